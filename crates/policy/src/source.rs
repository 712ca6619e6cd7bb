//! Reading policies from YAML/JSON text, remembering where each path sits so
//! errors can name a line. Accepts a bare policy or an `InferencePolicy`
//! manifest (several documents may share one file).

use std::collections::HashMap;

use serde_json::{Map, Value as Json};
use yaml_rust2::Yaml;
use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

use crate::compile::{CompileError, compile};
use crate::model::CompiledPolicy;
use crate::spec::PolicySpec;

/// One YAML document as JSON, with the line of every path in it.
#[derive(Debug, Clone)]
pub struct Document {
    pub value: Json,
    lines: HashMap<String, usize>,
}

impl Document {
    /// The line of `path`, or of its nearest ancestor that has one.
    pub fn line_of(&self, path: &str) -> Option<usize> {
        let mut p = path;
        loop {
            if let Some(line) = self.lines.get(p) {
                return Some(*line);
            }
            let cut = p.rfind(['.', '['])?;
            p = &p[..cut];
        }
    }
}

/// A problem found while reading or compiling, placed in the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub line: Option<usize>,
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(line) = self.line {
            write!(f, "line {line}: ")?;
        }
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        f.write_str(&self.message)
    }
}

/// A policy read from a document: the bare policy, or the `spec` of an
/// `InferencePolicy` (then paths start with `spec`).
#[derive(Debug, Clone)]
pub struct PolicyDocument {
    pub name: Option<String>,
    pub prefix: &'static str,
    pub spec: PolicySpec,
}

/// Parses YAML (JSON is YAML) into documents.
pub fn parse_documents(text: &str) -> Result<Vec<Document>, Diagnostic> {
    let mut builder = Builder::default();
    let mut parser = Parser::new_from_str(text);
    parser.load(&mut builder, true).map_err(|e| Diagnostic {
        line: Some(e.marker().line()),
        path: String::new(),
        message: format!("invalid YAML: {}", e.info()),
    })?;
    match builder.problem {
        Some(problem) => Err(problem),
        None => Ok(builder.docs),
    }
}

/// Reads the policy out of one document.
/// Fields of an InferencePolicy's spec that configure how the operator
/// deploys the EPP and which existing pool it attaches to, not the policy
/// (see `kinference_api`): the policy's hash and its compiler never see them.
pub const DEPLOYMENT_FIELDS: &[&str] = &["endpointPicker", "targetRefs"];

/// The policy part of an InferencePolicy's spec.
fn policy_of_spec(spec: Option<&Json>) -> Json {
    let mut spec = spec.cloned().unwrap_or(Json::Null);
    if let Some(fields) = spec.as_object_mut() {
        for field in DEPLOYMENT_FIELDS {
            fields.remove(*field);
        }
    }
    spec
}

pub fn policy_document(doc: &Document) -> Result<PolicyDocument, Diagnostic> {
    let (prefix, name, body) = match doc.value.get("kind").and_then(Json::as_str) {
        Some("InferencePolicy") => (
            "spec",
            doc.value
                .pointer("/metadata/name")
                .and_then(Json::as_str)
                .map(str::to_string),
            policy_of_spec(doc.value.get("spec")),
        ),
        Some(other) => {
            return Err(Diagnostic {
                line: doc.line_of("kind"),
                path: "kind".into(),
                message: format!(
                    "expected an InferencePolicy or a bare policy, found kind {other}"
                ),
            });
        }
        None => ("", None, doc.value.clone()),
    };
    let spec = serde_path_to_error::deserialize::<_, PolicySpec>(body).map_err(|e| {
        let path = crate::compile::errors_join(prefix, &e.path().to_string().replace("?", ""));
        Diagnostic {
            line: doc.line_of(&path),
            path: if path == "." { String::new() } else { path },
            message: e.inner().to_string(),
        }
    })?;
    Ok(PolicyDocument { name, prefix, spec })
}

