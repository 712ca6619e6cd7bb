//! Prometheus metrics of the EPP (served on `/metrics`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::classify::ClassifierError;
use crate::endpoints::EndpointRegistry;
use crate::endpoints::ScrapeStats;
use kinference_runtime::sync::lock;

type Labels = Vec<(String, String)>;

/// How a decision ended, for [`Metrics::observe_decision`].
#[derive(Debug, Clone, Copy)]
pub enum DecisionOutcome {
    Local,
    Provider,
    Reject { status: u16 },
}

pub struct Metrics {
    registry: Mutex<Registry>,
    decisions: Family<Labels, Counter>,
    decision_seconds: Histogram,
    rejects: Family<Labels, Counter>,
    classifier_seconds: Family<Labels, Histogram>,
    classifier_timeouts: Family<Labels, Counter>,
    classifier_failures: Family<Labels, Counter>,
    bad_requests: Family<Labels, Counter>,
    endpoint_waiting: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    endpoint_running: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    endpoint_kv: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    endpoint_stale: Family<Labels, Gauge>,
    /// Precise mode only: each Pod's KV-event index state.
    kv_index: Family<Labels, Gauge>,
    kv_index_on: AtomicBool,
    policy_info: Family<Labels, Gauge>,
    /// 1 when Ready (`/readyz`), else 0: a policy, synced discovery,
    /// every background task running.
    ready: Gauge,
    streams_open: Gauge,
    buffered_body_bytes: Gauge,
    stream_refusals: Family<Labels, Counter>,
    ttft_prediction_error: Family<Labels, Histogram>,
    cached_prefix_error: Family<Labels, Histogram>,
    fallback_answers: Counter,
    scrape: Arc<ScrapeStats>,
    /// The Inference Extension's `inference_pool_*` series.
    pub pool: crate::pool_metrics::PoolMetrics,
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl Default for Metrics {
    fn default() -> Self {
        let decisions = Family::<Labels, Counter>::default();
        let decision_seconds = Histogram::new(exponential_buckets(0.000_005, 2.0, 20));
        let rejects = Family::<Labels, Counter>::default();
        let classifier_seconds = Family::<Labels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.000_01, 2.0, 18))
        });
        let classifier_timeouts = Family::<Labels, Counter>::default();
        let classifier_failures = Family::<Labels, Counter>::default();
        let bad_requests = Family::<Labels, Counter>::default();
        let endpoint_waiting = Family::default();
        let endpoint_running = Family::default();
        let endpoint_kv = Family::default();
        let endpoint_stale = Family::<Labels, Gauge>::default();
        let kv_index = Family::<Labels, Gauge>::default();
        let policy_info = Family::<Labels, Gauge>::default();
        let streams_open = Gauge::default();
        let buffered_body_bytes = Gauge::default();
        let stream_refusals = Family::<Labels, Counter>::default();
        let ttft_prediction_error = Family::<Labels, Histogram>::new_with_constructor(|| {
            Histogram::new([0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0])
        });
        let cached_prefix_error = Family::<Labels, Histogram>::new_with_constructor(|| {
            Histogram::new([0.01, 0.05, 0.1, 0.25, 0.5, 1.0])
        });
        let scrape = Arc::new(ScrapeStats::default());
        let mut r = Registry::with_prefix("kinference_epp");
        r.register(
            "decisions",
            "Routing decisions by rule and outcome",
            decisions.clone(),
        );
        r.register(
            "decision_duration_seconds",
            "Time to decide, classifiers included",
            decision_seconds.clone(),
        );
        r.register(
            "rejects",
            "Rejected requests by status and reason",
            rejects.clone(),
        );
        r.register(
            "classifier_duration_seconds",
            "Classifier run time",
            classifier_seconds.clone(),
        );
        r.register(
            "classifier_timeouts",
            "Classifier runs that timed out (no tags)",
            classifier_timeouts.clone(),
        );
        r.register(
            "classifier_failures",
            "Classifier runs that failed (no tags), by kind: unreachable, status, bad_answer, internal",
            classifier_failures.clone(),
        );
        r.register(
            "bad_requests",
            "Requests refused before routing, by reason",
            bad_requests.clone(),
        );
        r.register(
            "endpoint_waiting_requests",
            "Scraped queue depth per endpoint",
            endpoint_waiting.clone(),
        );
        r.register(
            "endpoint_running_requests",
            "Scraped running requests per endpoint",
            endpoint_running.clone(),
        );
        r.register(
            "endpoint_kv_cache_utilization",
            "Scraped KV-cache utilization per endpoint",
            endpoint_kv.clone(),
        );
        r.register(
            "endpoint_metrics_stale",
            "1 when an endpoint's metrics are stale or missing",
            endpoint_stale.clone(),
        );
        r.register(
            "kv_events_index",
            "Precise prefix mode: 1 for each endpoint's KV-event index state (live: used; partial: joined after the engine's first batch without a replay, used with the estimate; empty: nothing published yet; stale: events lost and not replayed; silent: nothing published for 10 s since it was sent a request). In empty, stale and silent the endpoint's cached prefix is estimated",
            kv_index.clone(),
        );
        r.register(
            "policy_info",
            "The loaded policy (hash label)",
            policy_info.clone(),
        );
        let ready = Gauge::default();
        r.register(
            "ready",
            "1 when the EPP is ready (a policy loaded, discovery synced, every task running), else 0",
            ready.clone(),
        );
        r.register(
            "streams_open",
            "ext_proc streams open now",
            streams_open.clone(),
        );
        r.register(
            "buffered_body_bytes",
            "Request-body bytes buffered across all streams",
            buffered_body_bytes.clone(),
        );
        r.register(
            "stream_refusals",
            "Streams answered before routing to protect the EPP, by reason (body_budget, idle_timeout)",
            stream_refusals.clone(),
        );
        r.register(
            "ttft_prediction_relative_error",
            "|predicted - observed| / observed TTFT of each routed request the model predicted, by direction (over: predicted too slow, under: too fast)",
            ttft_prediction_error.clone(),
        );
        r.register(
            "cached_prefix_prediction_error",
            "|predicted - reported| cached prompt tokens as a share of the prompt, for each answer from a Pod that reported both (vLLM: --enable-prompt-tokens-details), by the prediction's source (events: the Pod's KV events; estimate: what was routed there)",
            cached_prefix_error.clone(),
        );
        let fallback_answers = Counter::default();
        r.register(
            "fallback_answers",
            "Answers from another Pod than the one picked, as the gateway reported the Pod that answered: the pick failed and the gateway went down the fallback list",
            fallback_answers.clone(),
        );
        // kinference_epp_scrape_attempts_total, _scrape_failures_total{reason}
        scrape.register(&mut r);
        Metrics {
            registry: Mutex::new(r),
            decisions,
            decision_seconds,
            rejects,
            classifier_seconds,
            classifier_timeouts,
            classifier_failures,
            bad_requests,
            endpoint_waiting,
            endpoint_running,
            endpoint_kv,
            endpoint_stale,
            kv_index,
            kv_index_on: AtomicBool::new(false),
            policy_info,
            streams_open,
            buffered_body_bytes,
            stream_refusals,
            ttft_prediction_error,
            cached_prefix_error,
            fallback_answers,
            scrape,
            ready,
            pool: Default::default(),
        }
    }
}

