//! Scrapes every endpoint's Prometheus `/metrics` on a short interval and
//! stores the load metrics the picker needs in the [`EndpointRegistry`].
//!
//! One task per endpoint, so a slow or dead server never delays the others;
//! the tasks are started and stopped as the registry's endpoint set changes.
//! A failed or timed-out scrape records nothing: the endpoint's last metrics
//! simply age out after the registry's staleness window, which is exactly the
//! signal the picker wants ("no metric attributes"). Every attempt, and every
//! failure by [`FailureReason`], is counted in [`ScrapeStats`], which the
//! EPP's `Metrics` renders on `/metrics`.
//!
//! # Metric names
//!
//! Each engine's names live in one table, an [`EngineMetrics`]: [`VLLM`],
//! [`SGLANG`] and [`TRT_LLM`]. A page is read through the table of the
//! engine whose waiting, running or KV-cache names it carries; when a page
//! carries several engines' names, [`ENGINES`] order decides (vLLM, then
//! SGLang, then TensorRT-LLM) and every field comes from that one engine.
//!
//! | Field            | vLLM                                                      | SGLang                    | Triton TensorRT-LLM                                                  |
//! |------------------|-----------------------------------------------------------|---------------------------|----------------------------------------------------------------------|
//! | `waiting`        | `vllm:num_requests_waiting`                               | `sglang:num_queue_reqs`   | `nv_trt_llm_request_metrics{request_type="waiting"}`                 |
//! | `running`        | `vllm:num_requests_running`                               | `sglang:num_running_reqs` | `nv_trt_llm_request_metrics{request_type="scheduled"}`               |
//! | `kv_cache_usage` | `vllm:kv_cache_usage_perc`, else `vllm:gpu_cache_usage_perc` | `sglang:token_usage`   | `nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}`, else `used`/`max` |
//! | LoRA fields      | `vllm:lora_requests_info` labels `running_lora_adapters`, `waiting_lora_adapters`, `max_lora` (the series with the largest value) | – | – |
//! | `block_size`, `num_gpu_blocks` | `vllm:cache_config_info` labels `block_size`, `num_gpu_blocks` | – | – |
//!
//! Counts are summed over all series of a name (so over `model_name` and
//! vLLM's data-parallel `engine` label); a KV-cache fraction takes the
//! maximum series, the conservative choice when several engines share a
//! server, and is clamped to 0..=1. NaN samples are ignored. A body with none
//! of the waiting, running or KV-cache names counts as a failed scrape
//! ([`FailureReason::Parse`]): reporting zeros would make an unknown server
//! look idle.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kinference_runtime::AbortOnDrop;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::prom::{self, Sample};
use super::registry::{Endpoint, EndpointRegistry, ScrapedMetrics};
use crate::lists::comma_separated;

/// Default scrape interval.
pub(crate) const DEFAULT_SCRAPE_INTERVAL: Duration = Duration::from_millis(50);

/// Default per-scrape timeout. Longer than the interval on purpose: a Python
/// model server under load can take a few tens of milliseconds to render its
/// metrics, and a late answer is still fresher than none. Ticks missed while
/// waiting are skipped, not queued.
pub(crate) const DEFAULT_SCRAPE_TIMEOUT: Duration = Duration::from_millis(200);

// ---------------------------------------------------------------------------
// Per-engine metric tables
// ---------------------------------------------------------------------------

/// A model-server engine whose metric names the EPP knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Engine {
    Vllm,
    Sglang,
    TrtLlm,
}

/// One metric series: samples of `name`, and when `label` is set only those
/// whose label `label.0` has the value `label.1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Series {
    pub name: &'static str,
    pub label: Option<(&'static str, &'static str)>,
}

impl Series {
    /// Every sample of `name`.
    pub const fn named(name: &'static str) -> Self {
        Self { name, label: None }
    }

    /// The samples of `name` whose label `key` is `value`.
    pub const fn labelled(name: &'static str, key: &'static str, value: &'static str) -> Self {
        Self {
            name,
            label: Some((key, value)),
        }
    }
}

/// Where an engine reports its KV-cache utilisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCacheSource {
    /// A 0..=1 gauge; the largest series wins.
    Fraction(Series),
    /// Used over total blocks, each summed over its series.
    Ratio { used: Series, total: Series },
}

/// vLLM's LoRA info gauge: its value is when it was last set, and the newest
/// series holds the current adapters in comma-separated labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraInfoNames {
    pub metric: &'static str,
    pub running_label: &'static str,
    pub waiting_label: &'static str,
    pub max_label: &'static str,
}

/// vLLM's cache-config info gauge: the values are labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfigNames {
    pub metric: &'static str,
    pub block_size_label: &'static str,
    pub num_gpu_blocks_label: &'static str,
}

/// How one engine names each load metric the picker needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineMetrics {
    pub engine: Engine,
    /// Requests queued, not yet running; summed over series.
    pub waiting: Series,
    /// Requests being served; summed over series.
    pub running: Series,
    /// KV-cache utilisation sources, best first: the first one present wins.
    pub kv_cache_usage: &'static [KvCacheSource],
    pub lora_info: Option<LoraInfoNames>,
    pub cache_config: Option<CacheConfigNames>,
}

