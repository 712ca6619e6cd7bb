//! The TTFT histogram, with vLLM's buckets.

/// Upper bounds of the TTFT histogram buckets, in seconds (vLLM's).
pub(crate) const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// A Prometheus histogram over [`TTFT_BUCKETS`].
#[derive(Debug, Clone, Default)]
pub(crate) struct Histogram {
    /// Non-cumulative counts per bucket; observations above the last bound
    /// only appear in `count` (the `+Inf` bucket).
    pub(crate) buckets: [u64; TTFT_BUCKETS.len()],
    pub(crate) sum: f64,
    pub(crate) count: u64,
}

impl Histogram {
    pub(crate) fn observe(&mut self, value: f64) {
        if let Some(i) = TTFT_BUCKETS.iter().position(|&le| value <= le) {
            self.buckets[i] += 1;
        }
        self.sum += value;
        self.count += 1;
    }
}
