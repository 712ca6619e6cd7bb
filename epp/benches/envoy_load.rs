//! Load through a real Envoy (the pinned wheel, `kinference_testbed::envoy`):
//! closed-loop HTTP/1.1 keep-alive clients → Envoy on loopback → simulated
//! model servers that answer at once (`time_scale: 0`). Three phases in the
//! same run, each behind its own Envoy, with the same client and bodies:
//!
//! * `static`: `Template::Static`, no ext_proc, a static route to pod 0 —
//!   the baseline;
//! * `floor`: `Template::Streamed` (the Inference Extension reference chart:
//!   `FULL_DUPLEX_STREAMED` both ways, an `ORIGINAL_DST` cluster dialling
//!   `x-gateway-destination-endpoint`) in front of a trivial ext_proc server
//!   in this file — TLS like the EPP, no parsing, every request sent to pod 0
//!   with the EPP's reply builders — the cost of ext_proc alone;
//! * `epp`: the same template in front of the EPP as shipped (TLS,
//!   `examples/pii-stays-local.yaml` by default: a pii classifier and a
//!   prefix-aware `minimize: PredictedTTFT` over the pods, its scraper
//!   reading their `/metrics` every 50 ms).
//!
//! Each concurrency level (32, then 1) runs static, floor, epp in turn. The
//! added latency of a phase is its quantile minus the static route's.
//! CPU: the EPP and the floor each run in a dedicated tokio runtime, whose
//! threads' `schedstat` gives the server's CPU per request; Envoy's is the
//! `schedstat` of its process's threads (it is this process's child).
//!
//! `cargo bench -p kinference-epp --bench envoy_load [-- --quick]` (~45 s on
//! 2 cores; `--quick`, a smoke run, a few seconds).
//!
//! Knobs (environment): `ENVOY_LOAD_REQUESTS` (10,000 measured requests per
//! phase at the high concurrency; 400 with `--quick`), `ENVOY_LOAD_C1_REQUESTS`
//! (2,000; 150), `ENVOY_LOAD_WARMUP` (500; 50, per phase, a third of it at c1),
//! `ENVOY_LOAD_CONCURRENCY` (32), `ENVOY_LOAD_ROUNDS` (2; 1 with `--quick`:
//! how many times each concurrency level repeats static/floor/epp, in that
//! order), `ENVOY_LOAD_PODS` (4),
//! `ENVOY_LOAD_POLICY` (`pii`, or `queue-depth` for a one-rule
//! `minimize: QueueDepth` policy), `ENVOY_LOAD_ENVOY_WORKERS` (2),
//! `ENVOY_LOAD_SERVER_THREADS` (2 workers each for the EPP and the floor),
//! `ENVOY_LOAD_CLIENT_THREADS` (2), `ENVOY_LOAD_SIM_THREADS` (1),
//! `ENVOY_LOAD_MAX_SECS` (60, per phase).
//!
//! Everything shares the machine's cores (Envoy, EPP, floor, simulators and
//! the load generator), so absolute figures are pessimistic; compare phases
//! of the same run.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, ProcessingRequest, ProcessingResponse,
    StreamedBodyResponse, body_mutation, processing_request::Request as Msg,
    processing_response::Response as Reply,
};
use kinference_epp::endpoints::{EndpointSpec, endpoints_from_specs};
use kinference_epp::extproc::{DESTINATION_ENDPOINT, reply};
use kinference_epp::server::{Epp, Settings};
use kinference_simulator::{SimConfig, SimHandle};
use kinference_testbed::envoy::{Bootstrap, ENVOY_VERSION, Envoy, Template};
use kinference_testbed::load::{
    Clocks, Cpu, Outcome, Phase, PhaseSpec, Tally, Turn, Window, cores, cpu, env_or, metric_sum,
    ms, per_request_us, ratio, runtime,
};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

const PII_POLICY: &str = include_str!("../../examples/pii-stays-local.yaml");
const QUEUE_DEPTH_POLICY: &str = "pool:
  selector: { app: vllm }
  targetPorts: [{ number: 8000 }]
