//! What evaluation reads: the request, the classifier tags, the candidates.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

use crate::attr::{CandidateAttr, CandidateType, Metric, RequestAttr};
use crate::duration::parse_duration;
use crate::model::ClassifierSet;

use super::placement::Placement;

/// Request attributes (SPEC.md section 3).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Request {
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default)]
    pub path: String,
    /// `chat`, `completions`, `embeddings` or `responses`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<String>,
    /// Header names lower-cased.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[serde(deserialize_with = "lowercase_keys")]
    pub headers: BTreeMap<String, String>,
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<String>,
    /// Seconds.
    #[serde(default, rename = "ttftSLO", deserialize_with = "seconds_opt")]
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "duration_text"
    )]
    pub ttft_slo: Option<f64>,
    /// The `ip:port` the request's session last went to (`sessionAffinity`),
    /// while the session is remembered: the request stays there if that Pod
    /// is among the matching rule's candidates after exclude.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_address: Option<String>,
    /// The InferenceObjective the request names
    /// (`x-gateway-inference-objective`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objective: Option<String>,
    /// Its objective's priority; 0 without one, as the reference EPP does.
    /// Higher waits less and is shed last.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority: i32,
}

fn is_zero(n: &i32) -> bool {
    *n == 0
}

/// The value of an attribute, borrowed from the request or candidate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Val<'a> {
    Text(&'a str),
    Number(f64),
    Set(&'a [String]),
}

/// Predicates see at most this many bytes of a request's text attribute
/// (model, tenant, path, a header). A client controls these values; without
/// a cap, one 60 KB header made each regex predicate cost milliseconds. Every
/// identifier a rule should route on is far shorter.
pub const MAX_ATTRIBUTE_BYTES: usize = 1024;

/// `text` cut to [`MAX_ATTRIBUTE_BYTES`] at a character boundary.
pub fn clamp_attribute(text: &str) -> &str {
    if text.len() <= MAX_ATTRIBUTE_BYTES {
        return text;
    }
    let mut end = MAX_ATTRIBUTE_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

impl Request {
    /// The request as predicates see it: every text attribute clamped, so
    /// a copy kept for later (an explain trace) is small and evaluates the
    /// same.
    pub fn clamped(mut self) -> Self {
        let clamp = |s: &mut String| s.truncate(clamp_attribute(s).len());
        clamp(&mut self.model);
        clamp(&mut self.path);
        self.tenant.as_mut().map(clamp);
        self.lora.as_mut().map(clamp);
        self.objective.as_mut().map(clamp);
        self.headers.values_mut().for_each(clamp);
        self
    }

    pub fn value<'a>(&'a self, attr: &RequestAttr, tags: &'a Tags) -> Option<Val<'a>> {
        let text = |s: &'a Option<String>| s.as_deref().map(|s| Val::Text(clamp_attribute(s)));
        match attr {
            RequestAttr::Model => {
                (!self.model.is_empty()).then_some(Val::Text(clamp_attribute(&self.model)))
            }
            RequestAttr::Tenant => text(&self.tenant),
            RequestAttr::Path => Some(Val::Text(clamp_attribute(&self.path))),
            RequestAttr::Api => text(&self.api),
            RequestAttr::Header(h) => self.headers.get(h).map(|v| Val::Text(clamp_attribute(v))),
            RequestAttr::PromptTokens => Some(Val::Number(self.prompt_tokens as f64)),
            RequestAttr::MaxTokens => self.max_tokens.map(|n| Val::Number(n as f64)),
            RequestAttr::Stream => Some(Val::Text(if self.stream { "true" } else { "false" })),
            RequestAttr::Lora => text(&self.lora),
            RequestAttr::TtftSlo => self.ttft_slo.map(Val::Number),
            RequestAttr::Tag => Some(Val::Set(&tags.tags)),
            RequestAttr::Objective => text(&self.objective),
            RequestAttr::Priority => Some(Val::Number(f64::from(self.priority))),
        }
    }
}

/// Tags emitted so far, and which classifiers have run (a classifier that
/// timed out has run and emitted nothing).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tags {
    pub computed: ClassifierSet,
    pub tags: Vec<String>,
}

impl Tags {
    /// Tags from a source that already ran every classifier (tests, explain).
    pub fn complete(tags: Vec<String>) -> Self {
        Tags {
            computed: ClassifierSet(u64::MAX),
            tags,
        }
    }

    pub fn record(&mut self, classifier: usize, tags: impl IntoIterator<Item = String>) {
        self.computed = self.computed.with(classifier);
        for t in tags {
            if !self.tags.contains(&t) {
                self.tags.push(t);
            }
        }
    }
}

/// One (destination, model) pair the request could be sent to. Written
/// with the policy's attribute names (see [`Candidate::serialize`]); read
/// through [`parse_candidates`].
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Candidate {
    #[serde(rename = "type")]
    pub kind: CandidateType,
    pub model: String,
    /// Pod name, or provider name.
    pub endpoint: String,
    /// `ip:port` of a local Pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    #[serde(default, rename = "backend", skip_serializing_if = "Option::is_none")]
    pub backend_name: Option<String>,
    #[serde(default, rename = "provider", skip_serializing_if = "Option::is_none")]
    pub provider_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, flatten)]
    pub metrics: Metrics,
    /// Where `CachedPrefixTokens` came from, for traces; not an attribute
    /// policies read.
    #[serde(default)]
    pub cached_prefix_source: Option<PrefixSource>,
    /// What `minimize: PredictedTTFT` adds to the prediction, term by term.
    #[serde(default)]
    pub placement: Placement,
}

