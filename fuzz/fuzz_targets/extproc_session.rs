//! One ext_proc session (`ExtProcService::open`) over a message sequence
//! derived from the input: request headers, body chunks, trailers, response
//! headers and bodies, in any order, with protocol configurations, subset
//! hints and served-endpoint metadata, well-formed or not. The router is the
//! real `Picker`, over one of the shipped policies (the demo's default and
//! `examples/*.yaml`), four endpoints whose scraped load the input sets, and
//! provider keys for some providers only. Nothing leaves the process: no
//! scraper runs and the policies use built-in classifiers only.
//!
//! Checks, beyond "never panics":
//! - the reply stream ends (within 10 s) once the inbound stream has;
//! - every reply carries a response; an immediate response is the last one;
//! - a destination header or `envoy.lb` list names only known endpoints;
//! - a provider key is only ever set on a request routed to a provider;
//! - once the stream has ended, no request is left in flight on any
//!   endpoint or provider (tickets are released).
#![no_main]

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration, processing_request::Request as Msg,
    processing_response::Response as Reply,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use futures::StreamExt;
use kinference_epp::endpoints::{EndpointSpec, ScrapedMetrics, endpoints_from_specs};
use kinference_epp::extproc::{
    DESTINATION_ENDPOINT, DESTINATION_SUBSET, ExtProcConfig, ExtProcService, LB_NAMESPACE,
    SERVED_ENDPOINT, SUBSET_NAMESPACE,
};
use kinference_epp::server::{Epp, Settings};
use libfuzzer_sys::fuzz_target;

/// The policies a session may run under.
const POLICIES: &[(&str, &str)] = &[
    (
        "default",
        include_str!("../../cli/src/demo/default-policy.yaml"),
    ),
    (
        "cheap-model-unless-cached",
        include_str!("../../examples/cheap-model-unless-cached.yaml"),
    ),
    ("per-tenant", include_str!("../../examples/per-tenant.yaml")),
    (
        "pii-stays-local",
        include_str!("../../examples/pii-stays-local.yaml"),
    ),
    (
        "provider-fallback",
        include_str!("../../examples/provider-fallback.yaml"),
    ),
    (
        "slo-exclusion",
        include_str!("../../examples/slo-exclusion.yaml"),
    ),
];

/// `(name, address, models, backend)` of the local endpoints.
const ENDPOINTS: &[(&str, &str, &[&str], &str)] = &[
    ("vllm-a", "10.0.0.1:8000", &["qwen-2.5"], "vllm"),
    (
        "vllm-b",
        "10.0.0.2:8000",
        &["qwen-2.5", "gemma-4"],
        "premium",
    ),
    ("gemma-a", "10.0.0.3:8000", &["gemma-4", "sql-lora"], "vllm"),
    (
        "v6",
        "[fd00::4]:8000",
        &["qwen-2.5", "gemma-4"],
        "model-server",
    ),
];

/// Provider keys the EPP holds; `databricks` has none (its requests fail
/// closed).
const PROVIDER_KEYS: &[(&str, &str)] = &[("openai", "sk-fuzz-openai"), ("cloud", "sk-fuzz-cloud")];

/// Strings header values, models and hints are often drawn from.
const WORDS: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/chat/completions?stream=true",
    "/v1/models",
    "qwen-2.5",
    "gemma-4",
    "sql-lora",
    "gpt-4o-mini",
    "alice",
    "bob",
    "trial",
    "10.0.0.1:8000",
    "10.0.0.2:8000",
    "10.0.0.3:8000",
    "[fd00::4]:8000",
    "10.0.0.1:8000,10.0.0.3:8000",
    "10.0.0.9:8000",
    "provider/openai",
    "provider/cloud",
    "provider/databricks",
    "200",
    "429",
    "500",
    "503",
    "100ms",
    "2s",
    "Bearer sk-client",
    "",
];

#[derive(Arbitrary, Debug)]
struct Input {
    policy: u8,
    conformance_hooks: bool,
    /// A 256-byte body limit instead of the default 16 MiB.
    small_limit: bool,
    fallbacks: u8,
    loads: [Option<Load>; 4],
    messages: Vec<Message>,
    /// The inbound stream breaks (a gRPC error) after the messages.
    broken: bool,
}

