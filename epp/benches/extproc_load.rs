//! Load test of the ext_proc decision path over real gRPC on loopback:
//! in-process client tasks play Envoy (one ext_proc stream per HTTP request:
//! request headers, body, the decision, then response headers with the
//! served endpoint and a TTFT, end of response) against three servers in the
//! same run:
//!
//! * `floor`: a trivial ext_proc server in this file that buffers the body
//!   the same way and always answers the same endpoint (header + `envoy.lb`
//!   metadata; the body handed back in 62,000-byte chunks in streamed mode),
//!   without parsing anything — the cost of gRPC + ext_proc alone;
//! * `epp`: the real EPP exactly as `Epp::serve_ext_proc` serves it, with
//!   `examples/pii-stays-local.yaml` (pii classifier, prefix-aware
//!   `minimize: PredictedTTFT`) over 50 endpoints whose metrics are
//!   refreshed every 50 ms, as the scraper would;
//! * `epp+nodelay`: the same EPP service with `TCP_NODELAY` on accepted
//!   sockets (`serve_with_incoming*` leaves Nagle on).
//!
//! `cargo bench -p kinference-epp --bench extproc_load [-- normal|large|paced]`
//!
//! Scenarios, each in `BUFFERED` and `FULL_DUPLEX_STREAMED` mode (62,000-byte
//! chunks, as Envoy sends them): (a) ~1.5 KB chat bodies, 64 concurrent
//! streams, closed loop; (c1) 220 KB prompts (16 groups sharing a 150 KB
//! prefix, unique 70 KB tails), 150 concurrent streams, closed loop — the
//! servers saturated, so this measures capacity; (c2) the same prompts with
//! 150 requests in flight where the upstream holds each ~1 s after the
//! decision (the shape of upstream issue #2928) — this measures the added
//! latency at that concurrency.
//!
//! Knobs (environment): `LOAD_NORMAL_REQUESTS` (20000), `LOAD_NORMAL_CONCURRENCY`
//! (64), `LOAD_LARGE_REQUESTS` (3000), `LOAD_LARGE_PACED_REQUESTS` (1500),
//! `LOAD_LARGE_CONCURRENCY` (150), `LOAD_UPSTREAM_MS` (1000),
//! `LOAD_CONNECTIONS` (4 gRPC connections per server, like Envoy's
//! per-worker connections), `LOAD_MAX_SECS` (60, per phase),
//! `LOAD_SERVER_THREADS` (2), `LOAD_CLIENT_THREADS` (2), `LOAD_PHASES` (runs
//! only phases whose `server-scenario-mode` key contains it, e.g.
//! `epp+nodelay-large-saturated-streamed`, for profiling).
//!
//! Client and servers share the machine's cores, so absolute numbers are
//! pessimistic; compare the EPP with the floor measured in the same run.
//! Server CPU per request (schedstat of the server runtime's threads) is the
//! least load-generator-sensitive figure; the report also shows the CPU that
//! other processes used during each phase.

use kinference_epp::extproc::reply as epp_reply;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeadersResponse, HttpBody, HttpHeaders, ProcessingRequest,
    ProcessingResponse, TrailersResponse, body_mutation, processing_request::Request as Msg,
    processing_response::Response as Reply,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use kinference_api::DESTINATION_HEADER;
