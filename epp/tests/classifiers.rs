//! The classifier runner: built-ins, an external `http` classifier over real
//! HTTP, timeouts (no tags), failures (no tags), concurrency.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::routing::post;
use kinference_epp::classify::{ClassifierError, ClassifierRunner};
use kinference_policy::model::ClassifierSet;
use kinference_policy::source::compile_text;

async fn classifier_server() -> std::net::SocketAddr {
    let app = axum::Router::new()
        .route(
            "/toxicity",
            post(|Json(body): Json<serde_json::Value>| async move {
                let prompt = body["prompt"].as_str().unwrap_or_default().to_string();
                let tag = if prompt.contains("idiot") {
                    "toxic-confirmed"
                } else {
                    "toxic-none"
                };
                // An undeclared tag must be ignored.
                Json(serde_json::json!({ "tags": [tag, "made-up-tag"] }))
            }),
        )
        .route(
            "/slow",
            post(|| async {
                tokio::time::sleep(Duration::from_secs(2)).await;
                Json(serde_json::json!({ "tags": ["slow-none"] }))
            }),
        )
        .route("/garbage", post(|| async { "this is not JSON" }))
        .route(
            "/broken",
            post(|| async { (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "boom") }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

#[tokio::test]
async fn runs_builtin_and_http_classifiers_with_timeouts() {
    let addr = classifier_server().await;
    let policy = compile_text(&format!(
        "pool: {{ selector: {{ app: x }}, targetPorts: [{{ number: 1 }}] }}\nclassifiers:\n  - {{ name: pii, type: pii, timeout: 500ms }}\n  - {{ name: toxicity, type: http, url: \"http://{addr}/toxicity\", tags: [toxic-confirmed, toxic-none], timeout: 1s }}\n  - {{ name: slow, type: http, url: \"http://{addr}/slow\", tags: [slow-none], timeout: 50ms }}\n  - {{ name: broken, type: http, url: \"http://{addr}/broken\", tags: [broken-none], timeout: 1s }}\nrules:\n  - name: r\n    route: {{ select: [{{ minimize: QueueDepth }}] }}\n"
    ))
    .unwrap();
    let runner = ClassifierRunner::default();
    let prompt: Arc<str> = Arc::from("you idiot, my email is maria.gonzalez@fastmail.de");
    let all = (0..4).fold(ClassifierSet::default(), |s, i| s.with(i));
    let started = Instant::now();
    let runs = runner.run(&policy.classifiers, all, &prompt).await;
    // Concurrent: bounded by the slowest timeout, not the sum.
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    let by_index = |i: usize| runs.iter().find(|r| r.index == i).unwrap();
    assert!(
        by_index(0).tags.contains(&"pii-confirmed".to_string()),
        "{:?}",
        by_index(0).tags
    );
    assert_eq!(by_index(1).tags, ["toxic-confirmed"]);
    let slow = by_index(2);
    assert_eq!(slow.error, Some(ClassifierError::Timeout));
    assert!(slow.tags.is_empty());
    let broken = by_index(3);
    assert!(broken.tags.is_empty());
    assert_eq!(broken.error, Some(ClassifierError::Status));
    assert_eq!(by_index(0).error, None);
}

#[tokio::test]
async fn failures_are_told_apart_by_kind_in_the_metrics() {
    let addr = classifier_server().await;
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let policy = compile_text(&format!(
        "pool: {{ selector: {{ app: x }}, targetPorts: [{{ number: 1 }}] }}\nclassifiers:\n  - {{ name: garbage, type: http, url: \"http://{addr}/garbage\", tags: [g-none], timeout: 1s }}\n  - {{ name: gone, type: http, url: \"http://{closed}/x\", tags: [x-none], timeout: 1s }}\n  - {{ name: broken, type: http, url: \"http://{addr}/broken\", tags: [b-none], timeout: 1s }}\nrules:\n  - name: r\n    route: {{ select: [{{ minimize: QueueDepth }}] }}\n"
    ))
    .unwrap();
    let all = (0..3).fold(ClassifierSet::default(), |s, i| s.with(i));
    let runs = ClassifierRunner::default()
        .run(&policy.classifiers, all, &Arc::from("hello"))
        .await;
    let errors: Vec<_> = runs.iter().map(|r| r.error).collect();
    assert_eq!(
        errors,
        [
            Some(ClassifierError::BadAnswer),
            Some(ClassifierError::Unreachable),
            Some(ClassifierError::Status)
        ]
    );
    let metrics = kinference_epp::metrics::Metrics::default();
    for run in &runs {
        metrics.observe_classifier(&policy.classifiers[run.index].name, run.elapsed, run.error);
    }
    let text = metrics.render(
        &kinference_epp::endpoints::EndpointRegistry::new(Duration::from_secs(1)),
        None,
    );
    for (name, kind) in [
        ("garbage", "bad_answer"),
        ("gone", "unreachable"),
        ("broken", "status"),
    ] {
        let line = format!(
            "kinference_epp_classifier_failures_total{{classifier=\"{name}\",kind=\"{kind}\"}} 1"
        );
        assert!(text.contains(&line), "{line} missing:\n{text}");
    }
}

#[tokio::test]
async fn only_requested_classifiers_run() {
    let policy = compile_text(
        "pool: { selector: { app: x }, targetPorts: [{ number: 1 }] }\nclassifiers:\n  - { name: pii, type: pii }\n  - { name: code, type: code }\nrules:\n  - name: r\n    route: { select: [{ minimize: QueueDepth }] }\n",
    )
    .unwrap();
    let runs = ClassifierRunner::default()
        .run(
            &policy.classifiers,
            ClassifierSet::default().with(1),
            &Arc::from("fn main() { println!(\"hi\"); }\n```rust\nlet x = 1;\n```"),
        )
        .await;
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].index, 1);
    assert!(
        runs[0].tags.iter().all(|t| t.starts_with("code-")),
        "{:?}",
        runs[0].tags
    );
}
