//! Precise prefix mode against real publishers: llm-d-inference-sim Pods
//! (built from the Go module proxy) send their KV-cache events to the EPP,
//! which routes through a real Envoy. The simulators' dummy tokenizer is
//! matched by the EPP's `simulator-dummy` tokenizer (for tests only).

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use kinference_epp::endpoints::{EndpointSpec, endpoints_from_specs};
use kinference_epp::kv_events::Freshness;
use kinference_epp::kv_events::tokenize::{PromptTokenizer, Tokenizer};
use kinference_epp::server::{Epp, Settings};
use kinference_testbed::envoy::{Bootstrap, Envoy, Template};
use kinference_testbed::llmd_sim::{LlmdSim, ensure_llmd_sim};
use serde_json::{Value, json};
use tokio::net::TcpListener;

const MODEL: &str = "sim-model";
const BLOCK_SIZE: u32 = 16;
const PODS: usize = 3;

fn policy(port: u16) -> String {
    format!(
        "pool:
  selector: {{ app: sim }}
  targetPorts: [{{ number: {port} }}]
rules:
  - name: cached-first
    route: {{ select: [{{ type: Local, maximize: CachedPrefixTokens }}] }}
"
    )
}

fn pod_ip(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 41 + i as u8))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A long system prompt of its own for `round`, and a short question.
fn chat(round: usize, question: &str) -> Value {
    let system = format!("round {round}: ").repeat(8)
        + &"You answer questions about the history of tea, briefly and politely. ".repeat(12);
    json!({
        "model": MODEL,
        "messages": [
            { "role": "system", "content": system },
            { "role": "user", "content": question }
        ],
        "max_tokens": 4
    })
}

async fn post(http: &reqwest::Client, url: &str, body: &Value, id: &str) -> Value {
    let response = http
        .post(url)
        .header("x-request-id", id)
        .json(body)
        .send()
        .await
        .expect("an answer");
    assert_eq!(response.status(), 200, "{url}");
    response.json().await.unwrap()
}

/// Envoy's access record of request `id` (flushed about once a second).
async fn access(envoy: &Envoy, id: &str) -> kinference_testbed::envoy::AccessRecord {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(record) = envoy.access(id) {
            return record;
        }
        assert!(Instant::now() < deadline, "no access record for {id}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_request_goes_where_the_engines_events_say_its_prefix_is_cached() {
    let sim_bin = ensure_llmd_sim().await.expect("llm-d-inference-sim");
    let events = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let events_addr = events.local_addr().unwrap();
    let epp = Epp::new(Settings {
        scrape_interval: Duration::from_millis(20),
        secure_serving: true,
        ..Settings::default()
    });
    let tokenizer = PromptTokenizer::new(Tokenizer::simulator_dummy(), Duration::from_secs(1));
    epp.picker.enable_precise_prefix(tokenizer);
    tokio::spawn({
        let epp = epp.clone();
        async move {
            epp.serve_kv_events(Some(events), std::future::pending())
                .await
        }
    });

    // Each Pod on its own loopback IP (the topic names it) and port.
    let ports: Vec<u16> = (0..PODS).map(|_| free_port()).collect();
    let mut sims = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        let sim = LlmdSim::start(&sim_bin, pod_ip(i), *port, MODEL, BLOCK_SIZE, events_addr);
        sims.push(sim.await.expect("the simulator starts"));
    }
    epp.policy().load_text(&policy(ports[0])).unwrap();
    let specs = sims.iter().enumerate().map(|(i, s)| {
        let mut spec = EndpointSpec::new(s.addr.to_string(), &[MODEL]);
        spec.name = Some(format!("sim-{i}"));
        spec
    });
    epp.registry()
        .replace_all(endpoints_from_specs(specs).unwrap());
    epp.registry().mark_synced();
    epp.spawn_scraper();
    let ext_proc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ext_proc_addr = ext_proc.local_addr().unwrap();
    tokio::spawn({
        let epp = epp.clone();
        async move { epp.serve_ext_proc(ext_proc, std::future::pending()).await }
    });
    let bootstrap = Bootstrap {
        pool: sims.iter().map(|s| s.addr).collect(),
        ..Bootstrap::new(Template::Streamed, ext_proc_addr)
    };
    let envoy = Envoy::start(&bootstrap).await.expect("Envoy starts");
    assert!(
        epp.registry()
            .wait_until_scraped(Duration::from_secs(10))
            .await
    );
    let http = reqwest::Client::new();

    // Each round warms one Pod directly, behind the EPP's back: only its
    // events can tell the EPP where the prefix is. Six rounds over three
    // Pods: a picker blind to the events would pass by chance once in 729.
    for round in 0..6 {
        let warm = round % PODS;
        let state = epp
            .registry()
            .state_at(&sims[warm].addr.to_string())
            .unwrap();
        let before = state.kv.len();
        let url = format!("http://{}/v1/chat/completions", sims[warm].addr);
        post(&http, &url, &chat(round, "warm up"), "warm").await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while state.kv.len() <= before {
            assert!(Instant::now() < deadline, "no KV events from sim-{warm}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(state.kv.freshness(), Freshness::Live);

        let id = format!("round-{round}");
        let answer = post(
            &http,
            &envoy.url("/v1/chat/completions"),
            &chat(round, "why?"),
            &id,
        )
        .await;
        let record = access(&envoy, &id).await;
        assert_eq!(
            record.upstream.as_deref(),
            Some(sims[warm].addr.to_string().as_str()),
            "round {round}: the prefix is cached on sim-{warm}"
        );
        let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(cached >= u64::from(BLOCK_SIZE), "round {round}: {answer}");
    }
    for sim in sims {
        sim.stop().await;
    }
}
