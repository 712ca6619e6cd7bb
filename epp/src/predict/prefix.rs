//! Prompt-prefix locality: chained block hashes of the prompt text and, per
//! destination, the prefixes it recently received.
//!
//! Model servers (vLLM, SGLang, TRT-LLM) keep the KV cache of recent prompts and
//! skip the prefill of a new prompt's longest cached prefix. The EPP cannot see
//! the servers' caches, so it remembers what it routed where: a request routed to
//! endpoint E leaves its prompt's prefix blocks "probably cached" on E until enough
//! other blocks have pushed them out. [`PrefixCache`] is that memory: one per
//! endpoint, owned by the endpoint's registry slot (created and dropped with
//! it) and sized like the endpoint's own KV cache once its metrics say how big
//! that is.
//!
//! Hashing works on prompt *text* bytes, not tokens (tokenizing 220 KB prompts on
//! the request path is too slow): a block of [`DEFAULT_BLOCK_CHARS`] bytes is
//! about 16 tokens at the usual ~4 bytes/token.

use kinference_runtime::sync::lock;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Default block size in bytes (≈ 16 tokens at ~4 bytes/token, vLLM's default
/// KV block size).
pub const DEFAULT_BLOCK_CHARS: usize = 64;

pub(crate) use crate::kv_cache::MAX_BLOCKS;

/// Capacity of an endpoint's [`PrefixCache`] until its metrics give the real
/// KV-cache size: 16,384 blocks ≈ 262k tokens, a typical single-GPU vLLM
/// server.
pub const DEFAULT_BLOCKS_PER_ENDPOINT: usize = 16_384;

/// How long a block's reuse counts, in seconds: a block no request touched
/// for this long belongs to a prompt whose requests stopped (a conversation
/// ended, a system prompt retired). Pushing it out costs no one a prefill
/// they would have skipped. Longer than a chat's pause between turns.
pub(crate) const REUSE_HORIZON_SECS: u32 = 300;

/// Reuse marks past the horizon are cleared at most this often (each
/// sweep walks the blocks past it).
const SWEEP_SECS: u32 = 15;

/// Tokens in one block of [`DEFAULT_BLOCK_CHARS`] prompt bytes.
pub(crate) const TOKENS_PER_BLOCK: f64 = DEFAULT_BLOCK_CHARS as f64 / 4.0;

/// Blocks of a [`PrefixCache`] that mirror a server's KV cache of
/// `num_gpu_blocks` blocks of `block_size` tokens (vLLM `cache_config_info`),
/// at least 1. `engine_tokens_per_estimated` is how many of the engine's
/// tokens one estimated token makes (see [`super::token_ratio`]): a cache
/// of a given number of engine tokens holds that much less text.
pub(crate) fn blocks_for_kv_cache(
    num_gpu_blocks: u64,
    block_size: u32,
    engine_tokens_per_estimated: f64,
) -> usize {
    let tokens = num_gpu_blocks.saturating_mul(u64::from(block_size)) as f64;
    let ratio = if engine_tokens_per_estimated > 0.0 {
        engine_tokens_per_estimated
    } else {
        1.0
    };
    ((tokens / (TOKENS_PER_BLOCK * ratio)) as usize).clamp(1, 1 << 30)
}

/// Per-process random seed of the hash chain. Prompts are attacker-controlled;
/// with a secret seed nobody can craft blocks whose hashes collide in the index's
/// hash tables (which are addressed by the block hashes' low bits directly) or
/// alias another tenant's prefix.
fn chain_seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(rand::random::<u64>)
}

/// Fills `out` (cleared first) with the chained hashes of the prompt's full
/// `block_chars`-byte blocks: `h[i] = xxh3(h[i-1], block i)`, so equal `h[i]`
/// means equal prompt bytes `0..(i+1)*block_chars` (up to hash collisions).
///
/// Blocks are cut at byte offsets (we hash bytes, char boundaries do not
/// matter) and hashed in place, without copying the prompt. A trailing partial
/// block is not hashed: servers cache full KV blocks only. At most
/// [`MAX_BLOCKS`] blocks are produced. `block_chars == 0` yields no blocks.
/// Hashes are only comparable within one process (the chain is seeded randomly).
pub fn block_hashes(prompt: &str, block_chars: usize, out: &mut Vec<u64>) {
    block_hashes_bytes(prompt.as_bytes(), block_chars, MAX_BLOCKS, out);
}

