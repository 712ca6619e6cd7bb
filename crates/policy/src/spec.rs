//! The policy as users write it (YAML/JSON). These types are deliberately loose:
//! predicates are free-form maps, durations are strings. The compiler
//! (`crate::compile`) turns them into [`crate::model::CompiledPolicy`], and every
//! mistake becomes an error with its path instead of a serde failure.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Everything the policy language needs: the pool it routes over, providers,
/// classifiers and the ordered rules. The `InferencePolicy` CRD spec embeds it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PolicySpec {
    /// The model-server Pods this policy routes over. Unset: a rules-only
    /// policy, attached to an existing InferencePool that names the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolSpec>,
    /// The Gateway route in front of the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<RouteSpec>,
    /// Request header carrying the tenant, set by the gateway's auth layer.
    /// Default `x-kinference-tenant`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_header: Option<String>,
    /// Keeps a session on the Pod its last request went to, while that Pod
    /// stays among the matching rule's candidates (its consider and
    /// exclude).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_affinity: Option<SessionAffinitySpec>,
    /// Bounds on the requests that wait in the EPP for room (rules with
    /// `onEmpty: Wait`), all priorities together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_control: Option<FlowControlSpec>,
    /// Off-cluster inference providers (OpenAI-compatible APIs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub providers: Vec<ProviderSpec>,
    /// Prompt classifiers whose tags rules may match on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub classifiers: Vec<ClassifierSpec>,
    /// Ordered rules; the first that matches a request decides it.
    #[serde(default)]
    #[schemars(length(max = 128))]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["name"],
        "x-kubernetes-validations" = [{
            "rule": "self.all(r, has(r.matches) || r.name == self[size(self) - 1].name)",
            "message": "a rule without matches matches every request and must be the last rule"
        }]
    ))]
    pub rules: Vec<RuleSpec>,
}

/// Which Pods serve the pool, on which ports, and what local models cost.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolSpec {
    /// Label selector (matchLabels) of the model-server Pods.
    #[serde(default)]
    pub selector: BTreeMap<String, String>,
    /// Ports the model servers listen on.
    #[serde(default)]
    pub target_ports: Vec<TargetPort>,
    /// Optional per-model facts for local serving (price, context window).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub models: Vec<ModelSpec>,
}

/// Where a request's session key is: a header or a cookie (exactly one).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SessionAffinitySpec {
    /// Request header carrying the session key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// Cookie carrying the session key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cookie: Option<String>,
    /// How long a session is remembered after its last request (default
    /// `10m`, at most `24h`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl: Option<String>,
}

/// How much may wait in the EPP at once. When either bound is reached, the
/// lowest priority waiting (or arriving) is answered 429 first.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FlowControlSpec {
    /// Requests waiting at once (default 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub max_requests: Option<u32>,
    /// Request body bytes waiting at once (default 64 MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_bytes: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TargetPort {
    #[schemars(range(min = 1, max = 65535))]
    pub number: u16,
}

/// How the Gateway reaches the pool.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteSpec {
    /// Gateways the generated HTTPRoute attaches to.
    #[serde(default)]
    pub parent_refs: Vec<ParentRef>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hostnames: Vec<String>,
    /// Path prefix the route matches; default `/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ParentRef {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub section_name: Option<String>,
}

/// An off-cluster, OpenAI-compatible inference provider.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.baseURL) != has(self.baseUrl)",
    "message": "set baseURL (baseUrl is its deprecated spelling), exactly once"
}]))]
pub struct ProviderSpec {
    pub name: String,
    /// e.g. `https://api.example.com/v1`. Required.
    #[serde(rename = "baseURL", default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// Deprecated spelling of `baseURL` (Kubernetes API conventions write
    /// acronyms in capitals), still read in v1alpha1 with a lint warning.
    #[serde(rename = "baseUrl", default, skip_serializing_if = "Option::is_none")]
    pub deprecated_base_url: Option<String>,
    /// API flavour; only `openai` is supported today.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Secret holding the API key, injected as `Authorization: Bearer`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretKeyRef>,
    /// Models this provider serves, with their mapping and prices.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub models: Vec<ModelSpec>,
}

impl ProviderSpec {
    /// The base URL, whichever spelling set it.
    pub fn url(&self) -> Option<&str> {
        self.base_url
            .as_deref()
            .or(self.deprecated_base_url.as_deref())
    }
}

/// Key within a provider's Secret when its [`SecretKeyRef`] names none.
pub const DEFAULT_SECRET_KEY: &str = "apiKey";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretKeyRef {
    pub name: String,
    /// Key within the Secret; default `apiKey`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

/// A model as the policy names it, and what serving it costs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelSpec {
    /// The model name requests and rules use.
    pub name: String,
    /// The name the destination knows it by, if different.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price: Option<PriceSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_window: Option<u64>,
}

/// USD per million tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PriceSpec {
    pub input: f64,
    /// Price of prompt tokens the destination has cached; default: `input`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input: Option<f64>,
    pub output: f64,
}

/// A classifier whose tags rules can match (`tag: [pii-confirmed]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClassifierSpec {
    pub name: String,
    /// `pii`, `complexity`, `code` (built in) or `http` (external).
    #[serde(rename = "type")]
    pub kind: String,
    /// How long the classifier may take before it is skipped (emits no tags).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
    /// `http` only: where the prompt is POSTed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// `http` only: the tags it may return, so rules can be checked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
}

