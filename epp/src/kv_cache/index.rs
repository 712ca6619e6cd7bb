//! What one Pod's engines hold, rebuilt from their KV-cache events.
//!
//! The engine's own block hashes cannot be reproduced here (vLLM hashes with
//! sha256 over its own keys, other engines differently), so every stored
//! block is re-hashed into our own chain over its token ids: equal chain
//! hashes mean equal token prefixes. A request's prompt, tokenized the way
//! the engine tokenizes it, is hashed into the same chain and matched block
//! by block. What must agree with the engine is therefore the token ids and
//! the block size, not the hash algorithm.
//!
//! An index lives in its Pod's registry slot and is dropped with it, so a
//! Pod recreated on the same IP starts empty. Its memory is bounded: past
//! its capacity the oldest stored blocks are forgotten (the engine, whose
//! cache is that size, has most likely evicted them too).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::pool::PoolIndex;
use super::wire::{BlockStored, EngineBlock, EventBatch, KvEvent};
use kinference_runtime::sync::lock;

/// A Pod that has published nothing for this long since it was sent a
/// request has most likely stopped publishing (an engine stores blocks at
/// every prefill, and every block of generated tokens).
pub const SILENCE: Duration = Duration::from_secs(10);

/// Blocks an index remembers per engine until the Pod's metrics say how
/// large its KV cache is.
pub(crate) const DEFAULT_CAPACITY: usize = 65_536;

/// Adapter names an index remembers: a vLLM serves a few dozen at most
/// (`--max-loras`, `--max-cpu-loras`).
const MAX_ADAPTERS: usize = 256;

/// The highest sequence number an engine's first batch can have: vLLM
/// numbers from 0, llm-d-inference-sim from 1. An engine first heard at a
/// later one published before this index subscribed (a new EPP replica, or
/// one restarted while its engines kept running).
const FIRST_SEQ: u64 = 1;

/// The parent llm-d-inference-sim gives a sequence's first block.
const NO_PARENT: EngineBlock = EngineBlock(0);

/// Per-process random seed of the token chain: prompts are
/// attacker-controlled, so nobody can craft colliding blocks.
pub(super) fn chain_seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(rand::random::<u64>)
}

/// The chain's root for a base model (`None`) or a LoRA adapter: blocks of
/// different adapters never match each other.
pub(crate) fn chain_root(lora: Option<&str>) -> u64 {
    xxh3_64_with_seed(lora.unwrap_or("").as_bytes(), chain_seed())
}

/// The next link of the chain: `parent` followed by one block of tokens.
fn link(parent: u64, tokens: &[u32], buf: &mut Vec<u8>) -> u64 {
    buf.clear();
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(buf, parent)
}

/// Fills `out` with the chain hashes of `tokens`' full blocks of
/// `block_size`, at most `max_blocks` of them.
pub(crate) fn token_chain(
    root: u64,
    tokens: &[u32],
    block_size: usize,
    max_blocks: usize,
    out: &mut Vec<u64>,
) {
    out.clear();
    if block_size == 0 {
        return;
    }
    let mut buf = Vec::with_capacity(block_size * 4);
    let mut prev = root;
    for block in tokens.chunks_exact(block_size).take(max_blocks) {
        prev = link(prev, block, &mut buf);
        out.push(prev);
    }
}

/// What applying one batch found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub stored: u64,
    pub removed: u64,
    /// Blocks stored after a parent this index does not know (a missed
    /// event, or forgotten past capacity): kept so that their removal and
    /// their children are recognised, but never matched.
    pub orphaned: u64,
    /// Blocks outside the GPU prefix cache of the first KV group (another
    /// medium, another group, extra keys such as images): not matched.
    pub skipped: u64,
    /// `BlockStored` whose token count is not a whole number of blocks.
    pub malformed: u64,
    pub cleared: bool,
    /// This batch followed a sequence gap and left a live index stale.
    pub became_stale: bool,
    /// This batch was the first heard of an engine that had published
    /// before, and the earlier ones were not replayed.
    pub joined_late: bool,
}

