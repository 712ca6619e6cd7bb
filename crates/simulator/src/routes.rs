//! HTTP routes: the OpenAI endpoints, `/v1/models`, `/metrics` and `/health`.

use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use xxhash_rust::xxh3::xxh3_64;

use crate::config::{SimConfig, StreamHeaders};
use crate::engine::{Active, Api, Engine, Job, Killed, Prompt, Timing};
use crate::metrics::{self, MetricsMode};
use crate::openai::{
    ApiError, AssistantMessage, ChatChoice, ChatChunk, ChatCompletion, ChatRequest, ChunkChoice,
    CompletionRequest, Delta, Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage,
    EmbeddingValue, ModelCard, ModelList, OutputMessage, OutputText, ResponseObject,
    ResponsesRequest, TextChoice, TextCompletion, Usage, base64_f32, embedding, filler_text,
    filler_token,
};

/// How many credential headers [`Shared::credentials_seen`] keeps.
const CREDENTIALS_KEPT: usize = 256;

/// State shared by the routes and the [`crate::SimHandle`].
pub(crate) struct Shared {
    pub cfg: Arc<SimConfig>,
    pub engine: Arc<Engine>,
    pub metrics_mode: watch::Sender<MetricsMode>,
    /// Exposition served while the mode is [`MetricsMode::Frozen`].
    pub frozen_metrics: Mutex<String>,
    /// Status forced on inference requests; 0 = none.
    pub error_status: AtomicU16,
    /// Set once the server starts shutting down or is killed.
    pub stopping: watch::Sender<bool>,
    /// Credential headers of the last inference requests (`name: value`),
    /// so tests can prove which credentials reached which server.
    pub credentials_seen: Mutex<std::collections::VecDeque<String>>,
    next_id: AtomicU64,
    created: u64,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Shared {
    pub(crate) fn new(cfg: Arc<SimConfig>) -> Self {
        Self {
            engine: Arc::new(Engine::new(Arc::clone(&cfg))),
            cfg,
            metrics_mode: watch::Sender::new(MetricsMode::Live),
            frozen_metrics: Mutex::new(String::new()),
            credentials_seen: Mutex::default(),
            error_status: AtomicU16::new(0),
            stopping: watch::Sender::new(false),
            next_id: AtomicU64::new(0),
            created: unix_now(),
        }
    }

    /// The current metrics exposition.
    pub(crate) fn render_metrics(&self) -> String {
        let snap = self.engine.snapshot();
        metrics::render(&self.cfg, &snap, self.engine.kv_usage(snap.kv_used_tokens))
    }

    fn next_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!(
            "{prefix}-{:08x}{n:08x}",
            xxh3_64(self.cfg.name.as_bytes()) as u32
        )
    }

    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        self.remember_credentials(headers);
        let Some(key) = &self.cfg.api_key else {
            return Ok(());
        };
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if presented == Some(key.as_str()) {
            Ok(())
        } else {
            Err(ApiError::unauthorized())
        }
    }

    fn remember_credentials(&self, headers: &HeaderMap) {
        const CREDENTIALS: [&str; 5] = [
            "authorization",
            "proxy-authorization",
            "x-api-key",
            "api-key",
            "cookie",
        ];
        let mut seen = self
            .credentials_seen
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for name in CREDENTIALS {
            for value in headers.get_all(name) {
                if seen.len() == CREDENTIALS_KEPT {
                    seen.pop_front();
                }
                seen.push_back(format!(
                    "{name}: {}",
                    String::from_utf8_lossy(value.as_bytes())
                ));
            }
        }
    }

    fn serves(&self, model: &str) -> bool {
        self.cfg.models.iter().any(|m| m == model)
            || self.cfg.lora_adapters.iter().any(|m| m == model)
    }

    /// Authentication, JSON parsing, model lookup and forced errors, in that order.
    fn accept<T: DeserializeOwned + Model>(
        &self,
        headers: &HeaderMap,
        body: Result<Bytes, BytesRejection>,
    ) -> Result<T, ApiError> {
        self.authorize(headers)?;
        let body = body.map_err(|e| ApiError::body_rejected(e.status(), e.body_text()))?;
        let req: T = serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))?;
        if !self.serves(req.model()) {
            return Err(ApiError::model_not_found(req.model()));
        }
        match self.error_status.load(Ordering::Relaxed) {
            0 => Ok(req),
            code => Err(ApiError::injected(
                StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            )),
        }
    }

    /// Checks the context window and builds the job: what a server does
    /// before it answers anything.
    fn job(
        &self,
        api: Api,
        model: &str,
        prompt: &Prompt,
        max_tokens: u32,
    ) -> Result<Job, ApiError> {
        if let Some(limit) = self.cfg.max_model_len {
            let requested = prompt.tokens + u64::from(max_tokens);
            if requested > limit {
                return Err(ApiError::context_length(limit, requested));
            }
        }
        Ok(Job::new(
            &self.cfg,
            api,
            model.to_owned(),
            prompt,
            max_tokens,
        ))
    }

    /// Waits through queue and prefill.
    async fn run(&self, job: Job) -> Result<Active, ApiError> {
        self.engine
            .admit(job)
            .await
            .map_err(|Killed| ApiError::unavailable())
    }

    /// A streamed answer of `n` tokens for `job`, its headers sent as
    /// [`SimConfig::stream_headers`] says.
    async fn stream<E: Encoder>(
        &self,
        job: Job,
        encoder: E,
        seed: u64,
        n: u32,
        include_usage: bool,
    ) -> Response {
        let engine = Arc::clone(&self.engine);
        match self.cfg.stream_headers {
            StreamHeaders::Admission => {
                let admission = async move { engine.admit(job).await };
                stream_response(admission, encoder, seed, n, include_usage)
            }
            StreamHeaders::FirstToken => {
                let active = match engine.admit(job).await {
                    Ok(active) => active,
                    Err(Killed) => return self.reject(ApiError::unavailable()),
                };
                let timing = active.timing;
                let admission = std::future::ready(Ok(active));
                let mut resp = stream_response(admission, encoder, seed, n, include_usage);
                add_timing_headers(resp.headers_mut(), &timing);
                resp
            }
        }
    }

    fn reject(&self, err: ApiError) -> Response {
        self.engine.record_rejected();
        err.into_response()
    }
}

