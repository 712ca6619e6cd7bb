//! What the whole EPP logs, over real gRPC: the one span each ext_proc
//! stream is served in, and the per-sample TTFT line.
//!
//! These tests share one global subscriber in a process of their own. A
//! subscriber set per thread, while other tests hit the same callsites on
//! other threads, can lose a race for tracing's global interest cache, and
//! its lines are then never recorded.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kinference_epp::endpoints::{EndpointSpec, ScrapedMetrics, endpoints_from_specs};
use kinference_epp::server::{Epp, Settings};
use kinference_testbed::extproc_client::{EppClient, HttpRequest};
use kinference_testbed::logs::CapturedLogs;
use tokio::net::TcpListener;

const POLICY: &str = "pool: { selector: { app: sim }, targetPorts: [{ number: 8000 }] }
rules:
  - name: fast
    route: { select: [{ minimize: PredictedTTFT }] }
";

/// Everything logged in this process, at the levels the EPP's documented
/// `RUST_LOG` for TTFT samples asks for.
fn logs() -> &'static CapturedLogs {
    static LOGS: OnceLock<CapturedLogs> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = CapturedLogs::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_env_filter("info,kinference_epp::ttft_samples=debug")
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .with_ansi(false)
            .finish();
        tracing::subscriber::set_global_default(subscriber).unwrap();
        logs
    })
}

/// An EPP over one idle Pod at `address` serving `m`, whose metrics no
/// scraper touches (a 60 s interval keeps the one set here fresh), serving
/// ext_proc on loopback; a client of it.
async fn epp_over_one_pod(address: &str) -> EppClient {
    let epp = Epp::new(Settings {
        scrape_interval: Duration::from_secs(60),
        ..Settings::default()
    });
    epp.policy().load_text(POLICY).expect("policy compiles");
    let specs = [EndpointSpec::new(address.to_string(), &["m"])];
    epp.registry()
        .replace_all(endpoints_from_specs(specs).unwrap());
    epp.registry().mark_synced();
    for ep in epp.registry().endpoints() {
        epp.registry()
            .set_metrics(&ep.name, ScrapedMetrics::empty(Instant::now()));
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        epp.serve_ext_proc(listener, std::future::pending())
            .await
            .unwrap()
    });
    EppClient::connect(addr).await.unwrap()
}

/// The lines logged so far that hold every one of `parts`.
fn lines_with(parts: &[&str]) -> Vec<String> {
    logs()
        .text()
        .lines()
        .filter(|l| parts.iter().all(|p| l.contains(p)))
        .map(str::to_string)
        .collect()
}

/// The lines that hold every one of `parts`, once there are some; they may
/// come just after the client's side of the stream ended.
async fn wait_for_lines_with(parts: &[&str]) -> Vec<String> {
    for _ in 0..200 {
        let lines = lines_with(parts);
        if !lines.is_empty() {
            return lines;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Vec::new()
}

/// The number logged as `name=` in `line`.
fn number(line: &str, name: &str) -> f64 {
    let at = line.find(&format!(" {name}=")).expect(name) + name.len() + 2;
    let value: String = line[at..]
        .chars()
        .take_while(|c| !c.is_whitespace())
        .collect();
    value.parse().expect(name)
}

/// A chat request for `m` whose prompt is `marker`.
fn chat(marker: &str, request_id: &str) -> HttpRequest {
    let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{marker}"}}]}}"#);
    HttpRequest::post("/v1/chat/completions", body.into_bytes())
        .header("x-request-id", request_id)
        .header("authorization", "Bearer sk-secret")
}

#[tokio::test]
async fn one_span_per_stream_carries_id_rule_destination_and_outcome() {
    logs();
    let client = epp_over_one_pod("10.0.0.1:8000").await;
    let request = chat("prompt-marker-77", "req-42");
    let (outcome, mut stream) = client.decide(&request).await.unwrap();
    assert_eq!(outcome.destination(), Some("10.0.0.1:8000"));
    stream
        .response_headers(200, Some("10.0.0.1:8000"), None)
        .await
        .unwrap();
    stream.finish().await.unwrap();

    let closed = wait_for_lines_with(&["ext_proc{", "req-42", "close"]).await;
    let text = logs().text();
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

#[tokio::test]
async fn each_ttft_sample_learnt_is_one_debug_line_of_numbers() {
    logs();
    let client = epp_over_one_pod("10.0.0.9:8000").await;
    let (outcome, mut stream) = client
        .decide(&chat("prompt-marker-78", "req-43"))
        .await
        .unwrap();
    assert_eq!(outcome.destination(), Some("10.0.0.9:8000"));
    // The gateway reports the first byte 50 ms after the request left.
    stream
        .response_headers(200, Some("10.0.0.9:8000"), Some(50.0))
        .await
        .unwrap();
    stream.finish().await.unwrap();

    let lines = wait_for_lines_with(&["TTFT sample learnt", "10.0.0.9:8000"]).await;
    let text = logs().text();
    assert_eq!(lines.len(), 1, "{text}");
    let line = &lines[0];
    // At debug level under its own target, inside the request's span.
    for expected in [
        "DEBUG ",
        "kinference_epp::ttft_samples:",
        "request_id=\"req-43\"",
        "endpoint=\"10.0.0.9:8000\"",
        "observed_ms=50.0 ",
        // An idle Pod, nothing cached: the whole prompt was prefilled.
        "waiting=0",
        "running=0",
        "kv_utilization=0",
    ] {
        assert!(line.contains(expected), "{expected} missing: {line}");
    }
    assert!(number(line, "predicted_ms") > 0.0, "{line}");
    assert!(number(line, "uncached_tokens") > 0.0, "{line}");
    // No engine count came: the decision's guess was learnt.
    assert_eq!(
        number(line, "guessed_uncached_tokens"),
        number(line, "uncached_tokens"),
        "{line}"
    );
    assert!(!text.contains("prompt-marker-78"), "{text}");

    // An answer whose engine says it had all but 4 of its 100 tokens
    // cached: the model learns that count, and the line keeps the guess.
    let (_, mut stream) = client
        .decide(&chat("prompt-marker-79", "req-44"))
        .await
        .unwrap();
    stream
        .response_headers(200, Some("10.0.0.9:8000"), Some(20.0))
        .await
        .unwrap();
    let usage = r#"{"usage":{"prompt_tokens":100,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":96}}}"#;
    stream.finish_with(usage).await.unwrap();
    let lines = wait_for_lines_with(&["TTFT sample learnt", "req-44"]).await;
    assert_eq!(lines.len(), 1, "{}", logs().text());
    let line = &lines[0];
    assert!(number(line, "guessed_uncached_tokens") > 1.0, "{line}");
    assert!(number(line, "uncached_tokens") < 1.0, "{line}");
}