/// How a Pod's cached prefix was known.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum PrefixSource {
    /// The model server's own KV-cache events (precise prefix mode).
    Events,
    /// What the EPP routed there.
    Estimate,
}

impl PrefixSource {
    pub fn as_str(self) -> &'static str {
        match self {
            PrefixSource::Events => "events",
            PrefixSource::Estimate => "estimate",
        }
    }
}

/// Metric attributes; `None` when unknown (stale scrape, not priced, ...).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    #[serde(
        rename = "QueueDepth",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub queue_depth: Option<f64>,
    #[serde(
        rename = "RunningRequests",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub running_requests: Option<f64>,
    #[serde(
        rename = "KVCacheUtilization",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub kv_cache_utilization: Option<f64>,
    #[serde(
        rename = "CachedPrefixTokens",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub cached_prefix_tokens: Option<f64>,
    /// Seconds.
    #[serde(rename = "PredictedTTFT", default, deserialize_with = "seconds_opt")]
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "duration_text"
    )]
    pub predicted_ttft: Option<f64>,
    /// Seconds.
    #[serde(rename = "ObservedTTFT", default, deserialize_with = "seconds_opt")]
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "duration_text"
    )]
    pub observed_ttft: Option<f64>,
    #[serde(rename = "ErrorRate", default, skip_serializing_if = "Option::is_none")]
    pub error_rate: Option<f64>,
    /// USD for this request.
    #[serde(rename = "Cost", default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
    #[serde(
        rename = "contextWindow",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub context_window: Option<f64>,
    /// A LoRA request's candidate: 1 when its Pod has the adapter loaded
    /// (running or waiting in `vllm:lora_requests_info`), else 0.
    #[serde(
        rename = "loraLoaded",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub lora_loaded: Option<f64>,
    /// A LoRA request's candidate: adapters its Pod can still load without
    /// evicting one in use (`max_lora` minus those running or waiting).
    #[serde(
        rename = "loraSlotsFree",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub lora_slots_free: Option<f64>,
    /// Requests this EPP has sent to the candidate that have not finished:
    /// counted at every dispatch and completion, not at a scrape.
    #[serde(rename = "InFlight", default, skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<f64>,
}

impl Metrics {
    pub fn get(&self, metric: Metric) -> Option<f64> {
        match metric {
            Metric::QueueDepth => self.queue_depth,
            Metric::RunningRequests => self.running_requests,
            Metric::KvCacheUtilization => self.kv_cache_utilization,
            Metric::CachedPrefixTokens => self.cached_prefix_tokens,
            Metric::PredictedTtft => self.predicted_ttft,
            Metric::ObservedTtft => self.observed_ttft,
            Metric::ErrorRate => self.error_rate,
            Metric::Cost => self.cost,
            Metric::ContextWindow => self.context_window,
            Metric::LoraLoaded => self.lora_loaded,
            Metric::LoraSlotsFree => self.lora_slots_free,
            Metric::InFlight => self.in_flight,
        }
        .filter(|v| !v.is_nan())
    }
}

