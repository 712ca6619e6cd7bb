//! Endpoint scraping, standalone discovery and multi-port (data-parallel)
//! Pod endpoints against real local HTTP servers (no cluster needed).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use kinference_epp::endpoints::discovery::{fetch_models, pod_to_endpoints};
use kinference_epp::endpoints::scrape::{scrape_client, scrape_once};
use kinference_epp::endpoints::{
    Endpoint, EndpointRegistry, ScrapeStats, load_endpoints_file, spawn_scraper,
    spawn_scraper_with_stats,
};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A fake model server: `/metrics` serves whatever text the test sets,
/// `/v1/models` a fixed list.
struct FakeServer {
    addr: SocketAddr,
    state: Arc<ServerState>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

struct ServerState {
    metrics: Mutex<String>,
    models: Vec<String>,
    hits: AtomicU64,
}

impl FakeServer {
    async fn start(metrics: &str, models: &[&str]) -> Self {
        let state = Arc::new(ServerState {
            metrics: Mutex::new(metrics.to_string()),
            models: models.iter().map(|m| m.to_string()).collect(),
            hits: AtomicU64::new(0),
        });
        let app = Router::new()
            .route(
                "/metrics",
                get(|State(s): State<Arc<ServerState>>| async move {
                    s.hits.fetch_add(1, Ordering::Relaxed);
                    s.metrics.lock().unwrap().clone()
                }),
            )
            .route(
                "/v1/models",
                get(|State(s): State<Arc<ServerState>>| async move {
                    let data: Vec<_> = s
                        .models
                        .iter()
                        .map(|id| serde_json::json!({"id": id, "object": "model", "owned_by": "vllm"}))
                        .collect();
                    axum::Json(serde_json::json!({"object": "list", "data": data}))
                }),
            )
            .with_state(Arc::clone(&state));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        Self {
            addr,
            state,
            stop: Some(stop),
            task: Some(task),
        }
    }

    fn set_metrics(&self, text: &str) {
        *self.state.metrics.lock().unwrap() = text.to_string();
    }

    fn hits(&self) -> u64 {
        self.state.hits.load(Ordering::Relaxed)
    }

    /// Stops listening and closes every connection (graceful shutdown
    /// closes idle keep-alive connections too).
    async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let abort = task.abort_handle();
            if tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
    }

    fn endpoint(&self, name: &str) -> Endpoint {
        Endpoint {
            name: name.into(),
            pod: name.into(),
            uid: None,
            namespace: String::new(),
            ip: self.addr.ip(),
            port: self.addr.port(),
            models: vec!["m".into()],
            adapters: Vec::new(),
            backend: None,
            zone: None,
            node: None,
            labels: BTreeMap::new(),
        }
    }
}

fn vllm_metrics(waiting: u32, running: u32, kv: f64) -> String {
    format!(
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}.0\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}.0\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {kv}\n\
         vllm:lora_requests_info{{max_lora=\"2\",running_lora_adapters=\"a1\",waiting_lora_adapters=\"\"}} 1.7e9\n"
    )
}

