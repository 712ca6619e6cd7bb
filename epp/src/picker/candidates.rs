//! Candidates for one request: each local endpoint × model it serves, each
//! provider × model, with every attribute we can know now.

use std::time::Instant;

use kinference_policy::attr::CandidateType;
use kinference_policy::eval::{
    Candidate, Decision, Metrics as CandidateMetrics, PrefixSource, Request,
};
use kinference_policy::model::{CompiledPolicy, Price};

use std::collections::HashMap;
use std::sync::Arc;

use super::placement::{self, Local, Overflow, Pod, PoolFacts};
use super::{LocalPick, Pick, Picker, ProviderCredential, ProviderPick};
use crate::endpoints::EndpointView;
use crate::kv_cache::PodKvIndex;
use crate::kv_cache::PromptTokens;
use crate::kv_cache::index::PodSlots;
use crate::kv_cache::pool::PoolIndex;
use crate::policy_store::LoadedPolicy;
use crate::predict::{DestinationState, TtftFeatures, TtftPredictor};

/// Candidates with what the pick needs to act on each.
pub(crate) struct CandidateSet {
    pub candidates: Vec<Candidate>,
    states: Vec<Arc<DestinationState>>,
    features: Vec<Option<TtftFeatures>>,
    /// Local candidates' TTFT as predicted for this request alone, before a
    /// replica's prefill is shared (`predict::reuse`); `None` for providers.
    predicted: Vec<Option<f64>>,
    /// Candidates priced as a new replica of the prompt's prefix.
    seeds: Vec<usize>,
    /// Local candidates' cached-prefix predictions; `None` for providers.
    prefixes: Vec<Option<PrefixPrediction>>,
}

/// A local candidate's cached prefix as the decision saw it, to compare
/// with what its engine reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixPrediction {
    pub cached_tokens: f64,
    /// The prompt's length in the unit `cached_tokens` counts in: the
    /// engine's tokens in precise mode, else estimated.
    pub prompt: f64,
    pub source: PrefixSource,
    /// The block size the Pod's events declare, when they were the source.
    pub block_size: Option<u32>,
    /// The prompt's tokens as precise mode tokenized it, if it did.
    pub prompt_tokens: Option<u64>,
    /// The prompt's tokens as estimated (4 bytes a token), the approximate
    /// index's unit.
    pub estimated_prompt: u64,
    /// A block of the approximate index, in the unit `prompt` counts in.
    pub index_block: f64,
}

impl CandidateSet {
    pub fn build(
        picker: &Picker,
        policy: &LoadedPolicy,
        request: &Request,
        hashes: &[u64],
        tokens: Option<&PromptTokens>,
        subset: Option<&[String]>,
    ) -> Self {
        let now = Instant::now();
        let snapshot = picker.registry.snapshot();
        let compiled = &policy.compiled;
        let mut set = CandidateSet {
            candidates: Vec::with_capacity(snapshot.len() + compiled.providers.len()),
            states: Vec::new(),
            features: Vec::new(),
            predicted: Vec::new(),
            seeds: Vec::new(),
            prefixes: Vec::new(),
        };
        // Each endpoint's address is formatted once per request.
        let admitted: Vec<(&EndpointView, String)> = snapshot
            .iter()
            .map(|view| (view, view.endpoint.address()))
            .filter(|(_, address)| subset.is_none_or(|s| in_subset(s, address)))
            .collect();
        let tokenized = tokens.map(|t| t.ids().len() as u64);
        let precise = tokens.map_or_else(Vec::new, |t| {
            let indexes: Vec<&PodKvIndex> = admitted.iter().map(|(v, _)| &v.state.kv).collect();
            let adapter = lora_adapter(&request.model, admitted.iter().map(|(v, _)| *v));
            precise_cached_tokens(picker.registry.kv_pool(), &indexes, t, adapter, now)
        });
        let units = PromptUnits::new(request.prompt_tokens, tokenized, picker.config.block_chars);
        let facts = RequestFacts {
            request,
            hashes,
            units,
            tokenized,
            output: request
                .max_tokens
                .unwrap_or(picker.config.default_output_tokens) as f64,
            now,
        };
        // Requests this EPP routed to each local candidate lately.
        let mut recent_routes = Vec::with_capacity(admitted.len());
        for (i, (view, address)) in admitted.iter().enumerate() {
            let events = precise.get(i).copied().flatten();
            let prefix = facts.cached_prefix(view, events);
            let recent = set.push_local(picker, compiled, &facts, view, address, prefix);
            recent_routes.extend(std::iter::repeat_n(recent, view.endpoint.models.len()));
        }
        set.place(picker, policy, &facts, &recent_routes);
        set.push_providers(picker, compiled, &facts);
        set
    }

