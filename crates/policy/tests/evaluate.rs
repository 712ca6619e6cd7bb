//! Evaluation semantics, phase by phase, including every rule the seed states.

use kinference_policy::CompiledPolicy;
use kinference_policy::attr::CandidateType;
use kinference_policy::eval::{
    Candidate, Decision, Metrics, NoTrace, PrefixSource, Request, Tags, Trace, evaluate,
    evaluate_with,
};
use kinference_policy::source::compile_text;
use rand::SeedableRng;
use rand::rngs::StdRng;

const POOL: &str = "pool: { selector: { app: vllm }, targetPorts: [{ number: 8000 }] }\n";

fn policy(yaml: &str) -> CompiledPolicy {
    let text = format!("{POOL}{yaml}");
    compile_text(&text).unwrap_or_else(|e| panic!("policy does not compile: {e:?}\n{text}"))
}

fn local(name: &str, model: &str) -> Candidate {
    Candidate {
        kind: CandidateType::Local,
        model: model.into(),
        endpoint: name.into(),
        address: Some(format!("10.0.0.{}:8000", name.len())),
        backend_name: Some("vllm".into()),
        ..Candidate::default()
    }
}

fn provider(name: &str, model: &str) -> Candidate {
    Candidate {
        kind: CandidateType::Provider,
        model: model.into(),
        endpoint: name.into(),
        provider_name: Some(name.into()),
        ..Candidate::default()
    }
}

fn with(mut c: Candidate, f: impl FnOnce(&mut Metrics)) -> Candidate {
    f(&mut c.metrics);
    c
}

fn request(model: &str) -> Request {
    Request {
        model: model.into(),
        path: "/v1/chat/completions".into(),
        api: Some("chat".into()),
        prompt_tokens: 100,
        ..Request::default()
    }
}

/// Runs the policy; classifiers emit those of `tags` they own.
fn decide(policy: &CompiledPolicy, req: &Request, tags: &[&str], cands: &[Candidate]) -> Decision {
    let mut rng = StdRng::seed_from_u64(7);
    evaluate_with(policy, req, cands, &mut rng, &mut NoTrace, |c| {
        let owned = &policy.classifiers[c].tags;
        tags.iter()
            .filter(|t| owned.iter().any(|o| o == *t))
            .map(|t| t.to_string())
            .collect()
    })
    .0
}

/// The endpoint chosen, or `reject <status>`.
fn outcome(policy: &CompiledPolicy, req: &Request, tags: &[&str], cands: &[Candidate]) -> String {
    match decide(policy, req, tags, cands) {
        Decision::Route(r) => cands[r.winner].endpoint.clone(),
        Decision::Reject(r) => format!("reject {}", r.status),
    }
}

fn rule_name(policy: &CompiledPolicy, d: &Decision) -> Option<String> {
    match d {
        Decision::Route(r) => Some(policy.rules[r.rule].name.clone()),
        Decision::Reject(r) => r.rule.map(|i| policy.rules[i].name.clone()),
    }
}

/// A two-rule policy: `hit` if the request matches `matches`, else `miss`.
fn matcher(matches: &str) -> CompiledPolicy {
    policy(&format!(
        "classifiers: [{{ name: pii, type: pii }}]\nrules:\n  - name: hit\n    matches:\n      - {matches}\n    route: {{ select: [{{ minimize: QueueDepth }}] }}\n  - name: miss\n    route: {{ select: [{{ minimize: QueueDepth }}] }}\n"
    ))
}

fn matched(matches: &str, req: &Request, tags: &[&str]) -> bool {
    let p = matcher(matches);
    let cands = [with(local("a", &req.model), |m| m.queue_depth = Some(1.0))];
    let d = decide(&p, req, tags, &cands);
    rule_name(&p, &d).as_deref() == Some("hit")
}