/// [`block_hashes`] over raw bytes with an explicit block cap.
pub(crate) fn block_hashes_bytes(
    prompt: &[u8],
    block_chars: usize,
    max_blocks: usize,
    out: &mut Vec<u64>,
) {
    out.clear();
    if block_chars == 0 {
        return;
    }
    let n = (prompt.len() / block_chars).min(max_blocks);
    out.reserve(n);
    let mut prev = chain_seed();
    for block in prompt.chunks_exact(block_chars).take(n) {
        // Up to 240 bytes xxh3 takes the seed directly (cheap); above that a
        // seeded call derives a fresh 192-byte secret per call, so hash the
        // block unseeded and fold the previous hash in with a short seeded hash.
        prev = if block.len() <= 240 {
            xxh3_64_with_seed(block, prev)
        } else {
            xxh3_64_with_seed(&xxh3_64(block).to_le_bytes(), prev)
        };
        out.push(prev);
    }
}

const NIL: u32 = u32::MAX;

/// One slot of the intrusive LRU list (indices instead of pointers: no unsafe,
/// 16 bytes per block).
#[derive(Clone, Copy)]
struct Node {
    hash: u64,
    prev: u32,
    next: u32,
}

/// Exact LRU set of block hashes for one endpoint.
///
/// `nodes` holds every tracked block (a doubly linked recency list by index);
/// `slots` is an open-addressing table (linear probing, load ≤ 1/2) of indices
/// into `nodes`, addressed by the block hash's low bits. The hashes are already
/// uniform (xxh3 with a secret seed), so they index the table directly, and the
/// table stores 4-byte indices rather than (hash, index) pairs: 16 B per node,
/// 1 B for its reused flag, 4 B for its last touch and 8–16 B of table per
/// block, about half of a `HashMap<u64, u32>`.
///
/// Times are whole seconds since the owner's epoch (`now` below).
struct BlockLru {
    slots: Vec<u32>,
    nodes: Vec<Node>,
    /// Per node: whether a request reused the block after the one that
    /// stored it, within [`REUSE_HORIZON_SECS`]. A block one prompt brought
    /// and nobody sent again (a user's own question) costs nothing to
    /// evict; a reused one will be prefilled again by its next reuser,
    /// unless its requests stopped.
    reused: Vec<bool>,
    /// How many of `reused` are set.
    reused_count: usize,
    /// Per node: when a request last touched it.
    touched: Vec<u32>,
    /// When reuse marks past the horizon were last cleared.
    swept: u32,
    /// Whether the cache has had the time to tell the blocks requests come
    /// back for from the one-offs: it pushed a block out (or a shrink
    /// dropped one), or a block went untouched for the horizon. Until then
    /// every block is as young as the Pod's traffic, and one that nobody
    /// reused yet may simply not have had the time.
    settled: bool,
    /// Most recently used.
    head: u32,
    /// Least recently used.
    tail: u32,
    cap: usize,
}

impl BlockLru {
    fn new(cap: usize) -> Self {
        Self {
            slots: Vec::new(),
            nodes: Vec::new(),
            reused: Vec::new(),
            reused_count: 0,
            touched: Vec::new(),
            swept: 0,
            settled: false,
            head: NIL,
            tail: NIL,
            // Node indices are u32 with NIL reserved, and the table needs
            // twice as many slots as nodes.
            cap: cap.min(1 << 30),
        }
    }

    fn len(&self) -> usize {
        self.nodes.len()
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// `(slot, node index)` of `h`.
    fn find(&self, h: u64) -> Option<(usize, u32)> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        // Truncation is intended: the low bits address the table.
        let mut s = h as usize & mask;
        loop {
            let v = self.slots[s];
            if v == NIL {
                return None;
            }
            if self.nodes[v as usize].hash == h {
                return Some((s, v));
            }
            s = (s + 1) & mask;
        }
    }

    fn contains(&self, h: u64) -> bool {
        self.find(h).is_some()
    }

    /// Stores node `i` (not yet in the table) in its probe sequence.
    fn insert_slot(&mut self, i: u32) {
        let mask = self.mask();
        let mut s = self.nodes[i as usize].hash as usize & mask;
        while self.slots[s] != NIL {
            s = (s + 1) & mask;
        }
        self.slots[s] = i;
    }

    /// Makes room for `len` nodes at load ≤ 1/2, rehashing if the table grows.
    fn reserve_slots(&mut self, len: usize) {
        if len * 2 <= self.slots.len() {
            return;
        }
        let size = (len * 2).next_power_of_two().max(16);
        self.slots = vec![NIL; size];
        for i in 0..self.nodes.len() {
            self.insert_slot(i as u32);
        }
    }