/// Compiles one document, placing every error on its line.
pub fn compile_document(
    doc: &Document,
) -> Result<(PolicyDocument, CompiledPolicy), Vec<Diagnostic>> {
    let policy = policy_document(doc).map_err(|d| vec![d])?;
    match compile(&policy.spec) {
        Ok(compiled) => Ok((policy, compiled)),
        Err(errors) => Err(errors
            .prefixed(policy.prefix)
            .0
            .into_iter()
            .map(|CompileError { path, message }| Diagnostic {
                line: doc.line_of(&path),
                path,
                message,
            })
            .collect()),
    }
}

/// Parses and compiles the first document of `text`: for callers that hold
/// exactly one policy (files mounted into the EPP, tests).
pub fn compile_text(text: &str) -> Result<CompiledPolicy, Vec<Diagnostic>> {
    let docs = parse_documents(text).map_err(|d| vec![d])?;
    let doc = docs.first().ok_or_else(|| {
        vec![Diagnostic {
            line: None,
            path: String::new(),
            message: "the document is empty".into(),
        }]
    })?;
    compile_document(doc).map(|(_, compiled)| compiled)
}

enum Frame {
    Map {
        map: Map<String, Json>,
        path: String,
        key: Option<String>,
    },
    Seq {
        items: Vec<Json>,
        path: String,
    },
}

#[derive(Default)]
struct Builder {
    docs: Vec<Document>,
    stack: Vec<Frame>,
    lines: HashMap<String, usize>,
    root: Option<Json>,
    /// The first thing YAML accepts but a policy must not: a value it would
    /// silently drop or misread.
    problem: Option<Diagnostic>,
}

impl Builder {
    /// Path of the value about to be placed in the current container.
    fn child_path(&self) -> String {
        match self.stack.last() {
            None => String::new(),
            Some(Frame::Map { path, key, .. }) => {
                crate::compile::errors_join(path, key.as_deref().unwrap_or_default())
            }
            Some(Frame::Seq { items, path }) => format!("{path}[{}]", items.len()),
        }
    }

    fn place(&mut self, value: Json) {
        match self.stack.last_mut() {
            None => self.root = Some(value),
            Some(Frame::Map { map, key, .. }) => {
                if let Some(k) = key.take() {
                    map.insert(k, value);
                }
            }
            Some(Frame::Seq { items, .. }) => items.push(value),
        }
    }

    fn expecting_key(&self) -> bool {
        matches!(self.stack.last(), Some(Frame::Map { key: None, .. }))
    }

    fn refuse(&mut self, line: usize, path: String, message: String) {
        self.problem.get_or_insert(Diagnostic {
            line: Some(line),
            path,
            message,
        });
    }

    /// A key the current map already has: YAML keeps the last value, so
    /// `{ tenant: alice, tenant: bob }` would match bob only.
    fn check_duplicate(&mut self, path: &str, key: &str, line: usize) {
        let Some(Frame::Map { map, .. }) = self.stack.last() else {
            return;
        };
        if map.contains_key(key) {
            let first = self.lines.get(path).copied().unwrap_or(line);
            self.refuse(
                line,
                path.to_string(),
                format!(
                    "duplicate key {key:?} (first on line {first}); YAML keeps only the last one: merge them into one"
                ),
            );
        }
    }
}

