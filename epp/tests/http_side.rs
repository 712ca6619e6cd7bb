//! The EPP's HTTP side: /readyz follows policy and discovery, /metrics
//! counts decisions, /debug/explain replays recent decisions without prompts;
//! gRPC health answers the reference EPP's service names.

use std::time::Duration;

use kinference_epp::endpoints::{EndpointSpec, endpoints_from_specs};
use kinference_epp::server::{Epp, HEALTH_SERVICES, Settings};
use kinference_testbed::extproc_client::{EppClient, HttpRequest};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

async fn listener() -> (tokio::net::TcpListener, std::net::SocketAddr) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap();
    (l, a)
}

async fn readiness(addr: std::net::SocketAddr, service: &str) -> i32 {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    client
        .check(HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .map(|r| r.into_inner().status)
        .unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_and_grpc_health_metrics_and_explain() {
    let epp = Epp::new(Settings::default());
    let (http, http_addr) = listener().await;
    let (grpc, grpc_addr) = listener().await;
    let (health, health_addr) = listener().await;
    for (e, l, which) in [
        (epp.clone(), http, 0),
        (epp.clone(), grpc, 1),
        (epp.clone(), health, 2),
    ] {
        tokio::spawn(async move {
            match which {
                0 => e.serve_http(l, std::future::pending()).await,
                1 => e.serve_ext_proc(l, std::future::pending()).await,
                _ => e.serve_health(l, std::future::pending()).await,
            }
        });
    }
    let get = |path: &'static str| async move {
        let r = reqwest::get(format!("http://{http_addr}{path}"))
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(get("/healthz").await.0, 200);
    let (status, why) = get("/readyz").await;
    assert_eq!((status, why.as_str()), (503, "no policy loaded"));
    assert_eq!(
        readiness(health_addr, "readiness").await,
        2,
        "NOT_SERVING before a policy"
    );
    for service in HEALTH_SERVICES.iter().filter(|s| **s != "readiness") {
        assert_eq!(
            readiness(health_addr, service).await,
            1,
            "{service} SERVING"
        );
    }

    epp.policy()
        .load_text("pool: { selector: { app: x }, targetPorts: [{ number: 8000 }] }\nrules:\n  - name: only\n    route: { select: [{ minimize: QueueDepth }] }\n")
        .unwrap();
    assert_eq!(
        get("/readyz").await,
        (503, "endpoint discovery has not synced".to_string())
    );
    // The endpoint has no live server: it has no metrics, so QueueDepth
    // excludes it and the request is rejected — a decision all the same.
    let spec = EndpointSpec::new("127.0.0.1:9", &["qwen"]);
    epp.registry()
        .replace_all(endpoints_from_specs([spec]).unwrap());
    epp.registry().mark_synced();
    assert_eq!(get("/readyz").await.0, 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        readiness(health_addr, "readiness").await,
        1,
        "SERVING once ready"
    );

    let client = EppClient::connect(grpc_addr).await.unwrap();
    let secret_prompt = "my secret prompt text";
    let body = serde_json::json!({"model": "qwen", "messages": [{"role": "user", "content": secret_prompt}]});
    let request = HttpRequest::post("/v1/chat/completions", serde_json::to_vec(&body).unwrap())
        .header("authorization", "Bearer sk-should-not-leak");
    let (outcome, _) = client.decide(&request).await.unwrap();
    assert_eq!(outcome.status(), Some(503));

    let (_, metrics) = get("/metrics").await;
    assert!(
        metrics.contains("kinference_epp_decisions_total{rule=\"only\",outcome=\"reject\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kinference_epp_endpoint_metrics_stale{"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kinference_epp_policy_info{hash="),
        "{metrics}"
    );
    assert_eq!(
        get("/debug/explain").await.0,
        404,
        "debug endpoints are not on the metrics port"
    );
    let (debug, debug_addr) = listener().await;
    tokio::spawn({
        let epp = epp.clone();
        async move { epp.serve_debug(Some(debug), std::future::pending()).await }
    });
    let explain = reqwest::get(format!("http://{debug_addr}/debug/explain"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let traces: serde_json::Value = serde_json::from_str(&explain).unwrap();
    assert_eq!(traces[0]["decision"]["action"], "reject");
    assert_eq!(traces[0]["trace"]["rules"][0]["rule"], "only");
    assert!(
        !explain.contains(secret_prompt),
        "no prompt text in explain"
    );
    assert!(
        !explain.contains("sk-should-not-leak"),
        "no credentials in explain"
    );
}

/// llm-d's Envoy health-checks gRPC on the ext_proc port itself: it answers
/// the same statuses as the health port, `readiness` following `Epp::ready`
/// (on either port, whichever other server has stopped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_on_the_ext_proc_port_matches_the_health_port() {
    let epp = Epp::new(Settings::default());
    let (grpc, grpc_addr) = listener().await;
    let (health, health_addr) = listener().await;
    tokio::spawn({
        let epp = epp.clone();
        async move { epp.serve_ext_proc(grpc, std::future::pending()).await }
    });
    let (stop_health, health_stopped) = tokio::sync::oneshot::channel::<()>();
    let health_server = tokio::spawn({
        let epp = epp.clone();
        async move {
            epp.serve_health(health, async {
                let _ = health_stopped.await;
            })
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    for addr in [grpc_addr, health_addr] {
        assert_eq!(readiness(addr, "liveness").await, 1, "liveness at {addr}");
        assert_eq!(readiness(addr, "readiness").await, 2, "readiness at {addr}");
        for service in HEALTH_SERVICES.iter().filter(|s| **s != "readiness") {
            assert_eq!(readiness(addr, service).await, 1, "{service} at {addr}");
        }
        assert_eq!(readiness(addr, "").await, 1, "overall at {addr}");
    }

    let ready = || {
        epp.policy()
            .load_text("pool: { selector: { app: x }, targetPorts: [{ number: 8000 }] }\nrules:\n  - name: only\n    route: { select: [{ minimize: QueueDepth }] }\n")
            .unwrap();
        epp.registry().mark_synced();
        assert!(epp.ready());
    };
    let serving = |addr| async move {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while readiness(addr, "readiness").await != 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "readiness at {addr} never became SERVING"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };

    // The health port stops; the ext_proc port's readiness still follows.
    stop_health.send(()).unwrap();
    health_server.await.unwrap().unwrap();
    ready();
    serving(grpc_addr).await;
}

/// Every field a client controls carries a marker; none may appear in
/// `/debug/explain`, and a megabyte header must not make it large.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_never_shows_what_a_client_sent() {
    let epp = Epp::new(Settings::default());
    epp.policy()
        .load_text(
            "pool: { selector: { app: x }, targetPorts: [{ number: 8000 }] }
tenantHeader: x-tenant
rules:
  - name: by-credentials
    matches: [{ header.authorization: Bearer expected, header.x-api-key: expected }]
    route: { select: [{ minimize: QueueDepth }] }
  - name: by-team
    matches: [{ header.x-team: blue, tenant: acme, path: { prefix: /v2 } }]
    route: { select: [{ minimize: QueueDepth }] }
  - name: rest
    route: { select: [{ minimize: QueueDepth }] }
",
        )
        .unwrap();
    epp.registry()
        .replace_all(endpoints_from_specs([EndpointSpec::new("127.0.0.1:9", &["qwen"])]).unwrap());
    epp.registry().mark_synced();
    let (grpc, grpc_addr) = listener().await;
    let (debug, debug_addr) = listener().await;
    for (e, l, debug) in [(epp.clone(), grpc, false), (epp.clone(), debug, true)] {
        tokio::spawn(async move {
            if debug {
                e.serve_debug(Some(l), std::future::pending()).await
            } else {
                e.serve_ext_proc(l, std::future::pending()).await
            }
        });
    }
    tokio::time::sleep(Duration::from_millis(100)).await;

    let huge_tenant = format!("MARKER-TENANT-{}", "t".repeat(1 << 20));
    let client = EppClient::connect(grpc_addr).await.unwrap();
    for i in 0..64 {
        let body = serde_json::json!({"model": "qwen", "prompt": "MARKER-PROMPT"});
        let request = HttpRequest::post(
            "/v1/completions?api_key=MARKER-QUERY-KEY&email=MARKER-EMAIL",
            serde_json::to_vec(&body).unwrap(),
        )
        .header("authorization", "Bearer MARKER-BEARER")
        .header("x-api-key", "MARKER-API-KEY")
        .header("x-team", "MARKER-TEAM")
        .header(
            "x-tenant",
            if i == 0 {
                "MARKER-SMALL-TENANT"
            } else {
                &huge_tenant
            },
        );
        client.decide(&request).await.unwrap();
    }

    let explain = reqwest::get(format!("http://{debug_addr}/debug/explain?limit=64"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let traces: Vec<serde_json::Value> = serde_json::from_str(&explain).unwrap();
    assert_eq!(traces.len(), 64);
    assert!(
        !explain.contains("MARKER"),
        "{}",
        &explain[..explain.len().min(4000)]
    );
    // 64 decisions with a 1 MiB tenant each: the kept values are clamped
    // and digested, so the page stays small.
    assert!(explain.len() < 512 * 1024, "{} bytes", explain.len());
    let first = &traces[0];
    assert_eq!(first["request"]["path"], "/v1/completions");
    assert_eq!(first["request"]["headers"]["authorization"], "<redacted>");
    assert_eq!(first["request"]["headers"]["x-api-key"], "<redacted>");
    let team = first["request"]["headers"]["x-team"].as_str().unwrap();
    assert!(team.starts_with("sha256:"), "{team}");
    // The trace still says why a rule did not match, without the value.
    let why = first["trace"]["rules"][0]["notMatchedBecause"][0]
        .as_str()
        .unwrap();
    assert!(why.contains("header.authorization is <redacted>"), "{why}");
}
