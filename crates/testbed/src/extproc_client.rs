//! The gateway's side of ext_proc, message by message as Envoy speaks it: for
//! protocol-level tests of the EPP (sequences real Envoy never sends, exact
//! replies) and for the ext_proc load generator. Everything a user would do
//! goes through real Envoy instead ([`crate::envoy`]).

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration, body_mutation, processing_request::Request as Msg,
    processing_response::Response as Reply,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use tonic::transport::Channel;

// The protocol's names, spelled out rather than taken from the EPP.
const DESTINATION_ENDPOINT: &str = "x-gateway-destination-endpoint";
const DESTINATION_SUBSET: &str = "x-gateway-destination-endpoint-subset";
const SERVED_ENDPOINT: &str = "x-gateway-destination-endpoint-served";
const LB_NAMESPACE: &str = "envoy.lb";
const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// A first-byte time the gateway measured, reported on the response.
const OBSERVED_TTFT_HEADER: &str = "x-kinference-observed-ttft-ms";

/// How the gateway sends the request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyMode {
    Buffered,
    /// `FULL_DUPLEX_STREAMED`, the body in chunks of this size.
    Streamed(usize),
}

/// One HTTP request as the gateway hands it to the EPP.
#[derive(Debug, Clone)]
pub struct HttpRequest {
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub mode: BodyMode,
    /// `x-gateway-destination-endpoint-subset` hint, as a list.
    pub subset: Option<Vec<String>>,
}

impl HttpRequest {
    pub fn post(path: &str, body: impl Into<Vec<u8>>) -> Self {
        HttpRequest {
            path: path.to_string(),
            headers: Vec::new(),
            body: body.into(),
            mode: BodyMode::Buffered,
            subset: None,
        }
    }

    pub fn header(mut self, k: &str, v: &str) -> Self {
        self.headers.push((k.to_string(), v.to_string()));
        self
    }

    pub fn streamed(mut self, chunk: usize) -> Self {
        self.mode = BodyMode::Streamed(chunk.max(1));
        self
    }

    /// The request-path messages Envoy would send.
    pub fn messages(&self) -> Vec<ProcessingRequest> {
        let mut headers = vec![
            (":method".to_string(), "POST".to_string()),
            (":path".to_string(), self.path.clone()),
            (":authority".to_string(), "gateway.local".to_string()),
            ("content-type".to_string(), "application/json".to_string()),
            ("content-length".to_string(), self.body.len().to_string()),
        ];
        headers.extend(self.headers.iter().cloned());
        let mode = match self.mode {
            BodyMode::Buffered => BodySendMode::Buffered,
            BodyMode::Streamed(_) => BodySendMode::FullDuplexStreamed,
        } as i32;
        let mut first = ProcessingRequest {
            protocol_config: Some(ProtocolConfiguration {
                request_body_mode: mode,
                response_body_mode: BodySendMode::None as i32,
                ..ProtocolConfiguration::default()
            }),
            metadata_context: self.subset.as_ref().map(|s| subset_metadata(s)),
            request: Some(Msg::RequestHeaders(HttpHeaders {
                headers: Some(header_map(&headers)),
                end_of_stream: self.body.is_empty(),
                ..HttpHeaders::default()
            })),
            ..ProcessingRequest::default()
        };
        first.observability_mode = false;
        let mut out = vec![first];
        if self.body.is_empty() {
            return out;
        }
        let chunks: Vec<&[u8]> = match self.mode {
            BodyMode::Buffered => vec![&self.body[..]],
            BodyMode::Streamed(size) => self.body.chunks(size).collect(),
        };
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.into_iter().enumerate() {
            out.push(ProcessingRequest {
                request: Some(Msg::RequestBody(HttpBody {
                    body: chunk.to_vec(),
                    end_of_stream: i == last,
                    ..HttpBody::default()
                })),
                ..ProcessingRequest::default()
            });
        }
        out
    }
}

/// What the EPP decided, read back from its replies.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    /// Request headers the EPP set (for an immediate response: its headers).
    pub set_headers: HashMap<String, String>,
    pub removed_headers: Vec<String>,
    /// `envoy.lb` dynamic metadata.
    pub lb_metadata: HashMap<String, String>,
    /// The body to send upstream when the EPP replaced it.
    pub body: Option<Vec<u8>>,
    pub clear_route_cache: bool,
    /// An immediate response: (status, body).
    pub immediate: Option<(u16, Vec<u8>)>,
}

