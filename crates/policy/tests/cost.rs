//! What a policy, or a request, can make evaluation cost: compiled patterns
//! share one budget, and predicates see a bounded prefix of each value.

use kinference_policy::eval::{
    Candidate, Decision, MAX_ATTRIBUTE_BYTES, NoTrace, Request, evaluate_with,
};
use kinference_policy::source::compile_text;
use rand::SeedableRng;
use rand::rngs::StdRng;

const POOL: &str = "pool: { selector: { app: vllm }, targetPorts: [{ number: 8000 }] }\n";

/// The review's policy: 11 KB, 100 rules of `tenant: {regex: '\w{200}'}`.
fn hundred_wide_regexes() -> String {
    let mut text = format!("{POOL}rules:\n");
    for i in 0..100 {
        text.push_str(&format!(
            "  - name: r{i}\n    matches: [{{ tenant: {{ regex: '\\w{{200}}' }} }}]\n    route: {{ select: [{{ minimize: QueueDepth }}] }}\n"
        ));
    }
    text.push_str("  - name: rest\n    route: { select: [{ minimize: QueueDepth }] }\n");
    text
}

#[test]
fn a_policy_over_the_pattern_budget_is_refused_at_the_rule_that_crosses_it() {
    let errors = compile_text(&hundred_wide_regexes()).unwrap_err();
    let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        messages.len(),
        1,
        "one error, not one per later rule: {messages:#?}"
    );
    insta::assert_snapshot!(messages[0]);
}

#[test]
fn narrow_patterns_fit_many_times_over() {
    let text = hundred_wide_regexes().replace(r"\w{200}", "^team-[a-z0-9]{1,32}$");
    compile_text(&text).expect("a hundred small patterns compile");
}

fn first_rule_matches(policy: &kinference_policy::CompiledPolicy, request: &Request) -> bool {
    let candidate = Candidate {
        model: "m".into(),
        endpoint: "a".into(),
        address: Some("10.0.0.1:8000".into()),
        ..Candidate::default()
    };
    let mut rng = StdRng::seed_from_u64(1);
    match evaluate_with(
        policy,
        request,
        &[candidate],
        &mut rng,
        &mut NoTrace,
        |_| vec![],
    )
    .0
    {
        Decision::Route(r) => r.rule == 0,
        Decision::Reject(r) => r.rule == Some(0),
    }
}

#[test]
fn predicates_see_a_bounded_prefix_of_each_request_value() {
    let policy = compile_text(&format!(
        "{POOL}rules:
  - name: ends-in-z
    matches: [{{ header.x-team: {{ regex: 'z$' }} }}]
    route: {{ select: [{{ minimize: QueueDepth }}] }}
  - name: rest
    route: {{ select: [{{ minimize: QueueDepth }}] }}
"
    ))
    .unwrap();
    let with_team = |value: String| Request {
        model: "m".into(),
        headers: [("x-team".to_string(), value)].into(),
        ..Request::default()
    };
    assert!(first_rule_matches(&policy, &with_team("blue-z".into())));
    // 60 KB ending in z: the predicate sees the first KiB, which does not.
    let long = format!("{}z", "a".repeat(60_000));
    assert!(!first_rule_matches(&policy, &with_team(long.clone())));
    // Exactly at the cap it still matches; one byte over, it does not.
    let at_cap = format!("{}z", "a".repeat(MAX_ATTRIBUTE_BYTES - 1));
    assert!(first_rule_matches(&policy, &with_team(at_cap)));
    let over = format!("{}z", "a".repeat(MAX_ATTRIBUTE_BYTES));
    assert!(!first_rule_matches(&policy, &with_team(over)));

    // A clamped copy evaluates the same and is small.
    let clamped = with_team(long).clamped();
    assert_eq!(clamped.headers["x-team"].len(), MAX_ATTRIBUTE_BYTES);
    assert!(!first_rule_matches(&policy, &clamped));
    // Multi-byte characters are never split.
    let accented = with_team("é".repeat(MAX_ATTRIBUTE_BYTES)).clamped();
    assert_eq!(accented.headers["x-team"].len(), MAX_ATTRIBUTE_BYTES);
}

/// `{"a":{"a":...}}` nested `depth` levels deep.
fn nested(depth: usize) -> String {
    format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth))
}

fn policy_json(matches_value: &str, drop_value: &str) -> String {
    format!(
        r#"{{"pool":{{"selector":{{"app":"vllm"}},"targetPorts":[{{"number":8000}}]}},
        "rules":[{{"name":"deep","matches":[{{"model":{matches_value}}}],
                  "route":{{"exclude":[{{"drop":{drop_value}}}],"select":[{{"minimize":"QueueDepth"}}]}}}},
                 {{"name":"rest","route":{{"select":[{{"minimize":"QueueDepth"}}]}}}}]}}"#
    )
}

#[test]
fn free_form_values_nested_thousands_deep_decode_and_are_refused_with_their_path() {
    // 3,000 levels: far past serde_json's own limit of 128, which would fail
    // the decoding of everything around the value.
    let text = policy_json(&nested(3000), &nested(3000));
    let spec: kinference_policy::PolicySpec =
        serde_json::from_str(&text).expect("decodes whatever the depth");
    let errors = kinference_policy::compile(&spec).unwrap_err();
    let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        messages,
        [
            "rules[0].matches[0].model: nested deeper than 16 levels; predicates need at most 3",
            "rules[0].route.exclude[0].drop: nested deeper than 16 levels; predicates need at most 3",
        ]
    );
}

#[test]
fn nesting_up_to_the_limit_reaches_the_compiler_as_json() {
    // 16 levels decode as JSON (and are then refused for what they are, not
    // for their depth); 17 do not.
    let at_limit = serde_json::from_str::<kinference_policy::PolicySpec>(&policy_json(
        &nested(16),
        r#"{"type":"Provider"}"#,
    ))
    .unwrap();
    let messages: Vec<String> = kinference_policy::compile(&at_limit)
        .unwrap_err()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert!(
        messages.iter().all(|m| !m.contains("nested deeper")),
        "{messages:#?}"
    );
    let over = serde_json::from_str::<kinference_policy::PolicySpec>(&policy_json(
        &nested(17),
        r#"{"type":"Provider"}"#,
    ))
    .unwrap();
    let messages: Vec<String> = kinference_policy::compile(&over)
        .unwrap_err()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert!(
        messages[0].contains("nested deeper than 16 levels"),
        "{messages:#?}"
    );
}

#[test]
fn brackets_inside_strings_do_not_count_as_nesting() {
    let quoted = format!("{{\"oneOf\":[\"{}\", \"\\\"[[\"]}}", "[".repeat(100));
    let spec: kinference_policy::PolicySpec =
        serde_json::from_str(&policy_json(&quoted, r#"{"type":"Provider"}"#)).unwrap();
    let errors = kinference_policy::compile(&spec).err();
    let messages: Vec<String> = errors
        .iter()
        .flat_map(|e| e.iter().map(ToString::to_string))
        .collect();
    assert!(
        messages.iter().all(|m| !m.contains("nested deeper")),
        "{messages:#?}"
    );
}