/// Requests that name a model.
trait Model {
    fn model(&self) -> &str;
}

macro_rules! impl_model {
    ($($t:ty),*) => {$(impl Model for $t { fn model(&self) -> &str { &self.model } })*};
}
impl_model!(
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    ResponsesRequest
);

type AppState = State<Arc<Shared>>;

/// A request body, or why it could not be read (e.g. over the size limit).
type RawBody = Result<Bytes, BytesRejection>;

/// Builds the router of one simulated server.
pub(crate) fn router(shared: Arc<Shared>) -> Router {
    let server_name =
        HeaderValue::from_str(&shared.cfg.name).unwrap_or(HeaderValue::from_static("sim"));
    let body_limit = shared.cfg.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics_route))
        .route("/health", get(health))
        .fallback(fallback)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::map_response(move |mut resp: Response| {
            let server_name = server_name.clone();
            async move {
                resp.headers_mut()
                    .insert(HeaderName::from_static("x-sim-server"), server_name);
                resp
            }
        }))
        .with_state(shared)
}

// ---------------------------------------------------------------- helpers

fn json_response<T: Serialize>(value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// A JSON inference response with the `x-sim-*` timing headers.
fn timed_json_response<T: Serialize>(value: &T, timing: &Timing) -> Response {
    let mut resp = json_response(value);
    add_timing_headers(resp.headers_mut(), timing);
    resp
}

/// `x-sim-*` headers describing the simulator's own view of the request.
fn add_timing_headers(headers: &mut HeaderMap, t: &Timing) {
    let ms = |d: std::time::Duration| format!("{:.3}", d.as_secs_f64() * 1000.0);
    let values = [
        ("x-sim-ttft-ms", ms(t.ttft())),
        ("x-sim-queue-ms", ms(t.queue)),
        ("x-sim-prefill-ms", ms(t.prefill)),
        ("x-sim-prompt-tokens", t.prompt_tokens.to_string()),
        ("x-sim-cached-tokens", t.cached_tokens.to_string()),
    ];
    for (name, value) in values {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static(name), value);
        }
    }
}