#[test]
fn request_predicates_every_operator() {
    let mut req = request("qwen-2.5");
    req.tenant = Some("alice".into());
    req.max_tokens = Some(256);
    req.ttft_slo = Some(0.3);
    req.headers.insert("x-team".into(), "search".into());
    let cases: &[(&str, bool)] = &[
        ("{ model: qwen-2.5 }", true),
        ("{ model: gemma-4 }", false),
        ("{ tenant: [bob, alice] }", true),
        ("{ tenant: [bob, carol] }", false),
        ("{ tenant: { notIn: [bob] } }", true),
        ("{ tenant: { notIn: [alice] } }", false),
        ("{ tenant: { notEquals: bob } }", true),
        ("{ promptTokens: { greaterThan: 99 } }", true),
        ("{ promptTokens: { greaterThan: 100 } }", false),
        ("{ promptTokens: { greaterThanOrEqual: 100 } }", true),
        ("{ promptTokens: { lessThan: 100 } }", false),
        ("{ promptTokens: { lessThanOrEqual: 100 } }", true),
        ("{ maxTokens: 256 }", true),
        ("{ ttftSLO: { lessThan: 500ms } }", true),
        ("{ ttftSLO: { greaterThan: 1s } }", false),
        ("{ path: { prefix: /v1/chat } }", true),
        (
            "{ path: { regex: \"^/v1/(completions|embeddings)$\" } }",
            false,
        ),
        ("{ api: chat }", true),
        ("{ stream: false }", true),
        ("{ header.x-team: search }", true),
        ("{ header.X-Team: search }", true),
        ("{ lora: { exists: false } }", true),
        ("{ lora: { exists: true } }", false),
        ("{ tenant: { exists: true } }", true),
        ("{ model: qwen-2.5, tenant: alice }", true),
        ("{ model: qwen-2.5, tenant: bob }", false),
    ];
    for (matches, expected) in cases {
        assert_eq!(matched(matches, &req, &[]), *expected, "matches: {matches}");
    }
}

#[test]
fn absent_attributes_fail_every_predicate_but_exists_false() {
    let req = request("qwen-2.5"); // no tenant, no lora, no SLO, no header
    for m in [
        "{ tenant: { notEquals: alice } }",
        "{ tenant: { notIn: [alice] } }",
        "{ tenant: { prefix: a } }",
        "{ ttftSLO: { lessThan: 10s } }",
        "{ header.x-team: { notEquals: search } }",
        "{ lora: { regex: \".*\" } }",
    ] {
        assert!(
            !matched(m, &req, &[]),
            "{m} must be false when the attribute is absent"
        );
    }
    assert!(matched("{ tenant: { exists: false } }", &req, &[]));
}

#[test]
fn matches_entries_are_ored_and_predicates_anded() {
    // The seed's example: alice's requests for qwen-2.5, or any request from bob.
    let p = policy(
        "rules:\n  - name: premium\n    matches:\n      - { model: qwen-2.5, tenant: alice }\n      - tenant: bob\n    route: { select: [{ minimize: QueueDepth }] }\n  - name: rest\n    route: { select: [{ minimize: QueueDepth }] }\n",
    );
    let cases = [
        ("qwen-2.5", "alice", "premium"),
        ("gemma-4", "alice", "rest"),
        ("gemma-4", "bob", "premium"),
    ];
    for (model, tenant, expected) in cases {
        let mut req = request(model);
        req.tenant = Some(tenant.into());
        let cands = [with(local("a", model), |m| m.queue_depth = Some(0.0))];
        let d = decide(&p, &req, &[], &cands);
        assert_eq!(
            rule_name(&p, &d).as_deref(),
            Some(expected),
            "{model} {tenant}"
        );
    }
}

#[test]
fn tag_predicates_and_set_operators() {
    let req = request("qwen-2.5");
    assert!(matched(
        "{ tag: [pii-confirmed, pii-unknown] }",
        &req,
        &["pii-unknown"]
    ));
    assert!(!matched(
        "{ tag: [pii-confirmed, pii-unknown] }",
        &req,
        &["pii-none"]
    ));
    assert!(matched(
        "{ tag: { containsAll: [pii-confirmed, ssn-confirmed] } }",
        &req,
        &["pii-confirmed", "ssn-confirmed"]
    ));
    assert!(!matched(
        "{ tag: { containsAll: [pii-confirmed, ssn-confirmed] } }",
        &req,
        &["pii-confirmed"]
    ));
    assert!(matched(
        "{ tag: { containsNone: [pii-confirmed] } }",
        &req,
        &["pii-none"]
    ));
    assert!(!matched(
        "{ tag: { containsNone: [pii-confirmed] } }",
        &req,
        &["pii-confirmed"]
    ));
    // A classifier that timed out emits no tags: only a policy that matches
    // on the absence of pii-none stays restrictive.
    assert!(!matched("{ tag: pii-confirmed }", &req, &[]));
    assert!(matched("{ tag: { containsNone: [pii-none] } }", &req, &[]));
}