/// One engine (one data-parallel rank of a Pod), with its own event
/// sequence: vLLM numbers each rank's batches separately.
struct Engine {
    /// The engine's key → our chain hash; `None`: known but not matchable.
    by_engine: HashMap<EngineBlock, Option<u64>>,
    /// Our chain hash → how many engine blocks hold it.
    held: HashMap<u64, u32>,
    /// Stored keys, oldest first (may hold keys removed since).
    order: VecDeque<EngineBlock>,
    block_size: Option<u32>,
    /// The sequence number the next batch should have.
    next_seq: u64,
    /// Batches were lost (a gap with no replay): what `held` says may be
    /// wrong until the engine clears its cache.
    stale: bool,
    /// The index joined after the engine's first batch and could not
    /// replay the earlier ones: `held` is right but incomplete (it lacks
    /// what was stored before, such as a hot prefix hit ever since) until
    /// the engine clears its cache.
    partial: bool,
    /// The pool's index `held` is mirrored into, and this engine's slot.
    pool: Arc<PoolIndex>,
    slot: u32,
}

impl Drop for Engine {
    /// The engine's bits leave the pool with it, and its slot is freed.
    fn drop(&mut self) {
        self.unpool_all();
        self.pool.free_slot(self.slot);
    }
}

impl Engine {
    /// An engine whose first batch is `seq`.
    fn new(pool: &Arc<PoolIndex>, seq: u64) -> Engine {
        Engine {
            by_engine: HashMap::new(),
            held: HashMap::new(),
            order: VecDeque::new(),
            block_size: None,
            next_seq: seq,
            stale: false,
            partial: seq > FIRST_SEQ,
            pool: Arc::clone(pool),
            slot: pool.take_slot(),
        }
    }

    fn hold(&mut self, h: u64) {
        let count = self.held.entry(h).or_default();
        *count += 1;
        if *count == 1 {
            self.pool.add(h, self.slot);
        }
    }

    fn release(&mut self, h: u64) {
        let Some(count) = self.held.get_mut(&h) else {
            return;
        };
        *count -= 1;
        if *count == 0 {
            self.held.remove(&h);
            self.pool.remove(h, self.slot);
        }
    }

    fn unpool_all(&mut self) {
        for h in self.held.keys() {
            self.pool.remove(*h, self.slot);
        }
    }

    fn store(&mut self, s: &BlockStored, cap: usize, applied: &mut Applied) {
        let n = s.block_hashes.len();
        let bs = s.block_size as usize;
        if bs == 0 || s.token_ids.len() != n * bs {
            applied.malformed += 1;
            return;
        }
        let matchable = s.medium.as_deref().is_none_or(|m| m == "GPU")
            && s.group_idx.unwrap_or(0) == 0
            && !s.has_extra_keys;
        let mut parent = match s.parent {
            // llm-d-inference-sim writes 0, not nil, for "no parent"; a
            // real block hashing to 0 is a 2^-64 chance.
            None | Some(NO_PARENT) => Some(chain_root(s.lora_name.as_deref())),
            Some(p) => match self.by_engine.get(&p) {
                Some(own) => *own,
                None => {
                    applied.orphaned += n as u64;
                    None
                }
            },
        };
        if !matchable {
            applied.skipped += n as u64;
            parent = None;
        }
        self.block_size = Some(s.block_size);
        let mut buf = Vec::with_capacity(bs * 4);
        for (key, tokens) in s.block_hashes.iter().zip(s.token_ids.chunks_exact(bs)) {
            let own = parent.map(|p| link(p, tokens, &mut buf));
            self.forget(*key);
            self.by_engine.insert(*key, own);
            if let Some(h) = own {
                self.hold(h);
            }
            self.order.push_back(*key);
            parent = own;
            applied.stored += 1;
        }
        self.bound(cap);
    }

    /// Drops `key`, if held.
    fn forget(&mut self, key: EngineBlock) -> bool {
        let Some(own) = self.by_engine.remove(&key) else {
            return false;
        };
        if let Some(h) = own {
            self.release(h);
        }
        true
    }

    /// Forgets the oldest blocks past `cap`, and compacts the order queue
    /// when removals left it mostly stale.
    fn bound(&mut self, cap: usize) {
        while self.by_engine.len() > cap {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            self.forget(oldest);
        }
        if self.order.len() > 2 * self.by_engine.len() + 1024 {
            let by_engine = &self.by_engine;
            self.order.retain(|k| by_engine.contains_key(k));
        }
    }

    fn clear(&mut self) {
        self.unpool_all();
        self.by_engine.clear();
        self.held.clear();
        self.order.clear();
    }
}