impl Outcome {
    pub fn destination(&self) -> Option<&str> {
        self.set_headers
            .get(DESTINATION_ENDPOINT)
            .map(String::as_str)
    }

    pub fn status(&self) -> Option<u16> {
        self.immediate.as_ref().map(|(s, _)| *s)
    }

    /// Folds the EPP's replies into one outcome.
    pub fn from_replies(replies: &[ProcessingResponse]) -> Outcome {
        let mut out = Outcome::default();
        let mut streamed_body: Option<Vec<u8>> = None;
        for reply in replies {
            if let Some(md) = &reply.dynamic_metadata
                && let Some(Value {
                    kind: Some(Kind::StructValue(lb)),
                }) = md.fields.get(LB_NAMESPACE)
            {
                for (k, v) in &lb.fields {
                    if let Some(Kind::StringValue(s)) = &v.kind {
                        out.lb_metadata.insert(k.clone(), s.clone());
                    }
                }
            }
            let common = match &reply.response {
                Some(Reply::RequestHeaders(h)) => h.response.as_ref(),
                Some(Reply::RequestBody(b)) => b.response.as_ref(),
                Some(Reply::ImmediateResponse(i)) => {
                    let status = i.status.as_ref().map_or(200, |s| s.code as u16);
                    out.immediate = Some((status, i.body.clone()));
                    for h in i
                        .headers
                        .iter()
                        .flat_map(|m| &m.set_headers)
                        .filter_map(|o| o.header.as_ref())
                    {
                        out.set_headers.insert(
                            h.key.clone(),
                            String::from_utf8_lossy(&h.raw_value).into_owned(),
                        );
                    }
                    None
                }
                _ => None,
            };
            let Some(common) = common else { continue };
            out.clear_route_cache |= common.clear_route_cache;
            if let Some(hm) = &common.header_mutation {
                for h in hm.set_headers.iter().filter_map(|o| o.header.as_ref()) {
                    let v = if h.raw_value.is_empty() {
                        h.value.clone()
                    } else {
                        String::from_utf8_lossy(&h.raw_value).into_owned()
                    };
                    out.set_headers.insert(h.key.clone(), v);
                }
                out.removed_headers
                    .extend(hm.remove_headers.iter().cloned());
            }
            match common
                .body_mutation
                .as_ref()
                .and_then(|b| b.mutation.as_ref())
            {
                Some(body_mutation::Mutation::Body(b)) => out.body = Some(b.clone()),
                Some(body_mutation::Mutation::StreamedResponse(s)) => streamed_body
                    .get_or_insert_with(Vec::new)
                    .extend_from_slice(&s.body),
                _ => {}
            }
        }
        if out.body.is_none() {
            out.body = streamed_body;
        }
        out
    }
}

/// A gRPC client to the EPP's ext_proc service.
#[derive(Clone)]
pub struct EppClient {
    inner: ExternalProcessorClient<Channel>,
}

impl EppClient {
    pub async fn connect(addr: std::net::SocketAddr) -> anyhow::Result<Self> {
        let channel = Channel::from_shared(format!("http://{addr}"))?
            .connect()
            .await?;
        Ok(EppClient {
            inner: ExternalProcessorClient::new(channel)
                .max_decoding_message_size(64 * 1024 * 1024)
                .max_encoding_message_size(64 * 1024 * 1024),
        })
    }

