//! Decision cost of the evaluator. `cargo bench -p kinference-policy --bench evaluate`

use criterion::{Criterion, criterion_group, criterion_main};
use kinference_policy::attr::CandidateType;
use kinference_policy::eval::{Candidate, Metrics, NoTrace, Request, Tags, evaluate};
use kinference_policy::source::compile_text;
use rand::SeedableRng;
use rand::rngs::StdRng;
use std::hint::black_box;

const POOL: &str = "pool: { selector: { app: vllm }, targetPorts: [{ number: 8000 }] }\n";

/// 19 tenant-specific rules the request does not match, then a catch-all
/// that considers every destination, excludes twice and selects in 3 tiers.
fn large_policy() -> String {
    let mut p = format!(
        "{POOL}providers:\n{}rules:\n",
        (0..10)
            .map(|i| format!("  - {{ name: p{i}, baseURL: https://p{i}.test, models: [{{ name: m0 }}, {{ name: m1 }}] }}\n"))
            .collect::<String>()
    );
    for i in 0..19 {
        p += &format!(
            "  - name: tenant-{i}\n    matches:\n      - {{ tenant: t{i}, promptTokens: {{ greaterThan: 10 }} }}\n      - {{ header.x-team: team-{i} }}\n    route:\n      exclude: [{{ drop: {{ QueueDepth: {{ greaterThan: 10 }} }} }}]\n      select: [{{ minimize: QueueDepth }}]\n"
        );
    }
    p += "  - name: everyone\n    route:\n      consider: [{ backends: {} }]\n      exclude:\n        - drop: { KVCacheUtilization: { greaterThan: 0.95 } }\n        - if: { ttftSLO: { exists: true } }\n          drop: { PredictedTTFT: { greaterThan: 500ms } }\n      select:\n        - { type: Local, minimize: PredictedTTFT, within: 10ms }\n        - { type: Provider, minimize: Cost }\n        - { type: Any, minimize: RunningRequests }\n      tieBreak: PreferLocal\n";
    p
}

fn candidates(local: usize, providers: usize) -> Vec<Candidate> {
    let mut out = Vec::new();
    for i in 0..local {
        out.push(Candidate {
            kind: CandidateType::Local,
            model: "m0".into(),
            endpoint: format!("pod-{i}"),
            address: Some(format!("10.0.{}.{}:8000", i / 250, i % 250)),
            backend_name: Some("vllm".into()),
            metrics: Metrics {
                queue_depth: Some((i % 7) as f64),
                running_requests: Some((i % 5) as f64),
                kv_cache_utilization: Some((i % 100) as f64 / 100.0),
                predicted_ttft: Some(0.05 + (i % 13) as f64 * 0.01),
                ..Metrics::default()
            },
            ..Candidate::default()
        });
    }
    for i in 0..providers {
        out.push(Candidate {
            kind: CandidateType::Provider,
            model: format!("m{}", i % 2),
            endpoint: format!("p{}", i % 10),
            provider_name: Some(format!("p{}", i % 10)),
            metrics: Metrics {
                cost: Some(0.001 * (i % 10) as f64),
                running_requests: Some(1.0),
                ..Metrics::default()
            },
            ..Candidate::default()
        });
    }
    out
}

fn bench(c: &mut Criterion) {
    let large = compile_text(&large_policy()).unwrap();
    let small = compile_text(&format!(
        "{POOL}rules:\n  - name: only\n    route: {{ select: [{{ minimize: QueueDepth }}] }}\n"
    ))
    .unwrap();
    let request = Request {
        model: "m0".into(),
        tenant: Some("nobody".into()),
        prompt_tokens: 800,
        ..Request::default()
    };
    let tags = Tags::default();
    let large_cands = candidates(180, 20);
    let small_cands = candidates(10, 0);
    let mut rng = StdRng::seed_from_u64(1);
    c.bench_function("evaluate/20-rules-200-candidates", |b| {
        b.iter(|| {
            evaluate(
                &large,
                black_box(&request),
                &tags,
                black_box(&large_cands),
                &mut rng,
                &mut NoTrace,
            )
        })
    });
    c.bench_function("evaluate/1-rule-10-candidates", |b| {
        b.iter(|| {
            evaluate(
                &small,
                black_box(&request),
                &tags,
                black_box(&small_cands),
                &mut rng,
                &mut NoTrace,
            )
        })
    });
    // Baseline in the same run: the cheapest possible pick, a round-robin
    // over the same 200 candidates with no policy at all.
    let mut next = 0usize;
    c.bench_function("baseline/round-robin-200-candidates", |b| {
        b.iter(|| {
            next = (next + 1) % large_cands.len();
            black_box(&large_cands[next]);
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
