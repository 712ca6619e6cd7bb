//! The one span each ext_proc stream is served in, read from the whole EPP
//! over real gRPC.
//!
//! This file holds one test, so that its process holds one subscriber: a
//! subscriber set per thread while other tests hit the same span callsite
//! on other threads can lose a race for tracing's global interest cache,
//! and the span is then never recorded.

use std::time::{Duration, Instant};

use kinference_epp::endpoints::{EndpointSpec, ScrapedMetrics, endpoints_from_specs};
use kinference_epp::server::{Epp, Settings};
use kinference_testbed::extproc_client::{EppClient, HttpRequest};
use kinference_testbed::logs::CapturedLogs;
use tokio::net::TcpListener;

const POLICY: &str = "pool: { selector: { app: sim }, targetPorts: [{ number: 8000 }] }
rules:
  - name: fast
    route: { select: [{ minimize: QueueDepth }] }
";

/// An EPP over one idle Pod serving `m`, whose metrics no scraper touches
/// (a 60 s interval keeps the one set here fresh).
fn epp_over_one_pod() -> Epp {
    let epp = Epp::new(Settings {
        scrape_interval: Duration::from_secs(60),
        ..Settings::default()
    });
    epp.policy().load_text(POLICY).expect("policy compiles");
    let specs = [EndpointSpec::new("10.0.0.1:8000".to_string(), &["m"])];
    epp.registry()
        .replace_all(endpoints_from_specs(specs).unwrap());
    epp.registry().mark_synced();
    for ep in epp.registry().endpoints() {
        epp.registry()
            .set_metrics(&ep.name, ScrapedMetrics::empty(Instant::now()));
    }
    epp
}

/// The closing lines of `ext_proc` spans logged so far.
fn closed_spans(logs: &CapturedLogs) -> Vec<String> {
    logs.text()
        .lines()
        .filter(|l| l.contains("ext_proc{") && l.contains("close"))
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn one_span_per_stream_carries_id_rule_destination_and_outcome() {
    let logs = CapturedLogs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_ansi(false)
        .finish();
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let epp = epp_over_one_pod();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = epp.clone();
    tokio::spawn(async move {
        server
            .serve_ext_proc(listener, std::future::pending())
            .await
            .unwrap()
    });
    let client = EppClient::connect(addr).await.unwrap();

    let request = HttpRequest::post(
        "/v1/chat/completions",
        br#"{"model":"m","messages":[{"role":"user","content":"prompt-marker-77"}]}"#.to_vec(),
    )
    .header("x-request-id", "req-42")
    .header("authorization", "Bearer sk-secret");
    let (outcome, mut stream) = client.decide(&request).await.unwrap();
    assert_eq!(outcome.destination(), Some("10.0.0.1:8000"));
    stream
        .response_headers(200, Some("10.0.0.1:8000"), None)
        .await
        .unwrap();
    stream.finish().await.unwrap();

    // The span closes when the server's side of the stream ends, which may
    // be just after the client's.
    for _ in 0..200 {
        if !closed_spans(&logs).is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let text = logs.text();
    let closed = closed_spans(&logs);
    assert_eq!(closed.len(), 1, "{text}");
    for expected in [
        "request_id=\"req-42\"",
        "rule=\"fast\"",
        "destination=\"10.0.0.1:8000\"",
        "outcome=200",
    ] {
        assert!(closed[0].contains(expected), "{expected} missing: {text}");
    }
    assert!(
        !text.contains("sk-secret") && !text.contains("prompt-marker-77"),
        "{text}"
    );
}