    /// Opens a stream, sends the request path and collects replies until the
    /// EPP has answered the body (or sent an immediate response). Returns the
    /// open stream's sender too, for the response path.
    pub async fn decide(&self, request: &HttpRequest) -> anyhow::Result<(Outcome, Stream)> {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let mut client = self.inner.clone();
        for msg in request.messages() {
            tx.send(msg).await?;
        }
        let mut inbound = client
            .process(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        let expected_body_replies = match request.mode {
            BodyMode::Buffered => 1,
            BodyMode::Streamed(_) => usize::MAX,
        };
        let mut replies = Vec::new();
        let mut body_replies = 0;
        while let Some(reply) = inbound.message().await? {
            let done = match &reply.response {
                Some(Reply::ImmediateResponse(_)) => true,
                Some(Reply::RequestBody(b)) => {
                    body_replies += 1;
                    let last_chunk = matches!(
                        b.response.as_ref().and_then(|c| c.body_mutation.as_ref()).and_then(|m| m.mutation.as_ref()),
                        Some(body_mutation::Mutation::StreamedResponse(s)) if s.end_of_stream
                    );
                    body_replies >= expected_body_replies || last_chunk
                }
                _ => false,
            };
            replies.push(reply);
            if done {
                break;
            }
        }
        Ok((Outcome::from_replies(&replies), Stream { tx, inbound }))
    }
}

/// The rest of an ext_proc stream: the response path.
pub struct Stream {
    tx: tokio::sync::mpsc::Sender<ProcessingRequest>,
    inbound: tonic::Streaming<ProcessingResponse>,
}

impl Stream {
    /// Reports the upstream's response headers (status, which endpoint
    /// served, an observed TTFT) and waits for the EPP's answer.
    pub async fn response_headers(
        &mut self,
        status: u16,
        served: Option<&str>,
        ttft_ms: Option<f64>,
    ) -> anyhow::Result<ProcessingResponse> {
        let mut headers = vec![(":status".to_string(), status.to_string())];
        if let Some(ms) = ttft_ms {
            headers.push((OBSERVED_TTFT_HEADER.to_string(), format!("{ms:.3}")));
        }
        let metadata = served.map(|s| Metadata {
            filter_metadata: [(
                LB_NAMESPACE.to_string(),
                Struct {
                    fields: [(SERVED_ENDPOINT.to_string(), string(s))].into(),
                },
            )]
            .into(),
            ..Metadata::default()
        });
        self.tx
            .send(ProcessingRequest {
                metadata_context: metadata,
                request: Some(Msg::ResponseHeaders(HttpHeaders {
                    headers: Some(header_map(&headers)),
                    ..HttpHeaders::default()
                })),
                ..ProcessingRequest::default()
            })
            .await?;
        self.inbound
            .message()
            .await?
            .ok_or_else(|| anyhow::anyhow!("the EPP closed the stream"))
    }

    /// Ends the response (an empty last body chunk) and closes the stream.
    pub async fn finish(self) -> anyhow::Result<()> {
        self.finish_with(Vec::new()).await
    }

    /// Ends the response with `body` as its one chunk (an answer the EPP
    /// may read, e.g. its usage) and closes the stream.
    pub async fn finish_with(mut self, body: impl Into<Vec<u8>>) -> anyhow::Result<()> {
        self.tx
            .send(ProcessingRequest {
                request: Some(Msg::ResponseBody(HttpBody {
                    body: body.into(),
                    end_of_stream: true,
                    ..HttpBody::default()
                })),
                ..ProcessingRequest::default()
            })
            .await?;
        let _ = self.inbound.message().await;
        Ok(())
    }

    /// Sends request trailers (some gateways end a body that way).
    pub async fn trailers(&self) -> anyhow::Result<()> {
        self.tx
            .send(ProcessingRequest {
                request: Some(Msg::RequestTrailers(HttpTrailers::default())),
                ..ProcessingRequest::default()
            })
            .await?;
        Ok(())
    }
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

fn header_map(headers: &[(String, String)]) -> HeaderMap {
    HeaderMap {
        headers: headers
            .iter()
            .map(|(k, v)| HeaderValue {
                key: k.clone(),
                raw_value: v.as_bytes().to_vec(),
                ..HeaderValue::default()
            })
            .collect(),
    }
}

/// The subset hint as Envoy sends it: a list under `envoy.lb.subset_hint`.
pub fn subset_metadata(endpoints: &[String]) -> Metadata {
    let list = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: endpoints.iter().map(|e| string(e)).collect(),
        })),
    };
    Metadata {
        filter_metadata: [(
            SUBSET_NAMESPACE.to_string(),
            Struct {
                fields: [(DESTINATION_SUBSET.to_string(), list)].into(),
            },
        )]
        .into(),
        ..Metadata::default()
    }
}
