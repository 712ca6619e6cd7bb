//! The shared view of local endpoints that the request path reads on every
//! request.
//!
//! # Design
//!
//! Writers (discovery, the scraper) and readers (every request) meet here, and
//! readers vastly outnumber writers at high request rates, so reads must be an
//! atomic load and nothing more in the common case:
//!
//! * The endpoint set is an [`ArcSwap`]'d immutable `Table` (a list plus a
//!   name index). Membership changes, which are rare, copy the table under a
//!   writer mutex and swap it in.
//! * Each endpoint's latest metrics live in its own [`ArcSwapOption`] inside
//!   the table's slot, so the scraper (tens of writes per second per
//!   endpoint) never copies the table.
//! * [`EndpointRegistry::snapshot`] returns a cached `Arc<Vec<EndpointView>>`.
//!   The cache is rebuilt lazily, by the first reader that notices either that
//!   something changed (a version counter every write bumps) or that one of
//!   the cached metrics has since passed its staleness deadline. So the
//!   rebuild rate is bounded by both the write rate and the request rate, and
//!   staleness is still decided at snapshot time, exactly.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use tokio::sync::watch;

use crate::kv_cache::pool::PoolIndex;
use crate::predict::{DestinationConfig, DestinationState};
use kinference_runtime::sync::lock;

/// The smallest staleness window [`default_staleness`] hands out: shorter
/// windows would make metrics flap on ordinary scheduling jitter.
pub(crate) const MIN_STALENESS: Duration = Duration::from_millis(250);

/// The staleness window for a scrape interval: three missed scrapes, at least
/// [`MIN_STALENESS`].
pub(crate) fn default_staleness(scrape_interval: Duration) -> Duration {
    (scrape_interval * 3).max(MIN_STALENESS)
}

/// One model-server endpoint the EPP may route to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Unique key in the registry: the Pod name under discovery, or
    /// `<pod>-rank-<i>` when the pool has several target ports.
    pub name: String,
    /// The Pod (or standalone server) this endpoint belongs to: the policy's
    /// `endpoint` attribute, shared by a Pod's data-parallel ranks.
    pub pod: String,
    /// The Pod's UID: a Pod recreated under the same name and address is
    /// another endpoint, with a fresh state. `None` for standalone endpoints.
    pub uid: Option<String>,
    /// Kubernetes namespace; empty for standalone endpoints.
    pub namespace: String,
    /// Address the gateway should send traffic to.
    pub ip: IpAddr,
    /// Port the model server listens on.
    pub port: u16,
    /// Models (and LoRA adapters) this endpoint serves. Empty means "not known
    /// yet" (e.g. `/v1/models` has not answered): treat it as serving nothing.
    pub models: Vec<String>,
    /// Which of `models` are LoRA adapters, as the server's `/v1/models`
    /// says (an entry naming a parent model): known as adapters before any
    /// request has run them.
    pub adapters: Vec<String>,
    /// The serving stack / workload this endpoint belongs to (label
    /// `kinference.io/backend`, else the owning Deployment or StatefulSet).
    pub backend: Option<String>,
    /// Topology zone (`topology.kubernetes.io/zone`).
    pub zone: Option<String>,
    /// Kubernetes node name.
    pub node: Option<String>,
    /// All labels of the Pod (or of the standalone spec).
    pub labels: BTreeMap<String, String>,
}

impl Endpoint {
    /// `ip:port`, with IPv6 addresses in brackets, as the GIE protocol's
    /// `x-gateway-destination-endpoint` header expects.
    pub fn address(&self) -> String {
        std::net::SocketAddr::new(self.ip, self.port).to_string()
    }
}

/// Load metrics scraped from one endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct ScrapedMetrics {
    /// Requests queued, not yet running.
    pub waiting: f64,
    /// Requests being served.
    pub running: f64,
    /// KV-cache utilisation, 0..=1.
    pub kv_cache_usage: f64,
    /// LoRA adapters loaded and serving.
    pub running_loras: Vec<String>,
    /// LoRA adapters with requests waiting.
    pub waiting_loras: Vec<String>,
    /// How many adapters fit on the GPU at once.
    pub max_lora: Option<u32>,
    /// KV-cache block size in tokens (vLLM `cache_config_info`), if exposed.
    pub block_size: Option<u32>,
    /// Number of KV-cache blocks on the GPU (vLLM `cache_config_info`), if
    /// exposed.
    pub num_gpu_blocks: Option<u64>,
    /// When the scrape that produced these values finished: they are fresh
    /// from then until the registry's staleness has passed.
    pub scraped_at: Instant,
    /// When that scrape was sent: the values show every request the server
    /// had by then.
    pub sent_at: Instant,
}

