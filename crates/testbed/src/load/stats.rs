//! Latency statistics of a phase and the small formatting helpers of the
//! load reports.

use std::time::Duration;

/// What one phase runs: `concurrency` closed-loop clients send `warmup`
/// requests that are not measured, then `requests` that are, unless
/// `max_time` runs out first.
#[derive(Clone, Copy, Debug)]
pub struct PhaseSpec {
    pub concurrency: usize,
    pub warmup: u64,
    pub requests: u64,
    pub max_time: Duration,
}

/// The measured requests of a phase as its clients saw them: one latency per
/// answered request, and errors counted (the first one kept). Each client
/// keeps its own; [`Tally::merge`] joins them and [`Tally::sort`] readies the
/// quantiles.
#[derive(Debug, Default)]
pub struct Tally {
    pub latencies: Vec<Duration>,
    pub errors: u64,
    pub first_error: Option<String>,
}

impl Tally {
    /// Counts an error; the first one is kept for the report.
    pub fn error(&mut self, e: impl std::fmt::Display) {
        self.errors += 1;
        self.first_error.get_or_insert_with(|| format!("{e:#}"));
    }

    /// Adds another client's tally (its first error only if none is kept).
    pub fn merge(&mut self, other: Tally) {
        self.latencies.extend(other.latencies);
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }

    /// Sorts the latencies, for [`Tally::quantile`] and [`Tally::max`].
    pub fn sort(&mut self) {
        self.latencies.sort_unstable();
    }

    /// Requests answered or failed.
    pub fn measured(&self) -> u64 {
        self.latencies.len() as u64 + self.errors
    }

    /// See [`quantile`]; the tally must be sorted.
    pub fn quantile(&self, q: f64) -> Duration {
        quantile(&self.latencies, q)
    }

    /// The slowest answer (zero when none); the tally must be sorted.
    pub fn max(&self) -> Duration {
        self.latencies.last().copied().unwrap_or_default()
    }
}

/// The `q` quantile (0..=1) of sorted samples by nearest rank: the
/// ⌈n·q⌉-th smallest (the smallest for q = 0); zero when there are none.
pub fn quantile<T: Copy + Default>(sorted: &[T], q: f64) -> T {
    if sorted.is_empty() {
        return T::default();
    }
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    sorted[i - 1]
}

/// The largest share of the sorted samples that one value predicts within
/// `tolerance` of each (|p − o| ≤ tolerance·o, as the EPP's prediction error
/// is measured): what a predictor that knew the distribution beforehand, and
/// nothing about each request, would score. Where the samples' spread
/// comes from noise no feature explains, no predictor scores much more.
pub fn best_single_prediction_share(sorted: &[Duration], tolerance: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    if tolerance >= 1.0 {
        return Some(1.0);
    }
    // p fits o in [p/(1+t), p/(1-t)]: a window of this ratio.
    let span = (1.0 + tolerance) / (1.0 - tolerance);
    let (mut best, mut end) = (0, 0);
    for (start, low) in sorted.iter().enumerate() {
        let top = low.as_secs_f64() * span;
        end = end.max(start);
        while end < sorted.len() && sorted[end].as_secs_f64() <= top {
            end += 1;
        }
        best = best.max(end - start);
    }
    Some(best as f64 / sorted.len() as f64)
}

/// Milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Microseconds of `cpu` per request over `requests` (at least one).
pub fn per_request_us(cpu: Duration, requests: u64) -> f64 {
    cpu.as_secs_f64() * 1e6 / requests.max(1) as f64
}

/// `a ÷ b` as `1.23×`, or `n/a` when `b` is too small (≤ 0.005) for the
/// ratio to mean anything (also when it is negative: an added latency below
/// the baseline's).
pub fn ratio(a: f64, b: f64) -> String {
    if b > 0.005 {
        format!("{:.2}×", a / b)
    } else {
        "n/a".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn millis(v: &[u64]) -> Vec<Duration> {
        v.iter().copied().map(Duration::from_millis).collect()
    }

    #[test]
    fn the_best_single_prediction_covers_the_densest_window() {
        // Within 25%: p = 15 ms fits 12 to 20 ms, 8 of 10 samples.
        let spread = millis(&(10..=19).collect::<Vec<_>>());
        assert_eq!(best_single_prediction_share(&spread, 0.25), Some(0.8));
        let tight = millis(&[20, 20, 21, 22, 500]);
        assert_eq!(best_single_prediction_share(&tight, 0.25), Some(0.8));
        assert_eq!(best_single_prediction_share(&tight, 1.0), Some(1.0));
        assert_eq!(best_single_prediction_share(&[], 0.25), None);
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let sorted = millis(&(1..=100).collect::<Vec<_>>());
        assert_eq!(quantile(&sorted, 0.50), Duration::from_millis(50));
        assert_eq!(quantile(&sorted, 0.90), Duration::from_millis(90));
        assert_eq!(quantile(&sorted, 0.99), Duration::from_millis(99));
        assert_eq!(quantile(&sorted, 0.995), Duration::from_millis(100));
        assert_eq!(quantile(&sorted, 1.0), Duration::from_millis(100));
        assert_eq!(quantile(&sorted, 0.0), Duration::from_millis(1));

        let few = millis(&[3, 7, 20]);
        assert_eq!(quantile(&few, 0.5), Duration::from_millis(7));
        assert_eq!(quantile(&few, 0.99), Duration::from_millis(20));
        assert_eq!(quantile(&few[..1], 0.5), Duration::from_millis(3));
        assert_eq!(quantile::<Duration>(&[], 0.5), Duration::ZERO);
    }

    #[test]
    fn ratios_and_units() {
        assert_eq!(ratio(3.0, 2.0), "1.50×");
        assert_eq!(ratio(1.0, 3.0), "0.33×");
        assert_eq!(ratio(-2.0, 4.0), "-0.50×");
        assert_eq!(ratio(1.0, 0.005), "n/a");
        assert_eq!(ratio(1.0, 0.0), "n/a");
        assert_eq!(ratio(1.0, -2.0), "n/a");
        assert_eq!(ms(Duration::from_micros(2_500)), 2.5);
        assert_eq!(per_request_us(Duration::from_millis(3), 1_000), 3.0);
        assert_eq!(per_request_us(Duration::from_millis(3), 0), 3_000.0);
    }

    #[test]
    fn tallies_merge() {
        let mut a = Tally {
            latencies: millis(&[5, 1]),
            ..Tally::default()
        };
        a.error("first");
        a.error("second");
        let mut b = Tally {
            latencies: millis(&[3]),
            ..Tally::default()
        };
        b.error("third");
        a.merge(b);
        a.sort();
        assert_eq!(a.latencies, millis(&[1, 3, 5]));
        assert_eq!(a.errors, 3);
        assert_eq!(a.measured(), 6);
        assert_eq!(a.first_error.as_deref(), Some("first"));
        assert_eq!(a.quantile(0.5), Duration::from_millis(3));
        assert_eq!(a.max(), Duration::from_millis(5));
        assert_eq!(Tally::default().max(), Duration::ZERO);

        let mut empty = Tally::default();
        empty.merge(Tally {
            first_error: Some("from a client".into()),
            errors: 1,
            ..Tally::default()
        });
        assert_eq!(empty.first_error.as_deref(), Some("from a client"));
    }
}
