use std::fmt;

use crate::pattern::PatternBudget;

/// One problem in a policy, at a path such as `rules[2].route.select[0]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileError {
    pub path: String,
    pub message: String,
}

impl fmt::Display for CompileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Every problem found, in document order. Never empty.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct CompileErrors(pub Vec<CompileError>);

impl CompileErrors {
    /// The same errors with their paths under `prefix` (e.g. `spec`), as the
    /// operator reports them for an `InferencePolicy`.
    pub fn prefixed(mut self, prefix: &str) -> Self {
        for e in &mut self.0 {
            e.path = join(prefix, &e.path);
        }
        self
    }

    pub fn iter(&self) -> impl Iterator<Item = &CompileError> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for CompileErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

pub(crate) fn join(prefix: &str, path: &str) -> String {
    match (prefix.is_empty(), path.is_empty()) {
        (true, _) => path.to_string(),
        (false, true) => prefix.to_string(),
        (false, false) if path.starts_with('[') => format!("{prefix}{path}"),
        (false, false) => format!("{prefix}.{path}"),
    }
}

/// Collects errors while the compiler walks the whole policy, so users see
/// every mistake at once rather than one per attempt. It also carries what
/// the policy has spent of its pattern budget: the one piece of state every
/// compile step already threads through.
#[derive(Default)]
pub(crate) struct Errors(pub Vec<CompileError>, pub PatternBudget);

impl Errors {
    pub fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(CompileError {
            path: path.into(),
            message: message.into(),
        });
    }
}
