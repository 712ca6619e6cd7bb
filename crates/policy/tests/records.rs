//! Decision records: written redacted, read back strictly, replayed under
//! the same policy to the same decision, and diffed under a changed one.

use kinference_policy::CompiledPolicy;
use kinference_policy::attr::CandidateType;
use kinference_policy::eval::{
    Candidate, DecisionRecord, NoTrace, Outcome, Request, evaluate_with, for_recorded_requests,
    replay, undecidable_predicates,
};
use kinference_policy::source::compile_text;
use rand::SeedableRng;
use rand::rngs::SmallRng;

const HEAD: &str = "pool: { selector: { app: vllm }, targetPorts: [{ number: 8000 }] }
tenantHeader: x-tenant
providers:
  - name: openai
    baseURL: https://api.openai.com/v1
    models: [{ name: m }]
classifiers:
  - { name: pii, type: pii, timeout: 20ms }
";

/// alice's requests and PII stay local; the rest go to the provider.
const OLD: &str = "rules:
  - name: alice-local
    matches: [{ tenant: alice }, { tag: { containsAll: [pii-confirmed] } }]
    route:
      consider: [{ backends: { type: Local } }]
      select: [{ minimize: QueueDepth }]
      tieBreak: Random
  - name: rest
    route:
      consider: [{ backends: {} }]
      select: [{ type: Provider, order: [openai] }]
";

fn policy(rules: &str) -> CompiledPolicy {
    compile_text(&format!("{HEAD}{rules}")).unwrap_or_else(|e| panic!("{e:?}"))
}

fn candidates() -> Vec<Candidate> {
    let local = |name: &str, queue: f64| {
        let mut c = Candidate {
            kind: CandidateType::Local,
            model: "m".into(),
            endpoint: name.into(),
            address: Some("10.0.0.1:8000".into()),
            ..Candidate::default()
        };
        c.metrics.queue_depth = Some(queue);
        c.metrics.cost = Some(0.0001);
        c
    };
    let mut openai = Candidate {
        kind: CandidateType::Provider,
        model: "m".into(),
        endpoint: "openai".into(),
        provider_name: Some("openai".into()),
        ..Candidate::default()
    };
    openai.metrics.cost = Some(0.002);
    vec![local("a", 1.0), local("b", 4.0), openai]
}

/// Decided as the EPP decides, recorded as the EPP records.
fn record(policy: &CompiledPolicy, tenant: &str, emitted: &[&str]) -> String {
    record_with(policy, tenant, emitted, candidates(), 1)
}

/// As the EPP does: the decision drawn with `seed`, which the record keeps.
fn record_with(
    policy: &CompiledPolicy,
    tenant: &str,
    emitted: &[&str],
    cands: Vec<Candidate>,
    seed: u64,
) -> String {
    let request = Request {
        model: "m".into(),
        tenant: Some(tenant.into()),
        path: "/v1/chat/completions?api-key=s3cret".into(),
        headers: [("x-api-key".to_string(), "s3cret".to_string())].into(),
        ..Request::default()
    };
    let mut rng = SmallRng::seed_from_u64(seed);
    let (decision, tags) = evaluate_with(policy, &request, &cands, &mut rng, &mut NoTrace, |_| {
        emitted.iter().map(|t| t.to_string()).collect()
    });
    let record = DecisionRecord::new(
        "2026-12-03T12:00:00Z".into(),
        policy,
        &request,
        &tags,
        cands,
        &decision,
        seed,
    );
    serde_json::to_string(&record).unwrap()
}

#[test]
fn a_record_holds_no_client_value_in_the_clear_and_reads_back() {
    let line = record(&policy(OLD), "alice", &["pii-none"]);
    for secret in ["\"alice\"", "s3cret", "api-key="] {
        assert!(!line.contains(secret), "{secret} in {line}");
    }
    let read = DecisionRecord::parse(&line).unwrap();
    assert_eq!(serde_json::to_string(&read).unwrap(), line);
    assert_eq!(read.request.path, "/v1/chat/completions");
    assert_eq!(read.tags, ["pii-none"]);
    assert!(
        matches!(&read.decision, Outcome::Route { rule, kind: CandidateType::Local, .. } if rule == "alice-local"),
        "{:?}",
        read.decision
    );
    let typo = line.replace("\"QueueDepth\"", "\"QueueDept\"");
    assert!(
        DecisionRecord::parse(&typo)
            .unwrap_err()
            .contains("QueueDept")
    );
}

