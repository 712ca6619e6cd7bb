//! `room` and `hotCarrier`: the prefills a Pod without room for a prompt's
//! group would make again.
//!
//! A Pod whose cache would not hold the prompt's new blocks beside its
//! working set would prefill its groups' questions, this one's and its
//! neighbours', again for as long as the group stays. For a prompt cached
//! nowhere (a new group's first request, or a one-off: they cannot be told
//! apart), a Pod with more requests running and waiting (picks not yet
//! scraped included) than one above the mean of its model's Pods has no
//! room either: its traffic would queue the new group's.
//!
//! `room` is the share of the new blocks that would not fit, times one
//! queued request by the Pod's model, and at most their prefill (a group's
//! next question on its own Pod costs no more than itself). It is a
//! forecast: the group may never come back. Uncapped, or without the load,
//! it sent every new group to the one Pod with room, the one a hot group
//! kept busy. So room decides between Pods whose loads are within a queued
//! request, and load beyond that.
//!
//! `hotCarrier` replaces it on a Pod that carries a hot group ([`super::hot`]),
//! for a prompt cached nowhere or one another Pod holds more of (a group
//! leaving its first Pod, busy with the pool's cold prefills): the prefill
//! the Pod lacks, counted a second time and at least one queued request,
//! since the group would queue behind the hot one and leave again.

use kinference_policy::eval::PlacementTerm;

use super::{Local, Pod, per_model};
use crate::predict::{TtftFeatures, reuse};

/// What a local candidate is compared with, from the local candidates of
/// its model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct RoomBounds {
    /// The most of the prompt any of them holds: 0 for a prompt cached
    /// nowhere.
    pub best: f64,
    /// For a prompt cached nowhere, the load (requests running and waiting)
    /// above which a Pod has no room for its group: one request above
    /// their mean. Unbounded for a prompt cached somewhere.
    pub full_above_load: f64,
}

/// A candidate's room term: `room` or `hotCarrier`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct RoomPrice {
    pub term: PlacementTerm,
    pub seconds: f64,
}