#[test]
fn candidate_predicates_absent_attribute_is_never_a_match() {
    // "a candidate with no backend.name is not considered a candidate whose
    // backend.name is not X"
    let p = policy(
        "rules:\n  - name: r\n    route:\n      exclude:\n        - drop: { backend.name: { notEquals: premium } }\n      select: [{ minimize: QueueDepth }]\n",
    );
    let mut nameless = with(local("nameless", "m"), |m| m.queue_depth = Some(5.0));
    nameless.backend_name = None;
    let shared = with(local("shared", "m"), |m| m.queue_depth = Some(1.0));
    assert_eq!(
        outcome(&p, &request("m"), &[], &[shared, nameless]),
        "nameless"
    );
}

#[test]
fn candidate_compared_with_request_attribute() {
    let p = policy(
        "rules:\n  - name: r\n    route:\n      consider: [{ backends: {} }]\n      exclude:\n        - drop: { contextWindow: { lessThan: { request: promptTokens } } }\n      select: [{ type: Any, minimize: Cost }]\n",
    );
    let small = with(local("small", "m"), |m| {
        m.context_window = Some(4096.0);
        m.cost = Some(0.0);
    });
    let big = with(provider("big", "m"), |m| {
        m.context_window = Some(128_000.0);
        m.cost = Some(0.01);
    });
    let mut req = request("m");
    req.prompt_tokens = 1000;
    assert_eq!(
        outcome(&p, &req, &[], &[small.clone(), big.clone()]),
        "small"
    );
    req.prompt_tokens = 20_000;
    assert_eq!(outcome(&p, &req, &[], &[small, big]), "big");
}

#[test]
fn consider_defaults_to_local_endpoints_of_the_requested_model() {
    let p = policy("rules:\n  - name: r\n    route: { select: [{ minimize: QueueDepth }] }\n");
    let cands = [
        with(local("other-model", "gemma-4"), |m| {
            m.queue_depth = Some(0.0)
        }),
        with(provider("openai", "qwen-2.5"), |m| m.cost = Some(0.0)),
        with(local("right", "qwen-2.5"), |m| m.queue_depth = Some(9.0)),
    ];
    assert_eq!(outcome(&p, &request("qwen-2.5"), &[], &cands), "right");
}

#[test]
fn consider_models_names_and_backends_block() {
    let p = policy(
        "providers: [{ name: openai, baseURL: https://api.openai.com/v1, models: [{ name: qwen-2.5 }] }]\nrules:\n  - name: r\n    route:\n      consider:\n        - models: { names: [gemma-4] }\n        - backends: { type: Provider, names: [openai] }\n      select: [{ type: Any, minimize: RunningRequests }]\n",
    );
    let cands = [
        with(local("qwen-local", "qwen-2.5"), |m| {
            m.running_requests = Some(0.0)
        }),
        with(local("gemma", "gemma-4"), |m| {
            m.running_requests = Some(3.0)
        }),
        with(provider("openai", "qwen-2.5"), |m| {
            m.running_requests = Some(1.0)
        }),
    ];
    // qwen-local is neither a gemma-4 endpoint nor a named provider.
    assert_eq!(outcome(&p, &request("qwen-2.5"), &[], &cands), "openai");
    // `backends: {}` means every destination.
    let every = policy(
        "providers: [{ name: openai, baseURL: https://api.openai.com/v1, models: [{ name: qwen-2.5 }] }]\nrules:\n  - name: r\n    route:\n      consider: [{ backends: {} }]\n      select: [{ type: Any, minimize: RunningRequests }]\n",
    );
    let mut req = request("qwen-2.5");
    req.prompt_tokens = 1;
    let cands = [
        with(local("qwen-local", "qwen-2.5"), |m| {
            m.running_requests = Some(4.0)
        }),
        with(provider("openai", "qwen-2.5"), |m| {
            m.running_requests = Some(1.0)
        }),
    ];
    assert_eq!(outcome(&every, &req, &[], &cands), "openai");
}

#[test]
fn exclude_if_applies_only_when_the_request_matches() {
    let p = policy(
        "rules:\n  - name: r\n    route:\n      exclude:\n        - if: { ttftSLO: { lessThan: 1s } }\n          drop: { PredictedTTFT: { greaterThan: 200ms } }\n      select: [{ minimize: QueueDepth }]\n",
    );
    let slow_idle = with(local("slow-idle", "m"), |m| {
        m.queue_depth = Some(0.0);
        m.predicted_ttft = Some(0.5);
    });
    let fast_busy = with(local("fast-busy", "m"), |m| {
        m.queue_depth = Some(4.0);
        m.predicted_ttft = Some(0.1);
    });
    let cands = [slow_idle, fast_busy];
    assert_eq!(outcome(&p, &request("m"), &[], &cands), "slow-idle");
    let mut slo = request("m");
    slo.ttft_slo = Some(0.5);
    assert_eq!(outcome(&p, &slo, &[], &cands), "fast-busy");
}

