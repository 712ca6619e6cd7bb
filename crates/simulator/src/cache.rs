//! Prompt-prefix block hashing and the server's LRU prefix cache.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Splits `prompt` into blocks of `block_chars` characters and hashes them
/// cumulatively: block `i`'s hash covers blocks `0..=i` (each block is hashed
/// with the previous block's hash as seed), so equal hashes mean equal
/// prefixes. The chain is seeded with `namespace` (the model or adapter name)
/// because KV entries are not shared between models. Only full blocks are
/// hashed; a trailing partial block is never cached. Linear in the prompt length.
pub(crate) fn block_hashes(namespace: &str, prompt: &str, block_chars: usize) -> Vec<u64> {
    let block_chars = block_chars.max(1);
    let mut hashes = Vec::with_capacity(prompt.len() / block_chars);
    let mut seed = xxh3_64(namespace.as_bytes());
    let mut push = |block: &[u8]| {
        seed = xxh3_64_with_seed(block, seed);
        hashes.push(seed);
    };
    if prompt.is_ascii() {
        // One byte per character: fixed-size chunks, no decoding.
        prompt
            .as_bytes()
            .chunks_exact(block_chars)
            .for_each(&mut push);
    } else {
        let mut start = 0;
        // Byte offsets at which a new block begins (every `block_chars`-th char).
        let boundaries = prompt
            .char_indices()
            .map(|(offset, _)| offset)
            .chain(std::iter::once(prompt.len()))
            .skip(block_chars)
            .step_by(block_chars);
        for end in boundaries {
            push(&prompt.as_bytes()[start..end]);
            start = end;
        }
    }
    hashes
}

/// Block hashes are already uniformly distributed: use them as map hashes.
#[derive(Default)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

const NIL: usize = usize::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    /// Towards the most recently used end.
    prev: usize,
    /// Towards the least recently used end.
    next: usize,
}

/// A fixed-capacity LRU set of block hashes: a doubly linked recency list in
/// a slab, indexed by hash, so every operation is `O(1)`.
#[derive(Debug)]
pub(crate) struct PrefixCache {
    capacity: usize,
    nodes: Vec<Node>,
    index: HashMap<u64, usize, BuildHasherDefault<IdentityHasher>>,
    /// Most recently used node.
    head: usize,
    /// Least recently used node.
    tail: usize,
}

impl PrefixCache {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            nodes: Vec::new(),
            index: HashMap::default(),
            head: NIL,
            tail: NIL,
        }
    }

    /// Number of cached blocks.
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    /// Counts the leading blocks of `hashes` present in the cache. Recency is
    /// refreshed by the [`PrefixCache::insert`] that follows the prefill.
    pub(crate) fn match_prefix(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.index.contains_key(h))
            .count()
    }

    /// Inserts (or refreshes) all blocks of a prompt, evicting the least
    /// recently used blocks beyond capacity. Blocks are touched last-to-first
    /// so the prompt's first block ends up the most recent: eviction then
    /// trims prompts from their tail, which keeps surviving blocks usable as
    /// a prefix.
    pub(crate) fn insert(&mut self, hashes: &[u64]) {
        if self.capacity == 0 {
            return;
        }
        for &hash in hashes.iter().rev() {
            let node = match self.index.get(&hash) {
                Some(&node) => {
                    self.unlink(node);
                    node
                }
                None if self.nodes.len() < self.capacity => {
                    self.nodes.push(Node {
                        hash,
                        prev: NIL,
                        next: NIL,
                    });
                    self.index.insert(hash, self.nodes.len() - 1);
                    self.nodes.len() - 1
                }
                None => {
                    // Full: recycle the least recently used node.
                    let node = self.tail;
                    self.unlink(node);
                    self.index.remove(&self.nodes[node].hash);
                    self.nodes[node].hash = hash;
                    self.index.insert(hash, node);
                    node
                }
            };
            self.push_front(node);
        }
    }

    fn unlink(&mut self, node: usize) {
        let Node { prev, next, .. } = self.nodes[node];
        match prev {
            NIL => self.head = next,
            prev => self.nodes[prev].next = next,
        }
        match next {
            NIL => self.tail = prev,
            next => self.nodes[next].prev = prev,
        }
    }

    fn push_front(&mut self, node: usize) {
        self.nodes[node].prev = NIL;
        self.nodes[node].next = self.head;
        match self.head {
            NIL => self.tail = node,
            head => self.nodes[head].prev = node,
        }
        self.head = node;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_cumulative_and_full_blocks_only() {
        let a = block_hashes("m", "aaaabbbbcc", 4);
        assert_eq!(a.len(), 2);
        let b = block_hashes("m", "xaaabbbbcc", 4);
        assert_ne!(a[0], b[0]);
        // Same second block, different first block: the cumulative hash differs.
        assert_ne!(a[1], b[1]);
        let c = block_hashes("m", "aaaabbbbzzzz", 4);
        assert_eq!(&c[..2], &a[..]);
        assert_eq!(c.len(), 3);
        assert_ne!(block_hashes("other", "aaaabbbb", 4), a);
        assert!(block_hashes("m", "abc", 4).is_empty());
        assert_eq!(block_hashes("m", "abcd", 4).len(), 1);
    }

    #[test]
    fn blocks_count_characters_not_bytes() {
        // 8 two-byte characters = 2 blocks of 4 chars.
        assert_eq!(block_hashes("m", "éééééééé", 4).len(), 2);
        // The ASCII fast path and the general path agree on block contents.
        let ascii = block_hashes("m", "abcdefgh", 4);
        let mixed = block_hashes("m", "abcdefghé", 4);
        assert_eq!(ascii, mixed);
    }

    #[test]
    fn lru_matches_prefix_and_evicts_tails_first() {
        let mut cache = PrefixCache::new(4);
        assert_eq!(cache.match_prefix(&[1, 2, 3]), 0);
        cache.insert(&[1, 2, 3]);
        assert_eq!(cache.match_prefix(&[1, 2, 3]), 3);
        assert_eq!(cache.match_prefix(&[1, 9, 3]), 1);
        // Inserting 2 new blocks evicts the oldest: block 3, the tail of [1,2,3].
        cache.insert(&[7, 8]);
        assert_eq!(cache.len(), 4);
        assert_eq!(cache.match_prefix(&[1, 2, 3]), 2);
        assert_eq!(cache.match_prefix(&[7, 8]), 2);
        // Refreshing [1,2] makes [7,8] the oldest: 8 goes first, then 7.
        cache.insert(&[1, 2]);
        cache.insert(&[5]);
        assert_eq!(cache.match_prefix(&[7, 8]), 1);
        cache.insert(&[6]);
        assert_eq!(cache.match_prefix(&[7]), 0);
        assert_eq!(cache.match_prefix(&[1, 2]), 2);
        assert_eq!(cache.len(), 4);
    }

    #[test]
    fn prompt_longer_than_capacity_keeps_its_head() {
        let mut cache = PrefixCache::new(3);
        cache.insert(&[1, 2, 3, 4, 5]);
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.match_prefix(&[1, 2, 3, 4, 5]), 3);
    }

    #[test]
    fn zero_capacity_disables() {
        let mut cache = PrefixCache::new(0);
        cache.insert(&[1, 2]);
        assert_eq!(cache.match_prefix(&[1, 2]), 0);
        assert_eq!(cache.len(), 0);
    }
}