/// vLLM (v0 and v1 engines).
pub const VLLM: EngineMetrics = EngineMetrics {
    engine: Engine::Vllm,
    waiting: Series::named("vllm:num_requests_waiting"),
    running: Series::named("vllm:num_requests_running"),
    kv_cache_usage: &[
        KvCacheSource::Fraction(Series::named("vllm:kv_cache_usage_perc")),
        // Deprecated name (vLLM < 0.9, and hidden after 0.10).
        KvCacheSource::Fraction(Series::named("vllm:gpu_cache_usage_perc")),
    ],
    lora_info: Some(LoraInfoNames {
        metric: "vllm:lora_requests_info",
        running_label: "running_lora_adapters",
        waiting_label: "waiting_lora_adapters",
        max_label: "max_lora",
    }),
    cache_config: Some(CacheConfigNames {
        metric: "vllm:cache_config_info",
        block_size_label: "block_size",
        num_gpu_blocks_label: "num_gpu_blocks",
    }),
};

/// SGLang.
pub const SGLANG: EngineMetrics = EngineMetrics {
    engine: Engine::Sglang,
    waiting: Series::named("sglang:num_queue_reqs"),
    running: Series::named("sglang:num_running_reqs"),
    kv_cache_usage: &[KvCacheSource::Fraction(Series::named("sglang:token_usage"))],
    lora_info: None,
    cache_config: None,
};

/// TensorRT-LLM behind Triton (the `tensorrtllm` backend's batch-manager
/// statistics).
pub(crate) const TRT_LLM: EngineMetrics = EngineMetrics {
    engine: Engine::TrtLlm,
    waiting: Series::labelled("nv_trt_llm_request_metrics", "request_type", "waiting"),
    running: Series::labelled("nv_trt_llm_request_metrics", "request_type", "scheduled"),
    kv_cache_usage: &[
        KvCacheSource::Fraction(Series::labelled(
            "nv_trt_llm_kv_cache_block_metrics",
            "kv_cache_block_type",
            "fraction",
        )),
        // Older backends have no `fraction`; used/max is the same quantity
        // (our inference from the block counters, not stated by the 003
        // protocol document).
        KvCacheSource::Ratio {
            used: Series::labelled(
                "nv_trt_llm_kv_cache_block_metrics",
                "kv_cache_block_type",
                "used",
            ),
            total: Series::labelled(
                "nv_trt_llm_kv_cache_block_metrics",
                "kv_cache_block_type",
                "max",
            ),
        },
    ],
    lora_info: None,
    cache_config: None,
};

/// Every engine, in precedence order for pages that carry several.
pub const ENGINES: [&EngineMetrics; 3] = [&VLLM, &SGLANG, &TRT_LLM];

/// The most KV-cache sources one engine has; accumulators are sized by it.
const MAX_KV_SOURCES: usize = 2;
const _: () = {
    assert!(
        ENGINES.len() <= u8::BITS as usize,
        "engine sets are u8 bit sets"
    );
    let mut i = 0;
    while i < ENGINES.len() {
        assert!(ENGINES[i].kv_cache_usage.len() <= MAX_KV_SOURCES);
        i += 1;
    }
};

/// The most metric names one table lists.
const MAX_NAMES: usize = 8;

impl EngineMetrics {
    /// Every metric name this table reads, in a fixed array (a name read by
    /// two fields appears twice), and how many there are; `const`, so the
    /// scraper's line filter is built at compile time.
    const fn name_array(&self) -> ([&'static str; MAX_NAMES], usize) {
        let mut out = [""; MAX_NAMES];
        out[0] = self.waiting.name;
        out[1] = self.running.name;
        let mut n = 2;
        let mut k = 0;
        while k < self.kv_cache_usage.len() {
            match &self.kv_cache_usage[k] {
                KvCacheSource::Fraction(f) => {
                    out[n] = f.name;
                    n += 1;
                }
                KvCacheSource::Ratio { used, total } => {
                    out[n] = used.name;
                    out[n + 1] = total.name;
                    n += 2;
                }
            }
            k += 1;
        }
        if let Some(l) = &self.lora_info {
            out[n] = l.metric;
            n += 1;
        }
        if let Some(c) = &self.cache_config {
            out[n] = c.metric;
            n += 1;
        }
        (out, n)
    }

    /// Every metric name this table reads.
    #[cfg(test)]
    fn metric_names(&self) -> impl Iterator<Item = &'static str> + use<> {
        let (names, n) = self.name_array();
        names.into_iter().take(n)
    }
}

/// Extracts the picker's load metrics from a Prometheus exposition; `None`
/// when it contains none of the known waiting, running or KV-cache names.
pub fn metrics_from_exposition(text: &str, scraped_at: Instant) -> Option<ScrapedMetrics> {
    let mut acc: [EngineAcc; ENGINES.len()] = Default::default();
    for s in prom::samples_where(text, is_interesting) {
        add_sample(&mut acc, &s);
    }
    let (table, acc) = ENGINES
        .iter()
        .zip(acc)
        .find(|(table, acc)| acc.recognised(table))?;
    Some(acc.finish(table, scraped_at))
}