rules:
  - name: least-queued
    route: { select: [{ type: Local, minimize: QueueDepth }] }
";
/// The model of `examples/pii-stays-local.yaml`, served by every pod.
const MODEL: &str = "qwen-2.5";
/// The example's provider, served by a simulator in case the overflow rule
/// picks it.
const PROVIDER: &str = "openai";
const PROVIDER_MODEL: &str = "gpt-4o-mini";
const PROVIDER_KEY: &str = "sk-bench-0c1d";
const MAX_MESSAGE: usize = 64 << 20;
/// `BodySendMode::FullDuplexStreamed`.
const FULL_DUPLEX_STREAMED: i32 = 4;
/// Distinct request bodies, cycled.
const BODIES: usize = 1024;
/// Thread-name prefixes of the runtimes (the kernel keeps 15 bytes).
const EPP_THREADS: &str = "epp-srv";
const FLOOR_THREADS: &str = "floor-srv";
const LOAD_THREADS: &str = "load";
const SIM_THREADS: &str = "sim";
/// The thread groups whose CPU a phase reads, and their indices in [`Cpu`].
const GROUPS: usize = 4;
const THREADS: [&str; GROUPS] = [EPP_THREADS, FLOOR_THREADS, LOAD_THREADS, SIM_THREADS];
const EPP: usize = 0;
const FLOOR: usize = 1;
const LOAD: usize = 2;
const SIM: usize = 3;

// ---------------------------------------------------------------------------
// The floor: TLS + gRPC + ext_proc, no parsing, always pod 0.
// ---------------------------------------------------------------------------

#[derive(Clone)]
struct Floor {
    destination: Arc<str>,
}

#[tonic::async_trait]
impl ExternalProcessor for Floor {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        // Same shape as the EPP: one task per stream, a bounded reply channel.
        let (tx, rx) = mpsc::channel(32);
        tokio::spawn(floor_session(
            request.into_inner(),
            tx,
            self.destination.clone(),
        ));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The same header and `envoy.lb` metadata the EPP sets for a local pick.
fn floor_mutation(destination: &str) -> reply::Mutation {
    reply::Mutation {
        set_headers: vec![(DESTINATION_ENDPOINT.to_string(), destination.to_string())],
        lb_metadata: vec![(DESTINATION_ENDPOINT.to_string(), destination.to_string())],
        ..reply::Mutation::default()
    }
}

fn floor_routed(streamed: bool, destination: &str, body: &[u8]) -> Vec<ProcessingResponse> {
    let m = floor_mutation(destination);
    if streamed {
        reply::routed_streamed(&m, body)
    } else {
        vec![reply::routed_buffered(&m)]
    }
}

/// Full-duplex streaming: a response body chunk handed back unchanged.
fn echo_response_body(body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Reply::ResponseBody(BodyResponse {
            response: Some(CommonResponse {
                body_mutation: Some(BodyMutation {
                    mutation: Some(body_mutation::Mutation::StreamedResponse(
                        StreamedBodyResponse {
                            body,
                            end_of_stream,
                            ..StreamedBodyResponse::default()
                        },
                    )),
                }),
                ..CommonResponse::default()
            }),
        })),
        ..ProcessingResponse::default()
    }
}

