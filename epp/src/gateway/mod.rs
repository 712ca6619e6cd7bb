//! A small HTTP gateway that speaks ext_proc to the EPP the way Envoy does:
//! for `kinference demo`, the routing-quality benchmark and integration tests.
//! Loopback only; plain HTTP upstreams (no TLS).
//!
//! Per client request:
//! 1. the body is buffered and the request (headers + body, buffered or
//!    `FULL_DUPLEX_STREAMED`) goes to the EPP on one ext_proc stream;
//! 2. the EPP's outcome is applied:
//!    - an immediate response is returned as is (status, JSON body);
//!    - `x-kinference-destination: provider/<name>` → the request goes to that
//!      provider's base URL (from [`GatewayConfig::providers`]) with the headers
//!      the EPP set (its `authorization` among them);
//!    - `x-gateway-destination-endpoint: a,b,c` (or the same key in `envoy.lb`
//!      metadata) → `http://a<path>`; when `a` refuses the connection, `b`, then
//!      `c` (the EPP's fallback list);
//!    - the (possibly rewritten) body and the set headers go upstream, the
//!      removed headers do not;
//! 3. the upstream response streams back to the client as it arrives (SSE
//!    passes through chunk by chunk);
//! 4. on the ext_proc stream's response path the gateway reports the status,
//!    the endpoint that really served (`envoy.lb`
//!    `x-gateway-destination-endpoint-served`) and the TTFT it measured (first
//!    response body byte, from the moment the request left for the upstream),
//!    then ends the stream — so the EPP calibrates its TTFT model.
//!
//! Upstream failure (every address refused, or an error before the response
//! headers) → 502 to the client and 502 reported to the EPP. Every request
//! ends in a [`RequestRecord`] sent to [`GatewayConfig::records`].

mod forward;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::client::{BodyMode, EppClient, HttpRequest};
use crate::extproc::{DESTINATION_SUBSET, MODEL_HEADER, RULE_HEADER};

/// Response header naming where the request was served: `ip:port` or
/// `provider/<name>` (for people and tests; Envoy has no such header).
pub const SERVED_BY_HEADER: &str = "x-kinference-served-by";

/// How the gateway runs.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The EPP's ext_proc address (plaintext gRPC).
    pub epp: SocketAddr,
    /// Provider name → base URL, e.g. `http://127.0.0.1:9100/v1`. The request
    /// path is appended; a base URL ending in `/v1` absorbs the path's own
    /// leading `/v1`.
    pub providers: BTreeMap<String, String>,
    /// How the request body is sent to the EPP.
    pub body_mode: BodyMode,
    /// Larger request bodies get 413 without asking the EPP.
    pub max_body_bytes: usize,
    /// Connecting to an upstream; a refused or timed-out connection moves on to
    /// the next address of the fallback list.
    pub connect_timeout: Duration,
    /// Whole upstream exchange, body included.
    pub request_timeout: Duration,
    /// Pass a client's `x-gateway-destination-endpoint-subset` header to the
    /// EPP as the subset hint (benchmarks use it for a true round-robin). Off
    /// by default: a client must not pick endpoints.
    pub trust_subset_header: bool,
    /// Where a [`RequestRecord`] goes when a request ends.
    pub records: Option<mpsc::UnboundedSender<RequestRecord>>,
}

impl GatewayConfig {
    pub fn new(epp: SocketAddr) -> Self {
        GatewayConfig {
            epp,
            providers: BTreeMap::new(),
            body_mode: BodyMode::Buffered,
            max_body_bytes: 16 * 1024 * 1024,
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(300),
            trust_subset_header: false,
            records: None,
        }
    }
}

/// Where a request went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// A local endpoint, `ip:port` of the one that answered; `fallback` when it
    /// was not the EPP's first choice.
    Local { endpoint: String, fallback: bool },
    /// A provider, by name.
    Provider(String),
    /// The EPP answered itself (reject, bad request).
    Immediate,
    /// Nothing was sent upstream (EPP failure, no usable destination, every
    /// upstream refused).
    None,
}

