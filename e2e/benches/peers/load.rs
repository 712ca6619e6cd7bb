//! The load: closed and open loops of requests through a target, and
//! what each request came back with.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use kinference_testbed::http_client::{Answer, HttpClient};
use kinference_testbed::load::{
    Clocks, Outcome, Phase, PhaseSpec, Tally, Turn, Window, cpu, ms, quantile,
};
use kinference_testbed::proc_status::{peak_rss_bytes, rss_bytes};

use super::settings::{GROUPS, Mode, THREADS};
use super::workloads::{BodySet, GroupRequests, OPEN};

/// Where a phase's requests go.
#[derive(Clone)]
pub(crate) enum Target {
    /// Through a gateway.
    Url(Arc<str>),
    /// Straight to the simulators, request `i` to simulator `i % n`.
    RoundRobin(Arc<[String]>),
}

impl Target {
    pub(crate) fn url(&self, id: u64) -> &str {
        match self {
            Target::Url(u) => u,
            Target::RoundRobin(urls) => &urls[id as usize % urls.len()],
        }
    }
}

pub(crate) async fn send(http: &HttpClient, url: &str, body: &Arc<Vec<u8>>) -> Result<Answer> {
    http.post_json(url, body.as_ref().clone()).await
}

#[derive(Default)]
pub(crate) struct Outcomes {
    pub(crate) tally: Tally,
    pub(crate) first_bytes: Vec<Duration>,
    /// Of an open loop's requests, those sent [`COLD_START`] or more after
    /// its first: what a picker does once the pool's caches are warm.
    pub(crate) warm_first_bytes: Vec<Duration>,
    /// Simulator → what it served.
    pub(crate) served: BTreeMap<String, Served>,
    /// Prompt tokens of the answers that reported usage, and how many of
    /// them the simulators had cached.
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
}

/// What one simulator served in a phase.
#[derive(Default)]
pub(crate) struct Served {
    pub(crate) first_bytes: Vec<Duration>,
    /// Prompt tokens the engine prefilled, per answer that reported usage.
    pub(crate) uncached: Vec<u64>,
    /// Shared-prefix group → its requests here.
    pub(crate) groups: BTreeMap<usize, GroupServed>,
}

/// One shared-prefix group's requests on one simulator.
#[derive(Default)]
pub(crate) struct GroupServed {
    pub(crate) requests: u64,
    /// Prompt tokens the engine prefilled, per answer that reported usage.
    pub(crate) uncached: Vec<u64>,
}

impl Served {
    pub(crate) fn merge(&mut self, other: Served) {
        self.first_bytes.extend(other.first_bytes);
        self.uncached.extend(other.uncached);
        for (g, o) in other.groups {
            let mine = self.groups.entry(g).or_default();
            mine.requests += o.requests;
            mine.uncached.extend(o.uncached);
        }
    }

    /// `142 req, TTFT p90 28 ms, prefilled p50/p90 9/41 tokens, groups
    /// 1×53 (p90 41) 3×48 (p90 12)`: where a phase's time went, to tell
    /// queueing from prefill (a partly evicted prefix, questions the
    /// engine no longer holds), and which group paid it.
    pub(crate) fn summary(&self) -> String {
        let mut first = self.first_bytes.clone();
        first.sort_unstable();
        let groups = self
            .groups
            .iter()
            .map(|(g, o)| {
                format!(
                    "{g}×{} (p90 {})",
                    o.requests,
                    token_quantile(&o.uncached, 0.9)
                )
            })
            .collect::<Vec<_>>()
            .join(" ");
        format!(
            "{} req, TTFT p90 {:.0} ms, prefilled p50/p90 {}/{} tokens, groups {groups}",
            first.len(),
            ms(quantile(&first, 0.9)),
            token_quantile(&self.uncached, 0.5),
            token_quantile(&self.uncached, 0.9)
        )
    }
}

/// The `q` quantile of token counts, `-` when there are none.
pub(crate) fn token_quantile(tokens: &[u64], q: f64) -> String {
    if tokens.is_empty() {
        return "-".to_string();
    }
    let mut sorted = tokens.to_vec();
    sorted.sort_unstable();
    quantile(&sorted, q).to_string()
}

impl Outcome for Outcomes {
    fn tally(&mut self) -> &mut Tally {
        &mut self.tally
    }

    fn merge(&mut self, other: Self) {
        self.tally.merge(other.tally);
        self.first_bytes.extend(other.first_bytes);
        self.warm_first_bytes.extend(other.warm_first_bytes);
        for (k, v) in other.served {
            self.served.entry(k).or_default().merge(v);
        }
        self.prompt_tokens += other.prompt_tokens;
        self.cached_tokens += other.cached_tokens;
    }
}

