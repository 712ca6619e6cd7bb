//! Scrapes every endpoint's Prometheus `/metrics` on a short interval and
//! stores the load metrics the picker needs in the [`EndpointRegistry`].
//!
//! One task per endpoint, so a slow or dead server never delays the others;
//! the tasks are started and stopped as the registry's endpoint set changes.
//! A failed or timed-out scrape records nothing: the endpoint's last metrics
//! simply age out after the registry's staleness window, which is exactly the
//! signal the picker wants ("no metric attributes").
//!
//! # Metric names
//!
//! | Field            | vLLM                                                      | SGLang                    | Triton TensorRT-LLM                                                  |
//! |------------------|-----------------------------------------------------------|---------------------------|----------------------------------------------------------------------|
//! | `waiting`        | `vllm:num_requests_waiting` (sum)                         | `sglang:num_queue_reqs`   | `nv_trt_llm_request_metrics{request_type="waiting"}`                 |
//! | `running`        | `vllm:num_requests_running` (sum)                         | `sglang:num_running_reqs` | `nv_trt_llm_request_metrics{request_type="scheduled"}`               |
//! | `kv_cache_usage` | `vllm:kv_cache_usage_perc`, else `vllm:gpu_cache_usage_perc` (max) | `sglang:token_usage` | `nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}`, else `used`/`max` |
//! | LoRA fields      | `vllm:lora_requests_info` labels `running_lora_adapters`, `waiting_lora_adapters`, `max_lora` (sample with the largest value) | – | – |
//! | `block_size`, `num_gpu_blocks` | `vllm:cache_config_info` labels `block_size`, `num_gpu_blocks` | – | – |
//!
//! Counts are summed over all series of a name (so over `model_name` and
//! vLLM's data-parallel `engine` label); KV-cache usage takes the maximum
//! series, the conservative choice when several engines share a server, and
//! is clamped to 0..=1. When a server exposes several families, vLLM wins,
//! then SGLang, then TensorRT-LLM. A body with none of the waiting, running
//! or KV-cache names counts as a failed scrape: reporting zeros would make an
//! unknown server look idle.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::prom::{self, Sample};
use super::registry::{Endpoint, EndpointRegistry, ScrapedMetrics};

/// Default scrape interval.
pub const DEFAULT_SCRAPE_INTERVAL: Duration = Duration::from_millis(50);

/// Default per-scrape timeout. Longer than the interval on purpose: a Python
/// model server under load can take a few tens of milliseconds to render its
/// metrics, and a late answer is still fresher than none. Ticks missed while
/// waiting are skipped, not queued.
pub const DEFAULT_SCRAPE_TIMEOUT: Duration = Duration::from_millis(200);

/// Scrape counters, for the EPP's own `/metrics`.
#[derive(Debug, Default)]
pub struct ScrapeStats {
    /// Scrapes that produced metrics.
    pub ok: AtomicU64,
    /// Scrapes that failed (connect error, timeout, HTTP error status,
    /// unreadable body or no recognised model-server metric).
    pub failed: AtomicU64,
}

/// Starts the scraper with fresh counters; see [`spawn_scraper_with_stats`].
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
/// `http://<address>/metrics` every `interval` with `timeout`. Aborting the
/// returned handle stops all of them.
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
                        _task: AbortOnDrop(task),
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
    _task: AbortOnDrop,
}

