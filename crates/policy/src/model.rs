//! The compiled policy: every name resolved, every type checked, every regex
//! and duration parsed. Only `crate::compile` builds these, so holding one
//! means the policy is valid.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::attr::{CandidateAttr, CandidateType, Metric, RequestAttr};
use crate::pattern::Pattern;
use crate::spec::{ParentRef, PolicySpec, RouteSpec, SecretKeyRef};

#[derive(Debug, Clone)]
pub struct CompiledPolicy {
    /// SHA-256 of the canonical JSON of the source spec: what the EPP reports
    /// as loaded, and what the operator waits for.
    pub hash: String,
    pub tenant_header: String,
    /// Sessions kept on their Pod, when the policy asks.
    pub session_affinity: Option<SessionAffinity>,
    /// Bounds on the requests waiting for room (rules with `onEmpty: Wait`).
    pub flow_control: FlowControl,
    /// The pool the policy declares; `None` for a rules-only policy, whose
    /// pool is the InferencePool it is attached to.
    pub pool: Option<Pool>,
    pub route: RouteSpec,
    pub providers: Vec<Provider>,
    pub classifiers: Vec<Classifier>,
    pub rules: Vec<Rule>,
    /// What the rules read beyond the fixed attributes.
    pub reads: Reads,
    /// The validated source, kept so the policy can be shipped (ConfigMap) and
    /// compiled again by the EPP with this same library.
    pub source: PolicySpec,
}

/// What a policy reads from a request and its candidates beyond the fixed
/// attributes, so the request path copies only that (and no header a policy
/// does not read can end up in a decision record).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reads {
    /// Request headers read as `header.<name>` (lower case).
    pub headers: BTreeSet<String>,
    /// Whether any predicate reads a candidate's `label.<key>`.
    pub labels: bool,
    /// Whether a tier ranks by `minimize: PredictedTTFT`.
    pub ranks_by_predicted_ttft: bool,
    /// Whether any candidate predicate (`exclude`, a tier's `if`) reads
    /// `PredictedTTFT`: a bound on the request's own TTFT, such as an SLO.
    pub filters_on_predicted_ttft: bool,
}

impl Reads {
    pub(crate) fn of(rules: &[Rule]) -> Reads {
        let mut reads = Reads::default();
        let mut request = |entries: &[Conjunction<RequestAttr>]| {
            for p in entries.iter().flatten() {
                if let RequestAttr::Header(h) = &p.attr {
                    reads.headers.insert(h.clone());
                }
            }
        };
        let (mut labels, mut filters_ttft) = (false, false);
        let mut candidate = |entries: &[Conjunction<CandidateAttr>]| {
            for p in entries.iter().flatten() {
                labels |= matches!(p.attr, CandidateAttr::Label(_));
                filters_ttft |= matches!(p.attr, CandidateAttr::Metric(Metric::PredictedTtft));
            }
        };
        for rule in rules {
            if let Some(m) = &rule.matches {
                request(m);
            }
            for ex in &rule.route.exclude {
                if let Some(w) = &ex.when {
                    request(w);
                }
                candidate(&ex.drop);
            }
            for tier in &rule.route.select {
                if let Some(w) = &tier.when {
                    candidate(w);
                }
                reads.ranks_by_predicted_ttft |=
                    matches!(tier.rank, Rank::Minimize(Metric::PredictedTtft));
            }
        }
        reads.labels = labels;
        reads.filters_on_predicted_ttft = filters_ttft;
        reads
    }
}

impl CompiledPolicy {
    pub fn provider(&self, name: &str) -> Option<&Provider> {
        self.providers.iter().find(|p| p.name == name)
    }

    pub fn local_model(&self, name: &str) -> Option<&ModelInfo> {
        self.pool
            .iter()
            .flat_map(|p| &p.models)
            .find(|m| m.name == name)
    }