/// Feeds one sample to the engines whose tables read its name.
fn add_sample(acc: &mut [EngineAcc; ENGINES.len()], s: &Sample<'_>) {
    if s.value.is_nan() {
        return;
    }
    let engines = engines_reading(s.name);
    let mut memo = Memo::new(s);
    for (i, (table, acc)) in ENGINES.iter().zip(acc.iter_mut()).enumerate() {
        if engines & (1 << i) != 0 {
            acc.add(table, &mut memo);
        }
    }
}

/// Every metric name in [`ENGINES`], once, with the engines reading it (bit
/// `i`: `ENGINES[i]`), built at compile time.
const KNOWN_NAMES: &[(&str, u8)] = KNOWN.0.split_at(KNOWN.1).0;

/// [`KNOWN_NAMES`] in a fixed array, and how much of it is used.
const KNOWN: ([(&str, u8); ENGINES.len() * MAX_NAMES], usize) = {
    const fn same(a: &str, b: &str) -> bool {
        let (a, b) = (a.as_bytes(), b.as_bytes());
        if a.len() != b.len() {
            return false;
        }
        let mut i = 0;
        while i < a.len() {
            if a[i] != b[i] {
                return false;
            }
            i += 1;
        }
        true
    }
    let mut out = [("", 0u8); ENGINES.len() * MAX_NAMES];
    let mut used = 0;
    let mut e = 0;
    while e < ENGINES.len() {
        let (names, n) = ENGINES[e].name_array();
        let mut k = 0;
        while k < n {
            let mut j = 0;
            while j < used && !same(out[j].0, names[k]) {
                j += 1;
            }
            if j == used {
                out[j].0 = names[k];
                used += 1;
            }
            out[j].1 |= 1 << e;
            k += 1;
        }
        e += 1;
    }
    (out, used)
};

/// Bit `n` is set when some name in [`ENGINES`] is `n` bytes long: most
/// lines of a page fail this before any string comparison.
const NAME_LENGTHS: u128 = {
    let mut bits = 0;
    let mut i = 0;
    while i < KNOWN_NAMES.len() {
        let len = KNOWN_NAMES[i].0.len();
        assert!(len < 128, "metric names are < 128 bytes");
        bits |= 1 << len;
        i += 1;
    }
    bits
};

/// The engines (bit `i`: `ENGINES[i]`) whose tables read `name`; 0 for the
/// many histogram and process lines of a page, which are then skipped right
/// after their name, before labels and value are parsed.
fn engines_reading(name: &str) -> u8 {
    if name.len() >= 128 || NAME_LENGTHS & (1 << name.len()) == 0 {
        return 0;
    }
    KNOWN_NAMES
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(0, |(_, engines)| *engines)
}

fn is_interesting(name: &str) -> bool {
    engines_reading(name) != 0
}

/// One sample with its last label lookup remembered: the tables filter a
/// name's series on one label key, so each sample parses its labels once.
struct Memo<'s, 'a> {
    sample: &'s Sample<'a>,
    key: Option<&'static str>,
    value: Option<Cow<'a, str>>,
}

impl<'s, 'a> Memo<'s, 'a> {
    fn new(sample: &'s Sample<'a>) -> Self {
        Self {
            sample,
            key: None,
            value: None,
        }
    }

    fn label(&mut self, key: &'static str) -> Option<&str> {
        if self.key != Some(key) {
            self.value = self.sample.label(key);
            self.key = Some(key);
        }
        self.value.as_deref()
    }

    fn is(&mut self, series: &Series) -> bool {
        self.sample.name == series.name
            && series.label.is_none_or(|(k, v)| self.label(k) == Some(v))
    }
}

/// One engine's running totals while walking the exposition once.
#[derive(Default)]
struct EngineAcc {
    waiting: Option<f64>,
    running: Option<f64>,
    /// Per KV source: the fraction's max, or the ratio's used sum.
    kv_a: [Option<f64>; MAX_KV_SOURCES],
    /// Per ratio KV source: the total sum.
    kv_b: [Option<f64>; MAX_KV_SOURCES],
    lora: Option<LoraSeen>,
    block_size: Option<u32>,
    num_gpu_blocks: Option<u64>,
}

impl LoraSeen {
    /// Adds a series stamped at the same time: the adapters of both, the
    /// larger bound.
    fn merge(&mut self, other: LoraSeen) {
        for adapter in other.running {
            if !self.running.contains(&adapter) {
                self.running.push(adapter);
            }
        }
        for adapter in other.waiting {
            if !self.waiting.contains(&adapter) {
                self.waiting.push(adapter);
            }
        }
        self.max = self.max.max(other.max);
    }
}

/// The newest LoRA info series seen so far.
struct LoraSeen {
    /// The sample value: when the engine last updated the info.
    stamp: f64,
    running: Vec<String>,
    waiting: Vec<String>,
    max: Option<u32>,
}