use kinference_epp::endpoints::{EndpointSpec, ScrapedMetrics, endpoints_from_specs};
use kinference_epp::extproc::{
    DESTINATION_ENDPOINT, ExtProcService, LB_NAMESPACE, OBSERVED_TTFT_HEADER, RULE_HEADER,
    SERVED_ENDPOINT,
};
use kinference_epp::server::{Epp, Settings};
use kinference_testbed::extproc_client::{BodyMode, HttpRequest};
use kinference_testbed::load::{
    Clocks, Outcome, Phase, PhaseSpec, Tally, Turn, Window, cores, cpu, env_or, metric_sum, ms,
    runtime,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::transport::Channel;
use tonic::transport::server::Router;
use tonic::{Request, Response, Status, Streaming};

const POLICY: &str = include_str!("../../examples/pii-stays-local.yaml");
const MODEL: &str = "qwen-2.5";
const ENDPOINTS: usize = 50;
const CHUNK: usize = 62_000;
const FLOOR_DESTINATION: &str = "127.0.0.1:20001";
const LARGE_GROUPS: usize = 16;
const LARGE_PREFIX_BYTES: usize = 150 * 1024;
const LARGE_TAIL_BYTES: usize = 70 * 1024;
const MAX_MESSAGE: usize = 64 * 1024 * 1024;
/// Thread-name prefixes of the two runtimes.
const SERVER_THREADS: &str = "srv";
const LOAD_THREADS: &str = "load";
/// The thread groups whose CPU a phase reads, and their indices in its
/// [`kinference_testbed::load::Cpu`].
const GROUPS: usize = 2;
const SERVER: usize = 0;
const LOAD: usize = 1;

// ---------------------------------------------------------------------------
// The floor: gRPC + ext_proc, no parsing, no decision.
// ---------------------------------------------------------------------------

#[derive(Clone, Copy)]
struct Floor;

#[tonic::async_trait]
impl ExternalProcessor for Floor {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        // Same shape as the EPP: one task per stream, a bounded reply channel.
        let (tx, rx) = mpsc::channel(32);
        tokio::spawn(floor_session(request.into_inner(), tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

async fn floor_session(
    mut inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
) {
    let mut streamed = false;
    let mut body: Vec<u8> = Vec::new();
    while let Ok(Some(msg)) = inbound.message().await {
        if let Some(pc) = &msg.protocol_config {
            streamed = pc.request_body_mode == FULL_DUPLEX_STREAMED;
        }
        let replies = match msg.request {
            Some(Msg::RequestHeaders(_)) if streamed => Vec::new(),
            Some(Msg::RequestHeaders(_)) => {
                vec![reply(Reply::RequestHeaders(HeadersResponse::default()))]
            }
            Some(Msg::RequestBody(b)) => {
                if body.is_empty() && b.end_of_stream {
                    body = b.body;
                } else {
                    body.extend_from_slice(&b.body);
                }
                if !b.end_of_stream {
                    Vec::new()
                } else if streamed {
                    epp_reply::routed_streamed(&floor_mutation(), &body)
                } else {
                    vec![epp_reply::routed_buffered(&floor_mutation())]
                }
            }
            Some(Msg::RequestTrailers(_)) => {
                vec![reply(Reply::RequestTrailers(TrailersResponse::default()))]
            }
            Some(Msg::ResponseHeaders(_)) => {
                vec![reply(Reply::ResponseHeaders(HeadersResponse::default()))]
            }
            Some(Msg::ResponseBody(_)) => {
                vec![reply(Reply::ResponseBody(BodyResponse::default()))]
            }
            Some(Msg::ResponseTrailers(_)) => {
                vec![reply(Reply::ResponseTrailers(TrailersResponse::default()))]
            }
            None => Vec::new(),
        };
        for r in replies {
            if tx.send(Ok(r)).await.is_err() {
                return;
            }
        }
    }
}

/// `BodySendMode::FullDuplexStreamed`.
const FULL_DUPLEX_STREAMED: i32 = 4;

fn reply(r: Reply) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        ..ProcessingResponse::default()
    }
}

/// The floor's fixed answer, built with the EPP's own reply builders so the
/// two servers send byte-for-byte the same kind of messages.
fn floor_mutation() -> epp_reply::Mutation {
    epp_reply::Mutation {
        set_headers: vec![(
            DESTINATION_ENDPOINT.to_string(),
            FLOOR_DESTINATION.to_string(),
        )],
        lb_metadata: vec![(
            DESTINATION_ENDPOINT.to_string(),
            FLOOR_DESTINATION.to_string(),
        )],
        ..epp_reply::Mutation::default()
    }
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// Accepted connections with `TCP_NODELAY` set. tonic only sets it on
/// listeners it binds itself; `serve_with_incoming*` takes sockets as they
/// come (Nagle on).
fn nodelay_incoming(
    listener: TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    TcpListenerStream::new(listener).map(|conn| {
        let conn = conn?;
        conn.set_nodelay(true)?;
        Ok(conn)
    })
}

/// The transport settings of `Epp::serve_ext_proc` (keepalive), plaintext.
fn builder() -> tonic::transport::Server {
    tonic::transport::Server::builder().http2_keepalive_interval(Some(Duration::from_secs(30)))
}

fn floor_router() -> Router {
    builder().add_service(
        ExternalProcessorServer::new(Floor)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE),
    )
}

/// The EPP's own ext_proc service, as `Epp::serve_ext_proc` builds it.
fn epp_router(epp: &Epp) -> Router {
    builder().add_service(
        ExtProcService::new(
            epp.picker.clone(),
            epp.picker.metrics().clone(),
            epp.settings.ext_proc.clone(),
        )
        .into_server(),
    )
}

/// Serves with `TCP_NODELAY` on every accepted connection.
async fn serve_nodelay(router: Router, listener: TcpListener, shutdown: oneshot::Receiver<()>) {
    let result = router
        .serve_with_incoming_shutdown(nodelay_incoming(listener), async {
            let _ = shutdown.await;
        })
        .await;
    if let Err(e) = result {
        eprintln!("ext_proc server: {e}");
    }
}

// ---------------------------------------------------------------------------
// The EPP under test.
// ---------------------------------------------------------------------------

fn endpoint_names() -> Vec<String> {
    (0..ENDPOINTS)
        .map(|i| format!("127.0.0.1:{}", 20001 + i))
        .collect()
}

fn build_epp() -> Epp {
    let epp = Epp::new(Settings {
        // Plaintext, like the floor (the gateway's TLS is not what we measure).
        secure_serving: false,
        ..Settings::default()
    });
    epp.policy()
        .load_text(POLICY)
        .expect("examples/pii-stays-local.yaml compiles");
    let specs = endpoint_names()
        .into_iter()
        .map(|a| EndpointSpec::new(a, &[MODEL]));
    epp.registry()
        .replace_all(endpoints_from_specs(specs).expect("endpoint specs are valid"));
    epp.registry().mark_synced();
    epp
}

/// Plays the scraper: fresh metrics for every endpoint every 50 ms (the
/// default scrape interval), without HTTP.
async fn refresh_metrics(epp: Epp) {
    let names = endpoint_names();
    let mut rng = StdRng::seed_from_u64(7);
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        let now = Instant::now();
        for name in &names {
            epp.registry().set_metrics(
                name,
                ScrapedMetrics {
                    waiting: f64::from(rng.random_range(0..4u8)),
                    running: f64::from(rng.random_range(0..16u8)),
                    kv_cache_usage: rng.random_range(0.1..0.8),
                    ..ScrapedMetrics::empty(now)
                },
            );
        }
    }
}

// ---------------------------------------------------------------------------
// Workloads.
// ---------------------------------------------------------------------------

const WORDS: &[&str] = &[
    "the",
    "model",
    "server",
    "request",
    "latency",
    "token",
    "cache",
    "prefix",
    "gateway",
    "endpoint",
    "policy",
    "route",
    "queue",
    "answer",
    "question",
    "summary",
    "report",
    "table",
    "column",
    "value",
    "update",
    "system",
    "user",
    "assistant",
    "context",
    "window",
    "batch",
    "prompt",
    "document",
    "section",
    "paragraph",
    "review",
    "change",
    "result",
    "error",
    "metric",
    "cluster",
    "node",
    "pod",
    "service",
    "deploy",
    "config",
    "please",
    "explain",
    "why",
    "how",
    "what",
    "when",
    "and",
    "or",
    "with",
    "from",
    "into",
    "over",
    "under",
    "about",
    "between",
    "quickly",
    "carefully",
    "again",
];

/// JSON-safe lines of pseudo-English, each ending in an escaped newline, so
/// any run of whole lines is valid inside a JSON string.
struct Corpus {
    lines: Vec<String>,
}

impl Corpus {
    fn new(seed: u64, count: usize) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let lines = (0..count)
            .map(|_| {
                let mut line = String::with_capacity(96);
                while line.len() < 72 {
                    if !line.is_empty() {
                        line.push(' ');
                    }
                    line.push_str(WORDS[rng.random_range(0..WORDS.len())]);
                    if rng.random_range(0..8) == 0 {
                        line.push(',');
                    }
                }
                line.push_str(".\\n");
                line
            })
            .collect();
        Corpus { lines }
    }

    /// Whole lines from `start` (wrapping) until `bytes` are reached.
    fn take(&self, out: &mut String, start: usize, bytes: usize) {
        let target = out.len() + bytes;
        let mut i = start % self.lines.len();
        while out.len() < target {
            out.push_str(&self.lines[i]);
            i = (i + 1) % self.lines.len();
        }
    }
}

