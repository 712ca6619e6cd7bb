//! Precision and recall of the built-in classifiers over hand-labelled corpora.
//!
//! Run with `cargo test -p kinference-classifiers --test corpus -- --nocapture`
//! to see the tables and the misclassified prompts.

use std::collections::BTreeMap;
use std::path::Path;

use kinference_classifiers::{BuiltinKind, classify, code, complexity, pii};

struct Example {
    line: usize,
    labels: Vec<String>,
    prompt: String,
}

/// Reads `tests/corpus/<name>.tsv`: tab-separated labels then the prompt, with
/// `\n`, `\t` and `\\` escapes in the prompt; `#` starts a comment line.
fn load(name: &str, label_columns: usize) -> Vec<Example> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus")
        .join(format!("{name}.tsv"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.starts_with('#') && !l.trim().is_empty())
        .map(|(i, l)| {
            let cols: Vec<&str> = l.splitn(label_columns + 1, '\t').collect();
            assert_eq!(
                cols.len(),
                label_columns + 1,
                "{}:{}: wrong column count",
                path.display(),
                i + 1
            );
            Example {
                line: i + 1,
                labels: cols[..label_columns]
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
                prompt: unescape(cols[label_columns]),
            }
        })
        .collect()
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('\\') => out.push('\\'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}

#[derive(Default, Clone, Copy)]
struct Counts {
    support: usize,
    predicted: usize,
    correct: usize,
}

impl Counts {
    /// Precision of a label the classifier never predicts is 0 when the label
    /// occurs, so "never say confirmed" cannot pass as perfectly precise.
    fn precision(&self) -> f64 {
        match (self.predicted, self.support) {
            (0, 0) => 1.0,
            (0, _) => 0.0,
            (p, _) => self.correct as f64 / p as f64,
        }
    }

    fn recall(&self) -> f64 {
        if self.support == 0 {
            1.0
        } else {
            self.correct as f64 / self.support as f64
        }
    }
}

/// Per-label counts for one column of labels.
fn evaluate(pairs: &[(String, String)]) -> BTreeMap<String, Counts> {
    let mut table: BTreeMap<String, Counts> = BTreeMap::new();
    for (expected, got) in pairs {
        table.entry(expected.clone()).or_default().support += 1;
        table.entry(got.clone()).or_default().predicted += 1;
        if expected == got {
            table.get_mut(expected).expect("inserted above").correct += 1;
        }
    }
    table
}

fn print_table(title: &str, table: &BTreeMap<String, Counts>) {
    println!("\n{title}");
    println!(
        "{:<20} {:>7} {:>9} {:>7} {:>9} {:>7}",
        "label", "support", "predicted", "correct", "precision", "recall"
    );
    for (label, c) in table {
        println!(
            "{:<20} {:>7} {:>9} {:>7} {:>9.3} {:>7.3}",
            label,
            c.support,
            c.predicted,
            c.correct,
            c.precision(),
            c.recall()
        );
    }
}

/// Minimum (precision, recall) per label; labels not listed use `default`.
struct Thresholds<'a> {
    specific: &'a [(&'a str, f64, f64)],
    default: (f64, f64),
}

impl Thresholds<'_> {
    fn for_label(&self, label: &str) -> (f64, f64) {
        self.specific
            .iter()
            .find(|(l, _, _)| *l == label)
            .map_or(self.default, |&(_, p, r)| (p, r))
    }

    /// Labels that miss their thresholds, as human-readable complaints.
    fn failures(&self, table: &BTreeMap<String, Counts>) -> Vec<String> {
        let mut failures = Vec::new();
        for (label, c) in table {
            let (min_p, min_r) = self.for_label(label);
            if c.support > 0 && c.precision() < min_p {
                failures.push(format!("{label}: precision {:.3} < {min_p}", c.precision()));
            }
            if c.support > 0 && c.recall() < min_r {
                failures.push(format!("{label}: recall {:.3} < {min_r}", c.recall()));
            }
            if c.support == 0 && c.predicted > 0 {
                failures.push(format!(
                    "{label}: predicted {} times but never expected",
                    c.predicted
                ));
            }
        }
        failures
    }
}

/// Runs one labelled column through `predict`, prints the table and the
/// misses, and returns the threshold failures.
fn run_column(
    title: &str,
    examples: &[Example],
    column: usize,
    predict: impl Fn(&str) -> String,
    thresholds: &Thresholds<'_>,
) -> Vec<String> {
    let mut pairs = Vec::new();
    for ex in examples {
        let got = predict(&ex.prompt);
        let expected = &ex.labels[column];
        if &got != expected {
            let shown: String = ex.prompt.chars().take(90).collect();
            println!(
                "  miss line {}: expected {expected}, got {got}: {shown:?}",
                ex.line
            );
        }
        pairs.push((expected.clone(), got));
    }
    let table = evaluate(&pairs);
    print_table(title, &table);
    thresholds.failures(&table)
}

