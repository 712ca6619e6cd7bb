//! Rule evaluation: match → consider → exclude → tiered select → tieBreak /
//! onEmpty, over a request and a candidate set. Pure and allocation-light.

mod detail;
mod input;
mod placement;
mod predicate;
mod record;
mod redact;
mod select;
mod trace;

use std::time::Duration;

use rand::Rng;

pub use detail::decision_detail;
pub use input::{
    CANDIDATE_FIELDS, Candidate, MAX_ATTRIBUTE_BYTES, Metrics, PrefixSource, Request, Tags, Val,
    clamp_attribute, parse_candidates,
};
pub use placement::{Placement, PlacementTerm};
pub use record::{
    DecisionRecord, DiffSummary, EXAMPLES_PER_GROUP, Group, Outcome, Totals, diff,
    for_recorded_requests, replay, undecidable_predicates, unrecorded_headers,
};
pub use redact::{REDACTED, digest, path_only, shown_value};
pub use select::Picked;
pub use trace::{CandidateDrop, NoTrace, RuleTrace, TierTrace, Trace, Tracer, evaluate_traced};

use crate::model::{ClassifierSet, CompiledPolicy, Consider, ModelSelector, OnEmpty, Route, Rule};
use predicate::{any_conjunction, conjunction_holds};

/// One step of evaluation: a decision, or the classifiers whose tags the next
/// rule needs. Callers run those classifiers, record their tags and evaluate
/// again; earlier rules are cheap to re-check and give the same answers.
#[derive(Debug, Clone, PartialEq)]
pub enum Evaluation {
    Decided(Decision),
    NeedTags(ClassifierSet),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    Route(Routed),
    Reject(Rejected),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    /// Index into [`CompiledPolicy::rules`].
    pub rule: usize,
    /// Index into the candidate slice.
    pub winner: usize,
    /// The winning tier's candidates in rank order, winner first: the
    /// fallback list the gateway may try.
    pub ranked: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rejected {
    /// The rule that rejected; `None` when no rule matched.
    pub rule: Option<usize>,
    pub status: u16,
    pub message: String,
    /// `onEmpty: Wait`: the request may wait this long for a candidate
    /// (evaluated again as load changes) before this reject answers it.
    pub wait: Option<Duration>,
}

pub const NO_RULE_MATCHED: &str = "no rule matched the request";

/// Evaluates the policy for one request.
pub fn evaluate<R: Rng + ?Sized, T: Tracer>(
    policy: &CompiledPolicy,
    request: &Request,
    tags: &Tags,
    candidates: &[Candidate],
    rng: &mut R,
    tracer: &mut T,
) -> Evaluation {
    for (index, rule) in policy.rules.iter().enumerate() {
        match rule_matches(rule, request, tags) {
            Err(needed) => return Evaluation::NeedTags(needed),
            Ok(false) => {
                tracer.rule_skipped(index, rule, request, tags);
                continue;
            }
            Ok(true) => tracer.rule_matched(index, rule),
        }
        match route(index, &rule.route, request, tags, candidates, rng, tracer) {
            Err(needed) => return Evaluation::NeedTags(needed),
            Ok(Some(routed)) => return Evaluation::Decided(Decision::Route(routed)),
            Ok(None) if rule.route.on_empty == OnEmpty::FallThrough => {
                tracer.fell_through(index);
            }
            Ok(None) => {
                let wait = match rule.route.on_empty {
                    OnEmpty::Wait(max) => Some(max),
                    OnEmpty::Reject | OnEmpty::FallThrough => None,
                };
                return Evaluation::Decided(Decision::Reject(Rejected {
                    rule: Some(index),
                    status: rule.route.reject.status,
                    message: rule.route.reject.message.clone(),
                    wait,
                }));
            }
        }
    }
    Evaluation::Decided(Decision::Reject(Rejected {
        rule: None,
        status: 503,
        message: NO_RULE_MATCHED.to_string(),
        wait: None,
    }))
}

/// Evaluates to a decision, asking `classify` for tags whenever a reached rule
/// needs classifiers that have not run. For synchronous callers (CLI, tests).
pub fn evaluate_with<R: Rng + ?Sized, T: Tracer>(
    policy: &CompiledPolicy,
    request: &Request,
    candidates: &[Candidate],
    rng: &mut R,
    tracer: &mut T,
    mut classify: impl FnMut(usize) -> Vec<String>,
) -> (Decision, Tags) {
    let mut tags = Tags::default();
    loop {
        tracer.restart();
        match evaluate(policy, request, &tags, candidates, rng, tracer) {
            Evaluation::Decided(d) => return (d, tags),
            Evaluation::NeedTags(needed) => {
                for c in needed.iter() {
                    let emitted = classify(c);
                    tags.record(c, emitted);
                }
            }
        }
    }
}

/// `Err(needed)` when the verdict depends on tags not yet computed.
fn rule_matches(rule: &Rule, request: &Request, tags: &Tags) -> Result<bool, ClassifierSet> {
    let Some(entries) = &rule.matches else {
        return Ok(true);
    };
    let missing = rule.match_needs.minus(tags.computed);
    if missing.is_empty() {
        return Ok(any_conjunction(entries, |a| request.value(a, tags)));
    }
    // Run classifiers only if some entry could still match without them.
    let plausible = entries
        .iter()
        .any(|entry| predicate::holds_ignoring_tags(entry, request, tags));
    if plausible { Err(missing) } else { Ok(false) }
}

fn route<R: Rng + ?Sized, T: Tracer>(
    rule_index: usize,
    route: &Route,
    request: &Request,
    tags: &Tags,
    candidates: &[Candidate],
    rng: &mut R,
    tracer: &mut T,
) -> Result<Option<Routed>, ClassifierSet> {
    let mut survivors: Vec<usize> = candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| {
            route
                .consider
                .iter()
                .any(|entry| considers(entry, c, request))
        })
        .map(|(i, _)| i)
        .collect();
    tracer.considered(&survivors, candidates);
    for (item_index, item) in route.exclude.iter().enumerate() {
        if let Some(when) = &item.when {
            let missing = item.when_needs.minus(tags.computed);
            if !missing.is_empty() {
                return Err(missing);
            }
            if !any_conjunction(when, |a| request.value(a, tags)) {
                tracer.exclude_skipped(item_index);
                continue;
            }
        }
        survivors.retain(|&i| {
            let c = &candidates[i];
            let dropped = item
                .drop
                .iter()
                .position(|entry| conjunction_holds(entry, |a| c.value(a), request, tags));
            if let Some(entry) = dropped {
                tracer.dropped(i, c, item_index, entry);
            }
            dropped.is_none()
        });
    }
    let selected = select::select(
        rule_index, route, &survivors, candidates, request, tags, rng, tracer,
    );
    Ok(keep_session(
        rule_index, selected, &survivors, candidates, request, tracer,
    ))
}

