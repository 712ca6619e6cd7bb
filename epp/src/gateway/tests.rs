//! Gateway + EPP + simulators on loopback.

use std::net::SocketAddr;
use std::time::Duration;

use kinference_simulator::{SimConfig, SimHandle};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use super::*;
use crate::endpoints::{EndpointSpec, endpoints_from_specs};
use crate::predict::EndpointKey;
use crate::server::{Epp, Settings};

const POLICY: &str = r#"
pool: { selector: { app: sim }, targetPorts: [{ number: 8000 }] }
providers:
  - name: cloud
    baseUrl: http://cloud.invalid/v1
    models:
      - { name: qwen-2.5, targetModel: cloud-large }
rules:
  - name: small
    matches: [{ header.x-test: rewrite }]
    route:
      consider: [{ models: { names: [gemma-4] } }]
      select: [{ minimize: QueueDepth }]
  - name: shed
    matches: [{ header.x-test: reject }]
    route:
      exclude: [{ drop: { type: Local } }]
      select: [{ minimize: QueueDepth }]
      reject: { status: 429, message: "slow down" }
  - name: paid
    matches: [{ header.x-test: provider }]
    route:
      consider: [{ backends: { type: Provider } }]
      select: [{ type: Provider, order: [cloud] }]
  - name: ordered
    matches: [{ header.x-test: fallback }]
    route:
      consider: [{ backends: { type: Local, names: [dead, qwen] } }]
      select: [{ type: Local, order: [dead, qwen] }]
  - name: default
    route:
      select: [{ minimize: PredictedTTFT }]
"#;

struct Harness {
    epp: Epp,
    gateway: GatewayHandle,
    records: mpsc::UnboundedReceiver<RequestRecord>,
    sims: Vec<SimHandle>,
    http: reqwest::Client,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn sim(config: SimConfig) -> SimHandle {
    kinference_simulator::spawn(
        SimConfig {
            time_scale: 0.05,
            ..config
        },
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap()
}

/// A loopback port nothing listens on.
async fn dead_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

async fn harness() -> Harness {
    let qwen = sim(SimConfig::new("qwen", ["qwen-2.5"])).await;
    let gemma = sim(SimConfig::new("gemma", ["gemma-4"])).await;
    let cloud = sim(SimConfig {
        api_key: Some("sk-test".into()),
        ..SimConfig::new("cloud", ["cloud-large"])
    })
    .await;
    let dead = dead_port().await;
    let epp = Epp::new(Settings::default());
    epp.policy().load_text(POLICY).unwrap();
    let spec = |name: &str, addr: String, model: &str| EndpointSpec {
        name: Some(name.into()),
        backend: Some(name.into()),
        ..EndpointSpec::new(addr, &[model])
    };
    epp.registry().replace_all(
        endpoints_from_specs([
            spec("qwen", qwen.addr().to_string(), "qwen-2.5"),
            spec("gemma", gemma.addr().to_string(), "gemma-4"),
            spec("dead", dead.to_string(), "qwen-2.5"),
        ])
        .unwrap(),
    );
    epp.registry().mark_synced();
    epp.picker.provider_keys.store(std::sync::Arc::new(
        [("cloud".to_string(), "sk-test".to_string())].into(),
    ));
    // Runs until the test's runtime ends.
    drop(epp.spawn_scraper());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let epp_addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn({
        let epp = epp.clone();
        async move {
            epp.serve_ext_proc(listener, async move {
                let _ = stopped.await;
            })
            .await
        }
    });
    let (tx, records) = mpsc::unbounded_channel();
    let mut config = GatewayConfig::new(epp_addr);
    config
        .providers
        .insert("cloud".into(), format!("{}/v1", cloud.base_url()));
    config.records = Some(tx);
    let gateway = spawn(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    // Wait for a first scrape of the live servers, so metric-based
    // objectives have values.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < deadline
        && epp
            .registry()
            .snapshot()
            .iter()
            .any(|v| v.endpoint.name != "dead" && v.metrics.is_none())
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Harness {
        epp,
        gateway,
        records,
        sims: vec![qwen, gemma, cloud],
        http: reqwest::Client::builder().no_proxy().build().unwrap(),
        _stop: stop,
    }
}

impl Harness {
    async fn post(&self, test: &str, body: serde_json::Value) -> reqwest::Response {
        self.http
            .post(format!("{}/v1/chat/completions", self.gateway.base_url()))
            .header("x-test", test)
            .header("x-request-id", test)
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    async fn record(&mut self) -> RequestRecord {
        tokio::time::timeout(Duration::from_secs(5), self.records.recv())
            .await
            .expect("a record in time")
            .expect("the gateway is alive")
    }
}

fn chat(model: &str, stream: bool) -> serde_json::Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say hello to the gateway test."}],
        "max_tokens": 4,
        "stream": stream,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_rewrites_rejects_falls_back_and_reports_ttft() {
    let mut h = harness().await;
    let qwen_addr = h.sims[0].addr().to_string();
    let gemma_addr = h.sims[1].addr().to_string();

    // A plain request: routed by the default rule and answered.
    let resp = h.post("plain", chat("qwen-2.5", false)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()[SERVED_BY_HEADER], qwen_addr.as_str());
    assert_eq!(resp.headers()[RULE_HEADER], "default");
    assert!(resp.headers().contains_key("x-sim-ttft-ms"));
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["model"], "qwen-2.5");
    let r = h.record().await;
    assert_eq!(r.rule.as_deref(), Some("default"));
    assert_eq!(r.status, 200);
    assert_eq!(
        r.destination,
        Destination::Local {
            endpoint: qwen_addr.clone(),
            fallback: false
        }
    );
    assert!(r.ttft.is_some() && r.upstream_ttft.is_some());

    // The model rewrite reaches the simulator: it only serves gemma-4 and
    // would answer 404 to qwen-2.5.
    let resp = h.post("rewrite", chat("qwen-2.5", false)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()[SERVED_BY_HEADER], gemma_addr.as_str());
    assert_eq!(resp.headers()[MODEL_HEADER], "gemma-4");
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["model"], "gemma-4");
    assert_eq!(h.sims[1].stats().requests_by_model.get("gemma-4"), Some(&1));
    assert_eq!(h.record().await.rule.as_deref(), Some("small"));

    // A reject comes back with its status and OpenAI-shaped JSON body.
    let resp = h.post("reject", chat("qwen-2.5", false)).await;
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["content-type"], "application/json");
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["message"], "slow down");
    assert_eq!(body["error"]["code"], 429);
    let r = h.record().await;
    assert_eq!((r.status, r.destination), (429, Destination::Immediate));
    assert_eq!(r.message.as_deref(), Some("slow down"));

