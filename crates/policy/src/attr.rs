//! The attribute vocabulary of the language: which names exist, their types,
//! and which candidate types define them (SPEC.md section 3).

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttrType {
    String,
    Numeric,
    Set,
    Duration,
}

impl fmt::Display for AttrType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttrType::String => "string",
            AttrType::Numeric => "numeric",
            AttrType::Set => "set",
            AttrType::Duration => "duration",
        })
    }
}

/// Attributes of the request.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RequestAttr {
    Model,
    Tenant,
    Path,
    Api,
    Header(String),
    PromptTokens,
    MaxTokens,
    Stream,
    Lora,
    TtftSlo,
    Tag,
    Objective,
    Priority,
}

pub const REQUEST_ATTRIBUTES: &[&str] = &[
    "model",
    "tenant",
    "path",
    "api",
    "header.<name>",
    "promptTokens",
    "maxTokens",
    "stream",
    "lora",
    "ttftSLO",
    "tag",
    "objective",
    "priority",
];

impl RequestAttr {
    pub fn parse(name: &str) -> Option<Self> {
        if let Some(header) = name.strip_prefix("header.") {
            return (!header.is_empty()).then(|| RequestAttr::Header(header.to_ascii_lowercase()));
        }
        Some(match name {
            "model" => RequestAttr::Model,
            "tenant" => RequestAttr::Tenant,
            "path" => RequestAttr::Path,
            "api" => RequestAttr::Api,
            "promptTokens" => RequestAttr::PromptTokens,
            "maxTokens" => RequestAttr::MaxTokens,
            "stream" => RequestAttr::Stream,
            "lora" => RequestAttr::Lora,
            "ttftSLO" => RequestAttr::TtftSlo,
            "tag" => RequestAttr::Tag,
            "objective" => RequestAttr::Objective,
            "priority" => RequestAttr::Priority,
            _ => return None,
        })
    }

    pub fn ty(&self) -> AttrType {
        match self {
            RequestAttr::PromptTokens | RequestAttr::MaxTokens | RequestAttr::Priority => {
                AttrType::Numeric
            }
            RequestAttr::TtftSlo => AttrType::Duration,
            RequestAttr::Tag => AttrType::Set,
            _ => AttrType::String,
        }
    }
}

impl fmt::Display for RequestAttr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestAttr::Model => f.write_str("model"),
            RequestAttr::Tenant => f.write_str("tenant"),
            RequestAttr::Path => f.write_str("path"),
            RequestAttr::Api => f.write_str("api"),
            RequestAttr::Header(h) => write!(f, "header.{h}"),
            RequestAttr::PromptTokens => f.write_str("promptTokens"),
            RequestAttr::MaxTokens => f.write_str("maxTokens"),
            RequestAttr::Stream => f.write_str("stream"),
            RequestAttr::Lora => f.write_str("lora"),
            RequestAttr::TtftSlo => f.write_str("ttftSLO"),
            RequestAttr::Tag => f.write_str("tag"),
            RequestAttr::Objective => f.write_str("objective"),
            RequestAttr::Priority => f.write_str("priority"),
        }
    }
}

/// Whether a candidate is a local Pod or an off-cluster provider.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum CandidateType {
    #[default]
    Local,
    Provider,
}

impl CandidateType {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "Local" => Some(CandidateType::Local),
            "Provider" => Some(CandidateType::Provider),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            CandidateType::Local => "Local",
            CandidateType::Provider => "Provider",
        }
    }
}

/// Metric-like candidate attributes, usable as `select` objectives too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Metric {
    QueueDepth,
    RunningRequests,
    KvCacheUtilization,
    CachedPrefixTokens,
    PredictedTtft,
    ObservedTtft,
    ErrorRate,
    Cost,
    ContextWindow,
    LoraLoaded,
    LoraSlotsFree,
    InFlight,
}

impl Metric {
    /// Whether the value counts the Pod's cached prompt prefix (a cached
    /// prefix is cheaper and faster to serve).
    pub fn depends_on_cached_prefix(self) -> bool {
        matches!(
            self,
            Metric::CachedPrefixTokens | Metric::PredictedTtft | Metric::Cost
        )
    }
}

/// Objectives a `select` tier may minimize or maximize.
pub const OBJECTIVES: &[&str] = &[
    "PredictedTTFT",
    "ObservedTTFT",
    "QueueDepth",
    "RunningRequests",
    "KVCacheUtilization",
    "CachedPrefixTokens",
    "Cost",
    "ErrorRate",
    "loraLoaded",
    "InFlight",
];

