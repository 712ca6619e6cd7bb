//! Warnings about policies that compile but probably do not do what their
//! author meant: rules that can never match, tiers that can never have a
//! survivor, tag rules that fail open when a classifier times out. Each
//! warning names its path in the policy and a one-line fix. Pure: a
//! function of the compiled policy.

use crate::attr::{CandidateAttr, CandidateType, Metric, RequestAttr};
use crate::model::{
    BackendSelector, CompiledPolicy, Conjunction, Exclude, OnEmpty, Predicate, Rank, Rule, Test,
    TieBreak, Tier, Value,
};

/// One finding: where, what, and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    /// Path in the policy, as compile errors give it (`rules[2].matches`).
    pub path: String,
    pub message: String,
    pub fix: String,
}

impl std::fmt::Display for Warning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {} (fix: {})", self.path, self.message, self.fix)
    }
}

/// Every warning for `policy`, in the order of the policy's text.
pub fn warnings(policy: &CompiledPolicy) -> Vec<Warning> {
    let mut out = Vec::new();
    for (i, rule) in policy.rules.iter().enumerate() {
        let path = format!("rules[{i}]");
        shadowed_rule(&policy.rules[..i], rule, &path, &mut out);
        subsumed_entries(rule, &path, &mut out);
        fail_open_tags(policy, i, rule, &path, &mut out);
        let explicit_reject = policy
            .source
            .rules
            .get(i)
            .is_some_and(|r| r.route.reject.is_some());
        excludes_everything(rule, explicit_reject, &path, &mut out);
        waits_without_load_limit(rule, &path, &mut out);
        if explicit_reject && always_empty(rule) {
            // Its select never runs: nothing else to say about it.
            continue;
        }
        for (t, tier) in rule.route.select.iter().enumerate() {
            let tier_path = format!("{path}.route.select[{t}]");
            empty_tier(policy, rule, tier, &tier_path, &mut out);
            burst_on_scraped_metric(rule, tier, &tier_path, &mut out);
        }
    }
    if let Some(last) = policy.rules.last()
        && last.route.on_empty == OnEmpty::FallThrough
    {
        out.push(Warning {
            path: format!("rules[{}].route.onEmpty", policy.rules.len() - 1),
            message: "FallThrough on the last rule: there is no later rule, so the request is rejected anyway".into(),
            fix: "use onEmpty: Reject and say so with reject.status and reject.message".into(),
        });
    }
    unused_classifiers(policy, &mut out);
    deprecated_spellings(policy, &mut out);
    flow_control_unused(policy, &mut out);
    out
}

/// `onEmpty: Wait` waits for a candidate to survive exclude; with nothing
/// excluded for load, only a pool with no ready Pod ever waits.
fn waits_without_load_limit(rule: &Rule, path: &str, out: &mut Vec<Warning>) {
    if !matches!(rule.route.on_empty, OnEmpty::Wait(_)) {
        return;
    }
    let load = |p: &Predicate<CandidateAttr>| {
        matches!(
            p.attr,
            CandidateAttr::Metric(
                Metric::InFlight
                    | Metric::QueueDepth
                    | Metric::RunningRequests
                    | Metric::KvCacheUtilization
                    | Metric::PredictedTtft
            )
        )
    };
    let limits_load = rule
        .route
        .exclude
        .iter()
        .any(|e| e.drop.iter().flatten().any(load));
    if !limits_load {
        out.push(Warning {
            path: format!("{path}.route.onEmpty"),
            message: "the rule waits for room but excludes no candidate for its load, so a request waits only when no Pod is ready".into(),
            fix: "say when a Pod is full, e.g. exclude: [{ drop: { InFlight: { greaterThanOrEqual: 8 } } }]".into(),
        });
    }
}

/// Bounds on waiting requests that no rule lets wait.
fn flow_control_unused(policy: &CompiledPolicy, out: &mut Vec<Warning>) {
    let waits = policy
        .rules
        .iter()
        .any(|r| matches!(r.route.on_empty, OnEmpty::Wait(_)));
    if policy.source.flow_control.is_some() && !waits {
        out.push(Warning {
            path: "flowControl".into(),
            message: "no rule has onEmpty: Wait, so no request ever waits and these bounds apply to nothing".into(),
            fix: "add onEmpty: Wait to the rules whose requests may wait, or remove flowControl".into(),
        });
    }
}

