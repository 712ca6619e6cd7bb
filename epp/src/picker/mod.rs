//! The decision: request attributes + candidates (local endpoints with their
//! scraped and estimated attributes, providers) → the policy's evaluator →
//! a pick. Everything here is shared by all streams.

mod candidates;
mod decision_log;
mod placement;
mod providers;
mod recent;
mod sessions;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kinference_policy::duration::parse_duration;
use kinference_policy::eval::{
    Decision, DecisionRecord, Evaluation, NoTrace, PrefixSource, Request, Tags, decision_detail,
    evaluate,
};
use kinference_policy::model::OnEmpty;
use rand::SeedableRng;
use rand::rngs::SmallRng;

pub use crate::extproc::router::Incoming;
pub(crate) use candidates::CandidateSet;
pub use candidates::PrefixPrediction;
pub use decision_log::{DecisionLog, LogTarget};
pub use providers::ProviderStates;
pub use recent::RecentDecisions;
pub use recent::RecordedDecision;
pub use recent::WaitOutcome;
pub use recent::Waited;

use crate::classify::ClassifierRunner;
use crate::endpoints::EndpointRegistry;
use crate::extproc::body::{Api, estimate_tokens};
use crate::extproc::router::Usage;
use crate::extproc::router::{LocalRoute, ProviderRoute, ResponseFacts, Route, Router};
use crate::flow::{Bounds, FlowControl, Next, Place, Shed, Turn};
use crate::kv_cache::PromptTokens;
use crate::kv_events::mismatch::Check;
use crate::kv_events::precise::PreciseMode;
use crate::kv_events::tokenize::PromptTokenizer;
use crate::metrics::{DecisionOutcome, Metrics};
use crate::objectives::{FAIRNESS_HEADER, OBJECTIVE_HEADER, Objectives};
use crate::policy_store::{LoadedPolicy, PolicyStore};
use crate::predict::reuse::SeedGate;
use crate::predict::{
    Decided, DestinationState, InflightGuard, Outcome, RoutedPrefixes, TtftFeatures, TtftPredictor,
    TtftSample, block_hashes,
};

/// Block hashes of the pool's recent routes (1 MiB): about 350 prompts of
/// 24 KB, the whole window at a hundred requests a second.
const POOL_ROUTE_HASHES: usize = 32 * crate::predict::MAX_BLOCKS;

pub(crate) const TTFT_SLO_HEADER: &str = "x-kinference-ttft-slo";
pub(crate) const MODEL_HEADER: &str = "x-gateway-model-name";

/// Tuning of the estimators.
#[derive(Debug, Clone)]
pub struct PickerConfig {
    pub block_chars: usize,
    /// Output tokens assumed for `Cost` when the request sets no max tokens.
    pub default_output_tokens: u64,
    /// `--decision-detail`: attach why each request went where it went.
    pub decision_detail: bool,
}

impl Default for PickerConfig {
    fn default() -> Self {
        PickerConfig {
            block_chars: crate::predict::DEFAULT_BLOCK_CHARS,
            default_output_tokens: 256,
            decision_detail: false,
        }
    }
}

/// Shared state of the decision path.
pub struct Picker {
    pub(crate) policy: Arc<PolicyStore>,
    pub(crate) registry: Arc<EndpointRegistry>,
    /// The global TTFT model (each endpoint's own lives in its state).
    pub(crate) ttft: Arc<TtftPredictor>,
    pub(crate) providers: ProviderStates,
    pub(crate) classifiers: ClassifierRunner,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) recent: RecentDecisions,
    /// Prompts this EPP routed to any of the pool's Pods in the last
    /// seconds: how many requests share a prefix (`predict::reuse`).
    pub(crate) routes: RoutedPrefixes,
    /// When this EPP last paid a prefill for a new replica.
    pub(crate) seeds: SeedGate,
    /// `--decision-log`, set once at start.
    pub(crate) decision_log: std::sync::OnceLock<DecisionLog>,
    /// `sessionAffinity`: each session's last Pod.
    sessions: sessions::Sessions,
    /// `--kv-events-port`: the tokenizer of precise prefix mode.
    precise: std::sync::OnceLock<PreciseMode>,
    pub(crate) config: PickerConfig,
    /// API keys of providers, by provider name.
    pub(crate) provider_keys: arc_swap::ArcSwap<BTreeMap<String, String>>,
    /// The pool's InferenceObjectives: each request's priority.
    pub(crate) objectives: Arc<Objectives>,
    /// Requests waiting for room (`onEmpty: Wait`).
    pub(crate) flow: Arc<FlowControl>,
}

