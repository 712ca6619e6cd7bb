//! Flow control through real Envoy, in front of llm-d-inference-sim: a
//! policy lets each Pod take two requests from this EPP (`InFlight`), and
//! a request that finds both Pods full waits in the EPP (`onEmpty: Wait`)
//! by the priority of the InferenceObjective it names. Room goes to the
//! highest priority first, a full queue sheds the lowest with 429, a wait
//! ends at `maxWait` with the rule's reject, and a client that leaves gives
//! its place up.

mod support;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use kinference_epp::endpoints::EndpointSpec;
use kinference_epp::server::{Epp, Settings};
use kinference_testbed::envoy::Envoy;
use kinference_testbed::llmd_sim::{LlmdSim, ensure_llmd_sim};
use serde_json::json;

const MODEL: &str = "base-model";

fn policy(max_wait: &str, max_requests: u32) -> String {
    format!(
        "pool: {{ selector: {{ app: sim }}, targetPorts: [{{ number: 8000 }}] }}
flowControl: {{ maxRequests: {max_requests} }}
rules:
  - name: waits
    route:
      exclude:
        - drop: {{ InFlight: {{ greaterThanOrEqual: 2 }} }}
      select:
        - {{ minimize: InFlight }}
      onEmpty: Wait
      maxWait: {max_wait}
      reject: {{ status: 503, message: \"no Pod had room\" }}
"
    )
}

struct Pool {
    epp: Epp,
    _sims: Vec<LlmdSim>,
    envoy: Envoy,
    http: reqwest::Client,
}

impl Pool {
    async fn start(policy: &str) -> Pool {
        let bin = ensure_llmd_sim().await.expect("llm-d-inference-sim");
        let events: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        // 20 ms a token: an answer of `tokens` tokens holds its place that long.
        let flags = ["--inter-token-latency".to_string(), "20ms".to_string()];
        let mut sims = Vec::new();
        for i in 0..2u8 {
            let ip = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 71 + i));
            let sim = LlmdSim::start_with(&bin, ip, free_port(), MODEL, 16, events, &flags);
            sims.push(sim.await.expect("the simulator starts"));
        }
        let epp = Epp::new(Settings {
            scrape_interval: Duration::from_millis(50),
            secure_serving: true,
            ..Settings::default()
        });
        epp.policy().load_text(policy).expect("the policy compiles");
        epp.picker.objectives().replace(HashMap::from([
            ("chat".to_string(), 10),
            ("batch".to_string(), -1),
        ]));
        let specs = sims
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut spec = EndpointSpec::new(s.addr.to_string(), &[MODEL]);
                spec.name = Some(format!("sim-{i}"));
                spec
            })
            .collect();
        let addrs = sims.iter().map(|s| s.addr).collect();
        let envoy = support::serve_behind_envoy(&epp, specs, addrs).await;
        Pool {
            epp,
            _sims: sims,
            envoy,
            http: reqwest::Client::new(),
        }
    }

    /// Sends a request naming `objective` whose answer takes `tokens`
    /// tokens; returns its status and when its answer ended.
    fn send(
        &self,
        objective: &str,
        tokens: u32,
        id: &str,
    ) -> tokio::task::JoinHandle<(u16, String, Instant)> {
        let request = self
            .http
            .post(self.envoy.url("/v1/chat/completions"))
            .header("x-request-id", id)
            .header("x-gateway-inference-objective", objective)
            .json(&json!({
                "model": MODEL,
                "messages": [{ "role": "user", "content": format!("request {id}") }],
                "max_tokens": tokens,
                "ignore_eos": true
            }));
        tokio::spawn(async move {
            let answer = request.send().await.expect("an answer");
            let status = answer.status().as_u16();
            let body = answer.text().await.unwrap_or_default();
            (status, body, Instant::now())
        })
    }

    async fn waiting(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.epp.picker.flow().waiting() != n {
            assert!(
                Instant::now() < deadline,
                "{} waiting, not {n}",
                self.epp.picker.flow().waiting()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn metrics(&self) -> String {
        self.epp.picker.metrics().render(self.epp.registry(), None)
    }

    /// Waits until `n` requests were decided to a Pod and count in
    /// flight there: a decision is counted when it is made, a request in
    /// flight once it is dispatched, a moment later.
    async fn dispatched(&self, n: usize) {
        self.decided(n).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let in_flight: u64 = self
                .epp
                .registry()
                .snapshot()
                .iter()
                .map(|view| view.state.stats.running())
                .sum();
            if in_flight == n as u64 {
                return;
            }
            assert!(Instant::now() < deadline, "{in_flight} in flight, not {n}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits until `n` requests were decided to a Pod.
    async fn decided(&self, n: usize) {
        let line = format!(r#"kinference_epp_decisions_total{{rule="waits",outcome="local"}} {n}"#);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.metrics().contains(&line) {
            if Instant::now() > deadline {
                let text = self.metrics();
                let seen: Vec<_> = text
                    .lines()
                    .filter(|l| {
                        l.contains("decisions") || l.contains("flow_") || l.contains("rejects")
                    })
                    .collect();
                panic!("never {line}: {seen:#?}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The tests of this file run one at a time: each holds its Pods full
/// with answers the simulators time, and reads what the EPP does
/// meanwhile. Side by side, with the other test's simulators, Envoy and
/// EPP on the same 2 cores, one run in four or five routed a request the
/// test meant to keep waiting; one at a time, none in 15.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn free_port() -> u16 {
    kinference_testbed::free_port().expect("a free port")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn room_goes_to_the_highest_priority_and_a_full_queue_sheds_the_lowest() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let pool = Pool::start(&policy("30s", 4)).await;
    // Both Pods full: four answers of 60 tokens (about 1.2 s).
    let running: Vec<_> = (0..4)
        .map(|i| pool.send("none", 60, &format!("fill-{i}")))
        .collect();
    // Once the four count in flight, the next ones must wait.
    pool.dispatched(4).await;
    let low: Vec<_> = (0..3)
        .map(|i| pool.send("batch", 5, &format!("low-{i}")))
        .collect();
    pool.waiting(3).await;
    let high: Vec<_> = (0..3)
        .map(|i| pool.send("chat", 5, &format!("high-{i}")))
        .collect();
    // Four places: the fourth and later high requests shed two of the low.
    pool.waiting(4).await;
    for fill in running {
        assert_eq!(fill.await.unwrap().0, 200);
    }
    for h in high {
        let (status, body, _) = h.await.unwrap();
        assert_eq!(status, 200, "{body}");
    }
    let mut shed = 0;
    for l in low {
        let (status, body, _) = l.await.unwrap();
        match status {
            200 => {}
            429 => {
                assert!(body.contains("flowControl.maxRequests"), "{body}");
                shed += 1;
            }
            other => panic!("low priority answered {other}: {body}"),
        }
    }
    assert_eq!(shed, 2, "the two newest low-priority requests gave way");
    // The decisions that waited, in the order room came (`/debug/explain`
    // lists the newest first), each with its priority and its wait.
    let explained = pool.epp.picker.recent().explain(16);
    let waits = |outcome: &str| -> Vec<i64> {
        explained
            .iter()
            .rev()
            .filter(|d| d["waited"]["outcome"] == outcome)
            .filter_map(|d| d["waited"]["priority"].as_i64())
            .collect()
    };
    assert_eq!(waits("dispatched"), [10, 10, 10, -1], "{explained:#?}");
    assert_eq!(waits("shed"), [-1, -1], "{explained:#?}");
    for d in &explained {
        if let Some(ms) = d["waited"]["ms"].as_f64() {
            assert!(ms > 0.0 && ms < 30_000.0, "{d}");
        }
    }
    pool.waiting(0).await;
    let text = pool.metrics();
    for line in [
        r#"kinference_epp_flow_shed_total{priority="-1",reason="max_requests"} 2"#,
        r#"kinference_epp_flow_wait_seconds_count{priority="10",outcome="dispatched"} 3"#,
        r#"kinference_epp_flow_wait_seconds_count{priority="-1",outcome="dispatched"} 1"#,
        r#"kinference_epp_flow_wait_seconds_count{priority="-1",outcome="shed"} 2"#,
        r#"kinference_epp_flow_waiting_requests{priority="10"} 0"#,
        r#"kinference_epp_decisions_total{rule="waits",outcome="reject"} 2"#,
        r#"kinference_epp_rejects_total{status="429",reason="rule"} 2"#,
    ] {
        assert!(text.contains(line), "{line} missing from\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_ends_at_max_wait_with_the_rules_reject_and_a_client_that_leaves_gives_up_its_place()
{
    let _alone = ONE_AT_A_TIME.lock().await;
    let pool = Pool::start(&policy("400ms", 100)).await;
    let running: Vec<_> = (0..4)
        .map(|i| pool.send("chat", 150, &format!("fill-{i}")))
        .collect();
    pool.dispatched(4).await;
    let started = Instant::now();
    let (status, body, _) = pool.send("chat", 5, "expires").await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("no Pod had room (waited"), "{body}");
    assert!(started.elapsed() >= Duration::from_millis(400));
    let explained = pool.epp.picker.recent().explain(1);
    assert_eq!(
        explained[0]["waited"]["outcome"], "expired",
        "{explained:#?}"
    );
    assert_eq!(
        explained[0]["decision"]["action"], "reject",
        "{explained:#?}"
    );
    // A client that gives up while waiting: its place is freed at once,
    // not at its maxWait.
    let leaving = pool
        .http
        .post(pool.envoy.url("/v1/chat/completions"))
        .timeout(Duration::from_millis(150))
        .header("x-gateway-inference-objective", "chat")
        .json(&json!({ "model": MODEL, "messages": [{ "role": "user", "content": "bye" }] }))
        .send()
        .await;
    assert!(leaving.is_err(), "the client timed out");
    pool.waiting(0).await;
    let text = pool.metrics();
    for line in [
        r#"kinference_epp_flow_wait_seconds_count{priority="10",outcome="expired"} 1"#,
        r#"kinference_epp_flow_wait_seconds_count{priority="10",outcome="cancelled"} 1"#,
    ] {
        assert!(text.contains(line), "{line} missing from\n{text}");
    }
    for fill in running {
        assert_eq!(fill.await.unwrap().0, 200);
    }
}
