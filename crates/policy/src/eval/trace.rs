//! Explain traces: which rule matched and why, each phase's survivors, why
//! each candidate was dropped. Evaluation is generic over [`Tracer`], so the
//! hot path pays nothing when tracing is off ([`NoTrace`]).

use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde::Serialize;

use super::input::{Candidate, Request, Tags, Val};
use super::predicate::first_failing;
use super::redact::shown_value;
use super::select::Picked;
use super::{Evaluation, evaluate};
use crate::attr::Metric;
use crate::duration::format_seconds;
use crate::model::{CompiledPolicy, Rank, Rule, Test, TieBreak, Tier, Value};

pub trait Tracer {
    /// Whether `tier` wants every candidate ranked (costly), or only the top.
    const FULL_RANKING: bool = false;
    fn restart(&mut self) {}
    fn rule_skipped(&mut self, _index: usize, _rule: &Rule, _request: &Request, _tags: &Tags) {}
    fn rule_matched(&mut self, _index: usize, _rule: &Rule) {}
    fn considered(&mut self, _survivors: &[usize], _candidates: &[Candidate]) {}
    fn exclude_skipped(&mut self, _item: usize) {}
    fn dropped(&mut self, _index: usize, _candidate: &Candidate, _item: usize, _entry: usize) {}
    fn tier(
        &mut self,
        _index: usize,
        _tier: &Tier,
        _survivors: &[usize],
        _ranked: &[(usize, f64)],
        _picked: Option<Picked<'_>>,
        _candidates: &[Candidate],
    ) {
    }
    fn fell_through(&mut self, _index: usize) {}
    /// The session's Pod at `address` was kept (among the survivors), or
    /// left (not among them).
    fn session(&mut self, _address: &str, _kept: bool) {}
}

/// Tracing off.
pub struct NoTrace;
impl Tracer for NoTrace {}

#[derive(Debug, Default, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Trace {
    pub rules: Vec<RuleTrace>,
    /// Show the request's client-supplied values as [`shown_value`] does
    /// (digests, no credentials): for traces served over HTTP.
    #[serde(skip)]
    pub redact: bool,
}

impl Trace {
    /// A trace that never shows a client-supplied value in the clear.
    pub fn redacted() -> Self {
        Trace {
            redact: true,
            ..Trace::default()
        }
    }
}

/// A decision made again with its own `seed` (so `tieBreak: Random` picks
/// the same), traced with client values redacted: what `/debug/explain`
/// and the decision detail show.
pub fn evaluate_traced(
    policy: &CompiledPolicy,
    request: &Request,
    tags: &Tags,
    candidates: &[Candidate],
    seed: u64,
) -> (Evaluation, Trace) {
    let mut trace = Trace::redacted();
    let mut rng = SmallRng::seed_from_u64(seed);
    let evaluation = evaluate(policy, request, tags, candidates, &mut rng, &mut trace);
    (evaluation, trace)
}

#[derive(Debug, Default, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RuleTrace {
    pub rule: String,
    pub matched: bool,
    /// Why each `matches` entry failed (first failing predicate).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_matched_because: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub considered: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub excludes_not_applied: Vec<usize>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dropped: Vec<CandidateDrop>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tiers: Vec<TierTrace>,
    /// `sessionAffinity`: whether the session stayed on its Pod.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    pub fell_through: bool,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CandidateDrop {
    pub candidate: String,
    /// `exclude[item].drop[entry]`.
    pub exclude: usize,
    pub entry: usize,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TierTrace {
    pub tier: usize,
    pub objective: String,
    /// Survivors this tier did not admit (wrong type, `if`, no objective value).
    pub left_out: Vec<String>,
    /// Admitted candidates, best first, with their objective value.
    pub ranking: Vec<(String, String)>,
    /// Candidates tied with the best (`within`; every member of an unranked
    /// tier), when more than one: `tieBreak` chose among them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tied: Vec<String>,
    /// How the winner was chosen among `tied` (`PreferLocal`, `Random`, or
    /// `RankOrder`: the first in rank order).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tie_break: Option<String>,
    pub winner: Option<String>,
}

impl Trace {
    fn current(&mut self) -> &mut RuleTrace {
        self.rules.last_mut().expect("a rule is being traced")
    }
}

impl Tracer for Trace {
    const FULL_RANKING: bool = true;

    fn restart(&mut self) {
        self.rules.clear();
    }

    fn rule_skipped(&mut self, _index: usize, rule: &Rule, request: &Request, tags: &Tags) {
        let reasons = rule
            .matches
            .iter()
            .flatten()
            .enumerate()
            .filter_map(|(i, entry)| {
                let p = first_failing(entry, |a| request.value(a, tags))?;
                let got = match request.value(&p.attr, tags) {
                    Some(Val::Text(s)) if self.redact => shown_value(&p.attr, s),
                    other => describe_value(other),
                };
                Some(format!(
                    "matches[{i}]: {} is {got}, wanted {}",
                    p.attr,
                    describe_test(&p.test)
                ))
            })
            .collect();
        self.rules.push(RuleTrace {
            rule: rule.name.clone(),
            matched: false,
            not_matched_because: reasons,
            ..RuleTrace::default()
        });
    }

