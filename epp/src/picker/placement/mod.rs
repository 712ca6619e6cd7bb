//! The placement terms of `minimize: PredictedTTFT` for local candidates:
//! what sending the request to a Pod costs the requests that follow it,
//! each a named term beside the Pod's TTFT prediction
//! (`kinference_policy::eval::Placement`), shown in explain traces.
//!
//! A prompt's group follows it: its next requests go where it went, since
//! that Pod holds its prefix. So the Pod that predicts the fastest TTFT
//! for this request alone can be the wrong home for its group. Each term
//! prices one way it is wrong, or right:
//!
//! - [`room`]: `room` and `hotCarrier`, the prefills a Pod without room
//!   for the group would make again;
//! - [`replica`]: `replicaShare` and `replicaEvictions`, a second copy of
//!   a prefix whose Pods have requests waiting;
//! - [`hot`]: which Pods carry a hot group, a fact both read.
//!
//! The terms read each Pod through [`Pod`], which the picker answers from
//! the Pod's TTFT model and prefix index, and the tests from numbers.

mod hot;
mod replica;
mod room;

use std::collections::HashMap;

use kinference_policy::eval::{Placement, PlacementTerm};

use crate::predict::TtftFeatures;

/// What the terms ask of a local candidate's Pod about this request.
pub(super) trait Pod {
    /// The Pod's TTFT for `features`, by its model.
    fn predict(&self, features: &TtftFeatures) -> f64;
    /// Seconds one queued request adds to the Pod's TTFT, by its model.
    fn per_queued(&self) -> f64;
    /// Whether the Pod's model has learnt from enough of its own answers.
    fn trained(&self) -> bool;
    /// The prompt's new blocks that would not fit beside the Pod's working
    /// set; `None` when they all fit.
    fn overflow(&self) -> Option<Overflow>;
    /// Tokens of blocks that requests reused which the prompt's new blocks
    /// would push out of the Pod's cache now.
    fn reused_evictions(&self) -> f64;
}

/// The part of a prompt that would not fit in a Pod's cache.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Overflow {
    /// Its share of the prompt's blocks the Pod lacks, 0 to 1.
    pub share: f64,
    /// Its tokens, in the unit the prompt counts in.
    pub tokens: f64,
}

/// A local candidate as the terms read it.
pub(super) struct Local<'a, P> {
    pub model: &'a str,
    /// The prompt's leading tokens the Pod holds.
    pub cached: f64,
    /// The prompt's tokens.
    pub prompt: f64,
    /// `None` without a scrape of the Pod's metrics.
    pub features: Option<TtftFeatures>,
    pub predicted: Option<f64>,
    /// Requests this EPP routed to the Pod lately, decayed.
    pub recent_routes: f64,
    pub pod: P,
}

/// Each candidate's terms (empty for providers), and the candidates that
/// would be a new replica of the prompt's prefix.
#[derive(Debug, Default)]
pub(super) struct Priced {
    pub terms: Vec<Placement>,
    pub replicas: Vec<usize>,
}

/// What the pool says of this request.
pub(super) struct PoolFacts<F> {
    /// Whether the prompt has blocks at all: a prompt too short for one
    /// leaves no group behind.
    pub hashed: bool,
    /// Whether this EPP may seed a replica now (`predict::reuse::SeedGate`).
    pub seeds_open: bool,
    /// Per recent request, the tokens of this prompt it shared from the
    /// start; computed only when a replica is priced.
    pub shared: F,
}