#[test]
fn replaying_under_the_same_policy_gives_the_logged_decisions() {
    let old = policy(OLD);
    let replayable = for_recorded_requests(&old);
    for (tenant, tags) in [
        ("alice", vec![]),
        ("bob", vec!["pii-confirmed"]),
        ("bob", vec!["pii-none"]),
    ] {
        let logged = DecisionRecord::parse(&record(&old, tenant, &tags)).unwrap();
        assert_eq!(
            replay(&replayable, &logged),
            logged.decision,
            "{tenant} {tags:?}"
        );
    }
    // The tenant literal is compared digested, as the record holds it.
    let alice = DecisionRecord::parse(&record(&old, "alice", &[])).unwrap();
    assert_eq!(replay(&old, &alice).rule(), Some("rest"));
    assert_eq!(undecidable_predicates(&old), 0);
    let by_prefix = policy(&OLD.replace("tenant: alice", "tenant: { prefix: ali }"));
    assert_eq!(undecidable_predicates(&by_prefix), 1);
}

/// alice's rule ties both local Pods (equal queues) and breaks the tie at
/// random: replay draws what the decision drew, whatever the seed.
#[test]
fn a_random_tie_break_replays_to_the_logged_pick() {
    let old = policy(OLD);
    let replayable = for_recorded_requests(&old);
    let mut tied = candidates();
    tied[1].metrics.queue_depth = tied[0].metrics.queue_depth;
    let mut picked = std::collections::BTreeSet::new();
    for seed in 0..32 {
        let line = record_with(&old, "alice", &[], tied.clone(), seed);
        let logged = DecisionRecord::parse(&line).unwrap();
        assert_eq!(replay(&replayable, &logged), logged.decision, "seed {seed}");
        if let Outcome::Route { candidate, .. } = &logged.decision {
            picked.insert(candidate.clone());
        }
    }
    assert_eq!(picked.len(), 2, "the tie was broken both ways: {picked:?}");
}

#[test]
fn a_diff_groups_the_changed_decisions_and_sums_their_cost() {
    let old = policy(OLD);
    // The new policy sends PII to the provider too.
    let new = policy(&OLD.replace(
        "matches: [{ tenant: alice }, { tag: { containsAll: [pii-confirmed] } }]",
        "matches: [{ tenant: alice }]",
    ));
    let records: Vec<DecisionRecord> = [
        ("alice", vec![]),
        ("bob", vec!["pii-confirmed"]),
        ("carol", vec!["pii-confirmed"]),
        ("dave", vec!["pii-none"]),
    ]
    .iter()
    .map(|(t, tags)| DecisionRecord::parse(&record(&old, t, tags)).unwrap())
    .collect();
    let summary = kinference_policy::eval::diff(
        &for_recorded_requests(&old),
        &for_recorded_requests(&new),
        &records,
    );
    assert_eq!(summary.records, 4);
    assert_eq!(summary.changed, 2);
    let groups: Vec<_> = summary
        .groups
        .iter()
        .map(|(k, g)| (k, (g.count, g.examples.clone())))
        .collect();
    assert_eq!(
        groups,
        [(
            &(
                "alice-local → rest".to_string(),
                "Local → Provider".to_string()
            ),
            (2, vec![1, 2])
        )]
    );
    assert_eq!((summary.old.local, summary.old.provider), (3, 1));
    assert_eq!((summary.new.local, summary.new.provider), (1, 3));
    assert!((summary.new.cost - summary.old.cost - 2.0 * (0.002 - 0.0001)).abs() < 1e-12);
}
