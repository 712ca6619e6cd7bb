//! Built-in prompt classifiers for Kinference.
//!
//! Each classifier is a pure function of the prompt text: no I/O, no clock, no
//! randomness, so the same prompt always yields the same tags and the EPP can run
//! them inline within a request's budget. Tags follow the `[type]-[degree]`
//! convention of the policy language (`pii-confirmed`, `complexity-low`, ...).
//!
//! The EPP only needs [`BuiltinKind`] and [`classify`]; the per-kind modules
//! expose the detailed results (findings, scores, features) for tools and tests.

#![forbid(unsafe_code)]

pub mod code;
pub mod complexity;
pub mod pii;
mod text;

use std::fmt;

/// The classifiers that ship with Kinference (`type` in `spec.classifiers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BuiltinKind {
    Pii,
    Complexity,
    Code,
}

impl BuiltinKind {
    /// Every built-in kind, in a stable order.
    pub const ALL: [BuiltinKind; 3] =
        [BuiltinKind::Pii, BuiltinKind::Complexity, BuiltinKind::Code];

    /// Parses the `type` of a classifier declaration. Case-insensitive and
    /// tolerant of surrounding whitespace because it comes from hand-written YAML.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        Self::ALL
            .into_iter()
            .find(|kind| kind.name().eq_ignore_ascii_case(s))
    }

    /// The canonical type name, which is also the prefix of every tag it emits.
    pub fn name(&self) -> &'static str {
        match self {
            BuiltinKind::Pii => "pii",
            BuiltinKind::Complexity => "complexity",
            BuiltinKind::Code => "code",
        }
    }

    /// Every tag this classifier can ever emit, so policies that reference a tag
    /// no classifier produces can be rejected when they are compiled.
    pub fn tags(&self) -> &'static [&'static str] {
        match self {
            BuiltinKind::Pii => pii::TAGS,
            BuiltinKind::Complexity => complexity::TAGS,
            BuiltinKind::Code => code::TAGS,
        }
    }
}

impl fmt::Display for BuiltinKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Compiles every built-in pattern now. Patterns are otherwise compiled on
/// first use, which would add a few milliseconds to the first request that
/// needs each classifier; a server calls this once at startup.
pub fn warm_up() {
    pii::warm_up();
    complexity::warm_up();
    code::warm_up();
    // Run each classifier once so lazily built matcher state exists too.
    for kind in BuiltinKind::ALL {
        let _ = classify(
            kind,
            "warm up: call +44 20 7946 0958, ssn 536-22-1984, `x = 1`",
        );
    }
}

/// Runs one built-in classifier and returns the tags it emits.
///
/// The PII classifier uses [`pii::DEFAULT_MAX_BYTES`]; call
/// [`pii::classify_pii_with_limit`] to use another limit.
pub fn classify(kind: BuiltinKind, prompt: &str) -> Vec<String> {
    match kind {
        BuiltinKind::Pii => pii::classify_pii(prompt),
        BuiltinKind::Complexity => vec![complexity::classify_complexity(prompt).tag().to_owned()],
        BuiltinKind::Code => vec![code::classify_code(prompt).tag().to_owned()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_round_trips_names() {
        for kind in BuiltinKind::ALL {
            assert_eq!(BuiltinKind::parse(kind.name()), Some(kind));
            assert_eq!(kind.to_string(), kind.name());
        }
        assert_eq!(BuiltinKind::parse(" PII "), Some(BuiltinKind::Pii));
        assert_eq!(
            BuiltinKind::parse("Complexity"),
            Some(BuiltinKind::Complexity)
        );
        assert_eq!(BuiltinKind::parse("http"), None);
        assert_eq!(BuiltinKind::parse(""), None);
    }

    #[test]
    fn tags_are_prefixed_and_unique() {
        for kind in BuiltinKind::ALL {
            let tags = kind.tags();
            assert!(!tags.is_empty());
            for (i, tag) in tags.iter().enumerate() {
                assert!(!tags[..i].contains(tag), "duplicate tag {tag}");
                let (ty, degree) = tag.split_once('-').expect("tag is [type]-[degree]");
                assert!(!degree.is_empty() && !degree.contains('-'), "{tag}");
                if kind != BuiltinKind::Pii {
                    assert_eq!(ty, kind.name());
                } else {
                    assert!(ty == "pii" || ty == "ssn", "{tag}");
                }
            }
        }
    }

    #[test]
    fn classify_emits_only_declared_tags() {
        let prompts = [
            "",
            "   ",
            "hello",
            "My SSN is 123-45-6789",
            "```rust\nfn main() {}\n```",
            "Prove that there are infinitely many primes, step by step.",
        ];
        for kind in BuiltinKind::ALL {
            for prompt in prompts {
                let tags = classify(kind, prompt);
                assert!(!tags.is_empty(), "{kind} emitted nothing for {prompt:?}");
                for tag in &tags {
                    assert!(
                        kind.tags().contains(&tag.as_str()),
                        "{kind} emitted undeclared {tag}"
                    );
                }
            }
        }
    }

    #[test]
    fn warm_up_is_idempotent() {
        warm_up();
        warm_up();
    }

    #[test]
    fn pii_emits_one_pii_and_one_ssn_tag() {
        for prompt in ["", "x", "ssn 123-45-6789", "call me at +44 20 7946 0958"] {
            let tags = classify(BuiltinKind::Pii, prompt);
            assert_eq!(tags.len(), 2, "{tags:?}");
            assert!(tags[0].starts_with("pii-"));
            assert!(tags[1].starts_with("ssn-"));
        }
    }
}
