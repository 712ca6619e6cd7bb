//! Prometheus metrics and the operator's small HTTP server (`/metrics`,
//! `/healthz`, `/readyz`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::shutdown::Shutdown;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabel {
    error: &'static str,
}

/// The operator's metrics. Cheap to clone; clones share the counters, so a
/// test can hand one to `run` and read it afterwards.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Registry,
    reconciles: Family<ResultLabel, Counter>,
    errors: Family<ErrorLabel, Counter>,
    duration: Histogram,
    leader: Gauge,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("reconciles_ok", &self.reconciles("success"))
            .field("reconciles_err", &self.reconciles("error"))
            .finish()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kinference_operator");
        let reconciles = Family::<ResultLabel, Counter>::default();
        registry.register(
            "reconciles",
            "InferencePolicy reconciles, by result (success or error)",
            reconciles.clone(),
        );
        let errors = Family::<ErrorLabel, Counter>::default();
        registry.register(
            "reconcile_errors",
            "Failed reconciles, by what failed (get, list, apply, delete, status)",
            errors.clone(),
        );
        // 5 ms .. ~20 s: a reconcile is a handful of API round trips.
        let duration = Histogram::new(exponential_buckets(0.005, 2.0, 13));
        registry.register(
            "reconcile_duration_seconds",
            "Time spent in one reconcile",
            duration.clone(),
        );
        // Every series from 0: an alert on `increase(...) > 0` sees the
        // first failure, not only the second, and dashboards a flat line.
        for result in ["success", "error"] {
            reconciles.get_or_create(&ResultLabel { result }).inc_by(0);
        }
        for error in crate::Error::METRIC_LABELS {
            errors.get_or_create(&ErrorLabel { error }).inc_by(0);
        }
        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease (or runs without leader election)",
            leader.clone(),
        );
        Self {
            inner: Arc::new(Inner {
                registry,
                reconciles,
                errors,
                duration,
                leader,
            }),
        }
    }

    pub(crate) fn reconciled(&self, elapsed: Duration, error: Option<&'static str>) {
        let result = if error.is_some() { "error" } else { "success" };
        self.inner
            .reconciles
            .get_or_create(&ResultLabel { result })
            .inc();
        if let Some(error) = error {
            self.inner.errors.get_or_create(&ErrorLabel { error }).inc();
        }
        self.inner.duration.observe(elapsed.as_secs_f64());
    }

    pub(crate) fn set_leader(&self, leader: bool) {
        self.inner.leader.set(i64::from(leader));
    }

    /// Reconciles finished with `result` (`success` or `error`) so far.
    pub fn reconciles(&self, result: &str) -> u64 {
        let result = match result {
            "success" => "success",
            "error" => "error",
            _ => return 0,
        };
        self.inner
            .reconciles
            .get_or_create(&ResultLabel { result })
            .get()
    }

    /// All reconciles finished so far, whatever their result.
    pub fn reconciles_total(&self) -> u64 {
        self.reconciles("success") + self.reconciles("error")
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.inner.registry).expect("writing to a String cannot fail");
        out
    }
}

/// Liveness and readiness of the process, for `/healthz` and `/readyz`.
#[derive(Clone, Debug, Default)]
pub struct Health {
    ready: Arc<AtomicBool>,
}

impl Health {
    /// Ready once the operator runs: as leader with its watches started, or
    /// as a standby waiting for the Lease (a standby is healthy too).
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }
}

#[derive(Clone)]
struct HttpState {
    metrics: Metrics,
    health: Health,
}

pub fn router(metrics: Metrics, health: Health) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(HttpState { metrics, health })
}

async fn metrics_handler(State(state): State<HttpState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

async fn readyz(State(state): State<HttpState>) -> impl IntoResponse {
    if state.health.is_ready() {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}

/// Serves [`router`] on `addr` until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    health: Health,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz and /readyz");
    axum::serve(listener, router(metrics, health))
        .with_graceful_shutdown(async move { shutdown.wait().await })
        .await
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn http_get(addr: SocketAddr, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await
            .unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).await.unwrap();
        out
    }

    #[test]
    fn counts_and_renders() {
        let m = Metrics::new();
        let fresh = m.render();
        for series in [
            "kinference_operator_reconciles_total{result=\"error\"} 0",
            "kinference_operator_reconcile_errors_total{error=\"conflict\"} 0",
        ] {
            assert!(fresh.contains(series), "every series starts at 0: {fresh}");
        }
        m.reconciled(Duration::from_millis(12), None);
        m.reconciled(Duration::from_millis(30), Some("apply"));
        m.set_leader(true);
        assert_eq!(m.reconciles("success"), 1);
        assert_eq!(m.reconciles("error"), 1);
        assert_eq!(m.reconciles_total(), 2);
        let text = m.render();
        assert!(
            text.contains("kinference_operator_reconciles_total{result=\"success\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kinference_operator_reconcile_errors_total{error=\"apply\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kinference_operator_reconcile_duration_seconds_count 2"),
            "{text}"
        );
        assert!(text.contains("kinference_operator_leader 1"), "{text}");
    }

    #[tokio::test]
    async fn serves_metrics_and_health() {
        let metrics = Metrics::new();
        metrics.reconciled(Duration::from_millis(1), None);
        let health = Health::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = router(metrics, health.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });

        assert!(http_get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        assert!(http_get(addr, "/readyz").await.starts_with("HTTP/1.1 503"));
        health.set_ready(true);
        assert!(http_get(addr, "/readyz").await.starts_with("HTTP/1.1 200"));
        let metrics = http_get(addr, "/metrics").await;
        assert!(
            metrics.contains("kinference_operator_reconciles_total{result=\"success\"} 1"),
            "{metrics}"
        );
    }
}
