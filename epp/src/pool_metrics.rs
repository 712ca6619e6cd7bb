//! The Inference Extension's pool-level series, under its names and labels
//! (`name` is the InferencePool's), so dashboards and autoscalers written
//! for the reference EPP keep working: the average KV-cache use, queue and
//! running requests over the Pods with fresh metrics, each Pod's queue, and
//! the Ready Pods.

use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, OnceLock};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::endpoints::EndpointView;
use kinference_runtime::sync::lock;

type Labels = Vec<(String, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

pub struct PoolMetrics {
    /// The pool's name; unset, nothing is exported.
    name: OnceLock<String>,
    registry: Mutex<Registry>,
    kv: Family<Labels, FloatGauge>,
    queue: Family<Labels, FloatGauge>,
    running: Family<Labels, FloatGauge>,
    per_pod_queue: Family<Labels, FloatGauge>,
    ready: Family<Labels, Gauge>,
}

impl Default for PoolMetrics {
    fn default() -> Self {
        let (kv, queue, running, per_pod_queue, ready) = Default::default();
        let mut r = Registry::default();
        r.register(
            "inference_pool_average_kv_cache_utilization",
            "The average KV-cache use (0 to 1) of the pool's Pods with fresh metrics",
            Family::clone(&kv),
        );
        r.register(
            "inference_pool_average_queue_size",
            "The average number of requests waiting in the pool's model servers",
            Family::clone(&queue),
        );
        r.register(
            "inference_pool_average_running_requests",
            "The average number of requests running in the pool's model servers",
            Family::clone(&running),
        );
        r.register(
            "inference_pool_per_pod_queue_size",
            "Requests waiting in each model server of the pool",
            Family::clone(&per_pod_queue),
        );
        r.register(
            "inference_pool_ready_pods",
            "The pool's Ready Pods (one per target port)",
            Family::clone(&ready),
        );
        PoolMetrics {
            name: OnceLock::new(),
            registry: Mutex::new(r),
            kv,
            queue,
            running,
            per_pod_queue,
            ready,
        }
    }
}

impl PoolMetrics {
    /// Exports the series for the pool `name`; the first name given stays.
    pub fn set_pool_name(&self, name: &str) {
        let _ = self.name.set(name.to_string());
    }

    /// The exposition of the pool's series over `endpoints`, ending with
    /// `# EOF`; empty when no pool name was given.
    pub fn render(&self, endpoints: &[EndpointView]) -> String {
        let Some(name) = self.name.get() else {
            return String::new();
        };
        let pool = vec![("name".to_string(), name.clone())];
        self.per_pod_queue.clear();
        let fresh: Vec<_> = endpoints
            .iter()
            .filter_map(|v| Some((v, v.metrics.as_ref()?)))
            .collect();
        let mean = |f: &dyn Fn(&crate::endpoints::ScrapedMetrics) -> f64| {
            if fresh.is_empty() {
                0.0
            } else {
                fresh.iter().map(|(_, m)| f(m)).sum::<f64>() / fresh.len() as f64
            }
        };
        self.kv
            .get_or_create(&pool)
            .set(mean(&|m| m.kv_cache_usage));
        self.queue.get_or_create(&pool).set(mean(&|m| m.waiting));
        self.running.get_or_create(&pool).set(mean(&|m| m.running));
        for (view, m) in &fresh {
            let mut l = pool.clone();
            l.push(("model_server_pod".to_string(), view.endpoint.name.clone()));
            self.per_pod_queue.get_or_create(&l).set(m.waiting);
        }
        self.ready.get_or_create(&pool).set(endpoints.len() as i64);
        let mut out = String::new();
        let registry = lock(&self.registry);
        encode(&mut out, &registry).expect("encoding to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use crate::endpoints::{EndpointSpec, ScrapedMetrics, endpoints_from_specs};
    use crate::server::{Epp, Settings};

    fn epp_with_two_pods() -> Epp {
        let epp = Epp::new(Settings::default());
        let specs = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
            .map(|a| EndpointSpec::new(a, &["m"]));
        epp.registry()
            .replace_all(endpoints_from_specs(specs).unwrap());
        let endpoints = epp.registry().endpoints();
        for (ep, (waiting, running, kv)) in
            endpoints.iter().zip([(2.0, 4.0, 0.5), (4.0, 0.0, 0.25)])
        {
            let scraped = ScrapedMetrics {
                waiting,
                running,
                kv_cache_usage: kv,
                ..ScrapedMetrics::empty(Instant::now())
            };
            epp.registry().set_metrics(&ep.name, scraped);
        }
        epp
    }

    /// The reference EPP's series, names and labels as its dashboards read
    /// them, averaged over the Pods with metrics (the third has none yet).
    #[test]
    fn the_pool_series_are_the_reference_epps() {
        let epp = epp_with_two_pods();
        let without = epp.picker.metrics.render(epp.registry(), None);
        assert!(
            !without.contains("inference_pool_"),
            "no pool name, no series"
        );
        epp.picker.metrics.pool.set_pool_name("vllm");
        let text = epp.picker.metrics.render(epp.registry(), None);
        for line in [
            "inference_pool_average_kv_cache_utilization{name=\"vllm\"} 0.375",
            "inference_pool_average_queue_size{name=\"vllm\"} 3.0",
            "inference_pool_average_running_requests{name=\"vllm\"} 2.0",
            "inference_pool_ready_pods{name=\"vllm\"} 3",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }
        let per_pod = text
            .lines()
            .filter(|l| l.starts_with("inference_pool_per_pod_queue_size{"))
            .count();
        assert_eq!(per_pod, 2, "{text}");
        // One exposition: one `# EOF`, last, and every line still ours too.
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        assert!(text.ends_with("# EOF\n"));
        assert!(text.contains("\nkinference_epp_decision_duration_seconds_count 0\n"));
    }
}
