//! One ext_proc stream: request headers → body → decision → answer, then the
//! response path. This is the protocol alone: the decision comes from a
//! [`Router`] in one call, what the response showed goes back in another,
//! and [`reply::answer`] turns the decision into Envoy's replies.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, body_mutation,
    processing_request::Request as Msg, processing_response::Response as Reply,
};
use envoy_types::pb::google::protobuf::Struct;
use envoy_types::pb::google::protobuf::value::Kind;
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tonic::Status;
use tracing::{Instrument, Span};

use super::body::{self, Api, path_only};
use super::limits::{BodyHold, StreamGuard};
use super::reply;
use super::router::{Incoming, ResponseFacts, Route, Router};
use super::usage::{Usage, UsageScanner};
use super::*;
use crate::lists::comma_separated;
use crate::metrics::Metrics;

/// The 503's message when the body budget is spent.
const BODY_BUDGET_EXHAUSTED: &str =
    "the endpoint picker is buffering too many request bodies; retry later";

/// `BodySendMode` values in the filter's protocol config.
const STREAMED: i32 = 1;
const FULL_DUPLEX_STREAMED: i32 = 4;

/// A routed request's ticket, and whether its response was reported.
struct Routed<T> {
    ticket: T,
    completed: bool,
    /// `--decision-detail`, returned as a response header.
    detail: Option<String>,
    /// Reads the answer's usage counts, when the router wants them.
    usage: Option<UsageScanner>,
    /// The router was told a first token would follow, and it has not come.
    awaiting_first_token: bool,
}

pub struct Session<R: Router> {
    router: Arc<R>,
    metrics: Arc<Metrics>,
    config: Arc<ExtProcConfig>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    request_streamed: bool,
    response_streamed: bool,
    /// The gateway sends the response body as it comes (`STREAMED` or
    /// `FULL_DUPLEX_STREAMED`), so a chunk's arrival times its token.
    response_body_live: bool,
    headers: BTreeMap<String, String>,
    api: Option<Api>,
    path: String,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    routed: Option<Routed<R::Ticket>>,
    done: bool,
    /// This stream's share of the body budget, for `body`.
    hold: BodyHold,
    _open: StreamGuard,
}

impl<R: Router> Session<R> {
    pub fn new(
        router: Arc<R>,
        metrics: Arc<Metrics>,
        config: Arc<ExtProcConfig>,
        hold: BodyHold,
        tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    ) -> Self {
        let open = StreamGuard::new(metrics.streams_open());
        Session {
            router,
            metrics,
            config,
            tx,
            request_streamed: false,
            response_streamed: false,
            response_body_live: false,
            headers: BTreeMap::new(),
            api: None,
            path: String::new(),
            subset: None,
            body: Vec::new(),
            routed: None,
            done: false,
            hold,
            _open: open,
        }
    }