impl MarkedEventReceiver for Builder {
    fn on_event(&mut self, event: Event, mark: Marker) {
        match event {
            Event::Scalar(text, style, _, _) => {
                if self.expecting_key() {
                    let path = {
                        let Some(Frame::Map { path, .. }) = self.stack.last() else {
                            unreachable!()
                        };
                        crate::compile::errors_join(path, &text)
                    };
                    self.check_duplicate(&path, &text, mark.line());
                    self.lines.entry(path).or_insert(mark.line());
                    if let Some(Frame::Map { key, .. }) = self.stack.last_mut() {
                        *key = Some(text);
                    }
                    return;
                }
                let path = self.child_path();
                self.lines.entry(path).or_insert(mark.line());
                self.place(scalar(text, style));
            }
            Event::MappingStart(..) => {
                let path = self.child_path();
                self.lines.entry(path.clone()).or_insert(mark.line());
                self.stack.push(Frame::Map {
                    map: Map::new(),
                    path,
                    key: None,
                });
            }
            Event::SequenceStart(..) => {
                let path = self.child_path();
                self.lines.entry(path.clone()).or_insert(mark.line());
                self.stack.push(Frame::Seq {
                    items: Vec::new(),
                    path,
                });
            }
            Event::MappingEnd => {
                if let Some(Frame::Map { map, .. }) = self.stack.pop() {
                    self.place(Json::Object(map));
                }
            }
            Event::SequenceEnd => {
                if let Some(Frame::Seq { items, .. }) = self.stack.pop() {
                    self.place(Json::Array(items));
                }
            }
            // Anchors are not part of the policy language. An alias (and a
            // `<<: *base` merge) is refused rather than read as null.
            Event::Alias(_) => {
                let path = self.child_path();
                self.refuse(
                    mark.line(),
                    path,
                    "YAML aliases (*name) are not supported in policies: write the value out"
                        .into(),
                );
                self.place(Json::Null);
            }
            Event::DocumentEnd => {
                if let Some(value) = self.root.take() {
                    self.docs.push(Document {
                        value,
                        lines: std::mem::take(&mut self.lines),
                    });
                }
            }
            _ => {}
        }
    }
}