    /// One candidate per model the Pod of `view` serves, with what is
    /// known of it now; returns the requests this EPP routed there lately.
    fn push_local(
        &mut self,
        picker: &Picker,
        compiled: &CompiledPolicy,
        facts: &RequestFacts<'_>,
        view: &EndpointView,
        address: &str,
        prefix: PrefixPrediction,
    ) -> f64 {
        let (ep, state) = (&view.endpoint, &view.state);
        let (prompt, cached) = (prefix.prompt, prefix.cached_tokens);
        let live = state.stats.snapshot(facts.now);
        // Requests picked since the last scrape was sent are load the
        // metrics do not show yet: without them a burst ties every
        // endpoint at the same stale values and lands on the first. For
        // the TTFT prediction they count as running, not queued: a server
        // with free batch slots starts them at once, and pricing each as a
        // full queue wait pushed requests away from their cached prefix.
        let unscraped = live.unscraped as f64;
        let load = view.metrics.as_ref().map(|m| {
            (
                m.waiting + unscraped,
                m.running + unscraped,
                m.kv_cache_usage,
            )
        });
        let features = view.metrics.as_ref().map(|m| {
            let running = m.running + unscraped;
            TtftFeatures::new(m.waiting, running, prompt, cached, m.kv_cache_usage)
        });
        let predicted = features
            .as_ref()
            .map(|f| picker.ttft.predict(&state.ttft, f));
        for model in &ep.models {
            let info = compiled.local_model(model);
            let lora = facts
                .request
                .lora
                .as_deref()
                .filter(|adapter| adapter == model)
                .and_then(|adapter| Some(LoraRoom::of(view.metrics.as_ref()?, adapter)));
            self.candidates.push(Candidate {
                kind: CandidateType::Local,
                model: model.clone(),
                endpoint: ep.pod.clone(),
                address: Some(address.to_string()),
                backend_name: ep.backend.clone(),
                provider_name: None,
                zone: ep.zone.clone(),
                node: ep.node.clone(),
                labels: if compiled.reads.labels {
                    ep.labels.clone()
                } else {
                    Default::default()
                },
                metrics: CandidateMetrics {
                    queue_depth: load.map(|l| l.0),
                    running_requests: load.map(|l| l.1),
                    kv_cache_utilization: load.map(|l| l.2),
                    cached_prefix_tokens: Some(cached),
                    predicted_ttft: predicted,
                    observed_ttft: live.observed_ttft.map(|d| d.as_secs_f64()),
                    error_rate: Some(live.error_rate),
                    cost: info
                        .and_then(|i| i.price)
                        .map(|p| p.cost(prompt, cached, facts.output)),
                    context_window: info.and_then(|i| i.context_window).map(|c| c as f64),
                    lora_loaded: lora.map(|l| f64::from(u8::from(l.loaded))),
                    lora_slots_free: lora.and_then(|l| l.slots_free),
                    in_flight: Some(live.running as f64),
                },
                cached_prefix_source: Some(prefix.source),
                placement: Default::default(),
            });
            self.states.push(Arc::clone(state));
            self.features.push(features);
            self.predicted.push(predicted);
            self.prefixes.push(Some(prefix));
        }
        live.recent_routes
    }