/// What the server, the binary's wiring and tests read of the picker.
impl Picker {
    /// The global TTFT model.
    pub fn ttft(&self) -> &Arc<TtftPredictor> {
        &self.ttft
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The last decisions, for `/debug/explain`.
    pub fn recent(&self) -> &RecentDecisions {
        &self.recent
    }

    /// `--decision-log`, set once at start.
    pub fn decision_log(&self) -> &std::sync::OnceLock<DecisionLog> {
        &self.decision_log
    }

    /// API keys of providers, by provider name.
    pub fn provider_keys(&self) -> &arc_swap::ArcSwap<BTreeMap<String, String>> {
        &self.provider_keys
    }

    /// The pool's InferenceObjectives.
    pub fn objectives(&self) -> &Arc<Objectives> {
        &self.objectives
    }

    /// Requests waiting for room.
    pub fn flow(&self) -> &Arc<FlowControl> {
        &self.flow
    }

    /// Each provider's live state.
    pub fn providers(&self) -> &ProviderStates {
        &self.providers
    }
}

/// What a request's evaluations share while it waits for room: the
/// prompt's block hashes and tokens, and the tags of the classifiers that
/// ran, are the same at every turn.
#[derive(Default)]
struct Prepared {
    hashes: Option<Vec<u64>>,
    tokens: Option<Option<PromptTokens>>,
    tags: Tags,
    /// When the request started waiting for room, if it did.
    waiting_since: Option<Instant>,
    /// Set when the wait ended without room: the last evaluation is
    /// recorded as the decision.
    wait_ended: Option<WaitOutcome>,
    /// The policy `tags` were computed under.
    policy_hash: Option<String>,
}

/// One evaluation's inputs, as a decision keeps them.
struct Evaluated {
    request: Request,
    tags: Tags,
    candidates: Vec<kinference_policy::eval::Candidate>,
    seed: u64,
}

/// Counts a decision in `/metrics`.
fn observe(metrics: &Metrics, pick: &Pick, took: Duration) {
    let (rule, outcome) = match pick {
        Pick::Local(l) => (l.rule.as_str(), DecisionOutcome::Local),
        Pick::Provider(p) => (p.rule.as_str(), DecisionOutcome::Provider),
        Pick::Reject { rule, status, .. } => (
            rule.as_deref().unwrap_or(""),
            DecisionOutcome::Reject { status: *status },
        ),
    };
    metrics.observe_decision(rule, outcome, took);
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
        /// `onEmpty: Wait`: the request may wait this long for room first.
        wait: Option<Duration>,
        detail: Option<String>,
    },
}

impl Pick {
    /// A reject before any rule ran (no policy, no model).
    fn reject_before_rules(status: u16, message: &str) -> Pick {
        Pick::Reject {
            rule: None,
            status,
            message: message.into(),
            wait: None,
            detail: None,
        }
    }

    /// How long the request may wait for room, if it should.
    fn waits(&self) -> Option<Duration> {
        match self {
            Pick::Reject { wait, .. } => *wait,
            _ => None,
        }
    }

