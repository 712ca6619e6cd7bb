//! Regexes in predicates. A policy's patterns share one memory budget: a
//! small policy of large-repetition patterns (`\w{200}` a hundred times) would
//! otherwise compile to gigabytes in the operator, the linter and every EPP.

use std::fmt;

use regex_automata::meta;

/// Compiled pattern memory a whole policy may use.
pub const PATTERN_BUDGET_BYTES: usize = 16 << 20;
/// One pattern's limit, as the `regex` crate's default.
const PATTERN_LIMIT_BYTES: usize = 10 << 20;
/// Each pattern's lazy-DFA cache (one per searching thread), charged once.
/// Small: predicates see at most 1 KiB of text, and a pattern whose cache
/// would need more falls back to engines without one.
const LAZY_DFA_CACHE_BYTES: usize = 32 << 10;

/// A compiled regex and its source.
#[derive(Clone)]
pub struct Pattern {
    source: String,
    regex: meta::Regex,
}

impl Pattern {
    pub fn as_str(&self) -> &str {
        &self.source
    }

    pub fn is_match(&self, text: &str) -> bool {
        self.regex.is_match(text)
    }

    /// What this pattern is charged against the budget.
    pub fn cost(&self) -> usize {
        self.regex.memory_usage() + LAZY_DFA_CACHE_BYTES
    }
}

impl fmt::Debug for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Pattern").field(&self.source).finish()
    }
}

/// What is left of a policy's pattern budget.
#[derive(Debug)]
pub(crate) struct PatternBudget {
    left: usize,
    /// A pattern crossed the budget: the policy is refused with that one
    /// error, and later patterns are not compiled at all.
    spent: bool,
}

/// Why a pattern did not compile.
#[derive(Debug, PartialEq)]
pub(crate) enum PatternError {
    /// A message for the predicate's path.
    Invalid(String),
    /// An earlier pattern crossed the budget and was reported.
    BudgetSpent,
}

impl Default for PatternBudget {
    fn default() -> Self {
        PatternBudget {
            left: PATTERN_BUDGET_BYTES,
            spent: false,
        }
    }
}

impl PatternBudget {
    /// Compiles `source` and charges it, or says why not.
    pub fn compile(&mut self, source: &str) -> Result<Pattern, PatternError> {
        if self.spent {
            return Err(PatternError::BudgetSpent);
        }
        self.compile_within_budget(source)
            .map_err(PatternError::Invalid)
    }

    fn compile_within_budget(&mut self, source: &str) -> Result<Pattern, String> {
        let limit = self.left.min(PATTERN_LIMIT_BYTES);
        let config = meta::Config::new()
            .nfa_size_limit(Some(limit))
            .hybrid_cache_capacity(LAZY_DFA_CACHE_BYTES);
        let regex = meta::Regex::builder()
            .configure(config)
            .build(source)
            .map_err(|e| self.explain(source, &e))?;
        let pattern = Pattern {
            source: source.to_string(),
            regex,
        };
        let cost = pattern.cost();
        if cost > self.left {
            return Err(self.over_budget(source, Some(cost)));
        }
        self.left -= cost;
        Ok(pattern)
    }

    fn explain(&mut self, source: &str, e: &meta::BuildError) -> String {
        if e.size_limit().is_some() {
            return if self.left < PATTERN_LIMIT_BYTES {
                self.over_budget(source, None)
            } else {
                format!(
                    "regex {source:?} compiles to more than {} MiB; use a narrower pattern (e.g. [A-Za-z0-9_] instead of \\w, or fewer repetitions)",
                    PATTERN_LIMIT_BYTES >> 20
                )
            };
        }
        // The syntax error's last line is the short reason ("error: unclosed group").
        let detail = e
            .syntax_error()
            .map_or_else(|| e.to_string(), ToString::to_string);
        let detail = detail.lines().last().unwrap_or_default().trim();
        format!("invalid regex {source:?}: {detail}")
    }

    /// `needs`: the pattern's cost, when it compiled at all.
    fn over_budget(&mut self, source: &str, needs: Option<usize>) -> String {
        self.spent = true;
        let needs = match needs {
            Some(bytes) => format!("{} KiB, more", bytes.div_ceil(1024)),
            None => "more".to_string(),
        };
        format!(
            "regex {source:?} needs {needs} than the {} KiB left of the policy's {} MiB budget for compiled patterns; use fewer or narrower patterns (e.g. [A-Za-z0-9_] instead of \\w)",
            self.left >> 10,
            PATTERN_BUDGET_BYTES >> 20,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_as_the_regex_crate_does() {
        let mut budget = PatternBudget::default();
        let p = budget.compile(r"^team-[a-z]+$").unwrap();
        assert!(p.is_match("team-blue"));
        assert!(!p.is_match("team-Blue"));
        assert_eq!(p.as_str(), r"^team-[a-z]+$");
        let unicode = budget.compile(r"^\w+$").unwrap();
        assert!(unicode.is_match("été"));
    }

    #[test]
    fn every_pattern_is_charged_until_the_budget_is_spent() {
        let mut budget = PatternBudget::default();
        let mut compiled = 0;
        let error = loop {
            match budget.compile(r"\w{200}") {
                Ok(p) => {
                    assert!(p.cost() > 1 << 20, "{} bytes", p.cost());
                    compiled += 1;
                }
                Err(PatternError::Invalid(e)) => break e,
                Err(PatternError::BudgetSpent) => unreachable!("reported first"),
            }
        };
        assert!((1..16).contains(&compiled), "{compiled} patterns fit");
        assert!(error.contains("of the policy's 16 MiB budget"), "{error}");
        // Once reported, later patterns are neither compiled nor reported.
        assert_eq!(
            budget.compile("^a$").unwrap_err(),
            PatternError::BudgetSpent
        );
    }

    #[test]
    fn a_syntax_error_names_the_problem() {
        let Err(PatternError::Invalid(e)) = PatternBudget::default().compile("(unclosed") else {
            panic!("compiled");
        };
        assert!(e.starts_with("invalid regex \"(unclosed\":"), "{e}");
    }
}