    /// Empties slot `s`, shifting later entries of the same probe run back so
    /// lookups never stop early (backward-shift deletion, no tombstones).
    fn remove_slot(&mut self, s: usize) {
        let mask = self.mask();
        let mut hole = s;
        self.slots[hole] = NIL;
        let mut j = s;
        loop {
            j = (j + 1) & mask;
            let v = self.slots[j];
            if v == NIL {
                return;
            }
            let home = self.nodes[v as usize].hash as usize & mask;
            // The entry may stay only if its home lies cyclically in (hole, j].
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.slots[hole] = v;
                self.slots[j] = NIL;
                hole = j;
            }
        }
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    fn push_front(&mut self, i: u32) {
        self.nodes[i as usize].prev = NIL;
        self.nodes[i as usize].next = self.head;
        if self.head != NIL {
            self.nodes[self.head as usize].prev = i;
        }
        self.head = i;
        if self.tail == NIL {
            self.tail = i;
        }
    }

    /// Marks `h` most recently used at `now`, inserting it (and evicting the
    /// least recently used block if full).
    fn touch(&mut self, h: u64, now: u32) {
        if let Some((_, i)) = self.find(h) {
            if !self.reused[i as usize] {
                self.reused[i as usize] = true;
                self.reused_count += 1;
            }
            self.touched[i as usize] = now;
            if self.head != i {
                self.unlink(i);
                self.push_front(i);
            }
            return;
        }
        if self.cap == 0 {
            return;
        }
        let i = if self.nodes.len() < self.cap {
            self.reserve_slots(self.nodes.len() + 1);
            self.nodes.push(Node {
                hash: h,
                prev: NIL,
                next: NIL,
            });
            self.reused.push(false);
            self.touched.push(now);
            (self.nodes.len() - 1) as u32
        } else {
            // Reuse the least recently used node for the new block.
            let i = self.tail;
            self.unlink(i);
            if let Some((s, _)) = self.find(self.nodes[i as usize].hash) {
                self.remove_slot(s);
            }
            self.nodes[i as usize].hash = h;
            if self.reused[i as usize] {
                self.reused[i as usize] = false;
                self.reused_count -= 1;
            }
            self.touched[i as usize] = now;
            self.settled = true;
            i
        };
        self.insert_slot(i);
        self.push_front(i);
    }

    /// Changes the capacity; shrinking keeps the most recently used blocks (and
    /// therefore the prefix-closure invariant, see [`PrefixCache`]).
    fn set_cap(&mut self, cap: usize) {
        let cap = cap.min(1 << 30);
        if cap < self.nodes.len() {
            let mut keep = Vec::with_capacity(cap);
            let mut i = self.head;
            while i != NIL && keep.len() < cap {
                let i_ = i as usize;
                keep.push((self.nodes[i_].hash, self.reused[i_], self.touched[i_]));
                i = self.nodes[i_].next;
            }
            let swept = self.swept;
            *self = Self::new(cap);
            // Re-insert oldest first so the most recent ends up at the head.
            for &(h, reused, touched) in keep.iter().rev() {
                self.touch(h, touched);
                self.reused[self.head as usize] = reused;
                self.reused_count += usize::from(reused);
            }
            self.swept = swept;
            self.settled = true;
        }
        self.cap = cap;
    }

    /// Clears the reuse marks of the blocks no request touched for the
    /// horizon, at most every [`SWEEP_SECS`]. They are the least recently
    /// used: the walk from the tail stops at the first block touched since.
    /// It walks again the blocks an earlier sweep cleared: a cache left
    /// untouched costs a walk of its length (16,384 steps at the default
    /// size, a few hundred microseconds) every [`SWEEP_SECS`], not more.
    fn sweep(&mut self, now: u32) {
        if now < self.swept.saturating_add(SWEEP_SECS) {
            return;
        }
        self.swept = now;
        let mut i = self.tail;
        while i != NIL && now.saturating_sub(self.touched[i as usize]) >= REUSE_HORIZON_SECS {
            self.settled = true;
            if self.reused[i as usize] {
                self.reused[i as usize] = false;
                self.reused_count -= 1;
            }
            i = self.nodes[i as usize].prev;
        }
    }

    /// Touches the chain at `now`, deepest block first: see the
    /// prefix-closure note on [`PrefixCache`].
    fn record(&mut self, hashes: &[u64], now: u32) {
        self.sweep(now);
        for &h in hashes.iter().rev() {
            self.touch(h, now);
        }
    }

    /// How many reused blocks storing `new` more blocks would evict: the
    /// least recently used ones beyond the free room, walked from the tail.
    fn reused_evictions(&self, new: usize) -> usize {
        let evicted = (self.nodes.len() + new).saturating_sub(self.cap);
        let mut i = self.tail;
        let mut reused = 0;
        for _ in 0..evicted {
            if i == NIL {
                break;
            }
            reused += usize::from(self.reused[i as usize]);
            i = self.nodes[i as usize].prev;
        }
        reused
    }

