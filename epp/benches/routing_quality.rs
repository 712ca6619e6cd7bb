//! Routing quality on the simulator: the same shared-prefix workload, with
//! Poisson arrivals, through a real Envoy (the pinned release of
//! `kinference_testbed::envoy`) to simulated model servers, once per policy;
//! p50/p90/p99 TTFT as the client sees it (request sent → first streamed
//! byte) and the ratio to round-robin.
//!
//! ```text
//! cargo bench -p kinference-epp --bench routing_quality
//! cargo bench -p kinference-epp --bench routing_quality -- --quick
//! cargo bench -p kinference-epp --bench routing_quality -- --requests 800 --rate 24 --seed 7
//! ```
//!
//! The numbers are for the EPP as shipped: `Settings { secure_serving: true,
//! ..Default::default() }` (what the binary builds from its default flags),
//! behind Envoy configured as the Inference Extension's reference chart
//! configures it (`Template::Streamed`: ext_proc over TLS with
//! `FULL_DUPLEX_STREAMED` bodies, an `ORIGINAL_DST` cluster). The bench does
//! nothing the binary does not do; in particular the EPP's prefix index is
//! sized only as the binary sizes it, from each server's scraped KV-cache
//! size (`cache_config_info`), and keeps its default capacity until then.
//!
//! Policies:
//! - `round-robin`: no EPP at all — Envoy's own `ROUND_ROBIN` over a static
//!   pool cluster (`Template::Static`), the baseline users compare against.
//! - `random`: `select: [{ type: Local }]` (an unranked tier) with
//!   `tieBreak: Random`.
//! - `least-queue`: `minimize: QueueDepth`, `tieBreak: Random` among equal
//!   queues (without it every tie goes to the first server).
//! - `predicted-ttft`: `minimize: PredictedTTFT`.
//!
//! Each run starts from fresh servers (cold caches), a fresh Envoy and (for
//! the EPP policies) a fresh EPP; the first `warmup` requests are not
//! measured. Which server answered comes from the simulator's `x-sim-server`
//! response header.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kinference_epp::predict::DEFAULT_BLOCKS_PER_ENDPOINT;
use kinference_simulator::{SimConfig, SimHandle};
use kinference_testbed::envoy::Template;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;

use common::{flags, gateway, percentile, start_epp};

const MODEL: &str = "llama-3-8b";

/// The simulated fleet and the workload.
#[derive(Debug, Clone)]
struct Scenario {
    name: &'static str,
    servers: usize,
    /// Running slots per server.
    slots: usize,
    prefill_tokens_per_sec: f64,
    decode_tokens_per_sec: f64,
    base_latency_ms: f64,
    /// Prefix cache per server, in 64-character blocks.
    cache_blocks: usize,
    /// Prompt families; each has its own long shared prefix.
    families: usize,
    prefix_chars: usize,
    suffix_chars: usize,
    max_tokens: u32,
    /// Mean arrivals per second (Poisson).
    rate: f64,
    requests: usize,
    warmup: usize,
}

impl Scenario {
    fn describe(&self) -> String {
        format!(
            "{} servers × {} slots, prefill {:.0} tok/s, decode {:.0} tok/s, base {:.0} ms; \
             {} families × {}-token shared prefix + {}-token unique suffix, {} output tokens; \
             prefix cache {} blocks/server (≈ {} prefixes; EPP prefix index sized from the scraped cache, {} blocks/endpoint before the first scrape); \
             Poisson {:.0} req/s; {} requests ({} warm-up)",
            self.servers,
            self.slots,
            self.prefill_tokens_per_sec,
            self.decode_tokens_per_sec,
            self.base_latency_ms,
            self.families,
            self.prefix_chars / 4,
            self.suffix_chars / 4,
            self.max_tokens,
            self.cache_blocks,
            self.cache_blocks / (self.prefix_chars / 64 + 1),
            DEFAULT_BLOCKS_PER_ENDPOINT,
            self.rate,
            self.requests,
            self.warmup
        )
    }
}

struct Policy {
    name: &'static str,
    /// The EPP's rules; `None`: no EPP, Envoy's own round-robin.
    yaml: Option<&'static str>,
}

const POOL: &str = "pool: { selector: { app: sim }, targetPorts: [{ number: 8000 }] }\n";