#[derive(Arbitrary, Debug)]
struct Load {
    waiting: f64,
    running: f64,
    kv_cache_usage: f64,
    running_loras: Vec<Text>,
    max_lora: Option<u32>,
    block_size: Option<u32>,
    num_gpu_blocks: Option<u64>,
}

#[derive(Arbitrary, Debug)]
struct Message {
    /// `(request_body_mode, response_body_mode)`: Envoy's `BodySendMode`.
    protocol: Option<(u8, u8)>,
    subset: Option<Subset>,
    served: Option<Text>,
    observability_mode: bool,
    kind: Step,
}

#[derive(Arbitrary, Debug)]
enum Step {
    /// A whole request: headers with `:path` and `content-length`, then the
    /// body in `chunks` pieces.
    Request {
        path: Text,
        headers: Vec<Header>,
        body: Body,
        chunks: u8,
        wrong_length: bool,
    },
    RequestHeaders {
        headers: Vec<Header>,
        end_of_stream: bool,
    },
    RequestBody {
        body: Body,
        end_of_stream: bool,
    },
    RequestTrailers(Vec<Header>),
    ResponseHeaders {
        status: Text,
        headers: Vec<Header>,
        end_of_stream: bool,
    },
    ResponseBody {
        body: Vec<u8>,
        end_of_stream: bool,
    },
    ResponseTrailers(Vec<Header>),
    Nothing,
}

#[derive(Arbitrary, Debug)]
enum Subset {
    Text(Text),
    List(Vec<Text>),
    Number(f64),
}

#[derive(Arbitrary, Debug)]
struct Header {
    name: Name,
    value: Text,
    /// In `raw_value` (as Envoy sends it) rather than `value`.
    raw: bool,
}

#[derive(Arbitrary, Debug)]
enum Name {
    Path,
    Status,
    ContentLength,
    RequestId,
    Tenant,
    TenantId,
    TtftSlo,
    GatewayModel,
    TestSelection,
    ObservedTtft,
    Authorization,
    Destination,
    Other(String),
}