    /// Serves the stream inside one span, `ext_proc`, that ends up carrying
    /// the request id, the rule, the destination and the outcome (never the
    /// prompt, the path's query or header values).
    pub async fn run(self, inbound: impl Stream<Item = Result<ProcessingRequest, Status>> + Unpin) {
        let span = tracing::info_span!(
            "ext_proc",
            request_id = tracing::field::Empty,
            rule = tracing::field::Empty,
            destination = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        self.serve(inbound).instrument(span).await
    }

    async fn serve(
        mut self,
        mut inbound: impl Stream<Item = Result<ProcessingRequest, Status>> + Unpin,
    ) {
        loop {
            // Until the request is decided the stream holds buffered body
            // and a slot; a client that stops sending must not keep them.
            let next = if self.done {
                inbound.next().await
            } else {
                match tokio::time::timeout(self.config.idle_timeout, inbound.next()).await {
                    Ok(next) => next,
                    Err(_) => {
                        let message = format!(
                            "no request data for {} s",
                            self.config.idle_timeout.as_secs_f64()
                        );
                        self.shed(408, "idle_timeout", &message).await;
                        break;
                    }
                }
            };
            let Some(item) = next else { break };
            let msg = match item {
                Ok(msg) => msg,
                // A message longer than a body (its length prefix, read
                // before its bytes): the request is too large, and says so.
                Err(status) if status.code() == tonic::Code::OutOfRange => {
                    self.too_large().await;
                    break;
                }
                // The body budget cannot hold the message being decoded
                // (`decoding`): refused as a body it cannot buffer is.
                Err(status) if status.code() == tonic::Code::ResourceExhausted => {
                    self.shed(503, "body_budget", BODY_BUDGET_EXHAUSTED).await;
                    break;
                }
                // The stream broke mid-way: nothing is left to answer.
                Err(status) => {
                    tracing::debug!(code = ?status.code(), "ext_proc stream ended with an error");
                    break;
                }
            };
            if !self.handle(msg).await {
                break;
            }
        }
        // The gateway closed the stream. Without response headers the outcome
        // is unknown (skipped by the gateway's processing mode, or the client
        // went away); a gateway's own error reply (no healthy upstream,
        // connect failure) would have come as response headers with a 5xx.
        if let Some(mut routed) = self.routed.take()
            && !routed.completed
        {
            Span::current().record("outcome", "unknown");
            self.router
                .complete(&mut routed.ticket, ResponseFacts::default());
        }
        // The ticket drops here: the request is no longer in flight.
    }

    /// Returns false when the stream should end.
    async fn handle(&mut self, msg: ProcessingRequest) -> bool {
        if let Some(pc) = &msg.protocol_config {
            self.request_streamed = pc.request_body_mode == FULL_DUPLEX_STREAMED;
            self.response_streamed = pc.response_body_mode == FULL_DUPLEX_STREAMED;
            self.response_body_live =
                matches!(pc.response_body_mode, STREAMED | FULL_DUPLEX_STREAMED);
        }
        if let Some(md) = &msg.metadata_context
            && let Some(subset) = subset_hint(md)
        {
            self.subset = Some(subset);
        }
        match msg.request {
            Some(Msg::RequestHeaders(h)) => {
                self.on_request_headers(h.headers.as_ref(), h.end_of_stream)
                    .await
            }
            Some(Msg::RequestBody(b)) => self.on_request_body(b).await,
            Some(Msg::RequestTrailers(_)) => {
                if !self.done {
                    return self.decide().await;
                }
                self.send(reply::continue_request_trailers()).await
            }
            Some(Msg::ResponseHeaders(h)) => {
                let served = msg
                    .metadata_context
                    .as_ref()
                    .and_then(served_endpoint)
                    .or_else(|| upstream_address(&msg.attributes));
                self.on_response_headers(h.headers.as_ref(), served).await
            }
            Some(Msg::ResponseBody(b)) => self.on_response_body(b).await,
            Some(Msg::ResponseTrailers(_)) => self.send(reply::continue_response_trailers()).await,
            None => true,
        }
    }

    async fn on_request_headers(
        &mut self,
        headers: Option<&HeaderMap>,
        end_of_stream: bool,
    ) -> bool {
        self.headers = header_map(headers);
        self.path = self.headers.get(":path").cloned().unwrap_or_default();
        Span::current().record("request_id", request_id(&self.headers).as_str());
        if self.config.conformance_hooks
            && let Some(ips) = self.headers.get(TEST_SELECTION_HEADER)
        {
            self.subset = Some(comma_separated(ips).map(str::to_string).collect());
        }
        let Some(api) = Api::from_path(&self.path) else {
            return self
                .refuse(
                    404,
                    "not_found",
                    "unknown_path",
                    &format!("no inference API at path {:?}", path_only(&self.path)),
                )
                .await;
        };
        self.api = Some(api);
        if end_of_stream {
            return self
                .refuse(
                    400,
                    "invalid_request_error",
                    "no_body",
                    "the request has no body",
                )
                .await;
        }
        if let Some(len) = self
            .headers
            .get("content-length")
            .and_then(|v| v.parse::<usize>().ok())
            && len > self.config.max_body_bytes
        {
            return self.too_large().await;
        }
        // Streamed mode: the headers answer waits for the body, because the
        // destination is only known then.
        if self.request_streamed {
            true
        } else {
            self.send(reply::continue_request_headers()).await
        }
    }

    async fn on_request_body(&mut self, b: HttpBody) -> bool {
        if self.done {
            return true;
        }
        if self.body.len() + b.body.len() > self.config.max_body_bytes {
            return self.too_large().await;
        }
        let last = b.end_of_stream;
        if !self.hold_chunk(b.body, last) {
            self.shed(503, "body_budget", BODY_BUDGET_EXHAUSTED).await;
            return false;
        }
        if last { self.decide().await } else { true }
    }

    /// Appends `chunk` to the body if the budget can pay for the memory it
    /// takes: the buffer's capacity, not its length. A buffer that doubles
    /// as chunks arrive holds up to twice what it was sent, and charging the
    /// length let unfinished bodies hold about twice the budget.
    fn hold_chunk(&mut self, chunk: Vec<u8>, last: bool) -> bool {
        if self.body.is_empty() && last {
            if !self.hold.grow(chunk.capacity()) {
                return false;
            }
            self.body = chunk;
            return true;
        }
        let needed = self.body.len() + chunk.len();
        let capacity = self.body.capacity();
        if needed > capacity {
            // Doubling keeps appends linear; never past a full body.
            let target = needed.max(capacity * 2).min(self.config.max_body_bytes);
            if !self.hold.grow(target - capacity) {
                return false;
            }
            self.body.reserve_exact(target - self.body.len());
        }
        self.body.extend_from_slice(&chunk);
        true
    }

    async fn decide(&mut self) -> bool {
        self.done = true;
        let Some(api) = self.api else {
            return self
                .refuse(
                    400,
                    "invalid_request_error",
                    "no_headers",
                    "request headers never arrived",
                )
                .await;
        };
        let parsed = match body::parse(&self.body) {
            Ok(p) => p,
            Err(e) => {
                return self
                    .refuse(400, "invalid_request_error", "bad_body", &e.to_string())
                    .await;
            }
        };
        let incoming = Incoming {
            headers: &self.headers,
            path: &self.path,
            api,
            body: &parsed,
            body_bytes: self.body.len(),
            subset: self.subset.as_deref(),
        };
        // A request may wait for room (`onEmpty: Wait`); if the gateway
        // gives up on the stream meanwhile, so does the wait.
        let (route, ticket) = tokio::select! {
            routed = self.router.route(&incoming) => routed,
            () = self.tx.closed() => {
                tracing::debug!("the gateway closed the stream before its decision");
                return false;
            }
        };
        record_route(&route);
        let detail = match &route {
            Route::Local(l) => l.detail.clone(),
            Route::Provider(p) => p.detail.clone(),
            Route::Reject { .. } => None,
        };
        self.routed = ticket.map(|ticket| Routed {
            usage: self.router.wants_usage(&ticket).then(UsageScanner::default),
            ticket,
            completed: false,
            detail,
            awaiting_first_token: false,
        });
        let replies = reply::answer(
            &route,
            reply::Exchange {
                body: &self.body,
                streamed: self.request_streamed,
                fallbacks: self.config.fallbacks,
            },
        );
        // The body is no longer needed; a long generation must not keep it.
        self.body = Vec::new();
        self.hold.release();
        for msg in replies {
            if !self.send(msg).await {
                return false;
            }
        }
        // An immediate response (a reject) is final: the stream ends.
        !matches!(route, Route::Reject { .. })
    }

    async fn on_response_headers(
        &mut self,
        headers: Option<&HeaderMap>,
        served: Option<String>,
    ) -> bool {
        let headers = header_map(headers);
        let status: u16 = headers
            .get(":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(200);
        let reported_ttft = headers
            .get(OBSERVED_TTFT_HEADER)
            .and_then(|v| v.parse::<f64>().ok())
            // Negative, NaN, infinite or beyond Duration's range (1e254 ms
            // is a finite f64 and no Duration): ignored, never a panic.
            .and_then(|ms| Duration::try_from_secs_f64(ms / 1000.0).ok());
        if let Some(routed) = &mut self.routed
            && !routed.completed
        {
            routed.completed = true;
            if status != 200 {
                routed.usage = None;
            }
            Span::current().record("outcome", status);
            routed.awaiting_first_token = (200..300).contains(&status)
                && self.response_body_live
                && is_event_stream(&headers);
            let facts = ResponseFacts {
                status: Some(status),
                served: served.clone(),
                reported_ttft,
                first_token_follows: routed.awaiting_first_token,
            };
            self.router.complete(&mut routed.ticket, facts);
        }
        let mut set_headers = Vec::new();
        if self.config.conformance_hooks
            && let Some(served) = served
        {
            set_headers.push(super::reply::header_option(TEST_SERVED_HEADER, &served));
        }
        if let Some(detail) = self.routed.as_ref().and_then(|r| r.detail.as_deref()) {
            set_headers.push(super::reply::header_option(super::DECISION_DETAIL, detail));
        }
        let mut answer = reply::continue_response_headers();
        if !set_headers.is_empty()
            && let Some(Reply::ResponseHeaders(HeadersResponse { response })) = &mut answer.response
        {
            *response = Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers,
                    remove_headers: vec![],
                }),
                ..CommonResponse::default()
            });
        }
        self.send(answer).await
    }

    async fn on_response_body(&mut self, b: HttpBody) -> bool {
        self.note_first_token(&b.body);
        self.read_usage(&b);
        if !self.response_streamed {
            return self.send(reply::continue_response_body()).await;
        }
        // Full-duplex streaming: every chunk must be handed back.
        self.send(ProcessingResponse {
            response: Some(Reply::ResponseBody(BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(body_mutation::Mutation::StreamedResponse(
                            StreamedBodyResponse {
                                body: b.body,
                                end_of_stream: b.end_of_stream,
                                ..StreamedBodyResponse::default()
                            },
                        )),
                    }),
                    ..CommonResponse::default()
                }),
            })),
            ..ProcessingResponse::default()
        })
        .await
    }

    /// Tells the router when the first chunk with a token arrives.
    fn note_first_token(&mut self, chunk: &[u8]) {
        let Some(routed) = &mut self.routed else {
            return;
        };
        if routed.awaiting_first_token && carries_a_token(self.api, chunk) {
            routed.awaiting_first_token = false;
            // Tokio's clock: the same as std's, but a test can pause it.
            let at = tokio::time::Instant::now().into_std();
            self.router.first_token(&mut routed.ticket, at);
        }
    }

    /// Feeds the answer to the usage scanner; at its end, reports.
    fn read_usage(&mut self, b: &HttpBody) {
        let Some(routed) = &mut self.routed else {
            return;
        };
        let Some(scanner) = &mut routed.usage else {
            return;
        };
        scanner.feed(&b.body, b.end_of_stream);
        if b.end_of_stream {
            let usage = scanner.usage();
            routed.usage = None;
            if usage != Usage::default() {
                self.router.usage(&mut routed.ticket, usage);
            }
        }
    }

    async fn too_large(&mut self) -> bool {
        let message = format!(
            "the request body exceeds {} bytes",
            self.config.max_body_bytes
        );
        self.refuse(413, "invalid_request_error", "too_large", &message)
            .await
    }

    /// Refuses before routing; ends the stream.
    async fn refuse(&mut self, status: u16, kind: &str, reason: &str, message: &str) -> bool {
        self.done = true;
        Span::current().record("outcome", reason);
        self.metrics.bad_request(reason);
        let _ = self
            .send(reply::immediate_error(status, kind, message))
            .await;
        false
    }

    /// Refuses to protect the EPP (not the client's fault); ends the stream.
    async fn shed(&mut self, status: u16, reason: &str, message: &str) {
        self.done = true;
        Span::current().record("outcome", reason);
        self.metrics.stream_refused(reason);
        tracing::debug!(reason, "stream refused");
        let _ = self
            .send(reply::immediate_error(status, "server_error", message))
            .await;
    }

    async fn send(&self, msg: ProcessingResponse) -> bool {
        self.tx.send(Ok(msg)).await.is_ok()
    }
}

