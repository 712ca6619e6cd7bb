//! The last decisions, kept cheaply (inputs only) so `/debug/explain` can
//! replay them with a trace on demand instead of tracing every request.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use kinference_policy::eval::{Candidate, Decision, Request, Tags, evaluate_traced};
use serde_json::{Value, json};

use crate::policy_store::LoadedPolicy;
use kinference_runtime::sync::lock;

/// Inputs of one decision. Holds no prompt text, only the headers the
/// policy reads, and every value clamped as predicates see it (so a client's
/// megabyte header is kept as at most 1 KiB).
pub struct RecordedDecision {
    pub at: SystemTime,
    pub policy: Arc<LoadedPolicy>,
    pub request: Request,
    pub tags: Tags,
    pub candidates: Vec<Candidate>,
    pub seed: u64,
    /// Its wait for room (`onEmpty: Wait`), if it waited.
    pub waited: Option<Waited>,
}

/// A decision's wait for room.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Waited {
    pub priority: i32,
    pub took: std::time::Duration,
    pub outcome: WaitOutcome,
}

/// How a wait for room ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitOutcome {
    /// Room came: the decision is the route.
    Dispatched,
    /// `maxWait` passed: the rule's reject answered.
    Expired,
    /// A higher priority took the place: 429.
    Shed,
    /// Evaluated again, the policy answered without waiting (a reload).
    Rejected,
}

impl WaitOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            WaitOutcome::Dispatched => "dispatched",
            WaitOutcome::Expired => "expired",
            WaitOutcome::Shed => "shed",
            WaitOutcome::Rejected => "rejected",
        }
    }
}

/// A replayed trace larger than this is left out of `/debug/explain`.
const MAX_TRACE_BYTES: usize = 64 * 1024;

pub struct RecentDecisions {
    capacity: usize,
    items: Mutex<VecDeque<RecordedDecision>>,
}

impl RecentDecisions {
    pub fn new(capacity: usize) -> Self {
        RecentDecisions {
            capacity,
            items: Mutex::new(VecDeque::with_capacity(capacity)),
        }
    }

    pub fn push(&self, d: RecordedDecision) {
        let mut items = lock(&self.items);
        if items.len() == self.capacity {
            items.pop_front();
        }
        items.push_back(d);
    }

    /// The newest `limit` decisions, newest first, each replayed with a trace.
    pub fn explain(&self, limit: usize) -> Vec<Value> {
        let items = lock(&self.items);
        items.iter().rev().take(limit).map(replay).collect()
    }
}

fn replay(d: &RecordedDecision) -> Value {
    let compiled = &d.policy.compiled;
    let (evaluation, trace) = evaluate_traced(compiled, &d.request, &d.tags, &d.candidates, d.seed);
    let outcome = match evaluation {
        kinference_policy::eval::Evaluation::Decided(Decision::Route(r)) => json!({
            "action": "route",
            "rule": compiled.rules[r.rule].name,
            "candidate": d.candidates[r.winner].label(),
            "address": d.candidates[r.winner].address,
        }),
        kinference_policy::eval::Evaluation::Decided(Decision::Reject(r)) => json!({
            "action": "reject",
            "rule": r.rule.map(|i| compiled.rules[i].name.clone()),
            "status": r.status,
            "message": r.message,
        }),
        kinference_policy::eval::Evaluation::NeedTags(_) => json!({ "action": "unknown" }),
    };
    let at =
        d.at.duration_since(SystemTime::UNIX_EPOCH)
            .map(|t| t.as_secs_f64())
            .unwrap_or_default();
    let trace = serde_json::to_value(&trace).unwrap_or_default();
    let trace_bytes = trace.to_string().len();
    let trace = if trace_bytes > MAX_TRACE_BYTES {
        json!({ "omitted": format!("the trace is {trace_bytes} bytes, over the {MAX_TRACE_BYTES}-byte cap") })
    } else {
        trace
    };
    let mut out = json!({
        "at": at,
        "policyHash": compiled.hash,
        "request": d.request.redacted(),
        "tags": d.tags.tags,
        "candidates": d.candidates.len(),
        "trace": trace,
        "decision": outcome,
    });
    if let Some(waited) = d.waited {
        // The trace replays the last evaluation: the one room came for, or
        // the one that ended the wait.
        out["waited"] = json!({
            "priority": waited.priority,
            "ms": waited.took.as_secs_f64() * 1e3,
            "outcome": waited.outcome.as_str(),
        });
    }
    out
}
