//! Decision records: what an EPP decided and over what, one JSON line each,
//! so a changed policy can be replayed against real traffic offline.
//!
//! A record holds the request attributes the policy reads with every
//! client-supplied value as `/debug/explain` shows it (tenant, LoRA and
//! header values digested, credentials and query strings dropped), the
//! classifier tags, the candidates and the decision. Never prompt text.

use std::collections::BTreeMap;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde::{Deserialize, Serialize};

use super::input::{Candidate, Request, Tags, parse_candidates};
use super::redact::digest;
use super::{Decision, NoTrace, evaluate_with};
use crate::attr::{CandidateType, RequestAttr};
use crate::model::{CompiledPolicy, Conjunction, Test, Value};

/// One decision as the EPP logs it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DecisionRecord {
    /// RFC 3339.
    pub time: String,
    pub policy_hash: String,
    pub request: Request,
    /// Every tag the classifiers that ran emitted. A classifier that did not
    /// run reads as one that timed out: it emitted nothing.
    pub tags: Vec<String>,
    pub candidates: Vec<Candidate>,
    pub decision: Outcome,
    /// The decision's random seed (`tieBreak: Random`): replay draws the same.
    pub seed: u64,
    /// The request headers the logging policy read, the only ones a record
    /// can hold: a replayed policy that reads others sees them absent.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub recorded_headers: Vec<String>,
}

/// Where a decision sent the request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "action")]
pub enum Outcome {
    #[serde(rename_all = "camelCase")]
    Route {
        rule: String,
        #[serde(rename = "type")]
        kind: CandidateType,
        /// `endpoint:model`, as explain traces name candidates.
        candidate: String,
        /// The winner's `Cost`, if priced.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cost: Option<f64>,
    },
    #[serde(rename_all = "camelCase")]
    Reject {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rule: Option<String>,
        status: u16,
    },
}

impl Outcome {
    pub fn of(policy: &CompiledPolicy, decision: &Decision, candidates: &[Candidate]) -> Self {
        match decision {
            Decision::Route(r) => {
                let winner = &candidates[r.winner];
                Outcome::Route {
                    rule: policy.rules[r.rule].name.clone(),
                    kind: winner.kind,
                    candidate: winner.label(),
                    cost: winner.metrics.cost,
                }
            }
            Decision::Reject(r) => Outcome::Reject {
                rule: r.rule.map(|i| policy.rules[i].name.clone()),
                status: r.status,
            },
        }
    }

    /// The rule that decided, if any.
    pub fn rule(&self) -> Option<&str> {
        match self {
            Outcome::Route { rule, .. } => Some(rule),
            Outcome::Reject { rule, .. } => rule.as_deref(),
        }
    }

    /// `Local`, `Provider` or `Reject`.
    pub fn kind(&self) -> &'static str {
        match self {
            Outcome::Route {
                kind: CandidateType::Local,
                ..
            } => "Local",
            Outcome::Route {
                kind: CandidateType::Provider,
                ..
            } => "Provider",
            Outcome::Reject { .. } => "Reject",
        }
    }

    pub fn cost(&self) -> Option<f64> {
        match self {
            Outcome::Route { cost, .. } => *cost,
            Outcome::Reject { .. } => None,
        }
    }
}

impl DecisionRecord {
    /// The record of `decision`, with the request's client values redacted.
    pub fn new(
        time: String,
        policy: &CompiledPolicy,
        request: &Request,
        tags: &Tags,
        candidates: Vec<Candidate>,
        decision: &Decision,
        seed: u64,
    ) -> Self {
        DecisionRecord {
            decision: Outcome::of(policy, decision, &candidates),
            time,
            policy_hash: policy.hash.clone(),
            request: request.redacted(),
            tags: tags.tags.clone(),
            candidates,
            seed,
            recorded_headers: policy.reads.headers.iter().cloned().collect(),
        }
    }

    /// One line of a decision log, as strictly as the explain inputs.
    pub fn parse(line: &str) -> Result<Self, String> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase", deny_unknown_fields)]
        struct Raw {
            time: String,
            policy_hash: String,
            request: Request,
            #[serde(default)]
            tags: Vec<String>,
            candidates: serde_json::Value,
            decision: Outcome,
            seed: u64,
            #[serde(default)]
            recorded_headers: Vec<String>,
        }
        let raw: Raw = serde_json::from_str(line).map_err(|e| e.to_string())?;
        Ok(DecisionRecord {
            time: raw.time,
            policy_hash: raw.policy_hash,
            request: raw.request,
            tags: raw.tags,
            candidates: parse_candidates(raw.candidates)?,
            decision: raw.decision,
            seed: raw.seed,
            recorded_headers: raw.recorded_headers,
        })
    }
}