fn sse_data<T: Serialize>(value: &T) -> Bytes {
    let mut out = b"data: ".to_vec();
    // Serializing these plain structs cannot fail.
    let _ = serde_json::to_writer(&mut out, value);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

fn sse_event<T: Serialize>(event: &str, value: &T) -> Bytes {
    let mut out = format!("event: {event}\n").into_bytes();
    out.extend_from_slice(&sse_data(value));
    Bytes::from(out)
}

const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// Events a streamed response is made of, rendered per API by [`Encoder`].
enum Event {
    Start,
    Token(String),
    Finish,
    Usage(Usage),
}

/// Renders [`Event`]s as SSE frames for one API.
trait Encoder: Send + 'static {
    fn encode(&mut self, event: Event) -> Option<Bytes>;

    /// Whether [`Event::Start`] goes out before queueing and prefill, as
    /// vLLM's `response.created`, rather than with the first token, as its
    /// chat role chunk.
    fn starts_at_admission(&self) -> bool {
        false
    }
}

/// Waits for `admission` (queue and prefill), then decodes `n` tokens at
/// the configured pace and sends `n` SSE frames (plus start, finish and
/// optional usage frames, then `[DONE]`) through the body. The running slot
/// is held until the stream ends or the client goes away.
fn stream_response<E: Encoder>(
    admission: impl Future<Output = Result<Active, Killed>> + Send + 'static,
    encoder: E,
    seed: u64,
    n: u32,
    include_usage: bool,
) -> Response {
    let (tx, rx) = mpsc::channel(8);
    tokio::spawn(async move {
        // An error means the client went away or the server was killed:
        // stopping here drops `active`, which frees the slot.
        let _ = produce_stream(admission, encoder, seed, n, include_usage, &tx).await;
    });
    let body = Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|frame| (frame, rx))
    }));
    let mut resp = Response::new(body);
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

type Frame = Result<Bytes, std::io::Error>;

/// The receiving end of a stream is gone.
struct Closed;

async fn produce_stream<E: Encoder>(
    admission: impl Future<Output = Result<Active, Killed>>,
    mut encoder: E,
    seed: u64,
    n: u32,
    include_usage: bool,
    tx: &mpsc::Sender<Frame>,
) -> Result<(), Closed> {
    let emit = async |frame: Option<Bytes>| match frame {
        Some(frame) => tx.send(Ok(frame)).await.map_err(|_| Closed),
        None => Ok(()),
    };
    // Abort the body so the client sees a broken stream, not an end.
    let abort = async || {
        let _ = tx.send(Err(std::io::Error::other("server killed"))).await;
        Closed
    };
    let early_start = encoder.starts_at_admission();
    if early_start {
        emit(encoder.encode(Event::Start)).await?;
    }
    let Ok(active) = admission.await else {
        return Err(abort().await);
    };
    if !early_start {
        emit(encoder.encode(Event::Start)).await?;
    }
    let start = Instant::now();
    let interval = active.token_interval();
    for i in 0..n {
        if active.sleep_until(start + interval * i).await.is_err() {
            return Err(abort().await);
        }
        emit(encoder.encode(Event::Token(filler_token(seed, i)))).await?;
    }
    emit(encoder.encode(Event::Finish)).await?;
    let usage = Usage::new(
        active.timing.prompt_tokens,
        u64::from(n),
        active.timing.cached_tokens,
    );
    active.finish(n);
    if include_usage {
        emit(encoder.encode(Event::Usage(usage))).await?;
    }
    emit(Some(Bytes::from_static(SSE_DONE))).await
}