    /// The blocks requests keep coming back for: the reused ones, or every
    /// one held until the cache has settled.
    fn working_set(&self) -> usize {
        if self.settled {
            self.reused_count
        } else {
            self.nodes.len()
        }
    }

    /// How many of `new` more blocks, were they reused like the working
    /// set, would not fit beside it: the blocks nobody came back for age
    /// out first, and past them each new block pushes out one that a
    /// request comes back for.
    fn working_set_overflow(&self, new: usize) -> usize {
        (self.working_set() + new).saturating_sub(self.cap)
    }

    /// Length of the longest prefix of `hashes` present. Relies on prefix
    /// closure (present(i) ⇒ present(j) for all j < i), so presence is monotone
    /// along the chain and a binary search finds the boundary in O(log n).
    fn longest_prefix(&self, hashes: &[u64]) -> usize {
        leading_run(hashes.len(), |i| self.contains(hashes[i]))
    }
}

/// How many of `0..n` hold `holds`, given that they are a leading run
/// (holds(i) implies holds(j) for all j < i): found by bisection.
pub(super) fn leading_run(n: usize, holds: impl Fn(usize) -> bool) -> usize {
    if n == 0 || !holds(0) {
        return 0;
    }
    if holds(n - 1) {
        return n;
    }
    // Invariant: holds at lo, not at hi.
    let (mut lo, mut hi) = (0, n - 1);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if holds(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo + 1
}

/// What storing a prompt adds to a [`PrefixCache`], in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Growth {
    /// The prompt's blocks not held yet.
    pub new: usize,
    /// How many of them would not fit beside the working set.
    pub overflow: usize,
}

/// The prompt prefixes one destination recently received.
///
/// An exact LRU set of block hashes with its own capacity (the unit a model
/// server evicts is its own cache, so the bound is per endpoint too), behind
/// one short mutex.
///
/// Prefix closure: [`record`](Self::record) touches the chain from the last
/// block to the first, so a block is always more recently used than every
/// deeper block of any chain through it (any later chain that contains block
/// i also contains blocks 0..i and touches them after it). LRU eviction
/// therefore removes chains from the tail, never leaving a gap, and
/// [`cached_blocks`](Self::cached_blocks) can binary-search the chain: 200
/// candidates × 3,500 blocks cost ~200 × 12 hash probes instead of one probe
/// per (block, endpoint).
///
/// Memory: 29–37 bytes per tracked block (16 B LRU node, its reused flag
/// and last touch, 8–16 B of table), ~500 KiB for a full endpoint at
/// [`DEFAULT_BLOCKS_PER_ENDPOINT`].
pub struct PrefixCache {
    lru: Mutex<BlockLru>,
    /// Time zero of the LRU's seconds.
    epoch: Instant,
}

impl PrefixCache {
    pub fn new(capacity_blocks: usize) -> Self {
        PrefixCache {
            lru: Mutex::new(BlockLru::new(capacity_blocks)),
            epoch: Instant::now(),
        }
    }

    /// Whole seconds since the epoch (u32: 136 years).
    fn now(&self) -> u32 {
        u32::try_from(self.epoch.elapsed().as_secs()).unwrap_or(u32::MAX)
    }

    /// Number of leading `hashes` this destination has recently received.
    pub fn cached_blocks(&self, hashes: &[u64]) -> usize {
        lock(&self.lru).longest_prefix(hashes)
    }

    /// Records that a request with these prefix hashes was routed here.
    /// Costs one table update per block: ~40 µs for a known 3,500-block chain
    /// (LRU refresh), ~200 µs for a new one that evicts; best called once the
    /// routing reply is on its way. The lock is held for the whole chain so
    /// readers never observe a half-recorded chain.
    pub fn record(&self, hashes: &[u64]) {
        if hashes.is_empty() {
            return;
        }
        // Read under the lock, so that touch times follow the list's order.
        let mut lru = lock(&self.lru);
        let now = self.now();
        lru.record(hashes, now);
    }

    /// How many blocks that requests reused within the reuse horizon would
    /// make room for the blocks of `hashes` not held here yet: what storing
    /// this prompt costs the prompts already here (`predict::reuse`). At
    /// most [`MAX_BLOCKS`] steps, since `hashes` has at most that many
    /// blocks.
    pub(crate) fn reused_evictions(&self, hashes: &[u64]) -> usize {
        let lru = lock(&self.lru);
        let new = hashes.len() - lru.longest_prefix(hashes);
        lru.reused_evictions(new)
    }

