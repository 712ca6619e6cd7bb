//! Lint warnings: each test writes the mistake, checks the warning's path
//! and text, and checks that the fixed policy is clean.

use kinference_policy::lint::{Warning, warnings};
use kinference_policy::source::compile_text;

const HEAD: &str = "pool: { selector: { app: vllm }, targetPorts: [{ number: 8000 }] }
providers:
  - name: openai
    baseURL: https://api.openai.com/v1
    models: [{ name: qwen-2.5, targetModel: gpt-4o-mini, price: { input: 0.15, cachedInput: 0.075, output: 0.6 } }]
classifiers:
  - { name: pii, type: pii, timeout: 20ms }
rules:
";

const LAST: &str = "  - name: rest
    route:
      consider: [{ backends: {} }]
      select: [{ minimize: RunningRequests }]
";

fn lint(rules: &str) -> Vec<Warning> {
    let text = format!("{HEAD}{rules}{LAST}");
    let policy = compile_text(&text).unwrap_or_else(|e| panic!("{e:#?}\n{text}"));
    warnings(&policy)
}

fn lines(ws: &[Warning]) -> Vec<String> {
    ws.iter().map(ToString::to_string).collect()
}

/// Uses the pii classifier, so only the warning under test shows.
const USES_PII: &str = "  - name: uses-pii
    matches: [{ tag: { containsNone: [pii-none] } }]
    route:
      consider: [{ backends: { type: Local } }]
      select: [{ minimize: RunningRequests }]
";

#[test]
fn a_clean_policy_has_no_warnings() {
    assert_eq!(lines(&lint(USES_PII)), Vec::<String>::new());
}

#[test]
fn a_rule_behind_a_broader_one_never_matches() {
    let rules = format!(
        "  - name: all-alice
    matches: [{{ tenant: [alice, bob] }}]
    route: {{ select: [{{ minimize: RunningRequests }}] }}
  - name: alice-long
    matches: [{{ tenant: alice, promptTokens: {{ greaterThan: 1000 }} }}]
    route: {{ select: [{{ minimize: RunningRequests }}] }}
{USES_PII}"
    );
    assert_eq!(
        lines(&lint(&rules)),
        [
            "rules[1].matches: rule \"alice-long\" can never match: every request it matches is taken by the earlier rule \"all-alice\" (fix: move it before \"all-alice\", narrow \"all-alice\"'s matches, or delete it)"
        ]
    );
    // An earlier rule that falls through when empty shadows nothing.
    let falls = rules.replace(
        "route: { select: [{ minimize: RunningRequests }] }\n  - name: alice-long",
        "route: { select: [{ minimize: RunningRequests }], onEmpty: FallThrough }\n  - name: alice-long",
    );
    assert_eq!(lines(&lint(&falls)), Vec::<String>::new());
    // Narrower comparisons are covered by broader ones, not the reverse.
    let ranges = format!(
        "  - name: long
    matches: [{{ promptTokens: {{ greaterThan: 1000 }} }}]
    route: {{ select: [{{ minimize: RunningRequests }}] }}
  - name: longer
    matches: [{{ promptTokens: {{ greaterThanOrEqual: 5000 }} }}]
    route: {{ select: [{{ minimize: RunningRequests }}] }}
  - name: shorter
    matches: [{{ promptTokens: {{ greaterThan: 500 }} }}]
    route: {{ select: [{{ minimize: RunningRequests }}] }}
{USES_PII}"
    );
    let ws = lint(&ranges);
    assert_eq!(ws.len(), 1, "{ws:#?}");
    assert_eq!(ws[0].path, "rules[1].matches");
}

#[test]
fn an_entry_covered_by_another_in_the_same_rule_adds_nothing() {
    let rules = format!(
        "  - name: models
    matches: [{{ model: [a, b] }}, {{ model: a, stream: true }}]
    route: {{ select: [{{ minimize: RunningRequests }}] }}
{USES_PII}"
    );
    assert_eq!(
        lines(&lint(&rules)),
        [
            "rules[0].matches[1]: this entry adds nothing: matches[0] already matches every request it does (fix: delete matches[1])"
        ]
    );
}