impl Outcomes {
    /// One answer; `group` is its shared-prefix group, if it has one, and
    /// `warm` whether it was sent after the cold start.
    pub(crate) fn record(
        &mut self,
        result: Result<Answer>,
        latency: Duration,
        group: Option<usize>,
        warm: bool,
    ) {
        match result {
            Ok(a) => {
                self.tally.latencies.push(latency);
                self.first_bytes.push(a.first_byte);
                if warm {
                    self.warm_first_bytes.push(a.first_byte);
                }
                if let Some(u) = a.usage {
                    self.prompt_tokens += u.prompt_tokens;
                    self.cached_tokens += u.cached_tokens;
                }
                let served = self.served.entry(a.server).or_default();
                served.first_bytes.push(a.first_byte);
                let uncached = a
                    .usage
                    .map(|u| u.prompt_tokens.saturating_sub(u.cached_tokens));
                served.uncached.extend(uncached);
                if let Some(g) = group {
                    let group = served.groups.entry(g).or_default();
                    group.requests += 1;
                    group.uncached.extend(uncached);
                }
            }
            Err(e) => self.tally.error(e),
        }
    }

    /// The share of prompt tokens the simulators reported cached, when
    /// they report usage.
    pub(crate) fn cache_hit_share(&self) -> Option<f64> {
        (self.prompt_tokens > 0).then(|| self.cached_tokens as f64 / self.prompt_tokens as f64)
    }

    /// How many simulators served each shared-prefix group, on average:
    /// 1 keeps every group's prefix in one cache.
    pub(crate) fn pods_per_group(&self) -> Option<f64> {
        let pods: usize = self.served.values().map(|s| s.groups.len()).sum();
        let groups = self
            .served
            .values()
            .flat_map(|s| s.groups.keys())
            .collect::<BTreeSet<_>>()
            .len();
        (groups > 0).then(|| pods as f64 / groups as f64)
    }
}

/// What one phase measured.
pub(crate) struct Measured {
    pub(crate) out: Outcomes,
    pub(crate) window: Window<GROUPS>,
    /// EPP and Envoy CPU over the window.
    pub(crate) epp_cpu: Duration,
    pub(crate) envoy_cpu: Duration,
    /// EPP resident memory at the end of the phase, and its peak so far.
    pub(crate) epp_rss: Option<(u64, u64)>,
}

impl Measured {
    pub(crate) fn measured(&self) -> u64 {
        self.out.tally.measured()
    }

    pub(crate) fn q(&self, q: f64) -> f64 {
        ms(self.out.tally.quantile(q))
    }

    pub(crate) fn rps(&self) -> f64 {
        self.window.rps(self.measured())
    }
}

/// The pids a phase reads CPU from.
#[derive(Clone, Copy)]
pub(crate) struct Pids {
    pub(crate) epp: Option<u32>,
    pub(crate) envoy: Option<u32>,
}

/// Closed loop: `spec.concurrency` clients send `bodies` in turn.
pub(crate) async fn closed_loop(
    http: &HttpClient,
    target: &Target,
    bodies: &BodySet,
    spec: PhaseSpec,
    pids: Pids,
) -> Measured {
    let envoy_before = pids.envoy.map_or(Duration::ZERO, cpu::process_cpu);
    let phase = Arc::new(Phase::new(&spec, Clocks::new(THREADS).with_child(pids.epp)));
    let mut tasks = Vec::with_capacity(spec.concurrency);
    for _ in 0..spec.concurrency {
        let (http, target, bodies, phase) =
            (http.clone(), target.clone(), bodies.clone(), phase.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Outcomes::default();
            while let Some(Turn { id, measured }) = phase.next() {
                let body = bodies[id as usize % bodies.len()].clone();
                let started = Instant::now();
                let result = send(&http, target.url(id), &body).await;
                if measured {
                    phase.completed();
                    out.record(result, started.elapsed(), None, false);
                }
            }
            out
        }));
    }
    let (out, window) = phase.join(tasks).await;
    finish(out, window, pids, envoy_before)
}

pub(crate) fn finish(
    out: Outcomes,
    window: Window<GROUPS>,
    pids: Pids,
    envoy_before: Duration,
) -> Measured {
    let envoy_cpu = pids.envoy.map_or(Duration::ZERO, |p| {
        cpu::process_cpu(p).saturating_sub(envoy_before)
    });
    let epp_rss = pids
        .epp
        .and_then(|p| Some((rss_bytes(p)?, peak_rss_bytes(p)?)));
    Measured {
        out,
        epp_cpu: window.cpu.child,
        window,
        envoy_cpu,
        epp_rss,
    }
}

/// How long an open loop's start lasts. A workload's first rate starts from
/// cold caches: each group's first prompt prefills in about 1.5 s on these
/// simulators, and the queues those prefills build must drain. Every picker
/// pays that; the TTFT of the requests sent after it tells the pickers'
/// steady states apart. (A later rate starts from the last one's caches
/// and queues.)
pub(crate) const COLD_START: Duration = Duration::from_secs(3);