    fn set_detail(&mut self, value: String) {
        let detail = match self {
            Pick::Local(l) => &mut l.detail,
            Pick::Provider(p) => &mut p.detail,
            Pick::Reject { detail, .. } => detail,
        };
        *detail = Some(value);
    }
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
    /// The winner's predicted TTFT in seconds, to compare with the observed.
    pub predicted_ttft: Option<f64>,
    /// The winner's cached prefix as predicted, to compare with the reported.
    pub prefix: Option<PrefixPrediction>,
    /// The prompt's prefix block hashes, to record once the answer is sent.
    pub prefix_hashes: Vec<u64>,
    /// The decision detail (`--decision-detail`), compact JSON.
    pub detail: Option<String>,
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
    /// The decision detail (`--decision-detail`), compact JSON.
    pub detail: Option<String>,
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
        let seeds = SeedGate::default();
        let flow = FlowControl::new(&metrics);
        metrics.register_counter(
            "replica_seeds",
            "Requests sent to a Pod without their prefix so that a group many recent requests shared gets another replica (each pays the prefill)",
            seeds.seeded.clone(),
        );
        Picker {
            policy,
            registry,
            ttft: Arc::new(TtftPredictor::new(Default::default())),
            providers: ProviderStates::default(),
            classifiers: ClassifierRunner::default(),
            metrics,
            recent: RecentDecisions::new(64),
            routes: RoutedPrefixes::with_capacity(POOL_ROUTE_HASHES),
            seeds,
            decision_log: std::sync::OnceLock::new(),
            sessions: sessions::Sessions::default(),
            precise: std::sync::OnceLock::new(),
            config,
            provider_keys: Default::default(),
            objectives: Default::default(),
            flow,
        }
    }

    /// Precise prefix mode: matches prompts against the engines' KV events
    /// with this tokenizer. Set once, at start.
    pub fn enable_precise_prefix(&self, tokenizer: PromptTokenizer) {
        let precise = PreciseMode::new(tokenizer);
        precise.register(&self.metrics);
        self.metrics.export_kv_index_states();
        let _ = self.precise.set(precise);
    }

    /// The prompt's tokens in precise mode, if tokenized in time.
    async fn prompt_tokens(&self, incoming: &Incoming<'_>) -> Option<PromptTokens> {
        let precise = self.precise.get()?;
        precise
            .tokenizer
            .tokenize(incoming.body.prompt_text())
            .await
    }

    /// Decides one request. Never panics on odd input; an unusable request is
    /// a reject with a 4xx status.
    pub async fn pick(&self, incoming: &Incoming<'_>) -> Pick {
        self.pick_prepared(incoming, &mut Prepared::default()).await
    }

    /// [`Self::pick`], reusing what earlier evaluations of the same request
    /// computed (a waiting request is evaluated at each turn).
    async fn pick_prepared(&self, incoming: &Incoming<'_>, prepared: &mut Prepared) -> Pick {
        let started = Instant::now();
        let Some(policy) = self.policy.current() else {
            let message = "the endpoint picker has no policy loaded yet";
            return Pick::reject_before_rules(503, message);
        };
        let mut request = self.request_attributes(&policy, incoming);
        let session = policy
            .compiled
            .session_affinity
            .as_ref()
            .and_then(|affinity| {
                let key = self.sessions.key_of(affinity, incoming.headers)?;
                Some((key, affinity.ttl))
            });
        // A model some Pod runs as an adapter is a LoRA request.
        request.lora = candidates::lora_adapter(&request.model, self.registry.snapshot().iter())
            .map(str::to_string);
        if let Some((key, ttl)) = session {
            request.session_address = self
                .sessions
                .address_of(key, ttl, started)
                .map(|a| a.to_string());
        }
        if request.model.is_empty() {
            let message = "the request names no model (body field `model`)";
            return Pick::reject_before_rules(400, message);
        }
        self.prepare(prepared, &policy, incoming).await;
        let hashes = prepared.hashes.as_deref().unwrap_or_default();
        let tokens = prepared.tokens.as_ref().and_then(Option::as_ref);
        let set = CandidateSet::build(self, &policy, &request, hashes, tokens, incoming.subset);
        let seed = rand::random::<u64>();
        let decision = self
            .evaluate(&policy, &request, &set, incoming, seed, &mut prepared.tags)
            .await;
        let mut pick = set.to_pick(self, &policy, &request, &decision);
        if prepared.waiting_since.is_none() {
            pick = self.behind_waiting(&policy, &request, &decision, pick);
        }
        let waits = pick.waits().is_some();
        if waits && prepared.wait_ended.is_none() {
            // Not a decision yet: recorded once the wait ends.
            return pick;
        }
        // What the request gets: not a wait that ended (its caller counts
        // the answer), nor room found by a request already shed.
        let decided = !waits && prepared.wait_ended != Some(WaitOutcome::Shed);
        let hashes = prepared.hashes.take().unwrap_or_default();
        let tags = std::mem::take(&mut prepared.tags);
        if decided {
            observe(&self.metrics, &pick, started.elapsed());
        }
        if let Pick::Local(local) = &mut pick {
            // Recorded by the caller once the answer is on its way: a new long
            // prompt costs a few hundred microseconds to index.
            local.prefix_hashes = hashes;
            if decided && let (Some((key, ttl)), Some(address)) = (session, local.addresses.first())
            {
                self.sessions.remember(key, address, ttl, started);
            }
        }
        let wait_outcome = match (&pick, decided) {
            (_, false) => prepared.wait_ended.unwrap_or(WaitOutcome::Expired),
            (Pick::Reject { .. }, true) => WaitOutcome::Rejected,
            (_, true) => WaitOutcome::Dispatched,
        };
        if self.config.decision_detail {
            // A second, traced evaluation with the decision's own seed: debug only.
            let detail = decision_detail(&policy.compiled, &request, &tags, &set.candidates, seed);
            pick.set_detail(detail);
        }
        let waited = prepared.waiting_since.map(|since| Waited {
            priority: request.priority,
            took: since.elapsed(),
            outcome: wait_outcome,
        });
        let evaluated = Evaluated {
            request,
            tags,
            candidates: set.candidates,
            seed,
        };
        self.record(&policy, evaluated, &decision, waited);
        pick
    }

    /// What every evaluation of a request shares: the classifiers' tags
    /// (again under another policy), the prompt's block hashes and, in
    /// precise mode, its tokens.
    async fn prepare(
        &self,
        prepared: &mut Prepared,
        policy: &LoadedPolicy,
        incoming: &Incoming<'_>,
    ) {
        // Tags name classifiers by their place in the policy that ran them.
        if prepared.policy_hash.as_deref() != Some(policy.compiled.hash.as_str()) {
            prepared.tags = Tags::default();
            prepared.policy_hash = Some(policy.compiled.hash.clone());
        }
        if prepared.hashes.is_none() {
            let mut hashes = Vec::new();
            block_hashes(&incoming.body.prompt, self.config.block_chars, &mut hashes);
            prepared.hashes = Some(hashes);
        }
        if prepared.tokens.is_none() {
            prepared.tokens = Some(self.prompt_tokens(incoming).await);
        }
    }

    /// Keeps a decision: in the decision log, if one is set, and among the
    /// recent decisions `/debug/explain` replays.
    fn record(
        &self,
        policy: &Arc<LoadedPolicy>,
        evaluated: Evaluated,
        decision: &Decision,
        waited: Option<Waited>,
    ) {
        let Evaluated {
            request,
            tags,
            candidates,
            seed,
        } = evaluated;
        if let Some(log) = self.decision_log.get() {
            log.offer(|| {
                DecisionRecord::new(
                    k8s_openapi::jiff::Timestamp::now().to_string(),
                    &policy.compiled,
                    &request,
                    &tags,
                    candidates.clone(),
                    decision,
                    seed,
                )
            });
        }
        self.recent.push(RecordedDecision {
            at: std::time::SystemTime::now(),
            policy: Arc::clone(policy),
            request,
            tags,
            candidates,
            seed,
            waited,
        });
    }

    /// A newcomer whose rule would route it, while requests of that rule
    /// at its priority or above wait for room, waits behind them: the
    /// room it found is theirs first.
    fn behind_waiting(
        &self,
        policy: &LoadedPolicy,
        request: &Request,
        decision: &Decision,
        pick: Pick,
    ) -> Pick {
        let Decision::Route(routed) = decision else {
            return pick;
        };
        let rule = &policy.compiled.rules[routed.rule];
        let OnEmpty::Wait(max_wait) = rule.route.on_empty else {
            return pick;
        };
        if !self.flow.waiting_ahead(&rule.name, request.priority) {
            return pick;
        }
        Pick::Reject {
            rule: Some(rule.name.clone()),
            status: rule.route.reject.status,
            message: rule.route.reject.message.clone(),
            wait: Some(max_wait),
            detail: None,
        }
    }

    /// Evaluates the policy, running the classifiers it reaches that have
    /// not run yet; their tags are kept in `tags`.
    async fn evaluate(
        &self,
        policy: &LoadedPolicy,
        request: &Request,
        set: &CandidateSet,
        incoming: &Incoming<'_>,
        seed: u64,
        tags: &mut Tags,
    ) -> Decision {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut prompt: Option<Arc<str>> = None;
        loop {
            let needed = match evaluate(
                &policy.compiled,
                request,
                tags,
                &set.candidates,
                &mut rng,
                &mut NoTrace,
            ) {
                Evaluation::Decided(d) => return d,
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
                    .observe_classifier(name, run.elapsed, run.error);
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
        let objective = header(OBJECTIVE_HEADER).filter(|o| !o.is_empty());
        // Only headers the policy reads are kept: less copying, and no
        // credentials end up in /debug/explain.
        let headers = policy
            .compiled
            .reads
            .headers
            .iter()
            .filter_map(|h| incoming.headers.get(h).map(|v| (h.clone(), v.clone())))
            .collect();
        // Clamped as predicates see it: the copy kept for /debug/explain
        // stays small whatever a client sends.
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
            session_address: None,
            priority: self.objectives.priority(objective.as_deref()),
            objective,
        }
        .clamped()
    }
}

