//! The policy compiler on arbitrary text, through the entry points the
//! product uses: `source::lint_text` (`kinference lint`),
//! `source::compile_text` (the EPP's policy file, `PolicyStore::load_text`)
//! and JSON → `PolicySpec` → `compile` (the operator's ConfigMap payload,
//! `PolicyStore::load_json`).
//!
//! Checks, beyond "never panics or hangs":
//! - `compile_text` and `lint_text` agree: a first document that compiles
//!   is one lint accepts, with the same rule count;
//! - every diagnostic's line is within the text;
//! - a compiled policy's hash is `policy_hash` of its source;
//! - a compiled policy evaluates (as `kinference explain` does) to a decision
//!   whose indices are in range, against a fixed request and candidates, with
//!   and without classifier tags.
#![no_main]

use std::sync::OnceLock;

use kinference_policy::eval::{
    Candidate, Decision, Request, Trace, evaluate_with, parse_candidates,
};
use kinference_policy::source::{compile_text, lint_text, parse_documents};
use kinference_policy::{CompiledPolicy, PolicySpec, compile, policy_hash};
use libfuzzer_sys::fuzz_target;
use rand::SeedableRng;
use rand::rngs::SmallRng;

const CANDIDATES: &str = include_str!("../../examples/explain/candidates.yaml");

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // YAML breaks lines at `\n`, `\r\n` and a lone `\r`. An error at the end
    // of the text may be placed one line further (yaml-rust2 puts `{` alone
    // at line 2).
    let lines = text.replace("\r\n", "\n").matches(['\n', '\r']).count() + 2;

    let report = lint_text("fuzz.yaml", text);
    let compiled = compile_text(text);
    match &compiled {
        Ok(policy) => {
            assert!(
                report
                    .accepted
                    .first()
                    .is_some_and(|(_, rules)| *rules == policy.rules.len()),
                "compile_text accepted what lint did not: {:?}",
                report.errors
            );
            check_compiled(policy);
        }
        Err(diagnostics) => {
            assert!(!diagnostics.is_empty(), "an error without diagnostics");
            for d in diagnostics {
                if let Some(line) = d.line {
                    assert!(line <= lines, "diagnostic line {line} past the end: {d}");
                }
            }
        }
    }

    // The operator hands the EPP the spec as JSON.
    if let Ok(spec) = serde_json::from_str::<PolicySpec>(text)
        && let Ok(policy) = compile(&spec)
    {
        check_compiled(&policy);
    }
});

fn check_compiled(policy: &CompiledPolicy) {
    assert_eq!(policy.hash, policy_hash(&policy.source), "unstable hash");
    let candidates = candidates();
    let request = Request {
        model: "qwen-2.5".into(),
        tenant: Some("alice".into()),
        path: "/v1/chat/completions".into(),
        api: Some("chat".into()),
        headers: [("x-tenant-id".to_string(), "alice".to_string())].into(),
        prompt_tokens: 1200,
        max_tokens: Some(256),
        ttft_slo: Some(0.5),
        ..Request::default()
    };
    let tagged = |c: usize| {
        policy.classifiers[c]
            .tags
            .iter()
            .take(1)
            .cloned()
            .collect::<Vec<_>>()
    };
    for with_tags in [false, true] {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut trace = Trace::default();
        let (decision, _tags) =
            evaluate_with(policy, &request, candidates, &mut rng, &mut trace, |c| {
                assert!(c < policy.classifiers.len(), "asked for classifier {c}");
                if with_tags { tagged(c) } else { Vec::new() }
            });
        match decision {
            Decision::Route(routed) => {
                assert!(routed.rule < policy.rules.len());
                assert!(routed.winner < candidates.len());
                assert_eq!(routed.ranked.first(), Some(&routed.winner));
                assert!(routed.ranked.iter().all(|&i| i < candidates.len()));
            }
            Decision::Reject(rejected) => {
                assert!(rejected.rule.is_none_or(|r| r < policy.rules.len()));
            }
        }
    }
}

/// The candidates of `examples/explain`, three local endpoints and a provider.
fn candidates() -> &'static [Candidate] {
    static CANDIDATES_PARSED: OnceLock<Vec<Candidate>> = OnceLock::new();
    CANDIDATES_PARSED.get_or_init(|| {
        let docs = parse_documents(CANDIDATES).expect("examples/explain/candidates.yaml parses");
        parse_candidates(docs[0].value.clone()).expect("the candidates deserialize")
    })
}