fn sum(slot: &mut Option<f64>, v: f64) {
    *slot = Some(slot.unwrap_or(0.0) + v);
}

fn max(slot: &mut Option<f64>, v: f64) {
    *slot = Some(slot.map_or(v, |old| old.max(v)));
}

/// Comma-separated adapter names, trimmed, empties dropped.
fn adapter_list(s: Option<Cow<'_, str>>) -> Vec<String> {
    s.map(|s| comma_separated(&s).map(str::to_string).collect())
        .unwrap_or_default()
}

impl EngineAcc {
    fn add(&mut self, t: &EngineMetrics, m: &mut Memo<'_, '_>) {
        let s = m.sample;
        let v = s.value;
        if m.is(&t.waiting) {
            sum(&mut self.waiting, v);
        }
        if m.is(&t.running) {
            sum(&mut self.running, v);
        }
        for (i, source) in t.kv_cache_usage.iter().enumerate() {
            match source {
                KvCacheSource::Fraction(f) => {
                    if m.is(f) {
                        max(&mut self.kv_a[i], v);
                    }
                }
                KvCacheSource::Ratio { used, total } => {
                    if m.is(used) {
                        sum(&mut self.kv_a[i], v);
                    }
                    if m.is(total) {
                        sum(&mut self.kv_b[i], v);
                    }
                }
            }
        }
        // Several LoRA info series coexist; the newest one is the truth.
        // Series as new as each other are merged: llm-d-inference-sim stamps
        // them in whole seconds, so an adapter that started running in the
        // second the idle series was written ties with it, and either one
        // alone could be the stale one.
        if let Some(l) = &t.lora_info
            && s.name == l.metric
        {
            let seen = LoraSeen {
                stamp: v,
                running: adapter_list(s.label(l.running_label)),
                waiting: adapter_list(s.label(l.waiting_label)),
                max: s.label(l.max_label).and_then(|m| m.trim().parse().ok()),
            };
            match &mut self.lora {
                Some(old) if v == old.stamp => old.merge(seen),
                Some(old) if v < old.stamp => {}
                _ => self.lora = Some(seen),
            }
        }
        if let Some(c) = &t.cache_config
            && s.name == c.metric
        {
            // Float-formatted integers ("16.0") occur in some versions.
            let int = |k: &str| {
                s.label(k)
                    .and_then(|x| x.trim().parse::<f64>().ok())
                    .filter(|x| x.is_finite() && *x >= 0.0)
            };
            if let Some(b) = int(c.block_size_label) {
                self.block_size = Some(b as u32);
            }
            if let Some(n) = int(c.num_gpu_blocks_label) {
                self.num_gpu_blocks = Some(n as u64);
            }
        }
    }

    /// The KV-cache utilisation from the first source present.
    fn kv_cache_usage(&self, t: &EngineMetrics) -> Option<f64> {
        t.kv_cache_usage
            .iter()
            .enumerate()
            .find_map(|(i, source)| match source {
                KvCacheSource::Fraction(_) => self.kv_a[i],
                KvCacheSource::Ratio { .. } => match (self.kv_a[i], self.kv_b[i]) {
                    (Some(used), Some(total)) if total > 0.0 => Some(used / total),
                    _ => None,
                },
            })
    }

    /// Whether the page carries this engine's waiting, running or KV names.
    fn recognised(&self, t: &EngineMetrics) -> bool {
        self.waiting.is_some() || self.running.is_some() || self.kv_cache_usage(t).is_some()
    }

    fn finish(self, t: &EngineMetrics, scraped_at: Instant) -> ScrapedMetrics {
        let kv = self.kv_cache_usage(t);
        let (running_loras, waiting_loras, max_lora) = match self.lora {
            Some(l) => (l.running, l.waiting, l.max),
            None => (Vec::new(), Vec::new(), None),
        };
        ScrapedMetrics {
            waiting: self.waiting.unwrap_or(0.0).max(0.0),
            running: self.running.unwrap_or(0.0).max(0.0),
            kv_cache_usage: kv.unwrap_or(0.0).clamp(0.0, 1.0),
            running_loras,
            waiting_loras,
            max_lora,
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            scraped_at,
            sent_at: scraped_at,
        }
    }
}

// ---------------------------------------------------------------------------
// Scrape counters
// ---------------------------------------------------------------------------

/// Why a scrape failed: the `reason` label of
/// `kinference_epp_scrape_failures_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureReason {
    /// No connection or no complete answer within the scrape timeout.
    Timeout,
    /// The connection could not be made (refused, unreachable, reset).
    Connect,
    /// The server answered with a non-success HTTP status.
    HttpStatus,
    /// The body carries none of a known engine's waiting, running or
    /// KV-cache metrics.
    Parse,
    /// Anything else, e.g. the connection broke while the body was read.
    Other,
}