#[test]
fn first_tier_with_a_surviving_candidate_wins() {
    let p = policy(
        "providers: [{ name: openai, baseURL: https://x.test, models: [{ name: m }] }, { name: azure, baseURL: https://y.test, models: [{ name: m }] }]\nrules:\n  - name: r\n    route:\n      consider: [{ backends: {} }]\n      exclude: [{ drop: { QueueDepth: { greaterThan: 5 } } }]\n      select:\n        - { type: Local, minimize: QueueDepth }\n        - { type: Provider, order: [azure, openai] }\n",
    );
    let busy = with(local("busy", "m"), |m| m.queue_depth = Some(9.0));
    let idle = with(local("idle", "m"), |m| m.queue_depth = Some(1.0));
    let providers = [provider("openai", "m"), provider("azure", "m")];
    let all: Vec<_> = [busy.clone(), idle]
        .into_iter()
        .chain(providers.clone())
        .collect();
    assert_eq!(outcome(&p, &request("m"), &[], &all), "idle");
    let saturated: Vec<_> = [busy].into_iter().chain(providers).collect();
    assert_eq!(outcome(&p, &request("m"), &[], &saturated), "azure");
    // The fallback list is the winning tier's rank order.
    match decide(&p, &request("m"), &[], &saturated) {
        Decision::Route(r) => {
            let names: Vec<_> = r
                .ranked
                .iter()
                .map(|&i| saturated[i].endpoint.as_str())
                .collect();
            assert_eq!(names, ["azure", "openai"]);
        }
        other => panic!("expected a route, got {other:?}"),
    }
}

#[test]
fn minimize_drops_candidates_without_the_objective() {
    // Stale metrics mean no PredictedTTFT: that endpoint leaves the tier even
    // though it would otherwise look best.
    let p = policy(
        "rules:\n  - name: r\n    route: { select: [{ minimize: PredictedTTFT }, { minimize: QueueDepth }] }\n",
    );
    let stale = local("stale", "m");
    let known = with(local("known", "m"), |m| m.predicted_ttft = Some(2.0));
    assert_eq!(
        outcome(&p, &request("m"), &[], &[stale.clone(), known]),
        "known"
    );
    // No one has the objective: the next tier decides; none there either: reject.
    assert_eq!(outcome(&p, &request("m"), &[], &[stale]), "reject 503");
}

#[test]
fn maximize_and_order_rank() {
    let p =
        policy("rules:\n  - name: r\n    route: { select: [{ maximize: CachedPrefixTokens }] }\n");
    let cands = [
        with(local("cold", "m"), |m| m.cached_prefix_tokens = Some(0.0)),
        with(local("warm", "m"), |m| m.cached_prefix_tokens = Some(900.0)),
    ];
    assert_eq!(outcome(&p, &request("m"), &[], &cands), "warm");
    let by_backend =
        policy("rules:\n  - name: r\n    route: { select: [{ order: [gold, silver] }] }\n");
    let mut silver = local("s", "m");
    silver.backend_name = Some("silver".into());
    let mut gold = local("g", "m");
    gold.backend_name = Some("gold".into());
    let mut unnamed = local("u", "m");
    unnamed.backend_name = Some("bronze".into());
    assert_eq!(
        outcome(
            &by_backend,
            &request("m"),
            &[],
            &[unnamed.clone(), silver, gold]
        ),
        "g"
    );
    assert_eq!(
        outcome(&by_backend, &request("m"), &[], &[unnamed]),
        "reject 503"
    );
}

