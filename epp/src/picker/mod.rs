//! The decision: request attributes + candidates (local endpoints with their
//! scraped and estimated attributes, providers) → the policy's evaluator →
//! a pick. Everything here is shared by all streams.

mod candidates;
mod providers;
mod recent;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kinference_policy::duration::parse_duration;
use kinference_policy::eval::{Decision, Evaluation, NoTrace, Request, Tags, evaluate};
use rand::SeedableRng;
use rand::rngs::SmallRng;

pub use candidates::CandidateSet;
pub use providers::ProviderStates;
pub use recent::{RecentDecisions, RecordedDecision};

use crate::classify::ClassifierRunner;
use crate::endpoints::EndpointRegistry;
use crate::extproc::body::{Api, ParsedBody, estimate_tokens};
use crate::metrics::Metrics;
use crate::policy_store::{LoadedPolicy, PolicyStore};
use crate::predict::{DestinationState, TtftFeatures, TtftPredictor, block_hashes};

pub const TTFT_SLO_HEADER: &str = "x-kinference-ttft-slo";
pub const MODEL_HEADER: &str = "x-gateway-model-name";

/// Tuning of the estimators.
#[derive(Debug, Clone)]
pub struct PickerConfig {
    pub block_chars: usize,
    /// Output tokens assumed for `Cost` when the request sets no max tokens.
    pub default_output_tokens: u64,
}

impl Default for PickerConfig {
    fn default() -> Self {
        PickerConfig {
            block_chars: crate::predict::DEFAULT_BLOCK_CHARS,
            default_output_tokens: 256,
        }
    }
}

/// Shared state of the decision path.
pub struct Picker {
    pub policy: Arc<PolicyStore>,
    pub registry: Arc<EndpointRegistry>,
    /// The global TTFT model (each endpoint's own lives in its state).
    pub ttft: TtftPredictor,
    pub providers: ProviderStates,
    pub classifiers: ClassifierRunner,
    pub metrics: Arc<Metrics>,
    pub recent: RecentDecisions,
    pub config: PickerConfig,
    /// API keys of providers, by provider name.
    pub provider_keys: arc_swap::ArcSwap<BTreeMap<String, String>>,
}

/// What the HTTP request carries, as the ext_proc stream saw it.
pub struct Incoming<'a> {
    /// Lower-cased names, pseudo-headers included (`:path`).
    pub headers: &'a BTreeMap<String, String>,
    pub path: &'a str,
    pub api: Api,
    pub body: &'a ParsedBody,
    /// Restricts local endpoints to these `ip:port` (or bare IPs); `None`: all.
    pub subset: Option<&'a [String]>,
}

/// Where the request goes.
#[derive(Debug)]
pub enum Pick {
    Local(LocalPick),
    Provider(ProviderPick),
    Reject {
        rule: Option<String>,
        status: u16,
        message: String,
    },
}

#[derive(Debug)]
pub struct LocalPick {
    pub rule: String,
    /// Winner first, then the fallback list (all `ip:port`).
    pub addresses: Vec<String>,
    pub endpoint: String,
    pub model: String,
    /// Set when the body's model must change.
    pub rewrite_model: Option<String>,
    /// The winner's state, to count the request and learn from its answer.
    pub state: Arc<DestinationState>,
    /// What the TTFT prediction was made from; `None` when the winner had no
    /// fresh metrics (nothing to calibrate the model with).
    pub features: Option<TtftFeatures>,
    /// The prompt's prefix block hashes, to record once the answer is sent.
    pub prefix_hashes: Vec<u64>,
}

#[derive(Debug)]
pub struct ProviderPick {
    pub rule: String,
    pub provider: String,
    pub model: String,
    /// The provider's name for the model, when it differs from the request's.
    pub rewrite_model: Option<String>,
    pub credential: ProviderCredential,
    pub state: Arc<DestinationState>,
}

/// What the request to a provider authenticates with. The client's own
/// credentials are never forwarded to a provider, whatever this is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProviderCredential {
    /// The policy names no Secret for this provider: send no key.
    NotRequired,
    /// The key read from the provider's Secret.
    Key(String),
    /// The policy names a Secret whose key the EPP does not hold (yet): the
    /// request must fail closed rather than go out unauthenticated.
    Missing { secret: String },
}

impl Picker {
    pub fn new(
        policy: Arc<PolicyStore>,
        registry: Arc<EndpointRegistry>,
        metrics: Arc<Metrics>,
        config: PickerConfig,
    ) -> Self {
        Picker {
            policy,
            registry,
            ttft: TtftPredictor::new(Default::default()),
            providers: ProviderStates::default(),
            classifiers: ClassifierRunner::default(),
            metrics,
            recent: RecentDecisions::new(64),
            config,
            provider_keys: Default::default(),
        }
    }

