//! What the closed-loop load benchmarks (`epp/benches/envoy_load.rs`,
//! `epp/benches/extproc_load.rs`) share: CPU accounting from Linux `/proc`
//! ([`cpu`]), the bookkeeping of one measured phase ([`phase`]), latency
//! statistics and report formatting ([`stats`]), and the knobs and runtimes
//! below.
//!
//! The benches run their servers and their load generator in separate tokio
//! runtimes with named threads (see [`runtime`]), so the CPU time of each can
//! be read apart from `/proc/self/task`.

pub mod cpu;
pub mod phase;
pub mod stats;

pub use cpu::{Clocks, Cpu, Mark};
pub use phase::{Outcome, Phase, Turn, Window};
pub use stats::{
    PhaseSpec, Tally, best_single_prediction_share, ms, per_request_us, quantile, ratio,
};

use std::time::Duration;

/// The environment variable `name` as a number; `default` when it is unset
/// or not a number.
pub fn env_or(name: &str, default: u64) -> u64 {
    parse_or(std::env::var(name).ok().as_deref(), default)
}

fn parse_or(value: Option<&str>, default: u64) -> u64 {
    value.and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A multi-threaded tokio runtime with `workers` workers (at least one)
/// whose threads are named `name`, so that [`cpu::threads_cpu`] reads their
/// CPU time apart. Idle blocking-pool threads are kept for an hour: a thread
/// that exits takes its CPU time with it.
pub fn runtime(name: &str, workers: usize) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers.max(1))
        .thread_name(name)
        .thread_keep_alive(Duration::from_secs(3600))
        .enable_all()
        .build()
}

/// The machine's cores, as the standard library sees them (1 when unknown).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
}

/// Sum over all label sets of the series `name` in a Prometheus text page
/// (`name` exactly, so `x_count` and `x_sum` are separate series; comments
/// never match).
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knobs_fall_back_to_the_default() {
        assert_eq!(parse_or(Some("250"), 7), 250);
        assert_eq!(parse_or(Some("2.5"), 7), 7);
        assert_eq!(parse_or(Some(""), 7), 7);
        assert_eq!(parse_or(None, 7), 7);
        assert_eq!(
            env_or("KINFERENCE_TESTBED_LOAD_SURELY_UNSET_VARIABLE", 11),
            11
        );
    }

    #[test]
    fn metric_sum_adds_label_sets_of_one_series() {
        let page = "\
# HELP kinference_epp_decision_duration_seconds Time to decide.
# TYPE kinference_epp_decision_duration_seconds histogram
kinference_epp_decision_duration_seconds_sum{rule=\"a\"} 0.25
kinference_epp_decision_duration_seconds_count{rule=\"a\"} 10
kinference_epp_decision_duration_seconds_count{rule=\"b\"} 5
kinference_epp_decision_duration_seconds_count_other 100
kinference_epp_classifier_timeouts_total 3
kinference_epp_classifier_timeouts_total{classifier=\"pii\"} 2
";
        assert_eq!(
            metric_sum(page, "kinference_epp_decision_duration_seconds_count"),
            15.0
        );
        assert_eq!(
            metric_sum(page, "kinference_epp_decision_duration_seconds_sum"),
            0.25
        );
        assert_eq!(
            metric_sum(page, "kinference_epp_classifier_timeouts_total"),
            5.0
        );
        assert_eq!(metric_sum(page, "kinference_epp_classifier_timeouts"), 0.0);
        assert_eq!(
            metric_sum(page, "kinference_epp_decision_duration_seconds"),
            0.0
        );
    }

    #[test]
    fn a_runtime_names_its_threads() {
        let rt = runtime("tb-load-test", 0).unwrap();
        let name = rt.block_on(async {
            tokio::spawn(async { std::thread::current().name().map(str::to_string) })
                .await
                .unwrap()
        });
        assert_eq!(name.as_deref(), Some("tb-load-test"));
        assert!(cores() >= 1);
    }
}
