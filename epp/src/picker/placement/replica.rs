//! `replicaShare` and `replicaEvictions`: a second copy of a prefix whose
//! Pods have requests waiting.
//!
//! A candidate that lacks part of the prefix the best-cached Pod of its
//! model holds would prefill it once, and then serve the group's next
//! requests from its cache: its prefill is shared among the recent
//! requests that reused the prefix (`replicaShare`, negative; see
//! `predict::reuse`). A replica also pushes reused blocks out of its
//! Pod's cache now (`replicaEvictions`, beyond what the `room` term
//! already forecasts). A hot group so spreads once its Pod's queue costs
//! more than its share of a new replica, onto a Pod with room for it.
//!
//! A replica is priced only where every Pod holding the most of the
//! prefix has requests waiting as its engine reports and a model trained
//! on its own answers (a replica pays for a queue the engine shows, not
//! one a prior guesses), on a Pod with none waiting that carries no hot
//! group, and only where it is cheaper than the request's own
//! prediction. Priced more eagerly, replicas were seeded faster than they
//! paid back: each costs a batch slot for a whole prefill and evicts
//! other prefixes, and those prefills queued everything behind them.

use std::cell::LazyCell;

use super::{Local, Pod};
use crate::predict::{TtftFeatures, reuse};

/// A candidate's replica terms, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct ReplicaPrice {
    /// The part of its prediction the reusers share: negative.
    pub share: f64,
    /// What its evictions now cost beyond its `room` term.
    pub evictions: f64,
}

