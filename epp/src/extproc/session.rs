//! One ext_proc stream: request headers → body → decision → answer, then the
//! response path (which endpoint served, how fast).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, body_mutation,
    processing_request::Request as Msg, processing_response::Response as Reply,
};
use envoy_types::pb::google::protobuf::value::Kind;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use super::body::{self, Api, path_only};
use super::reply::{self, Mutation};
use super::*;
use crate::picker::{Incoming, Pick, Picker, ProviderCredential};
use crate::predict::{DestinationState, InflightGuard, Outcome, TtftFeatures};

/// `BodySendMode::FullDuplexStreamed` in the filter's protocol config.
const FULL_DUPLEX_STREAMED: i32 = 4;

/// Client headers that carry credentials; removed before a provider call.
const CLIENT_CREDENTIAL_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "cookie",
];

/// What the session remembers after routing, for the response path.
struct Routed {
    /// Counts the request on the picked destination until the stream ends.
    guard: InflightGuard,
    state: Arc<DestinationState>,
    /// The picked endpoint's `ip:port`; `None` for a provider.
    address: Option<String>,
    features: Option<TtftFeatures>,
    decided_at: Instant,
    /// The upstream answered with a non-error status. Until response headers
    /// are seen the outcome is unknown: a gateway configured with
    /// `response_header_mode: SKIP` never sends them.
    answered: bool,
}

impl Routed {
    fn new(
        state: Arc<DestinationState>,
        address: Option<String>,
        features: Option<TtftFeatures>,
    ) -> Self {
        Routed {
            guard: state.stats.begin(Instant::now()),
            state,
            address,
            features,
            decided_at: Instant::now(),
            answered: false,
        }
    }
}

pub struct Session {
    picker: Arc<Picker>,
    config: Arc<ExtProcConfig>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    request_streamed: bool,
    response_streamed: bool,
    headers: BTreeMap<String, String>,
    api: Option<Api>,
    path: String,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    routed: Option<Routed>,
    done: bool,
}

impl Session {
    pub fn new(
        picker: Arc<Picker>,
        config: Arc<ExtProcConfig>,
        tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    ) -> Self {
        Session {
            picker,
            config,
            tx,
            request_streamed: false,
            response_streamed: false,
            headers: BTreeMap::new(),
            api: None,
            path: String::new(),
            subset: None,
            body: Vec::new(),
            routed: None,
            done: false,
        }
    }

    pub async fn run(mut self, mut inbound: Streaming<ProcessingRequest>) {
        loop {
            let msg = match inbound.message().await {
                Ok(Some(msg)) => msg,
                // The gateway closed the stream, or it broke mid-way: nothing
                // is left to answer; the in-flight guard (if any) is released.
                Ok(None) => break,
                Err(status) => {
                    tracing::debug!(code = ?status.code(), "ext_proc stream ended with an error");
                    break;
                }
            };
            if !self.handle(msg).await {
                break;
            }
        }
        if let Some(routed) = self.routed.take()
            && routed.answered
        {
            routed.guard.finish(Outcome::Success, Instant::now());
        }
        // Otherwise the guard is dropped unfinished: the stream ended without
        // response headers (skipped by the gateway's processing mode, or the
        // client went away), so the outcome is unknown, not a failure. A
        // gateway's own error reply (no healthy upstream, connect failure)
        // arrives as response headers with a 5xx status.
    }