#[test]
fn within_ties_and_tie_breaks() {
    let cands = [
        with(provider("p", "m"), |m| m.cost = Some(0.0100)),
        with(local("l", "m"), |m| m.cost = Some(0.0104)),
        with(local("far", "m"), |m| m.cost = Some(0.0200)),
    ];
    let rule = |extra: &str| {
        policy(&format!(
            "providers: [{{ name: p, baseURL: https://p.test, models: [{{ name: m }}] }}]\nrules:\n  - name: r\n    route:\n      consider: [{{ backends: {{}} }}]\n      select: [{{ type: Any, minimize: Cost{extra} }}]\n      tieBreak: PreferLocal\n"
        ))
    };
    // Without within the provider is strictly cheapest.
    assert_eq!(outcome(&rule(""), &request("m"), &[], &cands), "p");
    // 5% makes the local one a tie, and PreferLocal picks it; `far` is no tie.
    assert_eq!(
        outcome(&rule(", within: 5%"), &request("m"), &[], &cands),
        "l"
    );

    let random = policy(
        "rules:\n  - name: r\n    route:\n      select: [{ minimize: PredictedTTFT, within: 50ms }]\n      tieBreak: Random\n",
    );
    let cands = [
        with(local("a", "m"), |m| m.predicted_ttft = Some(0.100)),
        with(local("b", "m"), |m| m.predicted_ttft = Some(0.140)),
        with(local("c", "m"), |m| m.predicted_ttft = Some(0.300)),
    ];
    let mut seen = std::collections::BTreeSet::new();
    for seed in 0..64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let (d, _) = evaluate_with(
            &random,
            &request("m"),
            &cands,
            &mut rng,
            &mut NoTrace,
            |_| vec![],
        );
        if let Decision::Route(r) = d {
            seen.insert(cands[r.winner].endpoint.clone());
        }
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        ["a", "b"],
        "Random picks among the tie only"
    );
}

/// The explain trace says which candidates tied and what broke the tie,
/// and says nothing of ties when the best stood alone.
#[test]
fn the_trace_shows_the_tie_set_and_the_tie_break() {
    let cands = [
        with(provider("p", "m"), |m| m.cost = Some(0.0100)),
        with(local("l", "m"), |m| m.cost = Some(0.0104)),
        with(local("far", "m"), |m| m.cost = Some(0.0200)),
    ];
    let rule = |within: &str| {
        policy(&format!(
            "providers: [{{ name: p, baseURL: https://p.test, models: [{{ name: m }}] }}]\nrules:\n  - name: r\n    route:\n      consider: [{{ backends: {{}} }}]\n      select: [{{ type: Any, minimize: Cost{within} }}]\n      tieBreak: PreferLocal\n"
        ))
    };
    let tier = |policy: &CompiledPolicy| {
        let mut trace = Trace::default();
        let mut rng = StdRng::seed_from_u64(0);
        evaluate_with(
            policy,
            &request("m"),
            &cands,
            &mut rng,
            &mut trace,
            |_| vec![],
        );
        trace.rules[0].tiers[0].clone()
    };
    let tied = tier(&rule(", within: 5%"));
    assert_eq!(tied.tied, [cands[0].label(), cands[1].label()]);
    assert_eq!(tied.tie_break.as_deref(), Some("PreferLocal"));
    assert_eq!(tied.winner, Some(cands[1].label()));

    let alone = tier(&rule(""));
    assert!(alone.tied.is_empty(), "{:?}", alone.tied);
    assert_eq!(alone.tie_break, None);
    assert_eq!(alone.winner, Some(cands[0].label()));
}

#[test]
fn the_trace_says_where_each_cached_prefix_came_from() {
    let p =
        policy("rules:\n  - name: r\n    route: { select: [{ maximize: CachedPrefixTokens }] }\n");
    let cached = |name: &str, tokens: f64, source: Option<PrefixSource>| Candidate {
        cached_prefix_source: source,
        ..with(local(name, "m"), |m| m.cached_prefix_tokens = Some(tokens))
    };
    let cands = [
        cached("a", 512.0, Some(PrefixSource::Events)),
        cached("bb", 128.0, Some(PrefixSource::Estimate)),
        cached("ccc", 64.0, None),
    ];
    let mut trace = Trace::default();
    let mut rng = StdRng::seed_from_u64(0);
    evaluate_with(&p, &request("m"), &cands, &mut rng, &mut trace, |_| vec![]);
    let values: Vec<&str> = trace.rules[0].tiers[0]
        .ranking
        .iter()
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(values, ["512 (events)", "128 (estimate)", "64"]);
    // Metrics that do not count the cached prefix are shown bare.
    let p = policy("rules:\n  - name: r\n    route: { select: [{ minimize: QueueDepth }] }\n");
    let queued = Candidate {
        cached_prefix_source: Some(PrefixSource::Events),
        ..with(local("a", "m"), |m| m.queue_depth = Some(2.0))
    };
    let mut trace = Trace::default();
    evaluate_with(
        &p,
        &request("m"),
        &[queued],
        &mut rng,
        &mut trace,
        |_| vec![],
    );
    assert_eq!(trace.rules[0].tiers[0].ranking[0].1, "2");
}