enum Workload {
    /// ~1–2 KB chat bodies: one of 8 system prompts, a unique user turn; one
    /// in ten carries an e-mail address (the pii rule's traffic).
    Chat {
        corpus: Corpus,
        systems: Vec<String>,
    },
    /// 220 KB prompts: a group's 150 KB system prompt, a unique 70 KB tail.
    Large {
        corpus: Corpus,
        systems: Vec<String>,
    },
}

impl Workload {
    fn chat() -> Self {
        let corpus = Corpus::new(1, 4096);
        let systems = (0..8)
            .map(|g| {
                let mut s = format!("You are assistant number {g}. ");
                corpus.take(&mut s, g * 97, 400);
                s
            })
            .collect();
        Workload::Chat { corpus, systems }
    }

    fn large() -> Self {
        let corpus = Corpus::new(2, 16_384);
        let systems = (0..LARGE_GROUPS)
            .map(|g| {
                let mut s = format!("Group {g} knowledge base. ");
                corpus.take(&mut s, g * 1009, LARGE_PREFIX_BYTES);
                s
            })
            .collect();
        Workload::Large { corpus, systems }
    }

    fn groups(&self) -> usize {
        match self {
            Workload::Chat { systems, .. } | Workload::Large { systems, .. } => systems.len(),
        }
    }