impl FailureReason {
    pub const ALL: [FailureReason; 5] = [
        FailureReason::Timeout,
        FailureReason::Connect,
        FailureReason::HttpStatus,
        FailureReason::Parse,
        FailureReason::Other,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::Timeout => "timeout",
            FailureReason::Connect => "connect",
            FailureReason::HttpStatus => "http_status",
            FailureReason::Parse => "parse",
            FailureReason::Other => "other",
        }
    }

    fn of(e: &reqwest::Error) -> Self {
        // A connect timeout is both; it counts as a timeout.
        if e.is_timeout() {
            FailureReason::Timeout
        } else if e.is_connect() {
            FailureReason::Connect
        } else if e.is_status() {
            FailureReason::HttpStatus
        } else {
            FailureReason::Other
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed scrape.
#[derive(Debug)]
pub(crate) struct ScrapeError {
    reason: FailureReason,
    source: Option<reqwest::Error>,
}

impl ScrapeError {
    pub fn reason(&self) -> FailureReason {
        self.reason
    }
}

impl From<reqwest::Error> for ScrapeError {
    fn from(e: reqwest::Error) -> Self {
        Self {
            reason: FailureReason::of(&e),
            source: Some(e),
        }
    }
}

impl fmt::Display for ScrapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Some(e) => write!(f, "{}: {e}", self.reason),
            None => f.write_str("no recognised model-server metrics in the response"),
        }
    }
}

impl std::error::Error for ScrapeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

type ReasonLabel = [(&'static str, &'static str); 1];

/// Scrape counters. [`crate::metrics::Metrics`] owns one and renders it on
/// `/metrics` as `kinference_epp_scrape_attempts_total` and
/// `kinference_epp_scrape_failures_total{reason}`; hand
/// `Metrics::scrape_stats()` to [`spawn_scraper_with_stats`].
#[derive(Debug)]
pub struct ScrapeStats {
    /// Scrapes that produced metrics.
    pub ok: AtomicU64,
    /// Scrapes that failed, whatever the reason.
    pub failed: AtomicU64,
    attempts: Counter,
    failures: Family<ReasonLabel, Counter>,
    /// The `failures` children, by `FailureReason::ALL` index, so counting
    /// takes no lock.
    by_reason: [Counter; FailureReason::ALL.len()],
}

impl Default for ScrapeStats {
    fn default() -> Self {
        let failures = Family::<ReasonLabel, Counter>::default();
        // Created up front so every reason renders, at 0, from the start.
        let by_reason =
            FailureReason::ALL.map(|r| failures.get_or_create_owned(&[("reason", r.as_str())]));
        Self {
            ok: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            attempts: Counter::default(),
            failures,
            by_reason,
        }
    }
}

impl ScrapeStats {
    /// Adds the counters to `registry` (`scrape_attempts`, `scrape_failures`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "scrape_attempts",
            "Scrapes of model-server metrics started",
            self.attempts.clone(),
        );
        registry.register(
            "scrape_failures",
            "Model-server metric scrapes that failed, by reason",
            self.failures.clone(),
        );
    }

    /// Scrapes started.
    pub fn attempts(&self) -> u64 {
        self.attempts.get()
    }

    /// Scrapes that failed for `reason`.
    pub fn failures(&self, reason: FailureReason) -> u64 {
        self.by_reason[reason as usize].get()
    }

    fn attempt(&self) {
        self.attempts.inc();
    }

    fn succeeded(&self) {
        self.ok.fetch_add(1, Ordering::Relaxed);
    }

    fn failed(&self, reason: FailureReason) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        self.by_reason[reason as usize].inc();
    }
}

// ---------------------------------------------------------------------------
// The scrape loop
// ---------------------------------------------------------------------------

/// Starts the scraper with counters of its own, which reach no `/metrics`;
/// prefer [`spawn_scraper_with_stats`] with `Metrics::scrape_stats()`.
pub fn spawn_scraper(
    registry: Arc<EndpointRegistry>,
    interval: Duration,
    timeout: Duration,
) -> JoinHandle<()> {
    spawn_scraper_with_stats(
        registry,
        interval,
        timeout,
        Arc::new(ScrapeStats::default()),
    )
}

/// Starts the scraper: one task per registry endpoint, each fetching
/// `http://<address>/metrics` every `interval` with `timeout`, counting into
/// `stats`. Aborting the returned handle stops all of them.
pub fn spawn_scraper_with_stats(
    registry: Arc<EndpointRegistry>,
    interval: Duration,
    timeout: Duration,
    stats: Arc<ScrapeStats>,
) -> JoinHandle<()> {
    let client = scrape_client(timeout);
    tokio::spawn(async move {
        let mut changes = registry.changed();
        // Dropping this map (also when this task is aborted) aborts the
        // per-endpoint tasks.
        let mut workers: HashMap<String, Worker> = HashMap::new();
        loop {
            changes.borrow_and_update();
            let current = registry.endpoints();
            let mut live: HashMap<&str, &Arc<Endpoint>> =
                current.iter().map(|e| (e.name.as_str(), e)).collect();
            workers.retain(|name, w| {
                let keep = live
                    .get(name.as_str())
                    .is_some_and(|e| e.ip == w.endpoint.ip && e.port == w.endpoint.port);
                if !keep {
                    debug!(endpoint = %name, "stopping scrape task");
                }
                keep
            });
            live.retain(|name, _| !workers.contains_key(*name));
            for (name, ep) in live {
                debug!(endpoint = %name, address = %ep.address(), "starting scrape task");
                let task = tokio::spawn(scrape_loop(
                    client.clone(),
                    Arc::clone(&registry),
                    Arc::clone(ep),
                    interval,
                    timeout,
                    Arc::clone(&stats),
                ));
                workers.insert(
                    name.to_string(),
                    Worker {
                        endpoint: Arc::clone(ep),
                        _task: AbortOnDrop::new(task),
                    },
                );
            }
            if changes.changed().await.is_err() {
                // The registry (which owns the sender) is gone.
                return;
            }
        }
    })
}