#[test]
fn tie_without_tie_break_is_first_in_rank_order() {
    let p = policy("rules:\n  - name: r\n    route: { select: [{ minimize: QueueDepth }] }\n");
    let cands = [
        with(local("first", "m"), |m| m.queue_depth = Some(1.0)),
        with(local("second", "m"), |m| m.queue_depth = Some(1.0)),
    ];
    for _ in 0..10 {
        assert_eq!(outcome(&p, &request("m"), &[], &cands), "first");
    }
}

#[test]
fn on_empty_fall_through_continues_and_reject_answers() {
    let p = policy(
        "rules:\n  - name: local-only\n    matches: [{ api: chat }]\n    route:\n      exclude: [{ drop: { KVCacheUtilization: { greaterThan: 0.9 } } }]\n      select: [{ minimize: QueueDepth }]\n      onEmpty: FallThrough\n  - name: shed\n    matches: [{ model: m }]\n    route:\n      exclude: [{ drop: { type: Local } }]\n      select: [{ minimize: QueueDepth }]\n      reject: { status: 429, message: busy }\n",
    );
    let full = with(local("full", "m"), |m| {
        m.kv_cache_utilization = Some(0.99);
        m.queue_depth = Some(0.0);
    });
    let d = decide(&p, &request("m"), &[], &[full]);
    match d {
        Decision::Reject(r) => {
            assert_eq!((r.status, r.message.as_str()), (429, "busy"));
            assert_eq!(p.rules[r.rule.unwrap()].name, "shed");
        }
        other => panic!("expected reject, got {other:?}"),
    }
    // Nothing matches at all (another model): 503, no rule.
    match decide(&p, &request("other"), &[], &[]) {
        Decision::Reject(r) => {
            // local-only matches everything but has no candidate; it falls
            // through, and shed does not match `other`.
            assert_eq!((r.status, r.rule), (503, None));
        }
        other => panic!("expected reject, got {other:?}"),
    }
}

#[test]
fn classifiers_run_only_when_a_reached_rule_needs_them() {
    let p = policy(
        "classifiers:\n  - { name: pii, type: pii }\n  - { name: complexity, type: complexity }\nrules:\n  - name: internal\n    matches: [{ tenant: internal }]\n    route: { select: [{ minimize: QueueDepth }] }\n  - name: pii\n    matches: [{ model: m, tag: [pii-confirmed, pii-unknown] }]\n    route: { select: [{ minimize: QueueDepth }] }\n  - name: simple\n    matches: [{ tag: complexity-low }]\n    route: { select: [{ minimize: QueueDepth }] }\n  - name: rest\n    route: { select: [{ minimize: QueueDepth }] }\n",
    );
    let cands = [
        with(local("a", "m"), |m| m.queue_depth = Some(0.0)),
        with(local("b", "x"), |m| m.queue_depth = Some(0.0)),
    ];
    let run = |req: &Request| {
        let mut asked = Vec::new();
        let mut rng = StdRng::seed_from_u64(1);
        let (d, _) = evaluate_with(&p, req, &cands, &mut rng, &mut NoTrace, |c| {
            asked.push(p.classifiers[c].name.clone());
            vec![]
        });
        (rule_name(&p, &d).unwrap(), asked)
    };
    let mut internal = request("m");
    internal.tenant = Some("internal".into());
    assert_eq!(run(&internal), ("internal".to_string(), vec![]));
    // The pii rule's other predicate (model: m) fails for model x: pii is skipped.
    let (rule, asked) = run(&request("x"));
    assert_eq!(
        (rule.as_str(), asked),
        ("rest", vec!["complexity".to_string()])
    );
    let (rule, asked) = run(&request("m"));
    assert_eq!(
        (rule.as_str(), asked),
        ("rest", vec!["pii".to_string(), "complexity".to_string()])
    );
}