/// Waits out the decode of `n` tokens for a non-streamed response, then
/// frees the slot and returns the usage.
async fn decode_all(active: Active, n: u32) -> Result<(Timing, Usage), ApiError> {
    let deadline = Instant::now() + active.token_interval() * n.saturating_sub(1);
    active
        .sleep_until(deadline)
        .await
        .map_err(|Killed| ApiError::unavailable())?;
    let timing = active.timing;
    active.finish(n);
    let usage = Usage::new(timing.prompt_tokens, u64::from(n), timing.cached_tokens);
    Ok((timing, usage))
}

/// Seed of the filler text: a hash of the prompt's last 256 bytes.
fn seed_of(prompt: &Prompt) -> u64 {
    xxh3_64(&prompt.text.as_bytes()[prompt.text.len().saturating_sub(256)..])
}

macro_rules! tri {
    ($shared:expr, $e:expr) => {
        match $e {
            Ok(v) => v,
            Err(err) => return $shared.reject(err),
        }
    };
}

// ---------------------------------------------------------------- chat

struct ChatEncoder {
    id: String,
    created: u64,
    model: String,
}

impl ChatEncoder {
    fn chunk(&self, delta: Delta, finish: Option<&'static str>, usage: Option<Usage>) -> Bytes {
        let choices = if usage.is_some() {
            Vec::new()
        } else {
            vec![ChunkChoice {
                index: 0,
                delta,
                logprobs: None,
                finish_reason: finish,
            }]
        };
        sse_data(&ChatChunk {
            id: &self.id,
            object: "chat.completion.chunk",
            created: self.created,
            model: &self.model,
            choices,
            usage,
        })
    }
}

impl Encoder for ChatEncoder {
    fn encode(&mut self, event: Event) -> Option<Bytes> {
        Some(match event {
            Event::Start => self.chunk(
                Delta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                },
                None,
                None,
            ),
            Event::Token(text) => self.chunk(
                Delta {
                    role: None,
                    content: Some(text),
                },
                None,
                None,
            ),
            Event::Finish => self.chunk(Delta::default(), Some("length"), None),
            Event::Usage(usage) => self.chunk(Delta::default(), None, Some(usage)),
        })
    }
}

async fn chat(State(s): AppState, headers: HeaderMap, body: RawBody) -> Response {
    let req: ChatRequest = tri!(s, s.accept(&headers, body));
    let n = req
        .max_completion_tokens
        .or(req.max_tokens)
        .unwrap_or(s.cfg.default_max_tokens);
    let prompt = req.prompt();
    let seed = seed_of(&prompt);
    let job = tri!(s, s.job(Api::Chat, &req.model, &prompt, n));
    drop(prompt);
    let id = s.next_id("chatcmpl");
    if req.stream.unwrap_or(false) {
        let include_usage = req
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let encoder = ChatEncoder {
            id,
            created: unix_now(),
            model: req.model,
        };
        return s.stream(job, encoder, seed, n, include_usage).await;
    }
    let active = tri!(s, s.run(job).await);
    let (timing, usage) = tri!(s, decode_all(active, n).await);
    let body = ChatCompletion {
        id,
        object: "chat.completion",
        created: unix_now(),
        model: req.model,
        choices: vec![ChatChoice {
            index: 0,
            message: AssistantMessage {
                role: "assistant",
                content: filler_text(seed, n),
            },
            logprobs: None,
            finish_reason: "length",
        }],
        usage,
    };
    timed_json_response(&body, &timing)
}

// ---------------------------------------------------------------- completions

struct CompletionEncoder {
    id: String,
    created: u64,
    model: String,
}

