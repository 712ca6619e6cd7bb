//! Workload (i): priorities under overload. Three InferenceObjectives of the
//! pool (`chat` 10, `default` 0, `batch` -1, 20/20/60% of the arrivals),
//! each request naming its own in `x-gateway-inference-objective`, Poisson
//! arrivals at a quarter of the pool's capacity (the unloaded reference)
//! and at 1×, 1.5× and 2× of it, against our simulators with slow decode
//! ([`super::SimShape::Queued`]). Per priority: TTFT p50/p90, its p90 over
//! the contender's own unloaded p90, and how the others ended (429 shed,
//! 503 rejected or expired, anything else).
//!
//! The contenders that act on priority: `kinference-flow` (our policy: a
//! Pod is full at as many requests in flight as it has slots, one fewer for
//! priorities 0 and below; a request that finds every Pod full waits in the
//! EPP, `onEmpty: Wait`) and `gie-flow` (the reference EPP v1.5.0 with its
//! `flowControl` feature gate: the flow controller queues by priority band
//! while its saturation detector says the pool is saturated). Without the
//! gate the reference sheds requests of negative priority when saturated
//! (`gie-default`).

use std::time::{Duration, Instant};

use anyhow::Result;
use kinference_testbed::http_client::HttpClient;
use kinference_testbed::load::{ms, quantile, ratio};
use kinference_testbed::priorities::arrivals;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::json;

use super::settings::{MODEL, NS, POOL};

/// The contenders (i) runs for unless `--workloads` names it: the two that
/// act on priority, the reference without its gate, and ours without
/// waiting.
pub const CONTENDERS: [&str; 4] = [
    "kinference-flow",
    "gie-flow",
    "gie-default",
    "kinference-ttft",
];

/// `--workloads` name of (i), and its label in the report.
pub const WORKLOAD: &str = "priorities";
pub const LABEL: &str = "(i) priorities";

/// (objective, priority, share of the arrivals).
pub const OBJECTIVES: [(&str, i32, f64); 3] =
    [("chat", 10, 0.2), ("default", 0, 0.2), ("batch", -1, 0.6)];

/// Each answer's tokens: 40 at the queued simulators' 50 a second, so a
/// request holds its slot about 0.8 s.
pub const OUTPUT_TOKENS: u32 = 40;
/// Slots of a queued simulator.
pub const SLOTS: usize = 4;
pub const DECODE_TOKENS_PER_SEC: f64 = 50.0;
pub const BASE_LATENCY_MS: f64 = 5.0;

/// Requests the pool serves a second at most: every slot busy, each request
/// holding its slot for its decode, the base latency and a short prefill.
pub fn capacity(pods: usize) -> f64 {
    let prefill = 0.01;
    let service =
        BASE_LATENCY_MS / 1e3 + prefill + f64::from(OUTPUT_TOKENS) / DECODE_TOKENS_PER_SEC;
    (pods * SLOTS) as f64 / service
}

/// Creates the pool's InferenceObjectives.
pub async fn create_objectives(client: &Client) -> Result<()> {
    let gvk = GroupVersionKind::gvk(
        "inference.networking.x-k8s.io",
        "v1alpha2",
        "InferenceObjective",
    );
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NS,
        &ApiResource::from_gvk_with_plural(&gvk, "inferenceobjectives"),
    );
    for (name, priority, _) in OBJECTIVES {
        let objective: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": { "name": name, "namespace": NS },
            "spec": { "priority": priority, "poolRef": { "name": POOL } },
        }))?;
        api.create(&PostParams::default(), &objective).await?;
    }
    Ok(())
}

/// One request: when it is sent, which objective it names, its body.
struct Planned {
    at: Duration,
    objective: usize,
    body: Vec<u8>,
}

/// `seconds` of Poisson arrivals at `rate`, objectives drawn by share.
fn plan(rate: f64, seconds: f64, seed: u64) -> Vec<Planned> {
    let shares: Vec<f64> = OBJECTIVES.iter().map(|&(_, _, share)| share).collect();
    arrivals(rate, seconds, &shares, seed)
        .into_iter()
        .enumerate()
        .map(|(i, arrival)| {
            let at = arrival.at.as_secs_f64();
            let body = json!({
                "model": MODEL,
                "messages": [{ "role": "user", "content": format!("question {i} at {at:.3}") }],
                "max_tokens": OUTPUT_TOKENS,
                "stream": true,
            });
            Planned {
                at: arrival.at,
                objective: arrival.class,
                body: body.to_string().into_bytes(),
            }
        })
        .collect()
}

