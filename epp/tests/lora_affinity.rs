//! LoRA affinity against llm-d-inference-sim with its LoRA options: two
//! Pods serve the base model and the adapters `tweet` and `news` (at most
//! two adapters at once each). While one Pod runs `tweet`, as its
//! `vllm:lora_requests_info` reports, the built-in default policy sends
//! every `tweet` request there, through real Envoy, by the policy's
//! `adapter` rule; and an adapter no Pod runs yet, known as one from
//! `/v1/models`, never goes to a Pod whose adapter slots are all taken.

mod support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use kinference_epp::endpoints::discovery::fetch_served_models;
use kinference_epp::endpoints::{EndpointSpec, ScrapedMetrics};
use kinference_epp::server::{Epp, Settings};
use kinference_testbed::envoy::Envoy;
use kinference_testbed::llmd_sim::{LlmdSim, ensure_llmd_sim};
use serde_json::{Value, json};

const BASE: &str = "base-model";
const ADAPTERS: [&str; 2] = ["tweet", "news"];

fn pod_ip(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 61 + i as u8))
}

fn free_port() -> u16 {
    kinference_testbed::free_port().expect("a free port")
}

/// The simulator's flags: both adapters, two at once, 40 ms per token (so
/// a long answer keeps its adapter running across scrapes).
fn lora_flags(max_loras: u32) -> Vec<String> {
    let mut flags = vec!["--lora-modules".to_string()];
    flags.extend(
        ADAPTERS
            .iter()
            .map(|a| json!({ "name": a, "path": format!("/adapters/{a}") }).to_string()),
    );
    flags.extend([
        "--max-loras".into(),
        max_loras.to_string(),
        "--inter-token-latency".into(),
        "40ms".into(),
    ]);
    flags
}

struct Pool {
    epp: Epp,
    sims: Vec<LlmdSim>,
    envoy: Envoy,
    http: reqwest::Client,
}

impl Pool {
    async fn start(max_loras: &[u32]) -> Pool {
        let bin = ensure_llmd_sim().await.expect("llm-d-inference-sim");
        // Nobody listens for KV events here: approximate mode.
        let events: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let mut sims = Vec::new();
        for (i, max) in max_loras.iter().enumerate() {
            let flags = lora_flags(*max);
            let sim = LlmdSim::start_with(&bin, pod_ip(i), free_port(), BASE, 16, events, &flags);
            sims.push(sim.await.expect("the simulator starts"));
        }
        let epp = Epp::new(Settings {
            scrape_interval: Duration::from_millis(20),
            secure_serving: true,
            ..Settings::default()
        });
        epp.policy()
            .load_text(kinference_epp::policy_store::DEFAULT_POLICY)
            .expect("the built-in policy");
        // What discovery learns from each Pod's /v1/models (the same
        // call): the base model, and the adapters, which name it as parent.
        let http = reqwest::Client::new();
        let mut specs = Vec::new();
        for (i, s) in sims.iter().enumerate() {
            let address = s.addr.to_string();
            let served = fetch_served_models(&http, &address, Duration::from_secs(5))
                .await
                .expect("/v1/models");
            let mut adapters = served.adapters.clone();
            adapters.sort_unstable();
            assert_eq!(adapters, ["news", "tweet"], "sim-{i}'s /v1/models");
            let mut spec = EndpointSpec::new(address, &[]);
            spec.models = served.models;
            spec.adapters = served.adapters;
            spec.name = Some(format!("sim-{i}"));
            specs.push(spec);
        }
        let pool = sims.iter().map(|s| s.addr).collect();
        let envoy = support::serve_behind_envoy(&epp, specs, pool).await;
        Pool {
            epp,
            sims,
            envoy,
            http,
        }
    }

    /// A long `model` answer on sim `i` directly, behind the EPP's back:
    /// the adapter runs there for a few seconds.
    fn keep_busy(&self, i: usize, model: &str) -> tokio::task::JoinHandle<()> {
        let url = format!("http://{}/v1/chat/completions", self.sims[i].addr);
        let body = json!({
            "model": model,
            "messages": [{ "role": "user", "content": "write a long thread" }],
            "max_tokens": 150,
            "ignore_eos": true
        });
        let http = self.http.clone();
        tokio::spawn(async move {
            let answer = http.post(url).json(&body).send().await.expect("an answer");
            assert_eq!(answer.status(), 200);
        })
    }