impl ScrapedMetrics {
    /// All-zero metrics of a scrape sent and finished at `scraped_at`; handy
    /// for tests and struct-update syntax.
    pub fn empty(scraped_at: Instant) -> Self {
        Self {
            waiting: 0.0,
            running: 0.0,
            kv_cache_usage: 0.0,
            running_loras: Vec::new(),
            waiting_loras: Vec::new(),
            max_lora: None,
            block_size: None,
            num_gpu_blocks: None,
            scraped_at,
            sent_at: scraped_at,
        }
    }
}

/// One endpoint as the request path sees it.
#[derive(Clone)]
pub struct EndpointView {
    /// The endpoint itself (shared, never copied per request).
    pub endpoint: Arc<Endpoint>,
    /// What the EPP has learnt about it (stats, prefixes, TTFT model).
    pub state: Arc<DestinationState>,
    /// Latest metrics; `None` when never scraped or older than the registry's
    /// staleness window.
    pub metrics: Option<ScrapedMetrics>,
}

/// One registry entry: the endpoint, its independently updated metrics and
/// everything learnt about it, all dropped together when the endpoint goes.
struct Slot {
    endpoint: Arc<Endpoint>,
    metrics: ArcSwapOption<ScrapedMetrics>,
    state: Arc<DestinationState>,
}

/// Immutable endpoint table, swapped whole on membership changes.
#[derive(Default)]
struct Table {
    slots: Vec<Arc<Slot>>,
    by_name: HashMap<String, usize>,
}

impl Table {
    fn build(slots: Vec<Arc<Slot>>) -> Self {
        let by_name = slots
            .iter()
            .enumerate()
            .map(|(i, s)| (s.endpoint.name.clone(), i))
            .collect();
        Self { slots, by_name }
    }

    fn get(&self, name: &str) -> Option<&Arc<Slot>> {
        self.by_name.get(name).map(|&i| &self.slots[i])
    }
}

/// A built snapshot and the conditions under which it is still exact.
struct Cached {
    /// Registry version the snapshot was built from.
    version: u64,
    /// The earliest instant at which a metric inside turns stale; `None` when
    /// no metric inside can expire.
    valid_until: Option<Instant>,
    views: Arc<Vec<EndpointView>>,
}

/// The shared endpoint registry. Create with [`EndpointRegistry::new`] and
/// share the returned `Arc`.
pub struct EndpointRegistry {
    staleness: Duration,
    destinations: DestinationConfig,
    table: ArcSwap<Table>,
    /// Serialises table writers so concurrent upserts do not lose each other.
    write_lock: Mutex<()>,
    /// Bumped (after the change is visible) by every write, metrics included.
    version: AtomicU64,
    cache: ArcSwap<Cached>,
    synced: AtomicBool,
    /// Endpoint-set generation: bumped on endpoint changes, not on metrics.
    generation: watch::Sender<u64>,
    /// Which Pods' engines hold each block (precise prefix mode), kept by
    /// the Pods' own indexes.
    kv_pool: Arc<PoolIndex>,
}

impl std::fmt::Debug for EndpointRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointRegistry")
            .field("staleness", &self.staleness)
            .field("endpoints", &self.table.load().slots.len())
            .field("synced", &self.synced())
            .finish()
    }
}

impl EndpointRegistry {
    /// An empty, not yet synced registry whose metrics expire `staleness`
    /// after their scrape.
    pub fn new(staleness: Duration) -> Arc<Self> {
        Arc::new(Self {
            staleness,
            destinations: DestinationConfig::default(),
            kv_pool: Arc::default(),
            table: ArcSwap::from_pointee(Table::default()),
            write_lock: Mutex::new(()),
            version: AtomicU64::new(1),
            // Version 0 never matches, so the first snapshot builds.
            cache: ArcSwap::from_pointee(Cached {
                version: 0,
                valid_until: None,
                views: Arc::new(Vec::new()),
            }),
            synced: AtomicBool::new(false),
            generation: watch::channel(0).0,
        })
    }