/// What a routed request holds until its stream ends: the request counts in
/// flight on its destination, and the response path is judged against
/// exactly what the decision used.
pub struct Ticket {
    guard: InflightGuard,
    state: Arc<DestinationState>,
    /// The selected endpoint's `ip:port`; `None` for a provider.
    address: Option<String>,
    /// The TTFT prediction's inputs; `None` when there was no prediction.
    features: Option<TtftFeatures>,
    /// Who a TTFT measured from now on belongs to: set by a successful
    /// answer's headers, taken by the first TTFT (reported or timed).
    ttft_owner: Option<TtftOwner>,
    /// Once the first token came: its TTFT, for the model to learn when the
    /// engine's cached count has come or the stream ends.
    sample: Option<TtftSample>,
    /// The answer will end with the engine's token counts, if the engine
    /// reports them: a whole answer, a Responses stream, a stream that
    /// asked (or may have) for them.
    usage_in_answer: bool,
    /// The prediction itself, in seconds.
    predicted_ttft: Option<f64>,
    /// The cached prefix the decision counted on; `None` for a provider.
    prefix: Option<PrefixPrediction>,
    /// The prompt's block hashes, recorded where it went; `None` for a
    /// provider, or once moved to a fallback's Pod.
    chain: Option<Arc<[u64]>>,
    decided_at: Instant,
    /// Declared after `guard`, so dropped after it: the waiting requests
    /// are asked once this one no longer counts in flight.
    _room: RoomOnDrop,
}