/// One finished request, as the gateway saw it.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    /// The client's `x-request-id`, if any.
    pub request_id: Option<String>,
    /// The rule that decided (`x-kinference-rule`); `None` for immediate
    /// responses, which carry no rule.
    pub rule: Option<String>,
    /// The model the EPP chose (`x-kinference-model`).
    pub model: Option<String>,
    pub destination: Destination,
    /// Status returned to the client.
    pub status: u16,
    /// For immediate responses: the JSON error's `message`.
    pub message: Option<String>,
    /// Arrival at the gateway → first response body byte (EPP decision
    /// included): what the client sees.
    pub ttft: Option<Duration>,
    /// Request sent upstream → first response body byte: what the EPP is told.
    pub upstream_ttft: Option<Duration>,
    /// Time the EPP took to decide (ext_proc request path).
    pub decision: Option<Duration>,
    /// Arrival → last response byte.
    pub total: Duration,
    /// What went wrong on the gateway's side, if anything.
    pub error: Option<String>,
}

impl RequestRecord {
    fn new(request_id: Option<String>) -> Self {
        RequestRecord {
            request_id,
            rule: None,
            model: None,
            destination: Destination::None,
            status: 0,
            message: None,
            ttft: None,
            upstream_ttft: None,
            decision: None,
            total: Duration::ZERO,
            error: None,
        }
    }
}

/// The gateway: cheap to clone, all clones share the EPP connection and the
/// upstream connection pool.
#[derive(Clone)]
pub struct Gateway {
    inner: Arc<Inner>,
}

struct Inner {
    config: GatewayConfig,
    epp: EppClient,
    http: reqwest::Client,
}

impl Gateway {
    /// Connects to the EPP (which must be listening).
    pub async fn connect(config: GatewayConfig) -> anyhow::Result<Self> {
        let epp = EppClient::connect(config.epp).await?;
        let http = reqwest::Client::builder()
            // Loopback only: never go through a proxy from the environment.
            .no_proxy()
            .connect_timeout(config.connect_timeout)
            .timeout(config.request_timeout)
            .tcp_nodelay(true)
            .pool_max_idle_per_host(256)
            .build()?;
        Ok(Gateway {
            inner: Arc::new(Inner { config, epp, http }),
        })
    }

    pub fn config(&self) -> &GatewayConfig {
        &self.inner.config
    }

    /// Every path and method goes through [`Gateway::handle`].
    pub fn router(&self) -> axum::Router {
        axum::Router::new()
            .fallback(|State(gw): State<Gateway>, req: Request| async move { gw.handle(req).await })
            .with_state(self.clone())
    }

    /// Serves on `listener` until `shutdown` resolves (in-flight requests finish).
    pub async fn serve(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        axum::serve(listener, self.router())
            .with_graceful_shutdown(shutdown)
            .await?;
        Ok(())
    }

