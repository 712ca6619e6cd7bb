//! The EPP over real gRPC, driven with ext_proc messages as Envoy sends them,
//! against simulated model servers serving real HTTP and Prometheus metrics.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kinference_epp::endpoints::{EndpointSpec, endpoints_from_specs};
use kinference_epp::extproc::ExtProcConfig;
use kinference_epp::predict::TtftFeatures;
use kinference_epp::server::{Epp, Settings};
use kinference_simulator::{SimConfig, SimHandle};
use kinference_testbed::extproc_client::{EppClient, HttpRequest};
use serde_json::json;
use tokio::net::TcpListener;

struct Harness {
    epp: Epp,
    addr: SocketAddr,
    client: EppClient,
    sims: Vec<SimHandle>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

const POOL: &str = "pool: { selector: { app: sim }, targetPorts: [{ number: 8000 }] }\n";

async fn sim(name: &str, models: &[&str]) -> SimHandle {
    let mut config = SimConfig::new(name, models.iter().copied());
    config.time_scale = 0.05;
    kinference_simulator::spawn(config, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

/// Serves ext_proc for `epp` on loopback until `shutdown`; its address.
async fn serve_on_loopback(
    epp: &Epp,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = epp.clone();
    tokio::spawn(async move { server.serve_ext_proc(listener, shutdown).await.unwrap() });
    addr
}

/// Serves ext_proc for `epp`, whose metrics the test sets itself (no
/// scraper runs), and connects a client.
async fn serve_without_scraper(epp: &Epp) -> EppClient {
    let addr = serve_on_loopback(epp, std::future::pending()).await;
    EppClient::connect(addr).await.unwrap()
}

/// An EPP on loopback with `policy` over `sims` (their models as given).
async fn start(policy: &str, sims: Vec<SimHandle>, max_body: usize) -> Harness {
    let epp = Epp::new(Settings {
        ext_proc: ExtProcConfig {
            max_body_bytes: max_body,
            conformance_hooks: true,
            ..ExtProcConfig::default()
        },
        scrape_interval: Duration::from_millis(20),
        ..Settings::default()
    });
    epp.policy()
        .load_text(&format!("{POOL}{policy}"))
        .expect("policy compiles");
    let specs = sims.iter().map(|s| {
        let mut spec = EndpointSpec::new(
            s.addr().to_string(),
            &s.config()
                .models
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        );
        spec.name = Some(s.name().to_string());
        spec.backend = Some("sim".into());
        spec
    });
    epp.registry()
        .replace_all(endpoints_from_specs(specs).unwrap());
    epp.registry().mark_synced();
    epp.spawn_scraper();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let addr = serve_on_loopback(&epp, async {
        let _ = stopped.await;
    })
    .await;
    let client = EppClient::connect(addr).await.unwrap();
    let harness = Harness {
        epp,
        addr,
        client,
        sims,
        _stop: stop,
    };
    harness.wait_for_metrics().await;
    harness
}

/// Checks `done` every 10 ms, at most `tries` times: for what the EPP does
/// beside its reply (recording a route, learning a sample, resizing an
/// index). The caller asserts the outcome.
async fn poll_until(tries: usize, mut done: impl FnMut() -> bool) {
    for _ in 0..tries {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// An EPP whose one rule, `fast`, routes by `route` over `pods`, each
/// serving `qwen`; no scraper: the tests set the metrics, which its 60 s
/// interval keeps fresh for the whole test (staleness: 3 intervals),
/// however slow the machine.
fn epp_over_pods(route: &str, pods: &[&str]) -> Epp {
    let serving: Vec<(&str, &str)> = pods.iter().map(|&pod| (pod, "qwen")).collect();
    epp_over_pods_serving(route, &serving)
}

/// As [`epp_over_pods`], each Pod of `pods` serving the model beside it.
fn epp_over_pods_serving(route: &str, pods: &[(&str, &str)]) -> Epp {
    let epp = Epp::new(Settings {
        scrape_interval: Duration::from_secs(60),
        ..Settings::default()
    });
    epp.policy()
        .load_text(&format!("{POOL}rules:\n  - name: fast\n    {route}\n"))
        .expect("policy compiles");
    let specs = pods
        .iter()
        .map(|(a, model)| EndpointSpec::new(a.to_string(), &[model]));
    epp.registry()
        .replace_all(endpoints_from_specs(specs).unwrap());
    epp.registry().mark_synced();
    epp
}

/// The first destination the EPP names for `request`.
async fn primary_destination(client: &EppClient, request: &HttpRequest) -> String {
    let (outcome, _) = client.decide(request).await.unwrap();
    let destinations = outcome.destination().expect("routed to a Pod");
    destinations.split(',').next().unwrap().to_string()
}

impl Harness {
    /// Decides `request` and answers it from the endpoint picked: the first
    /// byte after `ttft_ms`, then `body`, the whole answer.
    async fn serve(&self, request: &HttpRequest, ttft_ms: f64, body: Vec<u8>) {
        let (outcome, mut stream) = self.client.decide(request).await.unwrap();
        let served = outcome.destination().unwrap().to_string();
        stream
            .response_headers(200, Some(&served), Some(ttft_ms))
            .await
            .unwrap();
        stream.finish_with(body).await.unwrap();
    }

    /// Decides a chat for `qwen` and answers it as a gateway whose
    /// `served` host answered, the first byte after `ttft_ms`.
    async fn answer_from(&self, prompt: &str, served: &str, ttft_ms: f64) {
        let request = HttpRequest::post("/v1/chat/completions", chat("qwen", prompt));
        let (_, mut stream) = self.client.decide(&request).await.unwrap();
        stream
            .response_headers(200, Some(served), Some(ttft_ms))
            .await
            .unwrap();
        stream.finish().await.unwrap();
    }

    async fn wait_for_metrics(&self) {
        assert!(
            self.epp
                .registry()
                .wait_until_scraped(Duration::from_secs(2))
                .await,
            "endpoints never got metrics"
        );
    }

    /// A raw ext_proc stream fed from `rx`, for tests that need every reply.
    async fn raw_stream(
        &self,
        rx: tokio::sync::mpsc::Receiver<
            envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest,
        >,
    ) -> tonic::Streaming<envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse> {
        use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
        let mut raw = ExternalProcessorClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
            .max_decoding_message_size(1 << 24);
        raw.process(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner()
    }

    fn addr_of(&self, i: usize) -> String {
        self.sims[i].addr().to_string()
    }
}

fn chat(model: &str, prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": model,
        "messages": [{ "role": "user", "content": prompt }],
        "max_tokens": 8
    }))
    .unwrap()
}

const LEAST_QUEUE: &str =
    "rules:\n  - name: local\n    route: { select: [{ minimize: QueueDepth }] }\n";

#[tokio::test]
async fn local_pick_sets_header_and_lb_metadata() {
    let h = start(
        LEAST_QUEUE,
        vec![sim("a", &["qwen"]).await, sim("b", &["qwen"]).await],
        1 << 20,
    )
    .await;
    let (outcome, _) = h
        .client
        .decide(&HttpRequest::post(
            "/v1/chat/completions",
            chat("qwen", "hello"),
        ))
        .await
        .unwrap();
    // The header holds the one selected endpoint; the metadata the ordered
    // list, that endpoint first, then the fallback.
    let dest = outcome.destination().expect("a destination").to_string();
    assert!([h.addr_of(0), h.addr_of(1)].contains(&dest), "{dest}");
    let other = if dest == h.addr_of(0) {
        h.addr_of(1)
    } else {
        h.addr_of(0)
    };
    assert_eq!(
        outcome.lb_metadata.get("x-gateway-destination-endpoint"),
        Some(&format!("{dest},{other}"))
    );
    assert_eq!(
        outcome
            .set_headers
            .get("x-kinference-rule")
            .map(String::as_str),
        Some("local")
    );
    assert!(outcome.clear_route_cache);
    assert!(
        outcome.body.is_none(),
        "no rewrite when the model is unchanged"
    );
    assert!(
        outcome
            .removed_headers
            .contains(&"x-kinference-destination".to_string())
    );
}

#[tokio::test]
async fn streamed_mode_holds_headers_and_returns_the_body_in_chunks() {
    let h = start(LEAST_QUEUE, vec![sim("a", &["qwen"]).await], 1 << 22).await;
    let prompt = "x".repeat(200_000);
    let body = chat("qwen", &prompt);
    let request = HttpRequest::post("/v1/chat/completions", body.clone()).streamed(16_384);
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    for m in request.messages() {
        tx.send(m).await.unwrap();
    }
    let mut inbound = h.raw_stream(rx).await;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as R;
    let first = inbound.message().await.unwrap().unwrap();
    // The first answer is the held headers response, carrying the destination.
    let Some(R::RequestHeaders(headers)) = &first.response else {
        panic!("expected headers first, got {first:?}")
    };
    assert!(headers.response.as_ref().unwrap().clear_route_cache);
    let mut replies = vec![first];
    let mut reassembled = Vec::new();
    loop {
        let reply = inbound.message().await.unwrap().unwrap();
        let Some(R::RequestBody(b)) = &reply.response else {
            panic!("expected body chunks, got {reply:?}")
        };
        let Some(envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation::StreamedResponse(chunk)) =
            b.response.as_ref().unwrap().body_mutation.as_ref().unwrap().mutation.as_ref()
        else {
            panic!("expected a streamed body mutation")
        };
        assert!(
            chunk.body.len() <= 62_000,
            "chunk of {} bytes",
            chunk.body.len()
        );
        reassembled.extend_from_slice(&chunk.body);
        let end = chunk.end_of_stream;
        replies.push(reply.clone());
        if end {
            break;
        }
    }
    assert_eq!(reassembled, body);
    let outcome = kinference_testbed::extproc_client::Outcome::from_replies(&replies);
    assert_eq!(outcome.destination(), Some(h.addr_of(0).as_str()));
    drop(tx);
}

#[tokio::test]
async fn model_rewrite_fixes_body_and_content_length() {
    let policy = "rules:\n  - name: small\n    route:\n      consider: [{ models: { names: [gemma] } }]\n      select: [{ minimize: QueueDepth }]\n";
    let h = start(
        policy,
        vec![sim("big", &["qwen"]).await, sim("small", &["gemma"]).await],
        1 << 20,
    )
    .await;
    for request in [
        HttpRequest::post("/v1/chat/completions", chat("qwen", "hi")),
        HttpRequest::post("/v1/chat/completions", chat("qwen", "hi")).streamed(7),
    ] {
        let (outcome, _) = h.client.decide(&request).await.unwrap();
        assert_eq!(outcome.destination(), Some(h.addr_of(1).as_str()));
        let body = outcome.body.expect("a rewritten body");
        let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(parsed["model"], "gemma");
        assert_eq!(parsed["messages"][0]["content"], "hi");
        assert_eq!(
            outcome.set_headers.get("content-length"),
            Some(&body.len().to_string())
        );
        assert_eq!(
            outcome
                .set_headers
                .get("x-kinference-model")
                .map(String::as_str),
            Some("gemma")
        );
    }
}

#[tokio::test]
async fn provider_pick_routes_by_header_with_credentials_and_mapped_model() {
    let policy = "providers:\n  - name: openai\n    baseURL: https://api.openai.test/v1\n    secretRef: { name: k }\n    models: [{ name: qwen, targetModel: gpt-4o-mini }]\nrules:\n  - name: overflow\n    route:\n      consider: [{ backends: { type: Provider } }]\n      select: [{ order: [openai] }]\n";
    let h = start(policy, vec![sim("a", &["qwen"]).await], 1 << 20).await;
    h.epp.picker.provider_keys().store(Arc::new(
        [("openai".to_string(), "sk-test".to_string())].into(),
    ));
    let (outcome, _) = h
        .client
        .decide(&HttpRequest::post(
            "/v1/chat/completions",
            chat("qwen", "hi"),
        ))
        .await
        .unwrap();
    assert_eq!(
        outcome
            .set_headers
            .get("x-kinference-destination")
            .map(String::as_str),
        Some("provider/openai")
    );
    assert_eq!(
        outcome.set_headers.get("authorization").map(String::as_str),
        Some("Bearer sk-test")
    );
    assert!(outcome.destination().is_none());
    assert!(
        outcome.clear_route_cache,
        "the route cache must be cleared so the provider rule applies"
    );
    let body: serde_json::Value = serde_json::from_slice(&outcome.body.unwrap()).unwrap();
    assert_eq!(body["model"], "gpt-4o-mini");
}

#[tokio::test]
async fn reject_and_fall_through() {
    let policy = "rules:\n  - name: premium\n    matches: [{ tenant: alice }]\n    route:\n      consider: [{ backends: { type: Local, names: [gold] } }]\n      select: [{ minimize: QueueDepth }]\n      onEmpty: FallThrough\n  - name: shed\n    matches: [{ tenant: alice }]\n    route:\n      exclude: [{ drop: { QueueDepth: { greaterThanOrEqual: 0 } } }]\n      select: [{ minimize: QueueDepth }]\n      reject: { status: 429, message: \"slow down\" }\n  - name: rest\n    route: { select: [{ minimize: QueueDepth }] }\n";
    let h = start(policy, vec![sim("a", &["qwen"]).await], 1 << 20).await;
    let alice = HttpRequest::post("/v1/chat/completions", chat("qwen", "hi"))
        .header("x-kinference-tenant", "alice");
    let (outcome, _) = h.client.decide(&alice).await.unwrap();
    // premium has no `gold` backend: it falls through to shed, which rejects.
    let (status, body) = outcome.immediate.expect("an immediate response");
    assert_eq!(status, 429);
    let error: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(error["error"]["message"], "slow down");
    assert_eq!(error["error"]["type"], "rate_limit_exceeded");
    assert_eq!(
        outcome
            .set_headers
            .get("x-kinference-rule")
            .map(String::as_str),
        Some("shed")
    );
    let (outcome, _) = h
        .client
        .decide(&HttpRequest::post(
            "/v1/chat/completions",
            chat("qwen", "hi"),
        ))
        .await
        .unwrap();
    assert_eq!(
        outcome
            .set_headers
            .get("x-kinference-rule")
            .map(String::as_str),
        Some("rest")
    );
}

#[tokio::test]
async fn bad_input_gets_a_clear_4xx_and_other_streams_keep_working() {
    let h = start(LEAST_QUEUE, vec![sim("a", &["qwen"]).await], 4096).await;
    let cases: Vec<(HttpRequest, u16, &str)> = vec![
        (
            HttpRequest::post("/v1/chat/completions", "model=qwen"),
            400,
            "not valid JSON",
        ),
        (
            HttpRequest::post("/v1/chat/completions", "[1]"),
            400,
            "JSON object",
        ),
        (
            HttpRequest::post("/v1/chat/completions", br#"{"messages":[]}"#.to_vec()),
            400,
            "no model",
        ),
        (
            HttpRequest::post("/v1/chat/completions", chat("qwen", &"y".repeat(5000))),
            413,
            "exceeds 4096 bytes",
        ),
        (
            HttpRequest::post("/v1/chat/completions", chat("qwen", &"y".repeat(5000)))
                .streamed(1000),
            413,
            "exceeds",
        ),
        (
            HttpRequest::post("/admin/delete", chat("qwen", "x")),
            404,
            "no inference API",
        ),
        (
            HttpRequest::post("/v1/chat/completions", Vec::new()),
            400,
            "no body",
        ),
        (
            HttpRequest::post("/v1/chat/completions", chat("unknown-model", "x")),
            503,
            "no eligible endpoint",
        ),
    ];
    for (request, status, text) in cases {
        let (outcome, _) = h.client.decide(&request).await.unwrap();
        let (got, body) = outcome
            .immediate
            .unwrap_or_else(|| panic!("expected {status} for {}", request.path));
        let body = String::from_utf8(body).unwrap();
        assert_eq!(got, status, "{body}");
        assert!(body.contains(text), "{body} should mention {text:?}");
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(json["error"]["message"].is_string());
    }
    // A stream cut after half of its body must not disturb the EPP.
    {
        let request =
            HttpRequest::post("/v1/chat/completions", chat("qwen", "partial")).streamed(10);
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let messages = request.messages();
        for m in messages.iter().take(messages.len() / 2) {
            tx.send(m.clone()).await.unwrap();
        }
        let stream = h.raw_stream(rx).await;
        drop(tx);
        drop(stream);
    }
    let (outcome, _) = h
        .client
        .decide(&HttpRequest::post(
            "/v1/chat/completions",
            chat("qwen", "after"),
        ))
        .await
        .unwrap();
    assert_eq!(outcome.destination(), Some(h.addr_of(0).as_str()));
}

#[tokio::test]
async fn subset_hint_restricts_endpoints_by_ip_and_port() {
    let h = start(
        LEAST_QUEUE,
        vec![sim("a", &["qwen"]).await, sim("b", &["qwen"]).await],
        1 << 20,
    )
    .await;
    for _ in 0..5 {
        let mut request = HttpRequest::post("/v1/chat/completions", chat("qwen", "hi"));
        request.subset = Some(vec![h.addr_of(1)]);
        let (outcome, _) = h.client.decide(&request).await.unwrap();
        assert_eq!(outcome.destination(), Some(h.addr_of(1).as_str()));
    }
    // Same IP, another port: not eligible. Nothing eligible: 503.
    let mut request = HttpRequest::post("/v1/chat/completions", chat("qwen", "hi"));
    request.subset = Some(vec!["127.0.0.1:1".to_string()]);
    let (outcome, _) = h.client.decide(&request).await.unwrap();
    assert_eq!(outcome.status(), Some(503));
}

#[tokio::test]
async fn dead_and_stale_endpoints_lose_their_metrics_and_leave_minimize_tiers() {
    let h = start(
        LEAST_QUEUE,
        vec![
            sim("a", &["qwen"]).await,
            sim("b", &["qwen"]).await,
            sim("c", &["qwen"]).await,
        ],
        1 << 20,
    )
    .await;
    h.sims[0].kill();
    h.sims[1].set_metrics_available(false);
    // Staleness is 250ms at a 20ms scrape interval.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let snapshot = h.epp.registry().snapshot();
    let stale: Vec<_> = snapshot
        .iter()
        .filter(|v| v.metrics.is_none())
        .map(|v| v.endpoint.name.clone())
        .collect();
    assert_eq!(stale.len(), 2, "{stale:?}");
    for _ in 0..10 {
        let (outcome, _) = h
            .client
            .decide(&HttpRequest::post(
                "/v1/chat/completions",
                chat("qwen", "hi"),
            ))
            .await
            .unwrap();
        assert_eq!(outcome.destination(), Some(h.addr_of(2).as_str()));
    }
}

#[tokio::test]
async fn response_path_calibrates_observed_ttft() {
    // a serves qwen, b only another model: every pick is a, and b can only
    // serve as a fallback.
    let h = start(
        LEAST_QUEUE,
        vec![sim("a", &["qwen"]).await, sim("b", &["other"]).await],
        1 << 20,
    )
    .await;
    let (outcome, mut stream) = h
        .client
        .decide(&HttpRequest::post(
            "/v1/chat/completions",
            chat("qwen", "hi"),
        ))
        .await
        .unwrap();
    let served = outcome.destination().unwrap().to_string();
    let reply = stream
        .response_headers(200, Some(&served), Some(42.0))
        .await
        .unwrap();
    // Conformance hooks are on in this harness: the served endpoint is echoed.
    let headers = match reply.response {
        Some(envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response::ResponseHeaders(r)) => r,
        other => panic!("expected a response-headers reply, got {other:?}"),
    };
    let set = headers
        .response
        .unwrap()
        .header_mutation
        .unwrap()
        .set_headers;
    assert_eq!(
        set[0].header.as_ref().unwrap().key,
        "x-conformance-test-served-endpoint"
    );
    stream.finish().await.unwrap();
    let learnt = |addr: &str| h.epp.registry().state_at(addr).unwrap().stats.clone();
    let observed = learnt(&served)
        .observed_ttft(std::time::Instant::now())
        .unwrap();
    assert!(
        (observed.as_secs_f64() - 0.042).abs() < 0.005,
        "{observed:?}"
    );
    // A fallback served instead of the first choice: its TTFT is its own.
    // (A prompt of a few blocks, for the prefix index.)
    h.answer_from(&"again ".repeat(50), &h.addr_of(1), 900.0)
        .await;
    // The fallback's Pod, never picked, now holds the prompt.
    let fallback = h.epp.registry().state_at(&h.addr_of(1)).unwrap();
    poll_until(100, || !fallback.prefix.is_empty()).await;
    assert!(
        !fallback.prefix.is_empty(),
        "the fallback's prefix index is empty"
    );
    let now = std::time::Instant::now();
    let credited = learnt(&h.addr_of(1)).observed_ttft(now).unwrap();
    assert!((credited.as_secs_f64() - 0.9).abs() < 0.01, "{credited:?}");
    let first = learnt(&served).observed_ttft(now).unwrap();
    assert!(
        first.as_secs_f64() < 0.1,
        "the first choice keeps its own TTFT: {first:?}"
    );
    // A served address that is no Pod of the pool (Envoy names an internal
    // listener so): no fallback, the pick answered.
    let errors_before = learnt(&served).error_rate(now);
    assert!(errors_before > 0.0, "the fallback counts against the pick");
    h.answer_from("a third time", "envoy://connect_originate/", 40.0)
        .await;
    let errors_after = learnt(&served).error_rate(std::time::Instant::now());
    assert!(
        errors_after < errors_before,
        "a success of the pick: {errors_before} → {errors_after}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_hot_swap_under_load_fails_no_request() {
    let h = Arc::new(
        start(
            LEAST_QUEUE,
            vec![sim("a", &["qwen"]).await, sim("b", &["qwen"]).await],
            1 << 20,
        )
        .await,
    );
    let v2 = format!(
        "{POOL}rules:\n  - name: local-v2\n    route: {{ select: [{{ minimize: RunningRequests }}] }}\n"
    );
    let v1 = format!("{POOL}{LEAST_QUEUE}");
    let swapper = {
        let h = h.clone();
        tokio::spawn(async move {
            for i in 0..40 {
                let text = if i % 2 == 0 { &v2 } else { &v1 };
                h.epp.policy().load_text(text).unwrap();
                // An invalid policy in between is refused and changes nothing.
                assert!(
                    h.epp
                        .policy()
                        .load_text("rules: [{ name: broken }]")
                        .is_err()
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            h.epp.policy().load_text(&v2).unwrap();
        })
    };
    let mut workers = Vec::new();
    for w in 0..8 {
        let h = h.clone();
        workers.push(tokio::spawn(async move {
            let mut rules = Vec::new();
            for i in 0..40 {
                let request =
                    HttpRequest::post("/v1/chat/completions", chat("qwen", &format!("w{w} r{i}")));
                let (outcome, _) = h.client.decide(&request).await.expect("the stream works");
                assert!(
                    outcome.immediate.is_none(),
                    "request failed during a swap: {outcome:?}"
                );
                rules.push(outcome.set_headers["x-kinference-rule"].clone());
            }
            rules
        }));
    }
    swapper.await.unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for w in workers {
        seen.extend(w.await.unwrap());
    }
    assert!(
        seen.contains("local") && seen.contains("local-v2"),
        "{seen:?}"
    );
    let (outcome, _) = h
        .client
        .decide(&HttpRequest::post(
            "/v1/chat/completions",
            chat("qwen", "last"),
        ))
        .await
        .unwrap();
    assert_eq!(outcome.set_headers["x-kinference-rule"], "local-v2");
}

/// The prefix index guesses what a Pod holds; the engine says, at the end
/// of its answer. Here the index is sure the prompt is cached (it routed it
/// here before) and every answer says nothing was (the engine evicted it)
/// and took 800 ms. Learnt with the guess, the model would charge a cached
/// prompt 800 ms and keep the prefill cheap.
#[tokio::test]
async fn the_ttft_model_learns_what_the_engine_had_cached_not_what_the_index_guessed() {
    let policy = "rules:\n  - name: fast\n    route: { select: [{ minimize: PredictedTTFT }] }\n";
    let h = start(policy, vec![sim("a", &["qwen"]).await], 1 << 22).await;
    let prompt = "The same long system prompt, evicted again. ".repeat(200);
    let evicted = json!({
        "choices": [],
        "usage": { "prompt_tokens": 1500, "prompt_tokens_details": { "cached_tokens": 0 } }
    });
    let request = HttpRequest::post("/v1/chat/completions", chat("qwen", &prompt));
    for _ in 0..40 {
        h.serve(&request, 800.0, serde_json::to_vec(&evicted).unwrap())
            .await;
    }
    let state = h.epp.registry().state_at(&h.addr_of(0)).unwrap();
    let model = &h.epp.picker.ttft();
    assert_eq!(model.observations(&state.ttft), 40, "each answer once");
    let tokens = prompt.len() as f64 / 4.0;
    let cached = TtftFeatures::new(0.0, 0.0, tokens, tokens, 0.0);
    let uncached = TtftFeatures::new(0.0, 0.0, tokens, 0.0, 0.0);
    let (cached, uncached) = (
        model.predict(&state.ttft, &cached),
        model.predict(&state.ttft, &uncached),
    );
    assert!(
        (0.6..1.0).contains(&uncached),
        "the prefill is learnt at its cost: {uncached}"
    );
    assert!(
        cached < 0.2,
        "a cached prompt is not charged for it: {cached}"
    );
}

/// A refusal (4xx) was never prefilled: even with a TTFT reported, it is
/// no sample for the model, nor for the prediction-error histogram; the
/// 2xx answer after it is.
#[tokio::test]
async fn a_refused_request_teaches_no_ttft_and_counts_no_prediction_error() {
    let policy = "rules:\n  - name: fast\n    route: { select: [{ minimize: PredictedTTFT }] }\n";
    let h = start(policy, vec![sim("a", &["qwen"]).await], 1 << 20).await;
    let request = HttpRequest::post("/v1/chat/completions", chat("qwen", "hi"));
    let errors = |h: &Harness| {
        let metrics = h.epp.picker.metrics().render(h.epp.registry(), None);
        ["over", "under"]
            .map(|d| {
                let prefix = format!(
                    "kinference_epp_ttft_prediction_relative_error_count{{direction=\"{d}\"}} "
                );
                metrics
                    .lines()
                    .find_map(|l| l.strip_prefix(&prefix))
                    .map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
            })
            .iter()
            .sum::<f64>()
    };
    for (status, count) in [(400, 0.0), (404, 0.0), (200, 1.0)] {
        let (_, mut stream) = h.client.decide(&request).await.unwrap();
        stream
            .response_headers(status, Some(&h.addr_of(0)), Some(30.0))
            .await
            .unwrap();
        stream.finish().await.unwrap();
        let state = h.epp.registry().state_at(&h.addr_of(0)).unwrap();
        poll_until(100, || errors(&h) >= count).await;
        assert_eq!(errors(&h), count, "after a {status}");
        let observed = state.stats.observed_ttft(std::time::Instant::now());
        assert_eq!(observed.is_some(), count > 0.0, "after a {status}");
    }
}

/// The approximate index remembers prompt text and is sized like the
/// engine's KV cache, which counts the engine's tokens. An engine whose
/// tokenizer makes half as many tokens of a text as the estimate's 4 bytes
/// a token holds twice the text: learnt from the prompt counts its answers
/// report, the index grows to match at the next scrape.
#[tokio::test]
async fn the_prefix_index_holds_as_much_text_as_the_engines_cache() {
    let policy = "rules:\n  - name: fast\n    route: { select: [{ minimize: PredictedTTFT }] }\n";
    let h = start(policy, vec![sim("a", &["qwen"]).await], 1 << 22).await;
    let state = h.epp.registry().state_at(&h.addr_of(0)).unwrap();
    let sized_by_estimate = state.prefix.capacity();
    let prompt = "Some long system prompt, tokenized coarsely. ".repeat(100);
    let estimated = prompt.len().div_ceil(4);
    let answer = serde_json::to_vec(&json!({
        "choices": [],
        "usage": { "prompt_tokens": estimated / 2 }
    }))
    .unwrap();
    let request = HttpRequest::post("/v1/chat/completions", chat("qwen", &prompt));
    for _ in 0..100 {
        h.serve(&request, 40.0, answer.clone()).await;
    }
    let ratio = state.engine_tokens.get();
    assert!((0.49..0.52).contains(&ratio), "learnt ratio {ratio}");
    // A scrape may land while the ratio is still learnt, and a size within
    // a sixteenth of the target is kept (`DestinationState::scraped`): the
    // next scrapes bring it there.
    let doubled = || state.prefix.capacity() as f64 / sized_by_estimate as f64;
    let near_twice = 2.0 / (1.0 + 1.0 / 16.0)..2.0 * (1.0 + 1.0 / 16.0);
    poll_until(300, || near_twice.contains(&doubled())).await;
    let grown = state.prefix.capacity();
    assert!(
        near_twice.contains(&doubled()),
        "{sized_by_estimate} -> {grown}"
    );
}

/// A stream reports the engine's cached count at its end only when asked
/// (`stream_options.include_usage`); one that will not is learnt at its
/// first byte, not seconds later when it ends. A whole answer, and a stream
/// that asked, wait for the count; so do unasked streams to an engine that
/// has been seen to report anyway (vLLM's `--enable-force-include-usage`).
#[tokio::test]
async fn a_stream_that_will_not_report_usage_is_learnt_at_its_first_byte() {
    let policy = "rules:\n  - name: fast\n    route: { select: [{ minimize: PredictedTTFT }] }\n";
    let h = start(policy, vec![sim("a", &["qwen"]).await], 1 << 20).await;
    let state = h.epp.registry().state_at(&h.addr_of(0)).unwrap();
    let learnt = || h.epp.picker.ttft().observations(&state.ttft);
    let usage = serde_json::to_vec(&json!({
        "choices": [],
        "usage": { "prompt_tokens": 9, "prompt_tokens_details": { "cached_tokens": 0 } }
    }))
    .unwrap();
    let body = |stream: serde_json::Value| {
        let mut body = json!({
            "model": "qwen",
            "messages": [{ "role": "user", "content": "hello there" }],
        });
        body.as_object_mut()
            .unwrap()
            .extend(stream.as_object().unwrap().clone());
        HttpRequest::post("/v1/chat/completions", serde_json::to_vec(&body).unwrap())
    };
    let unasked = body(json!({ "stream": true }));
    let asked = body(json!({ "stream": true, "stream_options": { "include_usage": true } }));
    let whole = body(json!({ "stream": false }));
    // Old and new vLLM read a missing include_usage differently: waited for.
    let maybe = body(json!({ "stream": true, "stream_options": {} }));
    // (request, its answer's last chunk, learnt at the first byte)
    let cases = [
        (&unasked, Vec::new(), true),
        (&asked, usage.clone(), false),
        (&whole, usage.clone(), false),
        (&maybe, usage.clone(), false),
        // The engine reports although not asked: learnt at the first byte
        // this once, and from now on its unasked streams wait...
        (&unasked, usage.clone(), true),
        (&unasked, usage.clone(), false),
        // ...until one ends without the count (the engine restarted
        // without the flag): learnt when its stream closes, and the next
        // at its first byte again.
        (&unasked, Vec::new(), false),
        (&unasked, Vec::new(), true),
    ];
    for (i, (request, last_chunk, at_first_byte)) in cases.into_iter().enumerate() {
        let before = learnt();
        let (outcome, mut stream) = h.client.decide(request).await.unwrap();
        let served = outcome.destination().unwrap().to_string();
        stream
            .response_headers(200, Some(&served), Some(40.0))
            .await
            .unwrap();
        let expected = before + u64::from(at_first_byte);
        assert_eq!(learnt(), expected, "case {i}: at the first byte");
        stream.finish_with(last_chunk).await.unwrap();
        // A sample no count came for is learnt when the stream closes,
        // just after the client's last message.
        poll_until(200, || learnt() > before).await;
        assert_eq!(learnt(), before + 1, "case {i}: once the answer ended");
    }
}

#[tokio::test]
async fn prefix_locality_sends_a_shared_prefix_back_to_its_endpoint() {
    let policy =
        "rules:\n  - name: cache\n    route: { select: [{ maximize: CachedPrefixTokens }] }\n";
    let h = start(
        policy,
        vec![sim("a", &["qwen"]).await, sim("b", &["qwen"]).await],
        1 << 22,
    )
    .await;
    let document = "The quarterly report says revenue grew. ".repeat(400);
    // The first request with this document is steered to b (subset hint)...
    let mut first = HttpRequest::post(
        "/v1/chat/completions",
        chat("qwen", &format!("{document}\nQ1: summarize")),
    );
    first.subset = Some(vec![h.addr_of(1)]);
    let (outcome, _) = h.client.decide(&first).await.unwrap();
    assert_eq!(outcome.destination(), Some(h.addr_of(1).as_str()));
    // ...so follow-ups sharing the prefix go to b, where it is cached, while
    // an unrelated prompt takes the first endpoint in rank order (a).
    for i in 0..3 {
        let follow_up = HttpRequest::post(
            "/v1/chat/completions",
            chat("qwen", &format!("{document}\nQ{i}: more detail")),
        );
        let (outcome, _) = h.client.decide(&follow_up).await.unwrap();
        assert_eq!(
            outcome.destination().unwrap().split(',').next(),
            Some(h.addr_of(1).as_str())
        );
    }
    let other = HttpRequest::post(
        "/v1/chat/completions",
        chat("qwen", &"Unrelated question. ".repeat(50)),
    );
    let (outcome, _) = h.client.decide(&other).await.unwrap();
    assert_eq!(
        outcome.destination().unwrap().split(',').next(),
        Some(h.addr_of(0).as_str())
    );
}

/// A burst of requests between two scrapes: every queue reads 0 in the last
/// metrics. Each pick reserves its place on the endpoint until a scrape shows
/// it, so the burst spreads instead of landing on the first endpoint.
#[tokio::test]
async fn a_burst_between_scrapes_spreads_over_the_endpoints() {
    use kinference_epp::endpoints::ScrapedMetrics;
    let addresses = [
        "10.0.0.1:8000",
        "10.0.0.2:8000",
        "10.0.0.3:8000",
        "10.0.0.4:8000",
    ];
    let epp = epp_over_pods("route: { select: [{ minimize: QueueDepth }] }", &addresses);
    // One scrape, all idle; no scraper runs during the burst.
    let before_the_burst = std::time::Instant::now();
    for ep in epp.registry().endpoints() {
        epp.registry()
            .set_metrics(&ep.name, ScrapedMetrics::empty(before_the_burst));
    }
    let client = serve_without_scraper(&epp).await;
    // 40 streams held open: requests in flight at their model servers.
    let mut open = Vec::new();
    let mut landed = std::collections::BTreeMap::<String, usize>::new();
    for i in 0..40 {
        let (outcome, stream) = client
            .decide(&HttpRequest::post(
                "/v1/chat/completions",
                chat("qwen", &format!("request {i}")),
            ))
            .await
            .unwrap();
        *landed
            .entry(outcome.destination().unwrap().to_string())
            .or_default() += 1;
        open.push(stream);
    }
    assert_eq!(landed.len(), 4, "{landed:?}");
    assert!(landed.values().all(|&n| n == 10), "{landed:?}");
    let first = epp.registry().endpoints()[0].name.clone();
    let state = epp.registry().state_at(addresses[0]).unwrap();
    // A scrape sent before the burst, answered only now, cannot show it.
    epp.registry()
        .set_metrics(&first, ScrapedMetrics::empty(before_the_burst));
    assert_eq!(
        state.stats.snapshot(std::time::Instant::now()).unscraped,
        10
    );
    // A scrape sent after the burst shows its load and takes over from the
    // reservations.
    epp.registry().set_metrics(
        &first,
        ScrapedMetrics {
            waiting: 10.0,
            ..ScrapedMetrics::empty(std::time::Instant::now())
        },
    );
    assert_eq!(state.stats.snapshot(std::time::Instant::now()).unscraped, 0);
    assert_eq!(state.stats.running(), 10);
    drop(open);
}

/// A prefix's Pod has a queue its engine reports; another Pod is idle and
/// would have to prefill the prefix. For a prompt one earlier request
/// shared, the queue costs less than the prefill: it stays. For a group that
/// a dozen earlier requests shared, the new replica's prefill is shared by
/// the group's next requests, and the group spreads, once the Pods' models
/// are trained on their answers. Right after, the pool pays for no other
/// replica: a second such group stays. All asked against the same metrics.
#[tokio::test]
async fn a_queued_prefix_spreads_when_many_requests_share_it_one_replica_at_a_time() {
    let (busy, idle) = (BUSY, IDLE);
    let route = "route: { select: [{ minimize: PredictedTTFT }] }";
    let seen = queued_prefix_case(route, None).await;
    assert_eq!(
        seen.untrained_group, busy,
        "no replica is paid for against the prior's guess of a queue"
    );
    assert_eq!(
        seen.lonely, busy,
        "one earlier request does not pay for a replica"
    );
    assert_eq!(
        seen.group, idle,
        "twelve earlier requests share the replica's prefill"
    );
    assert_eq!(seen.other_group, busy, "one replica at a time");
    assert_eq!(seen.seeds, 1);
    // The explain trace shows the replica's prediction and the share of
    // it the group's next requests take off, by name.
    let best = &seen.group_ranking[0];
    assert!(
        best.contains(" = predicted ") && best.contains(" - replicaShare "),
        "{best}"
    );
}

/// The same, under a policy that bounds `PredictedTTFT` (a TTFT SLO): the
/// bound must see each request's own prefill, so nothing is shared.
#[tokio::test]
async fn a_policy_that_bounds_predicted_ttft_prices_each_request_alone() {
    let route = "route:\n      exclude: [{ drop: { PredictedTTFT: { greaterThan: 30s } } }]\n      select: [{ minimize: PredictedTTFT }]";
    let seen = queued_prefix_case(route, None).await;
    assert_eq!(seen.group, BUSY, "the group stays with its prefix");
    assert_eq!(seen.other_group, BUSY);
    assert_eq!(seen.seeds, 0);
}

/// The same group, but the idle Pod's cache is full of two other
/// prompts: the replica's blocks would push them out. Prompts that were
/// sent again will be prefilled again by their next requests, and that
/// costs more than the queue: the group stays. Prompts nobody sent again
/// cost nothing to evict: the group spreads.
#[tokio::test]
async fn a_replica_is_not_seeded_where_it_would_evict_reused_prefixes() {
    let route = "route: { select: [{ minimize: PredictedTTFT }] }";
    let reused = queued_prefix_case(route, Some(IdleCache { sends: 2 })).await;
    assert_eq!(reused.group, BUSY, "the idle Pod's prefixes were reused");
    assert_eq!(reused.seeds, 0);
    let one_off = queued_prefix_case(route, Some(IdleCache { sends: 1 })).await;
    assert_eq!(one_off.group, IDLE, "nobody sent the idle Pod's again");
    assert_eq!(one_off.seeds, 1);
}

/// The idle Pod of [`queued_prefix_case`] with a KV cache of 8,000 tokens
/// (500 blocks of the prefix index), filled by two prompts of 250 and 265
/// blocks each sent `sends` times: the second pushes blocks out, so only
/// those sent again count as reused (until a cache first pushes a block
/// out, every block counts, see `PrefixCache::growth`).
struct IdleCache {
    sends: usize,
}

const BUSY: &str = "10.0.0.1:8000";
const IDLE: &str = "10.0.0.2:8000";

/// Where each request of [`queued_prefix_case`] went.
struct QueuedPrefixCase {
    untrained_group: String,
    lonely: String,
    group: String,
    other_group: String,
    seeds: u64,
    /// The explain trace's ranking of `group`'s decision.
    group_ranking: Vec<String>,
}

/// One rule with `route`, two Pods: [`BUSY`] holds the prefixes and has two
/// requests waiting, [`IDLE`] holds none, or `idle_cache`'s.
async fn queued_prefix_case(route: &str, idle_cache: Option<IdleCache>) -> QueuedPrefixCase {
    use kinference_epp::endpoints::ScrapedMetrics;
    let (busy, idle) = (BUSY, IDLE);
    let epp = epp_over_pods(route, &[busy, idle]);
    let scrape = |waiting_on_busy: f64| {
        for ep in epp.registry().endpoints() {
            let waiting = if ep.address() == busy {
                waiting_on_busy
            } else {
                0.0
            };
            let mut m = ScrapedMetrics {
                waiting,
                ..ScrapedMetrics::empty(std::time::Instant::now())
            };
            if ep.address() == idle && idle_cache.is_some() {
                m.num_gpu_blocks = Some(500);
                m.block_size = Some(16);
            }
            epp.registry().set_metrics(&ep.name, m);
        }
    };
    scrape(0.0);
    let client = serve_without_scraper(&epp).await;
    let request = |system: &str, question: usize, only: Option<&str>| {
        let body = json!({
            "model": "qwen",
            "messages": [
                { "role": "system", "content": system },
                { "role": "user", "content": format!("Question {question}?") }
            ]
        });
        let mut request =
            HttpRequest::post("/v1/chat/completions", serde_json::to_vec(&body).unwrap());
        request.subset = only.map(|a| vec![a.to_string()]);
        request
    };
    let ask = |system: String, question: usize, only: Option<&str>| {
        let request = request(&system, question, only);
        let client = &client;
        async move { primary_destination(client, &request).await }
    };
    let lonely = "A system prompt one user sent. ".repeat(775);
    let team = "A system prompt the whole team sends. ".repeat(632);
    let other_team = "Another team's system prompt, as hot. ".repeat(632);
    assert_eq!(ask(lonely.clone(), 0, Some(busy)).await, busy);
    for question in 0..12 {
        assert_eq!(ask(team.clone(), question, Some(busy)).await, busy);
        assert_eq!(ask(other_team.clone(), question, Some(busy)).await, busy);
    }
    // Two requests wait on the busy Pod: about 0.5 s by the model, against
    // 1.2 s to prefill a 6,000-token system prompt elsewhere. A scrape also
    // ends the routes' reservations.
    scrape(2.0);
    let untrained_group = ask(team.clone(), 12, None).await;
    // Each Pod's model learns from its own answers (short prompts in 20 ms,
    // as the prior has it, on idle engines).
    scrape(0.0);
    train_on_short_answers(&client, &[busy, idle]).await;
    if let Some(cache) = &idle_cache {
        for filler in ["One old prompt. ", "Another old one. "] {
            for _ in 0..cache.sends {
                let system = filler.repeat(1_000);
                assert_eq!(ask(system, 0, Some(idle)).await, idle);
            }
        }
        // The index records a route beside its reply.
        let state = epp.registry().state_at(idle).unwrap();
        poll_until(100, || state.prefix.len() == 500).await;
        assert_eq!(state.prefix.len(), 500, "the idle Pod's cache is full");
        // The last filler's second route refreshes blocks already there,
        // so the length cannot show it: let its recording run.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    scrape(2.0);
    let lonely = ask(lonely, 1, None).await;
    scrape(2.0);
    let group = ask(team, 13, None).await;
    let explained = epp.picker.recent().explain(1);
    let ranking = &explained[0]["trace"]["rules"][0]["tiers"][0]["ranking"];
    let group_ranking = ranking.as_array().into_iter().flatten();
    let group_ranking = group_ranking.map(|entry| entry.to_string()).collect();
    scrape(2.0);
    let other_group = ask(other_team, 12, None).await;
    let seeds = replica_seeds(&epp);
    QueuedPrefixCase {
        untrained_group,
        lonely,
        group,
        other_group,
        seeds,
        group_ranking,
    }
}

const TWO_GROUPS: &str = "10.0.0.1:8000";
const ONE_GROUP: &str = "10.0.0.2:8000";

/// A group cached nowhere goes where its prompts fit beside those that
/// requests may come back for. Both Pods' caches hold 500 blocks of the
/// prefix index and have pushed nothing out yet, so every block they hold
/// counts (at cold start, no group has had the time to come back). One
/// holds two groups of about 225 blocks, the other one such group and more
/// requests running. A third group beside the two would not fit by about
/// 180 blocks, which its and their next requests would prefill again for
/// as long as it stays: it goes to the other Pod, though that one is
/// busier. Nothing reused would be pushed out now, so only the forecast
/// sees this. The forecast weighs at most one queued request, so two
/// requests waiting there outweigh it, and a Pod with more requests than
/// one above its model's Pods' mean has no room either: its traffic would
/// queue the new group's. Under a TTFT SLO, which must see the request's
/// own TTFT, the load decides.
#[tokio::test]
async fn a_new_group_goes_where_its_working_set_fits() {
    let priced = "route: { select: [{ minimize: PredictedTTFT }] }";
    let busier = Load {
        running: 2.0,
        waiting: 0.0,
    };
    assert_eq!(new_group_case(priced, busier).await, ONE_GROUP);
    let queued = Load {
        running: 2.0,
        waiting: 2.0,
    };
    assert_eq!(new_group_case(priced, queued).await, TWO_GROUPS);
    assert_eq!(new_group_case(priced, THREE_RUNNING).await, TWO_GROUPS);
    let slo = "route:\n      exclude: [{ drop: { PredictedTTFT: { greaterThan: 30s } } }]\n      select: [{ minimize: PredictedTTFT }]";
    assert_eq!(new_group_case(slo, busier).await, TWO_GROUPS);
}

/// Requests running and waiting in a Pod's engine, as scraped.
#[derive(Clone, Copy, Default)]
struct Load {
    running: f64,
    waiting: f64,
}

/// More than one request above the mean of two Pods, the other idle.
const THREE_RUNNING: Load = Load {
    running: 3.0,
    waiting: 0.0,
};

const LLAMA_POD: &str = "10.0.0.3:8000";

/// A prompt that only a Pod of another model holds (a system prompt two
/// models share) is cached nowhere for this model's Pods: a busy one has
/// no room for the new group, as in
/// [`a_new_group_goes_where_its_working_set_fits`]. Read across models, the
/// prompt looked cached somewhere, and the busy Pod with room took it.
#[tokio::test]
async fn a_prompt_another_models_pod_holds_is_cached_nowhere_for_this_one() {
    let priced = "route: { select: [{ minimize: PredictedTTFT }] }";
    let epp = epp_over_pods_serving(
        priced,
        &[
            (TWO_GROUPS, "qwen"),
            (ONE_GROUP, "qwen"),
            (LLAMA_POD, "llama"),
        ],
    );
    let shared = model_group_request("llama", "Fourth group.", 225, 0, None);
    let to = placed_groups_case(&epp, THREE_RUNNING, Some((shared, LLAMA_POD))).await;
    assert_eq!(to, TWO_GROUPS);
}

/// Where [`a_new_group_goes_where_its_working_set_fits`]'s fourth group
/// goes under `route` with `load` on [`ONE_GROUP`].
async fn new_group_case(route: &str, load: Load) -> String {
    let epp = epp_over_pods(route, &[TWO_GROUPS, ONE_GROUP]);
    placed_groups_case(&epp, load, None).await
}

/// Where the fourth group goes when [`TWO_GROUPS`] holds two groups and
/// [`ONE_GROUP`] one and runs `load`, every other Pod idle. `before`, if
/// given, is a request of 225 blocks sent first, where the EPP picks, and
/// the Pod it must go to.
async fn placed_groups_case(epp: &Epp, load: Load, before: Option<(HttpRequest, &str)>) -> String {
    let loaded = |pod: &str| {
        if pod == ONE_GROUP {
            load
        } else {
            Load::default()
        }
    };
    scrape_full_caches(epp, |_| Load::default());
    let client = serve_without_scraper(epp).await;
    let ask = |group: &str, only: Option<&str>| {
        let request = group_request(group, 225, 0, only);
        let client = &client;
        async move { primary_destination(client, &request).await }
    };
    let placed = [
        (TWO_GROUPS, "First group."),
        (ONE_GROUP, "Second group."),
        (TWO_GROUPS, "Third group."),
    ];
    for (pod, group) in placed {
        assert_eq!(ask(group, Some(pod)).await, pod);
    }
    let mut holds = vec![(TWO_GROUPS, 450), (ONE_GROUP, 225)];
    if let Some((request, pod)) = before {
        assert_eq!(primary_destination(&client, &request).await, pod);
        holds.push((pod, 225));
    }
    // The index records a route beside its reply.
    for (pod, blocks) in holds {
        let state = epp.registry().state_at(pod).unwrap();
        poll_until(100, || state.prefix.len() >= blocks).await;
        assert!(state.prefix.len() >= blocks, "{pod} holds its groups");
    }
    scrape_full_caches(epp, loaded);
    ask("Fourth group.", None).await
}

/// Sets every Pod's metrics: the load `load_of` its address, and a KV
/// cache of 8,000 tokens (500 blocks of the prefix index).
fn scrape_full_caches(epp: &Epp, load_of: impl Fn(&str) -> Load) {
    use kinference_epp::endpoints::ScrapedMetrics;
    for ep in epp.registry().endpoints() {
        let load = load_of(&ep.address());
        let m = ScrapedMetrics {
            running: load.running,
            waiting: load.waiting,
            num_gpu_blocks: Some(500),
            block_size: Some(16),
            ..ScrapedMetrics::empty(std::time::Instant::now())
        };
        epp.registry().set_metrics(&ep.name, m);
    }
}

/// A chat request whose system prompt is `group`'s, `blocks` blocks of the
/// prefix index long, with question number `question`: restricted to `only`
/// where given.
fn group_request(group: &str, blocks: usize, question: usize, only: Option<&str>) -> HttpRequest {
    model_group_request("qwen", group, blocks, question, only)
}

/// [`group_request`] for `model`.
fn model_group_request(
    model: &str,
    group: &str,
    blocks: usize,
    question: usize,
    only: Option<&str>,
) -> HttpRequest {
    let body = json!({
        "model": model,
        "messages": [
            { "role": "system", "content": format!("{group:<64}").repeat(blocks) },
            { "role": "user", "content": format!("Question {question}?") }
        ]
    });
    let mut request = HttpRequest::post("/v1/chat/completions", serde_json::to_vec(&body).unwrap());
    request.subset = only.map(|a| vec![a.to_string()]);
    request
}

const HOT: &str = "10.0.0.1:8000";
const BESIDE_TWO: &str = "10.0.0.2:8000";
const BESIDE_ONE: &str = "10.0.0.3:8000";

/// The hot group's Pod when it is busy: two requests waiting.
const TWO_WAITING: Load = Load {
    running: 0.0,
    waiting: 2.0,
};

/// A hot group's Pod has requests waiting, and a dozen earlier requests
/// shared its prompt: it spreads (as in
/// [`a_queued_prefix_spreads_when_many_requests_share_it_one_replica_at_a_time`]).
/// Two Pods with none waiting could hold the replica, as cold as a pool's
/// start: each group there was sent once, so no block counts as reused
/// and the replica would evict nothing reused now on either. One holds two
/// other groups, the other one. Nothing was ever pushed out of their
/// caches, so every block they hold counts as the working set: beside the
/// two, the hot group would not fit by 100 blocks, and it and they would
/// be prefilled again for as long as it stays. The replica goes beside
/// the one, though that Pod runs a request and the other none.
#[tokio::test]
async fn a_hot_groups_replica_goes_where_its_working_set_fits() {
    let route = "route: { select: [{ minimize: PredictedTTFT }] }";
    let epp = epp_over_pods(route, &[HOT, BESIDE_TWO, BESIDE_ONE]);
    scrape_full_caches(&epp, |_| Load::default());
    let client = serve_without_scraper(&epp).await;
    let ask = |group: &str, question: usize, only: Option<&str>| {
        let request = group_request(group, 200, question, only);
        let client = &client;
        async move { primary_destination(client, &request).await }
    };
    // Each Pod's model learns from its own answers, so that the replica
    // pays for a queue its engine reports.
    train_on_short_answers(&client, &[HOT, BESIDE_TWO, BESIDE_ONE]).await;
    for question in 0..12 {
        assert_eq!(ask("The hot group.", question, Some(HOT)).await, HOT);
    }
    let placed = [
        (BESIDE_TWO, "A second group."),
        (BESIDE_ONE, "A third group."),
        (BESIDE_TWO, "A fourth group."),
    ];
    for (pod, group) in placed {
        assert_eq!(ask(group, 0, Some(pod)).await, pod);
    }
    // The index records a route beside its reply.
    for (pod, blocks) in [(HOT, 200), (BESIDE_TWO, 400), (BESIDE_ONE, 200)] {
        let state = epp.registry().state_at(pod).unwrap();
        poll_until(100, || state.prefix.len() >= blocks).await;
        assert!(state.prefix.len() >= blocks, "{pod} holds its groups");
    }
    let one_running = Load {
        running: 1.0,
        waiting: 0.0,
    };
    scrape_full_caches(&epp, |pod| match pod {
        HOT => TWO_WAITING,
        BESIDE_ONE => one_running,
        _ => Load::default(),
    });
    assert_eq!(ask("The hot group.", 12, None).await, BESIDE_ONE);
    assert_eq!(replica_seeds(&epp), 1, "the group spread as a replica");
}

/// A group's own Pod lacks only each request's question. With two
/// requests waiting, more than one above the Pods' mean, it is busy, but
/// the load it carries is the group's own, not one the prompt would join:
/// the group stays while its queue costs less than a prefill elsewhere
/// (two queued requests by the untrained model, against the prefill of
/// 200 blocks).
#[tokio::test]
async fn a_busy_pod_keeps_its_own_groups_requests() {
    let route = "route: { select: [{ minimize: PredictedTTFT }] }";
    let epp = epp_over_pods(route, &[HOT, BESIDE_TWO, BESIDE_ONE]);
    scrape_full_caches(&epp, |_| Load::default());
    let client = serve_without_scraper(&epp).await;
    for question in 0..12 {
        let request = group_request("The hot group.", 200, question, Some(HOT));
        assert_eq!(primary_destination(&client, &request).await, HOT);
    }
    // The index records a route beside its reply.
    let state = epp.registry().state_at(HOT).unwrap();
    poll_until(100, || state.prefix.len() >= 200).await;
    scrape_full_caches(&epp, |pod| {
        if pod == HOT {
            TWO_WAITING
        } else {
            Load::default()
        }
    });
    let request = group_request("The hot group.", 200, 12, None);
    assert_eq!(primary_destination(&client, &request).await, HOT);
}

const CARRIER: &str = "10.0.0.2:8000";
const CROWDED: &str = "10.0.0.3:8000";

/// A queued group's replica does not go to the Pod carrying another hot
/// group, though that Pod, serving its group from its cache, runs nothing
/// and has room for the replica: it goes beside two groups, where it does
/// not fit. Without the routes' share, the Pod with room took it.
#[tokio::test]
async fn a_replica_does_not_go_beside_another_hot_group() {
    let next = group_request("The queued group.", 200, 12, None);
    let (to, epp) = beside_a_hot_group(next, Load::default()).await;
    assert_eq!(to, CROWDED);
    assert_eq!(replica_seeds(&epp), 1, "the group spread as a replica");
}

/// Nor does a new group's first request (cached nowhere): it goes where
/// its neighbours' traffic is not a hot group's.
#[tokio::test]
async fn a_new_group_does_not_go_beside_a_hot_group() {
    let next = group_request("A new group.", 200, 0, None);
    let (to, epp) = beside_a_hot_group(next, Load::default()).await;
    assert_eq!(to, CROWDED);
    assert_eq!(replica_seeds(&epp), 0);
}

/// Nor does a group whose own Pod is busy (at a pool's start, with the
/// other groups' first prefills) leave for it: it leaves for the Pod with
/// a shorter queue, two requests waiting, that carries no hot group.
#[tokio::test]
async fn a_group_leaving_its_busy_pod_does_not_go_beside_a_hot_group() {
    let next = group_request("A third group.", 200, 1, None);
    let busy = Load {
        running: 4.0,
        waiting: 8.0,
    };
    let (to, _) = beside_a_hot_group(next, busy).await;
    assert_eq!(to, HOT);
}

/// Where `next` goes, in caches of 500 blocks, when [`HOT`] holds a group
/// of 200 blocks that 12 requests shared and has two requests waiting,
/// [`CARRIER`] holds another group of 200 that took 150 requests, most of
/// the pool's, and runs none (its answers came from its cache), and
/// [`CROWDED`] holds two groups of 200, sent once each, and runs `crowded`.
async fn beside_a_hot_group(next: HttpRequest, crowded: Load) -> (String, Epp) {
    let route = "route: { select: [{ minimize: PredictedTTFT }] }";
    let pods = [HOT, CARRIER, CROWDED];
    let epp = epp_over_pods(route, &pods);
    scrape_full_caches(&epp, |_| Load::default());
    let client = serve_without_scraper(&epp).await;
    let ask = |group: &str, question: usize, only: &'static str| {
        let request = group_request(group, 200, question, Some(only));
        let client = &client;
        async move { assert_eq!(primary_destination(client, &request).await, only) }
    };
    // Each Pod's model learns from its own answers, so that the replica
    // pays for a queue its engine reports.
    train_on_short_answers(&client, &pods).await;
    for question in 0..12 {
        ask("The queued group.", question, HOT).await;
    }
    for question in 0..150 {
        ask("Another hot group.", question, CARRIER).await;
    }
    ask("A third group.", 0, CROWDED).await;
    ask("A fourth group.", 0, CROWDED).await;
    // The index records a route beside its reply.
    for (pod, blocks) in [(HOT, 200), (CARRIER, 200), (CROWDED, 400)] {
        let state = epp.registry().state_at(pod).unwrap();
        poll_until(100, || state.prefix.len() >= blocks).await;
        assert!(state.prefix.len() >= blocks, "{pod} holds its groups");
    }
    scrape_full_caches(&epp, |pod| match pod {
        HOT => TWO_WAITING,
        CROWDED => crowded,
        _ => Load::default(),
    });
    (primary_destination(&client, &next).await, epp)
}

/// Trains each of `pods`' models on 20 answers of its own: short prompts
/// answered in 20 ms, as the prior has it for idle engines.
async fn train_on_short_answers(client: &EppClient, pods: &[&str]) {
    for &pod in pods {
        for i in 0..20 {
            // No system prompt, only the question.
            let request = group_request("", 0, i, Some(pod));
            let (outcome, mut stream) = client.decide(&request).await.unwrap();
            assert_eq!(outcome.destination(), Some(pod));
            stream
                .response_headers(200, Some(pod), Some(20.0))
                .await
                .unwrap();
            stream.finish().await.unwrap();
        }
    }
}

/// Replicas the EPP has seeded, from its metrics.
fn replica_seeds(epp: &Epp) -> u64 {
    let metrics = epp.picker.metrics().render(epp.registry(), None);
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("kinference_epp_replica_seeds_total "))
        .expect("the seeds are counted")
        .parse()
        .unwrap()
}

/// `sessionAffinity` over gRPC: a session (a cookie here) stays on its Pod
/// though another is idler, until the rule's exclude drops its Pod; it then
/// moves, and stays on the new one.
#[tokio::test]
async fn a_session_stays_on_its_pod_until_the_rule_excludes_it() {
    use kinference_epp::endpoints::ScrapedMetrics;
    let addresses = ["10.0.0.1:8000", "10.0.0.2:8000"];
    let epp = epp_over_pods("route: { select: [{ minimize: QueueDepth }] }", &addresses);
    epp.policy()
        .load_text(&format!(
            "{POOL}sessionAffinity: {{ cookie: sid, ttl: 10m }}
rules:
  - name: sticky
    route:
      exclude: [{{ drop: {{ QueueDepth: {{ greaterThan: 8 }} }} }}]
      select: [{{ minimize: QueueDepth }}]
"
        ))
        .unwrap();
    let set = |waiting: [f64; 2]| {
        for (ep, waiting) in epp.registry().endpoints().iter().zip(waiting) {
            let scraped = ScrapedMetrics {
                waiting,
                ..ScrapedMetrics::empty(std::time::Instant::now())
            };
            epp.registry().set_metrics(&ep.name, scraped);
        }
    };
    let client = serve_without_scraper(&epp).await;
    let ask = |sid: &str| {
        HttpRequest::post("/v1/chat/completions", chat("qwen", "hi"))
            .header("cookie", &format!("theme=dark; sid={sid}"))
    };
    set([0.0, 2.0]);
    assert_eq!(primary_destination(&client, &ask("s1")).await, addresses[0]);
    set([5.0, 0.0]);
    assert_eq!(
        primary_destination(&client, &ask("s1")).await,
        addresses[0],
        "kept on its Pod"
    );
    assert_eq!(primary_destination(&client, &ask("s2")).await, addresses[1]);
    set([9.0, 0.0]);
    assert_eq!(
        primary_destination(&client, &ask("s1")).await,
        addresses[1],
        "its Pod excluded: moved"
    );
    set([0.0, 3.0]);
    assert_eq!(
        primary_destination(&client, &ask("s1")).await,
        addresses[1],
        "kept on the new Pod"
    );
    let plain = HttpRequest::post("/v1/chat/completions", chat("qwen", "hi"));
    assert_eq!(primary_destination(&client, &plain).await, addresses[0]);
}

/// LoRA affinity with the built-in default policy: a request naming an
/// adapter goes to a Pod that has it loaded, never to one that would have
/// to evict an adapter in use (`max_lora` reached), and to a Pod with a
/// free slot when the loaded one's KV cache is full; a base-model request
/// is routed as usual.
#[tokio::test]
async fn a_lora_request_goes_where_its_adapter_is_loaded_and_evicts_none_in_use() {
    use kinference_epp::endpoints::ScrapedMetrics;
    let addresses = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];
    let epp = Epp::new(Settings {
        scrape_interval: Duration::from_secs(60),
        ..Settings::default()
    });
    epp.policy()
        .load_text(kinference_epp::policy_store::DEFAULT_POLICY)
        .unwrap();
    let specs = addresses
        .iter()
        .map(|a| EndpointSpec::new(a.to_string(), &["qwen", "sql-lora"]));
    epp.registry()
        .replace_all(endpoints_from_specs(specs).unwrap());
    epp.registry().mark_synced();
    let set = |kv_of_the_loaded: f64| {
        let loras = |running: &[&str]| running.iter().map(|a| a.to_string()).collect();
        let pods = [
            (3.0, kv_of_the_loaded, loras(&["sql-lora"])),
            (0.0, 0.1, loras(&["tweet-lora", "news-lora"])),
            (1.0, 0.1, loras(&[])),
        ];
        for (ep, (waiting, kv, running)) in epp.registry().endpoints().iter().zip(pods) {
            let scraped = ScrapedMetrics {
                waiting,
                kv_cache_usage: kv,
                running_loras: running,
                max_lora: Some(2),
                ..ScrapedMetrics::empty(std::time::Instant::now())
            };
            epp.registry().set_metrics(&ep.name, scraped);
        }
    };
    let client = serve_without_scraper(&epp).await;
    let ask = |model: &str| HttpRequest::post("/v1/chat/completions", chat(model, "hi"));
    set(0.2);
    let (outcome, _) = client.decide(&ask("sql-lora")).await.unwrap();
    assert_eq!(outcome.set_headers["x-kinference-rule"], "adapter");
    assert_eq!(
        outcome.destination().unwrap().split(',').next(),
        Some(addresses[0])
    );
    // The loaded Pod's KV cache full: the Pod with a free slot, never the
    // one whose two slots are in use by other adapters.
    set(0.97);
    assert_eq!(
        primary_destination(&client, &ask("sql-lora")).await,
        addresses[2]
    );
    // The base model: the shortest predicted TTFT, adapters aside.
    set(0.2);
    let (outcome, _) = client.decide(&ask("qwen")).await.unwrap();
    assert_eq!(outcome.set_headers["x-kinference-rule"], "default");
    assert_eq!(
        outcome.destination().unwrap().split(',').next(),
        Some(addresses[1])
    );
}