/// Tells flow control that a request finished, when dropped.
struct RoomOnDrop(Arc<FlowControl>);

impl Drop for RoomOnDrop {
    fn drop(&mut self) {
        self.0.wake();
    }
}

impl Ticket {
    fn new(
        flow: &Arc<FlowControl>,
        state: Arc<DestinationState>,
        address: Option<String>,
        features: Option<TtftFeatures>,
        predicted_ttft: Option<f64>,
        prefix: Option<PrefixPrediction>,
        usage_in_answer: bool,
    ) -> Self {
        let now = Instant::now();
        Ticket {
            _room: RoomOnDrop(Arc::clone(flow)),
            guard: state.stats.begin(now),
            state,
            address,
            features,
            ttft_owner: None,
            sample: None,
            usage_in_answer,
            predicted_ttft,
            prefix,
            chain: None,
            decided_at: now,
        }
    }
}

/// The Pod a successful answer's TTFT is learnt for.
enum TtftOwner {
    /// The pick answered: its statistics, the prediction's error and the
    /// TTFT model learn it.
    Pick,
    /// A fallback answered: its statistics only. The model was calibrated
    /// on the pick's inputs, not on this Pod's.
    Fallback(Arc<DestinationState>),
}

/// Whether the answer will end with its token counts (when its engine
/// reports them): a whole answer always does, a Responses stream in its
/// last event, a chat or completions stream only when asked
/// (`stream_options.include_usage`).
fn answer_reports_usage(request: &Incoming<'_>) -> bool {
    !request.body.stream || request.body.stream_usage || request.api == Api::Responses
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // Held because the engine had reported unasked, and no count came:
        // it no longer does (restarted without the flag), or the client
        // left; either way the next unasked answer tells again.
        if !self.usage_in_answer && self.sample.is_some() {
            self.state.note_usage_unasked(false);
        }
    }
}

impl Picker {
    /// A successful answer's TTFT, once: the observed statistics count it
    /// now, the TTFT model once the engine has said what it had cached (see
    /// [`TtftSample`]).
    fn learn_ttft(&self, ticket: &mut Ticket, ttft: Duration, now: Instant) {
        match ticket.ttft_owner.take() {
            Some(TtftOwner::Pick) => {}
            Some(TtftOwner::Fallback(actual)) => {
                actual.stats.record_ttft(ttft, now);
                return;
            }
            None => return,
        }
        if let Some(predicted) = ticket.predicted_ttft {
            self.metrics
                .observe_ttft_prediction(predicted, ttft.as_secs_f64());
        }
        ticket.state.stats.record_ttft(ttft, now);
        let sample = ticket.features.take().map(|f| {
            let (model, state) = (Arc::clone(&self.ttft), Arc::clone(&ticket.state));
            // Taken, not cloned: the TTFT is learnt once, and the fallback
            // check in `complete` was the address's last other reader.
            let decided = Decided {
                endpoint: ticket.address.take(),
                predicted: ticket.predicted_ttft,
            };
            TtftSample::new(model, state, f, ttft.as_secs_f64(), decided)
        });
        if ticket.usage_in_answer || ticket.state.reports_usage_unasked() {
            ticket.sample = sample;
        } else if let Some(sample) = sample {
            sample.learn();
        }
    }