/// One rule: when it applies (`matches`) and what it does (`route`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuleSpec {
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// Entries are ORed; predicates within an entry are ANDed. Unset: every request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "predicate_entries_schema")]
    pub matches: Option<Vec<Predicates>>,
    pub route: RouteClause,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteClause {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consider: Option<Vec<ConsiderSpec>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclude: Option<Vec<ExcludeSpec>>,
    /// Tiers in order; the first with a surviving candidate wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub select: Option<Vec<TierSpec>>,
    /// `PreferLocal` or `Random`; unset: first in rank order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["PreferLocal", "Random"]))]
    pub tie_break: Option<String>,
    /// `Reject` (default), `FallThrough`, or `Wait`: the request waits in
    /// the EPP, by priority, until a candidate survives the rule again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["Reject", "FallThrough", "Wait"]))]
    pub on_empty: Option<String>,
    /// With `onEmpty: Wait`: how long a request may wait before the rule's
    /// reject answers it (default `10s`, at most `10m`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reject: Option<RejectSpec>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConsiderSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models: Option<ModelsSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backends: Option<BackendsSelector>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelsSelector {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub names: Option<Vec<String>>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BackendsSelector {
    /// `Local` or `Provider`; unset with no names: every destination.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["Local", "Provider"]))]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub names: Option<Vec<String>>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExcludeSpec {
    /// Request predicates; unset: always.
    #[serde(rename = "if", default, skip_serializing_if = "Option::is_none")]
    pub when: Option<PredicateList>,
    /// Candidate predicates: matching candidates are dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drop: Option<PredicateList>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "(has(self.minimize) ? 1 : 0) + (has(self.maximize) ? 1 : 0) + (has(self.order) ? 1 : 0) <= 1",
    "message": "a tier takes at most one of minimize, maximize and order"
}]))]
pub struct TierSpec {
    /// `Local`, `Provider` or `Any` (default).
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["Local", "Provider", "Any"]))]
    pub kind: Option<String>,
    /// Candidate predicates a candidate must meet to be in this tier.
    #[serde(rename = "if", default, skip_serializing_if = "Option::is_none")]
    pub when: Option<PredicateList>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minimize: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maximize: Option<String>,
    /// Provider or backend names, best first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<Vec<String>>,
    /// Candidates this close to the best are tied: `10%`, `50ms`, or a number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub within: Option<Scalar>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RejectSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 400, max = 599))]
    pub status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Entries of free-form predicate maps. Typed as opaque objects, not maps of
/// opaque values, because CEL rules (`has(r.matches)`) cannot see fields of a
/// type that has `additionalProperties` with unknown fields.
fn predicate_entries_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "array",
        "nullable": true,
        "items": { "type": "object", "x-kubernetes-preserve-unknown-fields": true }
    })
}

/// `attribute: how-to-match` pairs, ANDed.
pub type Predicates = BTreeMap<String, MatchValue>;

/// A free-form match value (scalar, list or one-key operator map). Kept as
/// JSON so the compiler can report every mistake with its path.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MatchValue(pub FreeForm);

impl JsonSchema for MatchValue {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "MatchValue".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
    }
}

/// One predicate map (a single AND-entry) or a list of them (ORed).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PredicateList(pub FreeForm);

impl JsonSchema for PredicateList {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "PredicateList".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
    }
}

/// The deepest nesting a free-form value may have. The language needs three
/// levels (a list of operator maps over lists); anything much deeper is a
/// mistake or an attack.
pub const MAX_FREE_FORM_DEPTH: usize = 16;

/// JSON the schema leaves open (`x-kubernetes-preserve-unknown-fields`),
/// which the API server stores at any depth. Decoding one never fails and
/// never recurses past [`MAX_FREE_FORM_DEPTH`]: a value nested deeper
/// decodes to [`FreeForm::TooDeep`], which the compiler reports with its
/// path. Otherwise one such object would fail the decoding of a whole list
/// of policies (serde_json stops at 128 levels), and with it a watch.
#[derive(Clone, Debug, PartialEq)]
pub enum FreeForm {
    Json(serde_json::Value),
    TooDeep,
}

impl FreeForm {
    /// The value, or the error the compiler reports.
    pub fn json(&self) -> Result<&serde_json::Value, String> {
        match self {
            FreeForm::Json(v) => Ok(v),
            FreeForm::TooDeep => Err(format!(
                "nested deeper than {MAX_FREE_FORM_DEPTH} levels; predicates need at most 3"
            )),
        }
    }
}

impl From<serde_json::Value> for FreeForm {
    fn from(v: serde_json::Value) -> Self {
        FreeForm::Json(v)
    }
}

impl Serialize for FreeForm {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            FreeForm::Json(v) => v.serialize(s),
            FreeForm::TooDeep => s.serialize_unit(),
        }
    }
}

impl<'de> Deserialize<'de> for FreeForm {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // A raw value is skipped over without recursion (serde_json scans
        // it with a stack of its own), so its depth can be measured first.
        let raw = Box::<serde_json::value::RawValue>::deserialize(d)?;
        if json_depth(raw.get()) > MAX_FREE_FORM_DEPTH {
            return Ok(FreeForm::TooDeep);
        }
        serde_json::from_str(raw.get())
            .map(FreeForm::Json)
            .map_err(serde::de::Error::custom)
    }
}

/// The nesting depth of well-formed JSON text: brackets outside strings.
fn json_depth(text: &str) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for b in text.bytes() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// A string or number (`within: 10%`, `within: 2`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Scalar {
    Number(f64),
    Text(String),
}

impl JsonSchema for Scalar {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Scalar".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "x-kubernetes-int-or-string": true })
    }
}