    fn rule_matched(&mut self, _index: usize, rule: &Rule) {
        self.rules.push(RuleTrace {
            rule: rule.name.clone(),
            matched: true,
            ..RuleTrace::default()
        });
    }

    fn considered(&mut self, survivors: &[usize], candidates: &[Candidate]) {
        self.current().considered = survivors.iter().map(|&i| candidates[i].label()).collect();
    }

    fn exclude_skipped(&mut self, item: usize) {
        self.current().excludes_not_applied.push(item);
    }

    fn dropped(&mut self, _index: usize, candidate: &Candidate, item: usize, entry: usize) {
        self.current().dropped.push(CandidateDrop {
            candidate: candidate.label(),
            exclude: item,
            entry,
        });
    }

    fn tier(
        &mut self,
        index: usize,
        tier: &Tier,
        survivors: &[usize],
        ranked: &[(usize, f64)],
        picked: Option<Picked<'_>>,
        candidates: &[Candidate],
    ) {
        let value = |i: usize, key: f64| match &tier.rank {
            Rank::Minimize(m) | Rank::Maximize(m) => {
                let c = &candidates[i];
                let v = match tier.rank {
                    Rank::Minimize(_) => c.minimized(*m),
                    _ => c.metrics.get(*m),
                };
                let show = |v: f64| {
                    if m.ty() == crate::attr::AttrType::Duration {
                        format_seconds(v)
                    } else {
                        format!("{v}")
                    }
                };
                let shown = show(v.unwrap_or(key));
                // Which cached prefix the value stands on: the Pod's own
                // KV events, or the EPP's estimate.
                let shown = match c.cached_prefix_source {
                    Some(source) if m.depends_on_cached_prefix() => {
                        format!("{shown} ({})", source.as_str())
                    }
                    _ => shown,
                };
                // The prediction, then each placement term added to it.
                match (&tier.rank, c.metrics.get(*m)) {
                    (Rank::Minimize(Metric::PredictedTtft), Some(predicted))
                        if !c.placement.is_empty() =>
                    {
                        format!("{shown} = predicted {}{}", show(predicted), c.placement)
                    }
                    _ => shown,
                }
            }
            Rank::Order(_) => format!("#{}", key as usize + 1),
            Rank::Unranked => String::new(),
        };
        let left_out = survivors
            .iter()
            .filter(|i| !ranked.iter().any(|(r, _)| r == *i))
            .map(|&i| candidates[i].label())
            .collect();
        // A tie worth showing has more than the winner in it.
        let tie = picked.as_ref().filter(|p| p.ties.len() > 1);
        let trace = TierTrace {
            tier: index,
            objective: describe_rank(&tier.rank),
            left_out,
            ranking: ranked
                .iter()
                .map(|&(i, k)| (candidates[i].label(), value(i, k)))
                .collect(),
            tied: tie
                .map(|p| p.ties.iter().map(|&i| candidates[i].label()).collect())
                .unwrap_or_default(),
            tie_break: tie.map(|p| describe_tie_break(p.tie_break)),
            winner: picked.as_ref().map(|p| candidates[p.winner].label()),
        };
        self.current().tiers.push(trace);
    }

    fn fell_through(&mut self, _index: usize) {
        self.current().fell_through = true;
    }

    fn session(&mut self, address: &str, kept: bool) {
        self.current().session = Some(if kept {
            format!("kept on {address}, the session's Pod")
        } else {
            format!("left {address}, the session's Pod: not among the candidates after exclude")
        });
    }
}

fn describe_tie_break(tie_break: TieBreak) -> String {
    match tie_break {
        TieBreak::RankOrder => "RankOrder",
        TieBreak::PreferLocal => "PreferLocal",
        TieBreak::Random => "Random",
    }
    .into()
}

fn describe_rank(rank: &Rank) -> String {
    match rank {
        Rank::Unranked => "consider order".into(),
        Rank::Minimize(m) => format!("minimize {}", m.name()),
        Rank::Maximize(m) => format!("maximize {}", m.name()),
        Rank::Order(names) => format!("order [{}]", names.join(", ")),
    }
}

fn describe_value(value: Option<Val<'_>>) -> String {
    match value {
        None => "absent".to_string(),
        Some(Val::Text(s)) => format!("{s:?}"),
        Some(Val::Number(n)) => format!("{n}"),
        Some(Val::Set(s)) => format!("[{}]", s.join(", ")),
    }
}

fn describe_test(test: &Test) -> String {
    let list = |vs: &[Value]| {
        vs.iter()
            .map(|v| match v {
                Value::Text(t) => t.clone(),
                Value::Number(n) => n.to_string(),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    match test {
        Test::OneOf(vs) if vs.len() == 1 => list(vs),
        Test::OneOf(vs) => format!("one of [{}]", list(vs)),
        Test::NotIn(vs) => format!("none of [{}]", list(vs)),
        Test::Compare(cmp, operand) => format!("{cmp:?} {operand:?}"),
        Test::Prefix(p) => format!("prefix {p:?}"),
        Test::Regex(r) => format!("regex {:?}", r.as_str()),
        Test::ContainsAll(v) => format!("all of [{}]", v.join(", ")),
        Test::ContainsNone(v) => format!("none of [{}]", v.join(", ")),
        Test::Exists(b) => format!("exists: {b}"),
    }
}