async fn floor_session(
    mut inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    destination: Arc<str>,
) {
    let (mut request_streamed, mut response_streamed) = (false, false);
    let mut body: Vec<u8> = Vec::new();
    let mut decided = false;
    while let Ok(Some(msg)) = inbound.message().await {
        if let Some(pc) = &msg.protocol_config {
            request_streamed = pc.request_body_mode == FULL_DUPLEX_STREAMED;
            response_streamed = pc.response_body_mode == FULL_DUPLEX_STREAMED;
        }
        let replies = match msg.request {
            Some(Msg::RequestHeaders(_)) if !request_streamed => {
                vec![reply::continue_request_headers()]
            }
            Some(Msg::RequestHeaders(h)) if h.end_of_stream => {
                // No body: only the held headers answer.
                decided = true;
                floor_routed(true, &destination, &[])
                    .into_iter()
                    .take(1)
                    .collect()
            }
            // Streamed: the headers answer waits for the body, as the EPP's.
            Some(Msg::RequestHeaders(_)) => Vec::new(),
            Some(Msg::RequestBody(b)) => {
                body.extend_from_slice(&b.body);
                if b.end_of_stream {
                    decided = true;
                    floor_routed(request_streamed, &destination, &body)
                } else {
                    Vec::new()
                }
            }
            Some(Msg::RequestTrailers(_)) if !decided => {
                decided = true;
                floor_routed(request_streamed, &destination, &body)
            }
            Some(Msg::RequestTrailers(_)) => vec![reply::continue_request_trailers()],
            Some(Msg::ResponseHeaders(_)) => vec![reply::continue_response_headers()],
            Some(Msg::ResponseBody(b)) if response_streamed => {
                vec![echo_response_body(b.body, b.end_of_stream)]
            }
            Some(Msg::ResponseBody(_)) => vec![reply::continue_response_body()],
            Some(Msg::ResponseTrailers(_)) => vec![reply::continue_response_trailers()],
            None => Vec::new(),
        };
        for r in replies {
            if tx.send(Ok(r)).await.is_err() {
                return;
            }
        }
    }
}

/// Serves the floor as `Epp::serve_ext_proc` serves the EPP: self-signed TLS
/// (ALPN h2), HTTP/2 keepalive, `TCP_NODELAY` on accepted sockets.
async fn serve_floor(
    listener: TcpListener,
    destination: Arc<str>,
    stop: oneshot::Receiver<()>,
) -> anyhow::Result<()> {
    let names = vec!["kinference-epp".to_string(), "localhost".to_string()];
    let cert = rcgen::generate_simple_self_signed(names)?;
    let identity =
        tonic::transport::Identity::from_pem(cert.cert.pem(), cert.signing_key.serialize_pem());
    tonic::transport::Server::builder()
        .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))?
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .add_service(
            ExternalProcessorServer::new(Floor { destination })
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        )
        .serve_with_incoming_shutdown(
            TcpIncoming::from(listener).with_nodelay(Some(true)),
            async {
                let _ = stop.await;
            },
        )
        .await?;
    Ok(())
}

// ---------------------------------------------------------------------------
// The EPP, as shipped.
// ---------------------------------------------------------------------------

fn build_epp(policy: &str, pods: &[SimHandle]) -> anyhow::Result<Epp> {
    let epp = Epp::new(Settings {
        secure_serving: true,
        ..Settings::default()
    });
    epp.policy()
        .load_text(policy)
        .map_err(|e| anyhow::anyhow!("the policy does not compile: {e}"))?;
    let specs = pods.iter().map(|p| {
        let mut spec = EndpointSpec::new(p.addr().to_string(), &[MODEL]);
        spec.name = Some(p.name().to_string());
        spec.backend = Some("sim".to_string());
        spec
    });
    epp.registry().replace_all(endpoints_from_specs(specs)?);
    epp.registry().mark_synced();
    epp.picker.provider_keys().store(Arc::new(
        [(PROVIDER.to_string(), PROVIDER_KEY.to_string())].into(),
    ));
    Ok(epp)
}

/// Count and sum (seconds) of one of the EPP's histograms, from its own
/// `/metrics` text, over all label sets.
fn epp_histogram(epp: &Epp, name: &str) -> (f64, f64) {
    let text = epp
        .picker
        .metrics()
        .render(epp.registry(), epp.policy().loaded_hash().as_deref());
    let total = |suffix: &str| metric_sum(&text, &format!("{name}_{suffix}"));
    (total("count"), total("sum"))
}

/// Time inside `Picker::pick` and in the classifiers, as the EPP counts it.
#[derive(Clone, Copy, Default)]
struct Inside {
    decisions: (f64, f64),
    classifiers: (f64, f64),
}