/// Aborts the task when dropped, so a removed endpoint stops being scraped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
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
        match scrape_url(&client, &url, timeout).await {
            Ok(m) => {
                stats.ok.fetch_add(1, Ordering::Relaxed);
                registry.set_metrics_at(&endpoint.name, &endpoint, m);
                if failing {
                    info!(endpoint = %endpoint.name, %address, "metrics scrape recovered");
                    failing = false;
                }
            }
            Err(error) => {
                stats.failed.fetch_add(1, Ordering::Relaxed);
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
    scrape_url(client, &format!("http://{address}/metrics"), timeout).await
}

async fn scrape_url(
    client: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> anyhow::Result<ScrapedMetrics> {
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
    metrics_from_exposition(&body, Instant::now())
        .ok_or_else(|| anyhow::anyhow!("no recognised model-server metrics in the response"))
}

/// Extracts the picker's load metrics from a Prometheus exposition; `None`
/// when it contains none of the known waiting, running or KV-cache names.
pub fn metrics_from_exposition(text: &str, scraped_at: Instant) -> Option<ScrapedMetrics> {
    let mut acc = Acc::default();
    for s in prom::samples_where(text, is_interesting) {
        acc.add(&s);
    }
    acc.finish(scraped_at)
}

/// Exact names only: the many histogram lines of a model server's page are
/// then skipped right after their name, before labels and value are parsed.
fn is_interesting(name: &str) -> bool {
    matches!(
        name,
        "vllm:num_requests_waiting"
            | "vllm:num_requests_running"
            | "vllm:kv_cache_usage_perc"
            | "vllm:gpu_cache_usage_perc"
            | "vllm:lora_requests_info"
            | "vllm:cache_config_info"
            | "sglang:num_queue_reqs"
            | "sglang:num_running_reqs"
            | "sglang:token_usage"
            | "nv_trt_llm_request_metrics"
            | "nv_trt_llm_kv_cache_block_metrics"
    )
}

/// Per-family running totals while walking the exposition once.
#[derive(Default)]
struct Acc {
    vllm_waiting: Option<f64>,
    vllm_running: Option<f64>,
    vllm_kv: Option<f64>,
    vllm_gpu_kv: Option<f64>,
    lora: Option<LoraInfo>,
    block_size: Option<u32>,
    num_gpu_blocks: Option<u64>,
    sgl_waiting: Option<f64>,
    sgl_running: Option<f64>,
    sgl_kv: Option<f64>,
    trt_waiting: Option<f64>,
    trt_running: Option<f64>,
    trt_kv_fraction: Option<f64>,
    trt_kv_used: Option<f64>,
    trt_kv_max: Option<f64>,
}

/// The newest `vllm:lora_requests_info` series seen so far.
struct LoraInfo {
    /// The sample value: when vLLM last updated the info.
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
fn adapter_list(s: Option<std::borrow::Cow<'_, str>>) -> Vec<String> {
    s.map(|s| {
        s.split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(str::to_string)
            .collect()
    })
    .unwrap_or_default()
}

impl Acc {
    fn add(&mut self, s: &Sample<'_>) {
        let v = s.value;
        if v.is_nan() {
            return;
        }
        match s.name {
            "vllm:num_requests_waiting" => sum(&mut self.vllm_waiting, v),
            "vllm:num_requests_running" => sum(&mut self.vllm_running, v),
            "vllm:kv_cache_usage_perc" => max(&mut self.vllm_kv, v),
            "vllm:gpu_cache_usage_perc" => max(&mut self.vllm_gpu_kv, v),
            // The value is the time the info was last updated; several
            // series can coexist, and the newest one is the truth.
            "vllm:lora_requests_info" if self.lora.as_ref().is_none_or(|l| v > l.stamp) => {
                self.lora = Some(LoraInfo {
                    stamp: v,
                    running: adapter_list(s.label("running_lora_adapters")),
                    waiting: adapter_list(s.label("waiting_lora_adapters")),
                    max: s.label("max_lora").and_then(|m| m.trim().parse().ok()),
                });
            }
            "vllm:cache_config_info" => {
                // Float-formatted integers ("16.0") occur in some versions.
                let int = |k: &str| {
                    s.label(k)
                        .and_then(|x| x.trim().parse::<f64>().ok())
                        .filter(|x| x.is_finite() && *x >= 0.0)
                };
                if let Some(b) = int("block_size") {
                    self.block_size = Some(b as u32);
                }
                if let Some(n) = int("num_gpu_blocks") {
                    self.num_gpu_blocks = Some(n as u64);
                }
            }
            "sglang:num_queue_reqs" => sum(&mut self.sgl_waiting, v),
            "sglang:num_running_reqs" => sum(&mut self.sgl_running, v),
            "sglang:token_usage" => max(&mut self.sgl_kv, v),
            "nv_trt_llm_request_metrics" => match s.label("request_type").as_deref() {
                Some("waiting") => sum(&mut self.trt_waiting, v),
                Some("scheduled") => sum(&mut self.trt_running, v),
                _ => {}
            },
            "nv_trt_llm_kv_cache_block_metrics" => {
                match s.label("kv_cache_block_type").as_deref() {
                    Some("fraction") => max(&mut self.trt_kv_fraction, v),
                    // Older backends have no `fraction`; used/max is the same
                    // quantity (our inference from the block counters, not
                    // stated by the 003 protocol document).
                    Some("used") => sum(&mut self.trt_kv_used, v),
                    Some("max") => sum(&mut self.trt_kv_max, v),
                    _ => {}
                }
            }
            _ => {}
        }
    }

    fn finish(self, scraped_at: Instant) -> Option<ScrapedMetrics> {
        let trt_kv = self
            .trt_kv_fraction
            .or(match (self.trt_kv_used, self.trt_kv_max) {
                (Some(used), Some(max)) if max > 0.0 => Some(used / max),
                _ => None,
            });
        let waiting = self.vllm_waiting.or(self.sgl_waiting).or(self.trt_waiting);
        let running = self.vllm_running.or(self.sgl_running).or(self.trt_running);
        let kv = self.vllm_kv.or(self.vllm_gpu_kv).or(self.sgl_kv).or(trt_kv);
        if waiting.is_none() && running.is_none() && kv.is_none() {
            return None;
        }
        let (running_loras, waiting_loras, max_lora) = match self.lora {
            Some(l) => (l.running, l.waiting, l.max),
            None => (Vec::new(), Vec::new(), None),
        };
        Some(ScrapedMetrics {
            waiting: waiting.unwrap_or(0.0).max(0.0),
            running: running.unwrap_or(0.0).max(0.0),
            kv_cache_usage: kv.unwrap_or(0.0).clamp(0.0, 1.0),
            running_loras,
            waiting_loras,
            max_lora,
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            scraped_at,
        })
    }
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
}
