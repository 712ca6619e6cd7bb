//! Building ext_proc answers: the one place where a decision becomes an
//! Envoy reply ([`answer`]), and the header and body mutations, `envoy.lb`
//! dynamic metadata and immediate responses it is made of.

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, body_mutation, processing_response::Response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

use super::body;
use super::router::{LocalRoute, ProviderRoute, Route};
use super::{DECISION_DETAIL, DESTINATION_ENDPOINT, MODEL_HEADER, RULE_HEADER};

/// Client headers that carry credentials; removed before a provider call.
const CLIENT_CREDENTIAL_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "cookie",
];

/// How the gateway exchanges the request with the EPP.
#[derive(Debug, Clone, Copy)]
pub struct Exchange<'a> {
    /// The request body as received (rewritten here when the model changes).
    pub body: &'a [u8],
    /// `FULL_DUPLEX_STREAMED` request body: the held headers answer carries
    /// the routing, the body follows in chunks.
    pub streamed: bool,
    /// Fallback endpoints listed after the selected one in the metadata.
    pub fallbacks: usize,
}

/// The replies that carry `route` to the gateway, in order. A reject is one
/// immediate response (final: the stream ends).
pub fn answer(route: &Route, exchange: Exchange<'_>) -> Vec<ProcessingResponse> {
    let mutation = match route {
        Route::Reject {
            rule,
            status,
            message,
            detail,
        } => {
            let mut answer = reject(rule.as_deref(), *status, message);
            if let Some(detail) = detail {
                add_immediate_header(&mut answer, DECISION_DETAIL, detail);
            }
            return vec![answer];
        }
        Route::Local(local) => local_mutation(local, exchange),
        Route::Provider(provider) => provider_mutation(provider, exchange),
    };
    if exchange.streamed {
        routed_streamed(&mutation, exchange.body)
    } else {
        vec![routed_buffered(&mutation)]
    }
}

fn reject(rule: Option<&str>, status: u16, message: &str) -> ProcessingResponse {
    let kind = if status == 429 {
        "rate_limit_exceeded"
    } else if status < 500 {
        "invalid_request_error"
    } else {
        "service_unavailable"
    };
    let mut answer = immediate_error(status, kind, message);
    if let Some(rule) = rule {
        add_immediate_header(&mut answer, RULE_HEADER, rule);
    }
    answer
}

fn local_mutation(local: &LocalRoute, exchange: Exchange<'_>) -> Mutation {
    // The header names the selected endpoint alone: ORIGINAL_DST clusters
    // (most gateways) dial it as is and fail on a list. The metadata carries
    // the ordered list, primary first, for gateways whose override-host
    // policy retries along it.
    let primary = local.addresses.first().cloned().unwrap_or_default();
    let listed = local.addresses.len().min(1 + exchange.fallbacks);
    Mutation {
        set_headers: vec![
            (DESTINATION_ENDPOINT.into(), primary),
            (RULE_HEADER.into(), local.rule.clone()),
            (MODEL_HEADER.into(), local.model.clone()),
        ],
        // A client must not steer itself to a paid provider.
        remove_headers: vec![kinference_api::DESTINATION_HEADER.into()],
        lb_metadata: [(
            DESTINATION_ENDPOINT.into(),
            local.addresses[..listed].join(","),
        )]
        .into_iter()
        .chain(detail_metadata(local.detail.as_ref()))
        .collect(),
        body: rewritten(exchange.body, local.rewrite_model.as_deref()),
    }
}

fn provider_mutation(provider: &ProviderRoute, exchange: Exchange<'_>) -> Mutation {
    let mut set_headers = vec![
        (
            kinference_api::DESTINATION_HEADER.into(),
            format!("provider/{}", provider.provider),
        ),
        (RULE_HEADER.into(), provider.rule.clone()),
        (MODEL_HEADER.into(), provider.model.clone()),
    ];
    if let Some(key) = &provider.api_key {
        set_headers.push(("authorization".into(), format!("Bearer {key}")));
    }
    // The client's credentials are for this gateway, never for a provider; a
    // client-chosen endpoint header must not pull the provider's key to a
    // host of the client's choosing.
    let mut remove_headers: Vec<String> = CLIENT_CREDENTIAL_HEADERS
        .iter()
        .map(|h| h.to_string())
        .collect();
    remove_headers.push(DESTINATION_ENDPOINT.into());
    Mutation {
        set_headers,
        remove_headers,
        lb_metadata: detail_metadata(provider.detail.as_ref()).collect(),
        body: rewritten(exchange.body, provider.rewrite_model.as_deref()),
    }
}

/// The decision detail as `envoy.lb` metadata, for the gateway's access
/// log (`%DYNAMIC_METADATA(envoy.lb:x-kinference-decision-detail)%`); the
/// session also returns it as a response header where it sees one.
fn detail_metadata(detail: Option<&String>) -> impl Iterator<Item = (String, String)> {
    detail
        .map(|d| (DECISION_DETAIL.to_string(), d.clone()))
        .into_iter()
}

fn rewritten(original: &[u8], model: Option<&str>) -> Option<Vec<u8>> {
    model.and_then(|m| body::rewrite_model(original, m).ok())
}

/// Envoy caps a streamed body chunk at 64 KiB; stay clear of it.
pub(crate) const MAX_STREAMED_CHUNK: usize = 62_000;

