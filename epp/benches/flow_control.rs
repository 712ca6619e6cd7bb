//! Flow control under overload: three priorities (InferenceObjectives
//! `chat` 10, `default` 0, `batch` -1, in a 20/20/60 mix) at 1×, 1.5× and 2×
//! the pool's capacity, Poisson arrivals through a real Envoy to simulated
//! model servers that answer as vLLM does (headers at admission, tokens
//! later). TTFT (request sent → first token) by priority, and how each
//! request ended, for two policies measured in the same run:
//!
//! - `no-wait`: `minimize: QueueDepth` with a random tie-break; whatever
//!   arrives goes to an engine and waits in its queue.
//! - `wait`: a Pod is full at as many requests in flight as it has slots
//!   (`InFlight`); a request that finds every Pod full waits in the EPP by
//!   priority (`onEmpty: Wait`, `maxWait: 10s`, `flowControl.maxRequests`).
//! - `reserve`: `wait`, but priorities 0 and below count a Pod full one slot
//!   earlier, so a positive priority seldom waits for a slot to free.
//!
//! The unloaded row (0.25× capacity, `wait` policy) is the reference each
//! loaded p90 is divided by.
//!
//! ```text
//! cargo bench -p kinference-epp --bench flow_control
//! cargo bench -p kinference-epp --bench flow_control -- --seconds 10 --seed 7
//! ```

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{flags, gateway, percentile, start_epp};
use kinference_simulator::{SimConfig, SimHandle};
use kinference_testbed::envoy::Template;
use kinference_testbed::priorities::{POSITIVE_PRIORITY, arrivals, waiting_rule};

const MODEL: &str = "llama-3-8b";
const SERVERS: usize = 2;
const SLOTS: usize = 4;
const DECODE_TOKENS_PER_SEC: f64 = 100.0;
const BASE_LATENCY_MS: f64 = 20.0;
const OUTPUT_TOKENS: u32 = 40;
/// Requests waiting in the EPP at once, all priorities.
const MAX_WAITING: usize = 48;

/// (objective, priority, share of the arrivals).
const PRIORITIES: [(&str, i32, f64); 3] =
    [("chat", 10, 0.2), ("default", 0, 0.2), ("batch", -1, 0.6)];

const POOL: &str = "pool: { selector: { app: sim }, targetPorts: [{ number: 8000 }] }\n";

fn no_wait() -> String {
    format!(
        "{POOL}rules:\n  - name: no-wait\n    route:\n      select: [{{ minimize: QueueDepth }}]\n      tieBreak: Random\n"
    )
}

fn wait() -> String {
    let rule = waiting_rule("wait", "", SLOTS);
    format!("{POOL}flowControl: {{ maxRequests: {MAX_WAITING} }}\nrules:\n{rule}")
}

/// `wait`, with one slot of each Pod kept for positive priorities: the
/// others wait while a Pod has one slot left.
fn wait_reserving() -> String {
    let priority = waiting_rule("priority", POSITIVE_PRIORITY, SLOTS);
    let rest = waiting_rule("rest", "", SLOTS - 1);
    format!("{POOL}flowControl: {{ maxRequests: {MAX_WAITING} }}\nrules:\n{priority}{rest}")
}

/// Requests a second the pool serves at most: every slot busy, each answer
/// taking its decode time and the base latency (the prompts are short).
fn capacity() -> f64 {
    let service = BASE_LATENCY_MS / 1e3 + f64::from(OUTPUT_TOKENS) / DECODE_TOKENS_PER_SEC;
    (SERVERS * SLOTS) as f64 / service
}

struct Planned {
    at: Duration,
    priority: usize,
    body: Arc<String>,
}

fn workload(rate: f64, seconds: f64, seed: u64) -> Vec<Planned> {
    let shares: Vec<f64> = PRIORITIES.iter().map(|&(_, _, share)| share).collect();
    arrivals(rate, seconds, &shares, seed)
        .into_iter()
        .enumerate()
        .map(|(i, arrival)| {
            let at = arrival.at.as_secs_f64();
            let body = serde_json::json!({
                "model": MODEL,
                "messages": [{ "role": "user", "content": format!("question {i} of {at:.3}") }],
                "max_tokens": OUTPUT_TOKENS,
                "stream": true,
            });
            Planned {
                at: arrival.at,
                priority: arrival.class,
                body: Arc::new(body.to_string()),
            }
        })
        .collect()
}

/// How one priority's requests ended.
#[derive(Default)]
struct Band {
    ttfts_ms: Vec<f64>,
    shed: usize,
    expired: usize,
    other: usize,
}