    /// One candidate per model of each of the policy's providers.
    fn push_providers(
        &mut self,
        picker: &Picker,
        compiled: &CompiledPolicy,
        facts: &RequestFacts<'_>,
    ) {
        let provider_states = picker.providers.for_policy(compiled);
        for (provider, state) in compiled.providers.iter().zip(provider_states) {
            let live = state.stats.snapshot(facts.now);
            for model in &provider.models {
                let cost = model
                    .price
                    .map(|p: Price| p.cost(facts.units.prompt, 0.0, facts.output));
                self.candidates.push(Candidate {
                    kind: CandidateType::Provider,
                    model: model.name.clone(),
                    endpoint: provider.name.clone(),
                    provider_name: Some(provider.name.clone()),
                    metrics: CandidateMetrics {
                        running_requests: Some(live.running as f64),
                        in_flight: Some(live.running as f64),
                        observed_ttft: live.observed_ttft.map(|d| d.as_secs_f64()),
                        error_rate: Some(live.error_rate),
                        cost,
                        context_window: model.context_window.map(|c| c as f64),
                        ..CandidateMetrics::default()
                    },
                    ..Candidate::default()
                });
                self.states.push(Arc::clone(&state));
                self.features.push(None);
                self.predicted.push(None);
                self.prefixes.push(None);
            }
        }
    }

    /// Prices each local candidate's placement terms (`placement`), for a
    /// policy that ranks by `PredictedTTFT` and bounds it nowhere: one that
    /// bounds the request's own TTFT (an SLO) wants each request's fastest
    /// Pod, not its group's home.
    fn place(
        &mut self,
        picker: &Picker,
        policy: &LoadedPolicy,
        facts: &RequestFacts<'_>,
        recent_routes: &[f64],
    ) {
        let (units, hashes, now) = (&facts.units, facts.hashes, facts.now);
        let reads = &policy.compiled.reads;
        if !reads.ranks_by_predicted_ttft || reads.filters_on_predicted_ttft {
            return;
        }
        let local = |i: usize| {
            let prefix = self.prefixes[i]?;
            Some(Local {
                model: &self.candidates[i].model,
                cached: prefix.cached_tokens,
                prompt: prefix.prompt,
                features: self.features[i],
                predicted: self.predicted[i],
                recent_routes: recent_routes[i],
                pod: PodModel {
                    ttft: &picker.ttft,
                    state: &self.states[i],
                    hashes,
                    units,
                },
            })
        };
        let locals: Vec<_> = (0..self.candidates.len()).map(local).collect();
        let pool = PoolFacts {
            hashed: !hashes.is_empty(),
            seeds_open: picker.seeds.is_open(now),
            shared: || {
                let shared = picker.routes.shared_blocks(hashes, now);
                shared.into_iter().map(|b| units.of_estimate(b)).collect()
            },
        };
        let priced = placement::price(&locals, pool);
        drop(locals);
        for (candidate, terms) in self.candidates.iter_mut().zip(priced.terms) {
            candidate.placement = terms;
        }
        self.seeds = priced.replicas;
    }

