//! A prefix prefilled once serves every request that shares it: what a
//! hot group's next replica costs each of its requests.
//!
//! `PredictedTTFT` alone is myopic. A group whose Pod is saturated keeps
//! queueing there until the wait exceeds a whole prefill elsewhere (1.5 s
//! for a 6,000-token system prompt), because the request that would seed a
//! second Pod pays that prefill alone. But the second Pod then serves the
//! group's following requests from its cache: the prefill is paid once for
//! all of them. So the prefill a candidate needs beyond the best-cached
//! candidate's is divided among the requests of the last seconds that share
//! it ("reusers"): a group with a hundred requests in the window spreads
//! once its Pod's queue costs more than a hundredth of a prefill, and a
//! prompt nobody else sent is priced in full.
//!
//! Priced alone, this seeded replicas faster than they paid back: each
//! costs a batch slot for a whole prefill and evicts some other prefix, and
//! under load the queues of those prefills made more Pods look worth
//! leaving (the benchmark's median TTFT went from about 20 ms to seconds).
//! So the picker (`picker::placement::replica`) prices a replica only when every Pod
//! holding the prefix has requests waiting as its engine reports, on a Pod
//! with none waiting, with models trained on the Pods' own answers, for a
//! policy that bounds `PredictedTTFT` nowhere (an SLO must see the
//! request's whole prefill), and each EPP process seeds at most one
//! replica per [`SEED_INTERVAL`] (requests decided at the same moment may
//! seed together). The route memory and the gate are each EPP process's
//! own: with several EPP Pods, each counts the reusers it routed.
//!
//! A replica also costs the Pod it lands on: its blocks push out the
//! least recently used ones, and those that requests reused will be
//! prefilled again ([`eviction_cost`], counted by the Pod's prefix index).
//! Unpriced, replicas of a hot group landed on a Pod already holding three
//! other groups and slowed all of them.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;

use kinference_runtime::sync::lock;

/// How often an EPP process seeds a new replica at most: longer than a
/// prefill and the events that follow it, so that a replica shows in the next
/// decisions before another is paid for. Each seed costs one request a
/// whole prefill and its Pod a batch slot for as long; unbounded, a pool
/// under load seeded replicas faster than they paid back and the prefills
/// queued everything behind them (the shared-prefix ladder's median TTFT
/// went from about 20 ms to seconds).
pub(crate) const SEED_INTERVAL: Duration = Duration::from_secs(5);

/// When the pool last paid a prefill for a replica.
#[derive(Default)]
pub struct SeedGate {
    last: Mutex<Option<Instant>>,
    /// Replicas seeded, for the metrics.
    pub seeded: Counter,
}

impl SeedGate {
    /// Whether a replica may be seeded at `now`.
    pub(crate) fn is_open(&self, now: Instant) -> bool {
        lock(&self.last).is_none_or(|last| now.saturating_duration_since(last) >= SEED_INTERVAL)
    }

    /// A request was sent to seed a replica at `now`.
    pub(crate) fn seeded(&self, now: Instant) {
        *lock(&self.last) = Some(now);
        self.seeded.inc();
    }
}

/// How many recent requests would reuse the prefix that a candidate with
/// `cached` tokens lacks and the best-cached one, with `best`, holds.
/// `shared` holds, per recent request, the tokens of this prompt it shared
/// from the start; each counts for the share of that gap it covers.
pub(crate) fn reusers(shared: &[f64], cached: f64, best: f64) -> f64 {
    let gap = best - cached;
    if gap.is_nan() || gap <= 0.0 {
        return 0.0;
    }
    shared
        .iter()
        .map(|&s| ((s - cached) / gap).clamp(0.0, 1.0))
        .filter(|share| share.is_finite())
        .sum()
}

/// What storing a replica costs the prompts it pushes out of the Pod's
/// cache: each evicted token that requests reused is prefilled again by
/// its next reuser, at the per-token cost the replica's own prefill has
/// (`predicted − at_best` for `gap` tokens). A replica seeded on a Pod
/// whose cache is full of other groups' reused prefixes evicted them and
/// slowed all of those groups; on a Pod with room,
/// or with only prompts nobody sent again, it costs nothing. A price that
/// reaches the request's own prediction is no replica: the candidate is
/// then ranked as any other, by that prediction and the room it leaves.
pub(crate) fn eviction_cost(predicted: f64, at_best: f64, gap: f64, evicted: f64) -> f64 {
    let per_token = (predicted - at_best).max(0.0) / gap;
    if per_token.is_finite() {
        per_token * evicted.max(0.0)
    } else {
        0.0
    }
}

/// A candidate's predicted TTFT with the prefill it needs beyond the
/// best-cached candidate's divided among that prefix's `reusers` and this
/// request: `at_best` is its prediction had it held the best's prefix.
pub(crate) fn amortized(predicted: f64, at_best: f64, reusers: f64) -> f64 {
    let extra = (predicted - at_best).max(0.0);
    at_best.min(predicted) + extra / (1.0 + reusers.max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_recent_request_counts_for_the_share_of_the_gap_it_shares() {
        // The best candidate holds 1,000 tokens, this one 200: the gap is 800.
        let shared = [1_000.0, 600.0, 200.0, 100.0, 5_000.0];
        assert_eq!(
            reusers(&shared, 200.0, 1_000.0),
            1.0 + 0.5 + 0.0 + 0.0 + 1.0
        );
    }

    #[test]
    fn a_seed_closes_the_gate_for_the_interval() {
        let gate = SeedGate::default();
        let t0 = Instant::now();
        assert!(gate.is_open(t0));
        gate.seeded(t0);
        assert_eq!(gate.seeded.get(), 1);
        assert!(!gate.is_open(t0 + SEED_INTERVAL - Duration::from_millis(1)));
        assert!(gate.is_open(t0 + SEED_INTERVAL));
    }

    #[test]
    fn no_gap_no_reusers() {
        assert_eq!(reusers(&[1_000.0], 1_000.0, 1_000.0), 0.0);
        assert_eq!(reusers(&[1_000.0], 1_000.0, 500.0), 0.0);
        assert_eq!(reusers(&[1_000.0], f64::NAN, 500.0), 0.0);
    }

    #[test]
    fn each_evicted_reused_token_costs_a_prefilled_tokens_time() {
        // 1.5 s for a 6,000-token gap: 0.25 ms a token.
        assert!((eviction_cost(1.53, 0.03, 6_000.0, 2_000.0) - 0.5).abs() < 1e-12);
        assert_eq!(eviction_cost(1.53, 0.03, 6_000.0, 0.0), 0.0);
        assert_eq!(eviction_cost(1.53, 0.03, 0.0, 100.0), 0.0, "no gap");
        assert_eq!(eviction_cost(0.02, 0.03, 6_000.0, 100.0), 0.0);
    }

    #[test]
    fn the_extra_prefill_is_divided_among_the_reusers_and_this_request() {
        // 1.5 s of prefill beyond a 30 ms load: shared by 99 others, 15 ms.
        assert!((amortized(1.53, 0.03, 99.0) - 0.045).abs() < 1e-12);
        assert_eq!(amortized(1.53, 0.03, 0.0), 1.53, "nobody else: in full");
        assert_eq!(
            amortized(0.02, 0.03, 10.0),
            0.02,
            "never above the prediction"
        );
    }
}
