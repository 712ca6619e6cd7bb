//! Property tests: no policy panics the compiler, no input panics the evaluator.

use kinference_policy::attr::CandidateType;
use kinference_policy::eval::{Candidate, Decision, Metrics, NoTrace, Request, evaluate_with};
use kinference_policy::source::{compile_text, lint_text};
use kinference_policy::{PolicySpec, compile};
use proptest::prelude::*;
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::{Value as Json, json};

const WORDS: &[&str] = &[
    "pool",
    "selector",
    "targetPorts",
    "number",
    "rules",
    "name",
    "matches",
    "route",
    "consider",
    "exclude",
    "select",
    "models",
    "names",
    "backends",
    "type",
    "if",
    "drop",
    "minimize",
    "maximize",
    "order",
    "within",
    "tieBreak",
    "onEmpty",
    "reject",
    "status",
    "message",
    "providers",
    "baseURL",
    "classifiers",
    "timeout",
    "tag",
    "model",
    "tenant",
    "promptTokens",
    "ttftSLO",
    "QueueDepth",
    "PredictedTTFT",
    "Cost",
    "greaterThan",
    "lessThan",
    "notIn",
    "regex",
    "prefix",
    "exists",
    "containsAll",
    "request",
    "Local",
    "Provider",
    "Any",
    "pii-confirmed",
    "complexity-low",
    "PreferLocal",
    "FallThrough",
    "10%",
    "50ms",
    "(",
    "",
];

fn word() -> impl Strategy<Value = String> {
    proptest::sample::select(WORDS).prop_map(str::to_string)
}

fn json_value() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        any::<i32>().prop_map(|n| json!(n)),
        (-1e6f64..1e6).prop_map(|f| json!(f)),
        word().prop_map(Json::String),
    ];
    leaf.prop_recursive(5, 64, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Json::Array),
            proptest::collection::btree_map(word(), inner, 0..5)
                .prop_map(|m| Json::Object(m.into_iter().collect())),
        ]
    })
}

/// Mostly well-formed policies with random pieces, so the compiler's deep
/// paths get exercised, not just serde's rejections.
fn policy_value() -> impl Strategy<Value = Json> {
    (json_value(), json_value(), json_value(), json_value(), json_value()).prop_map(
        |(matches, consider, exclude, select, extra)| {
            json!({
                "pool": { "selector": { "app": "x" }, "targetPorts": [{ "number": 8000 }] },
                "classifiers": [{ "name": "pii", "type": "pii" }],
                "providers": [{ "name": "p", "baseURL": "https://p.test", "models": [{ "name": "m" }] }],
                "rules": [
                    { "name": "a", "matches": [matches], "route": { "consider": consider, "exclude": exclude, "select": select } },
                    { "name": "b", "route": extra },
                ]
            })
        },
    )
}

fn metric() -> impl Strategy<Value = Option<f64>> {
    prop_oneof![
        Just(None),
        Just(Some(f64::NAN)),
        Just(Some(f64::INFINITY)),
        (-10.0f64..1e4).prop_map(Some),
    ]
}

fn candidate() -> impl Strategy<Value = Candidate> {
    (
        any::<bool>(),
        proptest::sample::select(&["m", "n", "qwen-2.5"][..]),
        proptest::collection::vec(metric(), 12),
        proptest::option::of(proptest::sample::select(&["p", "gold", "vllm"][..])),
    )
        .prop_map(|(local, model, m, name)| Candidate {
            kind: if local {
                CandidateType::Local
            } else {
                CandidateType::Provider
            },
            model: model.into(),
            endpoint: "e".into(),
            backend_name: name.map(str::to_string),
            provider_name: name.map(str::to_string),
            metrics: Metrics {
                queue_depth: m[0],
                running_requests: m[1],
                kv_cache_utilization: m[2],
                cached_prefix_tokens: m[3],
                predicted_ttft: m[4],
                observed_ttft: m[5],
                error_rate: m[6],
                cost: m[7],
                context_window: m[8],
                lora_loaded: m[9],
                lora_slots_free: m[10],
                in_flight: m[11],
            },
            ..Candidate::default()
        })
}

fn example_policies() -> Vec<kinference_policy::CompiledPolicy> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            out.push(compile_text(&std::fs::read_to_string(path).unwrap()).unwrap());
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn compiler_never_panics(value in policy_value()) {
        if let Ok(spec) = serde_json::from_value::<PolicySpec>(value)
            && let Err(errors) = compile(&spec)
        {
            prop_assert!(!errors.is_empty());
            prop_assert!(errors.iter().all(|e| !e.message.is_empty()));
        }
    }

    #[test]
    fn lint_never_panics_on_text(text in "[ -~\n]{0,200}") {
        let _ = lint_text("fuzz.yaml", &text);
    }

    #[test]
    fn evaluator_never_panics(
        candidates in proptest::collection::vec(candidate(), 0..12),
        model in proptest::sample::select(&["m", "qwen-2.5", ""][..]),
        prompt_tokens in any::<u64>(),
        tags in proptest::collection::vec(proptest::sample::select(&["pii-confirmed", "complexity-low", "code-none"][..]), 0..3),
        seed in any::<u64>(),
    ) {
        let request = Request { model: model.into(), prompt_tokens, ..Request::default() };
        for policy in example_policies() {
            let mut rng = StdRng::seed_from_u64(seed);
            let (decision, _) = evaluate_with(&policy, &request, &candidates, &mut rng, &mut NoTrace, |c| {
                tags.iter().filter(|t| policy.classifiers[c].tags.iter().any(|o| o == *t)).map(|t| t.to_string()).collect()
            });
            if let Decision::Route(r) = decision {
                prop_assert!(r.winner < candidates.len());
                prop_assert_eq!(r.ranked[0], r.winner);
                prop_assert!(r.ranked.iter().all(|&i| i < candidates.len()));
            }
        }
    }
}