impl Inside {
    fn read(epp: &Epp) -> Self {
        Inside {
            decisions: epp_histogram(epp, "kinference_epp_decision_duration_seconds"),
            classifiers: epp_histogram(epp, "kinference_epp_classifier_duration_seconds"),
        }
    }

    fn describe(&self, before: &Self) -> String {
        let mean = |(n1, s1): (f64, f64), (n0, s0): (f64, f64)| {
            let n = n1 - n0;
            (n, if n > 0.0 { 1e6 * (s1 - s0) / n } else { 0.0 })
        };
        let (d, dm) = mean(self.decisions, before.decisions);
        let (c, cm) = mean(self.classifiers, before.classifiers);
        format!(
            "inside the EPP (warm-up included): Picker::pick mean {dm:.0} µs over {d} decisions, classifiers mean {cm:.0} µs over {c} runs"
        )
    }
}

// ---------------------------------------------------------------------------
// Request bodies: ~1 KB chat requests, one of 8 system prompts and a unique
// user turn; one in ten carries an e-mail address (the pii rule's traffic).
// ---------------------------------------------------------------------------

const WORDS: &[&str] = &[
    "the", "model", "server", "request", "latency", "token", "cache", "prefix", "gateway",
    "endpoint", "policy", "route", "queue", "answer", "summary", "report", "table", "value",
    "system", "context", "window", "prompt", "document", "review", "change", "result", "metric",
    "cluster", "please", "explain", "why", "how", "and", "with", "from", "about",
];

fn words(seed: usize, count: usize) -> String {
    let mut state = (seed as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::with_capacity(count * 8);
    for i in 0..count {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[(state % WORDS.len() as u64) as usize]);
    }
    out
}

fn bodies() -> Vec<Bytes> {
    (0..BODIES)
        .map(|i| {
            let group = i % 8;
            let system = format!(
                "You are assistant {group} of the benchmark. {}.",
                words(1000 + group, 60)
            );
            let mut user = format!("Request {i}: {}", words(i, 80));
            if i % 10 == 3 {
                user.push_str(&format!(", my e-mail is maria.gonzalez{i}@gmail.com"));
            }
            let body = serde_json::json!({
                "model": MODEL,
                "messages": [
                    { "role": "system", "content": system },
                    { "role": "user", "content": user },
                ],
                "max_tokens": 8,
            });
            Bytes::from(serde_json::to_vec(&body).expect("JSON"))
        })
        .collect()
}

/// This process's children named `envoy…` (Envoy runs as our child, killed
/// on drop).
fn envoy_children() -> Vec<u32> {
    cpu::children_named("envoy")
}

// ---------------------------------------------------------------------------
// Phases.
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Kind {
    Static,
    Floor,
    Epp,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Static => "static",
            Kind::Floor => "floor",
            Kind::Epp => "epp",
        }
    }
}

struct Gateway {
    kind: Kind,
    envoy: Envoy,
    pid: Option<u32>,
}

#[derive(Default)]
struct PhaseResult {
    tally: Tally,
    /// `x-sim-server` → requests.
    served: BTreeMap<String, u64>,
    window: Window<GROUPS>,
}

impl Outcome for PhaseResult {
    fn tally(&mut self) -> &mut Tally {
        &mut self.tally
    }

    fn merge(&mut self, other: Self) {
        self.tally.merge(other.tally);
        for (k, v) in other.served {
            *self.served.entry(k).or_default() += v;
        }
    }
}

impl PhaseResult {
    fn measured(&self) -> u64 {
        self.tally.measured()
    }

    fn rps(&self) -> f64 {
        self.window.rps(self.measured())
    }

    fn quantile(&self, q: f64) -> Duration {
        self.tally.quantile(q)
    }

    fn cpu(&self) -> &Cpu<GROUPS> {
        &self.window.cpu
    }

    fn per_request(&self, d: Duration) -> f64 {
        per_request_us(d, self.measured())
    }