const POLICIES: &[Policy] = &[
    Policy {
        name: "round-robin",
        yaml: None,
    },
    Policy {
        name: "random",
        yaml: Some(
            "rules:\n  - name: random\n    route:\n      select: [{ type: Local }]\n      tieBreak: Random\n",
        ),
    },
    Policy {
        name: "least-queue",
        yaml: Some(
            "rules:\n  - name: least-queue\n    route:\n      select: [{ minimize: QueueDepth }]\n      tieBreak: Random\n",
        ),
    },
    Policy {
        name: "predicted-ttft",
        yaml: Some(
            "rules:\n  - name: predicted\n    route:\n      select: [{ minimize: PredictedTTFT }]\n",
        ),
    },
];

/// One request of the workload: when it arrives and what it sends.
struct Planned {
    at: Duration,
    body: Arc<String>,
}

/// Words for prompt text (plain prose; no classifier runs in these policies).
const WORDS: &[&str] = &[
    "river", "stone", "garden", "window", "ledger", "copper", "signal", "harbor", "meadow",
    "lantern", "orbit", "canvas", "thread", "market", "summit", "engine", "valley", "beacon",
    "parcel", "quartz", "timber", "violet", "walnut", "anchor", "bridge", "cinder", "drift",
    "ember", "fabric", "glacier",
];

fn text(rng: &mut StdRng, chars: usize) -> String {
    let mut s = String::with_capacity(chars + 16);
    while s.len() < chars {
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
        s.push(' ');
    }
    s.truncate(chars);
    s
}

fn workload(sc: &Scenario, seed: u64) -> Vec<Planned> {
    let mut rng = StdRng::seed_from_u64(seed);
    let prefixes: Vec<String> = (0..sc.families)
        .map(|f| {
            format!(
                "System prompt of family {f}.\n{}",
                text(&mut rng, sc.prefix_chars)
            )
        })
        .collect();
    let mut at = 0.0f64;
    (0..sc.requests)
        .map(|i| {
            // Exponential inter-arrival times: a Poisson process.
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            at += -u.ln() / sc.rate;
            let family = rng.random_range(0..sc.families);
            let body = serde_json::json!({
                "model": MODEL,
                "messages": [
                    { "role": "system", "content": prefixes[family] },
                    { "role": "user", "content": format!("Request {i}: {}", text(&mut rng, sc.suffix_chars)) },
                ],
                "max_tokens": sc.max_tokens,
                "stream": true,
            });
            Planned {
                at: Duration::from_secs_f64(at),
                body: Arc::new(body.to_string()),
            }
        })
        .collect()
}

#[derive(Debug)]
struct RunResult {
    ttfts_ms: Vec<f64>,
    errors: usize,
    cached_fraction: f64,
    per_server: Vec<u64>,
}

async fn run(sc: &Scenario, policy: &Policy, plan: &[Planned]) -> anyhow::Result<RunResult> {
    let mut sims: Vec<SimHandle> = Vec::new();
    for i in 0..sc.servers {
        let config = SimConfig {
            max_concurrency: sc.slots,
            prefill_tokens_per_sec: sc.prefill_tokens_per_sec,
            decode_tokens_per_sec: sc.decode_tokens_per_sec,
            base_latency_ms: sc.base_latency_ms,
            prefix_cache_blocks: sc.cache_blocks,
            time_scale: 1.0,
            ..SimConfig::new(format!("sim-{i}"), [MODEL])
        };
        sims.push(kinference_simulator::spawn(config, "127.0.0.1:0".parse()?).await?);
    }
    let names: Vec<String> = sims.iter().map(|s| s.name().to_string()).collect();

    let (template, epp) = match policy.yaml {
        // No EPP: Envoy balances the static pool cluster itself.
        None => (Template::Static, None),
        Some(yaml) => {
            let epp = start_epp(&format!("{POOL}{yaml}"), MODEL, &sims).await?;
            (Template::Streamed, Some(epp))
        }
    };
    // `Template::Static` has no ext_proc: its EPP address is never dialled.
    let epp_addr = epp
        .as_ref()
        .map_or(SocketAddr::from(([127, 0, 0, 1], 9)), |(a, _)| *a);
    let (envoy, client) = gateway(template, epp_addr, &sims).await?;
    let url = envoy.url("/v1/chat/completions");
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(plan.len());
    for p in plan {
        tokio::time::sleep_until(start + p.at).await;
        let req = client
            .post(&url)
            .header("content-type", "application/json")
            .body(p.body.as_bytes().to_vec());
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let mut resp = req.send().await.ok()?;
            if !resp.status().is_success() {
                return None;
            }
            let server = resp
                .headers()
                .get("x-sim-server")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)?;
            let mut ttft = None;
            while let Some(chunk) = resp.chunk().await.ok()? {
                if ttft.is_none() && !chunk.is_empty() {
                    ttft = Some(sent.elapsed());
                }
            }
            Some((ttft?, server))
        }));
    }
    let mut ttfts_ms = Vec::new();
    let mut errors = 0;
    let mut per_server = vec![0u64; sims.len()];
    for (i, t) in tasks.into_iter().enumerate() {
        match t.await.ok().flatten() {
            Some((ttft, server)) => {
                match names.iter().position(|n| *n == server) {
                    Some(s) => per_server[s] += 1,
                    None => errors += 1,
                }
                if i >= sc.warmup {
                    ttfts_ms.push(ttft.as_secs_f64() * 1000.0);
                }
            }
            None => errors += 1,
        }
    }
    ttfts_ms.sort_by(f64::total_cmp);
    let stats: Vec<_> = sims.iter().map(|s| s.stats()).collect();
    let prompt: u64 = stats.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = stats.iter().map(|s| s.cached_prompt_tokens).sum();

    envoy.stop().await;
    if let Some((_, epp)) = epp {
        let _ = epp.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(2), epp.server).await;
        epp.scraper.abort();
    }
    for s in &sims {
        s.shutdown().await;
    }
    Ok(RunResult {
        ttfts_ms,
        errors,
        cached_fraction: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        per_server,
    })
}

