//! Precise prefix mode against real publishers: llm-d-inference-sim Pods
//! (built from the Go module proxy) send their KV-cache events to the EPP,
//! which routes through a real Envoy. The simulators' dummy tokenizer is
//! matched by the EPP's `simulator-dummy` tokenizer (for tests only); given
//! another tokenizer (Qwen3's), the EPP must notice from the answers.

mod support;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use kinference_epp::endpoints::EndpointSpec;
use kinference_epp::kv_cache::Freshness;
use kinference_epp::kv_events::subscriber::Source;
use kinference_epp::kv_events::tokenize::PromptTokenizer;
use kinference_epp::server::Epp;
use kinference_epp::server::Settings;
use kinference_testbed::envoy::Envoy;
use kinference_testbed::llmd_sim::{LlmdSim, ensure_llmd_sim};
use kinference_tokenizer::Tokenizer;
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
    kinference_testbed::free_port().expect("a free port")
}

/// [`policy`], ranked by `PredictedTTFT` (which counts the cached prefix).
fn policy_predicted_ttft(port: u16) -> String {
    policy(port).replace("maximize: CachedPrefixTokens", "minimize: PredictedTTFT")
}

/// [`policy`], with ties broken at random instead of in rank order.
fn policy_random_ties(port: u16) -> String {
    policy(port).replace(
        "route: { select: [{ type: Local, maximize: CachedPrefixTokens }] }",
        "route: { select: [{ type: Local, maximize: CachedPrefixTokens }], tieBreak: Random }",
    )
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

/// `name{label="value"}`'s value in the EPP's exposition, 0 if absent.
fn sample(epp: &Epp, name: &str, label: &str, value: &str) -> f64 {
    let metrics = epp.picker.metrics().render(epp.registry(), None);
    let prefix = format!("{name}{{{label}=\"{value}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// The EPP in precise mode with `tokenizer`, [`PODS`] simulators sending
/// it their events, and Envoy in front.
struct Pool {
    epp: Epp,
    sims: Vec<LlmdSim>,
    envoy: Envoy,
    http: reqwest::Client,
    sim_bin: std::path::PathBuf,
    events_addr: std::net::SocketAddr,
}

impl Pool {
    async fn start(tokenizer: Tokenizer) -> Pool {
        Self::start_with(tokenizer, policy).await
    }

    async fn start_with(tokenizer: Tokenizer, policy: fn(u16) -> String) -> Pool {
        let sim_bin = ensure_llmd_sim().await.expect("llm-d-inference-sim");
        let events = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let events_addr = events.local_addr().unwrap();
        let epp = Epp::new(Settings {
            scrape_interval: Duration::from_millis(20),
            secure_serving: true,
            ..Settings::default()
        });
        // Generous: CI runs many test binaries at once on two cores, and
        // over budget a request is estimated, not matched.
        let tokenizer = PromptTokenizer::new(tokenizer, Duration::from_secs(10));
        epp.picker.enable_precise_prefix(tokenizer);
        tokio::spawn({
            let epp = epp.clone();
            async move {
                epp.serve_kv_events(
                    Some(Source::Listen(vec![events])),
                    None,
                    std::future::pending(),
                )
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
        let pool = sims.iter().map(|s| s.addr).collect();
        let envoy = support::serve_behind_envoy(&epp, specs.collect(), pool).await;
        Pool {
            epp,
            sims,
            envoy,
            http: reqwest::Client::new(),
            sim_bin,
            events_addr,
        }
    }

    fn state(&self, i: usize) -> std::sync::Arc<kinference_epp::predict::DestinationState> {
        let addr = self.sims[i].addr.to_string();
        self.epp.registry().state_at(&addr).unwrap()
    }

    /// Leading blocks of `chain` Pod `i`'s engines hold, as the picker sees
    /// them in the pool's index; `None` while its index is not usable.
    fn cached_blocks(&self, i: usize, chain: &[u64]) -> Option<usize> {
        let slots = self.state(i).kv.pool_slots(Instant::now())?.slots;
        let held = self.epp.registry().kv_pool().leading_blocks(chain, &slots);
        held.into_iter().map(|(_, blocks)| blocks).max()
    }

    /// Stops sim `i` and starts a new one on the same IP and port: an
    /// empty cache, and its events numbered from the start again.
    async fn restart(&mut self, i: usize) {
        let old = self.sims.remove(i);
        let addr = old.addr;
        old.stop().await;
        let new = LlmdSim::start(
            &self.sim_bin,
            addr.ip(),
            addr.port(),
            MODEL,
            BLOCK_SIZE,
            self.events_addr,
        );
        self.sims
            .insert(i, new.await.expect("the simulator restarts"));
    }

    /// Sends `body` to sim `i` directly, behind the EPP's back, and waits
    /// until its events reached the EPP.
    async fn warm(&self, i: usize, body: &Value) {
        let state = self
            .epp
            .registry()
            .state_at(&self.sims[i].addr.to_string())
            .unwrap();
        let before = state.kv.len();
        let url = format!("http://{}/v1/chat/completions", self.sims[i].addr);
        post(&self.http, &url, body, "warm").await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while state.kv.len() <= before {
            assert!(Instant::now() < deadline, "no KV events from sim-{i}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(state.kv.freshness(), Freshness::Live);
    }

    /// Sends `body` through Envoy; the answer, and the sim it went to.
    async fn ask(&self, body: &Value, id: &str) -> (Value, usize) {
        let url = self.envoy.url("/v1/chat/completions");
        let answer = post(&self.http, &url, body, id).await;
        let record = access(&self.envoy, id).await;
        let upstream = record.upstream.expect("an upstream");
        let sim = self
            .sims
            .iter()
            .position(|s| s.addr.to_string() == upstream)
            .expect("one of the sims");
        (answer, sim)
    }

    async fn stop(self) {
        for sim in self.sims {
            sim.stop().await;
        }
    }
}

#[tokio::test]
async fn a_request_goes_where_the_engines_events_say_its_prefix_is_cached() {
    goes_where_the_events_say(policy).await;
}

#[tokio::test]
async fn predicted_ttft_counts_the_prefix_the_engines_events_say_is_cached() {
    goes_where_the_events_say(policy_predicted_ttft).await;
}

async fn goes_where_the_events_say(policy: fn(u16) -> String) {
    let pool = Pool::start_with(Tokenizer::simulator_dummy(), policy).await;
    // Each round warms one Pod directly: only its events can tell the EPP
    // where the prefix is. Six rounds over three Pods: a picker blind to
    // the events would pass by chance once in 729.
    for round in 0..6 {
        let warm = round % PODS;
        pool.warm(warm, &chat(round, "warm up")).await;
        let id = format!("round-{round}");
        let (answer, sim) = pool.ask(&chat(round, "why?"), &id).await;
        let tokenized = |outcome| {
            let name = "kinference_epp_prompt_tokenizations_total";
            sample(&pool.epp, name, "outcome", outcome)
        };
        assert_eq!(
            sim,
            warm,
            "round {round}: the prefix is cached on sim-{warm} (tokenizations ok {}, over budget {}); the decision: {}",
            tokenized("ok"),
            tokenized("over_budget"),
            pool.epp.picker.recent().explain(1)[0]["trace"]
        );
        let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(cached >= u64::from(BLOCK_SIZE), "round {round}: {answer}");
    }
    // Each answer's reported counts agreed with the EPP's own, and the
    // prediction error is exported per source.
    let epp = &pool.epp;
    let checks = "kinference_epp_kv_events_checks_total";
    let findings: Vec<(&str, f64)> = [
        "agree",
        "token_count",
        "block_size",
        "cached_tokens",
        "unindexed",
    ]
    .into_iter()
    .map(|result| (result, sample(epp, checks, "result", result)))
    .collect();
    assert_eq!(findings[0], ("agree", 6.0), "{findings:?}");
    assert_eq!(findings[1], ("token_count", 0.0), "{findings:?}");
    let errors = "kinference_epp_cached_prefix_prediction_error_count";
    assert_eq!(sample(epp, errors, "source", "events"), 6.0);
    let error_sum = "kinference_epp_cached_prefix_prediction_error_sum";
    assert!(sample(epp, error_sum, "source", "events") < 6.0 * 0.25);
    // /debug/explain says the winner's value came from its events.
    let explain = epp.picker.recent().explain(1);
    let ranking = &explain[0]["trace"]["rules"][0]["tiers"][0]["ranking"];
    let winner = ranking[0][1].as_str().unwrap_or_default();
    assert!(winner.ends_with(" (events)"), "{ranking}");
    pool.stop().await;
}

#[tokio::test]
async fn a_prefix_routed_moments_ago_counts_before_the_engines_events_say_so() {
    let pool = Pool::start(Tokenizer::simulator_dummy()).await;
    let port = pool.sims[0].addr.port();
    let random_ties = policy_random_ties(port);
    assert_ne!(random_ties, policy(port));
    pool.epp.policy().load_text(&random_ties).unwrap();
    // Every Pod has published: their events, not the EPP's estimate, are
    // what the picker reads.
    for i in 0..PODS {
        pool.warm(i, &chat(100 + i, "warm up")).await;
    }
    let url = pool.envoy.url("/v1/chat/completions");
    // The simulator publishes its events in batches up to a second apart:
    // the second request of each round is routed before they arrive. Ties
    // are broken at random, so a picker that waited for the events would
    // send it to the first one's Pod once in three, all six rounds once in
    // 729.
    let mut from_routes = 0;
    for round in 0..6 {
        let (first, second) = (format!("first-{round}"), format!("second-{round}"));
        post(&pool.http, &url, &chat(10 + round, "first?"), &first).await;
        let answer = post(&pool.http, &url, &chat(10 + round, "second?"), &second).await;
        // Whether the route memory, not the events, decided it.
        let explain = pool.epp.picker.recent().explain(1);
        let ranking = &explain[0]["trace"]["rules"][0]["tiers"][0]["ranking"];
        let winner = ranking[0][1].as_str().unwrap_or_default();
        from_routes += usize::from(winner.ends_with(" (estimate)"));
        let (first, second) = (
            access(&pool.envoy, &first).await,
            access(&pool.envoy, &second).await,
        );
        assert_eq!(
            second.upstream, first.upstream,
            "round {round}: the prefix was sent to {:?} moments before",
            first.upstream
        );
        let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(cached >= u64::from(BLOCK_SIZE), "round {round}: {answer}");
    }
    assert!(from_routes > 0, "the events came first in every round");
    pool.stop().await;
}

/// The chain of `body`'s prompt as the EPP computes it.
fn chain_of(body: &Value) -> std::sync::Arc<[u64]> {
    let parsed = kinference_epp::extproc::body::parse(body.to_string().as_bytes()).unwrap();
    let prompt = parsed.prompt_text();
    let ids = Tokenizer::simulator_dummy().tokens(&prompt).unwrap();
    kinference_epp::kv_cache::PromptTokens::new(ids).chain(BLOCK_SIZE, None)
}

#[tokio::test]
async fn an_engine_restarted_on_the_same_address_is_not_credited_with_its_old_cache() {
    let mut pool = Pool::start(Tokenizer::simulator_dummy()).await;
    pool.warm(0, &chat(0, "warm up")).await;
    let old = chain_of(&chat(0, "why?"));
    assert!(pool.cached_blocks(0, &old) > Some(0));

    pool.restart(0).await;
    // The new engine publishes once it serves: another prefix, directly.
    let url = format!("http://{}/v1/chat/completions", pool.sims[0].addr);
    post(&pool.http, &url, &chat(1, "warm up"), "warm").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let state = pool.state(0);
    while pool.cached_blocks(0, &old) != Some(0) || state.kv.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the Pod's index still holds the old engine's cache ({:?})",
            state.kv.freshness()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(state.kv.freshness(), Freshness::Live);
    // Round 0's question now finds its prefix nowhere, as the engines say.
    let (answer, _) = pool.ask(&chat(0, "why?"), "after-restart").await;
    let reported = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert_eq!(reported, Some(0), "{answer}");
    let checks = "kinference_epp_kv_events_checks_total";
    assert_eq!(sample(&pool.epp, checks, "result", "agree"), 1.0);
    assert_eq!(sample(&pool.epp, checks, "result", "cached_tokens"), 0.0);
    pool.stop().await;
}

#[tokio::test]
async fn a_tokenizer_that_is_not_the_engines_is_reported() {
    // This binary's only subscriber: the warning is logged from any thread.
    let logs = kinference_testbed::logs::CapturedLogs::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .init();
    let qwen3 = kinference_testbed::peers::qwen3_tokenizer().expect("Qwen3's tokenizer files");
    let pool = Pool::start(Tokenizer::hugging_face(&qwen3).unwrap()).await;
    // Qwen3 counts these prompts in fewer tokens than the simulator's
    // dummy tokenizer: every answer disagrees, and after half a window of
    // answers the warning names the cause.
    for i in 0..32 {
        pool.ask(&chat(i, "why?"), &format!("q-{i}")).await;
    }
    let epp = &pool.epp;
    let checks = "kinference_epp_kv_events_checks_total";
    assert_eq!(sample(epp, checks, "result", "token_count"), 32.0);
    assert_eq!(sample(epp, checks, "result", "agree"), 0.0);
    let logs = logs.text();
    let warnings: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("precise prefix mode disagrees with the engine"))
        .collect();
    assert_eq!(warnings.len(), 1, "{logs}");
    assert!(warnings[0].contains("finding=\"token_count\""), "{logs}");
    assert!(warnings[0].contains("chat template"), "{logs}");
    pool.stop().await;
}