    /// Decides one request. Never panics on odd input; an unusable request is
    /// a reject with a 4xx status.
    pub async fn pick(&self, incoming: &Incoming<'_>) -> Pick {
        let started = Instant::now();
        let Some(policy) = self.policy.current() else {
            return Pick::Reject {
                rule: None,
                status: 503,
                message: "the endpoint picker has no policy loaded yet".into(),
            };
        };
        let request = self.request_attributes(&policy, incoming);
        if request.model.is_empty() {
            return Pick::Reject {
                rule: None,
                status: 400,
                message: "the request names no model (body field `model`)".into(),
            };
        }
        let mut hashes = Vec::new();
        block_hashes(&incoming.body.prompt, self.config.block_chars, &mut hashes);
        let set = CandidateSet::build(self, &policy, &request, &hashes, incoming.subset);
        let seed = rand::random::<u64>();
        let (decision, tags) = self.evaluate(&policy, &request, &set, incoming, seed).await;
        let mut pick = set.to_pick(self, &policy, &request, &decision);
        self.metrics.observe_decision(&pick, started.elapsed());
        if let Pick::Local(local) = &mut pick {
            // Recorded by the caller once the answer is on its way: a new long
            // prompt costs a few hundred microseconds to index.
            local.prefix_hashes = hashes;
        }
        self.recent.push(RecordedDecision {
            at: std::time::SystemTime::now(),
            policy: policy.clone(),
            request,
            tags,
            candidates: set.candidates,
            seed,
        });
        pick
    }

    async fn evaluate(
        &self,
        policy: &LoadedPolicy,
        request: &Request,
        set: &CandidateSet,
        incoming: &Incoming<'_>,
        seed: u64,
    ) -> (Decision, Tags) {
        let mut tags = Tags::default();
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut prompt: Option<Arc<str>> = None;
        loop {
            let needed = match evaluate(
                &policy.compiled,
                request,
                &tags,
                &set.candidates,
                &mut rng,
                &mut NoTrace,
            ) {
                Evaluation::Decided(d) => return (d, tags),
                Evaluation::NeedTags(needed) => needed,
            };
            let text = prompt.get_or_insert_with(|| Arc::from(incoming.body.prompt.as_str()));
            for run in self
                .classifiers
                .run(&policy.compiled.classifiers, needed, text)
                .await
            {
                let name = &policy.compiled.classifiers[run.index].name;
                self.metrics
                    .observe_classifier(name, run.elapsed, run.timed_out, run.failed);
                tags.record(run.index, run.tags);
            }
            // Classifiers the set named but the runner skipped still count as run.
            for i in needed.iter() {
                tags.computed = tags.computed.with(i);
            }
        }
    }

    fn request_attributes(&self, policy: &LoadedPolicy, incoming: &Incoming<'_>) -> Request {
        let header = |name: &str| incoming.headers.get(name).cloned();
        let model = incoming
            .body
            .model
            .clone()
            .or_else(|| header(MODEL_HEADER))
            .unwrap_or_default();
        // Only headers the policy reads are kept: less copying, and no
        // credentials end up in /debug/explain.
        let headers = policy
            .header_names
            .iter()
            .filter_map(|h| incoming.headers.get(h).map(|v| (h.clone(), v.clone())))
            .collect();
        Request {
            model,
            tenant: header(&policy.compiled.tenant_header),
            path: incoming.path.to_string(),
            api: Some(incoming.api.name().to_string()),
            headers,
            prompt_tokens: estimate_tokens(&incoming.body.prompt),
            max_tokens: incoming.body.max_tokens,
            stream: incoming.body.stream,
            lora: None,
            ttft_slo: header(TTFT_SLO_HEADER)
                .and_then(|v| parse_duration(&v).ok())
                .map(|d| d.as_secs_f64()),
        }
    }

    /// The gateway reported a first byte after `ttft`: update the observed
    /// statistics, and calibrate the endpoint's TTFT model with the features
    /// its prediction was made from, when there were any.
    pub fn observe_ttft(
        &self,
        state: &DestinationState,
        features: Option<&TtftFeatures>,
        ttft: Duration,
    ) {
        state.stats.record_ttft(ttft, Instant::now());
        if let Some(f) = features {
            self.ttft.observe(&state.ttft, f, ttft.as_secs_f64());
        }
    }
}