    pub fn parent_refs(&self) -> &[ParentRef] {
        &self.route.parent_refs
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionAffinity {
    pub key: SessionKey,
    /// Forgotten this long after its last request.
    pub ttl: std::time::Duration,
}

/// Where a request carries its session key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionKey {
    /// A header, its name lower-cased.
    Header(String),
    Cookie(String),
}

#[derive(Debug, Clone, Default)]
pub struct Pool {
    pub selector: BTreeMap<String, String>,
    pub target_ports: Vec<u16>,
    pub models: Vec<ModelInfo>,
}

#[derive(Debug, Clone)]
pub struct Provider {
    pub name: String,
    pub base_url: String,
    pub secret: Option<SecretKeyRef>,
    pub models: Vec<ModelInfo>,
}

impl Provider {
    pub fn model(&self, name: &str) -> Option<&ModelInfo> {
        self.models.iter().find(|m| m.name == name)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    pub name: String,
    /// Name at the destination; equals `name` unless mapped.
    pub target_model: String,
    pub price: Option<Price>,
    pub context_window: Option<u64>,
}

/// USD per million tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Price {
    pub input: f64,
    pub cached_input: f64,
    pub output: f64,
}

impl Price {
    /// Estimated USD for one request; cached prompt tokens are billed at the
    /// cached-input price.
    pub fn cost(&self, prompt_tokens: f64, cached_tokens: f64, output_tokens: f64) -> f64 {
        let cached = cached_tokens.clamp(0.0, prompt_tokens);
        ((prompt_tokens - cached) * self.input
            + cached * self.cached_input
            + output_tokens * self.output)
            / 1e6
    }
}

#[derive(Debug, Clone)]
pub struct Classifier {
    pub name: String,
    pub kind: ClassifierKind,
    pub timeout: Duration,
    /// Every tag this classifier may emit.
    pub tags: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ClassifierKind {
    /// `pii`, `complexity` or `code`.
    Builtin(String),
    Http {
        url: String,
    },
}

/// A set of classifiers, by their index in [`CompiledPolicy::classifiers`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ClassifierSet(pub u64);

impl ClassifierSet {
    pub const MAX: usize = 64;