/// Where the index stands with its event stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    /// No event yet.
    Empty,
    /// Every event since the engine's first was applied.
    Live,
    /// Every event since the index joined was applied, but the engine
    /// published before that: the blocks it stored earlier are missing.
    Partial,
    /// Events were lost (a sequence gap with no replay): what the index
    /// holds may be wrong until the engine clears its cache.
    Stale,
}

/// Whether the picker may match prompts against a Pod's index now, and if
/// not, why (it then counts the Pod's prefix from the estimate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexUse {
    /// Used.
    Live,
    /// Used with the estimate: a Pod's cached prefix is the longer of the
    /// two, since each knows blocks the other does not (the index joined
    /// late, [`Freshness::Partial`]).
    Partial,
    /// Nothing published yet.
    Empty,
    /// Events were lost and not replayed.
    Stale,
    /// Live, but nothing published for [`SILENCE`] since the Pod was sent a
    /// request: its events have most likely stopped.
    Silent,
}

impl IndexUse {
    pub fn as_str(self) -> &'static str {
        match self {
            IndexUse::Live => "live",
            IndexUse::Partial => "partial",
            IndexUse::Empty => "empty",
            IndexUse::Stale => "stale",
            IndexUse::Silent => "silent",
        }
    }
}

struct Inner {
    /// Per data-parallel rank (`None`: no data parallelism).
    engines: HashMap<Option<u32>, Engine>,
    /// LoRA adapters the Pod's engines stored blocks for, at most
    /// [`MAX_ADAPTERS`]: a request naming one is matched in its chain.
    adapters: std::collections::BTreeSet<String>,
    /// The first request routed to the Pod since its last event.
    awaiting_since: Option<Instant>,
    cap: usize,
}

impl Inner {
    fn freshness(&self) -> Freshness {
        if self.engines.is_empty() {
            Freshness::Empty
        } else if self.engines.values().any(|e| e.stale) {
            Freshness::Stale
        } else if self.engines.values().any(|e| e.partial) {
            Freshness::Partial
        } else {
            Freshness::Live
        }
    }

    fn usable(&self, now: Instant) -> bool {
        matches!(self.usage(now), IndexUse::Live | IndexUse::Partial)
    }

    fn usage(&self, now: Instant) -> IndexUse {
        match self.freshness() {
            Freshness::Empty => IndexUse::Empty,
            Freshness::Stale => IndexUse::Stale,
            Freshness::Live | Freshness::Partial
                if self
                    .awaiting_since
                    .is_some_and(|t| now.saturating_duration_since(t) >= SILENCE) =>
            {
                IndexUse::Silent
            }
            Freshness::Live => IndexUse::Live,
            Freshness::Partial => IndexUse::Partial,
        }
    }
}

/// A usable index's engines in its pool's index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodSlots {
    pub slots: Vec<u32>,
    /// The tokens per block the engines publish in.
    pub block_size: u32,
    /// The index joined late ([`Freshness::Partial`]): it lacks blocks
    /// stored before, so a match is a lower bound.
    pub partial: bool,
}

/// What one Pod's engines hold. Their blocks are shown in a pool's index,
/// which is where a prompt is matched: one walk for every Pod of the pool.
pub struct PodKvIndex {
    inner: Mutex<Inner>,
    pool: Arc<PoolIndex>,
}

impl Default for PodKvIndex {
    fn default() -> Self {
        PodKvIndex::new(DEFAULT_CAPACITY)
    }
}

impl PodKvIndex {
    /// An empty index of at most `cap` blocks per engine, in a pool of its
    /// own (a destination outside the pool, such as a provider).
    pub fn new(cap: usize) -> Self {
        PodKvIndex::in_pool(cap, Arc::default())
    }

    /// An empty index whose engines show their blocks in `pool`.
    pub(crate) fn in_pool(cap: usize, pool: Arc<PoolIndex>) -> Self {
        PodKvIndex {
            pool,
            inner: Mutex::new(Inner {
                engines: HashMap::new(),
                adapters: Default::default(),
                awaiting_since: None,
                cap: cap.max(1),
            }),
        }
    }