    /// Request `id`'s body and its prefix group.
    fn body(&self, id: u64) -> (Vec<u8>, usize) {
        let (corpus, systems, tail) = match self {
            Workload::Chat { corpus, systems } => (corpus, systems, 600 + (id % 7) as usize * 100),
            Workload::Large { corpus, systems } => (corpus, systems, LARGE_TAIL_BYTES),
        };
        let group = (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % systems.len();
        let system = &systems[group];
        let mut user = format!("Request {id}: ");
        if matches!(self, Workload::Chat { .. }) && id % 10 == 3 {
            user.push_str(&format!("my e-mail is maria.gonzalez{id}@gmail.com, "));
        }
        corpus.take(&mut user, (id as usize).wrapping_mul(7919), tail);
        let mut body = Vec::with_capacity(system.len() + user.len() + 160);
        body.extend_from_slice(br#"{"model":""#);
        body.extend_from_slice(MODEL.as_bytes());
        body.extend_from_slice(br#"","messages":[{"role":"system","content":""#);
        body.extend_from_slice(system.as_bytes());
        body.extend_from_slice(br#""},{"role":"user","content":""#);
        body.extend_from_slice(user.as_bytes());
        body.extend_from_slice(br#""}],"max_tokens":256,"stream":true}"#);
        (body, group)
    }
}

// ---------------------------------------------------------------------------
// The load generator: Envoy's side of each stream.
// ---------------------------------------------------------------------------

type Client = ExternalProcessorClient<Channel>;

struct Decided {
    latency: Duration,
    destination: Option<String>,
    rule: Option<String>,
    immediate: Option<i32>,
}

fn set_header<'a>(common: &'a CommonResponse, key: &str) -> Option<&'a str> {
    common
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == key)
        .map(|h| std::str::from_utf8(&h.raw_value).unwrap_or(""))
}

/// The local endpoint list, or `provider/<name>` for a provider pick.
fn read_decision(c: &CommonResponse, destination: &mut Option<String>, rule: &mut Option<String>) {
    if let Some(d) =
        set_header(c, DESTINATION_ENDPOINT).or_else(|| set_header(c, DESTINATION_HEADER))
    {
        *destination = Some(d.to_string());
    }
    if let Some(r) = set_header(c, RULE_HEADER) {
        *rule = Some(r.to_string());
    }
}

fn lb_destination(r: &ProcessingResponse) -> Option<String> {
    let md = r.dynamic_metadata.as_ref()?;
    let Some(Kind::StructValue(lb)) = md.fields.get(LB_NAMESPACE)?.kind.as_ref() else {
        return None;
    };
    match lb.fields.get(DESTINATION_ENDPOINT)?.kind.as_ref()? {
        Kind::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

fn header_map(headers: &[(&str, String)]) -> HeaderMap {
    HeaderMap {
        headers: headers
            .iter()
            .map(|(k, v)| HeaderValue {
                key: k.to_string(),
                raw_value: v.as_bytes().to_vec(),
                ..HeaderValue::default()
            })
            .collect(),
    }
}

/// One HTTP request through ext_proc. The latency runs from sending the
/// request headers to the reply that completes the decision (buffered: the
/// body reply; streamed: the last handed-back body chunk). Then the response
/// path (headers with the served endpoint and a TTFT, end of body), and the
/// stream is closed.
async fn one_request(
    client: &mut Client,
    request: &HttpRequest,
    ttft_ms: f64,
    upstream: Duration,
) -> anyhow::Result<Decided> {
    let streamed = matches!(request.mode, BodyMode::Streamed(_));
    let mut messages = request.messages().into_iter();
    let expected_body = request.body.len();
    let (tx, rx) = mpsc::channel(16);
    let started = Instant::now();
    tx.send(messages.next().expect("headers message")).await?;
    if streamed {
        // Envoy streams the body without waiting for the headers answer.
        for m in messages.by_ref() {
            tx.send(m).await?;
        }
    }
    let mut inbound = client.process(ReceiverStream::new(rx)).await?.into_inner();
    let mut destination = None;
    let mut lb = None;
    let mut rule = None;
    let mut immediate = None;
    let mut echoed = 0usize;
    loop {
        let Some(r) = inbound.message().await? else {
            anyhow::bail!("stream closed before the decision");
        };
        if let Some(d) = lb_destination(&r) {
            lb = Some(d);
        }
        match &r.response {
            Some(Reply::ImmediateResponse(i)) => {
                immediate = Some(i.status.as_ref().map_or(200, |s| s.code));
                break;
            }
            Some(Reply::RequestHeaders(h)) => {
                if let Some(c) = &h.response {
                    read_decision(c, &mut destination, &mut rule);
                }
                if !streamed {
                    // Buffered: Envoy sends the body once headers are answered.
                    for m in messages.by_ref() {
                        tx.send(m).await?;
                    }
                }
            }
            Some(Reply::RequestBody(b)) => {
                let c = b.response.as_ref();
                if !streamed {
                    if let Some(c) = c {
                        read_decision(c, &mut destination, &mut rule);
                    }
                    break;
                }
                match c
                    .and_then(|c| c.body_mutation.as_ref())
                    .and_then(|m| m.mutation.as_ref())
                {
                    Some(body_mutation::Mutation::StreamedResponse(s)) => {
                        echoed += s.body.len();
                        if s.end_of_stream {
                            break;
                        }
                    }
                    _ => anyhow::bail!("streamed mode: a body reply without a streamed body"),
                }
            }
            other => anyhow::bail!("unexpected reply {other:?}"),
        }
    }
    let latency = started.elapsed();
    if immediate.is_none() {
        let dest = destination
            .clone()
            .ok_or_else(|| anyhow::anyhow!("no destination header"))?;
        // The header names the selected endpoint; the metadata lists it first,
        // then the fallbacks.
        let listed_first = lb.as_deref().and_then(|l| l.split(',').next());
        if !dest.starts_with("provider/") && listed_first != Some(dest.as_str()) {
            anyhow::bail!("header {dest:?} is not the first endpoint of envoy.lb metadata {lb:?}");
        }
        if streamed && echoed != expected_body {
            anyhow::bail!("streamed body: {echoed} bytes back, {expected_body} sent");
        }
        // The upstream serves the request; the ext_proc stream stays open.
        if !upstream.is_zero() {
            tokio::time::sleep(upstream).await;
        }
        // Response path, as the demo gateway reports it.
        let served = dest.split(',').next().unwrap_or_default().to_string();
        let metadata = Metadata {
            filter_metadata: [(
                LB_NAMESPACE.to_string(),
                Struct {
                    fields: [(SERVED_ENDPOINT.to_string(), string(&served))].into(),
                },
            )]
            .into(),
            ..Metadata::default()
        };
        tx.send(ProcessingRequest {
            metadata_context: Some(metadata),
            request: Some(Msg::ResponseHeaders(HttpHeaders {
                headers: Some(header_map(&[
                    (":status", "200".to_string()),
                    (OBSERVED_TTFT_HEADER, format!("{ttft_ms:.3}")),
                ])),
                ..HttpHeaders::default()
            })),
            ..ProcessingRequest::default()
        })
        .await?;
        inbound.message().await?;
        tx.send(ProcessingRequest {
            request: Some(Msg::ResponseBody(HttpBody {
                end_of_stream: true,
                ..HttpBody::default()
            })),
            ..ProcessingRequest::default()
        })
        .await?;
        inbound.message().await?;
    }
    drop(tx);
    // Let the server end its side; bounded in case it does not.
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(_)) = inbound.message().await {}
    })
    .await;
    Ok(Decided {
        latency,
        destination,
        rule,
        immediate,
    })
}

/// One phase: its requests, clients and time cap, and how the body is sent.
#[derive(Clone, Copy)]
struct Spec {
    phase: PhaseSpec,
    mode: BodyMode,
    /// Mean time the upstream holds each request after the decision (uniform
    /// 0.5×–1.5×); zero: the next request starts at once (closed loop, the
    /// EPP saturated).
    upstream: Duration,
}

#[derive(Default)]
struct PhaseResult {
    tally: Tally,
    statuses: HashMap<i32, u64>,
    rules: HashMap<String, u64>,
    destinations: HashMap<String, u64>,
    /// Per prefix group: requests per destination.
    groups: HashMap<usize, HashMap<String, u64>>,
    window: Window<GROUPS>,
}

impl Outcome for PhaseResult {
    fn tally(&mut self) -> &mut Tally {
        &mut self.tally
    }

