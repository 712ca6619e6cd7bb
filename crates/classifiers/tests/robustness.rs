//! Large inputs and arbitrary inputs: correct tags on a 220 KB prompt, and no
//! panics or undeclared tags on anything proptest can generate.

use std::time::Instant;

use kinference_classifiers::{BuiltinKind, classify, pii};
use proptest::prelude::*;

/// Realistic filler: varied sentences, some digits and punctuation, no PII.
fn prose(target_bytes: usize) -> String {
    const SENTENCES: &[&str] = &[
        "The quarterly report covers revenue, churn and hiring across 12 regions.",
        "In 2023 the team shipped version 4.2.1 and closed 318 tickets.",
        "Meeting notes: budget approved; next review on 2024-11-05 at 10:30.",
        "Über 40 % der Kunden nutzen die App täglich — Tendenz steigend.",
        "Customers in Tokyo (東京) asked for faster delivery and better packaging.",
        "Order #88231 was delayed because the warehouse in Lyon was closed.",
        "The function of the committee is to review proposals, not to fund them.",
    ];
    let mut out = String::with_capacity(target_bytes + 128);
    let mut i = 0;
    while out.len() < target_bytes {
        out.push_str(SENTENCES[i % SENTENCES.len()]);
        out.push(if i % 5 == 4 { '\n' } else { ' ' });
        i += 1;
    }
    out
}

fn timed(kind: BuiltinKind, prompt: &str) -> Vec<String> {
    kinference_classifiers::warm_up();
    let start = Instant::now();
    let tags = classify(kind, prompt);
    // Printed, not asserted: debug builds and shared CI machines are too noisy
    // for timing assertions. Use `--release -- --nocapture` to read them.
    println!(
        "{kind}: {} bytes in {:?} -> {tags:?}",
        prompt.len(),
        start.elapsed()
    );
    tags
}

#[test]
fn large_clean_prompt() {
    let prompt = prose(220 * 1024);
    assert!(prompt.len() >= 220 * 1024);
    assert_eq!(timed(BuiltinKind::Pii, &prompt), ["pii-none", "ssn-none"]);
    assert_eq!(timed(BuiltinKind::Code, &prompt), ["code-none"]);
    // Long documents are never "low": the model must at least read them.
    assert_ne!(timed(BuiltinKind::Complexity, &prompt), ["complexity-low"]);
}

#[test]
fn large_prompt_with_evidence_at_the_end() {
    let mut prompt = prose(110 * 1024);
    prompt.push_str("\n```python\ndef total(xs):\n    return sum(xs)\n```\n");
    prompt.push_str(&prose(110 * 1024));
    prompt.push_str("\nFinally, my SSN is 536-22-1984 and my email is r.okafor@fastmail.fm.");
    assert!(prompt.len() >= 220 * 1024);
    assert_eq!(
        timed(BuiltinKind::Pii, &prompt),
        ["pii-confirmed", "ssn-confirmed"]
    );
    assert_eq!(timed(BuiltinKind::Code, &prompt), ["code-confirmed"]);
    let _ = timed(BuiltinKind::Complexity, &prompt);
}

#[test]
fn large_adversarial_prompts() {
    // Shapes that stress the scanners: endless digits, separators, tokens,
    // keywords and dense evidence. Each must stay linear (a quadratic scan
    // here takes minutes in a debug build, so it shows up as a slow test).
    let cases = [
        "1".repeat(220 * 1024),
        "1-".repeat(110 * 1024),
        "4111 ".repeat(44 * 1024),
        "a@".repeat(110 * 1024),
        "A".repeat(220 * 1024),
        "{;".repeat(110 * 1024),
        "`".repeat(220 * 1024),
        "password=".repeat(24 * 1024),
        "key: ".repeat(44 * 1024),
        "é".repeat(110 * 1024),
        "call 555 1234567\n".repeat(13 * 1024),
        "SSN 536-22-1984\n".repeat(14 * 1024),
        "q8Zr2LmX9vBt4KpW7sYc1NdE5hJg3FaU ".repeat(6600),
        "let x = foo(bar);\n".repeat(12 * 1024),
        "explain compare design prove per each only ".repeat(5 * 1024),
    ];
    for prompt in &cases {
        for kind in BuiltinKind::ALL {
            let tags = timed(kind, prompt);
            assert!(!tags.is_empty());
        }
    }
}

#[test]
fn over_the_default_limit_is_unknown() {
    let prompt = prose(pii::DEFAULT_MAX_BYTES + 1);
    assert_eq!(
        classify(BuiltinKind::Pii, &prompt),
        ["pii-unknown", "ssn-unknown"]
    );
}

fn check_invariants(prompt: &str) {
    for kind in BuiltinKind::ALL {
        let tags = classify(kind, prompt);
        let expected_len = if kind == BuiltinKind::Pii { 2 } else { 1 };
        assert_eq!(tags.len(), expected_len, "{kind}: {tags:?}");
        for tag in &tags {
            assert!(
                kind.tags().contains(&tag.as_str()),
                "{kind} emitted undeclared {tag}"
            );
        }
        assert_eq!(tags, classify(kind, prompt), "{kind} is not deterministic");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn any_string(prompt in any::<String>()) {
        check_invariants(&prompt);
    }

    #[test]
    fn any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        check_invariants(&String::from_utf8_lossy(&bytes));
    }

    // An alphabet dense in the characters the detectors key on, so that
    // partial matches, boundaries and context windows get exercised.
    #[test]
    fn detector_alphabet(prompt in "[0-9 \\-+().@a-zA-Z_:=/#`{};\n\té✓]{0,300}") {
        check_invariants(&prompt);
    }

    #[test]
    fn near_misses(
        prefix in "[a-zA-Zé ]{0,12}",
        digits in proptest::collection::vec("[0-9]{1,6}", 1..7),
        sep in "[ .-]",
        suffix in "[a-zA-Z.✓ ]{0,12}",
    ) {
        let prompt = format!("{prefix}{}{suffix}", digits.join(&sep));
        check_invariants(&prompt);
    }

    #[test]
    fn pii_limit_is_respected(prompt in "[a-z0-9@. ]{1,64}", limit in 0usize..80) {
        let tags = pii::classify_pii_with_limit(&prompt, limit);
        if prompt.len() > limit || prompt.trim().is_empty() {
            prop_assert_eq!(tags, ["pii-unknown", "ssn-unknown"]);
        } else {
            prop_assert_ne!(&tags[0], "pii-unknown");
        }
    }

    #[test]
    fn blank_prompts(prompt in "[ \t\n\r]{0,40}") {
        prop_assert_eq!(classify(BuiltinKind::Pii, &prompt), ["pii-unknown", "ssn-unknown"]);
        prop_assert_eq!(classify(BuiltinKind::Code, &prompt), ["code-unknown"]);
        prop_assert_eq!(classify(BuiltinKind::Complexity, &prompt), ["complexity-low"]);
    }
}
