//! Which engines of the pool hold each block, for matching a prompt against
//! every Pod in one walk: one lookup per block of the prompt, where asking
//! each Pod's own index costs one per block and Pod.
//!
//! Each engine (a Pod, or one data-parallel rank of it) has a slot, a bit
//! in every block's holder set. The engine's own index keeps its bits
//! here as it stores and removes blocks, and clears them and frees its slot
//! when it is dropped with its Pod: nothing here outlives an engine.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Mutex, RwLock};

use kinference_runtime::sync::{lock, read, write};

/// Lock shards: event streams of different Pods and the request path
/// rarely wait on each other.
const SHARDS: usize = 16;

/// A set of slots, inline up to 128 (pools of that many engines allocate
/// nothing per block).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Holders {
    Inline(u128),
    Words(Box<[u64]>),
}

impl Holders {
    fn with(slot: u32) -> Holders {
        let mut h = Holders::Inline(0);
        h.set(slot);
        h
    }

    fn set(&mut self, slot: u32) {
        let slot = slot as usize;
        if let Holders::Inline(bits) = self {
            if slot < 128 {
                *bits |= 1 << slot;
                return;
            }
            let words = vec![*bits as u64, (*bits >> 64) as u64];
            *self = Holders::Words(words.into_boxed_slice());
        }
        if let Holders::Words(words) = self {
            if words.len() <= slot / 64 {
                let mut grown = words.to_vec();
                grown.resize(slot / 64 + 1, 0);
                *words = grown.into_boxed_slice();
            }
            words[slot / 64] |= 1 << (slot % 64);
        }
    }

    /// Clears `slot`; whether the set is now empty.
    fn clear(&mut self, slot: u32) -> bool {
        let slot = slot as usize;
        match self {
            Holders::Inline(bits) => {
                if slot < 128 {
                    *bits &= !(1 << slot);
                }
                *bits == 0
            }
            Holders::Words(words) => {
                if let Some(w) = words.get_mut(slot / 64) {
                    *w &= !(1 << (slot % 64));
                }
                words.iter().all(|w| *w == 0)
            }
        }
    }

    fn word(&self, i: usize) -> u64 {
        match self {
            Holders::Inline(bits) => match i {
                0 => *bits as u64,
                1 => (*bits >> 64) as u64,
                _ => 0,
            },
            Holders::Words(words) => words.get(i).copied().unwrap_or(0),
        }
    }
}

#[derive(Default)]
struct Slots {
    free: BTreeSet<u32>,
    next: u32,
}

/// The pool's blocks and who holds them.
pub struct PoolIndex {
    shards: Vec<RwLock<HashMap<u64, Holders>>>,
    slots: Mutex<Slots>,
}

impl Default for PoolIndex {
    fn default() -> Self {
        PoolIndex {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            slots: Mutex::default(),
        }
    }
}

impl PoolIndex {
    /// A slot for a new engine: the lowest free one, so small pools stay
    /// inline.
    pub(crate) fn take_slot(&self) -> u32 {
        let mut slots = lock(&self.slots);
        match slots.free.pop_first() {
            Some(slot) => slot,
            None => {
                slots.next += 1;
                slots.next - 1
            }
        }
    }

    /// Gives back a slot whose blocks were all removed.
    pub(crate) fn free_slot(&self, slot: u32) {
        lock(&self.slots).free.insert(slot);
    }

    fn shard(&self, block: u64) -> &RwLock<HashMap<u64, Holders>> {
        &self.shards[(block as usize) % SHARDS]
    }

    /// The engine in `slot` now holds `block`.
    pub fn add(&self, block: u64, slot: u32) {
        let mut shard = write(self.shard(block));
        shard
            .entry(block)
            .and_modify(|h| h.set(slot))
            .or_insert_with(|| Holders::with(slot));
    }

    /// The engine in `slot` no longer holds `block`.
    pub fn remove(&self, block: u64, slot: u32) {
        let mut shard = write(self.shard(block));
        if let Some(h) = shard.get_mut(&block)
            && h.clear(slot)
        {
            shard.remove(&block);
        }
    }

    /// For each slot in `slots`, how many leading blocks of `chain` its
    /// engine holds. One lookup per block, until no slot is left.
    pub fn leading_blocks(&self, chain: &[u64], slots: &[u32]) -> Vec<(u32, usize)> {
        let Some(&max) = slots.iter().max() else {
            return Vec::new();
        };
        let words = max as usize / 64 + 1;
        let mut alive = vec![0u64; words];
        for &s in slots {
            alive[s as usize / 64] |= 1 << (s % 64);
        }
        let mut out = Vec::with_capacity(slots.len());
        let mut depth = chain.len();
        for (i, block) in chain.iter().enumerate() {
            let shard = read(self.shard(*block));
            let holders = shard.get(block);
            let mut any = false;
            for (w, word) in alive.iter_mut().enumerate() {
                let kept = *word & holders.map_or(0, |h| h.word(w));
                push_slots(*word & !kept, w, i, &mut out);
                *word = kept;
                any |= kept != 0;
            }
            if !any {
                depth = i;
                break;
            }
        }
        for (w, word) in alive.iter().enumerate() {
            push_slots(*word, w, depth, &mut out);
        }
        out
    }
}

/// Records each slot set in `bits` (word `w`) as holding `blocks` blocks.
fn push_slots(mut bits: u64, w: usize, blocks: usize, out: &mut Vec<(u32, usize)>) {
    while bits != 0 {
        let b = bits.trailing_zeros();
        out.push(((w * 64) as u32 + b, blocks));
        bits &= bits - 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(mut v: Vec<(u32, usize)>) -> Vec<(u32, usize)> {
        v.sort_unstable();
        v
    }

    #[test]
    fn each_slot_gets_its_own_leading_run() {
        let pool = PoolIndex::default();
        let (a, b, c) = (pool.take_slot(), pool.take_slot(), pool.take_slot());
        for block in [1, 2, 3] {
            pool.add(block, a);
        }
        pool.add(1, b);
        pool.add(3, b); // a hole at 2: b's run ends at 1
        let chain = [1, 2, 3, 4];
        assert_eq!(
            sorted(pool.leading_blocks(&chain, &[a, b, c])),
            [(a, 3), (b, 1), (c, 0)]
        );
        pool.remove(2, a);
        assert_eq!(pool.leading_blocks(&chain, &[a]), [(a, 1)]);
        assert_eq!(pool.leading_blocks(&[], &[a, c]), [(a, 0), (c, 0)]);
        assert_eq!(pool.leading_blocks(&chain, &[]), []);
    }

    #[test]
    fn slots_past_128_and_freed_slots_are_reused_lowest_first() {
        let pool = PoolIndex::default();
        let slots: Vec<u32> = (0..200).map(|_| pool.take_slot()).collect();
        for &s in &slots {
            pool.add(7, s);
            if s % 3 == 0 {
                pool.add(8, s);
            }
        }
        let got = sorted(pool.leading_blocks(&[7, 8], &slots));
        for (s, blocks) in got {
            assert_eq!(blocks, if s % 3 == 0 { 2 } else { 1 }, "slot {s}");
        }
        for &s in &slots {
            pool.remove(7, s);
            pool.remove(8, s);
        }
        assert!(pool.shards.iter().all(|s| s.read().unwrap().is_empty()));
        pool.free_slot(150);
        pool.free_slot(3);
        assert_eq!((pool.take_slot(), pool.take_slot()), (3, 150));
        assert_eq!(pool.take_slot(), 200);
    }
}