impl CompletionEncoder {
    fn chunk(&self, choices: Vec<TextChoice>, usage: Option<Usage>) -> Bytes {
        sse_data(&TextCompletion {
            id: &self.id,
            object: "text_completion",
            created: self.created,
            model: &self.model,
            choices,
            usage,
        })
    }
}

impl Encoder for CompletionEncoder {
    fn encode(&mut self, event: Event) -> Option<Bytes> {
        let choice = |text: String, finish_reason| TextChoice {
            index: 0,
            text,
            logprobs: None,
            finish_reason,
        };
        match event {
            Event::Start => None,
            Event::Token(text) => Some(self.chunk(vec![choice(text, None)], None)),
            Event::Finish => Some(self.chunk(vec![choice(String::new(), Some("length"))], None)),
            Event::Usage(usage) => Some(self.chunk(Vec::new(), Some(usage))),
        }
    }
}

async fn completions(State(s): AppState, headers: HeaderMap, body: RawBody) -> Response {
    let req: CompletionRequest = tri!(s, s.accept(&headers, body));
    let n = req.max_tokens.unwrap_or(s.cfg.default_max_tokens);
    let prompt = req.prompt.prompt();
    let seed = seed_of(&prompt);
    let job = tri!(s, s.job(Api::Completions, &req.model, &prompt, n));
    drop(prompt);
    let id = s.next_id("cmpl");
    if req.stream.unwrap_or(false) {
        let include_usage = req
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let encoder = CompletionEncoder {
            id,
            created: unix_now(),
            model: req.model,
        };
        return s.stream(job, encoder, seed, n, include_usage).await;
    }
    let active = tri!(s, s.run(job).await);
    let (timing, usage) = tri!(s, decode_all(active, n).await);
    let body = TextCompletion {
        id: &id,
        object: "text_completion",
        created: unix_now(),
        model: &req.model,
        choices: vec![TextChoice {
            index: 0,
            text: filler_text(seed, n),
            logprobs: None,
            finish_reason: Some("length"),
        }],
        usage: Some(usage),
    };
    timed_json_response(&body, &timing)
}

// ---------------------------------------------------------------- embeddings

async fn embeddings(State(s): AppState, headers: HeaderMap, body: RawBody) -> Response {
    let req: EmbeddingRequest = tri!(s, s.accept(&headers, body));
    let prompt = req.input.prompt();
    let job = tri!(s, s.job(Api::Embeddings, &req.model, &prompt, 0));
    drop(prompt);
    let active = tri!(s, s.run(job).await);
    let (timing, usage) = tri!(s, decode_all(active, 0).await);
    let dims = req.dimensions.unwrap_or(s.cfg.embedding_dims);
    let base64 = req.encoding_format.as_deref() == Some("base64");
    let data = req
        .input
        .item_hashes()
        .into_iter()
        .enumerate()
        .map(|(index, hash)| {
            let values = embedding(hash, dims);
            Embedding {
                object: "embedding",
                index,
                embedding: if base64 {
                    EmbeddingValue::Base64(base64_f32(&values))
                } else {
                    EmbeddingValue::Floats(values)
                },
            }
        })
        .collect();
    let body = EmbeddingList {
        object: "list",
        data,
        model: req.model,
        usage: EmbeddingUsage {
            prompt_tokens: usage.prompt_tokens,
            total_tokens: usage.prompt_tokens,
        },
    };
    timed_json_response(&body, &timing)
}

// ---------------------------------------------------------------- responses

struct ResponsesEncoder {
    response: ResponseObject,
    text: String,
}

impl Encoder for ResponsesEncoder {
    fn starts_at_admission(&self) -> bool {
        true
    }