#[test]
fn listing_the_unsafe_tags_fails_open_when_the_classifier_times_out() {
    let rules = "  - name: pii-stays-local
    matches: [{ tag: [pii-confirmed, pii-unknown] }]
    route:
      consider: [{ backends: { type: Local } }]
      select: [{ minimize: RunningRequests }]
";
    let ws = lint(rules);
    assert_eq!(ws.len(), 1, "{ws:#?}");
    assert_eq!(ws[0].path, "rules[0].matches[0].tag");
    assert!(
        ws[0]
            .message
            .starts_with("fails open: when classifier \"pii\" times out"),
        "{}",
        ws[0].message
    );
    assert!(
        ws[0]
            .fix
            .starts_with("match what is safe instead: tag: { containsNone: ["),
        "{}",
        ws[0].fix
    );
    assert!(ws[0].fix.contains("pii-none"), "{}", ws[0].fix);
    // The same list on a rule that may itself use providers is a choice.
    let providers = rules.replace("type: Local", "type: Provider");
    assert!(
        lint(&providers)
            .iter()
            .all(|w| !w.message.starts_with("fails open"))
    );
}

#[test]
fn a_classifier_no_rule_reads_is_reported() {
    let ws = lint("");
    assert_eq!(
        lines(&ws),
        [
            "classifiers[0]: classifier \"pii\" is declared but no rule reads its tags (fix: delete it, or match on its tags)"
        ]
    );
}

#[test]
fn fall_through_on_the_last_rule_is_reported() {
    let text = format!(
        "{HEAD}{USES_PII}{}",
        LAST.replace(
            "select: [{ minimize: RunningRequests }]",
            "select: [{ minimize: RunningRequests }]\n      onEmpty: FallThrough"
        )
    );
    let ws = warnings(&compile_text(&text).unwrap());
    assert_eq!(ws.len(), 1, "{ws:#?}");
    assert_eq!(ws[0].path, "rules[1].route.onEmpty");
}

#[test]
fn an_order_naming_nothing_considered_is_always_empty() {
    let rules = format!(
        "  - name: providers-only
    matches: [{{ tenant: b }}]
    route:
      consider: [{{ backends: {{ type: Local }} }}]
      select: [{{ order: [openai] }}, {{ minimize: RunningRequests }}]
{USES_PII}"
    );
    let ws = lint(&rules);
    assert_eq!(
        lines(&ws),
        [
            "rules[0].route.select[0].order: order names no candidate this rule considers, so the tier is always empty (fix: name the considered providers or backends, best first)"
        ]
    );
    let fixed = rules.replace("type: Local", "type: Provider");
    assert_eq!(lines(&lint(&fixed)), Vec::<String>::new());
}

#[test]
fn minimizing_kv_cache_use_without_a_tie_break_sends_bursts_to_one_candidate() {
    let rules = format!(
        "  - name: kv
    matches: [{{ tenant: a }}]
    route:
      consider: [{{ backends: {{ type: Local }} }}]
      select: [{{ minimize: KVCacheUtilization }}]
{USES_PII}"
    );
    let ws = lint(&rules);
    assert_eq!(ws.len(), 1, "{ws:#?}");
    assert!(
        ws[0].fix.starts_with("add tieBreak: Random"),
        "{}",
        ws[0].fix
    );
    let fixed = rules.replace(
        "select: [{ minimize: KVCacheUtilization }]",
        "select: [{ minimize: KVCacheUtilization }]\n      tieBreak: Random",
    );
    assert_eq!(lines(&lint(&fixed)), Vec::<String>::new());
    // The EPP counts its own picks in QueueDepth between scrapes: no tie.
    let queue = rules.replace("KVCacheUtilization", "QueueDepth");
    assert_eq!(lines(&lint(&queue)), Vec::<String>::new());
}