    pub(crate) fn to_pick(
        &self,
        picker: &Picker,
        policy: &LoadedPolicy,
        request: &Request,
        decision: &Decision,
    ) -> Pick {
        let compiled = &policy.compiled;
        match decision {
            Decision::Reject(r) => Pick::Reject {
                rule: r.rule.map(|i| compiled.rules[i].name.clone()),
                status: r.status,
                message: r.message.clone(),
                wait: r.wait,
                detail: None,
            },
            Decision::Route(routed) => {
                let rule = compiled.rules[routed.rule].name.clone();
                let winner = &self.candidates[routed.winner];
                if self.seeds.contains(&routed.winner) {
                    picker.seeds.seeded(Instant::now());
                }
                match winner.kind {
                    CandidateType::Local => Pick::Local(LocalPick {
                        rule,
                        addresses: routed
                            .ranked
                            .iter()
                            .filter_map(|&i| self.candidates[i].address.clone())
                            .collect(),
                        endpoint: winner.endpoint.clone(),
                        model: winner.model.clone(),
                        rewrite_model: Some(
                            compiled
                                .local_model(&winner.model)
                                .map_or(winner.model.clone(), |m| m.target_model.clone()),
                        )
                        .filter(|target| *target != request.model),
                        state: Arc::clone(&self.states[routed.winner]),
                        features: self.features[routed.winner],
                        predicted_ttft: self.predicted[routed.winner],
                        prefix: self.prefixes[routed.winner],
                        prefix_hashes: Vec::new(),
                        detail: None,
                    }),
                    CandidateType::Provider => {
                        let provider = winner.endpoint.clone();
                        let target = compiled
                            .provider(&provider)
                            .and_then(|p| p.model(&winner.model))
                            .map_or(winner.model.clone(), |m| m.target_model.clone());
                        let credential =
                            match compiled.provider(&provider).and_then(|p| p.secret.as_ref()) {
                                None => ProviderCredential::NotRequired,
                                Some(secret) => match picker.provider_keys.load().get(&provider) {
                                    Some(key) => ProviderCredential::Key(key.clone()),
                                    None => ProviderCredential::Missing {
                                        secret: secret.name.clone(),
                                    },
                                },
                            };
                        Pick::Provider(ProviderPick {
                            rule,
                            credential,
                            rewrite_model: (target != request.model).then(|| target.clone()),
                            model: winner.model.clone(),
                            provider,
                            state: Arc::clone(&self.states[routed.winner]),
                            detail: None,
                        })
                    }
                }
            }
        }
    }
}

/// What every candidate of one request is built from.
struct RequestFacts<'a> {
    request: &'a Request,
    hashes: &'a [u64],
    units: PromptUnits,
    /// The prompt's tokens, when precise mode tokenized it.
    tokenized: Option<u64>,
    /// Output tokens, for `Cost`.
    output: f64,
    now: Instant,
}

impl RequestFacts<'_> {
    /// The prompt's prefix the Pod of `view` holds: by its engines' events
    /// (`events`, precise mode) and this EPP's routes, or estimated.
    fn cached_prefix(&self, view: &EndpointView, events: Option<EventsMatch>) -> PrefixPrediction {
        let (units, hashes, state) = (&self.units, self.hashes, &view.state);
        let (cached, source, block_size) = match events {
            Some(matched) => {
                // A prompt sent here moments ago is cached before the
                // Pod's events say so: counted from this EPP's routes.
                let routed = units.of_estimate(state.routed.cached_blocks(hashes, self.now));
                // A late index lacks what was stored before it joined;
                // what this EPP routed there since may still be cached.
                let estimate = matched
                    .partial
                    .then(|| units.of_estimate(state.prefix.cached_blocks(hashes)));
                let events = units.of_events(matched.tokens);
                events_or_routes(
                    events,
                    routed.max(estimate.unwrap_or(0.0)),
                    matched.block_size,
                )
            }
            None => {
                let blocks = state.prefix.cached_blocks(hashes);
                (units.of_estimate(blocks), PrefixSource::Estimate, None)
            }
        };
        PrefixPrediction {
            cached_tokens: cached,
            prompt: units.prompt,
            source,
            block_size,
            prompt_tokens: self.tokenized,
            estimated_prompt: self.request.prompt_tokens,
            index_block: units.per_estimated_block,
        }
    }
}

/// A local candidate's Pod as the placement terms ask of it: its TTFT model
/// and its prefix index, for this request's prompt.
struct PodModel<'a> {
    ttft: &'a TtftPredictor,
    state: &'a DestinationState,
    hashes: &'a [u64],
    units: &'a PromptUnits,
}