/// How one objective's requests ended at one load.
#[derive(Clone, Debug, Default)]
pub struct Band {
    /// Sorted.
    pub ttfts: Vec<Duration>,
    pub shed: usize,
    pub rejected: usize,
    pub other: usize,
}

/// One load of one contender.
#[derive(Clone, Debug)]
pub struct Row {
    /// Multiple of the pool's capacity.
    pub load: f64,
    /// In the order of [`OBJECTIVES`].
    pub bands: Vec<Band>,
}

/// Sends `seconds` of arrivals at `load` × `capacity` to `url`; how each
/// objective's requests ended.
pub async fn run_load(http: &HttpClient, url: &str, load: f64, capacity: f64, seconds: f64) -> Row {
    let plan = plan(load * capacity, seconds, 42);
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(plan.len());
    for p in plan {
        tokio::time::sleep_until(start + p.at).await;
        let (http, url) = (http.clone(), url.to_string());
        tasks.push(tokio::spawn(async move {
            let header = [("x-gateway-inference-objective", OBJECTIVES[p.objective].0)];
            (
                p.objective,
                http.post_json_with(&url, p.body, &header).await,
            )
        }));
    }
    let mut bands = vec![Band::default(); OBJECTIVES.len()];
    for task in tasks {
        let Ok((objective, answer)) = task.await else {
            continue;
        };
        let band = &mut bands[objective];
        match answer {
            Ok(a) => band.ttfts.push(a.first_byte),
            // The client's error carries the status first.
            Err(e) if e.to_string().starts_with("429") => band.shed += 1,
            Err(e) if e.to_string().starts_with("503") => band.rejected += 1,
            Err(_) => band.other += 1,
        }
    }
    for band in &mut bands {
        band.ttfts.sort_unstable();
    }
    Row { load, bands }
}

/// The loads of a run: the unloaded reference first.
pub fn loads(full: bool) -> &'static [f64] {
    if full {
        &[0.25, 1.0, 1.5, 2.0]
    } else {
        &[0.25, 1.0]
    }
}

/// How long each load's arrivals last.
pub fn stage(full: bool) -> Duration {
    Duration::from_secs(if full { 20 } else { 1 })
}

/// The table of every contender's `(name, rows)` that ran the workload.
pub fn print_table(runs: &[(&str, &[Row])], pods: usize) {
    let runs: Vec<&(&str, &[Row])> = runs.iter().filter(|(_, rows)| !rows.is_empty()).collect();
    if runs.is_empty() {
        return;
    }
    println!(
        "\n#### {LABEL}: InferenceObjectives {OBJECTIVES:?} (name, priority, share of the arrivals); {pods} Pods × {SLOTS} slots, {OUTPUT_TOKENS} output tokens at {DECODE_TOKENS_PER_SEC:.0} tok/s: capacity {:.1} req/s; Poisson arrivals; TTFT = first body byte at the client; \"÷ unloaded\": the p90 over the same contender's at 0.25×\n",
        capacity(pods)
    );
    println!(
        "| load | contender | priority | ok | TTFT p50 ms | p90 ms | p90 ÷ unloaded | shed (429) | 503 | other |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (name, rows) in runs {
        let unloaded = rows.first();
        for row in rows.iter() {
            for (i, band) in row.bands.iter().enumerate() {
                let p90 = ms(quantile(&band.ttfts, 0.9));
                let base = unloaded.map(|u| ms(quantile(&u.bands[i].ttfts, 0.9)));
                println!(
                    "| {}× | {name} | {} | {} | {:.0} | {:.0} | {} | {} | {} | {} |",
                    row.load,
                    OBJECTIVES[i].1,
                    band.ttfts.len(),
                    ms(quantile(&band.ttfts, 0.5)),
                    p90,
                    base.map_or("-".into(), |b| ratio(p90, b)),
                    band.shed,
                    band.rejected,
                    band.other,
                );
            }
        }
    }
}

/// A short line per load for the progress log.
pub fn brief(row: &Row, started: Instant) -> String {
    let bands: Vec<String> = row
        .bands
        .iter()
        .zip(OBJECTIVES)
        .map(|(b, (_, priority, _))| {
            format!(
                "priority {priority}: {} ok, p90 {:.0} ms, {} shed, {} 503, {} other",
                b.ttfts.len(),
                ms(quantile(&b.ttfts, 0.9)),
                b.shed,
                b.rejected,
                b.other
            )
        })
        .collect();
    format!(
        "{}× in {:.0?}: {}",
        row.load,
        started.elapsed(),
        bands.join("; ")
    )
}