#[test]
fn an_exclude_that_always_drops_everything_is_reported() {
    let rules = format!(
        "  - name: nothing-left
    matches: [{{ tenant: a }}]
    route:
      consider: [{{ backends: {{ type: Local }} }}]
      exclude: [{{ drop: {{ type: Local }} }}]
      select: [{{ minimize: RunningRequests }}]
{USES_PII}"
    );
    let ws = lint(&rules);
    assert_eq!(ws.len(), 1, "{ws:#?}");
    assert_eq!(ws[0].path, "rules[0].route.exclude[0]");
    // With a condition it is a deliberate rule.
    let guarded = rules.replace(
        "{ drop: { type: Local } }",
        "{ if: { tenant: x }, drop: { type: Local } }",
    );
    assert_eq!(lines(&lint(&guarded)), Vec::<String>::new());
}

#[test]
fn the_example_policies_lint_clean() {
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples")).unwrap()
    {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let policy = compile_text(&text).unwrap();
        assert_eq!(
            lines(&warnings(&policy)),
            Vec::<String>::new(),
            "{}",
            path.display()
        );
    }
}

#[test]
fn the_old_spelling_base_url_still_works_with_a_warning() {
    let old = format!("{}{USES_PII}{LAST}", HEAD.replace("baseURL:", "baseUrl:"));
    let policy = compile_text(&old).unwrap_or_else(|e| panic!("{e:#?}"));
    assert_eq!(policy.providers[0].base_url, "https://api.openai.com/v1");
    assert_eq!(
        lines(&warnings(&policy)),
        [
            "providers[0].baseUrl: baseUrl is deprecated and will not be read after v1alpha1 (fix: rename it to baseURL)"
        ]
    );

    let both = format!(
        "{}{USES_PII}{LAST}",
        HEAD.replace(
            "baseURL: https://api.openai.com/v1",
            "baseURL: https://api.openai.com/v1\n    baseUrl: https://api.openai.com/v1"
        )
    );
    let errors = format!("{:?}", compile_text(&both).expect_err("both spellings"));
    assert!(
        errors.contains("baseUrl is the deprecated spelling of baseURL: set only baseURL"),
        "{errors}"
    );
    let neither = format!(
        "{}{USES_PII}{LAST}",
        HEAD.replace("    baseURL: https://api.openai.com/v1\n", "")
    );
    let errors = format!("{:?}", compile_text(&neither).expect_err("no URL"));
    assert!(errors.contains("providers[0].baseURL"), "{errors}");
}

#[test]
fn a_rule_that_waits_without_excluding_full_pods_waits_only_for_ready_ones() {
    let waits = |exclude: &str| {
        format!(
            "  - name: waits
    matches: [{{ priority: {{ greaterThanOrEqual: 0 }} }}]
    route:
      {exclude}
      select: [{{ minimize: PredictedTTFT }}]
      onEmpty: Wait
{USES_PII}"
        )
    };
    assert_eq!(
        lines(&lint(&waits(""))),
        [
            "rules[0].route.onEmpty: the rule waits for room but excludes no candidate for its load, so a request waits only when no Pod is ready (fix: say when a Pod is full, e.g. exclude: [{ drop: { InFlight: { greaterThanOrEqual: 8 } } }])"
        ]
    );
    let fixed = waits("exclude: [{ drop: { InFlight: { greaterThanOrEqual: 8 } } }]");
    assert_eq!(lines(&lint(&fixed)), Vec::<String>::new());
}

#[test]
fn flow_control_bounds_without_a_rule_that_waits_apply_to_nothing() {
    let text = format!("flowControl: {{ maxRequests: 10 }}\n{HEAD}{USES_PII}{LAST}");
    let policy = compile_text(&text).unwrap();
    assert_eq!(
        lines(&warnings(&policy)),
        [
            "flowControl: no rule has onEmpty: Wait, so no request ever waits and these bounds apply to nothing (fix: add onEmpty: Wait to the rules whose requests may wait, or remove flowControl)"
        ]
    );
}