/// The terms of every candidate; `locals` holds `None` for providers.
pub(super) fn price<P: Pod>(
    locals: &[Option<Local<'_, P>>],
    pool: PoolFacts<impl FnOnce() -> Vec<f64>>,
) -> Priced {
    let mut priced = Priced {
        terms: vec![Placement::default(); locals.len()],
        replicas: Vec::new(),
    };
    let hot = hot::carriers(locals);
    let rooms = if pool.hashed {
        room::prices(locals, &hot)
    } else {
        vec![None; locals.len()]
    };
    for (terms, room) in priced.terms.iter_mut().zip(&rooms) {
        if let Some(room) = room {
            terms.add(room.term, room.seconds);
        }
    }
    if pool.seeds_open {
        let room_seconds: Vec<f64> = rooms.iter().map(|r| r.map_or(0.0, |r| r.seconds)).collect();
        let replicas = replica::prices(locals, &hot, &room_seconds, pool.shared);
        for (i, replica) in replicas.into_iter().enumerate() {
            let Some(replica) = replica else { continue };
            priced.terms[i].add(PlacementTerm::ReplicaShare, replica.share);
            priced.terms[i].add(PlacementTerm::ReplicaEvictions, replica.evictions);
            priced.replicas.push(i);
        }
    }
    priced
}

/// Per candidate, `add` folded over the local candidates of its model
/// (`None` for a provider). A Pod serving two models is a candidate of
/// each: a Pod of another model says nothing of where this model's group
/// is, and its load is not this model's Pods' load.
fn per_model<P, T: Default + Copy>(
    locals: &[Option<Local<'_, P>>],
    mut add: impl FnMut(&mut T, &Local<'_, P>),
) -> Vec<Option<T>> {
    let mut of_model: HashMap<&str, T> = HashMap::new();
    for local in locals.iter().flatten() {
        add(of_model.entry(local.model).or_default(), local);
    }
    locals
        .iter()
        .map(|l| l.as_ref().map(|l| of_model[l.model]))
        .collect()
}

#[cfg(test)]
pub(super) mod testing {
    //! Pods whose TTFT model is linear in the queue and the uncached
    //! tokens, and whose cache answers as told.

    use super::{Local, Overflow, Pod};
    use crate::predict::TtftFeatures;

    #[derive(Clone, Copy, Debug)]
    pub(crate) struct FakePod {
        pub per_queued: f64,
        /// Seconds a prompt token takes to prefill.
        pub per_token: f64,
        pub trained: bool,
        pub overflow: Option<Overflow>,
        pub reused_evictions: f64,
    }

    impl Default for FakePod {
        fn default() -> Self {
            FakePod {
                per_queued: 0.25,
                per_token: 0.001,
                trained: true,
                overflow: None,
                reused_evictions: 0.0,
            }
        }
    }

    impl Pod for FakePod {
        fn predict(&self, f: &TtftFeatures) -> f64 {
            0.02 + self.per_queued * f.waiting + self.per_token * f.uncached_tokens
        }
        fn per_queued(&self) -> f64 {
            self.per_queued
        }
        fn trained(&self) -> bool {
            self.trained
        }
        fn overflow(&self) -> Option<Overflow> {
            self.overflow
        }
        fn reused_evictions(&self) -> f64 {
            self.reused_evictions
        }
    }

    /// A candidate of `model` holding `cached` of a 1,000-token prompt,
    /// with `running` and `waiting` requests, predicted by `pod`.
    pub fn local(
        model: &str,
        cached: f64,
        (running, waiting): (f64, f64),
        pod: FakePod,
    ) -> Local<'_, FakePod> {
        let features = TtftFeatures::new(waiting, running, 1_000.0, cached, 0.0);
        Local {
            model,
            cached,
            prompt: 1_000.0,
            features: Some(features),
            predicted: Some(pod.predict(&features)),
            recent_routes: 0.0,
            pod,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{FakePod, local};
    use super::*;

    #[test]
    fn a_pod_with_room_and_the_prefix_is_priced_by_its_prediction_alone() {
        let locals = [
            Some(local("m", 1_000.0, (1.0, 0.0), FakePod::default())),
            Some(local("m", 0.0, (1.0, 0.0), FakePod::default())),
            None,
        ];
        let pool = PoolFacts {
            hashed: true,
            seeds_open: true,
            shared: Vec::new,
        };
        let priced = price(&locals, pool);
        assert!(priced.terms.iter().all(Placement::is_empty), "{priced:?}");
        assert!(priced.replicas.is_empty());
    }

    #[test]
    fn a_prompt_without_blocks_leaves_no_group_to_price() {
        // The second Pod is loaded above its model's mean: for a hashed
        // prompt cached nowhere it has no room.
        let locals = [
            Some(local("m", 0.0, (0.0, 0.0), FakePod::default())),
            Some(local("m", 0.0, (4.0, 0.0), FakePod::default())),
        ];
        let facts = |hashed| PoolFacts {
            hashed,
            seeds_open: false,
            shared: Vec::new,
        };
        let hashed = price(&locals, facts(true));
        assert_eq!(hashed.terms[1].get(PlacementTerm::Room), Some(0.25));
        let unhashed = price(&locals, facts(false));
        assert!(unhashed.terms.iter().all(Placement::is_empty));
    }

    #[test]
    fn a_replica_is_priced_only_while_the_seed_gate_is_open() {
        // The only holder has requests waiting; the other Pod is idle and
        // nine recent requests shared the whole prompt.
        let locals = [
            Some(local("m", 1_000.0, (4.0, 2.0), FakePod::default())),
            Some(local("m", 0.0, (0.0, 0.0), FakePod::default())),
        ];
        let facts = |seeds_open| PoolFacts {
            hashed: true,
            seeds_open,
            shared: || vec![1_000.0; 9],
        };
        let open = price(&locals, facts(true));
        assert_eq!(open.replicas, [1]);
        // 1 s of prefill shared by ten requests: 0.9 s taken off.
        let share = open.terms[1].get(PlacementTerm::ReplicaShare).unwrap();
        assert!((share - -0.9).abs() < 1e-9, "{share}");
        let shut = price(&locals, facts(false));
        assert!(shut.replicas.is_empty());
        assert_eq!(shut.terms[1].get(PlacementTerm::ReplicaShare), None);
    }
}