fn main() -> anyhow::Result<()> {
    let flags = flags();
    let num = |name: &str| flags.get(name).and_then(|v| v.parse::<f64>().ok());
    let quick = flags.contains_key("quick");
    let seed = num("seed").map_or(42, |s| s as u64);
    let base = Scenario {
        name: "cache-limited",
        servers: 4,
        slots: 4,
        prefill_tokens_per_sec: 8_000.0,
        decode_tokens_per_sec: 100.0,
        base_latency_ms: 20.0,
        // 1,200 blocks ≈ 6 of the 3,000-token prefixes: each server holds a
        // third of the families, the four together hold them all.
        cache_blocks: 1_200,
        families: 16,
        prefix_chars: 12_000,
        suffix_chars: 200,
        max_tokens: 16,
        rate: num("rate").unwrap_or(24.0),
        requests: num("requests").map_or(if quick { 150 } else { 600 }, |n| n as usize),
        warmup: 0,
    };
    let base = Scenario {
        warmup: base.requests / 10,
        ..base
    };
    let mut scenarios = vec![base.clone()];
    if !quick && !flags.contains_key("only-limited") {
        scenarios.push(Scenario {
            name: "cache-ample",
            // Every server can hold every family: locality matters only
            // until each server has seen each family once.
            cache_blocks: 16_384,
            ..base.clone()
        });
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        for sc in &scenarios {
            println!("## scenario {}: {}", sc.name, sc.describe());
            println!(
                "{:<15} {:>9} {:>9} {:>9} {:>11} {:>10} {:>10}  requests per server",
                "policy", "p50 ms", "p90 ms", "p99 ms", "cached tok", "p50 vs RR", "p90 vs RR"
            );
            let plan = workload(sc, seed);
            let mut rr: Option<(f64, f64)> = None;
            for policy in POLICIES {
                let r = run(sc, policy, &plan).await?;
                let (p50, p90, p99) = (
                    percentile(&r.ttfts_ms, 0.5),
                    percentile(&r.ttfts_ms, 0.9),
                    percentile(&r.ttfts_ms, 0.99),
                );
                let (rr50, rr90) = *rr.get_or_insert((p50, p90));
                println!(
                    "{:<15} {:>9.1} {:>9.1} {:>9.1} {:>10.0}% {:>9.2}× {:>9.2}×  {:?}{}",
                    policy.name,
                    p50,
                    p90,
                    p99,
                    100.0 * r.cached_fraction,
                    rr50 / p50,
                    rr90 / p90,
                    r.per_server,
                    if r.errors > 0 {
                        format!("  ({} errors)", r.errors)
                    } else {
                        String::new()
                    }
                );
            }
            println!();
        }
        anyhow::Ok(())
    })?;
    Ok(())
}