    /// The blocks of `hashes` not held here, and how many of them would not
    /// fit beside the working set (the blocks requests keep coming back
    /// for, or every block held until the cache first pushes one out or
    /// holds one untouched for the reuse horizon): a group placed where its
    /// working set does not fit has its prompts prefilled again and again.
    /// It does not walk the index.
    ///
    /// Once the cache has settled, this never exceeds
    /// [`reused_evictions`](Self::reused_evictions), which also counts the
    /// reused blocks that are older than some one-off: it is the steady
    /// state, after the one-offs aged out. Before, it counts every block
    /// held, reused or not: a cold cache's groups have not had the time to
    /// come back.
    pub fn growth(&self, hashes: &[u64]) -> Growth {
        let lru = lock(&self.lru);
        let new = hashes.len() - lru.longest_prefix(hashes);
        Growth {
            new,
            overflow: lru.working_set_overflow(new),
        }
    }

    /// Clears the reuse marks of blocks no request touched for
    /// [`REUSE_HORIZON_SECS`] (at most every few seconds: a no-op
    /// between). Called after each scrape and each record, never on a
    /// request's path: a sweep may walk the whole cache.
    pub(crate) fn expire_reuse(&self) {
        let mut lru = lock(&self.lru);
        let now = self.now();
        lru.sweep(now);
    }

    /// Resizes to `capacity_blocks` (the server's real cache size); shrinking
    /// drops the least recently used blocks. A no-op at the same size.
    pub fn set_capacity(&self, capacity_blocks: usize) {
        let mut lru = lock(&self.lru);
        if lru.cap != capacity_blocks.min(1 << 30) {
            lru.set_cap(capacity_blocks);
        }
    }

    pub fn capacity(&self) -> usize {
        lock(&self.lru).cap
    }