    // The provider gets the EPP's credentials and model mapping.
    let resp = h.post("provider", chat("qwen-2.5", true)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()[SERVED_BY_HEADER], "provider/cloud");
    let text = resp.text().await.unwrap();
    assert!(text.contains("cloud-large"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let r = h.record().await;
    assert_eq!(r.destination, Destination::Provider("cloud".into()));
    assert_eq!(h.sims[2].stats().requests_served, 1);

    // The first choice refuses connections: the fallback list takes over.
    let resp = h.post("fallback", chat("qwen-2.5", true)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()[SERVED_BY_HEADER], qwen_addr.as_str());
    let text = resp.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let r = h.record().await;
    assert_eq!(
        r.destination,
        Destination::Local {
            endpoint: qwen_addr.clone(),
            fallback: true
        }
    );

    // The EPP learned TTFTs from the gateway's reports.
    let key = EndpointKey::from_addr(&qwen_addr);
    let mut observed = None;
    for _ in 0..50 {
        observed = h
            .epp
            .picker
            .stats
            .observed_ttft(key, std::time::Instant::now());
        if observed.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(observed.is_some(), "the EPP saw no TTFT for {qwen_addr}");

    // Not POST, and bad input answered by the EPP.
    let resp = h
        .http
        .get(format!("{}/v1/models", h.gateway.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 405);
    let resp = h
        .http
        .post(format!("{}/v1/chat/completions", h.gateway.base_url()))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    h.gateway.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_failure_is_a_502_and_streamed_mode_works() {
    let mut h = harness().await;
    // Streamed ext_proc body mode through a second gateway.
    let mut config = h.gateway.gateway.config().clone();
    config.body_mode = crate::client::BodyMode::Streamed(7);
    let streamed = spawn(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let resp = h
        .http
        .post(format!("{}/v1/chat/completions", streamed.base_url()))
        .header("x-test", "rewrite")
        .json(&chat("qwen-2.5", false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["model"], "gemma-4");
    assert_eq!(h.record().await.rule.as_deref(), Some("small"));

    // Kill gemma: the only candidate of `small`; the EPP may still pick it
    // until its metrics go stale, and then the gateway answers 502.
    h.sims[1].kill();
    let resp = h.post("rewrite", chat("qwen-2.5", false)).await;
    let r = h.record().await;
    if r.destination == Destination::None {
        assert_eq!(resp.status(), 502);
        assert_eq!(r.status, 502);
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["code"], 502);
    } else {
        // The EPP already refused it (no endpoint ready).
        assert_eq!(r.destination, Destination::Immediate);
        assert_eq!(resp.status(), 503);
    }
    streamed.shutdown(Duration::from_secs(2)).await;
    h.gateway.shutdown(Duration::from_secs(2)).await;
}