    /// The Pod `state` was sent a prompt with these block hashes at `now`:
    /// its indexes hold it from now on.
    fn remember_prompt(&self, state: Arc<DestinationState>, chain: Arc<[u64]>, now: Instant) {
        if chain.is_empty() {
            return;
        }
        if self.precise.get().is_some() {
            // Precise mode: the Pod's events will trail this route.
            state.routed.record(Arc::clone(&chain), now);
        }
        // Indexing a long prompt costs a few hundred microseconds: done
        // beside the reply, not before it.
        tokio::spawn(async move { state.prefix.record(&chain) });
    }
}

impl Picker {
    /// Picks, waiting for room while the matching rule says so. The
    /// request's turn is answered only once its ticket counts it in flight,
    /// so the next in line is evaluated with it counted.
    async fn pick_or_wait(&self, request: &Incoming<'_>) -> (Route, Option<Ticket>) {
        let mut prepared = Prepared::default();
        let mut pick = self.pick_prepared(request, &mut prepared).await;
        let Some(max_wait) = pick.waits() else {
            return self.dispatch(pick, request);
        };
        let place = self.place(request, &pick);
        let bounds = self.policy.current().map_or(
            Bounds {
                requests: 0,
                bytes: 0,
            },
            |p| Bounds {
                requests: p.compiled.flow_control.max_requests,
                bytes: p.compiled.flow_control.max_bytes,
            },
        );
        prepared.waiting_since = Some(Instant::now());
        let mut waiting = match self.flow.enter(place, max_wait, bounds) {
            Ok(w) => w,
            Err(why) => {
                let pick = self
                    .end_wait(request, &mut prepared, pick, Ended::Shed(why))
                    .await;
                return self.dispatch(pick, request);
            }
        };
        let mut turn: Option<Turn> = None;
        loop {
            if let Some(t) = turn.take() {
                t.answer(false);
            }
            match waiting.next().await {
                Next::Turn(t) => {
                    turn = Some(t);
                    pick = self.pick_prepared(request, &mut prepared).await;
                    if pick.waits().is_none() {
                        break;
                    }
                }
                Next::Shed(why) => {
                    pick = self
                        .end_wait(request, &mut prepared, pick, Ended::Shed(why))
                        .await;
                    break;
                }
                Next::Expired => {
                    pick = self
                        .end_wait(request, &mut prepared, pick, Ended::Expired)
                        .await;
                    break;
                }
            }
        }
        let waited = waiting.waited();
        match &pick {
            Pick::Local(_) | Pick::Provider(_) => waiting.dispatched(),
            // A turn answered otherwise (a reload); a shed or an expiry
            // was told its outcome already.
            Pick::Reject { .. } if turn.is_some() => waiting.rejected(),
            Pick::Reject { .. } => {}
        }
        let routed = self.dispatch(pick, request);
        if let Some(t) = turn {
            t.answer(true);
        }
        tracing::debug!(waited_ms = waited.as_millis() as u64, "waited for room");
        routed
    }

    /// A wait that ends without a turn's room: shed (429), or at its
    /// deadline, where one last evaluation takes room that came with it.
    /// Either way the last evaluation is recorded for `/debug/explain` and
    /// the decision log, and the answer counted.
    async fn end_wait(
        &self,
        request: &Incoming<'_>,
        prepared: &mut Prepared,
        waiting_pick: Pick,
        how: Ended,
    ) -> Pick {
        let waited = prepared
            .waiting_since
            .map_or(Duration::ZERO, |s| s.elapsed());
        let answer = match how {
            Ended::Shed(why) => {
                prepared.wait_ended = Some(WaitOutcome::Shed);
                let _ = self.pick_prepared(request, prepared).await;
                shed(waiting_pick, why, waited)
            }
            Ended::Expired => {
                prepared.wait_ended = Some(WaitOutcome::Expired);
                let last = self.pick_prepared(request, prepared).await;
                if last.waits().is_none() {
                    // Counted and recorded as a decision already.
                    return last;
                }
                expired(last, waited)
            }
        };
        observe(&self.metrics, &answer, waited);
        answer
    }