    /// Blocks tracked now.
    pub fn len(&self) -> usize {
        lock(&self.lru).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Default for PrefixCache {
    fn default() -> Self {
        Self::new(DEFAULT_BLOCKS_PER_ENDPOINT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(s: &str) -> Vec<u64> {
        let mut v = Vec::new();
        block_hashes(s, DEFAULT_BLOCK_CHARS, &mut v);
        v
    }

    fn text(seed: u8, len: usize) -> String {
        // Pseudo-random letters, distinct per seed.
        (0..len)
            .map(|i| {
                (b'a' + (xxh3_64(&[seed, (i % 251) as u8, (i / 251) as u8]) % 26) as u8) as char
            })
            .collect()
    }

    #[test]
    fn block_hashes_are_chained_prefixes() {
        let a = text(1, 64 * 10 + 5);
        let mut b = a[..64 * 6].to_string();
        b.push_str(&text(2, 64 * 4));
        let (ha, hb) = (hashes(&a), hashes(&b));
        assert_eq!(ha.len(), 10, "trailing partial block is not hashed");
        assert_eq!(hb.len(), 10);
        assert_eq!(ha[..6], hb[..6]);
        assert!(ha[6..].iter().zip(&hb[6..]).all(|(x, y)| x != y));
        // Same block content at a different position hashes differently.
        let rep = "x".repeat(64 * 3);
        let hr = hashes(&rep);
        assert_ne!(hr[0], hr[1]);
        assert_ne!(hr[1], hr[2]);
    }

    #[test]
    fn block_hashes_edge_cases() {
        let mut v = vec![1, 2, 3];
        block_hashes("short", 64, &mut v);
        assert!(v.is_empty());
        block_hashes("abc", 0, &mut v);
        assert!(v.is_empty());
        // Multi-byte chars cut mid-char are fine: bytes are hashed.
        block_hashes(&"é".repeat(100), 3, &mut v);
        assert_eq!(v.len(), 66);
        // Cap.
        let big = "y".repeat(64 * (MAX_BLOCKS + 10));
        block_hashes(&big, 64, &mut v);
        assert_eq!(v.len(), MAX_BLOCKS);
        // Large blocks take the unseeded-then-fold path and stay chained.
        let a = text(3, 1000 * 4);
        let mut b = a[..2000].to_string();
        b.push_str(&text(4, 2000));
        let (mut ha, mut hb) = (Vec::new(), Vec::new());
        block_hashes(&a, 1000, &mut ha);
        block_hashes(&b, 1000, &mut hb);
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
    }

    #[test]
    fn cached_blocks_longest_prefix() {
        let (e1, e2) = (PrefixCache::new(1000), PrefixCache::new(1000));
        let a = hashes(&text(1, 64 * 20));
        let mut bs = text(1, 64 * 8);
        bs.push_str(&text(9, 64 * 12));
        let b = hashes(&bs);
        assert_eq!(e1.cached_blocks(&a), 0);
        e1.record(&a);
        assert_eq!(e1.cached_blocks(&a), 20);
        assert_eq!(e1.cached_blocks(&b), 8);
        assert_eq!(e2.cached_blocks(&a), 0);
        assert_eq!(e1.cached_blocks(&a[..5]), 5);
        assert_eq!(e1.cached_blocks(&[]), 0);
        e2.record(&b[..3]);
        assert_eq!(e2.cached_blocks(&b), 3);
    }

    #[test]
    fn kv_cache_size_in_blocks() {
        // 384 vLLM blocks of 16 tokens = 6,144 tokens = 384 blocks of 16.
        assert_eq!(blocks_for_kv_cache(384, 16, 1.0), 384);
        assert_eq!(blocks_for_kv_cache(1000, 64, 1.0), 4000);
        assert_eq!(blocks_for_kv_cache(0, 16, 1.0), 1);
        assert_eq!(blocks_for_kv_cache(u64::MAX, u32::MAX, 1.0), 1 << 30);
        // An engine counting half as many tokens holds twice the text.
        assert_eq!(blocks_for_kv_cache(384, 16, 0.5), 768);
        assert_eq!(blocks_for_kv_cache(384, 16, 2.0), 192);
        // No ratio is read as the estimate's own.
        assert_eq!(blocks_for_kv_cache(384, 16, 0.0), 384);
        assert_eq!(blocks_for_kv_cache(384, 16, f64::NAN), 384);
    }

    /// Brute-force reference: longest prefix by a linear scan until the first
    /// miss. Under LRU pressure the binary search must agree with it (the
    /// prefix-closure invariant).
    #[test]
    fn eviction_keeps_prefix_closure() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(7);
        let e = PrefixCache::new(300);
        // A few "system prompts" shared by many requests, each with a random tail.
        let systems: Vec<String> = (0..4)
            .map(|i| text(i, 64 * rng.random_range(5..60)))
            .collect();
        let mut seen: Vec<Vec<u64>> = Vec::new();
        for round in 0..400 {
            let mut p = systems[rng.random_range(0..systems.len())].clone();
            p.push_str(&text((round % 250) as u8, 64 * rng.random_range(0..80)));
            let h = hashes(&p);
            e.record(&h);
            seen.push(h);
            if round % 7 == 0 {
                e.set_capacity(rng.random_range(50..400));
            }
            let lru = lock(&e.lru);
            assert!(lru.len() <= lru.cap);
            for q in seen.iter().rev().take(20) {
                let linear = q.iter().take_while(|h| lru.contains(**h)).count();
                assert_eq!(lru.longest_prefix(q), linear);
                // No gaps: nothing beyond the linear prefix is present.
                assert!(q[linear..].iter().all(|h| !lru.contains(*h)));
            }
        }
    }

    /// The compact table + list against a naive LRU (a Vec in recency
    /// order), with keys that collide heavily in the table's low bits to
    /// exercise probing and backward-shift deletion.
    #[test]
    fn block_lru_matches_naive_model() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(11);
        for cap in [1usize, 2, 7, 64, 300] {
            let mut lru = BlockLru::new(cap);
            let mut model: Vec<(u64, bool)> = Vec::new(); // most recent first, reused
            let mut has_evicted = false;
            for step in 0..20_000 {
                let k = match rng.random_range(0..3) {
                    0 => rng.random_range(0..(cap as u64 * 3)) << 32, // low bits all 0
                    1 => (rng.random_range(0..40u64) << 40) | rng.random_range(0..4u64),
                    _ => rng.random_range(0..(cap as u64 * 2 + 5)),
                };
                lru.touch(k, 0);
                let reused = match model.iter().position(|&(m, _)| m == k) {
                    Some(p) => {
                        model.remove(p);
                        true
                    }
                    None => false,
                };
                model.insert(0, (k, reused));
                has_evicted |= model.len() > cap;
                model.truncate(cap);
                if step % 97 == 0 {
                    assert_eq!(lru.len(), model.len());
                    // Recency order from the list matches the model.
                    let mut order = Vec::new();
                    let mut i = lru.head;
                    while i != NIL {
                        order.push((lru.nodes[i as usize].hash, lru.reused[i as usize]));
                        i = lru.nodes[i as usize].next;
                    }
                    assert_eq!(order, model, "cap {cap} step {step}");
                    assert!(model.iter().all(|&(m, _)| lru.contains(m)));
                    // Storing n new blocks evicts the oldest past the room,
                    // reused or not.
                    let n = rng.random_range(0..=2 * cap);
                    let room = cap - model.len();
                    let oldest = model.iter().rev().take(n.saturating_sub(room));
                    assert_eq!(
                        lru.reused_evictions(n),
                        oldest.filter(|&&(_, reused)| reused).count()
                    );
                    // Until a block was pushed out, all of them are the
                    // working set; after, the reused ones.
                    let working = if has_evicted {
                        model.iter().filter(|&&(_, reused)| reused).count()
                    } else {
                        model.len()
                    };
                    assert_eq!(lru.working_set(), working, "cap {cap} step {step}");
                    assert_eq!(lru.slots.iter().filter(|&&v| v != NIL).count(), model.len());
                }
                let probe = rng.random_range(0..(cap as u64 * 3)) << 32;
                assert_eq!(lru.contains(probe), model.iter().any(|&(m, _)| m == probe));
            }
        }
    }

    #[test]
    fn lru_evicts_least_recent() {
        let e = PrefixCache::new(10);
        let a = hashes(&text(1, 64 * 6));
        let b = hashes(&text(2, 64 * 6));
        e.record(&a);
        e.record(&b);
        // 12 blocks into 10 slots: a's two deepest blocks went first.
        assert_eq!(e.cached_blocks(&a), 4);
        assert_eq!(e.cached_blocks(&b), 6);
        // Refresh a's head block, then push 3 new blocks: a's tail blocks 3, 2, 1
        // are now the least recent and go.
        e.record(&a[..1]);
        e.record(&b);
        e.record(&hashes(&text(3, 64 * 3)));
        assert_eq!(e.cached_blocks(&a), 1);
        assert_eq!(e.cached_blocks(&b), 6);
        assert_eq!(e.len(), 10);
        e.set_capacity(0);
        assert_eq!(e.cached_blocks(&b), 0);
        e.record(&b);
        assert_eq!(e.len(), 0);
    }

    #[test]
    fn storing_a_prompt_evicts_the_reused_blocks_past_the_free_room() {
        let e = PrefixCache::new(20);
        let shared = hashes(&text(1, 64 * 8));
        let one_off = hashes(&text(2, 64 * 6));
        e.record(&shared);
        e.record(&shared);
        e.record(&one_off);
        // 14 of 20 blocks held; `shared`'s 8, sent twice, are the oldest.
        let new = hashes(&text(3, 64 * 6));
        assert_eq!(e.reused_evictions(&new), 0, "6 new blocks fit in the room");
        let longer = hashes(&text(3, 64 * 10));
        assert_eq!(
            e.reused_evictions(&longer),
            4,
            "10 new blocks push out 4 of the oldest, all reused"
        );
        // Refreshed, `shared` is younger than `one_off`, which goes first
        // and cost nobody anything.
        e.record(&shared);
        assert_eq!(e.reused_evictions(&longer), 0);
        let longest = hashes(&text(3, 64 * 16));
        assert_eq!(e.reused_evictions(&longest), 4);
        // A prompt already held needs no room.
        assert_eq!(e.reused_evictions(&shared), 0);
        // A shrink keeps the flags of the blocks it keeps, and their count.
        e.set_capacity(8);
        assert_eq!(e.reused_evictions(&new), 6);
        assert_eq!(
            e.growth(&new),
            Growth {
                new: 6,
                overflow: 6
            }
        );
    }

    #[test]
    fn a_new_prompt_overflows_a_working_set_that_fills_the_cache() {
        let e = PrefixCache::new(20);
        let group = |seed| hashes(&text(seed, 64 * 8));
        let (a, b, c) = (group(1), group(2), group(3));
        // Before the cache first pushes a block out, every block held
        // counts: 8 + 8 beside `c`'s 8 is 4 too many, though none of them
        // was reused yet.
        e.record(&a);
        assert_eq!(e.growth(&b).overflow, 0);
        e.record(&b);
        assert_eq!(e.reused_evictions(&c), 0, "nothing reused pushed out now");
        assert_eq!(
            e.growth(&c),
            Growth {
                new: 8,
                overflow: 4
            }
        );
        assert_eq!(e.growth(&a).overflow, 0, "a prompt held needs no room");
        // Once blocks were pushed out, only what requests came back for
        // counts: `a` reused, `b` and `c` sent once.
        e.record(&a);
        e.record(&c);
        let d = group(4);
        assert_eq!(e.growth(&d).overflow, 0, "8 reused + 8 new fit in 20");
        e.record(&c);
        assert_eq!(
            e.growth(&d).overflow,
            4,
            "c reused too: 16 + 8 is 4 past 20"
        );
        let long = hashes(&text(5, 64 * 30));
        assert_eq!(e.growth(&long).overflow, 16 + 30 - 20);
    }

    /// Two groups of 8 blocks, `a` and `b`, each sent at 0 and 1 s into a
    /// cache of 20 (16 reused blocks); then only `b`, at the reuse horizon.
    fn a_stops_b_goes_on() -> (BlockLru, Vec<u64>, Vec<u64>) {
        let group = |seed| hashes(&text(seed, 64 * 8));
        let (a, b) = (group(1), group(2));
        let mut lru = BlockLru::new(20);
        for t in [0, 1] {
            lru.record(&a, t);
            lru.record(&b, t);
        }
        lru.record(&b, REUSE_HORIZON_SECS);
        (lru, a, b)
    }

    #[test]
    fn a_block_untouched_for_the_reuse_horizon_no_longer_counts_as_reused() {
        let (mut lru, a, b) = a_stops_b_goes_on();
        let horizon = REUSE_HORIZON_SECS;
        assert_eq!(lru.reused_count, 16, "a was touched 299 s ago");
        assert_eq!(lru.working_set_overflow(8), 4, "a new group's 8 do not fit");
        assert_eq!(lru.reused_evictions(12), 8, "12 new blocks push a out");
        // The next sweep finds `a` untouched for the horizon: pushing it
        // out costs no one, and it is no longer part of the working set.
        let later = horizon + SWEEP_SECS;
        lru.record(&b, later);
        assert_eq!(lru.reused_count, 8);
        assert_eq!(lru.reused_evictions(12), 0);
        assert_eq!(lru.working_set_overflow(8), 0, "8 reused + 8 new fit in 20");
        // Back again, `a` counts once more.
        lru.record(&a, later);
        assert_eq!(lru.reused_count, 16);
    }

    #[test]
    fn expire_reuse_clears_the_marks_past_the_horizon_by_the_caches_clock() {
        let started = Instant::now()
            .checked_sub(std::time::Duration::from_secs(400))
            .expect("the clock is past 400 s");
        // A cache whose epoch was 400 s ago: its clock reads 400.
        let e = PrefixCache {
            lru: Mutex::new(BlockLru::new(20)),
            epoch: started,
        };
        // Touched without a sweep: `old` twice at 0 s, `recent` twice at
        // 399 s.
        let (old, recent) = (hashes(&text(1, 64 * 8)), hashes(&text(2, 64 * 8)));
        let mut lru = lock(&e.lru);
        for (chain, at) in [(&old, 0), (&old, 0), (&recent, 399), (&recent, 399)] {
            chain.iter().rev().for_each(|&h| lru.touch(h, at));
        }
        assert_eq!(lru.reused_count, 16);
        drop(lru);
        e.expire_reuse();
        assert_eq!(lock(&e.lru).reused_count, 8, "only `recent`'s marks stay");
    }

    #[test]
    fn a_shrink_keeps_each_blocks_last_touch() {
        let (mut lru, _, _) = a_stops_b_goes_on();
        // Down to 12: `b`'s 8 and the first 4 of `a`, all reused.
        lru.set_cap(12);
        assert_eq!(lru.reused_count, 12);
        // `a`'s 4 were touched at 1, `b`'s at 300: the sweep clears only
        // `a`'s (with the times lost to 0, it would clear all).
        lru.sweep(REUSE_HORIZON_SECS + SWEEP_SECS);
        assert_eq!(lru.reused_count, 8);
    }

    #[test]
    fn a_cache_that_never_filled_settles_once_a_block_outlives_the_horizon() {
        let group = |seed| hashes(&text(seed, 64 * 8));
        let (a, b, c) = (group(1), group(2), group(3));
        let mut lru = BlockLru::new(20);
        lru.record(&a, 0);
        lru.record(&b, 0);
        // Nothing pushed out, nothing old: every block counts, as a cold
        // cache's groups may not have come back yet.
        assert_eq!(lru.working_set_overflow(c.len()), 4);
        // `b` keeps coming; `a` was sent once and never again.
        lru.record(&b, 10);
        lru.record(&b, REUSE_HORIZON_SECS - 1);
        assert_eq!(lru.working_set_overflow(c.len()), 4, "a is 299 s old");
        lru.sweep(REUSE_HORIZON_SECS - 1 + SWEEP_SECS);
        assert_eq!(lru.reused_count, 8);
        assert_eq!(lru.working_set_overflow(c.len()), 0, "only b is kept");
    }

    #[test]
    fn concurrent_use() {
        let caches: std::sync::Arc<Vec<PrefixCache>> =
            std::sync::Arc::new((0..5).map(|_| PrefixCache::new(2000)).collect());
        let hs: Vec<Vec<u64>> = (0..8).map(|i| hashes(&text(i, 64 * 100))).collect();
        let hs = std::sync::Arc::new(hs);
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let (caches, hs) = (caches.clone(), hs.clone());
                std::thread::spawn(move || {
                    for i in 0..200 {
                        let h = &hs[(i + t) % hs.len()];
                        caches[i % 5].record(h);
                        for c in caches.iter() {
                            let n = c.cached_blocks(h);
                            assert!(n == 0 || n == 100, "a half-recorded chain: {n}");
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }
}