    /// Applies the batch with sequence number `seq` to its engine. A gap (a
    /// sequence number beyond the engine's next) marks the engine stale. A
    /// sequence number that goes back means its publisher restarted: the
    /// engine starts over.
    pub fn apply(&self, seq: u64, batch: &EventBatch) -> Applied {
        let mut inner = lock(&self.inner);
        let was_stale = inner.freshness() == Freshness::Stale;
        let mut applied = Applied::default();
        inner.awaiting_since = None;
        let cap = inner.cap;
        let rank = batch.data_parallel_rank;
        if inner.engines.get(&rank).is_some_and(|e| seq < e.next_seq) {
            // Dropping the old engine takes its blocks out of the pool.
            inner.engines.remove(&rank);
        }
        let engine = inner.engines.entry(rank).or_insert_with(|| {
            let engine = Engine::new(&self.pool, seq);
            applied.joined_late = engine.partial;
            engine
        });
        engine.stale |= seq > engine.next_seq;
        engine.next_seq = seq.wrapping_add(1);
        let mut adapters = Vec::new();
        for event in &batch.events {
            match event {
                KvEvent::Stored(s) => {
                    engine.store(s, cap, &mut applied);
                    adapters.extend(s.lora_name.as_deref());
                }
                KvEvent::Removed(r) => {
                    for key in &r.block_hashes {
                        applied.removed += u64::from(engine.forget(*key));
                    }
                }
                KvEvent::AllCleared => {
                    // A cleared cache holds nothing we could have missed.
                    engine.clear();
                    engine.stale = false;
                    engine.partial = false;
                    applied.cleared = true;
                }
            }
        }
        for adapter in adapters {
            if inner.adapters.len() < MAX_ADAPTERS && !inner.adapters.contains(adapter) {
                inner.adapters.insert(adapter.to_string());
            }
        }
        applied.became_stale = !was_stale && inner.freshness() == Freshness::Stale;
        applied
    }

    /// Whether the Pod's engines stored blocks for LoRA adapter `name`.
    pub(crate) fn has_adapter(&self, name: &str) -> bool {
        lock(&self.inner).adapters.contains(name)
    }

    pub fn freshness(&self) -> Freshness {
        lock(&self.inner).freshness()
    }

    /// Whether the picker may use the index at `now`, or why not.
    pub fn usage(&self, now: Instant) -> IndexUse {
        lock(&self.inner).usage(now)
    }

    /// Where the batches a gap lost begin, if batch `seq` of `rank` would
    /// follow one: the sequence number the engine's next batch should have;
    /// or the engine's first, when `seq` is the first heard of it (or of
    /// its restarted publisher) and the engine published before.
    pub(crate) fn missed_from(&self, rank: Option<u32>, seq: u64) -> Option<u64> {
        let inner = lock(&self.inner);
        match inner.engines.get(&rank) {
            Some(engine) if seq >= engine.next_seq => {
                (seq > engine.next_seq).then_some(engine.next_seq)
            }
            _ => (seq > FIRST_SEQ).then_some(0),
        }
    }

    /// A request was routed to the Pod at `now`: its engine should publish
    /// soon.
    pub fn note_routed(&self, now: Instant) {
        lock(&self.inner).awaiting_since.get_or_insert(now);
    }

    /// Resizes to the engine's real cache (blocks per engine).
    pub fn set_capacity(&self, cap: usize) {
        let mut inner = lock(&self.inner);
        inner.cap = cap.max(1);
        let cap = inner.cap;
        for e in inner.engines.values_mut() {
            e.bound(cap);
        }
    }

    /// When the index can be used at `now` (live or partial, and not
    /// silent for [`SILENCE`] since a request was routed to the Pod;
    /// silence is not sticky): its engines' slots in the pool, and the
    /// block size they publish in (engines of another size are left out).
    pub fn pool_slots(&self, now: Instant) -> Option<PodSlots> {
        let inner = lock(&self.inner);
        if !inner.usable(now) {
            return None;
        }
        let block_size = inner.engines.values().find_map(|e| e.block_size)?;
        let slots = inner
            .engines
            .values()
            .filter(|e| e.block_size == Some(block_size))
            .map(|e| e.slot)
            .collect();
        Some(PodSlots {
            slots,
            block_size,
            partial: inner.freshness() == Freshness::Partial,
        })
    }