#[test]
fn evaluate_reports_needed_classifiers_then_resumes() {
    let p = policy(
        "classifiers: [{ name: pii, type: pii }]\nrules:\n  - name: pii\n    matches: [{ tag: pii-confirmed }]\n    route: { select: [{ minimize: QueueDepth }] }\n",
    );
    let cands = [with(local("a", "m"), |m| m.queue_depth = Some(0.0))];
    let req = request("m");
    let mut rng = StdRng::seed_from_u64(1);
    let first = evaluate(&p, &req, &Tags::default(), &cands, &mut rng, &mut NoTrace);
    let kinference_policy::eval::Evaluation::NeedTags(needed) = first else {
        panic!("expected a request for tags, got {first:?}");
    };
    assert_eq!(needed.iter().collect::<Vec<_>>(), [0]);
    let mut tags = Tags::default();
    tags.record(0, ["pii-confirmed".to_string()]);
    let second = evaluate(&p, &req, &tags, &cands, &mut rng, &mut NoTrace);
    assert!(matches!(
        second,
        kinference_policy::eval::Evaluation::Decided(Decision::Route(_))
    ));
}

#[test]
fn examples_route_as_documented() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/cheap-model-unless-cached.yaml"
    ))
    .unwrap();
    let p = compile_text(&text).unwrap();
    // Prices: gemma 0.10/M in; qwen 0.60/M in, 0.03/M cached. 10k prompt tokens.
    let cost = |model: &str, cached: f64| {
        let price = p.local_model(model).unwrap().price.unwrap();
        price.cost(10_000.0, cached, 100.0)
    };
    let cands = |qwen_cached: f64| {
        vec![
            with(local("gemma", "gemma-4"), |m| {
                m.cost = Some(cost("gemma-4", 0.0))
            }),
            with(local("qwen", "qwen-2.5"), |m| {
                m.cost = Some(cost("qwen-2.5", qwen_cached))
            }),
        ]
    };
    let mut req = request("qwen-2.5");
    req.prompt_tokens = 10_000;
    assert_eq!(outcome(&p, &req, &["complexity-low"], &cands(0.0)), "gemma");
    assert_eq!(
        outcome(&p, &req, &["complexity-low"], &cands(9_800.0)),
        "qwen"
    );
}

/// `sessionAffinity`: a session stays on its Pod while the Pod is among
/// the rule's candidates after exclude, ahead of a better one; the tiers'
/// ranking follows as the fallback list; an excluded Pod lets it move.
#[test]
fn a_session_stays_on_its_pod_while_the_pod_is_within_the_rules_bounds() {
    let p = policy(
        "sessionAffinity: { header: X-Session-Id }
rules:
  - name: least-queue
    route:
      exclude: [{ drop: { QueueDepth: { greaterThan: 8 } } }]
      select: [{ minimize: QueueDepth }]
",
    );
    let cands = |busy_a: f64| {
        [
            with(local("a", "qwen"), |m| m.queue_depth = Some(busy_a)),
            with(local("bb", "qwen"), |m| m.queue_depth = Some(0.0)),
            with(local("ccc", "qwen"), |m| m.queue_depth = Some(1.0)),
        ]
    };
    let mut req = request("qwen");
    assert_eq!(outcome(&p, &req, &[], &cands(3.0)), "bb", "no session yet");
    req.session_address = Some("10.0.0.1:8000".into()); // a's
    let three = cands(3.0);
    let Decision::Route(kept) = decide(&p, &req, &[], &three) else {
        panic!("routed")
    };
    let ranked: Vec<&str> = kept
        .ranked
        .iter()
        .map(|&i| three[i].endpoint.as_str())
        .collect();
    assert_eq!(
        ranked,
        ["a", "bb", "ccc"],
        "a first, then the tier's ranking"
    );
    let mut trace = Trace::default();
    evaluate(
        &p,
        &req,
        &Tags::default(),
        &cands(3.0),
        &mut StdRng::seed_from_u64(1),
        &mut trace,
    );
    assert_eq!(
        trace.rules[0].session.as_deref(),
        Some("kept on 10.0.0.1:8000, the session's Pod")
    );
    // a is excluded (queue over 8): the session moves to the tiers' choice.
    assert_eq!(outcome(&p, &req, &[], &cands(9.0)), "bb");
    let mut trace = Trace::default();
    evaluate(
        &p,
        &req,
        &Tags::default(),
        &cands(9.0),
        &mut StdRng::seed_from_u64(1),
        &mut trace,
    );
    assert!(
        trace.rules[0]
            .session
            .as_deref()
            .unwrap()
            .starts_with("left 10.0.0.1:8000")
    );
    // A session address no candidate has: the tiers decide.
    req.session_address = Some("10.9.9.9:8000".into());
    assert_eq!(outcome(&p, &req, &[], &cands(3.0)), "bb");
}

