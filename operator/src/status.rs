//! The one writer of `InferencePolicy.status`: what the conditions say, given
//! what the reconciler observed. Pure (the reconciler does the I/O), so every
//! combination is unit-tested here.
//!
//! Conventions (kstatus, which Argo CD and Flux use for health):
//! `observedGeneration` on the status and on each condition; `Ready` is the
//! summary condition; `lastTransitionTime` changes only when a condition's
//! `status` changes, so a status that does not change is not rewritten.

use std::collections::{BTreeMap, BTreeSet};

use crate::attachment::{Attached, PoolState};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kinference_api::{
    CONDITION_ACCEPTED, CONDITION_READY, CONDITION_RECONCILING, CONDITION_RESOLVED_REFS,
    CONDITION_STALLED, InferencePolicyStatus,
};

pub const REASON_ACCEPTED: &str = "Accepted";
/// Accepted, and `kinference lint` would warn: the message lists the warnings.
pub const REASON_ACCEPTED_WITH_WARNINGS: &str = "AcceptedWithWarnings";
pub const REASON_INVALID_POLICY: &str = "InvalidPolicy";
pub const REASON_RESOLVED_REFS: &str = "ResolvedRefs";
pub const REASON_SECRET_NOT_FOUND: &str = "SecretNotFound";
pub const REASON_GATEWAY_NOT_FOUND: &str = "GatewayNotFound";
/// ResolvedRefs is Unknown: no EPP Pod has reported on some provider key.
pub const REASON_SECRETS_NOT_CHECKED: &str = "SecretsNotChecked";
pub const REASON_READY: &str = "Ready";
pub const REASON_EPP_UNAVAILABLE: &str = "EppUnavailable";
/// Applying or pruning a generated object failed (the message names it).
pub const REASON_APPLY_FAILED: &str = "ApplyFailed";
/// A generated name is taken by an object the policy does not control.
pub const REASON_CONFLICT: &str = "Conflict";
pub const REASON_POLICY_NOT_LOADED: &str = "PolicyNotLoaded";
/// An attached policy's pool is missing, or sends its requests to another
/// EPP: the policy does not take effect.
pub const REASON_NOT_ATTACHED: &str = "NotAttached";
pub const REASON_POOL_NOT_FOUND: &str = "InferencePoolNotFound";

/// Condition messages are capped by the API (32 KiB); stay well below.
const MAX_MESSAGE: usize = 16 * 1024;
/// Event notes are capped at 1 kB.
const MAX_NOTE: usize = 1000;

/// Whether the current generation compiled.
#[derive(Clone, Debug, PartialEq)]
pub enum Acceptance {
    Accepted {
        hash: String,
        rules: usize,
        providers: usize,
        pool: String,
        /// Lint warnings as `path: message (fix: ...)`.
        warnings: Vec<String>,
    },
    /// Every error as `path: message`.
    Rejected { errors: Vec<String> },
}

/// References that do not resolve, as names to show users.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RefReport {
    pub namespace: String,
    /// `name (key k)`: an EPP Pod reports no value for key `k` of Secret
    /// `name` (the Secret or the key is missing, or the value is empty).
    pub missing_secrets: Vec<String>,
    /// `name (key k)`: no live EPP Pod has reported on it yet. The operator
    /// cannot tell by itself: it has no access to Secrets.
    pub unchecked_secrets: Vec<String>,
    /// `namespace/name` of Gateways.
    pub missing_gateways: Vec<String>,
    /// `namespace/name` of the InferencePool an attached policy names.
    pub missing_pool: Option<String>,
}