/// Per candidate, its room term; `None` for one with room (and providers).
pub(super) fn prices<P: Pod>(
    locals: &[Option<Local<'_, P>>],
    hot: &[bool],
) -> Vec<Option<RoomPrice>> {
    let bounds = bounds(locals);
    locals
        .iter()
        .zip(bounds)
        .zip(hot)
        .map(|((local, bounds), &hot)| price(local.as_ref()?, bounds?, hot))
        .collect()
}

/// Per candidate, the [`RoomBounds`] of its model's local candidates.
fn bounds<P>(locals: &[Option<Local<'_, P>>]) -> Vec<Option<RoomBounds>> {
    let of_model = per_model(locals, |(best, load, loaded): &mut (f64, f64, f64), l| {
        *best = best.max(l.cached);
        if let Some(f) = l.features {
            *load += f.running + f.waiting;
            *loaded += 1.0;
        }
    });
    let bounds = |(best, load, loaded): (f64, f64, f64)| RoomBounds {
        best,
        full_above_load: if best <= 0.0 {
            load / loaded.max(1.0) + 1.0
        } else {
            f64::INFINITY
        },
    };
    of_model.into_iter().map(|m| m.map(bounds)).collect()
}

/// One candidate's room term, if it lacks room for the prompt's group.
fn price<P: Pod>(local: &Local<'_, P>, bounds: RoomBounds, hot: bool) -> Option<RoomPrice> {
    let (features, predicted) = (local.features?, local.predicted?);
    let gap = local.prompt - local.cached;
    if gap <= 0.0 {
        return None;
    }
    let queued = local.pod.per_queued();
    let at_cached = || {
        let all_cached = TtftFeatures {
            uncached_tokens: 0.0,
            ..features
        };
        local.pod.predict(&all_cached)
    };
    let cached_nowhere = bounds.best <= 0.0;
    if hot && (cached_nowhere || local.cached < bounds.best) {
        return Some(RoomPrice {
            term: PlacementTerm::HotCarrier,
            seconds: (predicted - at_cached()).max(queued),
        });
    }
    let seconds = if features.running + features.waiting > bounds.full_above_load {
        queued
    } else {
        let overflow = local.pod.overflow()?;
        // In precise mode the events may hold more than this EPP routed:
        // the prompt's own uncached tokens bound what it adds.
        let evicted = overflow.tokens.min(gap);
        let cost = reuse::eviction_cost(predicted, at_cached(), gap, evicted);
        cost.min(queued * overflow.share)
    };
    Some(RoomPrice {
        term: PlacementTerm::Room,
        seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::super::Overflow;
    use super::super::testing::{FakePod, local};
    use super::*;

    fn room(seconds: f64) -> Option<RoomPrice> {
        Some(RoomPrice {
            term: PlacementTerm::Room,
            seconds,
        })
    }

    #[test]
    fn a_prompt_is_cached_nowhere_when_no_pod_of_its_model_holds_it() {
        // Model b's Pod holds the prompt (a system prompt both models
        // share) and runs 10 requests: model a's Pods hold none of it, and
        // a Pod of theirs has no room above 3, one request above their own
        // mean of 2.
        let pod = FakePod::default();
        let locals = [
            Some(local("a", 0.0, (3.0, 0.0), pod)),
            Some(local("a", 0.0, (1.0, 0.0), pod)),
            Some(local("b", 1_000.0, (10.0, 0.0), pod)),
            None,
        ];
        let a = RoomBounds {
            best: 0.0,
            full_above_load: 3.0,
        };
        let b = RoomBounds {
            best: 1_000.0,
            full_above_load: f64::INFINITY,
        };
        assert_eq!(bounds(&locals), [Some(a), Some(a), Some(b), None]);
        // Among model a's Pods, the best-cached one sets the bound.
        let locals = [
            Some(local("a", 200.0, (3.0, 0.0), pod)),
            Some(local("a", 600.0, (1.0, 0.0), pod)),
        ];
        let a = RoomBounds {
            best: 600.0,
            full_above_load: f64::INFINITY,
        };
        assert_eq!(bounds(&locals), [Some(a), Some(a)]);
    }

    #[test]
    fn a_pod_loaded_a_request_above_the_mean_has_no_room_for_a_new_group() {
        let pod = FakePod::default();
        let locals = [
            Some(local("m", 0.0, (4.0, 1.0), pod)),
            Some(local("m", 0.0, (1.0, 0.0), pod)),
            Some(local("m", 0.0, (1.0, 0.0), pod)),
        ];
        // Mean load 7/3: the first Pod's 5 is above 3.33, one queued
        // request; the others have room and their caches take the prompt.
        assert_eq!(prices(&locals, &[false; 3]), [room(0.25), None, None]);
    }

    #[test]
    fn overflowing_blocks_cost_their_prefill_at_most_a_queued_request_in_share() {
        // 1,000 tokens uncached at 1 ms each; 400 of them would push out
        // the working set, 40% of the new blocks.
        let overflow = Some(Overflow {
            share: 0.4,
            tokens: 400.0,
        });
        let small = FakePod {
            overflow,
            ..FakePod::default()
        };
        let candidate = local("m", 0.0, (1.0, 0.0), small);
        let cached_somewhere = RoomBounds {
            best: 100.0,
            full_above_load: f64::INFINITY,
        };
        // Their prefill is 0.4 s; 40% of a queued request, 0.1 s.
        assert_eq!(price(&candidate, cached_somewhere, false), room(0.1));
        let cheap_queue = FakePod {
            per_queued: 2.0,
            ..small
        };
        let candidate = local("m", 0.0, (1.0, 0.0), cheap_queue);
        let priced = price(&candidate, cached_somewhere, false).unwrap();
        assert!((priced.seconds - 0.4).abs() < 1e-9, "{priced:?}");
    }

    #[test]
    fn a_hot_carrier_is_priced_the_prefill_it_lacks_a_second_time() {
        let pod = FakePod::default();
        let holder = local("m", 300.0, (1.0, 0.0), pod);
        let best_elsewhere = RoomBounds {
            best: 600.0,
            full_above_load: f64::INFINITY,
        };
        // 700 tokens to prefill at 1 ms each.
        let priced = price(&holder, best_elsewhere, true).unwrap();
        assert_eq!(priced.term, PlacementTerm::HotCarrier);
        assert!((priced.seconds - 0.7).abs() < 1e-9, "{priced:?}");
        // The group's own Pod, holding the most: no term (it has room).
        let best_here = RoomBounds {
            best: 300.0,
            ..best_elsewhere
        };
        assert_eq!(price(&holder, best_here, true), None);
        // At least one queued request, however little it lacks.
        let nearly = local("m", 990.0, (1.0, 0.0), pod);
        let whole_elsewhere = RoomBounds {
            best: 1_000.0,
            ..best_elsewhere
        };
        let priced = price(&nearly, whole_elsewhere, true).unwrap();
        assert_eq!(priced.seconds, 0.25);
    }

    #[test]
    fn a_pod_holding_the_whole_prompt_or_unscraped_is_not_priced() {
        let pod = FakePod::default();
        let full = RoomBounds {
            best: 0.0,
            full_above_load: 0.0,
        };
        assert_eq!(
            price(&local("m", 1_000.0, (9.0, 9.0), pod), full, true),
            None
        );
        let mut unscraped = local("m", 0.0, (9.0, 9.0), pod);
        unscraped.features = None;
        assert_eq!(price(&unscraped, full, true), None);
    }
}