    /// Blocks remembered, all engines together.
    pub fn len(&self) -> usize {
        lock(&self.inner)
            .engines
            .values()
            .map(|e| e.by_engine.len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::wire::BlockRemoved;

    const BS: u32 = 4;

    fn stored(keys: &[u64], parent: Option<u64>, first_token: u32) -> KvEvent {
        let n = keys.len() as u32 * BS;
        KvEvent::Stored(BlockStored {
            block_hashes: keys.iter().map(|&k| EngineBlock(k)).collect(),
            parent: parent.map(EngineBlock),
            token_ids: (first_token..first_token + n).collect(),
            block_size: BS,
            lora_name: None,
            medium: Some("GPU".into()),
            has_extra_keys: false,
            group_idx: None,
        })
    }

    fn removed(keys: &[u64]) -> KvEvent {
        KvEvent::Removed(BlockRemoved {
            block_hashes: keys.iter().map(|&k| EngineBlock(k)).collect(),
            medium: Some("GPU".into()),
            group_idx: None,
        })
    }

    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: None,
        }
    }

    /// Leading blocks of `chain` the Pod's best engine holds, as its pool
    /// shows them, usable or not.
    fn cached(ix: &PodKvIndex, chain: &[u64]) -> usize {
        let slots: Vec<u32> = lock(&ix.inner).engines.values().map(|e| e.slot).collect();
        ix.pool
            .leading_blocks(chain, &slots)
            .into_iter()
            .map(|(_, blocks)| blocks)
            .max()
            .unwrap_or(0)
    }

    fn usable(ix: &PodKvIndex, now: Instant) -> bool {
        lock(&ix.inner).usable(now)
    }

    /// The chain of a prompt of tokens `0..n`.
    fn prompt(n: u32) -> Vec<u64> {
        let tokens: Vec<u32> = (0..n).collect();
        let mut out = Vec::new();
        token_chain(chain_root(None), &tokens, BS as usize, 1024, &mut out);
        out
    }

    /// vLLM roots a LoRA request's blocks at its adapter: a prompt matches
    /// them in its adapter's chain only, never in the base model's.
    #[test]
    fn an_adapters_blocks_match_only_in_its_own_chain() {
        let ix = PodKvIndex::default();
        let KvEvent::Stored(mut s) = stored(&[10, 11], None, 0) else {
            unreachable!()
        };
        s.lora_name = Some("sql-lora".into());
        ix.apply(0, &batch(vec![KvEvent::Stored(s)]));
        let tokens: Vec<u32> = (0..8).collect();
        let chain_of = |lora| {
            let mut out = Vec::new();
            token_chain(chain_root(lora), &tokens, BS as usize, 1024, &mut out);
            out
        };
        assert_eq!(cached(&ix, &chain_of(Some("sql-lora"))), 2);
        assert_eq!(cached(&ix, &chain_of(None)), 0);
        assert_eq!(cached(&ix, &chain_of(Some("other-lora"))), 0);
        assert!(ix.has_adapter("sql-lora"));
        assert!(!ix.has_adapter("other-lora"));
    }

    #[test]
    fn stored_blocks_match_the_prompt_that_shares_their_tokens() {
        let ix = PodKvIndex::default();
        ix.apply(0, &batch(vec![stored(&[10, 11], None, 0)]));
        ix.apply(1, &batch(vec![stored(&[12], Some(11), 8)]));
        assert_eq!(cached(&ix, &prompt(20)), 3);
        assert_eq!(cached(&ix, &prompt(9)), 2, "only full blocks");
        // Same tokens after a different first block: no match at all.
        let mut other = Vec::new();
        let tokens: Vec<u32> = (1..21).collect();
        token_chain(chain_root(None), &tokens, BS as usize, 1024, &mut other);
        assert_eq!(cached(&ix, &other), 0);
        assert_eq!(ix.freshness(), Freshness::Live);
    }

    #[test]
    fn a_zero_parent_starts_a_sequence_as_llm_d_inference_sim_sends_it() {
        let ix = PodKvIndex::default();
        let a = ix.apply(1, &batch(vec![stored(&[10, 11], Some(0), 0)]));
        assert_eq!(a.orphaned, 0);
        assert_eq!(cached(&ix, &prompt(8)), 2);
    }