/// What the EPP Deployment and its Pods report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EppReport {
    pub deployment: String,
    pub available_replicas: i32,
    /// The policy hash each live EPP Pod reports having loaded.
    pub loaded_hashes: BTreeSet<String>,
    /// (Secret, key) → whether any live EPP Pod found a value for it.
    pub secret_keys: BTreeMap<(String, String), bool>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Observation {
    pub generation: Option<i64>,
    pub acceptance: Acceptance,
    pub refs: RefReport,
    pub epp: EppReport,
    /// Hash held by the policy ConfigMap (the last accepted policy), read
    /// when the current generation is rejected.
    pub configured_hash: Option<String>,
    /// Why applying or pruning the generated objects failed, if it did:
    /// the Ready reason ([`REASON_CONFLICT`] or [`REASON_APPLY_FAILED`]) and
    /// the message.
    pub apply_failure: Option<(&'static str, String)>,
    /// An attached policy's pool (None: the policy declares its pool).
    pub attachment: Option<Attached>,
}

/// The status to write for `obs`, keeping transition times from `prev`.
pub fn compute(
    prev: Option<&InferencePolicyStatus>,
    obs: &Observation,
    now: Timestamp,
) -> InferencePolicyStatus {
    let generation = obs.generation;
    let Described {
        pool,
        rules,
        policy_hash,
    } = described(prev, obs);
    let accepted = accepted(&obs.acceptance);
    let ready = ready(obs, policy_hash.as_deref());
    let (stalled, reconciling) = progress(&accepted, &ready);
    let known = |(ok, reason, message): Verdict| (Some(ok), reason, message);
    let conditions = [
        (CONDITION_ACCEPTED, known(accepted)),
        (CONDITION_RESOLVED_REFS, resolved_refs(&obs.refs)),
        (CONDITION_READY, known(ready)),
        (CONDITION_RECONCILING, known(reconciling)),
        (CONDITION_STALLED, known(stalled)),
    ]
    .into_iter()
    .map(|(type_, verdict)| to_condition(prev, type_, verdict, generation, now))
    .collect();
    InferencePolicyStatus {
        observed_generation: generation,
        conditions,
        pool,
        rules,
        policy_hash,
    }
}

/// A condition's status, reason and message.
type Verdict = (bool, &'static str, String);
/// A [`Verdict`] that may be Unknown (`None`).
type MaybeVerdict = (Option<bool>, &'static str, String);

/// What the status says of the policy the EPP is given.
struct Described {
    pool: Option<String>,
    rules: Option<i32>,
    policy_hash: Option<String>,
}

/// The accepted policy's pool, rule count and hash. A rejected generation
/// leaves the last accepted policy's, which is what the EPP keeps serving.
fn described(prev: Option<&InferencePolicyStatus>, obs: &Observation) -> Described {
    match &obs.acceptance {
        Acceptance::Accepted {
            hash, rules, pool, ..
        } => Described {
            pool: Some(pool.clone()),
            rules: Some(i32::try_from(*rules).unwrap_or(i32::MAX)),
            policy_hash: Some(hash.clone()),
        },
        Acceptance::Rejected { .. } => Described {
            pool: prev.and_then(|p| p.pool.clone()),
            rules: prev.and_then(|p| p.rules),
            policy_hash: prev
                .and_then(|p| p.policy_hash.clone())
                .or_else(|| obs.configured_hash.clone()),
        },
    }
}

/// `Accepted`: whether the policy compiled, and what it holds or why not.
fn accepted(acceptance: &Acceptance) -> Verdict {
    match acceptance {
        Acceptance::Accepted {
            hash,
            rules,
            providers,
            warnings,
            ..
        } => (
            true,
            if warnings.is_empty() {
                REASON_ACCEPTED
            } else {
                REASON_ACCEPTED_WITH_WARNINGS
            },
            truncate(
                &format!(
                    "policy compiled: {rules} rule{}, {providers} provider{}; hash {}{}",
                    plural(*rules),
                    plural(*providers),
                    short(hash),
                    warnings_suffix(warnings)
                ),
                MAX_MESSAGE,
            ),
        ),
        Acceptance::Rejected { errors } => (
            false,
            REASON_INVALID_POLICY,
            truncate(&errors.join("; "), MAX_MESSAGE),
        ),
    }
}

/// `ResolvedRefs`: every Secret key, Gateway and InferencePool the policy
/// names exists; Unknown while no EPP Pod has reported on the Secrets.
fn resolved_refs(refs: &RefReport) -> MaybeVerdict {
    let all_found = refs.missing_secrets.is_empty()
        && refs.missing_gateways.is_empty()
        && refs.missing_pool.is_none();
    if all_found && refs.unchecked_secrets.is_empty() {
        return (
            Some(true),
            REASON_RESOLVED_REFS,
            "all referenced Secrets and Gateways exist".to_string(),
        );
    }
    if all_found {
        return (
            None,
            REASON_SECRETS_NOT_CHECKED,
            format!(
                "no EPP Pod has reported on the provider Secret key{} {} in namespace {} yet \
                 (the EPP reads them; the operator has no access to Secrets)",
                plural(refs.unchecked_secrets.len()),
                refs.unchecked_secrets.join(", "),
                refs.namespace
            ),
        );
    }
    let mut parts = Vec::new();
    if !refs.missing_secrets.is_empty() {
        parts.push(format!(
            "Secret key{} missing or empty in namespace {}: {}",
            plural(refs.missing_secrets.len()),
            refs.namespace,
            refs.missing_secrets.join(", ")
        ));
    }
    if !refs.missing_gateways.is_empty() {
        parts.push(format!(
            "Gateway{} not found: {}",
            plural(refs.missing_gateways.len()),
            refs.missing_gateways.join(", ")
        ));
    }
    if let Some(pool) = &refs.missing_pool {
        parts.push(format!("InferencePool not found: {pool}"));
    }
    if !refs.unchecked_secrets.is_empty() {
        parts.push(format!(
            "not reported by an EPP Pod yet: {}",
            refs.unchecked_secrets.join(", ")
        ));
    }
    let reason = if !refs.missing_secrets.is_empty() {
        REASON_SECRET_NOT_FOUND
    } else if refs.missing_pool.is_some() {
        REASON_POOL_NOT_FOUND
    } else {
        REASON_GATEWAY_NOT_FOUND
    };
    (Some(false), reason, parts.join("; "))
}

/// `Ready`: an available EPP replica reports the accepted policy as loaded.
/// `last_accepted`: the hash the status describes.
fn ready(obs: &Observation, last_accepted: Option<&str>) -> Verdict {
    let epp = &obs.epp;
    let serving = |hash: &str| epp.available_replicas >= 1 && epp.loaded_hashes.contains(hash);
    match &obs.acceptance {
        Acceptance::Accepted { .. } if let Some((reason, message)) = &obs.apply_failure => {
            (false, *reason, truncate(message, MAX_MESSAGE))
        }
        Acceptance::Accepted { .. } if let Some(why) = not_attached(obs.attachment.as_ref()) => {
            (false, REASON_NOT_ATTACHED, why)
        }
        Acceptance::Accepted { hash, .. } if epp.available_replicas < 1 => (
            false,
            REASON_EPP_UNAVAILABLE,
            format!(
                "EPP Deployment {} has no available replica; policy {} is not served yet",
                epp.deployment,
                short(hash)
            ),
        ),
        Acceptance::Accepted { hash, .. } if serving(hash) => (
            true,
            REASON_READY,
            format!("EPP {} serves policy {}", epp.deployment, short(hash)),
        ),
        Acceptance::Accepted { hash, .. } => (
            false,
            REASON_POLICY_NOT_LOADED,
            format!(
                "no EPP Pod of {} reports policy {} as loaded yet{}",
                epp.deployment,
                short(hash),
                loaded_suffix(&epp.loaded_hashes)
            ),
        ),
        Acceptance::Rejected { .. } => {
            let mut message =
                "this generation of the policy is invalid (see the Accepted condition)".to_string();
            match last_accepted {
                Some(last) if serving(last) => message.push_str(&format!(
                    "; the EPP keeps serving the last accepted policy {}",
                    short(last)
                )),
                Some(last) => message.push_str(&format!(
                    "; the last accepted policy {} stays configured, but the EPP does not serve it",
                    short(last)
                )),
                None => message.push_str("; no policy has been accepted yet"),
            }
            (false, REASON_INVALID_POLICY, message)
        }
    }
}

/// The condition `type_` says `verdict` for `generation`; its transition
/// time is kept from `prev` while its status stays.
fn to_condition(
    prev: Option<&InferencePolicyStatus>,
    type_: &str,
    (ok, reason, message): MaybeVerdict,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    let status = match ok {
        Some(true) => "True",
        Some(false) => "False",
        None => "Unknown",
    };
    let since = condition(prev, type_)
        .filter(|c| c.status == status)
        .map(|c| c.last_transition_time.clone())
        // Whole seconds: that is all the API stores, so a time we write
        // compares equal to the one we read back.
        .unwrap_or_else(|| Time(Timestamp::from_second(now.as_second()).unwrap_or(now)));
    Condition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time: since,
    }
}

/// Why an attached policy does not take effect, if it does not.
fn not_attached(attachment: Option<&Attached>) -> Option<String> {
    let Attached { pool, state } = attachment?;
    match state {
        PoolState::Missing => Some(format!(
            "InferencePool {pool} does not exist; the EPP serves it once it does"
        )),
        PoolState::Elsewhere { names, fix } => Some(format!(
            "InferencePool {pool} sends its requests to the EPP Service {names:?}, not to this \
             policy's: {fix}"
        )),
        // A conflict is an apply failure: the reconciler applies nothing.
        PoolState::Served | PoolState::Conflict { .. } => None,
    }
}

/// kstatus's `Stalled` and `Reconciling` from `Ready`: stalled while the
/// policy must change first (invalid, or a generated name someone else
/// holds), reconciling while the work goes on (the EPP rolling out or
/// loading the policy, an apply to retry); neither once ready. Flux and
/// Argo CD read them: invalid → Failed, under way → InProgress, ready →
/// Current. An invalid policy's `Stalled` says its errors, as `Accepted`.
fn progress(accepted: &Verdict, ready: &Verdict) -> (Verdict, Verdict) {
    let (ok, reason, message) = ready;
    let stalls = matches!(*reason, REASON_INVALID_POLICY | REASON_CONFLICT);
    let why = if accepted.0 { message } else { &accepted.2 };
    let stalled = (!ok && stalls, *reason, why.clone());
    let reconciling = (!ok && !stalls, *reason, message.clone());
    (stalled, reconciling)
}

pub fn condition<'a>(
    status: Option<&'a InferencePolicyStatus>,
    type_: &str,
) -> Option<&'a Condition> {
    status?.conditions.iter().find(|c| c.type_ == type_)
}