    /// Returns false when the stream should end.
    async fn handle(&mut self, msg: ProcessingRequest) -> bool {
        if let Some(pc) = &msg.protocol_config {
            self.request_streamed = pc.request_body_mode == FULL_DUPLEX_STREAMED;
            self.response_streamed = pc.response_body_mode == FULL_DUPLEX_STREAMED;
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
                let served = msg.metadata_context.as_ref().and_then(served_endpoint);
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
        if self.config.conformance_hooks
            && let Some(ips) = self.headers.get(TEST_SELECTION_HEADER)
        {
            self.subset = Some(split_list(ips));
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
        if self.body.is_empty() && b.end_of_stream {
            self.body = b.body;
        } else {
            self.body.extend_from_slice(&b.body);
        }
        if b.end_of_stream {
            self.decide().await
        } else {
            true
        }
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
        let pick = self
            .picker
            .pick(&Incoming {
                headers: &self.headers,
                path: &self.path,
                api,
                body: &parsed,
                subset: self.subset.as_deref(),
            })
            .await;
        let mut prefix: Option<(Arc<DestinationState>, Vec<u64>)> = None;
        let mutation = match pick {
            Pick::Reject {
                status,
                message,
                rule,
            } => {
                let kind = if status == 429 {
                    "rate_limit_exceeded"
                } else if status < 500 {
                    "invalid_request_error"
                } else {
                    "service_unavailable"
                };
                tracing::debug!(?rule, status, "rejected");
                let mut answer = reply::immediate_error(status, kind, &message);
                if let Some(rule) = &rule {
                    reply::add_immediate_header(&mut answer, RULE_HEADER, rule);
                }
                // The stream ends either way: an immediate response is final.
                let _ = self.send(answer).await;
                return false;
            }
            Pick::Local(local) => {
                self.routed = Some(Routed::new(
                    Arc::clone(&local.state),
                    local.addresses.first().cloned(),
                    local.features,
                ));
                prefix = Some((local.state, local.prefix_hashes));
                // The header names the selected endpoint alone: ORIGINAL_DST
                // clusters (most gateways) dial it as is and fail on a list.
                // The metadata carries the ordered list, primary first, for
                // gateways whose override-host policy retries along it.
                let primary = local.addresses.first().cloned().unwrap_or_default();
                let listed = 1 + self.config.fallbacks;
                let list = local.addresses[..local.addresses.len().min(listed)].join(",");
                Mutation {
                    set_headers: vec![
                        (DESTINATION_ENDPOINT.into(), primary),
                        (RULE_HEADER.into(), local.rule),
                        (MODEL_HEADER.into(), local.model),
                    ],
                    // A client must not steer itself to a paid provider.
                    remove_headers: vec![kinference_api::DESTINATION_HEADER.into()],
                    lb_metadata: vec![(DESTINATION_ENDPOINT.into(), list)],
                    body: self.rewritten(local.rewrite_model.as_deref()),
                }
            }
            Pick::Provider(p) => {
                let key = match p.credential {
                    ProviderCredential::Key(key) => Some(key),
                    ProviderCredential::NotRequired => None,
                    ProviderCredential::Missing { secret } => {
                        // Fail closed: without its key the request would go out
                        // unauthenticated, or worse with the client's own token.
                        tracing::warn!(provider = %p.provider, %secret, "provider picked but its API key is not loaded");
                        let message = format!(
                            "provider {:?} has no API key loaded (Secret {secret:?})",
                            p.provider
                        );
                        let mut answer =
                            reply::immediate_error(503, "service_unavailable", &message);
                        reply::add_immediate_header(&mut answer, RULE_HEADER, &p.rule);
                        self.picker.metrics.bad_request("provider_key_missing");
                        let _ = self.send(answer).await;
                        return false;
                    }
                };
                self.routed = Some(Routed::new(p.state, None, None));
                let mut set_headers = vec![
                    (
                        kinference_api::DESTINATION_HEADER.into(),
                        format!("provider/{}", p.provider),
                    ),
                    (RULE_HEADER.into(), p.rule),
                    (MODEL_HEADER.into(), p.model),
                ];
                if let Some(key) = key {
                    set_headers.push(("authorization".into(), format!("Bearer {key}")));
                }
                // The client's credentials are for this gateway, never for a
                // provider; a client-chosen endpoint header must not pull the
                // provider's key to a host of the client's choosing.
                let mut remove_headers: Vec<String> = CLIENT_CREDENTIAL_HEADERS
                    .iter()
                    .map(|h| h.to_string())
                    .collect();
                remove_headers.push(DESTINATION_ENDPOINT.into());
                Mutation {
                    set_headers,
                    remove_headers,
                    lb_metadata: vec![],
                    body: self.rewritten(p.rewrite_model.as_deref()),
                }
            }
        };
        let sent = if self.request_streamed {
            let mut ok = true;
            for msg in reply::routed_streamed(&mutation, &self.body) {
                if !self.send(msg).await {
                    ok = false;
                    break;
                }
            }
            ok
        } else {
            self.send(reply::routed_buffered(&mutation)).await
        };
        if let Some((state, hashes)) = prefix {
            state.prefix.record(&hashes);
        }
        sent
    }

    fn rewritten(&self, model: Option<&str>) -> Option<Vec<u8>> {
        model.and_then(|m| body::rewrite_model(&self.body, m).ok())
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
        let reported = headers
            .get(OBSERVED_TTFT_HEADER)
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|ms| ms.is_finite() && *ms >= 0.0)
            .map(|ms| Duration::from_secs_f64(ms / 1000.0));
        let now = Instant::now();
        let failed = status >= 500 || status == 429;
        match self.routed.take() {
            None => {}
            Some(routed) if failed => routed.guard.finish(Outcome::Failure, now),
            // The gateway went down the fallback list: the primary failed and
            // another endpoint answered. Credit that one with the success
            // and its TTFT; the model is calibrated only on the predicted one.
            Some(routed) if fell_back(&routed, served.as_deref()) => {
                let ttft = reported.unwrap_or_else(|| now - routed.decided_at);
                let actual = served
                    .as_deref()
                    .and_then(|a| self.picker.registry.state_at(a));
                if let Some(actual) = actual {
                    self.picker.observe_ttft(&actual, None, ttft);
                    actual.stats.record_outcome(Outcome::Success, now);
                }
                routed.guard.finish(Outcome::Failure, now);
            }
            Some(mut routed) => {
                let ttft = reported.unwrap_or_else(|| now - routed.decided_at);
                self.picker
                    .observe_ttft(&routed.state, routed.features.as_ref(), ttft);
                routed.answered = true;
                self.routed = Some(routed);
            }
        }
        let mut answer = reply::continue_response_headers();
        if self.config.conformance_hooks
            && let Some(served) = served
            && let Some(Reply::ResponseHeaders(HeadersResponse { response })) = &mut answer.response
        {
            *response = Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers: vec![super::reply::header_option(TEST_SERVED_HEADER, &served)],
                    remove_headers: vec![],
                }),
                ..CommonResponse::default()
            });
        }
        self.send(answer).await
    }

    async fn on_response_body(&mut self, b: HttpBody) -> bool {
        if b.end_of_stream
            && self.routed.as_ref().is_some_and(|r| r.answered)
            && let Some(routed) = self.routed.take()
        {
            routed.guard.finish(Outcome::Success, Instant::now());
        }
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
        self.picker.metrics.bad_request(reason);
        let _ = self
            .send(reply::immediate_error(status, kind, message))
            .await;
        false
    }

    async fn send(&self, msg: ProcessingResponse) -> bool {
        self.tx.send(Ok(msg)).await.is_ok()
    }
}

/// Whether the gateway reports that an endpoint other than the one picked
/// served the request.
fn fell_back(routed: &Routed, served: Option<&str>) -> bool {
    matches!((routed.address.as_deref(), served), (Some(picked), Some(served)) if picked != served)
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

fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// The subset hint: a list of `ip:port` strings, or one comma-separated string.
pub(super) fn subset_hint(md: &Metadata) -> Option<Vec<String>> {
    let value = md
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(DESTINATION_SUBSET)?;
    match value.kind.as_ref()? {
        Kind::StringValue(s) => Some(split_list(s)),
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