    fn merge(&mut self, o: PhaseResult) {
        self.tally.merge(o.tally);
        for (k, v) in o.statuses {
            *self.statuses.entry(k).or_default() += v;
        }
        for (k, v) in o.rules {
            *self.rules.entry(k).or_default() += v;
        }
        for (k, v) in o.destinations {
            *self.destinations.entry(k).or_default() += v;
        }
        for (g, m) in o.groups {
            let e = self.groups.entry(g).or_default();
            for (k, v) in m {
                *e.entry(k).or_default() += v;
            }
        }
    }
}

impl PhaseResult {
    fn measured(&self) -> u64 {
        self.tally.measured() + self.statuses.values().sum::<u64>()
    }

    /// Completions per second while every stream was busy (from the end of
    /// the warm-up until the first stream ran out of requests), so neither
    /// ramp-up nor ramp-down counts.
    fn rps(&self) -> f64 {
        self.window.rps(self.measured())
    }

    fn quantile(&self, q: f64) -> Duration {
        self.tally.quantile(q)
    }

    fn cpu_per_request(&self) -> Duration {
        self.window.cpu[SERVER] / self.measured().max(1) as u32
    }
}

async fn run_phase(
    clients: &[Client],
    workload: Arc<Workload>,
    spec: Spec,
    server_threads: &'static str,
) -> PhaseResult {
    let clocks = Clocks::new([server_threads, LOAD_THREADS]);
    let phase = Arc::new(Phase::new(&spec.phase, clocks));
    let mut tasks = Vec::new();
    for w in 0..spec.phase.concurrency {
        let mut client = clients[w % clients.len()].clone();
        let (workload, phase) = (workload.clone(), phase.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = PhaseResult::default();
            let mut rng = StdRng::seed_from_u64(w as u64);
            if !spec.upstream.is_zero() {
                // Stagger the streams so they do not move in lockstep.
                tokio::time::sleep(spec.upstream.mul_f64(rng.random_range(0.0..1.0))).await;
            }
            while let Some(Turn { id, measured }) = phase.next() {
                let (body, group) = workload.body(id);
                let mut request = HttpRequest::post("/v1/chat/completions", body);
                if let BodyMode::Streamed(n) = spec.mode {
                    request = request.streamed(n);
                }
                let ttft_ms = rng.random_range(40.0..120.0);
                let upstream = spec.upstream.mul_f64(rng.random_range(0.5..1.5));
                let result = one_request(&mut client, &request, ttft_ms, upstream).await;
                if !measured {
                    continue;
                }
                phase.completed();
                match result {
                    Ok(d) => {
                        if let Some(status) = d.immediate {
                            *out.statuses.entry(status).or_default() += 1;
                            continue;
                        }
                        out.tally.latencies.push(d.latency);
                        let rule = d.rule.unwrap_or_else(|| "-".to_string());
                        *out.rules.entry(rule).or_default() += 1;
                        let first = d
                            .destination
                            .as_deref()
                            .and_then(|s| s.split(',').next())
                            .unwrap_or_default()
                            .to_string();
                        *out.groups
                            .entry(group)
                            .or_default()
                            .entry(first.clone())
                            .or_default() += 1;
                        *out.destinations.entry(first).or_default() += 1;
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
        "| phase | requests | conc | req/s | p50 ms | p90 ms | p99 ms | max ms | server CPU µs/req | cores: server / load gen / other procs | errors | rejects |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|");
}

fn print_row(label: &str, spec: &Spec, r: &PhaseResult) {
    let rejects = if r.statuses.is_empty() {
        "-".to_string()
    } else {
        let mut s: Vec<_> = r.statuses.iter().map(|(k, v)| format!("{k}×{v}")).collect();
        s.sort();
        s.join(" ")
    };
    println!(
        "| {label} | {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {:.2} / {:.2} / {:.2} | {} | {}{} |",
        r.measured(),
        spec.phase.concurrency,
        r.rps(),
        ms(r.quantile(0.50)),
        ms(r.quantile(0.90)),
        ms(r.quantile(0.99)),
        ms(r.tally.max()),
        r.cpu_per_request().as_secs_f64() * 1e6,
        r.window.cores(r.window.cpu[SERVER]),
        r.window.cores(r.window.cpu[LOAD]),
        r.window.cpu.others_cores(),
        r.tally.errors,
        rejects,
        if r.window.truncated {
            " (time cap hit)"
        } else {
            ""
        },
    );
}

fn routing_line(label: &str, r: &PhaseResult, groups: usize) -> String {
    let mut rules: Vec<_> = r.rules.iter().collect();
    rules.sort();
    let rules: Vec<String> = rules.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let busiest = r.destinations.values().max().copied().unwrap_or(0);
    let per_group: Vec<usize> = (0..groups)
        .map(|g| r.groups.get(&g).map_or(0, HashMap::len))
        .collect();
    let mean = per_group.iter().sum::<usize>() as f64 / groups.max(1) as f64;
    // Share of each group's requests that went to that group's top endpoint.
    let top: u64 = r
        .groups
        .values()
        .map(|m| m.values().max().copied().unwrap_or(0))
        .sum();
    let mut line = format!(
        "- {label}: rules [{}]; {} endpoints used (busiest {busiest}); per prefix group {mean:.1} endpoints on average, {:.0}% of requests on the group's top endpoint",
        rules.join(", "),
        r.destinations.len(),
        100.0 * top as f64 / r.tally.latencies.len().max(1) as f64,
    );
    if let Some(e) = &r.tally.first_error {
        line.push_str(&format!("; first error: {e}"));
    }
    line
}

/// A target's verdict; none when no request was answered, and the errors,
/// if any, beside it.
fn verdict(met: bool, tally: &Tally) -> String {
    let mut v = match (tally.latencies.is_empty(), met) {
        (true, _) => "NOT MEASURED (no request answered)",
        (false, true) => "MET",
        (false, false) => "MISSED",
    }
    .to_string();
    if tally.errors > 0 {
        v.push_str(&format!(" ({} errors)", tally.errors));
    }
    v
}

struct Scenario {
    name: String,
    /// For `LOAD_PHASES` and the command-line filter.
    key: &'static str,
    /// See [`Spec::upstream`].
    upstream: Duration,
    workload: Arc<Workload>,
    requests: u64,
    warmup: u64,
    concurrency: usize,
    target: Target,
}

#[derive(Clone, Copy)]
enum Target {
    /// EPP p99 within this multiple of the floor's p99.
    RatioOfFloor(f64),
    /// EPP p99 minus the floor's p99 under this.
    AddedP99(Duration),
}

struct Server {
    name: &'static str,
    clients: Vec<Client>,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

/// `connections` HTTP/2 connections (Envoy opens one per worker thread).
async fn connect(addr: SocketAddr, connections: usize) -> anyhow::Result<Vec<Client>> {
    let mut out = Vec::new();
    for _ in 0..connections {
        let channel = Channel::from_shared(format!("http://{addr}"))?
            .connect()
            .await?;
        out.push(
            ExternalProcessorClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        );
    }
    Ok(out)
}

/// The EPP's own counters (its `/metrics`), to see inside a phase: time in
/// `Picker::pick` (classifiers included) and classifier outcomes.
#[derive(Default, Clone, Copy)]
struct EppCounters {
    decisions: f64,
    decision_seconds: f64,
    classifier_runs: f64,
    classifier_seconds: f64,
    classifier_timeouts: f64,
    classifier_failures: f64,
}

impl EppCounters {
    fn read(epp: &Epp) -> Self {
        let hash = epp.policy().loaded_hash();
        let text = epp.picker.metrics().render(epp.registry(), hash.as_deref());
        let sum =
            |name: &str| metric_sum(&text, name) + metric_sum(&text, &format!("{name}_total"));
        EppCounters {
            decisions: sum("kinference_epp_decision_duration_seconds_count"),
            decision_seconds: sum("kinference_epp_decision_duration_seconds_sum"),
            classifier_runs: sum("kinference_epp_classifier_duration_seconds_count"),
            classifier_seconds: sum("kinference_epp_classifier_duration_seconds_sum"),
            classifier_timeouts: sum("kinference_epp_classifier_timeouts"),
            classifier_failures: sum("kinference_epp_classifier_failures"),
        }
    }

    fn since(&self, before: &Self) -> Self {
        EppCounters {
            decisions: self.decisions - before.decisions,
            decision_seconds: self.decision_seconds - before.decision_seconds,
            classifier_runs: self.classifier_runs - before.classifier_runs,
            classifier_seconds: self.classifier_seconds - before.classifier_seconds,
            classifier_timeouts: self.classifier_timeouts - before.classifier_timeouts,
            classifier_failures: self.classifier_failures - before.classifier_failures,
        }
    }

    fn describe(&self) -> String {
        format!(
            "inside the EPP (its metrics, warm-up included): Picker::pick mean {:.0} µs over {} decisions, pii classifier mean {:.0} µs over {} runs, {} timed out, {} failed",
            1e6 * self.decision_seconds / self.decisions.max(1.0),
            self.decisions,
            1e6 * self.classifier_seconds / self.classifier_runs.max(1.0),
            self.classifier_runs,
            self.classifier_timeouts,
            self.classifier_failures,
        )
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let phase_filter = std::env::var("LOAD_PHASES").ok();
    let server_threads = env_or("LOAD_SERVER_THREADS", 2) as usize;
    let client_threads = env_or("LOAD_CLIENT_THREADS", 2) as usize;
    let connections = env_or("LOAD_CONNECTIONS", 4).max(1) as usize;
    let max_time = Duration::from_secs(env_or("LOAD_MAX_SECS", 60));

    // Two runtimes, like two processes: the servers (EPP and floor, with their
    // blocking pools) and the load generator. Named threads let us read the
    // servers' CPU time apart from the client's.
    let server_rt = runtime(SERVER_THREADS, server_threads)?;
    let client_rt = runtime(LOAD_THREADS, client_threads)?;

    let epp = build_epp();
    let refresher = server_rt.spawn(refresh_metrics(epp.clone()));
    // Three servers on loopback: the floor; the EPP exactly as
    // `Epp::serve_ext_proc` serves it; the same EPP service with TCP_NODELAY.
    let mut servers: Vec<Server> = Vec::new();
    for name in ["floor", "epp", "epp+nodelay"] {
        let listener = server_rt.block_on(TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = match name {
            "floor" => server_rt.spawn(serve_nodelay(floor_router(), listener, stopped)),
            "epp" => {
                let epp = epp.clone();
                server_rt.spawn(async move {
                    let stopped = async {
                        let _ = stopped.await;
                    };
                    if let Err(e) = epp.serve_ext_proc(listener, stopped).await {
                        eprintln!("EPP server: {e:#}");
                    }
                })
            }
            _ => server_rt.spawn(serve_nodelay(epp_router(&epp), listener, stopped)),
        };
        let clients = client_rt.block_on(connect(addr, connections))?;
        servers.push(Server {
            name,
            clients,
            stop,
            task,
        });
    }

    let large = Arc::new(Workload::large());
    let large_concurrency = env_or("LOAD_LARGE_CONCURRENCY", 150) as usize;
    let upstream_ms = env_or("LOAD_UPSTREAM_MS", 1_000);
    let mut scenarios = vec![
        Scenario {
            name: "(a) chat ~1.5 KB, closed loop".into(),
            workload: Arc::new(Workload::chat()),
            requests: env_or("LOAD_NORMAL_REQUESTS", 20_000),
            warmup: 2_000,
            concurrency: env_or("LOAD_NORMAL_CONCURRENCY", 64) as usize,
            key: "normal",
            upstream: Duration::ZERO,
            target: Target::RatioOfFloor(3.0),
        },
        Scenario {
            name: "(c1) 220 KB prompts, closed loop (saturation)".into(),
            workload: large.clone(),
            requests: env_or("LOAD_LARGE_REQUESTS", 3_000),
            warmup: 300,
            concurrency: large_concurrency,
            key: "large-saturated",
            upstream: Duration::ZERO,
            target: Target::AddedP99(Duration::from_millis(10)),
        },
        Scenario {
            name: format!(
                "(c2) 220 KB prompts, {large_concurrency} in flight, upstream holds each ~{upstream_ms} ms"
            ),
            workload: large,
            requests: env_or("LOAD_LARGE_PACED_REQUESTS", 1_500),
            warmup: 300,
            concurrency: large_concurrency,
            key: "large-paced",
            upstream: Duration::from_millis(upstream_ms),
            target: Target::AddedP99(Duration::from_millis(10)),
        },
    ];
    scenarios.retain(|sc| args.is_empty() || args.iter().any(|a| sc.key.contains(a.as_str())));

    println!(
        "extproc_load: {} cores, server runtime {server_threads} workers, load generator {client_threads} workers, {connections} gRPC connections per server, {ENDPOINTS} endpoints, policy examples/pii-stays-local.yaml",
        cores(),
    );
    let mut verdicts = Vec::new();
    for sc in &scenarios {
        println!();
        println!("### {}", sc.name);
        print_header();
        let mut notes = Vec::new();
        for (mode_name, mode) in [
            ("buffered", BodyMode::Buffered),
            ("streamed", BodyMode::Streamed(CHUNK)),
        ] {
            let spec = Spec {
                phase: PhaseSpec {
                    requests: sc.requests,
                    warmup: sc.warmup,
                    concurrency: sc.concurrency,
                    max_time,
                },
                mode,
                upstream: sc.upstream,
            };
            let mut floor: Option<PhaseResult> = None;
            for server in &servers {
                let label = format!("{} {mode_name}", server.name);
                let key = format!("{}-{}-{mode_name}", server.name, sc.key);
                if phase_filter.as_deref().is_some_and(|f| !key.contains(f)) {
                    continue;
                }
                let before = EppCounters::read(&epp);
                let r = client_rt.block_on(run_phase(
                    &server.clients,
                    sc.workload.clone(),
                    spec,
                    SERVER_THREADS,
                ));
                print_row(&label, &spec, &r);
                if server.name == "floor" {
                    if r.tally.errors > 0 {
                        notes.push(routing_line(&label, &r, sc.workload.groups()));
                    }
                    floor = Some(r);
                    continue;
                }
                let inside = EppCounters::read(&epp).since(&before);
                notes.push(format!(
                    "{}; {}",
                    routing_line(&label, &r, sc.workload.groups()),
                    inside.describe()
                ));
                let Some(floor) = &floor else { continue };
                let (f99, e99) = (floor.quantile(0.99), r.quantile(0.99));
                let ratio = e99.as_secs_f64() / f99.as_secs_f64().max(1e-9);
                let added = e99.saturating_sub(f99);
                let cpu_added = r.cpu_per_request().saturating_sub(floor.cpu_per_request());
                let (met, target) = match sc.target {
                    Target::RatioOfFloor(x) => (ratio <= x, format!("EPP p99 ≤ {x}× floor p99")),
                    Target::AddedP99(d) => (added < d, format!("added p99 < {:.2} ms", ms(d))),
                };
                verdicts.push(format!(
                    "{} {label}: EPP/floor p99 {ratio:.2}×, added p99 {:.2} ms, added p50 {:.2} ms, req/s {:.0} vs {:.0} ({:.0}%), added server CPU {:.0} µs/req — target {target}: {}",
                    sc.name,
                    ms(added),
                    ms(r.quantile(0.5).saturating_sub(floor.quantile(0.5))),
                    r.rps(),
                    floor.rps(),
                    100.0 * r.rps() / floor.rps().max(1e-9),
                    cpu_added.as_secs_f64() * 1e6,
                    verdict(met, &r.tally),
                ));
            }
        }
        println!();
        for n in notes {
            println!("{n}");
        }
    }
    println!();
    println!(
        "Server runtime threads at the end: {} ({server_threads} workers; the rest is the blocking pool, grown by classifier `spawn_blocking` calls that ran at once).",
        cpu::thread_count(SERVER_THREADS)
    );
    println!();
    println!("### Verdicts");
    for v in &verdicts {
        println!("- {v}");
    }

    refresher.abort();
    let mut tasks = Vec::new();
    for server in servers {
        let _ = server.stop.send(());
        drop(server.clients);
        tasks.push(server.task);
    }
    server_rt.block_on(async {
        let _ =
            tokio::time::timeout(Duration::from_secs(5), futures::future::join_all(tasks)).await;
    });
    client_rt.shutdown_timeout(Duration::from_secs(1));
    server_rt.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}