    /// Waits until the EPP's view of sim `i` has at least `n` requests
    /// running.
    async fn wait_load(&self, i: usize, n: f64) {
        self.wait_scraped(i, &format!("{n} requests running"), |m| m.running >= n)
            .await;
    }

    /// Waits until the EPP's view of sim `i` has `adapter` running.
    async fn wait_running(&self, i: usize, adapter: &str) {
        self.wait_scraped(i, &format!("{adapter} running"), |m| {
            m.running_loras.iter().any(|a| a == adapter)
        })
        .await;
    }

    /// Waits until the EPP's last scrape of sim `i` shows `what`; on a
    /// timeout, fails with the sim's own LoRA and load lines.
    async fn wait_scraped(&self, i: usize, what: &str, shows: impl Fn(&ScrapedMetrics) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let address = self.sims[i].addr.to_string();
        loop {
            let seen = self
                .epp
                .registry()
                .snapshot()
                .iter()
                .find(|v| v.endpoint.address() == address)
                .and_then(|v| v.metrics.clone())
                .is_some_and(|m| shows(&m));
            if seen {
                return;
            }
            if Instant::now() > deadline {
                let page = match self
                    .http
                    .get(format!("http://{address}/metrics"))
                    .send()
                    .await
                {
                    Ok(r) => r.text().await.unwrap_or_default(),
                    Err(e) => e.to_string(),
                };
                let lines: Vec<&str> = page
                    .lines()
                    .filter(|l| l.contains("lora") || l.contains("num_requests"))
                    .collect();
                panic!("sim-{i} never showed {what}; its /metrics: {lines:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// One short `model` request through Envoy: the sim that served it.
    async fn ask(&self, model: &str, id: &str) -> usize {
        let body = json!({
            "model": model,
            "messages": [{ "role": "user", "content": "hi" }],
            "max_tokens": 2
        });
        let answer = self
            .http
            .post(self.envoy.url("/v1/chat/completions"))
            .header("x-request-id", id)
            .json(&body)
            .send()
            .await
            .expect("an answer");
        assert_eq!(answer.status(), 200, "{id}");
        let _: Value = answer.json().await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let record = loop {
            if let Some(r) = self.envoy.access(id) {
                break r;
            }
            assert!(Instant::now() < deadline, "no access record for {id}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(record.rule.as_deref(), Some("adapter"), "{record:?}");
        let upstream = record.upstream.expect("an upstream");
        self.sims
            .iter()
            .position(|s| s.addr.to_string() == upstream)
            .expect("one of the sims")
    }

    async fn stop(self) {
        for sim in self.sims {
            sim.stop().await;
        }
    }
}

/// Whichever Pod runs the adapter gets its requests, though it is the
/// busier one (by load alone the other would win).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapters_requests_go_to_the_pod_running_it() {
    for running in [1, 0] {
        let pool = Pool::start(&[2, 2]).await;
        let busy = pool.keep_busy(running, "tweet");
        pool.wait_running(running, "tweet").await;
        for n in 0..8 {
            let id = format!("tweet-{running}-{n}");
            assert_eq!(pool.ask("tweet", &id).await, running, "{id}");
        }
        busy.abort();
        pool.stop().await;
    }
}

/// An adapter no Pod runs yet is known as one from `/v1/models`: its
/// request takes the `adapter` rule, which drops the Pod whose only
/// adapter slot another adapter holds, though by load that Pod would win.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_adapter_never_goes_to_a_pod_with_no_slot_free() {
    // sim-0 holds one adapter at most and runs `news`; sim-1 runs two long
    // base-model answers, so it is the busier one.
    let pool = Pool::start(&[1, 2]).await;
    let busy = [
        pool.keep_busy(0, "news"),
        pool.keep_busy(1, BASE),
        pool.keep_busy(1, BASE),
    ];
    pool.wait_running(0, "news").await;
    pool.wait_load(1, 2.0).await;
    for n in 0..6 {
        let id = format!("slot-{n}");
        assert_eq!(pool.ask("tweet", &id).await, 1, "{id}");
    }
    for task in busy {
        task.abort();
    }
    pool.stop().await;
}