    #[test]
    fn a_pod_silent_since_it_was_sent_a_request_is_not_used_until_it_publishes() {
        let ix = PodKvIndex::default();
        let t0 = Instant::now();
        assert!(!usable(&ix, t0), "no event yet");
        ix.apply(0, &batch(vec![stored(&[10], None, 0)]));
        assert!(usable(&ix, t0 + SILENCE * 100), "idle, nothing awaited");
        ix.note_routed(t0);
        ix.note_routed(t0 + SILENCE / 2);
        assert!(usable(&ix, t0 + SILENCE / 2));
        assert!(!usable(&ix, t0 + SILENCE), "the first request counts");
        assert_eq!(ix.usage(t0 + SILENCE), IndexUse::Silent);
        assert_eq!(PodKvIndex::default().usage(t0), IndexUse::Empty);
        ix.apply(1, &batch(vec![]));
        assert!(
            usable(&ix, t0 + SILENCE * 2),
            "events resumed without a gap"
        );
    }

    /// The chain of a prompt of tokens `0..n`, as the pool sees it.
    fn pool_match(pool: &PoolIndex, ix: &PodKvIndex, n: u32) -> Option<usize> {
        let PodSlots {
            slots,
            block_size: bs,
            ..
        } = ix.pool_slots(Instant::now())?;
        assert_eq!(bs, BS);
        pool.leading_blocks(&prompt(n), &slots)
            .into_iter()
            .map(|(_, blocks)| blocks)
            .max()
    }

    #[test]
    fn a_pods_blocks_show_in_the_pool_while_it_holds_them_and_leave_with_it() {
        let pool = Arc::new(PoolIndex::default());
        let ix = PodKvIndex::in_pool(DEFAULT_CAPACITY, Arc::clone(&pool));
        assert_eq!(ix.pool_slots(Instant::now()), None, "no event yet");
        ix.apply(0, &batch(vec![stored(&[10, 11, 12], None, 0)]));
        assert_eq!(pool_match(&pool, &ix, 20), Some(3));
        ix.apply(1, &batch(vec![removed(&[11])]));
        assert_eq!(pool_match(&pool, &ix, 20), Some(1));
        ix.apply(2, &batch(vec![KvEvent::AllCleared]));
        assert_eq!(pool_match(&pool, &ix, 20), Some(0));
        ix.apply(3, &batch(vec![stored(&[10, 11], None, 0)]));
        assert_eq!(pool_match(&pool, &ix, 20), Some(2));
        // A gap: not usable, so not asked.
        ix.apply(9, &batch(vec![]));
        assert_eq!(ix.pool_slots(Instant::now()), None);
        // A restarted publisher: the old engine and its bits are gone.
        ix.apply(0, &batch(vec![stored(&[20], None, 0)]));
        assert_eq!(pool_match(&pool, &ix, 20), Some(1));
        let slots = ix.pool_slots(Instant::now()).unwrap().slots;
        drop(ix);
        assert_eq!(
            pool.leading_blocks(&prompt(20), &slots),
            [(slots[0], 0)],
            "dropped with its Pod"
        );
        assert_eq!(pool.take_slot(), slots[0], "its slot is free again");
    }

    #[test]
    fn each_data_parallel_rank_has_its_own_slot() {
        let pool = Arc::new(PoolIndex::default());
        let ix = PodKvIndex::in_pool(DEFAULT_CAPACITY, Arc::clone(&pool));
        let ranked = |rank, events| EventBatch {
            data_parallel_rank: Some(rank),
            ..batch(events)
        };
        ix.apply(0, &ranked(0, vec![stored(&[10], None, 0)]));
        ix.apply(1, &ranked(1, vec![stored(&[20, 21], None, 0)]));
        let slots = ix.pool_slots(Instant::now()).unwrap().slots;
        assert_eq!(slots.len(), 2);
        assert_eq!(pool_match(&pool, &ix, 20), Some(2), "the best rank");
    }

    #[test]
    fn a_removed_block_ends_the_match_there() {
        let ix = PodKvIndex::default();
        ix.apply(0, &batch(vec![stored(&[10, 11, 12], None, 0)]));
        let a = ix.apply(1, &batch(vec![removed(&[11, 99])]));
        assert_eq!(a.removed, 1, "an unknown key is not counted");
        assert_eq!(cached(&ix, &prompt(12)), 1);
    }

    #[test]
    fn all_blocks_cleared_empties_the_engine_and_makes_a_stale_index_live() {
        let ix = PodKvIndex::default();
        ix.apply(0, &batch(vec![stored(&[10, 11], None, 0)]));
        ix.apply(5, &batch(vec![]));
        assert_eq!(ix.freshness(), Freshness::Stale);
        let a = ix.apply(6, &batch(vec![KvEvent::AllCleared]));
        assert!(a.cleared);
        assert_eq!(cached(&ix, &prompt(8)), 0);
        assert!(ix.is_empty());
        assert_eq!(ix.freshness(), Freshness::Live);
    }