impl Metrics {
    /// The scrape counters rendered here; hand them to
    /// [`crate::endpoints::spawn_scraper_with_stats`].
    pub(crate) fn scrape_stats(&self) -> Arc<ScrapeStats> {
        Arc::clone(&self.scrape)
    }

    /// One decision: its rule (empty when none matched) and outcome
    /// (`local`, `provider`, `reject`); a reject also counts by status.
    pub fn observe_decision(&self, rule: &str, outcome: DecisionOutcome, took: Duration) {
        self.decision_seconds.observe(took.as_secs_f64());
        let outcome = match outcome {
            DecisionOutcome::Local => "local",
            DecisionOutcome::Provider => "provider",
            DecisionOutcome::Reject { status } => {
                let reason = if rule.is_empty() { "no_rule" } else { "rule" };
                self.rejects
                    .get_or_create(&labels(&[
                        ("status", &status.to_string()),
                        ("reason", reason),
                    ]))
                    .inc();
                "reject"
            }
        };
        self.decisions
            .get_or_create(&labels(&[("rule", rule), ("outcome", outcome)]))
            .inc();
    }

    /// How far the TTFT the decision predicted was from the one observed.
    pub fn observe_ttft_prediction(&self, predicted: f64, observed: f64) {
        if !(observed > 0.0 && predicted.is_finite()) {
            return;
        }
        let direction = if predicted >= observed {
            "over"
        } else {
            "under"
        };
        self.ttft_prediction_error
            .get_or_create(&labels(&[("direction", direction)]))
            .observe((predicted - observed).abs() / observed);
    }

    /// How far the cached prefix the decision counted on was from the one
    /// the engine reported, as a share of the prompt.
    pub fn observe_cached_prefix_prediction(
        &self,
        source: &str,
        predicted: f64,
        reported: u64,
        prompt: u64,
    ) {
        if prompt == 0 || !predicted.is_finite() {
            return;
        }
        self.cached_prefix_error
            .get_or_create(&labels(&[("source", source)]))
            .observe((predicted - reported as f64).abs() / prompt as f64);
    }