struct Worker {
    endpoint: Arc<Endpoint>,
    /// Aborted when dropped: a removed endpoint stops being scraped.
    _task: AbortOnDrop<()>,
}

/// The HTTP client shared by all scrape tasks: plain HTTP/1.1 with
/// keep-alive (one idle connection per endpoint is all a periodic scrape
/// needs), and never a proxy — pod IPs are reachable directly, and an
/// `HTTP_PROXY` in the EPP's environment must not capture scrapes.
pub fn scrape_client(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .connect_timeout(timeout)
        .pool_max_idle_per_host(1)
        .pool_idle_timeout(Duration::from_secs(60))
        .build()
        .unwrap_or_else(|_| reqwest::Client::new())
}

async fn scrape_loop(
    client: reqwest::Client,
    registry: Arc<EndpointRegistry>,
    endpoint: Arc<Endpoint>,
    interval: Duration,
    timeout: Duration,
    stats: Arc<ScrapeStats>,
) {
    let address = endpoint.address();
    let url = format!("http://{address}/metrics");
    // Spread the endpoints over the interval so scrapes do not all fire
    // in the same instant after a (re)sync.
    let jitter_ms = interval.as_millis().min(1000) as u64;
    if jitter_ms > 0 {
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..jitter_ms))).await;
    }
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        ticker.tick().await;
        stats.attempt();
        match scrape_url(&client, &url, timeout).await {
            Ok(m) => {
                stats.succeeded();
                registry.set_metrics_at(&endpoint.name, &endpoint, m);
                if failing {
                    info!(endpoint = %endpoint.name, %address, "metrics scrape recovered");
                    failing = false;
                }
            }
            Err(error) => {
                stats.failed(error.reason());
                // Warn once per outage, not 20 times a second.
                if failing {
                    debug!(endpoint = %endpoint.name, %address, %error, "metrics scrape failed");
                } else {
                    warn!(endpoint = %endpoint.name, %address, %error,
                        "metrics scrape failed; metrics will go stale");
                    failing = true;
                }
            }
        }
    }
}

/// Scrapes one endpoint once (`address` is `ip:port`).
pub async fn scrape_once(
    client: &reqwest::Client,
    address: &str,
    timeout: Duration,
) -> anyhow::Result<ScrapedMetrics> {
    Ok(scrape_url(client, &format!("http://{address}/metrics"), timeout).await?)
}