pub fn is_true(status: Option<&InferencePolicyStatus>, type_: &str) -> bool {
    condition(status, type_).is_some_and(|c| c.status == "True")
}

/// A Kubernetes Event to publish for a state change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusEvent {
    pub warning: bool,
    pub reason: String,
    pub note: String,
}

/// Events for the changes from `prev` to `next`: a policy accepted (or a new
/// accepted hash), rejected (or rejected differently), references broken or
/// fixed, Ready gained or lost. Nothing when nothing changed, so periodic
/// reconciles stay silent. Good news that arrives together is one Event
/// (see [`one_normal_event`]); each failure is an Event of its own.
pub fn events(
    prev: Option<&InferencePolicyStatus>,
    next: &InferencePolicyStatus,
) -> Vec<StatusEvent> {
    let mut out = Vec::new();
    let changed = |type_: &str| {
        let (a, b) = (condition(prev, type_), condition(Some(next), type_));
        a.map(|c| (&c.status, &c.reason, &c.message))
            != b.map(|c| (&c.status, &c.reason, &c.message))
    };
    let flipped = |type_: &str| {
        condition(prev, type_).map(|c| &c.status) != condition(Some(next), type_).map(|c| &c.status)
    };
    let mut push = |c: &Condition| {
        out.push(StatusEvent {
            warning: c.status != "True",
            reason: c.reason.clone(),
            note: truncate(&c.message, MAX_NOTE),
        })
    };
    if let Some(c) = condition(Some(next), CONDITION_ACCEPTED) {
        let new_hash = prev.and_then(|p| p.policy_hash.as_ref()) != next.policy_hash.as_ref();
        if (c.status == "True" && (flipped(CONDITION_ACCEPTED) || new_hash))
            || (c.status != "True" && changed(CONDITION_ACCEPTED))
        {
            push(c);
        }
    }
    // Unknown (waiting for an EPP report) is no failure: no Event, and its
    // end is announced only if it had followed a failure.
    if let Some(c) = condition(Some(next), CONDITION_RESOLVED_REFS) {
        let was_false =
            condition(prev, CONDITION_RESOLVED_REFS).is_some_and(|p| p.status == "False");
        if (c.status == "False" && changed(CONDITION_RESOLVED_REFS))
            || (c.status == "True" && was_false)
        {
            push(c);
        }
    }
    if let Some(c) = condition(Some(next), CONDITION_READY) {
        let was_true = is_true(prev, CONDITION_READY);
        if (c.status == "True" && flipped(CONDITION_READY)) || (c.status != "True" && was_true) {
            push(c);
        }
    }
    one_normal_event(out)
}

