//! Prompts routed to one destination in the last moments: what its engine
//! already holds but has not said yet.
//!
//! In precise mode a Pod's KV events are the truth about its cache, but they
//! trail it. An engine stores a prompt's blocks when it starts the request
//! and publishes them later: llm-d-inference-sim batches its events for up
//! to a second, vLLM after the scheduler step, and either then crosses the
//! network. A second request of the same group routed meanwhile would see
//! no cached prefix anywhere, be priced as a full prefill, and be sent
//! wherever the queue is shortest; its TTFT then "beats" the prediction by
//! the whole prefill and the model learns from a mislabelled sample. So a
//! Pod remembers what it was sent for [`WINDOW`], and the picker counts the
//! longer of that and its events.
//!
//! The picker keeps one more for the whole pool, to count how many recent
//! requests shared a prompt's prefix (see `predict::reuse`).
//!
//! Bounded: at most [`MAX_HASHES`] block hashes per destination (64 KiB), or
//! the capacity given, the oldest routes dropped first.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::prefix::{MAX_BLOCKS, leading_run};
use kinference_runtime::sync::lock;

/// How long a route counts: longer than an engine's event delay plus the
/// transport (llm-d-inference-sim's batching alone is 1 s), short enough that
/// the engine has rarely evicted the prompt since.
pub(crate) const WINDOW: Duration = Duration::from_secs(3);

/// Block hashes kept per destination, all routes together.
const MAX_HASHES: usize = 2 * MAX_BLOCKS;

pub struct RoutedPrefixes {
    routes: Mutex<Routes>,
    /// Block hashes kept, all routes together.
    capacity: usize,
}

impl Default for RoutedPrefixes {
    fn default() -> Self {
        Self::with_capacity(MAX_HASHES)
    }
}

#[derive(Default)]
struct Routes {
    /// Oldest first: (when, the prompt's chained block hashes).
    recent: VecDeque<(Instant, Arc<[u64]>)>,
    hashes: usize,
}

impl Routes {
    fn expire(&mut self, now: Instant, capacity: usize) {
        while let Some((at, chain)) = self.recent.front() {
            if now.saturating_duration_since(*at) < WINDOW && self.hashes <= capacity {
                break;
            }
            self.hashes -= chain.len();
            self.recent.pop_front();
        }
    }
}

impl RoutedPrefixes {
    /// Keeps at most `capacity` block hashes, all routes together.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        RoutedPrefixes {
            routes: Mutex::default(),
            capacity,
        }
    }

    /// A request with this chain was routed here at `now`.
    pub fn record(&self, chain: Arc<[u64]>, now: Instant) {
        if chain.is_empty() || chain.len() > self.capacity {
            return;
        }
        let mut routes = lock(&self.routes);
        routes.hashes += chain.len();
        routes.recent.push_back((now, chain));
        routes.expire(now, self.capacity);
    }

    /// Leading blocks of `chain` that a route of the last [`WINDOW`] shared.
    pub fn cached_blocks(&self, chain: &[u64], now: Instant) -> usize {
        self.each_shared(chain, now, |shared| shared.max().unwrap_or(0))
    }

    /// For each route of the last [`WINDOW`] that shared a leading block
    /// with `chain`, how many it shared.
    pub(crate) fn shared_blocks(&self, chain: &[u64], now: Instant) -> Vec<usize> {
        self.each_shared(chain, now, |shared| shared.filter(|&n| n > 0).collect())
    }

    /// `f` over the leading blocks each recent route shares with `chain`.
    fn each_shared<R>(
        &self,
        chain: &[u64],
        now: Instant,
        f: impl FnOnce(&mut dyn Iterator<Item = usize>) -> R,
    ) -> R {
        let mut routes = lock(&self.routes);
        routes.expire(now, self.capacity);
        f(&mut routes
            .recent
            .iter()
            .map(|(_, routed)| common_prefix(routed, chain)))
    }
}

/// Blocks two chains share from the start. The hashes are chained (block i's
/// hash covers blocks 0..=i), so the shared blocks are a leading run.
fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    leading_run(a.len().min(b.len()), |i| a[i] == b[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(group: u64, len: u64) -> Arc<[u64]> {
        // Chained: a block's hash depends on the group and its position, so
        // two chains of one group share every leading block.
        (0..len).map(|i| group * 1_000_000 + i).collect()
    }

    #[test]
    fn a_recent_route_counts_its_shared_prefix() {
        let routed = RoutedPrefixes::default();
        let t0 = Instant::now();
        routed.record(chain(1, 100), t0);
        let mut longer: Vec<u64> = chain(1, 120).to_vec();
        assert_eq!(routed.cached_blocks(&longer, t0), 100);
        longer[40] = 7;
        assert_eq!(routed.cached_blocks(&longer[..41], t0), 40);
        assert_eq!(routed.cached_blocks(&chain(2, 100), t0), 0);
    }

    #[test]
    fn a_route_counts_only_within_the_window() {
        let routed = RoutedPrefixes::default();
        let t0 = Instant::now();
        routed.record(chain(1, 100), t0);
        let within = t0 + WINDOW - Duration::from_millis(1);
        assert_eq!(routed.cached_blocks(&chain(1, 100), within), 100);
        assert_eq!(routed.cached_blocks(&chain(1, 100), t0 + WINDOW), 0);
    }

    #[test]
    fn each_recent_route_tells_how_much_it_shared() {
        let routed = RoutedPrefixes::default();
        let t0 = Instant::now();
        routed.record(chain(1, 100), t0);
        routed.record(chain(2, 100), t0);
        // The same 90 leading blocks, then a question of its own (a chain
        // differs from its first differing block on).
        let question: Vec<u64> = chain(1, 90)
            .iter()
            .chain(&chain(9, 10)[..])
            .copied()
            .collect();
        routed.record(question.into(), t0);
        let mut shared = routed.shared_blocks(&chain(1, 120), t0);
        shared.sort_unstable();
        assert_eq!(shared, vec![90, 100], "the other group shares nothing");
    }

    #[test]
    fn a_larger_capacity_keeps_more_routes() {
        let routed = RoutedPrefixes::with_capacity(10 * MAX_BLOCKS);
        let t0 = Instant::now();
        for group in 0..12 {
            routed.record(chain(group, MAX_BLOCKS as u64), t0);
        }
        assert_eq!(lock(&routed.routes).recent.len(), 10);
    }

    #[test]
    fn memory_is_bounded_oldest_routes_first() {
        let routed = RoutedPrefixes::default();
        let t0 = Instant::now();
        let per = MAX_BLOCKS as u64;
        for group in 0..5 {
            routed.record(chain(group, per), t0);
        }
        let routes = lock(&routed.routes);
        assert!(routes.hashes <= MAX_HASHES, "{}", routes.hashes);
        assert_eq!(routes.recent.len(), 2);
        drop(routes);
        assert_eq!(routed.cached_blocks(&chain(0, per), t0), 0);
        assert_eq!(routed.cached_blocks(&chain(4, per), t0), MAX_BLOCKS);
    }
}