impl Pod for PodModel<'_> {
    fn predict(&self, features: &TtftFeatures) -> f64 {
        self.ttft.predict(&self.state.ttft, features)
    }

    fn per_queued(&self) -> f64 {
        self.ttft.coefficients(&self.state.ttft).per_queued
    }

    fn trained(&self) -> bool {
        let trained = self.ttft.config().min_endpoint_observations;
        self.ttft.observations(&self.state.ttft) >= trained
    }

    fn overflow(&self) -> Option<Overflow> {
        let growth = self.state.prefix.growth(self.hashes);
        (growth.overflow > 0).then(|| Overflow {
            share: growth.overflow as f64 / growth.new as f64,
            tokens: self.units.of_estimate(growth.overflow),
        })
    }

    fn reused_evictions(&self) -> f64 {
        let blocks = self.state.prefix.reused_evictions(self.hashes);
        self.units.of_estimate(blocks)
    }
}

/// The unit a request's prompt and its candidates' cached prefixes count
/// in, one for all so that candidates compare: the engine's tokens when
/// precise mode tokenized the prompt, else the estimate's (4 bytes a token).
/// Mixed, a Pod whose events said it held the whole prompt looked only
/// partly cached, next to the estimate's larger count of the prompt.
#[derive(Debug, Clone, Copy)]
struct PromptUnits {
    prompt: f64,
    /// Estimated tokens in a block of the approximate index, in this unit.
    per_estimated_block: f64,
}

impl PromptUnits {
    fn new(estimated_prompt: u64, tokenized: Option<u64>, block_chars: usize) -> Self {
        let estimated = estimated_prompt as f64;
        let prompt = tokenized.map_or(estimated, |t| t as f64);
        let scale = if estimated > 0.0 {
            prompt / estimated
        } else {
            1.0
        };
        PromptUnits {
            prompt,
            per_estimated_block: block_chars as f64 / 4.0 * scale,
        }
    }

    /// Cached tokens the engine's events count.
    fn of_events(&self, tokens: usize) -> f64 {
        (tokens as f64).min(self.prompt)
    }

    /// Cached blocks of the approximate index.
    fn of_estimate(&self, blocks: usize) -> f64 {
        (blocks as f64 * self.per_estimated_block).min(self.prompt)
    }
}

/// A Pod's cached prefix in precise mode, from its `events` and what this
/// EPP's `routes` say it holds: the longer, and where it comes from. Within
/// a block the two agree, rounded differently, and the answer still checks
/// the events; beyond it the routes know what the events do not say (yet,
/// or ever for a late index).
fn events_or_routes(events: f64, routes: f64, block_size: u32) -> (f64, PrefixSource, Option<u32>) {
    let cached = events.max(routes);
    if routes >= events + f64::from(block_size) {
        (cached, PrefixSource::Estimate, None)
    } else {
        (cached, PrefixSource::Events, Some(block_size))
    }
}

/// A prompt's leading tokens a Pod's engines hold, from their KV events.
#[derive(Clone, Copy, Debug, PartialEq)]
struct EventsMatch {
    tokens: usize,
    /// The block size the engines count in.
    block_size: u32,
    /// The index joined late: a lower bound, to be taken with the estimate.
    partial: bool,
}