fn scalar(text: String, style: TScalarStyle) -> Json {
    if style != TScalarStyle::Plain {
        return Json::String(text);
    }
    match Yaml::from_str(&text) {
        Yaml::Integer(i) => Json::from(i),
        Yaml::Real(r) => r
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map_or(Json::String(text), Json::Number),
        Yaml::Boolean(b) => Json::Bool(b),
        Yaml::Null => Json::Null,
        _ => Json::String(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inference_policy_may_carry_epp_deployment_settings() {
        let policy = "pool: { selector: { app: x }, targetPorts: [{ number: 8000 }] }\nrules:\n  - name: r\n    route: { select: [{ minimize: QueueDepth }] }\n";
        let bare = crate::source::compile_text(policy).unwrap();
        let indented = policy.replace('\n', "\n  ");
        let wrapped = format!(
            "apiVersion: kinference.io/v1alpha1\nkind: InferencePolicy\nmetadata: {{ name: p }}\nspec:\n  endpointPicker: {{ networkPolicy: {{ enabled: false }} }}\n  targetRefs: [{{ group: inference.networking.k8s.io, kind: InferencePool, name: vllm }}]\n  {indented}"
        );
        let compiled = crate::source::compile_text(&wrapped).unwrap();
        assert_eq!(
            compiled.hash, bare.hash,
            "the settings are not part of the policy"
        );
        // In a bare policy the field is not known.
        let bare_with = format!("endpointPicker: {{}}\n{policy}");
        let errors = crate::source::compile_text(&bare_with).unwrap_err();
        assert!(
            errors[0].to_string().contains("endpointPicker"),
            "{errors:?}"
        );
    }

    #[test]
    fn a_duplicate_key_is_an_error_on_its_line() {
        let text = "rules:\n  - name: r\n    matches: [{ tenant: alice, tenant: bob }]\n";
        let err = parse_documents(text).unwrap_err();
        assert_eq!(
            err.to_string(),
            "line 3: rules[0].matches[0].tenant: duplicate key \"tenant\" (first on line 3); YAML keeps only the last one: merge them into one"
        );
        let two_routes = "rules:\n  - name: r\n    route: { select: [] }\n    route: {}\n";
        let err = parse_documents(two_routes).unwrap_err();
        assert_eq!(err.line, Some(4));
        assert_eq!(err.path, "rules[0].route");
        assert!(err.message.contains("first on line 3"), "{err}");
        // The same key in different maps is fine.
        parse_documents("a: { k: 1 }\nb: { k: 2 }\n").unwrap();
    }

    #[test]
    fn aliases_are_refused_not_read_as_null() {
        let text = "base: &b { minimize: QueueDepth }\nrules:\n  - select: [*b]\n";
        let err = parse_documents(text).unwrap_err();
        assert_eq!(
            err.to_string(),
            "line 3: rules[0].select[0]: YAML aliases (*name) are not supported in policies: write the value out"
        );
        let merge = "a: &x { k: 1 }\nb:\n  <<: *x\n";
        assert!(parse_documents(merge).is_err());
    }

    #[test]
    fn builds_json_and_remembers_lines() {
        let docs =
            parse_documents("a: 1\nb:\n  - x: true\n    y: '2'\n  - 1.5\nc: null\n").unwrap();
        assert_eq!(docs.len(), 1);
        let d = &docs[0];
        assert_eq!(
            d.value,
            serde_json::json!({"a": 1, "b": [{"x": true, "y": "2"}, 1.5], "c": null})
        );
        assert_eq!(d.line_of("a"), Some(1));
        assert_eq!(d.line_of("b[0].y"), Some(4));
        assert_eq!(d.line_of("b[1]"), Some(5));
        assert_eq!(d.line_of("b[0].y.nothing[3]"), Some(4));
    }

    #[test]
    fn reads_every_document() {
        let docs = parse_documents("a: 1\n---\nb: 2\n").unwrap();
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[1].line_of("b"), Some(3));
    }

    #[test]
    fn reports_yaml_syntax_errors_with_a_line() {
        let err = parse_documents("a: [1, 2\nb: 3\n").unwrap_err();
        assert!(err.line.is_some());
        assert!(err.message.starts_with("invalid YAML"));
    }
}

/// What `kinference lint` reports for one file.
#[derive(Debug, Default)]
pub struct LintReport {
    /// `(document name, rule count)` of every policy that compiled.
    pub accepted: Vec<(String, usize)>,
    /// `file:line: path: message` lines.
    pub errors: Vec<String>,
    /// `file:line: path: warning: message (fix: ...)` lines.
    pub warnings: Vec<String>,
}

/// Lints every document in `text`, naming errors after `file`.
pub fn lint_text(file: &str, text: &str) -> LintReport {
    let mut report = LintReport::default();
    let docs = match parse_documents(text) {
        Ok(docs) => docs,
        Err(d) => {
            report.errors.push(located(file, &d));
            return report;
        }
    };
    if docs.is_empty() {
        report
            .errors
            .push(format!("{file}: no policy found (the file is empty)"));
    }
    for (i, doc) in docs.iter().enumerate() {
        match compile_document(doc) {
            Ok((policy, compiled)) => {
                for w in crate::lint::warnings(&compiled) {
                    let path = crate::compile::errors_join(policy.prefix, &w.path);
                    let d = Diagnostic {
                        line: doc.line_of(&path),
                        path,
                        message: format!("warning: {} (fix: {})", w.message, w.fix),
                    };
                    report.warnings.push(located(file, &d));
                }
                let name = policy.name.unwrap_or_else(|| format!("document {}", i + 1));
                report.accepted.push((name, compiled.rules.len()));
            }
            Err(diagnostics) => report
                .errors
                .extend(diagnostics.iter().map(|d| located(file, d))),
        }
    }
    report
}

fn located(file: &str, d: &Diagnostic) -> String {
    let at = match d.line {
        Some(line) => format!("{file}:{line}"),
        None => file.to_string(),
    };
    if d.path.is_empty() {
        format!("{at}: {}", d.message)
    } else {
        format!("{at}: {}: {}", d.path, d.message)
    }
}
