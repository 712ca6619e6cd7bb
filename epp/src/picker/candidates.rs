//! Candidates for one request: each local endpoint × model it serves, each
//! provider × model, with every attribute we can know now.

use std::time::Instant;

use kinference_policy::attr::CandidateType;
use kinference_policy::eval::{
    Candidate, Decision, Metrics as CandidateMetrics, PrefixSource, Request,
};
use kinference_policy::model::Price;

use std::collections::HashMap;
use std::sync::Arc;

use super::{LocalPick, Pick, Picker, ProviderCredential, ProviderPick};
use crate::endpoints::EndpointView;
use crate::kv_events::PodKvIndex;
use crate::kv_events::index::PodSlots;
use crate::kv_events::pool::PoolIndex;
use crate::kv_events::tokenize::PromptTokens;
use crate::policy_store::LoadedPolicy;
use crate::predict::{DestinationState, TtftFeatures, reuse};

/// Candidates with what the pick needs to act on each.
pub struct CandidateSet {
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
    /// Local candidates carrying a hot group ([`Self::hot_carriers`]).
    hot: Vec<bool>,
}

/// A Pod carries a hot group when it took more than this many times the
/// mean of the recent routes of the Pods serving the model ...
const HOT_SHARE: f64 = 2.0;
/// ... and at least this many of them (decayed): about 2.8 requests a
/// second held (8 × ln 2 ÷ the 2 s half-life), so that a pool's first
/// routes, and a Pod below that rate, flag nobody.
const HOT_MIN_ROUTES: f64 = 8.0;