async fn run(policy: &str, plan: &[Planned]) -> anyhow::Result<Vec<Band>> {
    let mut sims: Vec<SimHandle> = Vec::new();
    for i in 0..SERVERS {
        let config = SimConfig {
            max_concurrency: SLOTS,
            decode_tokens_per_sec: DECODE_TOKENS_PER_SEC,
            base_latency_ms: BASE_LATENCY_MS,
            time_scale: 1.0,
            ..SimConfig::new(format!("sim-{i}"), [MODEL])
        };
        sims.push(kinference_simulator::spawn(config, "127.0.0.1:0".parse()?).await?);
    }
    let (addr, epp) = start_epp(policy, MODEL, &sims).await?;
    epp.epp.picker.objectives().replace(
        PRIORITIES
            .iter()
            .map(|&(name, priority, _)| (name.to_string(), priority))
            .collect::<HashMap<_, _>>(),
    );
    let (envoy, client) = gateway(Template::Streamed, addr, &sims).await?;
    let url = envoy.url("/v1/chat/completions");
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(plan.len());
    for p in plan {
        tokio::time::sleep_until(start + p.at).await;
        let req = client
            .post(&url)
            .header("content-type", "application/json")
            .header("x-gateway-inference-objective", PRIORITIES[p.priority].0)
            .body(p.body.as_bytes().to_vec());
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let mut resp = req.send().await.map_err(|_| 0u16)?;
            let status = resp.status().as_u16();
            if status != 200 {
                return Err(status);
            }
            // The first chunk with a token: a stream's first `data:` event.
            // The answer is read to its end: a client that left would free
            // its slot early.
            let mut ttft = None;
            while let Some(chunk) = resp.chunk().await.map_err(|_| 0u16)? {
                if ttft.is_none() && chunk.windows(5).any(|w| w == b"data:") {
                    ttft = Some(sent.elapsed());
                }
            }
            ttft.ok_or(0)
        }));
    }
    let mut bands: Vec<Band> = PRIORITIES.iter().map(|_| Band::default()).collect();
    for (p, t) in plan.iter().zip(tasks) {
        let band = &mut bands[p.priority];
        match t.await? {
            Ok(ttft) => band.ttfts_ms.push(ttft.as_secs_f64() * 1e3),
            Err(429) => band.shed += 1,
            Err(503) => band.expired += 1,
            Err(_) => band.other += 1,
        }
    }
    for band in &mut bands {
        band.ttfts_ms.sort_by(f64::total_cmp);
    }
    envoy.stop().await;
    let _ = epp.stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(2), epp.server).await;
    epp.scraper.abort();
    for s in &sims {
        s.shutdown().await;
    }
    Ok(bands)
}

fn main() -> anyhow::Result<()> {
    let flags = flags();
    let num = |name: &str| flags.get(name).and_then(|v| v.parse::<f64>().ok());
    let seconds = num("seconds").unwrap_or(20.0);
    let seed = num("seed").map_or(42, |s| s as u64);
    let capacity = capacity();
    println!(
        "## {SERVERS} servers × {SLOTS} slots, {OUTPUT_TOKENS} output tokens at {DECODE_TOKENS_PER_SEC:.0} tok/s + {BASE_LATENCY_MS:.0} ms: capacity {capacity:.1} req/s; \
         priorities {PRIORITIES:?} (objective, priority, share); {seconds:.0} s of Poisson arrivals per row; wait policy: maxRequests {MAX_WAITING}, maxWait 10s"
    );
    println!(
        "{:<8} {:<8} {:<9} {:>6} {:>9} {:>9} {:>11} {:>6} {:>8} {:>6}",
        "load",
        "policy",
        "priority",
        "ok",
        "p50 ms",
        "p90 ms",
        "p90/unload",
        "shed",
        "expired",
        "other"
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut unloaded: Vec<f64> = Vec::new();
        let mut rows = vec![(0.25, "wait", wait())];
        for load in [1.0, 1.5, 2.0] {
            rows.push((load, "no-wait", no_wait()));
            rows.push((load, "wait", wait()));
            rows.push((load, "reserve", wait_reserving()));
        }
        for (load, name, policy) in &rows {
            let plan = workload(load * capacity, seconds, seed);
            let bands = run(policy, &plan).await?;
            if unloaded.is_empty() {
                unloaded = bands.iter().map(|b| percentile(&b.ttfts_ms, 0.9)).collect();
            }
            for (i, band) in bands.iter().enumerate() {
                let p90 = percentile(&band.ttfts_ms, 0.9);
                println!(
                    "{:<8} {:<8} {:<9} {:>6} {:>9.0} {:>9.0} {:>10.2}× {:>6} {:>8} {:>6}",
                    format!("{load}×"),
                    name,
                    PRIORITIES[i].1,
                    band.ttfts_ms.len(),
                    percentile(&band.ttfts_ms, 0.5),
                    p90,
                    p90 / unloaded[i],
                    band.shed,
                    band.expired,
                    band.other
                );
            }
        }
        anyhow::Ok(())
    })
}