impl Name {
    fn as_str(&self) -> &str {
        match self {
            Name::Path => ":path",
            Name::Status => ":status",
            Name::ContentLength => "content-length",
            Name::RequestId => "x-request-id",
            Name::Tenant => "x-kinference-tenant",
            Name::TenantId => "X-Tenant-Id",
            Name::TtftSlo => "x-kinference-ttft-slo",
            Name::GatewayModel => "x-gateway-model-name",
            Name::TestSelection => "test-epp-endpoint-selection",
            Name::ObservedTtft => "x-kinference-observed-ttft-ms",
            Name::Authorization => "authorization",
            Name::Destination => "x-kinference-destination",
            Name::Other(s) => s,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Text {
    Word(u8),
    Number(i64),
    Float(f64),
    Any(String),
}

impl Text {
    fn render(&self) -> String {
        match self {
            Text::Word(i) => WORDS[usize::from(*i) % WORDS.len()].to_string(),
            Text::Number(n) => n.to_string(),
            Text::Float(f) => f.to_string(),
            Text::Any(s) => s.clone(),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Body {
    Raw(Vec<u8>),
    Chat {
        model: Option<Text>,
        messages: Vec<(Text, Text)>,
        max_tokens: Option<u64>,
        stream: Option<bool>,
    },
    Completion {
        model: Option<Text>,
        prompt: Vec<Text>,
        max_tokens: Option<u64>,
    },
    Responses {
        model: Option<Text>,
        instructions: Option<Text>,
        input: Text,
    },
}

impl Body {
    fn render(&self) -> Vec<u8> {
        use serde_json::{Map, Value as Json, json};
        let model = |m: &Option<Text>, o: &mut Map<String, Json>| {
            if let Some(m) = m {
                o.insert("model".into(), Json::String(m.render()));
            }
        };
        let mut o = Map::new();
        match self {
            Body::Raw(bytes) => return bytes.clone(),
            Body::Chat {
                model: m,
                messages,
                max_tokens,
                stream,
            } => {
                model(m, &mut o);
                let messages = messages
                    .iter()
                    .map(|(role, content)| json!({"role": role.render(), "content": content.render()}))
                    .collect();
                o.insert("messages".into(), Json::Array(messages));
                if let Some(n) = max_tokens {
                    o.insert("max_tokens".into(), json!(n));
                }
                if let Some(s) = stream {
                    o.insert("stream".into(), json!(s));
                }
            }
            Body::Completion {
                model: m,
                prompt,
                max_tokens,
            } => {
                model(m, &mut o);
                let prompt = prompt.iter().map(|p| Json::String(p.render())).collect();
                o.insert("prompt".into(), Json::Array(prompt));
                if let Some(n) = max_tokens {
                    o.insert("max_completion_tokens".into(), json!(n));
                }
            }
            Body::Responses {
                model: m,
                instructions,
                input,
            } => {
                model(m, &mut o);
                if let Some(i) = instructions {
                    o.insert("instructions".into(), Json::String(i.render()));
                }
                o.insert("input".into(), Json::String(input.render()));
            }
        }
        serde_json::to_vec(&o).expect("a JSON map serializes")
    }
}

/// One EPP per policy, built on first use and kept for the process.
struct World {
    runtime: tokio::runtime::Runtime,
    epps: Vec<OnceLock<Epp>>,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| World {
        runtime: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a current-thread runtime"),
        epps: POLICIES.iter().map(|_| OnceLock::new()).collect(),
    })
}

fn epp(index: usize) -> &'static Epp {
    world().epps[index].get_or_init(|| {
        let (name, text) = POLICIES[index];
        let epp = Epp::new(Settings::default());
        epp.policy()
            .load_text(text)
            .unwrap_or_else(|e| panic!("policy {name} does not load: {e}"));
        let specs = ENDPOINTS.iter().map(|(name, address, models, backend)| {
            let mut spec = EndpointSpec::new(*address, models);
            spec.name = Some(name.to_string());
            spec.backend = Some(backend.to_string());
            spec.labels = [("app".to_string(), "vllm".to_string())].into();
            spec
        });
        epp.registry()
            .replace_all(endpoints_from_specs(specs).expect("valid endpoints"));
        epp.registry().mark_synced();
        let keys: BTreeMap<String, String> = PROVIDER_KEYS
            .iter()
            .map(|(p, k)| (p.to_string(), k.to_string()))
            .collect();
        epp.picker.provider_keys().store(Arc::new(keys));
        epp
    })
}

fn header_map(headers: &[Header], extra: &[(&str, String)]) -> HeaderMap {
    let mut out: Vec<HeaderValue> = extra
        .iter()
        .map(|(k, v)| HeaderValue {
            key: k.to_string(),
            raw_value: v.as_bytes().to_vec(),
            ..HeaderValue::default()
        })
        .collect();
    out.extend(headers.iter().map(|h| {
        let value = h.value.render();
        if h.raw {
            HeaderValue {
                key: h.name.as_str().to_string(),
                raw_value: value.into_bytes(),
                ..HeaderValue::default()
            }
        } else {
            HeaderValue {
                key: h.name.as_str().to_string(),
                value,
                ..HeaderValue::default()
            }
        }
    }));
    HeaderMap { headers: out }
}

fn string_value(s: String) -> Value {
    Value {
        kind: Some(Kind::StringValue(s)),
    }
}

fn metadata(m: &Message) -> Option<Metadata> {
    let mut filter_metadata = std::collections::HashMap::new();
    if let Some(subset) = &m.subset {
        let value = match subset {
            Subset::Text(t) => string_value(t.render()),
            Subset::List(items) => Value {
                kind: Some(Kind::ListValue(ListValue {
                    values: items.iter().map(|t| string_value(t.render())).collect(),
                })),
            },
            Subset::Number(n) => Value {
                kind: Some(Kind::NumberValue(*n)),
            },
        };
        filter_metadata.insert(
            SUBSET_NAMESPACE.to_string(),
            Struct {
                fields: [(DESTINATION_SUBSET.to_string(), value)].into(),
            },
        );
    }
    if let Some(served) = &m.served {
        filter_metadata.insert(
            LB_NAMESPACE.to_string(),
            Struct {
                fields: [(SERVED_ENDPOINT.to_string(), string_value(served.render()))].into(),
            },
        );
    }
    (!filter_metadata.is_empty()).then(|| Metadata {
        filter_metadata,
        ..Metadata::default()
    })
}

/// The ext_proc messages one [`Message`] stands for.
fn render(m: &Message, out: &mut Vec<ProcessingRequest>) {
    let first = out.len();
    match &m.kind {
        Step::Request {
            path,
            headers,
            body,
            chunks,
            wrong_length,
        } => {
            let bytes = body.render();
            let length = bytes.len() + usize::from(*wrong_length);
            let fixed = [
                (":method", "POST".to_string()),
                (":path", path.render()),
                ("content-type", "application/json".to_string()),
                ("content-length", length.to_string()),
            ];
            out.push(message(Msg::RequestHeaders(HttpHeaders {
                headers: Some(header_map(headers, &fixed)),
                end_of_stream: bytes.is_empty(),
                ..HttpHeaders::default()
            })));
            let n = usize::from(chunks % 4) + 1;
            let size = bytes.len().div_ceil(n).max(1);
            let pieces: Vec<&[u8]> = bytes.chunks(size).collect();
            for (i, piece) in pieces.iter().enumerate() {
                out.push(message(Msg::RequestBody(HttpBody {
                    body: piece.to_vec(),
                    end_of_stream: i + 1 == pieces.len(),
                    ..HttpBody::default()
                })));
            }
        }
        Step::RequestHeaders {
            headers,
            end_of_stream,
        } => out.push(message(Msg::RequestHeaders(HttpHeaders {
            headers: Some(header_map(headers, &[])),
            end_of_stream: *end_of_stream,
            ..HttpHeaders::default()
        }))),
        Step::RequestBody {
            body,
            end_of_stream,
        } => out.push(message(Msg::RequestBody(HttpBody {
            body: body.render(),
            end_of_stream: *end_of_stream,
            ..HttpBody::default()
        }))),
        Step::RequestTrailers(headers) => out.push(message(Msg::RequestTrailers(HttpTrailers {
            trailers: Some(header_map(headers, &[])),
        }))),
        Step::ResponseHeaders {
            status,
            headers,
            end_of_stream,
        } => out.push(message(Msg::ResponseHeaders(HttpHeaders {
            headers: Some(header_map(headers, &[(":status", status.render())])),
            end_of_stream: *end_of_stream,
            ..HttpHeaders::default()
        }))),
        Step::ResponseBody {
            body,
            end_of_stream,
        } => out.push(message(Msg::ResponseBody(HttpBody {
            body: body.clone(),
            end_of_stream: *end_of_stream,
            ..HttpBody::default()
        }))),
        Step::ResponseTrailers(headers) => out.push(message(Msg::ResponseTrailers(HttpTrailers {
            trailers: Some(header_map(headers, &[])),
        }))),
        Step::Nothing => out.push(ProcessingRequest::default()),
    }
    // Protocol configuration and metadata ride on the first message.
    let first = &mut out[first];
    first.protocol_config = m.protocol.map(|(req, resp)| ProtocolConfiguration {
        request_body_mode: i32::from(req % 6),
        response_body_mode: i32::from(resp % 6),
        ..ProtocolConfiguration::default()
    });
    first.metadata_context = metadata(m);
    first.observability_mode = m.observability_mode;
}

fn message(msg: Msg) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(msg),
        ..ProcessingRequest::default()
    }
}

fn set_loads(epp: &Epp, loads: &[Option<Load>; 4]) {
    let now = Instant::now();
    // Unknown load: metrics older than any staleness window.
    let stale = now.checked_sub(Duration::from_secs(3600)).unwrap_or(now);
    for ((name, ..), load) in ENDPOINTS.iter().zip(loads) {
        let metrics = match load {
            Some(l) => ScrapedMetrics {
                waiting: l.waiting,
                running: l.running,
                kv_cache_usage: l.kv_cache_usage,
                running_loras: l.running_loras.iter().map(Text::render).collect(),
                waiting_loras: Vec::new(),
                max_lora: l.max_lora,
                block_size: l.block_size,
                num_gpu_blocks: l.num_gpu_blocks,
                ..ScrapedMetrics::empty(now)
            },
            None => ScrapedMetrics::empty(stale),
        };
        epp.registry().set_metrics(name, metrics);
    }
}

fn header_values(common: &CommonResponse) -> Vec<(&str, String)> {
    common
        .header_mutation
        .iter()
        .flat_map(|m| &m.set_headers)
        .filter_map(|h| h.header.as_ref())
        .map(|h| {
            let value = if h.raw_value.is_empty() {
                h.value.clone()
            } else {
                String::from_utf8_lossy(&h.raw_value).into_owned()
            };
            (h.key.as_str(), value)
        })
        .collect()
}

fn check_replies(replies: &[ProcessingResponse]) {
    let known = |a: &str| ENDPOINTS.iter().any(|(_, address, ..)| *address == a);
    for (i, reply) in replies.iter().enumerate() {
        let response = reply
            .response
            .as_ref()
            .unwrap_or_else(|| panic!("reply {i} carries no response: {reply:?}"));
        if matches!(
            response,
            Reply::ImmediateResponse(_) | Reply::StreamedImmediateResponse(_)
        ) {
            assert_eq!(i + 1, replies.len(), "replies after an immediate response");
        }
        let common = match response {
            Reply::RequestHeaders(h) | Reply::ResponseHeaders(h) => h.response.as_ref(),
            Reply::RequestBody(b) | Reply::ResponseBody(b) => b.response.as_ref(),
            _ => None,
        };
        if let Some(common) = common {
            let headers = header_values(common);
            let get = |k: &str| headers.iter().find(|(key, _)| *key == k).map(|(_, v)| v);
            if let Some(destination) = get(DESTINATION_ENDPOINT) {
                assert!(
                    known(destination),
                    "routed to an unknown endpoint {destination:?}"
                );
            }
            if let Some(auth) = get("authorization") {
                let provider = get(kinference_api::DESTINATION_HEADER)
                    .and_then(|d| d.strip_prefix("provider/"))
                    .unwrap_or_else(|| panic!("a key set on a request not sent to a provider"));
                let key = PROVIDER_KEYS
                    .iter()
                    .find(|(p, _)| *p == provider)
                    .map(|(_, k)| format!("Bearer {k}"));
                assert_eq!(Some(auth), key.as_ref(), "the wrong key for {provider}");
            }
        }
        let lb = reply
            .dynamic_metadata
            .as_ref()
            .and_then(|m| m.fields.get(LB_NAMESPACE))
            .and_then(|v| match &v.kind {
                Some(Kind::StructValue(s)) => s.fields.get(DESTINATION_ENDPOINT),
                _ => None,
            });
        if let Some(Value {
            kind: Some(Kind::StringValue(list)),
        }) = lb
        {
            for address in list.split(',') {
                assert!(known(address), "an unknown endpoint in envoy.lb: {list:?}");
            }
        }
    }
}

fn check_nothing_in_flight(epp: &Epp) {
    for view in epp.registry().snapshot().iter() {
        assert_eq!(
            view.state.stats.running(),
            0,
            "a request left in flight on {}",
            view.endpoint.name
        );
    }
    let policy = epp.policy().current().expect("a policy is loaded");
    for state in epp.picker.providers().for_policy(&policy.compiled) {
        assert_eq!(
            state.stats.running(),
            0,
            "a request left in flight on a provider"
        );
    }
}

fuzz_target!(|input: Input| {
    let world = world();
    let epp = epp(usize::from(input.policy) % POLICIES.len());
    let mut requests = Vec::new();
    for m in &input.messages {
        render(m, &mut requests);
    }
    let mut inbound: Vec<Result<ProcessingRequest, tonic::Status>> =
        requests.into_iter().map(Ok).collect();
    if input.broken {
        inbound.push(Err(tonic::Status::cancelled("the gateway went away")));
    }
    let config = ExtProcConfig {
        max_body_bytes: if input.small_limit {
            256
        } else {
            ExtProcConfig::default().max_body_bytes
        },
        conformance_hooks: input.conformance_hooks,
        fallbacks: usize::from(input.fallbacks % 5),
        ..ExtProcConfig::default()
    };
    world.runtime.block_on(async {
        set_loads(epp, &input.loads);
        let service = ExtProcService::new(epp.picker.clone(), epp.picker.metrics().clone(), config);
        let mut replies = service.open(futures::stream::iter(inbound));
        let mut out = Vec::new();
        let drained = tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(reply) = replies.next().await {
                out.push(reply.expect("the session only sends replies"));
            }
        })
        .await;
        assert!(drained.is_ok(), "the reply stream did not end within 10 s");
        check_replies(&out);
        check_nothing_in_flight(epp);
    });
});