    pub fn with(self, index: usize) -> Self {
        ClassifierSet(self.0 | (1 << index))
    }
    pub fn union(self, other: Self) -> Self {
        ClassifierSet(self.0 | other.0)
    }
    pub fn minus(self, other: Self) -> Self {
        ClassifierSet(self.0 & !other.0)
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    pub fn contains(self, index: usize) -> bool {
        self.0 & (1 << index) != 0
    }
    pub fn iter(self) -> impl Iterator<Item = usize> {
        (0..Self::MAX).filter(move |i| self.contains(*i))
    }
}

#[derive(Debug, Clone)]
pub struct Rule {
    pub name: String,
    /// `None`: the catch-all; matches every request.
    pub matches: Option<Vec<Conjunction<RequestAttr>>>,
    /// Classifiers whose tags `matches` reads.
    pub match_needs: ClassifierSet,
    pub route: Route,
}

#[derive(Debug, Clone)]
pub struct Route {
    pub consider: Vec<Consider>,
    pub exclude: Vec<Exclude>,
    pub select: Vec<Tier>,
    pub tie_break: TieBreak,
    pub on_empty: OnEmpty,
    pub reject: Reject,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Consider {
    pub models: ModelSelector,
    pub backends: BackendSelector,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ModelSelector {
    /// The model the request asked for.
    Requested,
    Names(Vec<String>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct BackendSelector {
    pub local: bool,
    pub provider: bool,
    /// Restricts to these provider or backend names.
    pub names: Option<Vec<String>>,
}

#[derive(Debug, Clone)]
pub struct Exclude {
    /// Request condition; `None`: always applies.
    pub when: Option<Vec<Conjunction<RequestAttr>>>,
    pub when_needs: ClassifierSet,
    /// A candidate matching any entry is dropped.
    pub drop: Vec<Conjunction<CandidateAttr>>,
}

#[derive(Debug, Clone)]
pub struct Tier {
    pub kind: TierType,
    pub when: Option<Vec<Conjunction<CandidateAttr>>>,
    pub rank: Rank,
    pub within: Option<Within>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierType {
    Local,
    Provider,
    Any,
}

impl TierType {
    pub fn admits(self, ty: CandidateType) -> bool {
        match self {
            TierType::Any => true,
            TierType::Local => ty == CandidateType::Local,
            TierType::Provider => ty == CandidateType::Provider,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Rank {
    /// Keep consider order.
    Unranked,
    Minimize(Metric),
    Maximize(Metric),
    /// Provider or backend names, best first; unnamed candidates leave the tier.
    Order(Vec<String>),
}

/// How close to the best a candidate must be to tie with it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Within {
    /// Relative to the best value (`10%` is 0.1).
    Fraction(f64),
    /// In the objective's unit (seconds for durations).
    Absolute(f64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TieBreak {
    /// The first candidate in rank order.
    RankOrder,
    PreferLocal,
    Random,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnEmpty {
    Reject,
    FallThrough,
    /// Wait in the EPP at most this long for a candidate, then reject.
    Wait(Duration),
}

/// How much may wait in the EPP at once, all priorities together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowControl {
    pub max_requests: usize,
    pub max_bytes: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Reject {
    pub status: u16,
    pub message: String,
}

/// Predicates that must all hold.
pub type Conjunction<A> = Vec<Predicate<A>>;

#[derive(Debug, Clone)]
pub struct Predicate<A> {
    pub attr: A,
    pub test: Test,
}

#[derive(Debug, Clone)]
pub enum Test {
    /// Equals any of these (for a set: contains any).
    OneOf(Vec<Value>),
    /// Equals none of these; false when absent.
    NotIn(Vec<Value>),
    Compare(Comparison, Operand),
    Prefix(String),
    Regex(Pattern),
    ContainsAll(Vec<String>),
    /// False when absent.
    ContainsNone(Vec<String>),
    Exists(bool),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Comparison {
    GreaterThan,
    GreaterThanOrEqual,
    LessThan,
    LessThanOrEqual,
}

impl Comparison {
    pub fn holds(self, left: f64, right: f64) -> bool {
        match self {
            Comparison::GreaterThan => left > right,
            Comparison::GreaterThanOrEqual => left >= right,
            Comparison::LessThan => left < right,
            Comparison::LessThanOrEqual => left <= right,
        }
    }
}

/// A literal in a predicate. Durations are held in seconds.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Text(String),
    Number(f64),
}

/// The right-hand side of a comparison.
#[derive(Debug, Clone, PartialEq)]
pub enum Operand {
    Const(f64),
    /// `{ request: promptTokens }`: compare with a request attribute.
    Request(RequestAttr),
}

#[cfg(test)]
mod tests {
    use crate::source::compile_text;

    #[test]
    fn the_compiler_says_which_headers_and_labels_a_policy_reads() {
        let policy = compile_text(
            "pool: { selector: { app: m }, targetPorts: [{ number: 8000 }] }
rules:
  - name: by-header
    matches: [{ header.x-team: red }]
    route:
      exclude: [{ if: { header.X-Plan: free }, drop: { label.gpu: a10 } }]
      select: [{ minimize: QueueDepth }]
  - name: rest
    route: { select: [{ minimize: QueueDepth }] }
",
        )
        .unwrap();
        let headers: Vec<&str> = policy.reads.headers.iter().map(String::as_str).collect();
        assert_eq!(headers, ["x-plan", "x-team"]);
        assert!(policy.reads.labels);
        let plain = compile_text(
            "pool: { selector: { app: m }, targetPorts: [{ number: 8000 }] }
rules:
  - name: rest
    route: { select: [{ minimize: QueueDepth }] }
",
        )
        .unwrap();
        assert!(plain.reads.headers.is_empty() && !plain.reads.labels);
        assert!(!plain.reads.ranks_by_predicted_ttft && !plain.reads.filters_on_predicted_ttft);
    }

    #[test]
    fn the_compiler_says_whether_a_policy_ranks_by_or_bounds_predicted_ttft() {
        let pool = "pool: { selector: { app: m }, targetPorts: [{ number: 8000 }] }\n";
        let ranked = compile_text(&format!(
            "{pool}rules:\n  - name: fast\n    route: {{ select: [{{ minimize: PredictedTTFT }}] }}\n"
        ))
        .unwrap();
        assert!(ranked.reads.ranks_by_predicted_ttft);
        assert!(!ranked.reads.filters_on_predicted_ttft);
        let bounded = compile_text(&format!(
            "{pool}rules:
  - name: slo
    route:
      exclude: [{{ drop: {{ PredictedTTFT: {{ greaterThan: 500ms }} }} }}]
      select: [{{ minimize: QueueDepth }}]
"
        ))
        .unwrap();
        assert!(bounded.reads.filters_on_predicted_ttft);
        assert!(!bounded.reads.ranks_by_predicted_ttft);
        let in_a_tier = compile_text(&format!(
            "{pool}rules:
  - name: slo
    route:
      select:
        - {{ type: Local, if: {{ PredictedTTFT: {{ lessThan: 1s }} }}, minimize: PredictedTTFT }}
"
        ))
        .unwrap();
        assert!(in_a_tier.reads.filters_on_predicted_ttft);
        assert!(in_a_tier.reads.ranks_by_predicted_ttft);
    }
}