    /// Where a request waits: its objective's priority, its flow (the
    /// fairness id, else its tenant), the rule it waits for, and its body's
    /// size.
    fn place(&self, request: &Incoming<'_>, waiting: &Pick) -> Place {
        let header = |name: &str| request.headers.get(name).filter(|v| !v.is_empty());
        let objective = header(OBJECTIVE_HEADER).map(String::as_str);
        let tenant_header = self
            .policy
            .current()
            .map(|p| p.compiled.tenant_header.clone());
        let flow = header(FAIRNESS_HEADER)
            .or_else(|| header(tenant_header.as_deref()?))
            .map(|f| kinference_policy::eval::clamp_attribute(f).to_string())
            .unwrap_or_default();
        let rule = match waiting {
            Pick::Reject { rule, .. } => rule.clone().unwrap_or_default(),
            _ => String::new(),
        };
        Place {
            priority: self.objectives.priority(objective),
            flow,
            rule,
            bytes: request.body_bytes as u64,
        }
    }
}

/// How a wait ended without a turn's room.
enum Ended {
    Shed(Shed),
    Expired,
}

/// The wait ended before room came: the rule's own reject answers.
fn expired(pick: Pick, waited: Duration) -> Pick {
    match pick {
        Pick::Reject {
            rule,
            status,
            message,
            detail,
            ..
        } => Pick::Reject {
            rule,
            status,
            message: format!("{message} (waited {} ms for room)", waited.as_millis()),
            wait: None,
            detail,
        },
        other => other,
    }
}

/// A higher priority took the request's place, or there was none for it.
fn shed(pick: Pick, why: Shed, waited: Duration) -> Pick {
    let rule = match pick {
        Pick::Reject { rule, .. } => rule,
        _ => None,
    };
    let bound = match why {
        Shed::Requests => "flowControl.maxRequests",
        Shed::Bytes => "flowControl.maxBytes",
    };
    Pick::Reject {
        rule,
        status: 429,
        message: format!(
            "no room, and the waiting requests reached {bound}: shed for higher priorities (after {} ms)",
            waited.as_millis()
        ),
        wait: None,
        detail: None,
    }
}

impl Picker {
    /// A pick as the session's route, with the ticket that counts it in
    /// flight.
    fn dispatch(&self, pick: Pick, request: &Incoming<'_>) -> (Route, Option<Ticket>) {
        match pick {
            Pick::Reject {
                rule,
                status,
                message,
                detail,
                ..
            } => (
                Route::Reject {
                    rule,
                    status,
                    message,
                    detail,
                },
                None,
            ),
            Pick::Local(local) => {
                let mut ticket = Ticket::new(
                    &self.flow,
                    Arc::clone(&local.state),
                    local.addresses.first().cloned(),
                    local.features,
                    local.predicted_ttft,
                    local.prefix,
                    answer_reports_usage(request),
                );
                let now = Instant::now();
                let chain: Arc<[u64]> = local.prefix_hashes.into();
                self.routes.record(Arc::clone(&chain), now);
                // Its engine's events should follow (read by precise mode).
                local.state.kv.note_routed(now);
                self.remember_prompt(local.state, Arc::clone(&chain), now);
                ticket.chain = Some(chain);
                let route = Route::Local(LocalRoute {
                    rule: local.rule,
                    model: local.model,
                    addresses: local.addresses,
                    rewrite_model: local.rewrite_model,
                    detail: local.detail,
                });
                (route, Some(ticket))
            }
            Pick::Provider(p) => {
                let api_key = match p.credential {
                    ProviderCredential::Key(key) => Some(key),
                    ProviderCredential::NotRequired => None,
                    // Fail closed: without its key the request would go out
                    // unauthenticated, or worse with the client's own token.
                    ProviderCredential::Missing { secret } => {
                        tracing::warn!(provider = %p.provider, %secret, "provider picked but its API key is not loaded");
                        self.metrics.bad_request("provider_key_missing");
                        let message = format!(
                            "provider {:?} has no API key loaded (Secret {secret:?})",
                            p.provider
                        );
                        let route = Route::Reject {
                            rule: Some(p.rule),
                            status: 503,
                            message,
                            detail: p.detail,
                        };
                        return (route, None);
                    }
                };
                let ticket = Ticket::new(&self.flow, p.state, None, None, None, None, false);
                let route = Route::Provider(ProviderRoute {
                    rule: p.rule,
                    provider: p.provider,
                    model: p.model,
                    rewrite_model: p.rewrite_model,
                    api_key,
                    detail: p.detail,
                });
                (route, Some(ticket))
            }
        }
    }
}

impl Router for Picker {
    type Ticket = Ticket;