    /// All endpoints with their fresh metrics. Cheap: an atomic load unless
    /// something changed or a metric expired since the last call.
    pub fn snapshot(&self) -> Arc<Vec<EndpointView>> {
        let now = Instant::now();
        let cached = self.cache.load();
        if cached.version == self.version.load(Ordering::Acquire)
            && cached.valid_until.is_none_or(|t| now < t)
        {
            return Arc::clone(&cached.views);
        }
        drop(cached);
        self.rebuild(now)
    }

    fn rebuild(&self, now: Instant) -> Arc<Vec<EndpointView>> {
        // Read the version first: a write racing with the build then leaves
        // the cache one version behind, and the next reader rebuilds again.
        let version = self.version.load(Ordering::Acquire);
        let table = self.table.load();
        let mut valid_until: Option<Instant> = None;
        let views: Vec<EndpointView> = table
            .slots
            .iter()
            .map(|slot| {
                let metrics = slot.metrics.load();
                let metrics = metrics.as_deref().and_then(|m| {
                    let expires = m.scraped_at + self.staleness;
                    (now < expires).then(|| {
                        valid_until = Some(valid_until.map_or(expires, |t| t.min(expires)));
                        m.clone()
                    })
                });
                EndpointView {
                    endpoint: Arc::clone(&slot.endpoint),
                    state: Arc::clone(&slot.state),
                    metrics,
                }
            })
            .collect();
        let views = Arc::new(views);
        self.cache.store(Arc::new(Cached {
            version,
            valid_until,
            views: Arc::clone(&views),
        }));
        views
    }

    /// The endpoints alone (no metrics), e.g. for the scraper.
    pub fn endpoints(&self) -> Vec<Arc<Endpoint>> {
        self.table
            .load()
            .slots
            .iter()
            .map(|s| Arc::clone(&s.endpoint))
            .collect()
    }

    /// Looks one endpoint up by name.
    pub fn get(&self, name: &str) -> Option<Arc<Endpoint>> {
        self.table.load().get(name).map(|s| Arc::clone(&s.endpoint))
    }

    /// Number of endpoints.
    pub fn len(&self) -> usize {
        self.table.load().slots.len()
    }