/// The gateway's `x-request-id` (at most 128 bytes of it), or a fresh one.
fn request_id(headers: &BTreeMap<String, String>) -> String {
    match headers.get("x-request-id") {
        Some(id) if !id.is_empty() => {
            let mut end = id.len().min(128);
            while !id.is_char_boundary(end) {
                end -= 1;
            }
            id[..end].to_string()
        }
        _ => format!("kinference-{:016x}", rand::random::<u64>()),
    }
}

/// Rule, destination and, for a reject, the outcome on the stream's span.
fn record_route(route: &Route) {
    let span = Span::current();
    match route {
        Route::Local(local) => {
            span.record("rule", local.rule.as_str());
            if let Some(primary) = local.addresses.first() {
                span.record("destination", primary.as_str());
            }
        }
        Route::Provider(provider) => {
            span.record("rule", provider.rule.as_str());
            span.record(
                "destination",
                format!("provider/{}", provider.provider).as_str(),
            );
        }
        Route::Reject { rule, status, .. } => {
            if let Some(rule) = rule {
                span.record("rule", rule.as_str());
            }
            span.record("outcome", format!("rejected {status}").as_str());
        }
    }
}

/// A `text/event-stream` answer: tokens come as events, the first with the
/// first token.
fn is_event_stream(headers: &BTreeMap<String, String>) -> bool {
    headers.get("content-type").is_some_and(|v| {
        v.trim_start()
            .get(..17)
            .is_some_and(|t| t.eq_ignore_ascii_case("text/event-stream"))
    })
}