    /// Handles one client request (see the module docs).
    pub async fn handle(&self, req: Request) -> Response {
        let arrived = Instant::now();
        let (parts, body) = req.into_parts();
        let header = |name: &str| {
            parts
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let mut record = RequestRecord::new(header("x-request-id"));
        if parts.method != axum::http::Method::POST {
            let resp = error_response(
                405,
                "invalid_request_error",
                "the gateway accepts POST only",
            );
            return self.done(record, resp, arrived);
        }
        let body = match axum::body::to_bytes(body, self.inner.config.max_body_bytes).await {
            Ok(b) => b,
            Err(_) => {
                let msg = format!(
                    "the request body is unreadable or exceeds {} bytes",
                    self.inner.config.max_body_bytes
                );
                return self.done(
                    record,
                    error_response(413, "invalid_request_error", &msg),
                    arrived,
                );
            }
        };
        let path = parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path().to_string(), |p| p.as_str().to_string());
        let mut epp_req = HttpRequest::post(&path, body.to_vec());
        epp_req.mode = self.inner.config.body_mode;
        for (name, value) in &parts.headers {
            let name = name.as_str();
            if forward::skip_request_header(name) || name == "content-type" {
                continue;
            }
            if name == DESTINATION_SUBSET {
                if self.inner.config.trust_subset_header
                    && let Ok(v) = value.to_str()
                {
                    epp_req.subset = Some(
                        v.split(',')
                            .map(str::trim)
                            .filter(|s| !s.is_empty())
                            .map(str::to_string)
                            .collect(),
                    );
                }
                continue;
            }
            if let Ok(v) = value.to_str() {
                epp_req.headers.push((name.to_string(), v.to_string()));
            }
        }
        let (outcome, stream) = match self.inner.epp.decide(&epp_req).await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "ext_proc call failed");
                record.error = Some(format!("ext_proc: {e}"));
                // Envoy's ext_proc filter with failure_mode_allow=false.
                let resp = error_response(500, "api_error", "the endpoint picker failed");
                return self.done(record, resp, arrived);
            }
        };
        record.decision = Some(arrived.elapsed());
        if let Some((status, body)) = &outcome.immediate {
            record.destination = Destination::Immediate;
            record.message = serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v.pointer("/error/message")?.as_str().map(str::to_string));
            let resp = Response::builder()
                .status(StatusCode::from_u16(*status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
                .header("content-type", "application/json")
                .body(Body::from(body.clone()))
                .unwrap_or_else(|_| Response::new(Body::empty()));
            return self.done(record, resp, arrived);
        }
        record.rule = outcome.set_headers.get(RULE_HEADER).cloned();
        record.model = outcome.set_headers.get(MODEL_HEADER).cloned();
        let upstream_body = outcome.body.clone().map_or(body, bytes::Bytes::from);
        let upstream_headers = forward::upstream_headers(&parts.headers, &outcome);
        forward::forward(
            self.inner.clone(),
            forward::Job {
                path,
                headers: upstream_headers,
                body: upstream_body,
                outcome,
                stream,
                arrived,
                record,
            },
        )
        .await
    }

    /// Finishes a request answered without an upstream.
    fn done(&self, mut record: RequestRecord, mut resp: Response, arrived: Instant) -> Response {
        record.status = resp.status().as_u16();
        record.total = arrived.elapsed();
        if let Some(rule) = &record.rule
            && let Ok(v) = HeaderValue::from_str(rule)
        {
            resp.headers_mut().insert(RULE_HEADER, v);
        }
        self.inner.emit(record);
        resp
    }
}

impl Inner {
    fn emit(&self, record: RequestRecord) {
        if let Some(tx) = &self.config.records {
            let _ = tx.send(record);
        }
    }
}

/// A JSON error in the OpenAI shape.
fn error_response(status: u16, kind: &str, message: &str) -> Response {
    let body = serde_json::json!({
        "error": { "message": message, "type": kind, "param": null, "code": status }
    });
    Response::builder()
        .status(StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap_or_else(|_| Response::new(Body::empty()))
}

/// A running gateway on its own task.
pub struct GatewayHandle {
    pub addr: SocketAddr,
    pub gateway: Gateway,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl GatewayHandle {
    /// `http://<addr>`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, lets in-flight requests finish (at most `grace`).
    pub async fn shutdown(mut self, grace: Duration) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if tokio::time::timeout(grace, &mut self.task).await.is_err() {
            self.task.abort();
        }
    }
}

/// Connects to the EPP and serves on `addr` (`127.0.0.1:0` for a free port).
pub async fn spawn(config: GatewayConfig, addr: SocketAddr) -> anyhow::Result<GatewayHandle> {
    let gateway = Gateway::connect(config).await?;
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn({
        let gateway = gateway.clone();
        async move {
            gateway
                .serve(listener, async move {
                    let _ = stopped.await;
                })
                .await
        }
    });
    Ok(GatewayHandle {
        addr,
        gateway,
        stop: Some(stop),
        task,
    })
}