/// Fields renamed for the Kubernetes API conventions, read under their old
/// name for one release.
fn deprecated_spellings(policy: &CompiledPolicy, out: &mut Vec<Warning>) {
    for (i, p) in policy.source.providers.iter().enumerate() {
        if p.deprecated_base_url.is_some() {
            out.push(Warning {
                path: format!("providers[{i}].baseUrl"),
                message: "baseUrl is deprecated and will not be read after v1alpha1".into(),
                fix: "rename it to baseURL".into(),
            });
        }
    }
}

// ------------------------------------------------------------- shadowing

/// A rule after one that takes every request it would match (and never falls
/// through) can never decide anything.
fn shadowed_rule(earlier: &[Rule], rule: &Rule, path: &str, out: &mut Vec<Warning>) {
    let Some(matches) = &rule.matches else {
        return;
    };
    let by = earlier.iter().find(|e| {
        e.route.on_empty == OnEmpty::Reject
            && e.matches
                .as_ref()
                .is_some_and(|m| matches.iter().all(|c| covered_by(c, m)))
    });
    if let Some(by) = by {
        out.push(Warning {
            path: format!("{path}.matches"),
            message: format!(
                "rule {:?} can never match: every request it matches is taken by the earlier rule {:?}",
                rule.name, by.name
            ),
            fix: format!(
                "move it before {:?}, narrow {:?}'s matches, or delete it",
                by.name, by.name
            ),
        });
    }
}

/// An entry of a rule's matches that another entry of the same rule covers.
fn subsumed_entries(rule: &Rule, path: &str, out: &mut Vec<Warning>) {
    let Some(matches) = &rule.matches else {
        return;
    };
    for (j, entry) in matches.iter().enumerate() {
        let other = matches
            .iter()
            .enumerate()
            .find(|(k, o)| *k != j && implies(entry, o) && !(implies(o, entry) && *k > j));
        if let Some((k, _)) = other {
            out.push(Warning {
                path: format!("{path}.matches[{j}]"),
                message: format!(
                    "this entry adds nothing: matches[{k}] already matches every request it does"
                ),
                fix: format!("delete matches[{j}]"),
            });
        }
    }
}

/// Whether every request matching `entry` matches one of `entries` (sound,
/// not complete: false when unsure).
fn covered_by(entry: &Conjunction<RequestAttr>, entries: &[Conjunction<RequestAttr>]) -> bool {
    entries.iter().any(|e| implies(entry, e))
}

/// Whether every request meeting all of `a` meets all of `b`: each
/// predicate of `b` follows from one of `a`.
fn implies(a: &Conjunction<RequestAttr>, b: &Conjunction<RequestAttr>) -> bool {
    b.iter().all(|q| a.iter().any(|p| predicate_implies(p, q)))
}

fn predicate_implies(p: &Predicate<RequestAttr>, q: &Predicate<RequestAttr>) -> bool {
    p.attr == q.attr && test_implies(&p.test, &q.test)
}

fn test_implies(p: &Test, q: &Test) -> bool {
    use Test::*;
    match (p, q) {
        (OneOf(a), OneOf(b)) => a.iter().all(|v| b.contains(v)),
        (NotIn(a), NotIn(b)) => b.iter().all(|v| a.contains(v)),
        (Prefix(a), Prefix(b)) => a.starts_with(b.as_str()),
        (Regex(a), Regex(b)) => a.as_str() == b.as_str(),
        (ContainsAll(a), ContainsAll(b)) => b.iter().all(|v| a.contains(v)),
        (ContainsNone(a), ContainsNone(b)) => b.iter().all(|v| a.contains(v)),
        (Exists(a), Exists(b)) => a == b,
        (Compare(c1, o1), Compare(c2, o2)) => compare_implies(*c1, o1, *c2, o2),
        // Any test that holds needs the attribute.
        (OneOf(_) | Prefix(_) | Regex(_) | ContainsAll(_) | Compare(..), Exists(true)) => true,
        _ => false,
    }
}