fn assert_no_failures(failures: Vec<String>) {
    assert!(
        failures.is_empty(),
        "thresholds not met:\n{}",
        failures.join("\n")
    );
}

const PII_THRESHOLDS: Thresholds<'static> = Thresholds {
    specific: &[("pii-confirmed", 0.95, 0.9), ("ssn-confirmed", 0.95, 0.9)],
    default: (0.8, 0.8),
};

fn pii_column(prompt: &str, column: usize) -> String {
    classify(BuiltinKind::Pii, prompt)[column].clone()
}

#[test]
fn pii_corpus() {
    let examples = load("pii", 2);
    assert!(examples.len() >= 40, "corpus too small: {}", examples.len());
    let mut failures = run_column("pii", &examples, 0, |p| pii_column(p, 0), &PII_THRESHOLDS);
    failures.extend(run_column(
        "ssn",
        &examples,
        1,
        |p| pii_column(p, 1),
        &PII_THRESHOLDS,
    ));
    assert_no_failures(failures);
}

const COMPLEXITY_THRESHOLDS: Thresholds<'static> = Thresholds {
    specific: &[],
    default: (0.8, 0.8),
};

#[test]
fn complexity_corpus() {
    let examples = load("complexity", 1);
    assert!(examples.len() >= 40, "corpus too small: {}", examples.len());
    let failures = run_column(
        "complexity",
        &examples,
        0,
        |p| complexity::classify_complexity(p).tag().to_owned(),
        &COMPLEXITY_THRESHOLDS,
    );
    assert_no_failures(failures);
}

const CODE_THRESHOLDS: Thresholds<'static> = Thresholds {
    specific: &[("code-confirmed", 0.9, 0.9)],
    default: (0.8, 0.8),
};

#[test]
fn code_corpus() {
    let examples = load("code", 1);
    assert!(examples.len() >= 40, "corpus too small: {}", examples.len());
    let failures = run_column(
        "code",
        &examples,
        0,
        |p| code::classify_code(p).tag().to_owned(),
        &CODE_THRESHOLDS,
    );
    assert_no_failures(failures);
}

/// The thresholds must reject degenerate classifiers, otherwise the corpus
/// tests above would prove nothing.
#[test]
fn thresholds_reject_constant_classifiers() {
    let cases: [(&str, usize, &[&str], &Thresholds<'static>); 4] = [
        (
            "pii",
            2,
            &["pii-none", "pii-confirmed", "pii-suspected"],
            &PII_THRESHOLDS,
        ),
        ("pii", 2, &["ssn-none", "ssn-confirmed"], &PII_THRESHOLDS),
        (
            "complexity",
            1,
            &["complexity-low", "complexity-medium", "complexity-high"],
            &COMPLEXITY_THRESHOLDS,
        ),
        (
            "code",
            1,
            &["code-none", "code-confirmed", "code-unknown"],
            &CODE_THRESHOLDS,
        ),
    ];
    for (name, columns, constants, thresholds) in cases {
        let examples = load(name, columns);
        let column = usize::from(constants[0].starts_with("ssn-"));
        for constant in constants {
            let pairs: Vec<(String, String)> = examples
                .iter()
                .map(|ex| (ex.labels[column].clone(), (*constant).to_owned()))
                .collect();
            let failures = thresholds.failures(&evaluate(&pairs));
            assert!(
                !failures.is_empty(),
                "{name}: constant {constant} passes the thresholds"
            );
        }
    }
}

/// Every label in the corpora is a tag the classifier declares.
#[test]
fn corpus_labels_are_declared_tags() {
    for (name, columns, kind) in [
        ("pii", 2, BuiltinKind::Pii),
        ("complexity", 1, BuiltinKind::Complexity),
        ("code", 1, BuiltinKind::Code),
    ] {
        for ex in load(name, columns) {
            for label in &ex.labels {
                assert!(
                    kind.tags().contains(&label.as_str()),
                    "{name}:{}: unknown label {label}",
                    ex.line
                );
            }
        }
    }
}

/// The size limit is part of the PII contract but cannot live in a TSV.
#[test]
fn pii_unknown_over_limit() {
    let prompt = "My SSN is 536-22-1984";
    assert_eq!(
        pii::classify_pii_with_limit(prompt, 8),
        ["pii-unknown", "ssn-unknown"]
    );
    assert_eq!(
        pii::classify_pii_with_limit(prompt, 1024),
        ["pii-confirmed", "ssn-confirmed"]
    );
}