    /// The ext_proc server's CPU in this phase (none for the static route).
    fn server_cpu(&self, kind: Kind) -> Option<Duration> {
        match kind {
            Kind::Static => None,
            Kind::Floor => Some(self.cpu()[FLOOR]),
            Kind::Epp => Some(self.cpu()[EPP]),
        }
    }
}

/// One request; the name of the simulator that answered.
async fn send(http: &reqwest::Client, url: &str, body: Bytes) -> anyhow::Result<String> {
    let response = http
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await?;
    let status = response.status();
    let server = response
        .headers()
        .get("x-sim-server")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_string();
    let text = response.bytes().await?;
    if !status.is_success() {
        anyhow::bail!(
            "{status}: {}",
            String::from_utf8_lossy(&text[..text.len().min(300)])
        );
    }
    Ok(server)
}

async fn run_phase(
    http: reqwest::Client,
    url: String,
    bodies: Arc<Vec<Bytes>>,
    spec: PhaseSpec,
    envoy: Option<u32>,
) -> PhaseResult {
    let phase = Arc::new(Phase::new(&spec, Clocks::new(THREADS).with_child(envoy)));
    let url: Arc<str> = url.into();
    let mut tasks = Vec::new();
    for _ in 0..spec.concurrency {
        let (http, url, bodies, phase) = (http.clone(), url.clone(), bodies.clone(), phase.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = PhaseResult::default();
            while let Some(Turn { id, measured }) = phase.next() {
                let body = bodies[id as usize % bodies.len()].clone();
                let started = Instant::now();
                let result = send(&http, &url, body).await;
                let latency = started.elapsed();
                if !measured {
                    continue;
                }
                phase.completed();
                match result {
                    Ok(server) => {
                        out.tally.latencies.push(latency);
                        *out.served.entry(server).or_default() += 1;
                    }
                    Err(e) => out.tally.error(e),
                }
            }
            out
        }));
    }
    let (mut result, window) = phase.join(tasks).await;
    result.window = window;
    result
}

// ---------------------------------------------------------------------------
// Report.
// ---------------------------------------------------------------------------

fn print_header() {
    println!(
        "| phase | conc | requests | req/s | p50 ms | p90 ms | p99 ms | max ms | ext_proc server CPU µs/req | Envoy CPU µs/req | cores: ext_proc server / Envoy / clients / sims / EPP idle runtime / other procs | errors |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|");
}

fn print_row(label: &str, kind: Kind, spec: &PhaseSpec, r: &PhaseResult) {
    let cores = |d: Duration| r.window.cores(d);
    let server = r.server_cpu(kind);
    // Outside its own phase the EPP runtime only scrapes.
    let epp_idle = if kind == Kind::Epp {
        "-".to_string()
    } else {
        format!("{:.2}", cores(r.cpu()[EPP]))
    };
    println!(
        "| {label} | {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {:.0} | {} / {:.2} / {:.2} / {:.2} / {epp_idle} / {:.2} | {}{} |",
        spec.concurrency,
        r.measured(),
        r.rps(),
        ms(r.quantile(0.50)),
        ms(r.quantile(0.90)),
        ms(r.quantile(0.99)),
        ms(r.tally.max()),
        server.map_or("-".to_string(), |d| format!("{:.0}", r.per_request(d))),
        r.per_request(r.cpu().child),
        server.map_or("-".to_string(), |d| format!("{:.2}", cores(d))),
        cores(r.cpu().child),
        cores(r.cpu()[LOAD]),
        cores(r.cpu()[SIM]),
        r.cpu().others_cores(),
        r.tally.errors,
        if r.window.truncated {
            " (time cap hit)"
        } else {
            ""
        },
    );
}