impl Candidate {
    pub fn value(&self, attr: &CandidateAttr) -> Option<Val<'_>> {
        match attr {
            CandidateAttr::Type => Some(Val::Text(self.kind.as_str())),
            CandidateAttr::Model => Some(Val::Text(&self.model)),
            CandidateAttr::BackendName => self.backend_name.as_deref().map(Val::Text),
            CandidateAttr::ProviderName => self.provider_name.as_deref().map(Val::Text),
            CandidateAttr::Endpoint => Some(Val::Text(&self.endpoint)),
            CandidateAttr::Zone => self.zone.as_deref().map(Val::Text),
            CandidateAttr::Node => self.node.as_deref().map(Val::Text),
            CandidateAttr::Label(k) => self.labels.get(k).map(|v| Val::Text(v)),
            CandidateAttr::Metric(m) => self.metrics.get(*m).map(Val::Number),
        }
    }

    /// What a tier that minimizes `metric` ranks by: the metric, plus the
    /// placement terms for `PredictedTTFT` (`eval::placement`).
    pub fn minimized(&self, metric: Metric) -> Option<f64> {
        let value = self.metrics.get(metric)?;
        Some(match metric {
            Metric::PredictedTtft => value + self.placement.total(),
            _ => value,
        })
    }

    /// The name `order` tiers and `backends.names` rank and select by.
    pub fn destination_name(&self) -> Option<&str> {
        match self.kind {
            CandidateType::Local => self.backend_name.as_deref(),
            CandidateType::Provider => self.provider_name.as_deref(),
        }
    }

    /// A short label for traces: `provider/openai:gpt-4o` or `pod-1:qwen`.
    pub fn label(&self) -> String {
        match self.kind {
            CandidateType::Local => format!("{}:{}", self.endpoint, self.model),
            CandidateType::Provider => format!("provider/{}:{}", self.endpoint, self.model),
        }
    }
}

/// Durations in request/candidate files, written as in policies: `120ms`,
/// `1.5s`. A bare number is refused: `300` could mean seconds or
/// milliseconds, and read as seconds it silently made every Pod look slow.
fn seconds_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Number(f64),
        Text(String),
    }
    match Option::<Raw>::deserialize(d)? {
        None => Ok(None),
        Some(Raw::Number(n)) => Err(serde::de::Error::custom(format!(
            "write the duration {n} with its unit, as in policies: `{n}ms` or `{n}s`"
        ))),
        Some(Raw::Text(t)) => parse_duration(&t)
            .map(|d| Some(d.as_secs_f64()))
            .map_err(serde::de::Error::custom),
    }
}

/// Writes seconds the way [`seconds_opt`] reads them.
fn duration_text<S: serde::Serializer>(seconds: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match seconds {
        Some(secs) => s.serialize_str(&format!("{}ms", secs * 1000.0)),
        None => s.serialize_none(),
    }
}

/// Header names are case-insensitive: kept lower-cased, as policies name them.
fn lowercase_keys<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    let headers = BTreeMap::<String, String>::deserialize(d)?;
    Ok(headers
        .into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect())
}

/// Every field a candidate in a file may have (`Candidate` flattens its
/// metrics, so serde cannot refuse unknown ones itself). Attributes are
/// named as policies name them (`backend.name`, `label.<key>`); `backend`,
/// `provider` and a `labels` map are read too.
pub const CANDIDATE_FIELDS: &[&str] = &[
    "type",
    "model",
    "endpoint",
    "address",
    "backend.name",
    "provider.name",
    "zone",
    "node",
    "label.<key>",
    "backend",
    "provider",
    "labels",
    "QueueDepth",
    "RunningRequests",
    "KVCacheUtilization",
    "CachedPrefixTokens",
    "PredictedTTFT",
    "ObservedTTFT",
    "ErrorRate",
    "Cost",
    "contextWindow",
    "loraLoaded",
    "loraSlotsFree",
    "InFlight",
    "cachedPrefixSource",
    "placement",
];

