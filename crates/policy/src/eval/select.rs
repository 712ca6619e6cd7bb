//! Tiered selection: the first tier with a survivor wins; within it, rank by
//! the objective, gather ties, and break them.

use rand::Rng;

use super::input::{Candidate, Request, Tags};
use super::predicate::conjunction_holds;
use super::{Routed, Tracer};
use crate::attr::CandidateType;
use crate::model::{Rank, Route, TieBreak, Tier, Within};

/// How many runners-up the fallback list carries: the gateway retries a few
/// endpoints, never hundreds, and a partial sort keeps big pools cheap.
pub const MAX_FALLBACKS: usize = 8;

#[allow(clippy::too_many_arguments)]
pub(super) fn select<R: Rng + ?Sized, T: Tracer>(
    rule: usize,
    route: &Route,
    survivors: &[usize],
    candidates: &[Candidate],
    request: &Request,
    tags: &Tags,
    rng: &mut R,
    tracer: &mut T,
) -> Option<Routed> {
    for (tier_index, tier) in route.select.iter().enumerate() {
        let mut ranked = rank_tier(tier, survivors, candidates, request, tags);
        if ranked.is_empty() {
            tracer.tier(tier_index, tier, survivors, &ranked, None, candidates);
            continue;
        }
        let winner = pick_winner(tier, route.tie_break, &ranked, candidates, rng);
        // Only an explain trace shows the tie set: not worth a pass otherwise.
        let ties = if T::FULL_RANKING {
            tie_set(tier, &ranked)
        } else {
            Vec::new()
        };
        let order = rank_order(&mut ranked, winner, T::FULL_RANKING);
        tracer.tier(
            tier_index,
            tier,
            survivors,
            &ranked,
            Some(Picked {
                winner,
                ties: &ties,
                tie_break: route.tie_break,
            }),
            candidates,
        );
        return Some(Routed {
            rule,
            winner,
            ranked: order,
        });
    }
    None
}

/// Best first by (key, consider order): a total order, so results are
/// deterministic. Sorts fully only when a tracer wants the whole ranking.
fn rank_order(ranked: &mut [(usize, f64)], winner: usize, full: bool) -> Vec<usize> {
    let by_rank = |a: &(usize, f64), b: &(usize, f64)| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0));
    let keep = if full {
        ranked.len()
    } else {
        ranked.len().min(MAX_FALLBACKS + 1)
    };
    if keep < ranked.len() {
        ranked.select_nth_unstable_by(keep - 1, by_rank);
    }
    ranked[..keep].sort_unstable_by(by_rank);
    let mut order = Vec::with_capacity(keep.min(MAX_FALLBACKS + 1));
    order.push(winner);
    order.extend(
        ranked[..keep]
            .iter()
            .map(|(i, _)| *i)
            .filter(|i| *i != winner)
            .take(MAX_FALLBACKS),
    );
    order
}

/// A tier's winner, the candidates it was tied with, and what broke the tie.
pub struct Picked<'a> {
    pub winner: usize,
    /// Candidate indices tied with the best (`within`), in consider order.
    pub ties: &'a [usize],
    pub tie_break: TieBreak,
}

/// The best entry of a non-empty ranking, and whether an entry ties with it.
fn best_and_tied(
    tier: &Tier,
    ranked: &[(usize, f64)],
) -> ((usize, f64), impl Fn(&(usize, f64)) -> bool) {
    let best = ranked
        .iter()
        .copied()
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
        .expect("ranked is not empty");
    let slack = match (&tier.rank, tier.within) {
        // Unranked tiers keep consider order; every member is a tie.
        (Rank::Unranked, _) => f64::INFINITY,
        (_, None) => 0.0,
        (_, Some(Within::Absolute(a))) => a,
        (_, Some(Within::Fraction(f))) => best.1.abs() * f,
    };
    // The best always ties with itself, even when infinities make distances NaN.
    (best, move |&(i, v): &(usize, f64)| {
        i == best.0 || v - best.1 <= slack
    })
}

fn tie_set(tier: &Tier, ranked: &[(usize, f64)]) -> Vec<usize> {
    let (_, tied) = best_and_tied(tier, ranked);
    ranked.iter().filter(|e| tied(e)).map(|e| e.0).collect()
}

/// The winner among the candidates tied with the best (`within`), by tieBreak.
fn pick_winner<R: Rng + ?Sized>(
    tier: &Tier,
    tie_break: TieBreak,
    ranked: &[(usize, f64)],
    candidates: &[Candidate],
    rng: &mut R,
) -> usize {
    let (best, tied) = best_and_tied(tier, ranked);
    let first_by_rank = |filter: &dyn Fn(usize) -> bool| {
        ranked
            .iter()
            .filter(|e| tied(e) && filter(e.0))
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
            .map(|e| e.0)
    };
    match tie_break {
        TieBreak::RankOrder => best.0,
        TieBreak::PreferLocal => {
            first_by_rank(&|i| candidates[i].kind == CandidateType::Local).unwrap_or(best.0)
        }
        TieBreak::Random => {
            let count = ranked.iter().filter(|e| tied(e)).count();
            let nth = rng.random_range(0..count);
            ranked
                .iter()
                .filter(|e| tied(e))
                .nth(nth)
                .map_or(best.0, |e| e.0)
        }
    }
}

/// Eligible candidates of a tier with their rank keys (lower is better), in
/// consider order. Candidates
/// without the objective (or not named by `order`) leave the tier.
fn rank_tier(
    tier: &Tier,
    survivors: &[usize],
    candidates: &[Candidate],
    request: &Request,
    tags: &Tags,
) -> Vec<(usize, f64)> {
    let eligible = survivors.iter().copied().filter(|&i| {
        let c = &candidates[i];
        tier.kind.admits(c.kind)
            && tier.when.as_ref().is_none_or(|entries| {
                entries
                    .iter()
                    .any(|e| conjunction_holds(e, |a| c.value(a), request, tags))
            })
    });
    match &tier.rank {
        Rank::Unranked => eligible.map(|i| (i, 0.0)).collect(),
        Rank::Minimize(m) => eligible
            .filter_map(|i| candidates[i].minimized(*m).map(|v| (i, v)))
            .collect(),
        Rank::Maximize(m) => eligible
            .filter_map(|i| candidates[i].metrics.get(*m).map(|v| (i, -v)))
            .collect(),
        Rank::Order(names) => eligible
            .filter_map(|i| {
                let name = candidates[i].destination_name()?;
                names.iter().position(|n| n == name).map(|p| (i, p as f64))
            })
            .collect(),
    }
}