/// Added latency and CPU of the floor and the EPP over the static route of
/// the same concurrency level and round.
fn print_comparison(label: &str, phases: &BTreeMap<Kind, PhaseResult>) {
    let (Some(s), Some(f), Some(e)) = (
        phases.get(&Kind::Static),
        phases.get(&Kind::Floor),
        phases.get(&Kind::Epp),
    ) else {
        return;
    };
    let added = |r: &PhaseResult, q: f64| ms(r.quantile(q)) - ms(s.quantile(q));
    let (f50, e50, f99, e99) = (added(f, 0.5), added(e, 0.5), added(f, 0.99), added(e, 0.99));
    let epp_cpu = e.per_request(e.cpu()[EPP]);
    let floor_cpu = f.per_request(f.cpu()[FLOOR]);
    let envoy_static = s.per_request(s.cpu().child);
    println!(
        "| {label} | {e50:+.2} | {f50:+.2} | {} | {e99:+.2} | {f99:+.2} | {} | {:.0} / {:.0} / {:.0} | {epp_cpu:.0} / {floor_cpu:.0} = {} | {} | {:.0} / {:.0} / {envoy_static:.0} |",
        ratio(e50, f50),
        ratio(e99, f99),
        e.rps(),
        f.rps(),
        s.rps(),
        ratio(epp_cpu, floor_cpu),
        ratio(epp_cpu, envoy_static),
        e.per_request(e.cpu().child),
        f.per_request(f.cpu().child),
    );
}

// ---------------------------------------------------------------------------
// Setup and run.
// ---------------------------------------------------------------------------

async fn sim(config: SimConfig) -> anyhow::Result<SimHandle> {
    Ok(kinference_simulator::spawn(config, "127.0.0.1:0".parse()?).await?)
}