impl Metric {
    pub const ALL: [Metric; 12] = [
        Metric::QueueDepth,
        Metric::RunningRequests,
        Metric::KvCacheUtilization,
        Metric::CachedPrefixTokens,
        Metric::PredictedTtft,
        Metric::ObservedTtft,
        Metric::ErrorRate,
        Metric::Cost,
        Metric::ContextWindow,
        Metric::LoraLoaded,
        Metric::LoraSlotsFree,
        Metric::InFlight,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Metric::QueueDepth => "QueueDepth",
            Metric::RunningRequests => "RunningRequests",
            Metric::KvCacheUtilization => "KVCacheUtilization",
            Metric::CachedPrefixTokens => "CachedPrefixTokens",
            Metric::PredictedTtft => "PredictedTTFT",
            Metric::ObservedTtft => "ObservedTTFT",
            Metric::ErrorRate => "ErrorRate",
            Metric::Cost => "Cost",
            Metric::ContextWindow => "contextWindow",
            Metric::LoraLoaded => "loraLoaded",
            Metric::LoraSlotsFree => "loraSlotsFree",
            Metric::InFlight => "InFlight",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Metric::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Objectives exclude `contextWindow` and `loraSlotsFree`: ranking by
    /// them is not meaningful.
    pub fn parse_objective(name: &str) -> Option<Self> {
        Metric::parse(name).filter(|m| !matches!(m, Metric::ContextWindow | Metric::LoraSlotsFree))
    }

    pub fn ty(self) -> AttrType {
        match self {
            Metric::PredictedTtft | Metric::ObservedTtft => AttrType::Duration,
            _ => AttrType::Numeric,
        }
    }

    /// Which candidate types can carry this value at all (SPEC.md section 3).
    pub fn defined_for(self, ty: CandidateType) -> bool {
        match self {
            Metric::QueueDepth
            | Metric::KvCacheUtilization
            | Metric::CachedPrefixTokens
            | Metric::PredictedTtft
            | Metric::LoraLoaded
            | Metric::LoraSlotsFree => ty == CandidateType::Local,
            Metric::RunningRequests
            | Metric::ObservedTtft
            | Metric::ErrorRate
            | Metric::Cost
            | Metric::ContextWindow
            | Metric::InFlight => true,
        }
    }
}

/// Attributes of a candidate (one destination × model pair).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CandidateAttr {
    Type,
    Model,
    BackendName,
    ProviderName,
    Endpoint,
    Zone,
    Node,
    Label(String),
    Metric(Metric),
}

pub const CANDIDATE_ATTRIBUTES: &[&str] = &[
    "type",
    "model",
    "backend.name",
    "provider.name",
    "endpoint",
    "zone",
    "node",
    "label.<key>",
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
];

impl CandidateAttr {
    pub fn parse(name: &str) -> Option<Self> {
        if let Some(key) = name.strip_prefix("label.") {
            return (!key.is_empty()).then(|| CandidateAttr::Label(key.to_string()));
        }
        Some(match name {
            "type" => CandidateAttr::Type,
            "model" => CandidateAttr::Model,
            "backend.name" => CandidateAttr::BackendName,
            "provider.name" => CandidateAttr::ProviderName,
            "endpoint" => CandidateAttr::Endpoint,
            "zone" => CandidateAttr::Zone,
            "node" => CandidateAttr::Node,
            other => CandidateAttr::Metric(Metric::parse(other)?),
        })
    }

    pub fn ty(&self) -> AttrType {
        match self {
            CandidateAttr::Metric(m) => m.ty(),
            _ => AttrType::String,
        }
    }
}

impl fmt::Display for CandidateAttr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CandidateAttr::Type => f.write_str("type"),
            CandidateAttr::Model => f.write_str("model"),
            CandidateAttr::BackendName => f.write_str("backend.name"),
            CandidateAttr::ProviderName => f.write_str("provider.name"),
            CandidateAttr::Endpoint => f.write_str("endpoint"),
            CandidateAttr::Zone => f.write_str("zone"),
            CandidateAttr::Node => f.write_str("node"),
            CandidateAttr::Label(k) => write!(f, "label.{k}"),
            CandidateAttr::Metric(m) => f.write_str(m.name()),
        }
    }
}

/// Built-in classifier types and every tag each may emit, so the compiler can
/// tell a typo (`pii-confimed`) from a real tag. The classifiers own the list.
pub fn builtin_classifier_tags(kind: &str) -> Option<&'static [&'static str]> {
    // Exact names only: the policy names what the EPP will run.
    kinference_classifiers::BuiltinKind::parse(kind)
        .filter(|k| k.name() == kind)
        .map(|k| k.tags())
}

pub const CLASSIFIER_TYPES: &[&str] = &["pii", "complexity", "code", "http"];