/// Folds the Normal Events of one status change into one, under the reason
/// of the first (the cause: `Accepted`, `ResolvedRefs`) with every note: a
/// new policy whose EPP is already up is one Event, not two, which at a
/// thousand policies is a thousand writes fewer. Warnings stay apart, so
/// each failure keeps a reason of its own to alert on.
fn one_normal_event(events: Vec<StatusEvent>) -> Vec<StatusEvent> {
    let (normal, mut out): (Vec<_>, Vec<_>) = events.into_iter().partition(|e| !e.warning);
    let mut normal = normal.into_iter();
    if let Some(first) = normal.next() {
        let notes: Vec<String> = std::iter::once(first.note)
            .chain(normal.map(|e| e.note))
            .collect();
        out.push(StatusEvent {
            warning: false,
            reason: first.reason,
            note: truncate(&notes.join("; "), MAX_NOTE),
        });
    }
    out
}

fn short(hash: &str) -> &str {
    hash.get(..12).unwrap_or(hash)
}

fn warnings_suffix(warnings: &[String]) -> String {
    match warnings.len() {
        0 => String::new(),
        n => format!("; {n} warning{}: {}", plural(n), warnings.join("; ")),
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn loaded_suffix(loaded: &BTreeSet<String>) -> String {
    if loaded.is_empty() {
        String::new()
    } else {
        let list: Vec<&str> = loaded.iter().map(|h| short(h)).collect();
        format!(" (loaded: {})", list.join(", "))
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max.saturating_sub(3);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH: &str = "0123456789abcdef0123456789abcdef";
    const OLD: &str = "fedcba9876543210fedcba9876543210";

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_750_000_000 + s).unwrap()
    }

    fn accepted() -> Acceptance {
        Acceptance::Accepted {
            hash: HASH.into(),
            rules: 2,
            providers: 1,
            pool: "chat".into(),
            warnings: Vec::new(),
        }
    }

    #[test]
    fn lint_warnings_ride_on_accepted() {
        let mut acceptance = accepted();
        if let Acceptance::Accepted { warnings, .. } = &mut acceptance {
            warnings.push("rules[1].matches: rule \"b\" can never match (fix: delete it)".into());
        }
        let s = compute(None, &obs(acceptance, 0, &[]), t(0));
        let c = cond(&s, "Accepted");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", "AcceptedWithWarnings")
        );
        assert!(
            c.message.ends_with(
                "; 1 warning: rules[1].matches: rule \"b\" can never match (fix: delete it)"
            ),
            "{}",
            c.message
        );
    }

    fn obs(acceptance: Acceptance, available: i32, loaded: &[&str]) -> Observation {
        Observation {
            generation: Some(4),
            acceptance,
            refs: RefReport {
                namespace: "team-a".into(),
                ..RefReport::default()
            },
            epp: EppReport {
                deployment: "chat-epp".into(),
                available_replicas: available,
                loaded_hashes: loaded.iter().map(|s| s.to_string()).collect(),
                ..EppReport::default()
            },
            configured_hash: None,
            apply_failure: None,
            attachment: None,
        }
    }

    /// An attached policy, its EPP serving, in each state of its pool.
    #[test]
    fn an_attached_policy_is_ready_only_once_its_pool_sends_it_requests() {
        let with = |state: PoolState, missing: bool| {
            let mut o = obs(accepted(), 1, &[HASH]);
            o.attachment = Some(Attached {
                pool: "team-a/shared".into(),
                state,
            });
            o.refs.missing_pool = missing.then(|| "team-a/shared".to_string());
            compute(None, &o, t(0))
        };
        let summary = |s: &InferencePolicyStatus| {
            ["ResolvedRefs", "Ready", "Reconciling", "Stalled"]
                .map(|type_| {
                    let c = cond(s, type_);
                    format!("{type_}={} {}", c.status, c.reason)
                })
                .join(", ")
        };

        let missing = with(PoolState::Missing, true);
        assert_eq!(
            summary(&missing),
            "ResolvedRefs=False InferencePoolNotFound, Ready=False NotAttached, \
             Reconciling=True NotAttached, Stalled=False NotAttached"
        );
        assert_eq!(
            cond(&missing, "ResolvedRefs").message,
            "InferencePool not found: team-a/shared"
        );
        let elsewhere = with(
            PoolState::Elsewhere {
                names: "vllm-epp".into(),
                fix: "set its spec.endpointPickerRef to {name: chat-epp, port: {number: 9002}}"
                    .into(),
            },
            false,
        );
        assert_eq!(
            summary(&elsewhere),
            "ResolvedRefs=True ResolvedRefs, Ready=False NotAttached, \
             Reconciling=True NotAttached, Stalled=False NotAttached"
        );
        assert_eq!(
            cond(&elsewhere, "Ready").message,
            "InferencePool team-a/shared sends its requests to the EPP Service \"vllm-epp\", \
             not to this policy's: set its spec.endpointPickerRef to \
             {name: chat-epp, port: {number: 9002}}"
        );
        let served = with(PoolState::Served, false);
        assert_eq!(
            summary(&served),
            "ResolvedRefs=True ResolvedRefs, Ready=True Ready, \
             Reconciling=False Ready, Stalled=False Ready"
        );
    }

    fn cond<'a>(s: &'a InferencePolicyStatus, type_: &str) -> &'a Condition {
        condition(Some(s), type_).unwrap()
    }

    #[test]
    fn accepted_and_ready() {
        let s = compute(None, &obs(accepted(), 1, &[HASH]), t(0));
        assert_eq!(s.observed_generation, Some(4));
        assert_eq!(s.pool.as_deref(), Some("chat"));
        assert_eq!(s.rules, Some(2));
        assert_eq!(s.policy_hash.as_deref(), Some(HASH));
        let types: Vec<&str> = s.conditions.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(
            types,
            [
                "Accepted",
                "ResolvedRefs",
                "Ready",
                "Reconciling",
                "Stalled"
            ]
        );
        for c in &s.conditions[3..] {
            assert_eq!(c.status, "False", "{c:?}");
        }
        for c in &s.conditions[..3] {
            assert_eq!(
                (c.status.as_str(), c.observed_generation),
                ("True", Some(4)),
                "{c:?}"
            );
        }
        assert_eq!(cond(&s, "Accepted").reason, "Accepted");
        assert_eq!(
            cond(&s, "Accepted").message,
            "policy compiled: 2 rules, 1 provider; hash 0123456789ab"
        );
        assert_eq!(
            cond(&s, "Ready").message,
            "EPP chat-epp serves policy 0123456789ab"
        );
        assert_eq!(cond(&s, "Ready").last_transition_time, Time(t(0)));
    }

    /// kstatus's reading: Stalled (Failed) for what needs a change to the
    /// policy, Reconciling (InProgress) while the work goes on, neither
    /// once Ready (Current).
    #[test]
    fn stalled_and_reconciling_follow_kstatus() {
        let state = |s: &InferencePolicyStatus| {
            (
                cond(s, "Reconciling").status.clone(),
                cond(s, "Stalled").status.clone(),
                cond(s, "Ready").reason.clone(),
            )
        };
        let row =
            |r: &str, s: &str, reason: &str| (r.to_string(), s.to_string(), reason.to_string());
        let ready = compute(None, &obs(accepted(), 1, &[HASH]), t(0));
        assert_eq!(state(&ready), row("False", "False", "Ready"));
        let rolling = compute(None, &obs(accepted(), 0, &[]), t(0));
        assert_eq!(state(&rolling), row("True", "False", "EppUnavailable"));
        let loading = compute(None, &obs(accepted(), 1, &[OLD]), t(0));
        assert_eq!(state(&loading), row("True", "False", "PolicyNotLoaded"));
        let invalid = Acceptance::Rejected {
            errors: vec!["rules[0].route.select: select is required".into()],
        };
        let stalled = compute(None, &obs(invalid, 1, &[HASH]), t(0));
        assert_eq!(state(&stalled), row("False", "True", "InvalidPolicy"));
        assert_eq!(
            cond(&stalled, "Stalled").message,
            "rules[0].route.select: select is required"
        );
        let mut taken = obs(accepted(), 1, &[HASH]);
        taken.apply_failure = Some((REASON_CONFLICT, "HTTPRoute team-a/chat exists".into()));
        assert_eq!(
            state(&compute(None, &taken, t(0))),
            row("False", "True", "Conflict")
        );
        let mut retried = obs(accepted(), 1, &[HASH]);
        retried.apply_failure = Some((REASON_APPLY_FAILED, "timeout".into()));
        let retrying = compute(None, &retried, t(0));
        assert_eq!(state(&retrying), row("True", "False", "ApplyFailed"));
        assert_eq!(cond(&retrying, "Reconciling").message, "timeout");
    }

    #[test]
    fn ready_waits_for_availability_then_the_hash() {
        let s = compute(None, &obs(accepted(), 0, &[HASH]), t(0));
        assert_eq!(cond(&s, "Ready").reason, "EppUnavailable");
        assert_eq!(cond(&s, "Ready").status, "False");
        let s = compute(Some(&s), &obs(accepted(), 1, &[OLD]), t(5));
        assert_eq!(cond(&s, "Ready").reason, "PolicyNotLoaded");
        assert!(cond(&s, "Ready").message.contains("(loaded: fedcba987654)"));
        // Still False: the transition time is kept.
        assert_eq!(cond(&s, "Ready").last_transition_time, Time(t(0)));
        let s = compute(Some(&s), &obs(accepted(), 1, &[OLD, HASH]), t(9));
        assert_eq!(cond(&s, "Ready").status, "True");
        assert_eq!(cond(&s, "Ready").last_transition_time, Time(t(9)));
    }

    #[test]
    fn a_failed_apply_makes_ready_false_with_the_error_even_if_an_old_epp_serves() {
        let mut o = obs(accepted(), 1, &[HASH]);
        o.apply_failure = Some((
            REASON_APPLY_FAILED,
            "ConfigMap team-a/chat-policy would hold 1200000 bytes, over the API server's limit of 1048576 bytes for one object; make the policy smaller".into(),
        ));
        let s = compute(None, &o, t(0));
        let ready = cond(&s, "Ready");
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "ApplyFailed")
        );
        assert!(
            ready
                .message
                .starts_with("ConfigMap team-a/chat-policy would hold 1200000 bytes")
        );
        assert_eq!(ready.observed_generation, Some(4));
        assert_eq!(cond(&s, "Accepted").status, "True");
        // Once the apply succeeds, Ready follows the EPP again.
        o.apply_failure = None;
        let s = compute(Some(&s), &o, t(5));
        assert_eq!(cond(&s, "Ready").status, "True");
    }

    #[test]
    fn unchanged_observation_gives_an_identical_status() {
        let first = compute(None, &obs(accepted(), 1, &[HASH]), t(0));
        let again = compute(Some(&first), &obs(accepted(), 1, &[HASH]), t(60));
        assert_eq!(first, again);
        assert!(events(Some(&first), &again).is_empty());
    }

    #[test]
    fn rejection_keeps_the_served_policy_in_status() {
        let good = compute(None, &obs(accepted(), 1, &[HASH]), t(0));
        let rejected = Acceptance::Rejected {
            errors: vec![
                "spec.rules[1].route.select[0]: unknown objective \"Speed\"".into(),
                "spec.providers[0].models: a provider needs at least one model it serves".into(),
            ],
        };
        let mut o = obs(rejected, 1, &[HASH]);
        o.generation = Some(5);
        let bad = compute(Some(&good), &o, t(30));
        let accepted = cond(&bad, "Accepted");
        assert_eq!(
            (accepted.status.as_str(), accepted.reason.as_str()),
            ("False", "InvalidPolicy")
        );
        assert_eq!(
            accepted.message,
            "spec.rules[1].route.select[0]: unknown objective \"Speed\"; \
             spec.providers[0].models: a provider needs at least one model it serves"
        );
        assert_eq!(accepted.observed_generation, Some(5));
        let ready = cond(&bad, "Ready");
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "InvalidPolicy")
        );
        assert!(
            ready
                .message
                .ends_with("the EPP keeps serving the last accepted policy 0123456789ab"),
            "{}",
            ready.message
        );
        assert_eq!(bad.policy_hash.as_deref(), Some(HASH));
        assert_eq!(bad.rules, Some(2));
        assert_eq!(bad.observed_generation, Some(5));

        let ev = events(Some(&good), &bad);
        assert_eq!(
            ev.iter().map(|e| e.reason.as_str()).collect::<Vec<_>>(),
            ["InvalidPolicy", "InvalidPolicy"]
        );
        assert!(ev.iter().all(|e| e.warning));
    }

    #[test]
    fn rejection_without_history() {
        let o = obs(
            Acceptance::Rejected {
                errors: vec!["spec.pool.selector: x".into()],
            },
            0,
            &[],
        );
        let s = compute(None, &o, t(0));
        assert!(
            cond(&s, "Ready")
                .message
                .ends_with("no policy has been accepted yet")
        );
        assert_eq!(s.policy_hash, None);
        // The ConfigMap still holds an older accepted policy (e.g. status lost).
        let mut o = o;
        o.configured_hash = Some(OLD.into());
        let s = compute(None, &o, t(0));
        assert_eq!(s.policy_hash.as_deref(), Some(OLD));
        assert!(
            cond(&s, "Ready")
                .message
                .contains("stays configured, but the EPP does not serve it")
        );
    }

    #[test]
    fn missing_refs_are_named() {
        let mut o = obs(accepted(), 1, &[HASH]);
        o.refs.missing_secrets = vec![
            "openai-key (key apiKey)".into(),
            "proxy-token (key apiKey)".into(),
        ];
        o.refs.missing_gateways = vec!["gateways/inference-gateway".into()];
        // A key no EPP has reported on does not hide the ones known missing,
        // and is named too.
        o.refs.unchecked_secrets = vec!["other (key apiKey)".into()];
        let s = compute(None, &o, t(0));
        let c = cond(&s, "ResolvedRefs");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "SecretNotFound")
        );
        assert_eq!(
            c.message,
            "Secret keys missing or empty in namespace team-a: openai-key (key apiKey), \
             proxy-token (key apiKey); Gateway not found: gateways/inference-gateway; \
             not reported by an EPP Pod yet: other (key apiKey)"
        );
        o.refs.missing_secrets.clear();
        let s = compute(None, &o, t(0));
        assert_eq!(cond(&s, "ResolvedRefs").reason, "GatewayNotFound");
    }

    #[test]
    fn unreported_secret_keys_leave_resolved_refs_unknown_and_quiet() {
        let mut o = obs(accepted(), 0, &[]);
        o.refs.unchecked_secrets = vec!["openai-key (key apiKey)".into()];
        let waiting = compute(None, &o, t(0));
        let c = cond(&waiting, "ResolvedRefs");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("Unknown", "SecretsNotChecked")
        );
        assert_eq!(
            c.message,
            "no EPP Pod has reported on the provider Secret key openai-key (key apiKey) in \
             namespace team-a yet (the EPP reads them; the operator has no access to Secrets)"
        );
        // Not a failure: no Warning Event for it.
        assert!(
            events(None, &waiting)
                .iter()
                .all(|e| e.reason != "SecretsNotChecked"),
        );
        // The EPP reports the key found: True, quietly (it never failed).
        let resolved = compute(Some(&waiting), &obs(accepted(), 0, &[]), t(1));
        assert_eq!(cond(&resolved, "ResolvedRefs").status, "True");
        assert!(
            events(Some(&waiting), &resolved)
                .iter()
                .all(|e| e.reason != "ResolvedRefs")
        );
        // Reported missing: False, with a Warning.
        let mut o = obs(accepted(), 0, &[]);
        o.refs.missing_secrets = vec!["openai-key (key apiKey)".into()];
        let missing = compute(Some(&waiting), &o, t(2));
        let ev = events(Some(&waiting), &missing);
        assert!(
            ev.iter().any(|e| e.reason == "SecretNotFound" && e.warning),
            "{ev:?}"
        );
    }

    #[test]
    fn events_on_transitions_only() {
        let pending = compute(None, &obs(accepted(), 0, &[]), t(0));
        let ev = events(None, &pending);
        assert_eq!(
            ev.iter()
                .map(|e| (e.reason.as_str(), e.warning))
                .collect::<Vec<_>>(),
            [("Accepted", false)]
        );
        let ready = compute(Some(&pending), &obs(accepted(), 1, &[HASH]), t(1));
        let ev = events(Some(&pending), &ready);
        assert_eq!(
            ev.iter().map(|e| e.reason.as_str()).collect::<Vec<_>>(),
            ["Ready"]
        );
        let lost = compute(Some(&ready), &obs(accepted(), 0, &[HASH]), t(2));
        let ev = events(Some(&ready), &lost);
        assert_eq!(
            ev.iter()
                .map(|e| (e.reason.as_str(), e.warning))
                .collect::<Vec<_>>(),
            [("EppUnavailable", true)]
        );
        let mut broken = obs(accepted(), 1, &[HASH]);
        broken.refs.missing_secrets = vec!["k".into()];
        let b = compute(Some(&ready), &broken, t(3));
        assert_eq!(events(Some(&ready), &b)[0].reason, "SecretNotFound");
        let fixed = compute(Some(&b), &obs(accepted(), 1, &[HASH]), t(4));
        assert_eq!(events(Some(&b), &fixed)[0].reason, "ResolvedRefs");
    }

    #[test]
    fn good_news_arriving_together_is_one_event_and_failures_stay_apart() {
        // Accepted and Ready in the same write: one Event, the cause's
        // reason, both notes.
        let ready = compute(None, &obs(accepted(), 1, &[HASH]), t(0));
        assert_eq!(cond(&ready, "Ready").status, "True");
        let ev = events(None, &ready);
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert_eq!((ev[0].reason.as_str(), ev[0].warning), ("Accepted", false));
        assert_eq!(
            ev[0].note,
            format!(
                "{}; {}",
                cond(&ready, "Accepted").message,
                cond(&ready, "Ready").message
            )
        );
        // Two failures at once: two Warnings.
        let mut broken = obs(accepted(), 0, &[HASH]);
        broken.refs.missing_secrets = vec!["k".into()];
        let b = compute(Some(&ready), &broken, t(1));
        let mut reasons: Vec<_> = events(Some(&ready), &b)
            .into_iter()
            .map(|e| (e.reason, e.warning))
            .collect();
        reasons.sort();
        assert_eq!(
            reasons,
            [
                ("EppUnavailable".to_string(), true),
                ("SecretNotFound".to_string(), true)
            ]
        );
    }

    #[test]
    fn long_messages_are_truncated_on_char_boundaries() {
        let s = truncate(&"é".repeat(1000), 11);
        assert_eq!(s, "éééé...");
        let errors = vec!["x".repeat(MAX_MESSAGE * 2)];
        let st = compute(None, &obs(Acceptance::Rejected { errors }, 0, &[]), t(0));
        assert!(cond(&st, "Accepted").message.len() <= MAX_MESSAGE);
        assert!(events(None, &st).iter().all(|e| e.note.len() <= MAX_NOTE));
    }
}