/// Per Pod of `indexes`, the prompt's leading tokens its engines hold, from
/// their KV events: `None` where its index is not usable at `now` (no
/// events yet, events lost, or silent since it was sent a request), so the
/// estimate is used. One walk of the pool's index per block size, not one
/// per Pod.
fn precise_cached_tokens(
    pool: &PoolIndex,
    indexes: &[&PodKvIndex],
    tokens: &PromptTokens,
    adapter: Option<&str>,
    now: Instant,
) -> Vec<Option<EventsMatch>> {
    let slots: Vec<Option<PodSlots>> = indexes.iter().map(|kv| kv.pool_slots(now)).collect();
    let mut out = vec![None; indexes.len()];
    let mut sizes: Vec<u32> = slots.iter().flatten().map(|p| p.block_size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for bs in sizes {
        let of_size = || {
            slots
                .iter()
                .enumerate()
                .filter_map(move |(i, s)| s.as_ref().filter(|p| p.block_size == bs).map(|p| (i, p)))
        };
        let all: Vec<u32> = of_size()
            .flat_map(|(_, p)| p.slots.iter().copied())
            .collect();
        let held: HashMap<u32, usize> = pool
            .leading_blocks(&tokens.chain(bs, adapter), &all)
            .into_iter()
            .collect();
        for (i, pod) in of_size() {
            // The best of the Pod's engines: its server may give the
            // request to any of its ranks.
            let blocks = pod.slots.iter().filter_map(|s| held.get(s)).max();
            out[i] = Some(EventsMatch {
                tokens: blocks.copied().unwrap_or(0) * bs as usize,
                block_size: bs,
                partial: pod.partial,
            });
        }
    }
    out
}

/// `model` when it names a LoRA adapter of one of `pods`: one its engines
/// stored blocks for, or its metrics list running or waiting
/// (`vllm:lora_requests_info`). The engines root an adapter's blocks at its
/// name, so its prompt must be matched in that chain, and never in the base
/// model's (whose cached prefix the adapter cannot use).
pub(super) fn lora_adapter<'a>(
    model: &'a str,
    mut pods: impl Iterator<Item = &'a EndpointView>,
) -> Option<&'a str> {
    let named = |list: &[String]| list.iter().any(|a| a == model);
    pods.any(|pod| {
        named(&pod.endpoint.adapters)
            || pod.state.kv.has_adapter(model)
            || pod
                .metrics
                .as_ref()
                .is_some_and(|m| named(&m.running_loras) || named(&m.waiting_loras))
    })
    .then_some(model)
}

/// A Pod's room for a LoRA adapter, from its `vllm:lora_requests_info`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct LoraRoom {
    /// Running or waiting there: loaded.
    loaded: bool,
    /// `max_lora` minus the adapters running or waiting; `None` without
    /// `max_lora`.
    slots_free: Option<f64>,
}

impl LoraRoom {
    fn of(metrics: &crate::endpoints::ScrapedMetrics, adapter: &str) -> LoraRoom {
        let mut in_use: Vec<&str> = metrics
            .running_loras
            .iter()
            .chain(&metrics.waiting_loras)
            .map(String::as_str)
            .collect();
        in_use.sort_unstable();
        in_use.dedup();
        LoraRoom {
            loaded: in_use.contains(&adapter),
            slots_free: metrics
                .max_lora
                .map(|max| (f64::from(max) - in_use.len() as f64).max(0.0)),
        }
    }
}

/// The subset hint names `ip:port`; a bare IP (the conformance test header)
/// admits every port of that IP.
fn in_subset(subset: &[String], address: &str) -> bool {
    subset.iter().any(|s| {
        s == address
            || (!s.contains(':') || s.starts_with('[') && s.ends_with(']'))
                && address.rsplit_once(':').is_some_and(|(ip, _)| ip == s)
    })
}

#[cfg(test)]
mod tests {
    use super::{PromptUnits, events_or_routes, in_subset, lora_adapter};
    use kinference_policy::eval::PrefixSource;