/// Open loop: requests start at Poisson-distributed times at `rate` per
/// second for `duration`, whatever the answers take (as inference-perf's
/// rate stages do).
pub(crate) async fn open_loop(
    http: &HttpClient,
    target: &Target,
    requests: &GroupRequests,
    rate: f64,
    duration: Duration,
    pids: Pids,
) -> Measured {
    let envoy_before = pids.envoy.map_or(Duration::ZERO, cpu::process_cpu);
    let count = (rate * duration.as_secs_f64()).ceil() as u64;
    let spec = PhaseSpec {
        concurrency: 1,
        warmup: 0,
        requests: count,
        max_time: duration * 4,
    };
    let phase = Arc::new(Phase::new(&spec, Clocks::new(THREADS).with_child(pids.epp)));
    let mut arrivals = Poisson::new(rate, 0x5EED ^ rate.to_bits());
    let start = tokio::time::Instant::now();
    let mut at = Duration::ZERO;
    let mut tasks = Vec::with_capacity(count as usize);
    while let Some(Turn { id, .. }) = phase.next() {
        at += arrivals.next_gap();
        tokio::time::sleep_until(start + at).await;
        let (http, target, phase) = (http.clone(), target.clone(), phase.clone());
        let (group, body) = requests[id as usize % requests.len()].clone();
        let warm = at >= COLD_START;
        tasks.push(tokio::spawn(async move {
            let mut out = Outcomes::default();
            let started = Instant::now();
            let result = send(&http, target.url(id), &body).await;
            phase.completed();
            out.record(result, started.elapsed(), Some(group), warm);
            out
        }));
    }
    let (mut out, window) = phase.join(tasks).await;
    out.first_bytes.sort_unstable();
    out.warm_first_bytes.sort_unstable();
    finish(out, window, pids, envoy_before)
}

/// Exponential inter-arrival gaps from a xorshift generator.
pub(crate) struct Poisson {
    pub(crate) rate: f64,
    pub(crate) state: u64,
}

impl Poisson {
    pub(crate) fn new(rate: f64, seed: u64) -> Poisson {
        Poisson {
            rate,
            state: seed | 1,
        }
    }

    pub(crate) fn next_gap(&mut self) -> Duration {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        let u = ((self.state >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        Duration::from_secs_f64(-u.ln() / self.rate)
    }
}

// ---------------------------------------------------------------------------
// Workloads.
// ---------------------------------------------------------------------------

pub(crate) struct Plan {
    pub(crate) chat_requests: u64,
    pub(crate) chat_warmup: u64,
    pub(crate) large_requests: u64,
    pub(crate) large_warmup: u64,
    /// (c), (d), (e) in the order of [`OPEN_WORKLOADS`]: Poisson rates
    /// (req/s), and how long each rate lasts.
    pub(crate) open_rates: [Vec<f64>; OPEN],
    pub(crate) open_stage: Duration,
    /// How long each of (f)'s rates lasts (the rates are (c)'s).
    pub(crate) inference_perf_stage: Duration,
    pub(crate) max_time: Duration,
}

impl Plan {
    pub(crate) fn with_prefix_rates(mut self, rates: &[f64]) -> Plan {
        if !rates.is_empty() {
            self.open_rates[0] = rates.to_vec();
        }
        self
    }

    pub(crate) fn with_hot_rates(mut self, rates: &[f64]) -> Plan {
        if !rates.is_empty() {
            self.open_rates[3] = rates.to_vec();
        }
        self
    }

    pub(crate) fn new(mode: Mode) -> Plan {
        match mode {
            Mode::Smoke => Plan {
                chat_requests: 40,
                chat_warmup: 10,
                large_requests: 20,
                large_warmup: 5,
                open_rates: [vec![4.0], vec![20.0], vec![2.0], vec![4.0], vec![4.0]],
                open_stage: Duration::from_secs(2),
                inference_perf_stage: Duration::from_secs(3),
                max_time: Duration::from_secs(30),
            },
            Mode::Full => Plan {
                chat_requests: 3_000,
                chat_warmup: 300,
                large_requests: 600,
                large_warmup: 150,
                open_rates: [
                    // Round-robin thrashes the caches and saturates near
                    // 20/s; prefix-aware routing keeps every prompt cached
                    // somewhere.
                    vec![8.0, 16.0, 24.0],
                    // About 120 ms a request (38 ms of prefill, 80 of
                    // decode) on 16 slots: saturation near 130/s.
                    vec![40.0, 80.0, 120.0],
                    // About 2.7 s a request (2.56 s of decode) on 16 slots:
                    // saturation near 6/s.
                    vec![2.0, 4.0, 6.0],
                    // (c)'s middle rate.
                    vec![16.0],
                    // Short requests (about 120 ms on a slot), so the
                    // adapters' slots, not the prefill, are what is short.
                    vec![20.0, 40.0, 60.0],
                ],
                open_stage: Duration::from_secs(12),
                inference_perf_stage: Duration::from_secs(20),
                max_time: Duration::from_secs(120),
            },
        }
    }

    pub(crate) fn closed(&self, concurrency: usize, warmup: u64, requests: u64) -> PhaseSpec {
        PhaseSpec {
            concurrency,
            warmup,
            requests,
            max_time: self.max_time,
        }
    }
}
