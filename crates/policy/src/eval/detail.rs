//! The decision detail: why a request went where it went, in one line of
//! compact JSON (the EPP's `--decision-detail`). Made from an explain trace
//! of the same decision, so it costs a traced evaluation: debug only.

use std::collections::HashMap;

use serde_json::{Value, json};

use super::Evaluation;
use super::input::{Candidate, Request, Tags};
use super::trace::evaluate_traced;
use crate::model::{CompiledPolicy, Rank};

/// Candidates left behind listed at most; the rest are counted.
pub const MAX_DROPPED: usize = 32;

/// The rule and tier that decided, the winner's and the runner-up's
/// objective values, and a reason per candidate left behind, as the deciding
/// tier saw it: `exclude[i].drop[j]`, `not-in-tier` (the tier's type, or its
/// `if`) or `no-objective` (no value for the tier's objective: stale or
/// missing metrics, no price). `seed`
/// must be the decision's own, so `tieBreak: Random` picks the same.
pub fn decision_detail(
    policy: &CompiledPolicy,
    request: &Request,
    tags: &Tags,
    candidates: &[Candidate],
    seed: u64,
) -> String {
    let (decided, trace) = evaluate_traced(policy, request, tags, candidates, seed);
    let Some(rule) = trace.rules.iter().rev().find(|r| r.matched) else {
        return json!({ "rule": null }).to_string();
    };
    let index = policy.rules.iter().position(|r| r.name == rule.rule);
    let mut dropped: Vec<Value> = rule
        .dropped
        .iter()
        .map(|d| {
            json!([
                d.candidate,
                format!("exclude[{}].drop[{}]", d.exclude, d.entry)
            ])
        })
        .collect();
    let mut out = json!({ "rule": rule.rule });
    if let Some(tier) = rule
        .tiers
        .iter()
        .find(|t| t.winner.is_some())
        .or(rule.tiers.last())
    {
        let spec = index.and_then(|i| policy.rules[i].route.select.get(tier.tier));
        let by_label: HashMap<String, &Candidate> =
            candidates.iter().map(|c| (c.label(), c)).collect();
        for label in &tier.left_out {
            let reason = match (spec, by_label.get(label)) {
                (Some(t), Some(c)) if !t.kind.admits(c.kind) => "not-in-tier",
                (Some(t), Some(c)) => match t.rank {
                    Rank::Minimize(m) | Rank::Maximize(m) if c.metrics.get(m).is_none() => {
                        "no-objective"
                    }
                    _ => "not-in-tier",
                },
                _ => "not-in-tier",
            };
            dropped.push(json!([label, reason]));
        }
        out["tier"] = json!(tier.tier);
        out["objective"] = json!(tier.objective);
        // The winner is the tieBreak's pick, not always the first ranked.
        let winner = tier.winner.as_deref();
        let value = |label: &str| {
            tier.ranking
                .iter()
                .find(|(c, _)| c == label)
                .map(|(_, v)| v)
        };
        if let Some(w) = winner {
            out["winner"] = json!([w, value(w)]);
        }
        if let Some((runner_up, v)) = tier
            .ranking
            .iter()
            .find(|(c, _)| Some(c.as_str()) != winner)
        {
            out["runnerUp"] = json!([runner_up, v]);
        }
    }
    if let Evaluation::Decided(super::Decision::Reject(r)) = decided {
        out["reject"] = json!(r.status);
    }
    // A header has a size limit; the detail is for a person to read.
    if dropped.len() > MAX_DROPPED {
        out["moreDropped"] = json!(dropped.len() - MAX_DROPPED);
        dropped.truncate(MAX_DROPPED);
    }
    out["dropped"] = Value::Array(dropped);
    out.to_string()
}
