//! Names shared by the operator, the EPP and the gateway configuration.

pub const GROUP: &str = "kinference.io";
/// Pod label listing the models a model server serves (comma-separated).
pub const MODELS_LABEL: &str = "kinference.io/models";
/// Pod label naming the backend a Pod belongs to (`backend.name`).
pub const BACKEND_LABEL: &str = "kinference.io/backend";
/// Label on every object the operator generates, naming its policy.
pub const POLICY_LABEL: &str = "kinference.io/policy";
/// ConfigMap keys written by the operator and read by the EPP.
pub const POLICY_KEY: &str = "policy.json";
pub const POLICY_HASH_KEY: &str = "policy.sha256";
/// Request header that sends a request to a provider's HTTPRoute rule.
pub const DESTINATION_HEADER: &str = "x-kinference-destination";
pub const CONDITION_ACCEPTED: &str = "Accepted";
pub const CONDITION_RESOLVED_REFS: &str = "ResolvedRefs";
pub const CONDITION_READY: &str = "Ready";
/// kstatus's abnormal-true conditions: work is under way (the EPP rolling
/// out or loading the policy), or cannot go on without a change to the
/// policy (invalid, or a name taken by another object).
pub const CONDITION_RECONCILING: &str = "Reconciling";
pub const CONDITION_STALLED: &str = "Stalled";