/// Whether a chunk of a streamed answer carries (the start of) a token.
/// A chat or completions stream sends nothing before its first token (vLLM
/// and SGLang send the chat role chunk with it), so any event does, but not
/// a blank line or a `:` comment (a keep-alive). A Responses stream opens
/// with `response.created` at admission: only a `*.delta` event does.
fn carries_a_token(api: Option<Api>, chunk: &[u8]) -> bool {
    if api == Some(Api::Responses) {
        return memchr::memmem::find(chunk, b".delta").is_some();
    }
    chunk.split(|&b| b == b'\n').any(|line| {
        let line = line.trim_ascii();
        !line.is_empty() && line[0] != b':'
    })
}

fn header_map(headers: Option<&HeaderMap>) -> BTreeMap<String, String> {
    headers
        .map(|h| {
            h.headers
                .iter()
                .map(|hv| {
                    let value = if hv.raw_value.is_empty() {
                        hv.value.clone()
                    } else {
                        String::from_utf8_lossy(&hv.raw_value).into_owned()
                    };
                    (hv.key.to_ascii_lowercase(), value)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The subset hint: a list of `ip:port` strings, or one comma-separated string.
pub(super) fn subset_hint(md: &Metadata) -> Option<Vec<String>> {
    let value = md
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(DESTINATION_SUBSET)?;
    match value.kind.as_ref()? {
        Kind::StringValue(s) => Some(comma_separated(s).map(str::to_string).collect()),
        Kind::ListValue(list) => Some(
            list.values
                .iter()
                .filter_map(|v| match v.kind.as_ref() {
                    Some(Kind::StringValue(s)) => Some(s.trim().to_string()),
                    _ => None,
                })
                .collect(),
        ),
        _ => None,
    }
}

fn served_endpoint(md: &Metadata) -> Option<String> {
    match md
        .filter_metadata
        .get(LB_NAMESPACE)?
        .fields
        .get(SERVED_ENDPOINT)?
        .kind
        .as_ref()?
    {
        Kind::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

/// Envoy's `upstream.address` attribute (`response_attributes` on the
/// filter): the host that answered, after any retry. Where the gateway sets
/// no served-endpoint metadata (a load-balancing policy without
/// `selected_host_key`), it still tells a fallback from the pick.
fn upstream_address(attributes: &HashMap<String, Struct>) -> Option<String> {
    let attributes = attributes.get(EXT_PROC_ATTRIBUTES)?;
    match attributes.fields.get(UPSTREAM_ADDRESS)?.kind.as_ref()? {
        Kind::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    //! The session against a fake router: the protocol alone, message by
    //! message, with no decision logic behind it.

    use std::sync::Mutex;
    use std::time::Instant;

    use envoy_types::pb::envoy::config::core::v3::HeaderValue;
    use envoy_types::pb::envoy::service::ext_proc::v3::{HttpHeaders, ProtocolConfiguration};

    use super::*;
    use crate::extproc::limits::BodyBudget;
    use crate::extproc::router::LocalRoute;

    /// Routes every request to one fixed answer and records what it is told.
    struct FakeRouter {
        route: Route,
        routed: Mutex<Vec<String>>,
        completed: Mutex<Vec<ResponseFacts>>,
        first_tokens: Mutex<Vec<Instant>>,
        usage: Mutex<Vec<Usage>>,
        tickets_alive: Arc<()>,
    }

    impl FakeRouter {
        fn new(route: Route) -> Arc<Self> {
            Arc::new(FakeRouter {
                route,
                routed: Mutex::default(),
                completed: Mutex::default(),
                first_tokens: Mutex::default(),
                usage: Mutex::default(),
                tickets_alive: Arc::new(()),
            })
        }

        fn live_tickets(&self) -> usize {
            Arc::strong_count(&self.tickets_alive) - 1
        }
    }

    impl Router for FakeRouter {
        type Ticket = Arc<()>;

        async fn route(&self, request: &Incoming<'_>) -> (Route, Option<Arc<()>>) {
            let model = request.body.model.clone().unwrap_or_default();
            self.routed.lock().unwrap().push(model);
            let ticket = (!matches!(self.route, Route::Reject { .. }))
                .then(|| Arc::clone(&self.tickets_alive));
            (self.route.clone(), ticket)
        }

        fn complete(&self, _ticket: &mut Arc<()>, facts: ResponseFacts) {
            self.completed.lock().unwrap().push(facts);
        }

        fn first_token(&self, _ticket: &mut Arc<()>, at: Instant) {
            self.first_tokens.lock().unwrap().push(at);
        }

        fn wants_usage(&self, _ticket: &Arc<()>) -> bool {
            true
        }

        fn usage(&self, _ticket: &mut Arc<()>, usage: Usage) {
            self.usage.lock().unwrap().push(usage);
        }
    }

    #[test]
    fn the_upstream_address_is_read_as_a_string_under_the_filters_name() {
        use envoy_types::pb::google::protobuf::Value;
        let attributes = |filter: &str, kind: Kind| {
            let value = Value { kind: Some(kind) };
            let fields = [("upstream.address".to_string(), value)].into();
            HashMap::from([(filter.to_string(), Struct { fields })])
        };
        let address = || Kind::StringValue("10.0.0.7:8000".into());
        assert_eq!(
            upstream_address(&attributes("envoy.filters.http.ext_proc", address())),
            Some("10.0.0.7:8000".to_string())
        );
        assert_eq!(
            upstream_address(&attributes(
                "envoy.filters.http.ext_proc",
                Kind::NumberValue(7.0)
            )),
            None
        );
        assert_eq!(
            upstream_address(&attributes("envoy.filters.http.lua", address())),
            None
        );
        assert_eq!(upstream_address(&HashMap::new()), None);
    }

    fn local() -> Route {
        Route::Local(LocalRoute {
            rule: "r".into(),
            model: "m".into(),
            addresses: vec!["10.0.0.1:8000".into(), "10.0.0.2:8000".into()],
            rewrite_model: None,
            detail: None,
        })
    }

    fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> Msg {
        Msg::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: k.to_string(),
                        raw_value: v.as_bytes().to_vec(),
                        ..HeaderValue::default()
                    })
                    .collect(),
            }),
            end_of_stream,
            ..HttpHeaders::default()
        })
    }

    fn body(bytes: &[u8], end_of_stream: bool) -> Msg {
        Msg::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..HttpBody::default()
        })
    }

    fn response_headers(status: &str) -> Msg {
        match headers(&[(":status", status)], false) {
            Msg::RequestHeaders(h) => Msg::ResponseHeaders(h),
            _ => unreachable!(),
        }
    }

    fn request(msg: Msg) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(msg),
            ..ProcessingRequest::default()
        }
    }

    /// Runs one session over `messages` and returns every reply.
    async fn exchange(
        router: &Arc<FakeRouter>,
        streamed: bool,
        messages: Vec<Msg>,
    ) -> Vec<ProcessingResponse> {
        let mut requests: Vec<ProcessingRequest> = messages.into_iter().map(request).collect();
        if streamed && let Some(first) = requests.first_mut() {
            first.protocol_config = Some(ProtocolConfiguration {
                request_body_mode: FULL_DUPLEX_STREAMED,
                response_body_mode: FULL_DUPLEX_STREAMED,
                ..ProtocolConfiguration::default()
            });
        }
        exchange_requests(router, requests).await
    }

    /// Runs one session over `requests` as given and returns every reply.
    async fn exchange_requests(
        router: &Arc<FakeRouter>,
        requests: Vec<ProcessingRequest>,
    ) -> Vec<ProcessingResponse> {
        let metrics = Arc::new(Metrics::default());
        let budget = BodyBudget::new(1 << 20, metrics.buffered_body_bytes());
        let (tx, mut rx) = mpsc::channel(64);
        let session = Session::new(
            Arc::clone(router),
            metrics,
            Arc::new(ExtProcConfig::default()),
            budget.hold(),
            tx,
        );
        let inbound = futures::stream::iter(requests.into_iter().map(Ok));
        session.run(inbound).await;
        let mut out = Vec::new();
        while let Ok(reply) = rx.try_recv() {
            out.push(reply.unwrap());
        }
        out
    }

    /// A session with its own metrics and a budget of `budget` bytes, fed
    /// by the returned sender; replies arrive on the returned receiver.
    struct Live {
        inbound: mpsc::Sender<Result<ProcessingRequest, Status>>,
        replies: mpsc::Receiver<Result<ProcessingResponse, Status>>,
        metrics: Arc<Metrics>,
        budget: Arc<BodyBudget>,
        task: tokio::task::JoinHandle<()>,
    }

    fn live(router: &Arc<FakeRouter>, budget: usize, idle: Duration) -> Live {
        let metrics = Arc::new(Metrics::default());
        let budget = BodyBudget::new(budget, metrics.buffered_body_bytes());
        let (tx, replies) = mpsc::channel(64);
        let (inbound, rx) = mpsc::channel(64);
        let config = ExtProcConfig {
            idle_timeout: idle,
            ..ExtProcConfig::default()
        };
        let session = Session::new(
            Arc::clone(router),
            Arc::clone(&metrics),
            Arc::new(config),
            budget.hold(),
            tx,
        );
        let task = tokio::spawn(session.run(tokio_stream::wrappers::ReceiverStream::new(rx)));
        Live {
            inbound,
            replies,
            metrics,
            budget,
            task,
        }
    }

    fn immediate_status(reply: &ProcessingResponse) -> Option<i32> {
        match reply.response.as_ref()? {
            Reply::ImmediateResponse(i) => i.status.as_ref().map(|s| s.code),
            _ => None,
        }
    }

    fn rendered(metrics: &Metrics) -> String {
        metrics.render(
            &crate::endpoints::EndpointRegistry::new(Duration::from_secs(1)),
            None,
        )
    }

    #[tokio::test]
    async fn a_message_the_decoder_could_not_charge_is_refused_as_a_body_is() {
        let router = FakeRouter::new(local());
        let mut s = live(&router, 1000, Duration::from_secs(60));
        s.inbound
            .send(Ok(request(headers(&[PATH], false))))
            .await
            .unwrap();
        assert!(s.replies.recv().await.is_some(), "headers continue");
        s.inbound
            .send(Err(Status::resource_exhausted("budget")))
            .await
            .unwrap();
        let reply = s.replies.recv().await.unwrap().unwrap();
        assert_eq!(immediate_status(&reply), Some(503));
        s.task.await.unwrap();
        assert!(router.routed.lock().unwrap().is_empty());
        let text = rendered(&s.metrics);
        assert!(
            text.contains(r#"kinference_epp_stream_refusals_total{reason="body_budget"} 1"#),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_body_over_the_shared_budget_is_refused_at_once_and_frees_nothing_else() {
        let router = FakeRouter::new(local());
        // One stream holds 600 of the 1,000 bytes and never finishes.
        let mut holder = live(&router, 1000, Duration::from_secs(60));
        holder
            .inbound
            .send(Ok(request(headers(&[PATH], false))))
            .await
            .unwrap();
        holder
            .inbound
            .send(Ok(request(body(&[b' '; 600], false))))
            .await
            .unwrap();
        assert!(holder.replies.recv().await.is_some(), "headers continue");
        tokio::task::yield_now().await;
        while holder.budget.used() < 600 {
            tokio::task::yield_now().await;
        }
        // A second stream on the same budget asks for 500 more: refused.
        let metrics = Arc::clone(&holder.metrics);
        let (tx, mut rx) = mpsc::channel(64);
        let second = Session::new(
            Arc::clone(&router),
            Arc::clone(&metrics),
            Arc::new(ExtProcConfig::default()),
            holder.budget.hold(),
            tx,
        );
        let messages = [headers(&[PATH], false), body(&[b' '; 500], false)];
        second
            .run(futures::stream::iter(
                messages.into_iter().map(|m| Ok(request(m))),
            ))
            .await;
        let mut statuses = Vec::new();
        while let Ok(reply) = rx.try_recv() {
            statuses.push(immediate_status(&reply.unwrap()));
        }
        assert_eq!(statuses, [None, Some(503)]);
        assert_eq!(holder.budget.used(), 600, "the refused stream took nothing");
        assert!(router.routed.lock().unwrap().is_empty());
        let text = rendered(&metrics);
        assert!(
            text.contains(r#"kinference_epp_stream_refusals_total{reason="body_budget"} 1"#),
            "{text}"
        );
        assert!(
            text.contains("kinference_epp_buffered_body_bytes 600"),
            "{text}"
        );
        assert!(text.contains("kinference_epp_streams_open 1"), "{text}");
        drop(holder.inbound);
        holder.task.await.unwrap();
        assert_eq!(
            holder.budget.used(),
            0,
            "a closed stream gives its bytes back"
        );
        assert!(rendered(&metrics).contains("kinference_epp_streams_open 0"));
    }

    /// The budget pays for the body's buffer as allocated: a body sent in
    /// chunks charges its capacity, which doubling keeps within twice its
    /// length, and a chunk the budget cannot pay for is refused.
    #[tokio::test]
    async fn the_budget_is_charged_for_the_buffer_a_chunked_body_takes() {
        let router = FakeRouter::new(local());
        let mut s = live(&router, 10_000, Duration::from_secs(60));
        s.inbound
            .send(Ok(request(headers(&[PATH], false))))
            .await
            .unwrap();
        assert!(s.replies.recv().await.is_some(), "headers continue");
        let mut sent = 0;
        for _ in 0..5 {
            s.inbound
                .send(Ok(request(body(&[b' '; 700], false))))
                .await
                .unwrap();
            sent += 700;
            while s.budget.used() < sent {
                tokio::task::yield_now().await;
            }
            let used = s.budget.used();
            assert!(
                used >= sent && used <= 2 * sent,
                "{used} held for {sent} sent"
            );
        }
        // 700, 1,400, 2,800, 2,800, 5,600: the buffer, not the 3,500 sent.
        assert_eq!(s.budget.used(), 5600);
        drop(s.inbound);
        s.task.await.unwrap();
        assert_eq!(s.budget.used(), 0);
    }

    #[tokio::test]
    async fn a_decided_request_gives_its_body_bytes_back_while_its_response_runs() {
        let router = FakeRouter::new(local());
        let mut s = live(&router, 1 << 20, Duration::from_secs(60));
        s.inbound
            .send(Ok(request(headers(&[PATH], false))))
            .await
            .unwrap();
        s.inbound.send(Ok(request(body(CHAT, true)))).await.unwrap();
        s.replies.recv().await.unwrap().unwrap();
        s.replies.recv().await.unwrap().unwrap();
        assert_eq!(*router.routed.lock().unwrap(), ["m"]);
        assert_eq!(
            s.budget.used(),
            0,
            "the stream is open, its body is not held"
        );
        drop(s.inbound);
        s.task.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_that_stops_sending_before_its_decision_gets_408_and_ends() {
        let router = FakeRouter::new(local());
        let mut s = live(&router, 1 << 20, Duration::from_secs(30));
        s.inbound
            .send(Ok(request(headers(&[PATH], false))))
            .await
            .unwrap();
        s.inbound
            .send(Ok(request(body(b"{\"model\"", false))))
            .await
            .unwrap();
        s.replies.recv().await.unwrap().unwrap();
        // Nothing more: paused time jumps to the timeout.
        let reply = s.replies.recv().await.unwrap().unwrap();
        assert_eq!(immediate_status(&reply), Some(408));
        s.task.await.unwrap();
        assert!(router.routed.lock().unwrap().is_empty());
        assert_eq!(s.budget.used(), 0);
        let text = rendered(&s.metrics);
        assert!(
            text.contains(r#"kinference_epp_stream_refusals_total{reason="idle_timeout"} 1"#),
            "{text}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_decided_stream_may_wait_for_its_response_longer_than_the_idle_timeout() {
        let router = FakeRouter::new(local());
        let mut s = live(&router, 1 << 20, Duration::from_secs(30));
        s.inbound
            .send(Ok(request(headers(&[PATH], false))))
            .await
            .unwrap();
        s.inbound.send(Ok(request(body(CHAT, true)))).await.unwrap();
        s.replies.recv().await.unwrap().unwrap();
        s.replies.recv().await.unwrap().unwrap();
        // A long generation: ten minutes before the response headers.
        tokio::time::sleep(Duration::from_secs(600)).await;
        s.inbound
            .send(Ok(request(response_headers("200"))))
            .await
            .unwrap();
        let reply = s.replies.recv().await.unwrap().unwrap();
        assert_eq!(immediate_status(&reply), None, "{reply:?}");
        drop(s.inbound);
        s.task.await.unwrap();
        assert_eq!(router.completed.lock().unwrap()[0].status, Some(200));
    }

    const CHAT: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    const PATH: (&str, &str) = (":path", "/v1/chat/completions");

    fn destination(reply: &ProcessingResponse) -> Option<String> {
        let common = match reply.response.as_ref()? {
            Reply::RequestHeaders(h) => h.response.as_ref()?,
            Reply::RequestBody(b) => b.response.as_ref()?,
            _ => return None,
        };
        common
            .header_mutation
            .as_ref()?
            .set_headers
            .iter()
            .filter_map(|h| h.header.as_ref())
            .find(|h| h.key == "x-gateway-destination-endpoint")
            .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
    }

    #[tokio::test]
    async fn buffered_request_is_routed_and_its_response_reported() {
        let router = FakeRouter::new(local());
        let replies = exchange(
            &router,
            false,
            vec![
                headers(&[PATH], false),
                body(CHAT, true),
                response_headers("200"),
            ],
        )
        .await;
        assert_eq!(*router.routed.lock().unwrap(), ["m"]);
        // Headers continue, the body reply routes, the response continues.
        assert_eq!(replies.len(), 3, "{replies:?}");
        assert_eq!(destination(&replies[1]).as_deref(), Some("10.0.0.1:8000"));
        let completed = router.completed.lock().unwrap();
        assert_eq!(completed.len(), 1);
        assert_eq!(completed[0].status, Some(200));
        assert!(
            !completed[0].first_token_follows,
            "no body is sent back: no first token to time"
        );
        assert_eq!(router.live_tickets(), 0, "the ticket ends with the stream");
    }

    fn answer_headers(status: &str, content_type: &str) -> Msg {
        match headers(
            &[(":status", status), ("content-type", content_type)],
            false,
        ) {
            Msg::RequestHeaders(h) => Msg::ResponseHeaders(h),
            _ => unreachable!(),
        }
    }

    /// vLLM's and SGLang's servers send a streamed answer's headers at
    /// admission: the TTFT is timed at the first chunk that carries an
    /// event, not at the headers, and not at a keep-alive comment.
    #[tokio::test(start_paused = true)]
    async fn a_streamed_answers_first_token_is_timed_at_its_first_event() {
        let router = FakeRouter::new(local());
        let s = live(&router, 1 << 20, Duration::from_secs(30));
        let streamed = ProtocolConfiguration {
            request_body_mode: FULL_DUPLEX_STREAMED,
            response_body_mode: FULL_DUPLEX_STREAMED,
            ..ProtocolConfiguration::default()
        };
        let send = async |msg: Msg| s.inbound.send(Ok(request(msg))).await.unwrap();
        s.inbound
            .send(Ok(ProcessingRequest {
                protocol_config: Some(streamed),
                ..request(headers(&[PATH], false))
            }))
            .await
            .unwrap();
        send(body(CHAT, true)).await;
        let now = || tokio::time::Instant::now().into_std();
        let headers_at = now();
        send(answer_headers("200", "text/event-stream; charset=utf-8")).await;
        tokio::time::sleep(Duration::from_millis(700)).await;
        send(response_body(b": keep-alive\n\n", false)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let first_event_at = now();
        send(response_body(
            b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n",
            false,
        ))
        .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        send(response_body(b"data: [DONE]\n\n", true)).await;
        drop(s.inbound);
        s.task.await.unwrap();
        let completed = router.completed.lock().unwrap();
        assert!(completed[0].first_token_follows, "{completed:?}");
        let first_tokens = router.first_tokens.lock().unwrap();
        assert_eq!(*first_tokens, [first_event_at]);
        assert_eq!(first_tokens[0] - headers_at, Duration::from_secs(1));
    }

    /// No first token is promised, or timed, for an answer whose chunks do
    /// not arrive as they come, for a whole (JSON) answer, or for an error.
    #[test]
    fn a_token_is_any_event_but_a_responses_streams_opening() {
        let chat = Some(Api::Chat);
        assert!(carries_a_token(chat, b"data: {\"choices\":[]}\n\n"));
        assert!(carries_a_token(chat, b"da"), "an event split across chunks");
        assert!(!carries_a_token(chat, b": ping\n\n\n"));
        assert!(!carries_a_token(chat, b""));
        let responses = Some(Api::Responses);
        let created = b"event: response.created\ndata: {\"type\":\"response.created\"}\n\n";
        assert!(!carries_a_token(responses, created));
        assert!(carries_a_token(
            responses,
            b"event: response.output_text.delta\ndata: {\"delta\":\"Hi\"}\n\n"
        ));
    }

    #[tokio::test]
    async fn only_a_successful_event_stream_sent_as_it_comes_times_a_first_token() {
        let event = response_body(b"data: {}\n\n", true);
        for (response_mode, status, content_type, follows) in [
            (FULL_DUPLEX_STREAMED, "200", "text/event-stream", true),
            (STREAMED, "200", "TEXT/EVENT-STREAM", true),
            (2, "200", "text/event-stream", false), // BUFFERED: one chunk at the end
            (FULL_DUPLEX_STREAMED, "200", "application/json", false),
            (FULL_DUPLEX_STREAMED, "400", "text/event-stream", false),
            (FULL_DUPLEX_STREAMED, "503", "text/event-stream", false),
        ] {
            let router = FakeRouter::new(local());
            let mut requests = [
                headers(&[PATH], false),
                body(CHAT, true),
                answer_headers(status, content_type),
                event.clone(),
            ]
            .map(request);
            requests[0].protocol_config = Some(ProtocolConfiguration {
                request_body_mode: FULL_DUPLEX_STREAMED,
                response_body_mode: response_mode,
                ..ProtocolConfiguration::default()
            });
            exchange_requests(&router, requests.into()).await;
            let case = format!("mode {response_mode}, {status}, {content_type}");
            assert_eq!(
                router.completed.lock().unwrap()[0].first_token_follows,
                follows,
                "{case}"
            );
            assert_eq!(
                router.first_tokens.lock().unwrap().len(),
                usize::from(follows),
                "{case}"
            );
        }
    }

    fn response_body(bytes: &[u8], end_of_stream: bool) -> Msg {
        match body(bytes, end_of_stream) {
            Msg::RequestBody(b) => Msg::ResponseBody(b),
            _ => unreachable!(),
        }
    }

    #[tokio::test]
    async fn a_streamed_answers_usage_is_reported_once_its_body_ends() {
        let router = FakeRouter::new(local());
        let answer = |status: &str, end: bool| {
            vec![
                headers(&[PATH], false),
                body(CHAT, true),
                response_headers(status),
                response_body(b"data: {\"usage\":{\"prompt_tokens\":4", false),
                response_body(
                    b"2,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n",
                    end,
                ),
            ]
        };
        let replies = exchange(&router, true, answer("200", true)).await;
        assert_eq!(replies.len(), 5, "every chunk is handed back: {replies:?}");
        let expected = Usage {
            prompt_tokens: Some(42),
            cached_tokens: Some(32),
        };
        assert_eq!(*router.usage.lock().unwrap(), [expected]);
        // An error answer's counts, or a body that never ends, say nothing.
        exchange(&router, true, answer("500", true)).await;
        exchange(&router, true, answer("200", false)).await;
        assert_eq!(router.usage.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn an_observed_ttft_beyond_durations_range_is_ignored() {
        // fuzz/regressions/extproc_session/observed-ttft-header-1e254
        let router = FakeRouter::new(local());
        let huge = match headers(
            &[
                (":status", "200"),
                ("x-kinference-observed-ttft-ms", "1.5729792023954678e254"),
            ],
            false,
        ) {
            Msg::RequestHeaders(h) => Msg::ResponseHeaders(h),
            _ => unreachable!(),
        };
        let replies = exchange(
            &router,
            false,
            vec![headers(&[PATH], false), body(CHAT, true), huge],
        )
        .await;
        assert_eq!(replies.len(), 3, "the response headers are answered");
        let completed = router.completed.lock().unwrap();
        assert_eq!(completed[0].status, Some(200));
        assert_eq!(completed[0].reported_ttft, None);
    }

    #[tokio::test]
    async fn a_stream_without_response_headers_completes_as_unknown() {
        let router = FakeRouter::new(local());
        exchange(
            &router,
            false,
            vec![headers(&[PATH], false), body(CHAT, true)],
        )
        .await;
        let completed = router.completed.lock().unwrap();
        assert_eq!(*completed, [ResponseFacts::default()]);
        assert_eq!(router.live_tickets(), 0);
    }

    #[tokio::test]
    async fn streamed_mode_holds_the_headers_answer_until_the_body_is_whole() {
        let router = FakeRouter::new(local());
        let replies = exchange(
            &router,
            true,
            vec![
                headers(&[PATH], false),
                body(&CHAT[..10], false),
                body(&CHAT[10..], true),
            ],
        )
        .await;
        // No reply to the headers or the first chunk; then the held headers
        // answer (with the destination) and the body back in one chunk.
        assert_eq!(replies.len(), 2, "{replies:?}");
        assert!(matches!(
            replies[0].response,
            Some(Reply::RequestHeaders(_))
        ));
        assert_eq!(destination(&replies[0]).as_deref(), Some("10.0.0.1:8000"));
        assert!(matches!(replies[1].response, Some(Reply::RequestBody(_))));
    }

    #[tokio::test]
    async fn bad_input_is_refused_without_asking_the_router() {
        for (messages, status) in [
            (vec![headers(&[PATH], false), body(b"{not json", true)], 400),
            (vec![headers(&[(":path", "/v2/nope")], false)], 404),
            (vec![headers(&[PATH], true)], 400),
        ] {
            let router = FakeRouter::new(local());
            let replies = exchange(&router, false, messages).await;
            let last = replies.last().expect("a reply");
            match &last.response {
                Some(Reply::ImmediateResponse(r)) => {
                    assert_eq!(r.status.as_ref().unwrap().code, status)
                }
                other => panic!("expected an immediate response, got {other:?}"),
            }
            assert!(router.routed.lock().unwrap().is_empty());
        }
    }

    #[tokio::test]
    async fn a_reject_is_final_and_leaves_no_ticket() {
        let router = FakeRouter::new(Route::Reject {
            rule: Some("shed".into()),
            status: 429,
            message: "busy".into(),
            detail: None,
        });
        let replies = exchange(
            &router,
            false,
            vec![
                headers(&[PATH], false),
                body(CHAT, true),
                response_headers("200"),
            ],
        )
        .await;
        // Headers continue, then the immediate response; nothing after it.
        assert_eq!(replies.len(), 2, "{replies:?}");
        assert!(matches!(
            replies[1].response,
            Some(Reply::ImmediateResponse(_))
        ));
        assert!(router.completed.lock().unwrap().is_empty());
    }
}