    fn pod_view(
        running_loras: &[&str],
        stored_for: Option<&str>,
    ) -> crate::endpoints::EndpointView {
        use crate::endpoints::{Endpoint, ScrapedMetrics};
        use crate::kv_cache::wire::{BlockStored, EngineBlock, EventBatch, KvEvent};
        use crate::predict::{DestinationConfig, DestinationState};
        let state = DestinationState::new(&DestinationConfig::default());
        if let Some(adapter) = stored_for {
            let stored = KvEvent::Stored(BlockStored {
                block_hashes: vec![EngineBlock(7)],
                parent: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: 4,
                lora_name: Some(adapter.into()),
                medium: None,
                has_extra_keys: false,
                group_idx: None,
            });
            let batch = EventBatch {
                ts: 0.0,
                events: vec![stored],
                data_parallel_rank: None,
            };
            state.kv.apply(0, &batch);
        }
        let metrics = ScrapedMetrics {
            running_loras: running_loras.iter().map(|a| a.to_string()).collect(),
            ..ScrapedMetrics::empty(std::time::Instant::now())
        };
        crate::endpoints::EndpointView {
            endpoint: std::sync::Arc::new(Endpoint {
                name: "p".into(),
                pod: "p".into(),
                uid: None,
                namespace: "ns".into(),
                ip: "10.0.0.1".parse().unwrap(),
                port: 8000,
                models: vec!["base".into(), "sql-lora".into()],
                adapters: Vec::new(),
                backend: None,
                zone: None,
                node: None,
                labels: Default::default(),
            }),
            state,
            metrics: Some(metrics),
        }
    }

    #[test]
    fn the_events_count_unless_the_routes_know_a_block_more() {
        let events = PrefixSource::Events;
        assert_eq!(events_or_routes(64.0, 0.0, 16), (64.0, events, Some(16)));
        assert_eq!(events_or_routes(64.0, 70.0, 16), (70.0, events, Some(16)));
        let routes = PrefixSource::Estimate;
        assert_eq!(events_or_routes(64.0, 80.0, 16), (80.0, routes, None));
        assert_eq!(events_or_routes(0.0, 512.0, 16), (512.0, routes, None));
    }

    #[test]
    fn a_model_is_an_adapter_once_a_pod_stores_its_blocks_or_runs_it() {
        let idle = pod_view(&[], None);
        let running = pod_view(&["sql-lora"], None);
        let stored = pod_view(&[], Some("sql-lora"));
        assert_eq!(lora_adapter("sql-lora", [&idle].into_iter()), None);
        assert_eq!(
            lora_adapter("sql-lora", [&idle, &running].into_iter()),
            Some("sql-lora")
        );
        assert_eq!(
            lora_adapter("sql-lora", [&stored].into_iter()),
            Some("sql-lora")
        );
        assert_eq!(lora_adapter("base", [&running, &stored].into_iter()), None);
    }

    #[test]
    fn a_tokenized_prompt_and_every_cached_prefix_count_in_the_engines_tokens() {
        // 4,096 bytes (1,024 estimated tokens, 64 blocks of 64 bytes) the
        // engine's tokenizer makes 640 tokens of.
        let units = PromptUnits::new(1_024, Some(640), 64);
        assert_eq!(units.prompt, 640.0);
        assert_eq!(units.of_events(640), 640.0, "held whole by its events");
        assert_eq!(units.of_events(700), 640.0);
        // Half the prompt's blocks, estimated: half the prompt still.
        assert_eq!(units.of_estimate(32), 320.0);
        assert_eq!(units.of_estimate(100), 640.0);
        // Not tokenized: the estimate's own unit.
        let estimated = PromptUnits::new(1_024, None, 64);
        assert_eq!(estimated.prompt, 1_024.0);
        assert_eq!(estimated.of_estimate(32), 512.0);
        assert_eq!(PromptUnits::new(0, Some(5), 64).of_estimate(1), 5.0);
    }

    #[test]
    fn subset_matches_ip_and_port_not_ip_alone() {
        let s = vec!["10.0.0.1:8000".to_string()];
        assert!(in_subset(&s, "10.0.0.1:8000"));
        assert!(!in_subset(&s, "10.0.0.1:8001"));
        assert!(!in_subset(&s, "10.0.0.10:8000"));
        let ip_only = vec!["10.0.0.1".to_string()];
        assert!(in_subset(&ip_only, "10.0.0.1:8001"));
        assert!(!in_subset(&ip_only, "10.0.0.11:8001"));
    }
}