    pub fn observe_classifier(&self, name: &str, took: Duration, error: Option<ClassifierError>) {
        let l = labels(&[("classifier", name)]);
        self.classifier_seconds
            .get_or_create(&l)
            .observe(took.as_secs_f64());
        match error {
            None => {}
            Some(ClassifierError::Timeout) => {
                self.classifier_timeouts.get_or_create(&l).inc();
            }
            Some(kind) => {
                let l = labels(&[("classifier", name), ("kind", kind.as_str())]);
                self.classifier_failures.get_or_create(&l).inc();
            }
        }
    }

    /// Serves `counter` as `kinference_epp_policy_refusals_total`.
    pub(crate) fn register_policy_refusals(&self, counter: Counter) {
        self.register_counter(
            "policy_refusals",
            "New policies refused (invalid, unreadable); the last good one keeps serving",
            counter,
        );
    }

    /// A counter served as `kinference_epp_decision_log_dropped_total`.
    pub fn decision_log_dropped(&self) -> Counter {
        let counter = Counter::default();
        self.register_counter(
            "decision_log_dropped",
            "Decision-log records dropped because the writer fell behind",
            counter.clone(),
        );
        counter
    }

    /// Registers a counter another part owns, after start-up.
    pub(crate) fn register_counter(&self, name: &str, help: &str, counter: Counter) {
        self.register_metric(name, help, counter);
    }

    /// Serves `metric` as `kinference_epp_<name>`.
    pub(crate) fn register_metric(
        &self,
        name: &str,
        help: &str,
        metric: impl prometheus_client::registry::Metric,
    ) {
        let mut registry = lock(&self.registry);
        registry.register(name, help, metric);
    }

    /// The open-streams gauge, for [`crate::extproc::limits::StreamGuard`].
    pub(crate) fn streams_open(&self) -> &Gauge {
        &self.streams_open
    }

    /// The gauge [`crate::extproc::limits::BodyBudget`] counts in.
    pub(crate) fn buffered_body_bytes(&self) -> Gauge {
        self.buffered_body_bytes.clone()
    }

    pub(crate) fn stream_refused(&self, reason: &str) {
        self.stream_refusals
            .get_or_create(&labels(&[("reason", reason)]))
            .inc();
    }

    /// The gateway reported another Pod than the pick as the one that
    /// answered.
    pub(crate) fn fallback_answered(&self) {
        self.fallback_answers.inc();
    }

    pub(crate) fn bad_request(&self, reason: &str) {
        self.bad_requests
            .get_or_create(&labels(&[("reason", reason)]))
            .inc();
    }

    /// Whether the EPP is ready, as `/readyz` says, for the next render.
    pub fn set_ready(&self, ready: bool) {
        self.ready.set(i64::from(ready));
    }

    /// Precise mode is on: export each endpoint's KV-event index state.
    pub fn export_kv_index_states(&self) {
        self.kv_index_on.store(true, Ordering::Relaxed);
    }

    /// Renders the exposition, refreshing per-endpoint gauges first.
    pub fn render(&self, endpoints: &EndpointRegistry, policy_hash: Option<&str>) -> String {
        self.endpoint_waiting.clear();
        self.endpoint_running.clear();
        self.endpoint_kv.clear();
        self.endpoint_stale.clear();
        self.kv_index.clear();
        let kv_index_on = self.kv_index_on.load(Ordering::Relaxed);
        let now = Instant::now();
        for view in endpoints.snapshot().iter() {
            let address = view.endpoint.address();
            if kv_index_on {
                let state = view.state.kv.usage(now).as_str();
                let l = labels(&[
                    ("endpoint", &view.endpoint.name),
                    ("address", &address),
                    ("state", state),
                ]);
                self.kv_index.get_or_create(&l).set(1);
            }
            let l = labels(&[("endpoint", &view.endpoint.name), ("address", &address)]);
            match &view.metrics {
                Some(m) => {
                    self.endpoint_waiting.get_or_create(&l).set(m.waiting);
                    self.endpoint_running.get_or_create(&l).set(m.running);
                    self.endpoint_kv.get_or_create(&l).set(m.kv_cache_usage);
                    self.endpoint_stale.get_or_create(&l).set(0);
                }
                None => {
                    self.endpoint_stale.get_or_create(&l).set(1);
                }
            }
        }
        self.policy_info.clear();
        if let Some(hash) = policy_hash {
            self.policy_info
                .get_or_create(&labels(&[("hash", hash)]))
                .set(1);
        }
        let mut out = String::new();
        let registry = lock(&self.registry);
        encode(&mut out, &registry).expect("encoding to a String cannot fail");
        let pool = self.pool.render(&endpoints.snapshot());
        if !pool.is_empty() {
            // One exposition: a single `# EOF`, the pool's, at the end.
            out.truncate(out.trim_end_matches("# EOF\n").len());
            out.push_str(&pool);
        }
        out
    }
}