/// Headers and metadata to set on the request when it is routed.
#[derive(Debug, Default, Clone)]
pub struct Mutation {
    pub set_headers: Vec<(String, String)>,
    pub remove_headers: Vec<String>,
    /// `envoy.lb` metadata entries.
    pub lb_metadata: Vec<(String, String)>,
    /// A replacement body (model rewrite); `content-length` is set to match.
    pub body: Option<Vec<u8>>,
}

impl Mutation {
    fn header_mutation(&self) -> Option<HeaderMutation> {
        let mut set: Vec<HeaderValueOption> = self
            .set_headers
            .iter()
            .map(|(k, v)| header_option(k, v))
            .collect();
        if let Some(body) = &self.body {
            set.push(header_option("content-length", &body.len().to_string()));
        }
        (!set.is_empty() || !self.remove_headers.is_empty()).then(|| HeaderMutation {
            set_headers: set,
            remove_headers: self.remove_headers.clone(),
        })
    }

    fn dynamic_metadata(&self) -> Option<Struct> {
        if self.lb_metadata.is_empty() {
            return None;
        }
        let inner = Struct {
            fields: self
                .lb_metadata
                .iter()
                .map(|(k, v)| (k.clone(), string_value(v)))
                .collect(),
        };
        Some(Struct {
            fields: [(
                "envoy.lb".to_string(),
                Value {
                    kind: Some(Kind::StructValue(inner)),
                },
            )]
            .into(),
        })
    }
}

pub(crate) fn header_option(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        ..HeaderValueOption::default()
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

fn common(mutation: Option<&Mutation>, with_body: bool) -> CommonResponse {
    CommonResponse {
        header_mutation: mutation.and_then(Mutation::header_mutation),
        body_mutation: mutation
            .filter(|_| with_body)
            .and_then(|m| m.body.clone())
            .map(|b| BodyMutation {
                mutation: Some(body_mutation::Mutation::Body(b)),
            }),
        clear_route_cache: mutation.is_some(),
        ..CommonResponse::default()
    }
}

/// Let the request headers through unchanged.
pub fn continue_request_headers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse::default())),
        ..ProcessingResponse::default()
    }
}

pub fn continue_response_headers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse::default())),
        ..ProcessingResponse::default()
    }
}

pub fn continue_response_body() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseBody(BodyResponse::default())),
        ..ProcessingResponse::default()
    }
}

pub fn continue_request_trailers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestTrailers(Default::default())),
        ..ProcessingResponse::default()
    }
}

pub fn continue_response_trailers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseTrailers(Default::default())),
        ..ProcessingResponse::default()
    }
}

/// Buffered mode: one body response carries headers, metadata and the body.
pub fn routed_buffered(m: &Mutation) -> ProcessingResponse {
    ProcessingResponse {
        dynamic_metadata: m.dynamic_metadata(),
        response: Some(Response::RequestBody(BodyResponse {
            response: Some(common(Some(m), true)),
        })),
        ..ProcessingResponse::default()
    }
}

/// Streamed mode: the held headers response carries headers and metadata; the
/// body follows in chunks of at most [`MAX_STREAMED_CHUNK`].
pub fn routed_streamed(m: &Mutation, original_body: &[u8]) -> Vec<ProcessingResponse> {
    let mut out = vec![ProcessingResponse {
        dynamic_metadata: m.dynamic_metadata(),
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(common(Some(m), false)),
        })),
        ..ProcessingResponse::default()
    }];
    let body = m.body.as_deref().unwrap_or(original_body);
    let chunks: Vec<&[u8]> = if body.is_empty() {
        vec![&[][..]]
    } else {
        body.chunks(MAX_STREAMED_CHUNK).collect()
    };
    let last = chunks.len() - 1;
    for (i, chunk) in chunks.into_iter().enumerate() {
        out.push(ProcessingResponse {
            response: Some(Response::RequestBody(BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(body_mutation::Mutation::StreamedResponse(
                            StreamedBodyResponse {
                                body: chunk.to_vec(),
                                end_of_stream: i == last,
                                ..StreamedBodyResponse::default()
                            },
                        )),
                    }),
                    ..CommonResponse::default()
                }),
            })),
            ..ProcessingResponse::default()
        });
    }
    out
}

/// Adds a header to an immediate response (e.g. which rule rejected).
pub(crate) fn add_immediate_header(response: &mut ProcessingResponse, key: &str, value: &str) {
    if let Some(Response::ImmediateResponse(ImmediateResponse {
        headers: Some(h), ..
    })) = &mut response.response
    {
        h.set_headers.push(header_option(key, value));
    }
}

/// An immediate response with an OpenAI-shaped error body; the request never
/// reaches a model server.
pub(crate) fn immediate_error(status: u16, kind: &str, message: &str) -> ProcessingResponse {
    let body = serde_json::json!({
        "error": { "message": message, "type": kind, "param": null, "code": status }
    });
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers: vec![header_option("content-type", "application/json")],
                remove_headers: vec![],
            }),
            body: serde_json::to_vec(&body).expect("JSON serializes"),
            details: format!("kinference_{kind}"),
            ..ImmediateResponse::default()
        })),
        ..ProcessingResponse::default()
    }
}