    #[test]
    fn children_of_an_unknown_parent_are_known_but_never_matched() {
        let ix = PodKvIndex::default();
        let a = ix.apply(0, &batch(vec![stored(&[21, 22], Some(20), 4)]));
        assert_eq!(a.orphaned, 2);
        // Its own children are orphans too, and their removal still works.
        ix.apply(1, &batch(vec![stored(&[23], Some(22), 12)]));
        assert_eq!(ix.len(), 3);
        ix.apply(2, &batch(vec![removed(&[21, 22, 23])]));
        assert!(ix.is_empty());
        assert_eq!(cached(&ix, &prompt(16)), 0);
    }

    #[test]
    fn a_sequence_gap_marks_stale_and_a_restart_starts_over() {
        let ix = PodKvIndex::default();
        ix.apply(0, &batch(vec![stored(&[10], None, 0)]));
        ix.apply(1, &batch(vec![]));
        assert_eq!(ix.freshness(), Freshness::Live);
        assert_eq!(ix.missed_from(None, 3), Some(2));
        assert_eq!(ix.missed_from(None, 2), None, "the next one");
        assert!(ix.apply(3, &batch(vec![])).became_stale);
        assert_eq!(ix.freshness(), Freshness::Stale);
        assert!(!ix.apply(5, &batch(vec![])).became_stale, "already stale");
        // The publisher restarted (sequence back to 0): its cache is new.
        assert_eq!(ix.missed_from(None, 0), None);
        assert_eq!(ix.missed_from(None, 2), Some(0), "its first batches lost");
        ix.apply(0, &batch(vec![stored(&[30], None, 100)]));
        assert_eq!(ix.freshness(), Freshness::Live);
        assert_eq!(cached(&ix, &prompt(4)), 0);
        // And its sequence goes on from there without a gap.
        assert!(!ix.apply(1, &batch(vec![])).became_stale);
        assert_eq!(ix.freshness(), Freshness::Live);
    }

    #[test]
    fn an_engine_heard_from_its_first_batch_is_live() {
        // vLLM numbers batches from 0, llm-d-inference-sim from 1.
        for first in [0, 1] {
            let ix = PodKvIndex::default();
            assert_eq!(ix.missed_from(None, first), None);
            ix.apply(first, &batch(vec![stored(&[10], None, 0)]));
            assert_eq!(ix.freshness(), Freshness::Live, "first batch {first}");
        }
    }

    #[test]
    fn an_engine_first_heard_later_is_partial_until_its_cache_is_cleared() {
        let ix = PodKvIndex::default();
        assert_eq!(
            ix.missed_from(None, 40),
            Some(0),
            "what it published before: from its first batch"
        );
        assert_eq!(ix.missed_from(Some(1), 40), Some(0), "per rank");
        ix.apply(40, &batch(vec![stored(&[10], None, 0)]));
        assert_eq!(ix.freshness(), Freshness::Partial);
        assert_eq!(ix.usage(Instant::now()), IndexUse::Partial);
        let slots = ix
            .pool_slots(Instant::now())
            .expect("a partial index is used");
        assert!(slots.partial);
        assert_eq!(cached(&ix, &prompt(8)), 1, "what it heard is matched");
        ix.apply(41, &batch(vec![]));
        assert_eq!(ix.freshness(), Freshness::Partial, "still lacks 0..40");
        // A gap on top is worse: what it holds may be wrong.
        ix.apply(43, &batch(vec![]));
        assert_eq!(ix.freshness(), Freshness::Stale);
        // A cleared cache holds nothing stored before the index joined.
        ix.apply(44, &batch(vec![KvEvent::AllCleared]));
        assert_eq!(ix.freshness(), Freshness::Live);
        assert!(!ix.pool_slots(Instant::now()).is_some_and(|s| s.partial));
    }

    #[test]
    fn a_late_index_that_replays_from_the_first_batch_is_live() {
        let ix = PodKvIndex::default();
        // The subscriber applies the replayed batches before the one that
        // revealed them.
        let from = ix.missed_from(None, 3).unwrap();
        for seq in from..3 {
            ix.apply(
                seq,
                &batch(vec![stored(
                    &[10 + seq],
                    (seq > 0).then(|| 9 + seq),
                    4 * seq as u32,
                )]),
            );
        }
        ix.apply(3, &batch(vec![]));
        assert_eq!(ix.freshness(), Freshness::Live);
        assert_eq!(cached(&ix, &prompt(12)), 3);
    }

