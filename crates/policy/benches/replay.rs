//! Replaying a decision log: 100,000 records (8 local Pods and 2 providers
//! each), parsed from their JSON lines and decided under two policies, as
//! `kinference diff` does; the baseline is deciding the same requests from
//! memory, as the EPP does.
//! `cargo bench -p kinference-policy --bench replay`

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use kinference_policy::attr::CandidateType;
use kinference_policy::eval::{
    Candidate, DecisionRecord, DiffSummary, Metrics, NoTrace, Request, evaluate_with,
    for_recorded_requests, replay,
};
use kinference_policy::source::compile_text;
use rand::SeedableRng;
use rand::rngs::{SmallRng, StdRng};

const RECORDS: usize = 100_000;

const OLD: &str = "pool: { selector: { app: vllm }, targetPorts: [{ number: 8000 }] }
providers:
  - { name: a, baseURL: https://a.test, models: [{ name: m }] }
  - { name: b, baseURL: https://b.test, models: [{ name: m }] }
rules:
  - name: gold
    matches: [{ tenant: [gold-1, gold-2] }, { promptTokens: { greaterThan: 4000 } }]
    route:
      consider: [{ backends: { type: Local } }]
      exclude: [{ drop: { KVCacheUtilization: { greaterThan: 0.95 } } }]
      select: [{ minimize: PredictedTTFT, within: 10ms }]
      tieBreak: Random
      onEmpty: FallThrough
  - name: rest
    route:
      consider: [{ backends: {} }]
      exclude: [{ drop: { QueueDepth: { greaterThan: 8 } } }]
      select:
        - { type: Local, minimize: QueueDepth }
        - { type: Provider, minimize: Cost }
      tieBreak: Random
";

fn candidates(i: usize) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = (0..8)
        .map(|p| Candidate {
            kind: CandidateType::Local,
            model: "m".into(),
            endpoint: format!("pod-{p}"),
            address: Some(format!("10.0.0.{p}:8000")),
            backend_name: Some("vllm".into()),
            metrics: Metrics {
                queue_depth: Some(((i * 7 + p * 3) % 12) as f64),
                kv_cache_utilization: Some(((i + p) % 100) as f64 / 100.0),
                predicted_ttft: Some(0.05 + ((i * 13 + p) % 40) as f64 / 1000.0),
                cost: Some(0.0002),
                ..Metrics::default()
            },
            ..Candidate::default()
        })
        .collect();
    for name in ["a", "b"] {
        out.push(Candidate {
            kind: CandidateType::Provider,
            model: "m".into(),
            endpoint: name.into(),
            provider_name: Some(name.into()),
            metrics: Metrics {
                cost: Some(if name == "a" { 0.002 } else { 0.003 }),
                ..Metrics::default()
            },
            ..Candidate::default()
        });
    }
    out
}

fn request(i: usize) -> Request {
    Request {
        model: "m".into(),
        tenant: Some(format!("gold-{}", i % 5)),
        path: "/v1/chat/completions".into(),
        prompt_tokens: (i * 37 % 6000) as u64,
        ..Request::default()
    }
}

fn log_lines() -> Vec<String> {
    let policy = compile_text(OLD).unwrap();
    (0..RECORDS)
        .map(|i| {
            let (req, cands) = (request(i), candidates(i));
            let (decision, tags) = evaluate_with(
                &policy,
                &req,
                &cands,
                &mut SmallRng::seed_from_u64(i as u64),
                &mut NoTrace,
                |_| vec![],
            );
            let record = DecisionRecord::new(
                "2026-12-03T12:00:00Z".into(),
                &policy,
                &req,
                &tags,
                cands,
                &decision,
                i as u64,
            );
            serde_json::to_string(&record).unwrap()
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let lines = log_lines();
    let old = for_recorded_requests(&compile_text(OLD).unwrap());
    let new = for_recorded_requests(
        &compile_text(&OLD.replace("greaterThan: 4000", "greaterThan: 2000")).unwrap(),
    );
    let inputs: Vec<(Request, Vec<Candidate>)> =
        (0..RECORDS).map(|i| (request(i), candidates(i))).collect();
    let plain = compile_text(OLD).unwrap();

    let mut group = c.benchmark_group("100k records");
    group.sample_size(10);
    group.bench_function("baseline: decide from memory (the EPP's work)", |b| {
        b.iter(|| {
            let mut rng = StdRng::seed_from_u64(0);
            for (req, cands) in &inputs {
                black_box(evaluate_with(
                    &plain,
                    req,
                    cands,
                    &mut rng,
                    &mut NoTrace,
                    |_| vec![],
                ));
            }
        })
    });
    group.bench_function("replay: parse each line, decide under one policy", |b| {
        b.iter(|| {
            for line in &lines {
                let record = DecisionRecord::parse(line).unwrap();
                black_box(replay(&old, &record));
            }
        })
    });
    group.bench_function("diff: parse each line, decide under two policies", |b| {
        b.iter(|| {
            let mut summary = DiffSummary::default();
            for (i, line) in lines.iter().enumerate() {
                let record = DecisionRecord::parse(line).unwrap();
                summary.add(i, &replay(&old, &record), &replay(&new, &record));
            }
            black_box(summary.changed)
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