async fn start_gateway(kind: Kind, bootstrap: Bootstrap) -> anyhow::Result<Gateway> {
    let before = envoy_children();
    let envoy = Envoy::start(&bootstrap).await?;
    let pid = envoy_children().into_iter().find(|p| !before.contains(p));
    Ok(Gateway { kind, envoy, pid })
}

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let concurrency = env_or("ENVOY_LOAD_CONCURRENCY", 32).max(1) as usize;
    let requests = env_or("ENVOY_LOAD_REQUESTS", if quick { 400 } else { 10_000 });
    let c1_requests = env_or("ENVOY_LOAD_C1_REQUESTS", if quick { 150 } else { 2_000 });
    let warmup = env_or("ENVOY_LOAD_WARMUP", if quick { 50 } else { 500 });
    let rounds = env_or("ENVOY_LOAD_ROUNDS", if quick { 1 } else { 2 }).max(1);
    let pod_count = env_or("ENVOY_LOAD_PODS", 4).max(1) as usize;
    let envoy_workers = env_or("ENVOY_LOAD_ENVOY_WORKERS", 2).max(1) as usize;
    let server_threads = env_or("ENVOY_LOAD_SERVER_THREADS", 2) as usize;
    let client_threads = env_or("ENVOY_LOAD_CLIENT_THREADS", 2) as usize;
    let sim_threads = env_or("ENVOY_LOAD_SIM_THREADS", 1) as usize;
    let max_time = Duration::from_secs(env_or("ENVOY_LOAD_MAX_SECS", 60));
    let policy_name = std::env::var("ENVOY_LOAD_POLICY").unwrap_or_else(|_| "pii".into());
    let (policy, policy_label) = match policy_name.as_str() {
        "queue-depth" => (
            QUEUE_DEPTH_POLICY,
            "one rule, `minimize: QueueDepth` (ENVOY_LOAD_POLICY=queue-depth)",
        ),
        _ => (
            PII_POLICY,
            "examples/pii-stays-local.yaml (pii classifier, prefix-aware PredictedTTFT)",
        ),
    };
    let load_start = cpu::loadavg();

    // Separate runtimes, like separate processes: their threads' CPU is read
    // apart.
    let sim_rt = runtime(SIM_THREADS, sim_threads)?;
    let epp_rt = runtime(EPP_THREADS, server_threads)?;
    let floor_rt = runtime(FLOOR_THREADS, server_threads)?;
    let load_rt = runtime(LOAD_THREADS, client_threads)?;

    // Model servers that answer at once, and the example policy's provider.
    let (pods, provider) = sim_rt.block_on(async {
        let mut pods = Vec::new();
        for i in 0..pod_count {
            pods.push(
                sim(SimConfig {
                    time_scale: 0.0,
                    max_concurrency: 256,
                    ..SimConfig::new(format!("pod-{i}"), [MODEL])
                })
                .await?,
            );
        }
        let provider = sim(SimConfig {
            time_scale: 0.0,
            max_concurrency: 256,
            api_key: Some(PROVIDER_KEY.into()),
            ..SimConfig::new(PROVIDER, [PROVIDER_MODEL])
        })
        .await?;
        anyhow::Ok((pods, provider))
    })?;
    let pod0: Arc<str> = pods[0].addr().to_string().into();

    // The EPP: its scraper and ext_proc server on its own runtime.
    let epp = build_epp(policy, &pods)?;
    let (stop_epp, stopped_epp) = oneshot::channel::<()>();
    let (epp_addr, scraper, epp_task) = epp_rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let scraper = epp.spawn_scraper();
        let server = epp.clone();
        let task = tokio::spawn(async move {
            let stopped = async {
                let _ = stopped_epp.await;
            };
            if let Err(e) = server.serve_ext_proc(listener, stopped).await {
                eprintln!("EPP: {e:#}");
            }
        });
        anyhow::Ok((addr, scraper, task))
    })?;
    let (stop_floor, stopped_floor) = oneshot::channel::<()>();
    let (floor_addr, floor_task) = floor_rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(serve_floor(listener, pod0.clone(), stopped_floor));
        anyhow::Ok((addr, task))
    })?;

    // Three Envoys, started once; only the phase's own one carries traffic.
    let providers = vec![(PROVIDER.to_string(), provider.addr())];
    let pool: Vec<_> = pods.iter().map(SimHandle::addr).collect();
    let bootstraps = [
        (
            Kind::Static,
            Bootstrap {
                pool: vec![pods[0].addr()],
                concurrency: envoy_workers,
                ..Bootstrap::new(Template::Static, floor_addr)
            },
        ),
        (
            Kind::Floor,
            Bootstrap {
                pool: pool.clone(),
                providers: providers.clone(),
                concurrency: envoy_workers,
                ..Bootstrap::new(Template::Streamed, floor_addr)
            },
        ),
        (
            Kind::Epp,
            Bootstrap {
                pool,
                providers,
                concurrency: envoy_workers,
                ..Bootstrap::new(Template::Streamed, epp_addr)
            },
        ),
    ];
    let (gateways, envoy_version, http) = load_rt.block_on(async {
        let mut gateways = Vec::new();
        for (kind, bootstrap) in bootstraps {
            gateways.push(start_gateway(kind, bootstrap).await?);
        }
        let info = gateways[0].envoy.admin_get("/server_info").await?;
        let info: serde_json::Value = serde_json::from_str(&info)?;
        let version = info["version"].as_str().unwrap_or("?").to_string();
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(concurrency + 8)
            .tcp_nodelay(true)
            .timeout(Duration::from_secs(30))
            .build()?;
        anyhow::Ok((gateways, version, http))
    })?;
    anyhow::ensure!(
        epp_rt.block_on(epp.registry().wait_until_scraped(Duration::from_secs(10))),
        "the EPP never scraped the simulators"
    );

    // One request through each gateway before anything is measured.
    let bodies = Arc::new(bodies());
    for g in &gateways {
        let url = g.envoy.url("/v1/chat/completions");
        let served = load_rt
            .block_on(send(&http, &url, bodies[0].clone()))
            .map_err(|e| {
                anyhow::anyhow!(
                    "{} gateway: {e:#}\nEnvoy log:\n{}",
                    g.kind.name(),
                    g.envoy.log_tail()
                )
            })?;
        anyhow::ensure!(
            g.kind != Kind::Floor || served == pods[0].name(),
            "the floor's request went to {served}"
        );
    }

    // The EPP at rest: its runtime only scrapes.
    let clocks = Clocks::new(THREADS);
    let idle_start = clocks.mark();
    std::thread::sleep(Duration::from_secs(2));
    let idle = Cpu::between(&idle_start, &clocks.mark());

    let cores = cores();
    println!(
        "envoy_load: Envoy {envoy_version} (pinned {}), {envoy_workers} Envoy workers, {cores} cores, load average at start {load_start}",
        ENVOY_VERSION.trim()
    );
    println!(
        "{pod_count} simulator pods (time_scale 0) + provider `{PROVIDER}`; policy {policy_label}; EPP and floor: {server_threads} runtime workers each, TLS; clients: {client_threads} workers, HTTP/1.1 keep-alive; Envoy pids: {}",
        gateways
            .iter()
            .map(|g| format!(
                "{} {}",
                g.kind.name(),
                g.pid.map_or("?".to_string(), |p| p.to_string())
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "EPP runtime at rest (scraper only): {:.1} ms CPU per second",
        idle[EPP].as_secs_f64() * 1e3 / 2.0
    );
    println!();
    print_header();
    let mut levels = vec![(concurrency, requests, warmup)];
    if concurrency != 1 {
        levels.push((1, c1_requests, (warmup / 3).max(10)));
    }
    let mut comparisons: Vec<(String, BTreeMap<Kind, PhaseResult>)> = Vec::new();
    let mut notes = Vec::new();
    for &(conc, requests, warmup) in &levels {
        let spec = PhaseSpec {
            concurrency: conc,
            warmup,
            requests,
            max_time,
        };
        for round in 1..=rounds {
            let mut phases = BTreeMap::new();
            for g in &gateways {
                let before = Inside::read(&epp);
                let r = load_rt.block_on(run_phase(
                    http.clone(),
                    g.envoy.url("/v1/chat/completions"),
                    bodies.clone(),
                    spec,
                    g.pid,
                ));
                let label = if rounds > 1 {
                    format!("{} c{conc} r{round}", g.kind.name())
                } else {
                    format!("{} c{conc}", g.kind.name())
                };
                print_row(&label, g.kind, &spec, &r);
                let served: Vec<String> =
                    r.served.iter().map(|(k, v)| format!("{k} {v}")).collect();
                let mut note = format!("- {label}: served by {}", served.join(", "));
                if g.kind == Kind::Epp {
                    note.push_str(&format!("; {}", Inside::read(&epp).describe(&before)));
                }
                if let Some(e) = &r.tally.first_error {
                    note.push_str(&format!("; first error: {e}"));
                }
                notes.push(note);
                phases.insert(g.kind, r);
            }
            let label = if rounds > 1 {
                format!("c{conc} r{round}")
            } else {
                format!("c{conc}")
            };
            comparisons.push((label, phases));
        }
    }
    println!();
    for n in &notes {
        println!("{n}");
    }
    println!();
    println!("### Added over the static route (phase minus static, same level)");
    println!(
        "| level | added p50 ms: EPP | floor | EPP/floor | added p99 ms: EPP | floor | EPP/floor | req/s EPP / floor / static | ext_proc CPU µs/req EPP / floor | EPP CPU ÷ Envoy's static CPU | Envoy CPU µs/req with EPP / floor / static |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---|---|---:|---|");
    for (label, phases) in &comparisons {
        print_comparison(label, phases);
    }
    println!();
    println!("load average at end: {}", cpu::loadavg());

    // Shut down: Envoys first, then the servers.
    load_rt.block_on(async {
        for g in gateways {
            g.envoy.stop().await;
        }
    });
    scraper.abort();
    let _ = stop_epp.send(());
    let _ = stop_floor.send(());
    epp_rt.block_on(async {
        let _ = tokio::time::timeout(Duration::from_secs(5), epp_task).await;
    });
    floor_rt.block_on(async {
        let _ = tokio::time::timeout(Duration::from_secs(5), floor_task).await;
    });
    sim_rt.block_on(async {
        for p in pods.iter().chain(std::iter::once(&provider)) {
            p.shutdown().await;
        }
    });
    for rt in [load_rt, epp_rt, floor_rt, sim_rt] {
        rt.shutdown_timeout(Duration::from_secs(1));
    }
    Ok(())
}