/// `policy` for deciding recorded (redacted) requests: literals that tenant,
/// LoRA and header predicates compare for equality are digested the way
/// records show the values, so `tenant: alice` still matches alice's
/// records. Prefix and regex tests on those attributes cannot be decided
/// from a digest; [`undecidable_predicates`] counts them.
pub fn for_recorded_requests(policy: &CompiledPolicy) -> CompiledPolicy {
    let mut out = policy.clone();
    for rule in &mut out.rules {
        rule.matches.iter_mut().flatten().for_each(digest_literals);
        for exclude in &mut rule.route.exclude {
            exclude.when.iter_mut().flatten().for_each(digest_literals);
        }
    }
    out
}

/// How many request predicates of `policy` test a redacted value with a
/// prefix or a regex, which replay cannot decide.
pub fn undecidable_predicates(policy: &CompiledPolicy) -> usize {
    policy
        .rules
        .iter()
        .flat_map(|r| {
            let excludes = r.route.exclude.iter().filter_map(|e| e.when.as_ref());
            r.matches.iter().chain(excludes).flatten().flatten()
        })
        .filter(|p| is_digested(&p.attr) && matches!(p.test, Test::Prefix(_) | Test::Regex(_)))
        .count()
}

fn is_digested(attr: &RequestAttr) -> bool {
    matches!(
        attr,
        RequestAttr::Tenant | RequestAttr::Lora | RequestAttr::Header(_)
    )
}

fn digest_literals(entry: &mut Conjunction<RequestAttr>) {
    for p in entry.iter_mut().filter(|p| is_digested(&p.attr)) {
        if let Test::OneOf(values) | Test::NotIn(values) = &mut p.test {
            for v in values.iter_mut() {
                if let Value::Text(t) = v {
                    *t = digest(t);
                }
            }
        }
    }
}

/// Decides `record` again under `policy` (made by [`for_recorded_requests`]),
/// with the decision's own seed: the same policy draws the same
/// `tieBreak: Random` pick, and two policies the same pick among the same tie.
pub fn replay(policy: &CompiledPolicy, record: &DecisionRecord) -> Outcome {
    let mut rng = SmallRng::seed_from_u64(record.seed);
    let tags = &record.tags;
    // Tags a classifier emitted are in the record; one that did not run
    // emits nothing, as when it times out.
    let (decision, _) = evaluate_with(
        policy,
        &record.request,
        &record.candidates,
        &mut rng,
        &mut NoTrace,
        |c| {
            let emits = &policy.classifiers[c].tags;
            tags.iter().filter(|t| emits.contains(t)).cloned().collect()
        },
    );
    Outcome::of(policy, &decision, &record.candidates)
}

/// How two deciders (two policies, or the log and a policy) decide the same
/// records. Built one record at a time, so a log of any length takes bounded
/// memory.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct DiffSummary {
    pub records: usize,
    pub changed: usize,
    /// `(old rule → new rule, old kind → new kind)` → the changed records.
    pub groups: BTreeMap<(String, String), Group>,
    pub old: Totals,
    pub new: Totals,
}

/// The records of one kind of change.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Group {
    pub count: usize,
    /// Indices of the first [`EXAMPLES_PER_GROUP`] records.
    pub examples: Vec<usize>,
}

pub const EXAMPLES_PER_GROUP: usize = 3;

/// Outcome counts and the summed expected cost of one side's decisions.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Totals {
    pub local: usize,
    pub provider: usize,
    pub reject: usize,
    pub cost: f64,
}

impl Totals {
    fn add(&mut self, outcome: &Outcome) {
        match outcome.kind() {
            "Local" => self.local += 1,
            "Provider" => self.provider += 1,
            _ => self.reject += 1,
        }
        self.cost += outcome.cost().unwrap_or(0.0);
    }
}

impl DiffSummary {
    /// Counts record `index`, decided `before` and `after`. Returns whether
    /// it became an example of its group.
    pub fn add(&mut self, index: usize, before: &Outcome, after: &Outcome) -> bool {
        self.records += 1;
        self.old.add(before);
        self.new.add(after);
        if before == after {
            return false;
        }
        self.changed += 1;
        let rules = format!(
            "{} → {}",
            before.rule().unwrap_or("-"),
            after.rule().unwrap_or("-")
        );
        let kinds = format!("{} → {}", before.kind(), after.kind());
        let group = self.groups.entry((rules, kinds)).or_default();
        group.count += 1;
        let example = group.examples.len() < EXAMPLES_PER_GROUP;
        if example {
            group.examples.push(index);
        }
        example
    }
}

/// Replays every record under both policies (each made by
/// [`for_recorded_requests`]), each with the decision's own seed.
pub fn diff(old: &CompiledPolicy, new: &CompiledPolicy, records: &[DecisionRecord]) -> DiffSummary {
    let mut summary = DiffSummary::default();
    for (i, record) in records.iter().enumerate() {
        summary.add(i, &replay(old, record), &replay(new, record));
    }
    summary
}

/// Headers `policy` reads that `record` could not hold (the logging policy
/// did not read them): a replay sees them absent.
pub fn unrecorded_headers<'p>(policy: &'p CompiledPolicy, record: &DecisionRecord) -> Vec<&'p str> {
    policy
        .reads
        .headers
        .iter()
        .filter(|h| !record.recorded_headers.contains(h))
        .map(String::as_str)
        .collect()
}