    async fn route(&self, request: &Incoming<'_>) -> (Route, Option<Ticket>) {
        self.pick_or_wait(request).await
    }

    fn complete(&self, ticket: &mut Ticket, facts: ResponseFacts) {
        // Dropped now rather than with the stream: up to 32 KiB of hashes.
        let chain = ticket.chain.take();
        // No response headers: neither a success nor a failure.
        let Some(status) = facts.status else { return };
        let now = Instant::now();
        if status >= 500 || status == 429 {
            ticket.guard.record(Outcome::Failure, now);
            return;
        }
        // A refusal (400: context too long) answers at once, with nothing
        // prefilled: no prompt stored, no TTFT to learn from.
        let answered = (200..300).contains(&status);
        // The gateway went down the fallback list: the selected endpoint
        // failed and another answered. Credit that one with the success and
        // its TTFT. A served address that is no Pod of the pool (an Envoy
        // internal address, a Service's) tells of no fallback.
        let fallback = match (ticket.address.as_deref(), facts.served.as_deref()) {
            (Some(picked), Some(served)) if picked != served => self.registry.state_at(served),
            _ => None,
        };
        if let Some(actual) = fallback {
            self.metrics.fallback_answered();
            actual.stats.record_outcome(Outcome::Success, now);
            // Its engine holds the prompt now, as well as (or rather than)
            // the pick's. Its events, if any, may have come already: not
            // awaited.
            if let Some(chain) = chain.filter(|_| answered) {
                self.remember_prompt(Arc::clone(&actual), chain, now);
            }
            ticket.guard.record(Outcome::Failure, now);
            // The answer's cached count is another Pod's: not a check of
            // this decision's prefix.
            ticket.prefix = None;
            ticket.ttft_owner = answered.then_some(TtftOwner::Fallback(actual));
        } else {
            ticket.guard.record(Outcome::Success, now);
            ticket.ttft_owner = answered.then_some(TtftOwner::Pick);
        }
        // Otherwise the first token times it; a whole answer gives no TTFT
        // here (its headers come with its last token) and teaches nothing.
        if let Some(reported) = facts.reported_ttft {
            self.learn_ttft(ticket, reported, now);
        }
    }

    fn first_token(&self, ticket: &mut Ticket, at: Instant) {
        let ttft = at.saturating_duration_since(ticket.decided_at);
        self.learn_ttft(ticket, ttft, at);
    }

    fn wants_usage(&self, ticket: &Ticket) -> bool {
        ticket.prefix.is_some()
    }

    /// The engine's own counts against the decision's: the cached-prefix
    /// prediction error, the cached count the TTFT model learns with, and in
    /// precise mode the tokenizer check.
    fn usage(&self, ticket: &mut Ticket, usage: Usage) {
        // None after a fallback: the answer is another Pod's.
        let Some(prefix) = ticket.prefix else { return };
        if let Some(prompt) = usage.prompt_tokens {
            ticket
                .state
                .engine_tokens
                .observe(prefix.estimated_prompt, prompt);
        }
        if !ticket.usage_in_answer && usage.cached_tokens.is_some() {
            // Its next unasked streams wait for the count too.
            ticket.state.note_usage_unasked(true);
        }
        if let (Some(reported), Some(prompt)) = (usage.cached_tokens, usage.prompt_tokens)
            && prefix.prompt > 0.0
        {
            // Learnt now, when dropped (with the engine's count when it had
            // a prompt).
            if let Some(mut sample) = ticket.sample.take() {
                sample.engine_reported(
                    prefix.prompt,
                    prompt,
                    reported,
                    ticket.state.engine_block(),
                    prefix.index_block,
                );
            }
            // As a share of the prompt: an estimate counts 4 bytes a token,
            // the engine its own tokens.
            let predicted = prefix.cached_tokens / prefix.prompt * prompt as f64;
            self.metrics.observe_cached_prefix_prediction(
                prefix.source.as_str(),
                predicted,
                reported,
                prompt,
            );
        }
        if let (Some(precise), Some(ours)) = (self.precise.get(), prefix.prompt_tokens) {
            let predicted = match (prefix.source, prefix.block_size) {
                (PrefixSource::Events, Some(block_size)) => {
                    Some((prefix.cached_tokens as u64, block_size))
                }
                _ => None,
            };
            precise.check(Check {
                ours,
                predicted,
                engine_prompt: usage.prompt_tokens,
                engine_cached: usage.cached_tokens,
            });
        }
    }
}