#[test]
fn session_affinity_is_checked_with_its_paths() {
    let errors = |yaml: &str| {
        let text = format!(
            "{POOL}{yaml}rules: [{{ name: r, route: {{ select: [{{ minimize: QueueDepth }}] }} }}]\n"
        );
        compile_text(&text).map(|_| Vec::new()).unwrap_or_else(|e| {
            e.iter()
                .map(|d| format!("{}: {}", d.path, d.message))
                .collect()
        })
    };
    assert_eq!(
        errors("sessionAffinity: { cookie: sid, ttl: 30m }\n"),
        Vec::<String>::new()
    );
    assert_eq!(
        errors("sessionAffinity: { header: a, cookie: b }\n"),
        ["sessionAffinity: name either a header or a cookie, not both"]
    );
    assert_eq!(
        errors("sessionAffinity: { ttl: 5m }\n"),
        [
            "sessionAffinity: name the header or the cookie that carries the session key, e.g. { header: x-session-id }"
        ]
    );
    assert_eq!(
        errors("sessionAffinity: { header: a, ttl: 25h }\n"),
        ["sessionAffinity.ttl: must be more than 0 and at most 24h"]
    );
    let p = policy(
        "sessionAffinity: { header: X-Session-Id }\nrules: [{ name: r, route: { select: [{ minimize: QueueDepth }] } }]\n",
    );
    let affinity = p.session_affinity.unwrap();
    assert_eq!(
        affinity.key,
        kinference_policy::model::SessionKey::Header("x-session-id".into())
    );
    assert_eq!(affinity.ttl, std::time::Duration::from_secs(600));
}

/// `minimize: PredictedTTFT` ranks by the prediction plus the placement
/// terms and the trace shows each by name; a predicate on `PredictedTTFT`
/// reads the prediction alone.
#[test]
fn predicted_ttft_ranks_with_its_placement_terms_and_predicates_read_the_prediction() {
    use kinference_policy::eval::{Placement, PlacementTerm};
    let placed = |name: &str, predicted: f64, terms: &[(PlacementTerm, f64)]| {
        let mut placement = Placement::default();
        for &(term, seconds) in terms {
            placement.add(term, seconds);
        }
        Candidate {
            placement,
            cached_prefix_source: Some(PrefixSource::Estimate),
            ..with(local(name, "m"), |m| m.predicted_ttft = Some(predicted))
        }
    };
    let cands = [
        // The fastest for this request, but short of room for its group.
        placed("a", 0.040, &[(PlacementTerm::Room, 0.100)]),
        placed("bb", 0.090, &[]),
        // A new replica: its prefill shared with the requests that follow.
        placed(
            "ccc",
            0.400,
            &[
                (PlacementTerm::ReplicaShare, -0.350),
                (PlacementTerm::ReplicaEvictions, 0.020),
            ],
        ),
    ];
    let ranked =
        policy("rules:\n  - name: r\n    route: { select: [{ minimize: PredictedTTFT }] }\n");
    let mut trace = Trace::default();
    let mut rng = StdRng::seed_from_u64(0);
    let (d, _) = evaluate_with(
        &ranked,
        &request("m"),
        &cands,
        &mut rng,
        &mut trace,
        |_| vec![],
    );
    let Decision::Route(r) = d else {
        panic!("{d:?}")
    };
    assert_eq!(cands[r.winner].endpoint, "ccc");
    let ranking: Vec<String> = trace.rules[0].tiers[0]
        .ranking
        .iter()
        .map(|(c, v)| format!("{c} {v}"))
        .collect();
    insta::assert_debug_snapshot!(ranking, @r#"
    [
        "ccc:m 70ms (estimate) = predicted 400ms - replicaShare 350ms + replicaEvictions 20ms",
        "bb:m 90ms (estimate)",
        "a:m 140ms (estimate) = predicted 40ms + room 100ms",
    ]
    "#);
    // An SLO bounds the request's own TTFT: `a` is within it, `ccc` is not.
    let bounded = policy(
        "rules:\n  - name: r\n    route:\n      exclude: [{ drop: { PredictedTTFT: { greaterThan: 100ms } } }]\n      select: [{ maximize: CachedPrefixTokens }, { type: Local }]\n",
    );
    let mut trace = Trace::default();
    evaluate_with(
        &bounded,
        &request("m"),
        &cands,
        &mut rng,
        &mut trace,
        |_| vec![],
    );
    let dropped: Vec<&str> = trace.rules[0]
        .dropped
        .iter()
        .map(|d| d.candidate.as_str())
        .collect();
    assert_eq!(dropped, ["ccc:m"]);
}