/// Per candidate, its replica terms if it would be a new replica;
/// `rooms` holds each candidate's `room` term (0 where none). `shared` is
/// called at most once.
pub(super) fn prices<P: Pod>(
    locals: &[Option<Local<'_, P>>],
    hot: &[bool],
    rooms: &[f64],
    shared: impl FnOnce() -> Vec<f64>,
) -> Vec<Option<ReplicaPrice>> {
    let mut bests: Vec<(&str, Option<f64>)> = Vec::new();
    let shared = LazyCell::new(shared);
    let mut priced = vec![None; locals.len()];
    for (i, local) in locals.iter().enumerate() {
        let Some(local) = local.as_ref().filter(|_| !hot[i]) else {
            continue;
        };
        let best = match bests.iter().find(|(m, _)| *m == local.model) {
            Some(&(_, best)) => best,
            None => {
                let best = queued_best(locals, local.model);
                bests.push((local.model, best));
                best
            }
        };
        let Some(best) = best.filter(|&best| local.cached < best) else {
            continue;
        };
        priced[i] = price(local, best, rooms[i], &shared);
    }
    priced
}

/// One candidate's replica terms, if it is cheaper as a replica of the
/// `best`-cached Pod's prefix than by its own prediction.
fn price<P: Pod>(
    local: &Local<'_, P>,
    best: f64,
    room: f64,
    shared: &LazyCell<Vec<f64>, impl FnOnce() -> Vec<f64>>,
) -> Option<ReplicaPrice> {
    let (features, predicted) = (local.features?, local.predicted?);
    if features.waiting > 0.0 {
        return None;
    }
    let as_best = TtftFeatures {
        uncached_tokens: (local.prompt - best).max(0.0),
        ..features
    };
    let at_best = local.pod.predict(&as_best);
    let reusers = reuse::reusers(shared, local.cached, best);
    let amortized = reuse::amortized(predicted, at_best, reusers);
    if amortized >= predicted {
        // No cheaper as a replica: the Pod's index need not be walked.
        return None;
    }
    let evicted = local.pod.reused_evictions();
    let gap = best - local.cached;
    let evicts_now = reuse::eviction_cost(predicted, at_best, gap, evicted);
    (amortized + evicts_now < predicted).then(|| ReplicaPrice {
        share: amortized - predicted,
        evictions: (evicts_now - room).max(0.0),
    })
}

/// The most of the prompt the local candidates of `model` hold, if every
/// one holding that much has requests waiting in its engine, as scraped,
/// and a model trained on its own answers.
fn queued_best<P: Pod>(locals: &[Option<Local<'_, P>>], model: &str) -> Option<f64> {
    let of_model = || locals.iter().flatten().filter(|l| l.model == model);
    let best = of_model().map(|l| l.cached).fold(0.0, f64::max);
    let queued = of_model()
        .filter(|l| l.cached >= best)
        .all(|l| l.features.is_some_and(|f| f.waiting >= 1.0) && l.pod.trained());
    (best > 0.0 && queued).then_some(best)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{FakePod, local};
    use super::*;

    const QUEUED: (f64, f64) = (4.0, 2.0);
    const IDLE: (f64, f64) = (0.0, 0.0);

    #[test]
    fn the_best_counts_only_while_every_pod_holding_it_has_a_queue() {
        let pod = FakePod::default();
        let untrained = FakePod {
            trained: false,
            ..pod
        };
        let both = [
            Some(local("m", 1_000.0, QUEUED, pod)),
            Some(local("m", 1_000.0, IDLE, pod)),
            Some(local("m", 0.0, IDLE, pod)),
        ];
        assert_eq!(queued_best(&both, "m"), None, "one holder has room");
        let queued = [
            Some(local("m", 1_000.0, QUEUED, pod)),
            Some(local("m", 500.0, IDLE, pod)),
        ];
        assert_eq!(queued_best(&queued, "m"), Some(1_000.0));
        assert_eq!(queued_best(&queued, "other"), None);
        let guessed = [Some(local("m", 1_000.0, QUEUED, untrained))];
        assert_eq!(queued_best(&guessed, "m"), None, "a prior's queue");
    }

    #[test]
    fn the_prefill_is_shared_among_the_requests_that_reuse_the_prefix() {
        let pod = FakePod::default();
        let locals = [
            Some(local("m", 1_000.0, QUEUED, pod)),
            Some(local("m", 0.0, IDLE, pod)),
        ];
        // Four recent requests shared all of the prompt: 1 s of prefill
        // among five is 0.2 s, 0.8 s taken off.
        let mut calls = 0;
        let priced = prices(&locals, &[false; 2], &[0.0; 2], || {
            calls += 1;
            vec![1_000.0; 4]
        });
        let replica = priced[1].unwrap();
        assert!((replica.share - -0.8).abs() < 1e-9, "{replica:?}");
        assert_eq!(replica.evictions, 0.0);
        assert_eq!(priced[0], None);
        assert_eq!(calls, 1);
        // Nobody shared it: no cheaper as a replica.
        let alone = prices(&locals, &[false; 2], &[0.0; 2], Vec::new);
        assert_eq!(alone, [None, None]);
        // A hot carrier is never a replica.
        let hot = prices(&locals, &[false, true], &[0.0; 2], || vec![1_000.0; 4]);
        assert_eq!(hot, [None, None]);
    }

    #[test]
    fn evictions_count_beyond_the_room_term_and_can_cancel_the_replica() {
        // 300 reused tokens pushed out: 0.3 s to prefill again.
        let evicting = FakePod {
            reused_evictions: 300.0,
            ..FakePod::default()
        };
        let locals = [
            Some(local("m", 1_000.0, QUEUED, FakePod::default())),
            Some(local("m", 0.0, IDLE, evicting)),
        ];
        let shared = || vec![1_000.0; 4];
        let priced = prices(&locals, &[false; 2], &[0.0, 0.1], shared)[1].unwrap();
        assert!((priced.evictions - 0.2).abs() < 1e-9, "{priced:?}");
        // 0.9 s of evictions and 0.2 s of shared prefill: above its own
        // 1.02 s.
        let costly = FakePod {
            reused_evictions: 900.0,
            ..FakePod::default()
        };
        let locals = [
            Some(local("m", 1_000.0, QUEUED, FakePod::default())),
            Some(local("m", 0.0, IDLE, costly)),
        ];
        assert_eq!(prices(&locals, &[false; 2], &[0.0; 2], shared)[1], None);
    }

    #[test]
    fn a_pod_with_its_own_queue_is_no_replica() {
        let pod = FakePod::default();
        let locals = [
            Some(local("m", 1_000.0, QUEUED, pod)),
            Some(local("m", 0.0, (0.0, 1.0), pod)),
        ];
        let priced = prices(&locals, &[false; 2], &[0.0; 2], || vec![1_000.0; 4]);
        assert_eq!(priced, [None, None]);
    }
}