/// What `price_room` compares a local candidate with, from the local
/// candidates of its model.
#[derive(Debug, Clone, Copy, PartialEq)]
struct RoomBounds {
    /// The most of the prompt any of them holds: 0 for a prompt cached
    /// nowhere.
    best: f64,
    /// For a prompt cached nowhere, the load (requests running and waiting)
    /// above which a Pod has no room for its group: one request above
    /// their mean. Unbounded for a prompt cached somewhere.
    full_above_load: f64,
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
            hot: Vec::new(),
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
        // Requests this EPP routed to each local candidate lately.
        let mut recent_routes = Vec::with_capacity(admitted.len());
        let prompt = units.prompt;
        let output = request
            .max_tokens
            .unwrap_or(picker.config.default_output_tokens) as f64;
        for (i, (view, address)) in admitted.iter().enumerate() {
            let ep = &view.endpoint;
            let state = &view.state;
            let (cached, source, block_size) = match precise.get(i).copied().flatten() {
                Some(matched) => {
                    // A prompt sent here moments ago is cached before the
                    // Pod's events say so: counted from this EPP's routes.
                    let routed = units.of_estimate(state.routed.cached_blocks(hashes, now));
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
            let prefix = PrefixPrediction {
                cached_tokens: cached,
                prompt,
                source,
                block_size,
                prompt_tokens: tokenized,
                estimated_prompt: request.prompt_tokens,
                index_block: units.per_estimated_block,
            };
            let live = state.stats.snapshot(now);
            // Requests picked since the last scrape was sent are load the
            // metrics do not show yet: without them a burst ties every
            // endpoint at the same stale values and lands on the first. For
            // the TTFT prediction they count as running, not queued: a
            // server with free batch slots starts them at once, and pricing
            // each as a full queue wait pushed requests away from their
            // cached prefix.
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
                let lora = request
                    .lora
                    .as_deref()
                    .filter(|adapter| adapter == model)
                    .and_then(|adapter| Some(LoraRoom::of(view.metrics.as_ref()?, adapter)));
                set.candidates.push(Candidate {
                    kind: CandidateType::Local,
                    model: model.clone(),
                    endpoint: ep.pod.clone(),
                    address: Some(address.clone()),
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
                            .map(|p| p.cost(prompt, cached, output)),
                        context_window: info.and_then(|i| i.context_window).map(|c| c as f64),
                        lora_loaded: lora.map(|l| f64::from(u8::from(l.loaded))),
                        lora_slots_free: lora.and_then(|l| l.slots_free),
                        in_flight: Some(live.running as f64),
                    },
                    cached_prefix_source: Some(source),
                });
                set.states.push(Arc::clone(state));
                set.features.push(features);
                set.predicted.push(predicted);
                set.prefixes.push(Some(prefix));
                recent_routes.push(live.recent_routes);
            }
        }
        set.hot = set.hot_carriers(&recent_routes);
        let rooms = set.price_room(picker, policy, &units, hashes);
        set.share_replica_prefills(picker, policy, &units, hashes, &rooms, now);
        let provider_states = picker.providers.for_policy(compiled);
        for (provider, state) in compiled.providers.iter().zip(provider_states) {
            let live = state.stats.snapshot(now);
            for model in &provider.models {
                set.candidates.push(Candidate {
                    kind: CandidateType::Provider,
                    model: model.name.clone(),
                    endpoint: provider.name.clone(),
                    provider_name: Some(provider.name.clone()),
                    metrics: CandidateMetrics {
                        running_requests: Some(live.running as f64),
                        in_flight: Some(live.running as f64),
                        observed_ttft: live.observed_ttft.map(|d| d.as_secs_f64()),
                        error_rate: Some(live.error_rate),
                        cost: model.price.map(|p: Price| p.cost(prompt, 0.0, output)),
                        context_window: model.context_window.map(|c| c as f64),
                        ..CandidateMetrics::default()
                    },
                    ..Candidate::default()
                });
                set.states.push(Arc::clone(&state));
                set.features.push(None);
                set.predicted.push(None);
                set.prefixes.push(None);
            }
        }
        set
    }

    pub fn to_pick(
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

impl CandidateSet {
    /// A local candidate that lacks part of the prompt is priced with the
    /// room it leaves: where a prompt goes, its group's next requests
    /// follow. A Pod whose cache would not hold the prompt's new blocks
    /// beside its working set (`PrefixCache::growth`) would prefill its
    /// questions, and its neighbours', again for as long as the group
    /// stays (a fourth group on a Pod holding three: BENCHMARKS, issue
    /// 14). For a prompt cached nowhere (a new group's first request, or a
    /// one-off: they cannot be told apart), a Pod with more requests
    /// running and waiting (picks not yet scraped included) than one above
    /// the mean of its model's Pods has no room either: its traffic would
    /// queue the new group's.
    ///
    /// The price is the share of the new blocks that would not fit, times
    /// one queued request by the Pod's model, and at most their prefill
    /// (a group's next question on its own Pod costs no more than itself).
    /// It is a forecast (the group may never come back); uncapped, or
    /// without the load, it sent new groups to the one Pod with room, the
    /// one a hot group kept busy (BENCHMARKS, "Room for a new group"). So
    /// room decides between Pods whose loads are within a queued request,
    /// and load beyond that. A Pod carrying a hot group
    /// ([`hot_carriers`](Self::hot_carriers)), for a prompt cached nowhere
    /// or one another Pod holds more of (a group leaving its first Pod,
    /// busy with the pool's cold prefills), is priced with the prefill it
    /// lacks a second time (at least one queued request): the group would
    /// queue behind the hot one and leave again. "Cached nowhere", "the
    /// mean" and "another Pod" are read among the candidate's model's Pods
    /// ([`room_bounds`](Self::room_bounds)). Only for a policy that ranks
    /// by `PredictedTTFT` and bounds it nowhere, as for a replica.
    ///
    /// Returns each candidate's room price (0 where none), which a
    /// replica's price (`share_replica_prefills`) builds on.
    fn price_room(
        &mut self,
        picker: &Picker,
        policy: &LoadedPolicy,
        units: &PromptUnits,
        hashes: &[u64],
    ) -> Vec<f64> {
        let mut rooms = vec![0.0; self.candidates.len()];
        let reads = &policy.compiled.reads;
        if !reads.ranks_by_predicted_ttft || reads.filters_on_predicted_ttft || hashes.is_empty() {
            return rooms;
        }
        for (i, bounds) in self.room_bounds().into_iter().enumerate() {
            let (Some(prefix), Some(features), Some(predicted), Some(bounds)) = (
                self.prefixes[i],
                self.features[i],
                self.predicted[i],
                bounds,
            ) else {
                continue;
            };
            let RoomBounds {
                best,
                full_above_load,
            } = bounds;
            let cached_nowhere = best <= 0.0;
            let gap = prefix.prompt - prefix.cached_tokens;
            if gap <= 0.0 {
                continue;
            }
            let queued = picker.ttft.coefficients(&self.states[i].ttft).per_queued;
            let full = features.running + features.waiting > full_above_load;
            let at_cached = || {
                let all_cached = TtftFeatures {
                    uncached_tokens: 0.0,
                    ..features
                };
                picker.ttft.predict(&self.states[i].ttft, &all_cached)
            };
            let another_group = self.hot[i] && (cached_nowhere || prefix.cached_tokens < best);
            let price = if another_group {
                // Its group would leave again, the hot one's traffic
                // queueing it, and pay this prefill a second time.
                (predicted - at_cached()).max(queued)
            } else if full {
                queued
            } else {
                let growth = self.states[i].prefix.growth(hashes);
                if growth.overflow == 0 {
                    continue;
                }
                // In precise mode the events may hold more than this EPP
                // routed: the prompt's own uncached tokens bound what it adds.
                let evicted = units.of_estimate(growth.overflow).min(gap);
                let cost = reuse::eviction_cost(predicted, at_cached(), gap, evicted);
                let share = growth.overflow as f64 / growth.new as f64;
                cost.min(queued * share)
            };
            self.candidates[i].metrics.predicted_ttft = Some(predicted + price);
            rooms[i] = price;
        }
        rooms
    }

    /// A local candidate that lacks part of the prefix the best-cached one
    /// of its model holds is priced with that part's prefill divided among
    /// the recent requests that shared it (`predict::reuse`), plus the
    /// larger of what its cache pushes out for it: the reused blocks it
    /// evicts now, or the forecast of `rooms` (`price_room`'s). A hot
    /// group spreads once its Pod's queue costs more than its share of a
    /// new replica, onto a Pod with room for it. Until a cache first
    /// pushes a block out (or holds one untouched for the reuse horizon,
    /// `predict::prefix`), the groups on it have not come back yet, so
    /// nothing counts as reused there and only the forecast tells a Pod
    /// that would hold the group beside two others from one that must
    /// hold it beside three, where it and they are prefilled again and
    /// again (BENCHMARKS, issue 14). A candidate is a replica, its price
    /// replacing the room-priced one, only where its share of the prefill
    /// and the evictions it makes now cost less than its own prediction
    /// (`reuse::eviction_cost`), and that carries no hot group of its own
    /// ([`hot_carriers`](Self::hot_carriers)). Only for a policy that
    /// ranks by `PredictedTTFT` and bounds it nowhere: an SLO on the
    /// request's own TTFT must see its full prefill.
    fn share_replica_prefills(
        &mut self,
        picker: &Picker,
        policy: &LoadedPolicy,
        units: &PromptUnits,
        hashes: &[u64],
        rooms: &[f64],
        now: Instant,
    ) {
        let reads = &policy.compiled.reads;
        if !reads.ranks_by_predicted_ttft
            || reads.filters_on_predicted_ttft
            || !picker.seeds.is_open(now)
        {
            return;
        }
        let mut holders: Vec<(String, Option<f64>)> = Vec::new();
        let mut shared: Option<Vec<f64>> = None;
        for (i, &room) in rooms.iter().enumerate() {
            let (Some(prefix), Some(features), Some(predicted)) =
                (self.prefixes[i], self.features[i], self.predicted[i])
            else {
                continue;
            };
            if features.waiting > 0.0 || self.hot[i] {
                continue;
            }
            let model = &self.candidates[i].model;
            let best = match holders.iter().find(|(m, _)| m == model) {
                Some((_, best)) => *best,
                None => {
                    let best = self.queued_best(picker, model);
                    holders.push((model.clone(), best));
                    best
                }
            };
            let Some(best) = best.filter(|&best| prefix.cached_tokens < best) else {
                continue;
            };
            let shared = shared.get_or_insert_with(|| {
                picker
                    .routes
                    .shared_blocks(hashes, now)
                    .into_iter()
                    .map(|blocks| units.of_estimate(blocks))
                    .collect()
            });
            let as_best = TtftFeatures {
                uncached_tokens: (prefix.prompt - best).max(0.0),
                ..features
            };
            let at_best = picker.ttft.predict(&self.states[i].ttft, &as_best);
            let reusers = reuse::reusers(shared, prefix.cached_tokens, best);
            let amortized = reuse::amortized(predicted, at_best, reusers);
            if amortized >= predicted {
                // No cheaper as a replica: the index need not be walked.
                continue;
            }
            let evicted = units.of_estimate(self.states[i].prefix.reused_evictions(hashes));
            let gap = best - prefix.cached_tokens;
            let evicts_now = reuse::eviction_cost(predicted, at_best, gap, evicted);
            if amortized + evicts_now < predicted {
                // Then also below its room-priced value, `predicted +
                // room`, which it replaces.
                let price = amortized + evicts_now.max(room);
                self.candidates[i].metrics.predicted_ttft = Some(price);
                self.seeds.push(i);
            }
        }
    }

    /// Per candidate, the [`RoomBounds`] of its model's local candidates
    /// (`None` for a provider). Per model, as for a replica
    /// ([`queued_best`](Self::queued_best)): a Pod serving only another
    /// model that holds the prompt (one system prompt for two models) says
    /// nothing of where this model's group is, and its load is not this
    /// model's Pods' load. A Pod serving two models is a candidate of each,
    /// and its one prefix index counts for both.
    fn room_bounds(&self) -> Vec<Option<RoomBounds>> {
        // Per model: the best cached prefix, and the loads scraped.
        let of_model = self.per_model(|(best, load, loaded): &mut (f64, f64, f64), i| {
            *best = best.max(self.prefixes[i].map_or(0.0, |p| p.cached_tokens));
            if let Some(f) = self.features[i] {
                *load += f.running + f.waiting;
                *loaded += 1.0;
            }
        });
        let bounds = |(best, load, loaded): (f64, f64, f64)| RoomBounds {
            best,
            full_above_load: if best <= 0.0 {
                load / loaded.max(1.0) + 1.0
            } else {
                f64::INFINITY
            },
        };
        of_model.into_iter().map(|m| m.map(bounds)).collect()
    }

    /// Per candidate, `add` folded over the local candidates of its model
    /// (`None` for a provider). A Pod serving two models is a candidate of
    /// each.
    fn per_model<T: Default + Copy>(&self, mut add: impl FnMut(&mut T, usize)) -> Vec<Option<T>> {
        let local = || (0..self.candidates.len()).filter(|&i| self.prefixes[i].is_some());
        let mut of_model: HashMap<&str, T> = HashMap::new();
        for i in local() {
            add(of_model.entry(&self.candidates[i].model).or_default(), i);
        }
        let mut folded = vec![None; self.candidates.len()];
        for i in local() {
            folded[i] = Some(of_model[self.candidates[i].model.as_str()]);
        }
        folded
    }

    /// Local candidates that carry a hot group: routed more than
    /// [`HOT_SHARE`] times the mean of the recent requests of the Pods
    /// serving the candidate's model, and at least [`HOT_MIN_ROUTES`] (so
    /// among two Pods, never). Several cold groups on one Pod would count
    /// too; what the rule reads is the Pod's share of the traffic, which a
    /// new group's would join. A hot group's Pod serves it from its
    /// cache: its engine shows few requests running and none waiting, and
    /// its cache has room, so by load and room it looks the best place for
    /// another group, whose requests would then queue behind the hot
    /// group's, and the hot group's behind their prefills (BENCHMARKS,
    /// issue 14: another group landed there in three hot-group reps of
    /// ten). Its share of the routes tells it apart. The engines' load did
    /// not: at a pool's start the Pods prefilling new groups run more
    /// requests than the hot group's, and a guard on load named them
    /// instead (BENCHMARKS, "Tried and reverted: no room for a copy on a
    /// busy Pod").
    ///
    /// `recent_routes` holds, per local candidate, the requests this EPP
    /// routed to its Pod lately, for every model the Pod serves; the mean
    /// is over the Pods the request may go to (a subset hint of one or two
    /// flags none).
    fn hot_carriers(&self, recent_routes: &[f64]) -> Vec<bool> {
        // Per model, its Pods' count and routes.
        let of_model = self.per_model(|(pods, routes): &mut (f64, f64), i| {
            *pods += 1.0;
            *routes += recent_routes[i];
        });
        let hot = |i: usize, (pods, total): (f64, f64)| {
            let routes = recent_routes[i];
            routes >= HOT_MIN_ROUTES && routes * pods > HOT_SHARE * total
        };
        let of_candidate = of_model.into_iter().enumerate();
        of_candidate
            .map(|(i, m)| m.is_some_and(|m| hot(i, m)))
            .collect()
    }

    /// The best cached prefix among the local candidates of `model`, if
    /// every one holding it has requests waiting in its engine, as scraped,
    /// and a model trained on its own answers: a replica pays only for a
    /// queue the engine reports, not for one the model guesses (the prior's
    /// is a quarter second a request).
    fn queued_best(&self, picker: &Picker, model: &str) -> Option<f64> {
        let trained = picker.ttft.config().min_endpoint_observations;
        let of_model = || {
            (0..self.candidates.len())
                .filter(|&i| self.candidates[i].model == model)
                .filter_map(|i| self.prefixes[i].map(|p| (i, p.cached_tokens)))
        };
        let best = of_model().map(|(_, cached)| cached).fold(0.0, f64::max);
        let queued = of_model()
            .filter(|&(_, cached)| cached >= best)
            .all(|(i, _)| {
                self.features[i].is_some_and(|f| f.waiting >= 1.0)
                    && picker.ttft.observations(&self.states[i].ttft) >= trained
            });
        (best > 0.0 && queued).then_some(best)
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
    use super::{
        CandidateSet, PrefixPrediction, PromptUnits, RoomBounds, events_or_routes, in_subset,
        lora_adapter,
    };
    use crate::predict::TtftFeatures;
    use kinference_policy::eval::{Candidate, PrefixSource};

    fn pod_view(
        running_loras: &[&str],
        stored_for: Option<&str>,
    ) -> crate::endpoints::EndpointView {
        use crate::endpoints::{Endpoint, ScrapedMetrics};
        use crate::kv_events::wire::{BlockStored, EngineBlock, EventBatch, KvEvent};
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

    /// Local candidates of `(model, cached tokens of a 100-token prompt,
    /// requests running)`, followed by a provider.
    fn set_of(local: &[(&str, f64, f64)]) -> CandidateSet {
        let mut candidates: Vec<Candidate> = local
            .iter()
            .map(|(model, _, _)| Candidate {
                model: model.to_string(),
                ..Candidate::default()
            })
            .collect();
        candidates.push(Candidate::default());
        let mut prefixes: Vec<_> = local
            .iter()
            .map(|&(_, cached, _)| {
                Some(PrefixPrediction {
                    cached_tokens: cached,
                    prompt: 100.0,
                    source: PrefixSource::Estimate,
                    block_size: None,
                    prompt_tokens: None,
                    estimated_prompt: 100,
                    index_block: 16.0,
                })
            })
            .collect();
        prefixes.push(None);
        let mut features: Vec<_> = local
            .iter()
            .map(|&(_, cached, running)| Some(TtftFeatures::new(0.0, running, 100.0, cached, 0.0)))
            .collect();
        features.push(None);
        CandidateSet {
            candidates,
            states: Vec::new(),
            features,
            predicted: vec![None; local.len() + 1],
            seeds: Vec::new(),
            prefixes,
            hot: Vec::new(),
        }
    }

    /// Which of `local`, candidates of `(model, recent routes)` followed
    /// by a provider, carry a hot group.
    fn hot_of(local: &[(&str, f64)]) -> Vec<bool> {
        let models: Vec<_> = local.iter().map(|&(model, _)| (model, 0.0, 0.0)).collect();
        let recent_routes: Vec<f64> = local.iter().map(|&(_, r)| r).collect();
        set_of(&models).hot_carriers(&recent_routes)
    }

    #[test]
    fn a_prompt_is_cached_nowhere_when_no_pod_of_its_model_holds_it() {
        // Model b's Pod holds the prompt (a system prompt both models
        // share) and runs 10 requests: model a's Pods hold none of it, and
        // a Pod of theirs has no room above 3, one request above their own
        // mean of 2.
        let set = set_of(&[("a", 0.0, 3.0), ("a", 0.0, 1.0), ("b", 100.0, 10.0)]);
        let a = RoomBounds {
            best: 0.0,
            full_above_load: 3.0,
        };
        let b = RoomBounds {
            best: 100.0,
            full_above_load: f64::INFINITY,
        };
        assert_eq!(set.room_bounds(), [Some(a), Some(a), Some(b), None]);
        // Among model a's Pods, the best-cached one sets the bound.
        let set = set_of(&[("a", 20.0, 3.0), ("a", 60.0, 1.0)]);
        let a = RoomBounds {
            best: 60.0,
            full_above_load: f64::INFINITY,
        };
        assert_eq!(set.room_bounds(), [Some(a), Some(a), None]);
    }

    #[test]
    fn a_pod_carries_a_hot_group_above_twice_its_models_mean() {
        let four = hot_of(&[("a", 60.0), ("a", 10.0), ("a", 10.0), ("a", 10.0)]);
        assert_eq!(four, [true, false, false, false, false]);
        // Among two Pods, more than twice the mean is more than both.
        let two = hot_of(&[("a", 60.0), ("a", 0.0)]);
        assert_eq!(two, [false, false, false]);
        // Too few routes to tell a hot group from a pool's first requests.
        let few = hot_of(&[("a", 7.0), ("a", 0.0), ("a", 0.0)]);
        assert_eq!(few, [false, false, false, false]);
    }

    #[test]
    fn a_pod_is_compared_with_its_own_models_pods() {
        // Model a's two Pods take most of the traffic, b's four little:
        // over all six, a's would both count as hot.
        let set = hot_of(&[
            ("a", 40.0),
            ("a", 40.0),
            ("b", 5.0),
            ("b", 5.0),
            ("b", 5.0),
            ("b", 5.0),
        ]);
        assert_eq!(set, [false; 7]);
        let one_hot_b = hot_of(&[("a", 40.0), ("b", 30.0), ("b", 1.0), ("b", 1.0)]);
        assert_eq!(one_hot_b, [false, true, false, false, false]);
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