fn compare_implies(
    c1: crate::model::Comparison,
    o1: &crate::model::Operand,
    c2: crate::model::Comparison,
    o2: &crate::model::Operand,
) -> bool {
    use crate::model::Comparison::*;
    use crate::model::Operand::Const;
    let (Const(a), Const(b)) = (o1, o2) else {
        return c1 == c2 && o1 == o2;
    };
    match (c1, c2) {
        (GreaterThan | GreaterThanOrEqual, GreaterThanOrEqual) => a >= b,
        (GreaterThan, GreaterThan) => a >= b,
        (GreaterThanOrEqual, GreaterThan) => a > b,
        (LessThan | LessThanOrEqual, LessThanOrEqual) => a <= b,
        (LessThan, LessThan) => a <= b,
        (LessThanOrEqual, LessThan) => a < b,
        _ => false,
    }
}

// ------------------------------------------------------------- classifiers

/// A rule that keeps requests carrying some of a classifier's tags local:
/// when that classifier times out or is skipped it emits no tag, the rule
/// does not match, and the request goes on to a later rule that may send it
/// to a provider. Naming the tags that mean "safe" (`containsNone`) fails
/// closed instead.
fn fail_open_tags(
    policy: &CompiledPolicy,
    index: usize,
    rule: &Rule,
    path: &str,
    out: &mut Vec<Warning>,
) {
    let Some(matches) = &rule.matches else {
        return;
    };
    // What matters is a rule keeping requests in the cluster while a later
    // one may send them out: the PII pattern.
    let keeps_local = !considered_types(rule).1;
    let later_sends_out = policy.rules[index + 1..]
        .iter()
        .any(|r| considered_types(r).1);
    if !(keeps_local && later_sends_out) {
        return;
    }
    for (j, entry) in matches.iter().enumerate() {
        for p in entry {
            let (RequestAttr::Tag, Test::OneOf(values)) = (&p.attr, &p.test) else {
                continue;
            };
            let tags: Vec<&str> = values
                .iter()
                .filter_map(|v| match v {
                    Value::Text(t) => Some(t.as_str()),
                    Value::Number(_) => None,
                })
                .collect();
            let Some(classifier) = policy
                .classifiers
                .iter()
                .find(|c| tags.iter().all(|t| c.tags.iter().any(|ct| ct == t)))
            else {
                continue;
            };
            let rest: Vec<&str> = classifier
                .tags
                .iter()
                .map(String::as_str)
                .filter(|t| !tags.contains(t))
                .collect();
            if rest.is_empty() {
                continue;
            }
            out.push(Warning {
                path: format!("{path}.matches[{j}].tag"),
                message: format!(
                    "fails open: when classifier {:?} times out or is skipped it emits no tag, this rule does not match and the request goes on to later rules",
                    classifier.name
                ),
                fix: format!("match what is safe instead: tag: {{ containsNone: [{}] }}", rest.join(", ")),
            });
        }
    }
}

fn unused_classifiers(policy: &CompiledPolicy, out: &mut Vec<Warning>) {
    let used =
        policy
            .rules
            .iter()
            .fold(Default::default(), |acc: crate::model::ClassifierSet, r| {
                r.route
                    .exclude
                    .iter()
                    .fold(acc.union(r.match_needs), |acc, e| acc.union(e.when_needs))
            });
    for (i, c) in policy.classifiers.iter().enumerate() {
        if !used.contains(i) {
            out.push(Warning {
                path: format!("classifiers[{i}]"),
                message: format!(
                    "classifier {:?} is declared but no rule reads its tags",
                    c.name
                ),
                fix: "delete it, or match on its tags".into(),
            });
        }
    }
}

// ------------------------------------------------------------- candidates