/// Candidates from a file's JSON, refusing unknown fields (a typo such as
/// `KVCacheUtilisation` would otherwise read as "no value").
pub fn parse_candidates(mut value: serde_json::Value) -> Result<Vec<Candidate>, String> {
    let items = value
        .as_array_mut()
        .ok_or("candidates must be a list of maps")?;
    for (i, item) in items.iter_mut().enumerate() {
        let fields = item
            .as_object_mut()
            .ok_or_else(|| format!("candidates[{i}]: expected a map"))?;
        from_policy_names(fields).map_err(|e| format!("candidates[{i}]: {e}"))?;
        // Checked here for the path: the flattened metrics lose it.
        for field in ["PredictedTTFT", "ObservedTTFT"] {
            if let Some(n) = fields.get(field).filter(|v| v.is_number()) {
                return Err(format!(
                    "candidates[{i}].{field}: write the duration {n} with its unit, as in policies: `{n}ms` or `{n}s`"
                ));
            }
        }
        if let Some(unknown) = fields
            .keys()
            .find(|k| !CANDIDATE_FIELDS.contains(&k.as_str()))
        {
            return Err(format!(
                "candidates[{i}]: unknown field `{unknown}` (known: {})",
                CANDIDATE_FIELDS.join(", ")
            ));
        }
    }
    serde_path_to_error::deserialize(value)
        .map_err(|e| format!("candidates{}: {}", e.path(), e.inner()))
}

impl Serialize for Candidate {
    /// As policies name the attributes: `backend.name`, `provider.name`,
    /// one `label.<key>` per label, and the metrics by their names.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{Error as _, SerializeMap};
        let metrics = serde_json::to_value(&self.metrics).map_err(S::Error::custom)?;
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("type", &self.kind)?;
        map.serialize_entry("model", &self.model)?;
        map.serialize_entry("endpoint", &self.endpoint)?;
        let optional = [
            ("address", &self.address),
            ("backend.name", &self.backend_name),
            ("provider.name", &self.provider_name),
            ("zone", &self.zone),
            ("node", &self.node),
        ];
        for (name, value) in optional {
            if let Some(v) = value {
                map.serialize_entry(name, v)?;
            }
        }
        for (key, value) in &self.labels {
            map.serialize_entry(&format!("label.{key}"), value)?;
        }
        for (name, value) in metrics.as_object().into_iter().flatten() {
            map.serialize_entry(name, value)?;
        }
        if let Some(source) = &self.cached_prefix_source {
            map.serialize_entry("cachedPrefixSource", source)?;
        }
        if !self.placement.is_empty() {
            map.serialize_entry("placement", &self.placement)?;
        }
        map.end()
    }
}

/// Renames the policy's attribute names to the fields [`Candidate`] reads:
/// `backend.name` to `backend`, `provider.name` to `provider`, each
/// `label.<key>` into the `labels` map.
fn from_policy_names(
    fields: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<(), String> {
    for (policy_name, field) in [("backend.name", "backend"), ("provider.name", "provider")] {
        if let Some(v) = fields.remove(policy_name) {
            if fields.contains_key(field) {
                return Err(format!(
                    "both `{policy_name}` and `{field}`: write only `{policy_name}`"
                ));
            }
            fields.insert(field.to_owned(), v);
        }
    }
    let label_keys: Vec<String> = fields
        .keys()
        .filter(|k| k.starts_with("label."))
        .cloned()
        .collect();
    for key in label_keys {
        let v = fields.remove(&key).expect("listed above");
        let labels = fields
            .entry("labels")
            .or_insert_with(|| serde_json::Value::Object(Default::default()))
            .as_object_mut()
            .ok_or("`labels` must be a map")?;
        let label = &key["label.".len()..];
        if labels.insert(label.to_owned(), v).is_some() {
            return Err(format!("label {label:?} given twice"));
        }
    }
    Ok(())
}