    #[test]
    fn other_media_groups_and_extra_keys_are_not_matched() {
        for tweak in [
            |s: &mut BlockStored| s.medium = Some("CPU".into()),
            |s: &mut BlockStored| s.group_idx = Some(1),
            |s: &mut BlockStored| s.has_extra_keys = true,
        ] {
            let ix = PodKvIndex::default();
            let KvEvent::Stored(mut s) = stored(&[10], None, 0) else {
                unreachable!()
            };
            tweak(&mut s);
            let a = ix.apply(0, &batch(vec![KvEvent::Stored(s)]));
            assert_eq!(a.skipped, 1);
            assert_eq!(cached(&ix, &prompt(4)), 0);
        }
    }

    #[test]
    fn a_token_count_that_is_not_whole_blocks_is_malformed_and_ignored() {
        let ix = PodKvIndex::default();
        let KvEvent::Stored(mut s) = stored(&[10, 11], None, 0) else {
            unreachable!()
        };
        s.token_ids.pop();
        let a = ix.apply(0, &batch(vec![KvEvent::Stored(s)]));
        assert_eq!((a.malformed, a.stored), (1, 0));
        assert!(ix.is_empty());
    }

    #[test]
    fn data_parallel_ranks_are_separate_engines_and_the_best_one_counts() {
        let ix = PodKvIndex::default();
        let mut b = batch(vec![stored(&[10], None, 0)]);
        b.data_parallel_rank = Some(0);
        ix.apply(0, &b);
        let mut b = batch(vec![stored(&[10, 11, 12], None, 0)]);
        b.data_parallel_rank = Some(1);
        ix.apply(1, &b);
        assert_eq!(cached(&ix, &prompt(12)), 3);
        let mut b = batch(vec![removed(&[10])]);
        b.data_parallel_rank = Some(1);
        ix.apply(2, &b);
        assert_eq!(cached(&ix, &prompt(12)), 1, "rank 0 still holds block 0");
    }

    #[test]
    fn each_rank_numbers_its_batches_and_only_its_own_gap_or_restart_counts() {
        let ix = PodKvIndex::default();
        let ranked = |rank, events| EventBatch {
            data_parallel_rank: Some(rank),
            ..batch(events)
        };
        ix.apply(0, &ranked(0, vec![stored(&[10, 11], None, 0)]));
        ix.apply(0, &ranked(1, vec![stored(&[20], None, 0)]));
        ix.apply(1, &ranked(0, vec![]));
        ix.apply(1, &ranked(1, vec![]));
        assert_eq!(ix.freshness(), Freshness::Live, "two sequences, no gap");
        assert_eq!(cached(&ix, &prompt(8)), 2, "no restart either");
        // Rank 1 restarts: rank 0 keeps its blocks.
        ix.apply(0, &ranked(1, vec![]));
        assert_eq!(cached(&ix, &prompt(8)), 2);
        // A gap in rank 1 makes the Pod stale; rank 1 clearing its cache
        // makes it live again, whatever rank 0 holds.
        assert!(ix.apply(5, &ranked(1, vec![])).became_stale);
        assert_eq!(ix.freshness(), Freshness::Stale);
        ix.apply(6, &ranked(1, vec![KvEvent::AllCleared]));
        assert_eq!(ix.freshness(), Freshness::Live);
        assert_eq!(cached(&ix, &prompt(8)), 2);
    }

    #[test]
    fn a_flood_of_stored_blocks_stays_within_capacity() {
        let ix = PodKvIndex::new(1_000);
        let mut parent = None;
        for i in 0..50_000u64 {
            ix.apply(i, &batch(vec![stored(&[i], parent, (i as u32) * BS)]));
            parent = Some(i);
        }
        assert_eq!(ix.len(), 1_000);
        let inner = lock(&ix.inner);
        let e = &inner.engines[&None];
        assert!(e.order.len() <= 2 * 1_000 + 1024);
        assert!(e.held.len() <= 1_000);
        drop(inner);
        ix.set_capacity(10);
        assert_eq!(ix.len(), 10);
    }
}
