//! Tiered selection: the first tier with a survivor wins; within it, rank by
//! the objective, gather ties, and break them.

use rand::Rng;

use super::input::{Candidate, Request, Tags};
use super::predicate::conjunction_holds;
use super::{Routed, Tracer};
use crate::attr::CandidateType;
use crate::model::{Rank, Route, TieBreak, Tier, Within};

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
        let ranked = rank_tier(tier, survivors, candidates, request, tags);
        if ranked.is_empty() {
            tracer.tier(tier_index, tier, survivors, &ranked, None, candidates);
            continue;
        }
        let ties = tie_count(tier, &ranked);
        let pick = break_tie(route.tie_break, &ranked[..ties], candidates, rng);
        tracer.tier(tier_index, tier, survivors, &ranked, Some(pick), candidates);
        let winner = ranked[pick].0;
        let mut order = Vec::with_capacity(ranked.len());
        order.push(winner);
        order.extend(ranked.iter().map(|(i, _)| *i).filter(|i| *i != winner));
        return Some(Routed {
            rule,
            winner,
            ranked: order,
        });
    }
    None
}

/// Eligible candidates of a tier with their rank keys, best first. Candidates
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
    let mut ranked: Vec<(usize, f64)> = match &tier.rank {
        Rank::Unranked => eligible.map(|i| (i, 0.0)).collect(),
        Rank::Minimize(m) => eligible
            .filter_map(|i| candidates[i].metrics.get(*m).map(|v| (i, v)))
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
    };
    // Stable: equal keys keep consider order, so results are deterministic.
    ranked.sort_by(|a, b| a.1.total_cmp(&b.1));
    ranked
}

/// How many leading entries tie with the best.
fn tie_count(tier: &Tier, ranked: &[(usize, f64)]) -> usize {
    if tier.rank == Rank::Unranked {
        return ranked.len();
    }
    let best = ranked[0].1;
    let slack = match tier.within {
        None => 0.0,
        Some(Within::Absolute(a)) => a,
        Some(Within::Fraction(f)) => best.abs() * f,
    };
    // At least the best itself, even when infinities make the distance NaN.
    ranked
        .iter()
        .take_while(|(_, v)| *v - best <= slack)
        .count()
        .max(1)
}

fn break_tie<R: Rng + ?Sized>(
    tie_break: TieBreak,
    tied: &[(usize, f64)],
    candidates: &[Candidate],
    rng: &mut R,
) -> usize {
    match tie_break {
        TieBreak::RankOrder => 0,
        TieBreak::PreferLocal => tied
            .iter()
            .position(|(i, _)| candidates[*i].kind == CandidateType::Local)
            .unwrap_or(0),
        TieBreak::Random => rng.random_range(0..tied.len()),
    }
}