    fn encode(&mut self, event: Event) -> Option<Bytes> {
        match event {
            Event::Start => Some(sse_event(
                "response.created",
                &json!({"type": "response.created", "response": self.response}),
            )),
            Event::Token(delta) => {
                self.text.push_str(&delta);
                Some(sse_event(
                    "response.output_text.delta",
                    &json!({
                        "type": "response.output_text.delta",
                        "item_id": self.response.id.replacen("resp", "msg", 1),
                        "output_index": 0,
                        "content_index": 0,
                        "delta": delta,
                    }),
                ))
            }
            Event::Finish => None,
            Event::Usage(usage) => {
                self.response.status = "completed";
                self.response.usage = Some(usage.into());
                self.response.output = vec![output_message(
                    &self.response.id,
                    std::mem::take(&mut self.text),
                )];
                Some(sse_event(
                    "response.completed",
                    &json!({"type": "response.completed", "response": self.response}),
                ))
            }
        }
    }
}

fn output_message(response_id: &str, text: String) -> OutputMessage {
    OutputMessage {
        kind: "message",
        id: response_id.replacen("resp", "msg", 1),
        status: "completed",
        role: "assistant",
        content: vec![OutputText {
            kind: "output_text",
            text,
            annotations: Vec::new(),
        }],
    }
}

async fn responses(State(s): AppState, headers: HeaderMap, body: RawBody) -> Response {
    let req: ResponsesRequest = tri!(s, s.accept(&headers, body));
    let n = req.max_output_tokens.unwrap_or(s.cfg.default_max_tokens);
    let prompt = req.prompt();
    let seed = seed_of(&prompt);
    let job = tri!(s, s.job(Api::Responses, &req.model, &prompt, n));
    drop(prompt);
    let mut response = ResponseObject {
        id: s.next_id("resp"),
        object: "response",
        created_at: unix_now(),
        status: "in_progress",
        model: req.model,
        output: Vec::new(),
        usage: None,
    };
    if req.stream.unwrap_or(false) {
        let encoder = ResponsesEncoder {
            response,
            text: String::new(),
        };
        // The usage event carries `response.completed`, so it is always on.
        return s.stream(job, encoder, seed, n, true).await;
    }
    let active = tri!(s, s.run(job).await);
    let (timing, usage) = tri!(s, decode_all(active, n).await);
    response.status = "completed";
    response.usage = Some(usage.into());
    response.output = vec![output_message(&response.id, filler_text(seed, n))];
    timed_json_response(&response, &timing)
}

// ---------------------------------------------------------------- other routes

async fn models(State(s): AppState, headers: HeaderMap) -> Response {
    tri!(s, s.authorize(&headers));
    let card = |id: &str, parent: Option<&str>| ModelCard {
        id: id.to_owned(),
        object: "model",
        created: s.created,
        owned_by: s.cfg.name.clone(),
        root: parent.unwrap_or(id).to_owned(),
        parent: parent.map(str::to_owned),
    };
    let primary = s.cfg.primary_model();
    let data = s
        .cfg
        .models
        .iter()
        .map(|m| card(m, None))
        .chain(s.cfg.lora_adapters.iter().map(|a| card(a, Some(primary))))
        .collect();
    json_response(&ModelList {
        object: "list",
        data,
    })
}

async fn metrics_route(State(s): AppState) -> Response {
    const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
    s.engine.record_metrics_request();
    let unavailable = || (StatusCode::SERVICE_UNAVAILABLE, "metrics unavailable\n").into_response();
    let mut mode = s.metrics_mode.subscribe();
    let mut stopping = s.stopping.subscribe();
    loop {
        let current = *mode.borrow_and_update();
        let text = match current {
            MetricsMode::Live => s.render_metrics(),
            MetricsMode::Frozen => s
                .frozen_metrics
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            MetricsMode::Unavailable => return unavailable(),
            MetricsMode::Hang => {
                tokio::select! {
                    changed = mode.changed() => if changed.is_err() { return unavailable() },
                    _ = stopping.wait_for(|s| *s) => return unavailable(),
                }
                continue;
            }
        };
        return ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response();
    }
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn fallback(State(s): AppState, uri: Uri) -> Response {
    s.reject(ApiError::unknown_path(uri.path()))
}