/// Polls `cond` every 10 ms until it holds, failing after `limit`.
async fn wait_for(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn waiting_of(reg: &EndpointRegistry, name: &str) -> Option<f64> {
    reg.snapshot()
        .iter()
        .find(|v| v.endpoint.name == name)
        .and_then(|v| v.metrics.as_ref().map(|m| m.waiting))
}

#[tokio::test]
async fn scraper_follows_values_then_goes_stale_when_server_stops() {
    let mut server = FakeServer::start(&vllm_metrics(3, 1, 0.25), &["m"]).await;
    let staleness = Duration::from_millis(300);
    let reg = EndpointRegistry::new(staleness);
    let stats = Arc::new(ScrapeStats::default());
    let scraper = spawn_scraper_with_stats(
        Arc::clone(&reg),
        Duration::from_millis(20),
        Duration::from_millis(500),
        Arc::clone(&stats),
    );
    // Added after the scraper started: it must notice via `changed()`.
    reg.upsert(server.endpoint("pod-a"));

    wait_for("first scrape", Duration::from_secs(10), || {
        waiting_of(&reg, "pod-a") == Some(3.0)
    })
    .await;
    let snap = reg.snapshot();
    let m = snap[0].metrics.as_ref().unwrap();
    assert_eq!(m.running, 1.0);
    assert_eq!(m.kv_cache_usage, 0.25);
    assert_eq!(m.running_loras, ["a1"]);
    assert_eq!(m.max_lora, Some(2));

    server.set_metrics(&vllm_metrics(9, 4, 0.5));
    wait_for("changed values", Duration::from_secs(10), || {
        waiting_of(&reg, "pod-a") == Some(9.0)
    })
    .await;
    assert!(stats.ok.load(Ordering::Relaxed) >= 2);

    server.stop().await;
    let stopped_at = Instant::now();
    wait_for("metrics to go stale", Duration::from_secs(10), || {
        reg.snapshot()[0].metrics.is_none()
    })
    .await;
    // The last good scrape happened at most one interval (plus a scrape's
    // time) before the stop, so staleness cannot show much earlier.
    assert!(
        stopped_at.elapsed() + Duration::from_millis(150) >= staleness,
        "went stale after only {:?}",
        stopped_at.elapsed()
    );
    // The endpoint itself stays; only its metric attributes are gone.
    assert_eq!(reg.snapshot().len(), 1);
    wait_for("failed scrapes counted", Duration::from_secs(5), || {
        stats.failed.load(Ordering::Relaxed) > 0
    })
    .await;
    scraper.abort();
}

#[tokio::test]
async fn scraper_stops_scraping_removed_endpoints_and_ignores_unknown_servers() {
    let server = FakeServer::start(&vllm_metrics(1, 1, 0.1), &["m"]).await;
    let other = FakeServer::start("# not a model server\nprocess_cpu_seconds_total 1\n", &[]).await;
    let reg = EndpointRegistry::new(Duration::from_secs(5));
    let scraper = spawn_scraper(
        Arc::clone(&reg),
        Duration::from_millis(20),
        Duration::from_millis(500),
    );
    reg.replace_all(vec![server.endpoint("a"), other.endpoint("b")]);
    wait_for("scrape of a", Duration::from_secs(10), || {
        waiting_of(&reg, "a").is_some()
    })
    .await;
    wait_for("b to be polled", Duration::from_secs(10), || {
        other.hits() >= 3
    })
    .await;
    // `b` answers but has no model-server metrics: never attributed.
    assert_eq!(waiting_of(&reg, "b"), None);

    reg.remove("a");
    // Let an in-flight scrape finish, then the count must stay put.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let hits = server.hits();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(server.hits(), hits, "removed endpoint still scraped");
    assert!(other.hits() > 3, "remaining endpoint keeps being scraped");

    // Aborting the scraper stops its per-endpoint tasks too.
    scraper.abort();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let hits = other.hits();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(other.hits(), hits, "aborted scraper still scraping");
}

#[tokio::test]
async fn scrape_once_and_fetch_models() {
    let server = FakeServer::start(&vllm_metrics(2, 5, 0.75), &["llama", "sql-lora"]).await;
    let client = scrape_client(Duration::from_secs(2));
    let address = server.addr.to_string();
    let m = scrape_once(&client, &address, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!((m.waiting, m.running, m.kv_cache_usage), (2.0, 5.0, 0.75));

    let models = fetch_models(&client, &address, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(models, ["llama", "sql-lora"]);

    // Nothing listens here (the port was just freed).
    let closed = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().to_string()
    };
    assert!(
        scrape_once(&client, &closed, Duration::from_millis(500))
            .await
            .is_err()
    );
    assert!(
        fetch_models(&client, &closed, Duration::from_millis(500))
            .await
            .is_err()
    );
}

#[tokio::test]
async fn standalone_file_feeds_the_scraper() {
    let server = FakeServer::start(&vllm_metrics(6, 0, 0.0), &["m"]).await;
    let dir = std::env::temp_dir().join(format!("kinference-epp-discovery-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("endpoints.yaml");
    std::fs::write(
        &path,
        format!(
            "endpoints:\n\
             - name: local-a\n  address: {}\n  models: [llama, sql-lora]\n  backend: vllm\n  zone: z1\n  labels: {{tier: gpu}}\n\
             - name: local-b\n  address: 127.0.0.1:1\n  models: [llama]\n",
            server.addr
        ),
    )
    .unwrap();
    let eps = load_endpoints_file(&path).unwrap();
    assert_eq!(eps.len(), 2);
    assert_eq!(eps[0].address(), server.addr.to_string());
    assert_eq!(eps[0].models, ["llama", "sql-lora"]);
    assert_eq!(eps[0].labels["tier"], "gpu");

    let json = dir.join("endpoints.json");
    std::fs::write(&json, r#"[{"address": "[::1]:8000", "models": ["x"]}]"#).unwrap();
    let eps_json = load_endpoints_file(&json).unwrap();
    assert_eq!(eps_json[0].address(), "[::1]:8000");
    assert!(load_endpoints_file(&dir.join("missing.yaml")).is_err());

    let reg = EndpointRegistry::new(Duration::from_secs(5));
    reg.replace_all(eps);
    reg.mark_synced();
    let scraper = spawn_scraper(
        Arc::clone(&reg),
        Duration::from_millis(20),
        Duration::from_millis(300),
    );
    wait_for("scrape of local-a", Duration::from_secs(10), || {
        waiting_of(&reg, "local-a") == Some(6.0)
    })
    .await;
    assert_eq!(
        waiting_of(&reg, "local-b"),
        None,
        "nothing listens on port 1"
    );
    scraper.abort();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Ready Pod at 127.0.0.1, as the API server would hand it to discovery.
fn ready_pod_at_loopback(
    name: &str,
    annotations: serde_json::Value,
) -> k8s_openapi::api::core::v1::Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "llm", "labels": {"app": "vllm"},
                     "annotations": annotations},
        "spec": {"containers": [{"name": "server", "image": "vllm"}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True"}]}
    }))
    .unwrap()
}

#[tokio::test]
async fn pod_with_two_target_ports_is_two_endpoints_scraped_per_rank() {
    // Two data-parallel ranks of one Pod: two servers, one port each.
    let rank0 = FakeServer::start(&vllm_metrics(1, 0, 0.1), &["llama"]).await;
    let rank1 = FakeServer::start(&vllm_metrics(7, 2, 0.9), &["llama", "sql-lora"]).await;
    let ports = [rank0.addr.port(), rank1.addr.port()];
    let pod = ready_pod_at_loopback("dp-0", serde_json::json!({}));

    let eps = pod_to_endpoints(&pod, &ports);
    let names: Vec<_> = eps.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["dp-0-rank-0", "dp-0-rank-1"]);
    assert_eq!(eps[0].address(), rank0.addr.to_string());
    assert_eq!(eps[1].address(), rank1.addr.to_string());

    // Each rank answers /v1/models on its own port.
    let client = scrape_client(Duration::from_secs(2));
    for (ep, want) in eps.iter().zip([&["llama"][..], &["llama", "sql-lora"][..]]) {
        let models = fetch_models(&client, &ep.address(), Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(models, want);
    }

    // ... and is scraped on its own, so load is per rank.
    let reg = EndpointRegistry::new(Duration::from_secs(5));
    reg.replace_all(eps);
    let scraper = spawn_scraper(
        Arc::clone(&reg),
        Duration::from_millis(20),
        Duration::from_millis(500),
    );
    wait_for("both ranks scraped", Duration::from_secs(10), || {
        waiting_of(&reg, "dp-0-rank-0") == Some(1.0) && waiting_of(&reg, "dp-0-rank-1") == Some(7.0)
    })
    .await;
    scraper.abort();

    // The active-ports annotation keeps only the ranks it lists.
    let narrowed = ready_pod_at_loopback(
        "dp-0",
        serde_json::json!({"inference.networking.k8s.io/active-ports": ports[1].to_string()}),
    );
    let eps = pod_to_endpoints(&narrowed, &ports);
    assert_eq!(eps.len(), 1);
    assert_eq!(eps[0].name, "dp-0-rank-1");
    assert_eq!(eps[0].address(), rank1.addr.to_string());
}