/// A session stays on its Pod while the Pod is among `survivors`: that
/// Pod wins, and the tiers' ranking follows it as the fallback list.
/// Otherwise the tiers' choice stands (and the caller remembers it).
fn keep_session<T: Tracer>(
    rule: usize,
    selected: Option<Routed>,
    survivors: &[usize],
    candidates: &[Candidate],
    request: &Request,
    tracer: &mut T,
) -> Option<Routed> {
    let Some(address) = request.session_address.as_deref() else {
        return selected;
    };
    let at_address = |&i: &usize| candidates[i].address.as_deref() == Some(address);
    // The requested model's candidate there first, if the rule offers two.
    let pinned = survivors
        .iter()
        .copied()
        .filter(at_address)
        .min_by_key(|&i| candidates[i].model != request.model);
    let Some(pinned) = pinned else {
        tracer.session(address, false);
        return selected;
    };
    tracer.session(address, true);
    let rest = selected.map(|r| r.ranked).unwrap_or_default();
    let ranked = std::iter::once(pinned)
        .chain(rest.into_iter().filter(|&i| i != pinned))
        .collect();
    Some(Routed {
        rule,
        winner: pinned,
        ranked,
    })
}

fn considers(entry: &Consider, c: &Candidate, request: &Request) -> bool {
    let backends = &entry.backends;
    let type_ok = match c.kind {
        crate::attr::CandidateType::Local => backends.local,
        crate::attr::CandidateType::Provider => backends.provider,
    };
    let name_ok = match &backends.names {
        None => true,
        Some(names) => c
            .destination_name()
            .is_some_and(|n| names.iter().any(|x| x == n)),
    };
    let model_ok = match &entry.models {
        ModelSelector::Requested => c.model == request.model,
        ModelSelector::Names(names) => names.contains(&c.model),
    };
    type_ok && name_ok && model_ok
}