    /// Whether there are no endpoints.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Replaces the whole endpoint set (after a full discovery listing).
    /// Metrics survive for endpoints whose name and address are unchanged.
    pub fn replace_all(&self, eps: Vec<Endpoint>) {
        let _guard = lock(&self.write_lock);
        let old = self.table.load();
        // Later duplicates win, keeping names unique.
        let last: HashMap<&str, usize> = eps
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.as_str(), i))
            .collect();
        let keep: Vec<bool> = eps
            .iter()
            .enumerate()
            .map(|(i, e)| last.get(e.name.as_str()) == Some(&i))
            .collect();
        drop(last);
        let mut changed = false;
        let slots: Vec<Arc<Slot>> = eps
            .into_iter()
            .zip(keep)
            .filter(|(_, keep)| *keep)
            .map(|(ep, _)| match old.get(&ep.name) {
                Some(prev) if *prev.endpoint == ep => Arc::clone(prev),
                Some(prev) => {
                    changed = true;
                    Arc::new(self.carry_over(prev, ep))
                }
                None => {
                    changed = true;
                    Arc::new(self.new_slot(ep))
                }
            })
            .collect();
        // Same length and every slot reused means the same (unique) names.
        changed |= slots.len() != old.slots.len();
        if changed {
            self.table.store(Arc::new(Table::build(slots)));
            self.bump(true);
        }
    }

    /// Adds an endpoint or updates the one with the same name. Updating with
    /// an identical endpoint is a no-op; metrics survive unless the address
    /// changed.
    pub fn upsert(&self, ep: Endpoint) {
        let _guard = lock(&self.write_lock);
        let old = self.table.load();
        let mut slots = old.slots.clone();
        match old.by_name.get(&ep.name) {
            Some(&i) if *slots[i].endpoint == ep => return,
            Some(&i) => slots[i] = Arc::new(self.carry_over(&slots[i], ep)),
            None => slots.push(Arc::new(self.new_slot(ep))),
        }
        self.table.store(Arc::new(Table::build(slots)));
        self.bump(true);
    }

    /// Removes the endpoint with this name, if any.
    pub fn remove(&self, name: &str) {
        let _guard = lock(&self.write_lock);
        let old = self.table.load();
        if !old.by_name.contains_key(name) {
            return;
        }
        let slots = old
            .slots
            .iter()
            .filter(|s| s.endpoint.name != name)
            .cloned()
            .collect();
        self.table.store(Arc::new(Table::build(slots)));
        self.bump(true);
    }

    /// Records fresh metrics for an endpoint; ignored for unknown names.
    pub fn set_metrics(&self, name: &str, m: ScrapedMetrics) {
        if let Some(slot) = self.table.load().get(name) {
            self.scraped(slot, m);
        }
    }

    /// Like [`set_metrics`](Self::set_metrics), but only while the endpoint
    /// still has `address`: a scrape that raced with an address change must
    /// not attach the old server's load to the new one.
    pub(crate) fn set_metrics_at(&self, name: &str, address: &Endpoint, m: ScrapedMetrics) {
        if let Some(slot) = self.table.load().get(name)
            && slot.endpoint.ip == address.ip
            && slot.endpoint.port == address.port
        {
            self.scraped(slot, m);
        }
    }

    /// Records that discovery has completed one full listing.
    pub fn mark_synced(&self) {
        self.synced.store(true, Ordering::Release);
    }

    /// Whether discovery has completed one full listing (gates `/readyz`).
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// Waits until every endpoint has fresh metrics, so metric objectives have
    /// values from the first request on. False if `timeout` passes first.
    pub async fn wait_until_scraped(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.snapshot().iter().all(|v| v.metrics.is_some()) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A receiver of the endpoint-set generation, bumped whenever an endpoint
    /// is added, changed or removed (not on metrics updates).
    pub fn changed(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// The new values are stored before the reservations they take over
    /// from are released. A decision reads its endpoints' values when it
    /// starts and their reservations a few microseconds later, so one that
    /// spans this call may still see the old values without the
    /// reservations: that window is those microseconds, not a scrape's
    /// round trip.
    fn scraped(&self, slot: &Slot, m: ScrapedMetrics) {
        let (blocks, block_size, sent_at) = (m.num_gpu_blocks, m.block_size, m.sent_at);
        slot.metrics.store(Some(Arc::new(m)));
        self.bump(false);
        slot.state.scraped(blocks, block_size, sent_at);
    }

    fn bump(&self, endpoints_changed: bool) {
        self.version.fetch_add(1, Ordering::AcqRel);
        if endpoints_changed {
            self.generation.send_modify(|g| *g += 1);
        }
    }
}

impl EndpointRegistry {
    /// Which Pods' engines hold each block, for matching a prompt against
    /// every Pod at once.
    pub fn kv_pool(&self) -> &PoolIndex {
        &self.kv_pool
    }

    fn new_slot(&self, ep: Endpoint) -> Slot {
        Slot {
            endpoint: Arc::new(ep),
            metrics: ArcSwapOption::empty(),
            state: DestinationState::in_pool(&self.destinations, &self.kv_pool),
        }
    }

    /// A new slot for an updated endpoint. The same server (address and Pod
    /// UID unchanged: only labels or models changed) keeps its metrics and
    /// state; another server behind the name starts clean.
    fn carry_over(&self, prev: &Slot, ep: Endpoint) -> Slot {
        let same = prev.endpoint.ip == ep.ip
            && prev.endpoint.port == ep.port
            && prev.endpoint.uid == ep.uid;
        if !same {
            return self.new_slot(ep);
        }
        Slot {
            endpoint: Arc::new(ep),
            metrics: ArcSwapOption::new(prev.metrics.load_full()),
            state: Arc::clone(&prev.state),
        }
    }

    /// The state of the endpoint at `address` (`ip:port`), e.g. the one a
    /// gateway reports as having served a request.
    pub fn state_at(&self, address: &str) -> Option<Arc<DestinationState>> {
        self.table
            .load()
            .slots
            .iter()
            .find(|s| s.endpoint.address() == address)
            .map(|s| Arc::clone(&s.state))
    }

    /// The states of every endpoint on `ip` (a Pod's KV events name its IP,
    /// not a port).
    pub(crate) fn states_on_ip(&self, ip: std::net::IpAddr) -> Vec<Arc<DestinationState>> {
        self.table
            .load()
            .slots
            .iter()
            .filter(|s| s.endpoint.ip == ip)
            .map(|s| Arc::clone(&s.state))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(name: &str, port: u16) -> Endpoint {
        Endpoint {
            name: name.into(),
            pod: name.into(),
            uid: None,
            namespace: "ns".into(),
            ip: "10.0.0.1".parse().unwrap(),
            port,
            models: vec!["m".into()],
            adapters: Vec::new(),
            backend: None,
            zone: None,
            node: None,
            labels: BTreeMap::new(),
        }
    }

    fn metrics(waiting: f64) -> ScrapedMetrics {
        ScrapedMetrics {
            waiting,
            ..ScrapedMetrics::empty(Instant::now())
        }
    }

    #[test]
    fn a_pod_recreated_on_the_same_address_starts_with_an_empty_kv_index() {
        use crate::kv_cache::wire::{BlockStored, EngineBlock, EventBatch, KvEvent};
        let reg = EndpointRegistry::new(Duration::from_secs(1));
        let first = Endpoint {
            uid: Some("uid-1".into()),
            ..ep("vllm-0", 8000)
        };
        reg.replace_all(vec![first.clone()]);
        let stored = KvEvent::Stored(BlockStored {
            block_hashes: vec![EngineBlock(7)],
            parent: None,
            token_ids: (0..16).collect(),
            block_size: 16,
            lora_name: None,
            medium: None,
            has_extra_keys: false,
            group_idx: None,
        });
        let batch = EventBatch {
            ts: 0.0,
            events: vec![stored],
            data_parallel_rank: None,
        };
        reg.state_at("10.0.0.1:8000").unwrap().kv.apply(0, &batch);
        reg.replace_all(vec![first]);
        assert_eq!(
            reg.state_at("10.0.0.1:8000").unwrap().kv.len(),
            1,
            "the same Pod keeps it"
        );
        let recreated = Endpoint {
            uid: Some("uid-2".into()),
            ..ep("vllm-0", 8000)
        };
        reg.replace_all(vec![recreated]);
        let state = reg.state_at("10.0.0.1:8000").unwrap();
        assert!(state.kv.is_empty());
        assert_eq!(state.kv.freshness(), crate::kv_cache::Freshness::Empty);
    }

    #[test]
    fn address_brackets_ipv6() {
        let mut e = ep("a", 8000);
        assert_eq!(e.address(), "10.0.0.1:8000");
        e.ip = "fd00::1".parse().unwrap();
        assert_eq!(e.address(), "[fd00::1]:8000");
    }

    #[test]
    fn default_staleness_has_floor() {
        assert_eq!(default_staleness(Duration::from_millis(50)), MIN_STALENESS);
        assert_eq!(
            default_staleness(Duration::from_secs(1)),
            Duration::from_secs(3)
        );
    }

    #[test]
    fn upsert_remove_and_snapshot() {
        let r = EndpointRegistry::new(Duration::from_secs(60));
        assert!(r.snapshot().is_empty());
        r.upsert(ep("a", 1));
        r.upsert(ep("b", 2));
        let s = r.snapshot();
        assert_eq!(s.len(), 2);
        assert!(s.iter().all(|v| v.metrics.is_none()));
        // Unchanged reads share the cached vector.
        assert!(Arc::ptr_eq(&s, &r.snapshot()));
        r.set_metrics("a", metrics(3.0));
        r.set_metrics("zzz", metrics(9.0)); // unknown: ignored
        let s = r.snapshot();
        let a = s.iter().find(|v| v.endpoint.name == "a").unwrap();
        assert_eq!(a.metrics.as_ref().unwrap().waiting, 3.0);
        r.remove("a");
        r.remove("a");
        let s = r.snapshot();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].endpoint.name, "b");
        assert_eq!(r.get("b").unwrap().port, 2);
        assert!(r.get("a").is_none());
    }

    /// Everything learnt about a server: a failure streak that opens its
    /// breaker, a recorded prefix and a TTFT sample.
    fn learn_things(state: &DestinationState) {
        let now = Instant::now();
        for _ in 0..10 {
            state
                .stats
                .record_outcome(crate::predict::Outcome::Failure, now);
        }
        state.prefix.record(&[1, 2, 3]);
        state.stats.record_ttft(Duration::from_millis(900), now);
        assert!(state.stats.is_open(now));
    }

    fn starts_clean(state: &DestinationState) -> bool {
        let now = Instant::now();
        let s = state.stats.snapshot(now);
        !s.breaker_open
            && s.error_rate == 0.0
            && s.observed_ttft.is_none()
            && state.prefix.cached_blocks(&[1, 2, 3]) == 0
    }

    #[test]
    fn a_new_pod_on_a_dead_pods_address_starts_clean() {
        let r = EndpointRegistry::new(Duration::from_secs(60));
        let mut old = ep("vllm-0", 8000);
        old.uid = Some("uid-1".into());
        r.upsert(old.clone());
        learn_things(&r.state_at("10.0.0.1:8000").unwrap());
        // Deleted, then another Pod gets the IP.
        r.remove("vllm-0");
        r.upsert(ep("vllm-7", 8000));
        assert!(starts_clean(&r.state_at("10.0.0.1:8000").unwrap()));
        // Same name and IP, new UID (a StatefulSet Pod recreated while the
        // watch was down, seen only in the relist): clean as well.
        learn_things(&r.state_at("10.0.0.1:8000").unwrap());
        r.replace_all(vec![old.clone()]);
        learn_things(&r.state_at("10.0.0.1:8000").unwrap());
        let mut recreated = old.clone();
        recreated.uid = Some("uid-2".into());
        r.replace_all(vec![recreated]);
        assert!(starts_clean(&r.state_at("10.0.0.1:8000").unwrap()));
    }

    #[test]
    fn the_same_pod_keeps_its_state_across_label_changes() {
        let r = EndpointRegistry::new(Duration::from_secs(60));
        r.upsert(ep("a", 1));
        learn_things(&r.state_at("10.0.0.1:1").unwrap());
        let mut e = ep("a", 1);
        e.labels.insert("tier".into(), "gold".into());
        r.upsert(e);
        assert!(!starts_clean(&r.state_at("10.0.0.1:1").unwrap()));
    }

    #[test]
    fn the_prefix_cache_is_sized_from_the_scraped_kv_cache() {
        let r = EndpointRegistry::new(Duration::from_secs(60));
        r.upsert(ep("a", 1));
        let state = r.state_at("10.0.0.1:1").unwrap();
        assert_eq!(
            state.prefix.capacity(),
            crate::predict::DEFAULT_BLOCKS_PER_ENDPOINT
        );
        // 384 vLLM blocks of 16 tokens: 6,144 tokens, 384 blocks of ~16.
        r.set_metrics(
            "a",
            ScrapedMetrics {
                num_gpu_blocks: Some(384),
                block_size: Some(16),
                ..metrics(0.0)
            },
        );
        assert_eq!(state.prefix.capacity(), 384);
        // Metrics without the cache config leave the size alone.
        r.set_metrics("a", metrics(1.0));
        assert_eq!(state.prefix.capacity(), 384);
    }

    #[test]
    fn state_is_dropped_with_its_endpoint_under_churn() {
        let r = EndpointRegistry::new(Duration::from_secs(60));
        let prompt: Vec<u64> = (0..64).collect();
        let mut gone = Vec::new();
        for i in 0..10_000u32 {
            let mut e = ep(&format!("pod-{i}"), 8000);
            e.ip = std::net::Ipv4Addr::from(0x0a00_0000 + (i % 50)).into();
            e.uid = Some(format!("uid-{i}"));
            let address = e.address();
            r.upsert(e);
            let state = r.state_at(&address).unwrap();
            state.prefix.record(&prompt);
            gone.push(Arc::downgrade(&state));
            drop(state);
            // At most 20 Pods live at once.
            if i >= 20 {
                r.remove(&format!("pod-{}", i - 20));
            }
        }
        assert_eq!(r.len(), 20);
        let alive = gone.iter().filter(|w| w.strong_count() > 0).count();
        assert_eq!(alive, 20, "the state of every removed Pod is freed");
        let blocks: usize = r.snapshot().iter().map(|v| v.state.prefix.len()).sum();
        assert_eq!(blocks, 20 * 64, "only live Pods hold prefix blocks");
    }

    #[test]
    fn metrics_survive_label_change_but_not_address_change() {
        let r = EndpointRegistry::new(Duration::from_secs(60));
        r.upsert(ep("a", 1));
        r.set_metrics("a", metrics(1.0));
        let mut e = ep("a", 1);
        e.models.push("lora".into());
        r.upsert(e);
        assert!(r.snapshot()[0].metrics.is_some());
        assert_eq!(r.snapshot()[0].endpoint.models.len(), 2);
        r.upsert(ep("a", 2));
        assert!(r.snapshot()[0].metrics.is_none());
        // A scrape of the old address arriving late is dropped.
        r.set_metrics_at("a", &ep("a", 1), metrics(5.0));
        assert!(r.snapshot()[0].metrics.is_none());
        r.set_metrics_at("a", &ep("a", 2), metrics(5.0));
        assert!(r.snapshot()[0].metrics.is_some());
    }

    #[test]
    fn replace_all_keeps_unchanged_metrics() {
        let r = EndpointRegistry::new(Duration::from_secs(60));
        r.replace_all(vec![ep("a", 1), ep("b", 2)]);
        r.set_metrics("a", metrics(1.0));
        r.set_metrics("b", metrics(2.0));
        let gen_before = *r.changed().borrow();
        r.replace_all(vec![ep("a", 1), ep("b", 2)]);
        assert_eq!(
            *r.changed().borrow(),
            gen_before,
            "identical set is a no-op"
        );
        r.replace_all(vec![ep("a", 1), ep("b", 3), ep("c", 4)]);
        assert!(*r.changed().borrow() > gen_before);
        let s = r.snapshot();
        let names: Vec<_> = s.iter().map(|v| v.endpoint.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert!(s[0].metrics.is_some());
        assert!(s[1].metrics.is_none());
        assert!(s[2].metrics.is_none());
        // Duplicate names: the later one wins.
        r.replace_all(vec![ep("a", 1), ep("b", 2), ep("a", 9)]);
        let s = r.snapshot();
        assert_eq!(s.len(), 2);
        assert_eq!(r.get("a").unwrap().port, 9);
        assert_eq!(r.get("b").unwrap().port, 2);
    }

    #[test]
    fn metrics_go_stale_at_snapshot_time() {
        let r = EndpointRegistry::new(Duration::from_millis(200));
        r.upsert(ep("a", 1));
        r.upsert(ep("b", 2));
        r.set_metrics("a", metrics(1.0));
        std::thread::sleep(Duration::from_millis(120));
        r.set_metrics("b", metrics(2.0));
        let s = r.snapshot();
        assert!(s[1].metrics.is_some());
        // Nothing is written any more; `a` expires first, then `b`.
        std::thread::sleep(Duration::from_millis(100));
        let s = r.snapshot();
        assert!(s[0].metrics.is_none(), "a is stale");
        assert!(s[1].metrics.is_some(), "b is still fresh");
        std::thread::sleep(Duration::from_millis(120));
        assert!(r.snapshot().iter().all(|v| v.metrics.is_none()));
        // Fresh metrics revive it.
        r.set_metrics("a", metrics(4.0));
        assert_eq!(r.snapshot()[0].metrics.as_ref().unwrap().waiting, 4.0);
    }

    #[test]
    fn already_stale_metrics_are_hidden() {
        let r = EndpointRegistry::new(Duration::from_millis(10));
        r.upsert(ep("a", 1));
        let old = Instant::now()
            .checked_sub(Duration::from_secs(1))
            .unwrap_or_else(Instant::now);
        r.set_metrics("a", ScrapedMetrics::empty(old));
        std::thread::sleep(Duration::from_millis(15));
        assert!(r.snapshot()[0].metrics.is_none());
    }

    #[test]
    fn synced_and_generation() {
        let r = EndpointRegistry::new(Duration::from_secs(1));
        assert!(!r.synced());
        r.mark_synced();
        assert!(r.synced());
        let mut rx = r.changed();
        let g0 = *rx.borrow_and_update();
        r.set_metrics("a", metrics(1.0));
        assert!(!rx.has_changed().unwrap());
        r.upsert(ep("a", 1));
        assert!(rx.has_changed().unwrap());
        assert!(*rx.borrow_and_update() > g0);
        r.set_metrics("a", metrics(1.0));
        assert!(
            !rx.has_changed().unwrap(),
            "metrics do not bump the generation"
        );
    }

    #[test]
    fn concurrent_writers_and_readers() {
        let r = EndpointRegistry::new(Duration::from_secs(60));
        std::thread::scope(|s| {
            for t in 0..4u16 {
                let r = &r;
                s.spawn(move || {
                    for i in 0..50u16 {
                        r.upsert(ep(&format!("e{t}-{i}"), i));
                        r.set_metrics(&format!("e{t}-{i}"), metrics(i.into()));
                        let _ = r.snapshot();
                    }
                });
            }
        });
        let s = r.snapshot();
        assert_eq!(s.len(), 200);
        assert!(s.iter().all(|v| v.metrics.is_some()));
    }
}