async fn scrape_url(
    client: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> Result<ScrapedMetrics, ScrapeError> {
    let sent = Instant::now();
    let body = client
        .get(url)
        .timeout(timeout)
        // Ask for the classic text format; OpenMetrics sample lines parse too.
        .header(
            reqwest::header::ACCEPT,
            "text/plain;version=0.0.4;q=1,*/*;q=0.1",
        )
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?;
    let mut metrics = metrics_from_exposition(&body, Instant::now()).ok_or(ScrapeError {
        reason: FailureReason::Parse,
        source: None,
    })?;
    metrics.sent_at = sent;
    Ok(metrics)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shaped like a vLLM v1 `/metrics` page (trimmed), two engines.
    const VLLM: &str = r#"# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.37
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora, tweet-lora",waiting_lora_adapters=""} 1.7208e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters="x"} 1.7207e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",gpu_memory_utilization="0.9",num_gpu_blocks="27648"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 17.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 17.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.5
"#;

    const SGLANG: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen2.5-7B-Instruct"} 12.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="Qwen/Qwen2.5-7B-Instruct"} 51234.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen2.5-7B-Instruct"} 0.61
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen2.5-7B-Instruct"} 5.0
"#;

    const TRITON: &str = r#"# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="context",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 6
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 512
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 8
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 2
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 300
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="tensorrt_llm",version="1"} 900
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 1200
"#;

    #[test]
    fn vllm_exposition() {
        let now = Instant::now();
        let m = metrics_from_exposition(VLLM, now).unwrap();
        assert_eq!(m.waiting, 4.0);
        assert_eq!(m.running, 6.0);
        assert_eq!(m.kv_cache_usage, 0.42);
        assert_eq!(m.running_loras, ["sql-lora", "tweet-lora"]);
        assert!(m.waiting_loras.is_empty());
        assert_eq!(m.max_lora, Some(4));
        assert_eq!(m.block_size, Some(16));
        assert_eq!(m.num_gpu_blocks, Some(27648));
        assert_eq!(m.scraped_at, now);
    }

    #[test]
    fn vllm_legacy_gpu_cache_name_and_sums_across_models() {
        let text = "vllm:gpu_cache_usage_perc{model_name=\"a\"} 0.25\n\
                    vllm:num_requests_waiting{model_name=\"a\"} 2\n\
                    vllm:num_requests_waiting{model_name=\"lora-b\"} 5\n";
        let m = metrics_from_exposition(text, Instant::now()).unwrap();
        assert_eq!(m.kv_cache_usage, 0.25);
        assert_eq!(m.waiting, 7.0);
        assert_eq!(m.running, 0.0);
        assert_eq!(m.max_lora, None);
        // The new name wins over the deprecated one.
        let both = format!("{text}vllm:kv_cache_usage_perc 0.5\n");
        assert_eq!(
            metrics_from_exposition(&both, Instant::now())
                .unwrap()
                .kv_cache_usage,
            0.5
        );
    }

    #[test]
    fn sglang_exposition() {
        let m = metrics_from_exposition(SGLANG, Instant::now()).unwrap();
        assert_eq!((m.waiting, m.running, m.kv_cache_usage), (5.0, 12.0, 0.61));
        assert!(m.running_loras.is_empty());
    }

    #[test]
    fn triton_trtllm_exposition() {
        let m = metrics_from_exposition(TRITON, Instant::now()).unwrap();
        assert_eq!((m.waiting, m.running), (2.0, 6.0));
        assert_eq!(m.kv_cache_usage, 0.25); // used / max
        let with_fraction = format!(
            "{TRITON}nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type=\"fraction\",model=\"tensorrt_llm\",version=\"1\"}} 0.3\n"
        );
        let m = metrics_from_exposition(&with_fraction, Instant::now()).unwrap();
        assert_eq!(m.kv_cache_usage, 0.3);
    }

    #[test]
    fn unknown_servers_and_odd_values() {
        assert!(metrics_from_exposition("", Instant::now()).is_none());
        assert!(metrics_from_exposition("# only comments\nfoo 1\n", Instant::now()).is_none());
        let text = "vllm:kv_cache_usage_perc 1.7\nvllm:num_requests_waiting NaN\nvllm:num_requests_running -1\n";
        let m = metrics_from_exposition(text, Instant::now()).unwrap();
        assert_eq!(m.kv_cache_usage, 1.0);
        assert_eq!(m.waiting, 0.0);
        assert_eq!(m.running, 0.0);
    }

    /// llm-d-inference-sim's stamps are whole seconds: an idle series and
    /// a running one written in the same second both count.
    #[test]
    fn lora_info_series_stamped_alike_are_merged() {
        let text = r#"vllm:num_requests_waiting 0
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.796629823e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="tweet",waiting_lora_adapters=""} 1.796629823e+09
vllm:lora_requests_info{max_lora="3",running_lora_adapters="news",waiting_lora_adapters="x"} 1.796629822e+09
"#;
        let m = metrics_from_exposition(text, Instant::now()).unwrap();
        assert_eq!(m.running_loras, ["tweet"]);
        assert!(m.waiting_loras.is_empty(), "an older series leaks");
        assert_eq!(m.max_lora, Some(2));
    }

    #[test]
    fn lora_info_takes_newest_and_escaped_labels() {
        let text = r#"vllm:num_requests_waiting 0
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters="a,b"} 10
vllm:lora_requests_info{max_lora="2",running_lora_adapters="c",waiting_lora_adapters="\"d\""} 5
"#;
        let m = metrics_from_exposition(text, Instant::now()).unwrap();
        assert!(m.running_loras.is_empty());
        assert_eq!(m.waiting_loras, ["a", "b"]);
        assert_eq!(m.max_lora, Some(2));
    }

    #[test]
    fn every_table_name_passes_the_line_filter() {
        // The compile-time name list agrees with the tables, both ways.
        for (i, t) in ENGINES.iter().enumerate() {
            for name in t.metric_names() {
                assert!(is_interesting(name), "{:?}: {name}", t.engine);
                assert_ne!(engines_reading(name) & (1 << i), 0, "{name}");
            }
        }
        for (name, engines) in KNOWN_NAMES {
            for (i, t) in ENGINES.iter().enumerate() {
                let listed = t.metric_names().any(|n| n == *name);
                assert_eq!(listed, engines & (1 << i) != 0, "{name}");
            }
        }
        assert!(!is_interesting("vllm:time_to_first_token_seconds_bucket"));
        assert!(!is_interesting("nv_trt_llm_general_metrics"));
        assert!(!is_interesting("process_cpu_seconds_total"));
    }

    #[test]
    fn one_engine_supplies_every_field() {
        // vLLM's waiting is present, so vLLM is the engine: SGLang's running
        // and token usage on the same page are not mixed in.
        let mixed = "vllm:num_requests_waiting 3\n\
                     sglang:num_running_reqs 7\n\
                     sglang:token_usage 0.5\n";
        let m = metrics_from_exposition(mixed, Instant::now()).unwrap();
        assert_eq!((m.waiting, m.running, m.kv_cache_usage), (3.0, 0.0, 0.0));
        // Precedence: vLLM, then SGLang, then TensorRT-LLM.
        let sgl_trt = "nv_trt_llm_request_metrics{request_type=\"waiting\"} 9\n\
                       sglang:num_queue_reqs 2\n";
        let m = metrics_from_exposition(sgl_trt, Instant::now()).unwrap();
        assert_eq!(m.waiting, 2.0);
        // A TensorRT-LLM series with another `request_type` is not "waiting",
        // and on its own does not make the page a TensorRT-LLM page.
        let other = "nv_trt_llm_request_metrics{request_type=\"max\"} 512\n";
        assert!(metrics_from_exposition(other, Instant::now()).is_none());
        // A ratio with a zero total is no KV-cache figure.
        let zero = "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"used\"} 0\n\
                    nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"max\"} 0\n";
        assert!(metrics_from_exposition(zero, Instant::now()).is_none());
    }

    #[test]
    fn failure_reasons_index_their_counters() {
        for (i, r) in FailureReason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
        }
        let stats = ScrapeStats::default();
        stats.failed(FailureReason::HttpStatus);
        stats.failed(FailureReason::HttpStatus);
        stats.failed(FailureReason::Parse);
        assert_eq!(stats.failures(FailureReason::HttpStatus), 2);
        assert_eq!(stats.failures(FailureReason::Parse), 1);
        assert_eq!(stats.failures(FailureReason::Timeout), 0);
        assert_eq!(stats.failed.load(Ordering::Relaxed), 3);
    }

    /// A one-shot HTTP server on loopback: `reply` answers every request
    /// (`None` accepts and then never answers).
    async fn http_server(reply: Option<&'static str>) -> std::net::SocketAddr {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((mut sock, _)) = listener.accept().await {
                let Some(reply) = reply else {
                    held.push(sock);
                    continue;
                };
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let _ = sock.write_all(reply.as_bytes()).await;
                    let _ = sock.shutdown().await;
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn failed_scrapes_are_counted_by_reason_on_the_metrics_page() {
        use crate::endpoints::standalone::{EndpointSpec, endpoints_from_specs};
        use crate::metrics::Metrics;

        const OK: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\
            connection: close\r\ncontent-length: 28\r\n\r\nvllm:num_requests_waiting 1\n";
        const UNKNOWN: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\
            connection: close\r\ncontent-length: 28\r\n\r\nprocess_cpu_seconds_total 1\n";
        const ERROR: &str = "HTTP/1.1 500 Internal Server Error\r\n\
            connection: close\r\ncontent-length: 0\r\n\r\n";
        let closed = {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            l.local_addr().unwrap()
        };
        let servers = [
            ("ok", http_server(Some(OK)).await),
            ("unknown", http_server(Some(UNKNOWN)).await),
            ("error", http_server(Some(ERROR)).await),
            ("silent", http_server(None).await),
            ("closed", closed),
        ];
        let specs = servers.iter().map(|(name, addr)| EndpointSpec {
            name: Some(name.to_string()),
            ..EndpointSpec::new(addr.to_string(), &["m"])
        });
        let metrics = Metrics::default();
        let stats = metrics.scrape_stats();
        let registry = EndpointRegistry::new(Duration::from_secs(5));
        registry.replace_all(endpoints_from_specs(specs).unwrap());
        let scraper = spawn_scraper_with_stats(
            Arc::clone(&registry),
            Duration::from_millis(20),
            Duration::from_millis(150),
            Arc::clone(&stats),
        );

        let deadline = Instant::now() + Duration::from_secs(20);
        let reasons = [
            FailureReason::Parse,
            FailureReason::HttpStatus,
            FailureReason::Timeout,
            FailureReason::Connect,
        ];
        while stats.ok.load(Ordering::Relaxed) == 0
            || reasons.iter().any(|r| stats.failures(*r) == 0)
        {
            assert!(
                Instant::now() < deadline,
                "timed out; failures: {:?}",
                FailureReason::ALL.map(|r| (r, stats.failures(r)))
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        scraper.abort();

        let text = metrics.render(&registry, None);
        let rendered = |name: &str, reason: Option<&str>| -> f64 {
            prom::samples(&text)
                .find(|s| s.name == name && s.label("reason").as_deref() == reason)
                .unwrap_or_else(|| panic!("{name} {reason:?} not rendered:\n{text}"))
                .value
        };
        for r in reasons {
            let n = rendered("kinference_epp_scrape_failures_total", Some(r.as_str()));
            assert!(n >= 1.0, "{r}: {n}\n{text}");
        }
        assert_eq!(
            rendered("kinference_epp_scrape_failures_total", Some("other")),
            0.0
        );
        let attempts = rendered("kinference_epp_scrape_attempts_total", None);
        assert!(attempts >= 5.0, "{attempts}");
    }
}