/// Candidate types a rule's consider list can produce.
fn considered_types(rule: &Rule) -> (bool, bool) {
    rule.route
        .consider
        .iter()
        .fold((false, false), |(l, p), c| {
            let BackendSelector {
                local, provider, ..
            } = &c.backends;
            (l || *local, p || *provider)
        })
}

/// A tier whose `order` names nothing the rule considers. (Tiers whose
/// type or objective cannot fit the consider set are compile errors.)
fn empty_tier(
    policy: &CompiledPolicy,
    rule: &Rule,
    tier: &Tier,
    path: &str,
    out: &mut Vec<Warning>,
) {
    let Rank::Order(names) = &tier.rank else {
        return;
    };
    let (local, provider) = considered_types(rule);
    let considered = |n: &String| {
        let named = |sel: &BackendSelector| sel.names.as_ref().is_none_or(|ns| ns.contains(n));
        let is_provider = policy.providers.iter().any(|p| &p.name == n);
        rule.route.consider.iter().any(|c| named(&c.backends))
            && ((is_provider && provider) || (!is_provider && local))
    };
    if !names.iter().any(considered) {
        out.push(Warning {
            path: format!("{path}.order"),
            message: "order names no candidate this rule considers, so the tier is always empty"
                .into(),
            fix: "name the considered providers or backends, best first".into(),
        });
    }
}

/// Ranking by KV-cache use, which only a scrape updates: between two
/// scrapes every candidate keeps its value, and ties go to the first in rank
/// order, so a burst lands on one candidate. (`QueueDepth` is not warned
/// about: the EPP adds the requests it picked since a scrape was sent to
/// it, so a burst spreads.)
fn burst_on_scraped_metric(rule: &Rule, tier: &Tier, path: &str, out: &mut Vec<Warning>) {
    let Rank::Minimize(m @ Metric::KvCacheUtilization) = tier.rank else {
        return;
    };
    if rule.route.tie_break == TieBreak::RankOrder {
        out.push(Warning {
            path: path.to_string(),
            message: format!(
                "minimize: {} is scraped, so between scrapes a burst ties and goes to the first candidate in rank order",
                m.name()
            ),
            fix: "add tieBreak: Random, or minimize RunningRequests (counts in-flight requests)".into(),
        });
    }
}

/// An exclude item that always applies and drops every candidate type the
/// rule considers: the rule can only reject (or fall through).
fn excludes_everything(rule: &Rule, deliberate: bool, path: &str, out: &mut Vec<Warning>) {
    // A rule that says what to answer (`reject:`) may be emptied on purpose,
    // to reject what reaches it.
    if deliberate {
        return;
    }
    let (local, provider) = considered_types(rule);
    for (i, Exclude { when, drop, .. }) in rule.route.exclude.iter().enumerate() {
        if when.is_some() {
            continue;
        }
        let drops = |ty: CandidateType| drop.iter().any(|entry| entry_is_type(entry, ty));
        let all = (!local || drops(CandidateType::Local))
            && (!provider || drops(CandidateType::Provider));
        if all && (local || provider) {
            out.push(Warning {
                path: format!("{path}.route.exclude[{i}]"),
                message: "drops every candidate this rule considers, on every request".into(),
                fix: "give it an if, narrow its drop, or narrow consider instead".into(),
            });
        }
    }
}

/// Whether an exclude item always drops every considered candidate.
fn always_empty(rule: &Rule) -> bool {
    let (local, provider) = considered_types(rule);
    rule.route.exclude.iter().any(|e| {
        let drops = |ty| e.drop.iter().any(|entry| entry_is_type(entry, ty));
        e.when.is_none()
            && (!local || drops(CandidateType::Local))
            && (!provider || drops(CandidateType::Provider))
    })
}

/// Whether `entry` is exactly a test that holds for every candidate of `ty`.
fn entry_is_type(entry: &Conjunction<CandidateAttr>, ty: CandidateType) -> bool {
    let name = match ty {
        CandidateType::Local => "Local",
        CandidateType::Provider => "Provider",
    };
    entry.len() == 1
        && entry[0].attr == CandidateAttr::Type
        && matches!(&entry[0].test, Test::OneOf(v) if v.contains(&Value::Text(name.into())))
}
