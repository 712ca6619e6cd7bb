//! Everything the EPP learns about one destination, in one place: its live
//! statistics and breaker, the prompt prefixes it received and its own TTFT
//! model. A local endpoint's state is owned by its registry slot, a
//! provider's by the provider's entry, so it is created, resized and dropped
//! with the destination and nothing outlives it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use super::prefix::{DEFAULT_BLOCKS_PER_ENDPOINT, PrefixCache, blocks_for_kv_cache};
use super::routed::RoutedPrefixes;
use super::stats::{DestStats, StatsConfig};
use super::token_ratio::TokenRatio;
use super::ttft::EndpointTtft;
use crate::kv_cache::PodKvIndex;
use crate::kv_cache::index::DEFAULT_CAPACITY;
use crate::kv_cache::pool::PoolIndex;

/// How a new destination's state starts.
#[derive(Debug, Clone, Copy)]
pub struct DestinationConfig {
    pub stats: StatsConfig,
    /// Prefix-cache blocks until the server's KV-cache size is known.
    pub prefix_blocks: usize,
}

impl Default for DestinationConfig {
    fn default() -> Self {
        DestinationConfig {
            stats: StatsConfig::default(),
            prefix_blocks: DEFAULT_BLOCKS_PER_ENDPOINT,
        }
    }
}

pub struct DestinationState {
    pub stats: Arc<DestStats>,
    pub prefix: PrefixCache,
    pub ttft: EndpointTtft,
    /// What the Pod's engines hold, from their KV events (precise mode);
    /// empty when they publish none.
    pub kv: PodKvIndex,
    /// Prompts routed here in the last seconds (precise mode: what the
    /// events have not reported yet).
    pub routed: RoutedPrefixes,
    /// Its engine's tokens per estimated token, from its answers.
    pub engine_tokens: TokenRatio,
    /// Its engine's KV-cache block size in tokens and its number of blocks,
    /// as last scraped; 0 until a scrape says.
    engine_block: AtomicU32,
    engine_blocks: AtomicU64,
    /// Its engine ended a stream with token counts the request had not
    /// asked for (vLLM's `--enable-force-include-usage`).
    usage_unasked: AtomicBool,
}

impl DestinationState {
    pub fn new(config: &DestinationConfig) -> Arc<Self> {
        Self::with_kv(config, PodKvIndex::default())
    }

    /// A Pod's state, whose KV-event index shows its blocks in `pool`.
    pub fn in_pool(config: &DestinationConfig, pool: &Arc<PoolIndex>) -> Arc<Self> {
        let kv = PodKvIndex::in_pool(DEFAULT_CAPACITY, Arc::clone(pool));
        Self::with_kv(config, kv)
    }

    fn with_kv(config: &DestinationConfig, kv: PodKvIndex) -> Arc<Self> {
        Arc::new(DestinationState {
            stats: Arc::new(DestStats::new(config.stats)),
            prefix: PrefixCache::new(config.prefix_blocks),
            ttft: EndpointTtft::default(),
            kv,
            routed: RoutedPrefixes::default(),
            engine_tokens: TokenRatio::default(),
            engine_block: AtomicU32::new(0),
            engine_blocks: AtomicU64::new(0),
            usage_unasked: AtomicBool::new(false),
        })
    }

    /// Its engine's KV-cache block size in tokens, once scraped.
    pub(crate) fn engine_block(&self) -> Option<u32> {
        Some(self.engine_block.load(Ordering::Relaxed)).filter(|&b| b > 0)
    }

    /// Whether its streams end with token counts even when not asked to.
    pub(crate) fn reports_usage_unasked(&self) -> bool {
        self.usage_unasked.load(Ordering::Relaxed)
    }

    /// What its last stream that did not ask for token counts showed.
    pub(crate) fn note_usage_unasked(&self, reported: bool) {
        self.usage_unasked.store(reported, Ordering::Relaxed);
    }

    /// New metrics of the destination, from a scrape sent at `sent`: sizes
    /// the prefix cache like the server's KV cache when the metrics say how
    /// large it is, and releases the load reserved for requests the metrics
    /// now include.
    pub fn scraped(&self, num_gpu_blocks: Option<u64>, block_size: Option<u32>, sent: Instant) {
        if let (Some(blocks), Some(size)) = (num_gpu_blocks, block_size)
            && blocks > 0
            && size > 0
        {
            let new_size = self.engine_block.swap(size, Ordering::Relaxed) != size;
            let new_count = self.engine_blocks.swap(blocks, Ordering::Relaxed) != blocks;
            let target = blocks_for_kv_cache(blocks, size, self.engine_tokens.get());
            // A new cache is followed at once. The learnt ratio wobbles a
            // little with answers, and a cache shrunk below its contents is
            // rebuilt: it is followed when it moved the size by more than a
            // sixteenth.
            let now = self.prefix.capacity();
            if new_size || new_count || target.abs_diff(now) > now / 16 {
                self.prefix.set_capacity(target);
            }
            self.kv
                .set_capacity(usize::try_from(blocks).unwrap_or(usize::MAX));
        }
        // Here rather than on a request's path: a Pod that receives nothing
        // still has its marks expire.
        self.prefix.expire_reuse();
        self.stats.note_scrape(sent);
    }
}

impl std::fmt::Debug for DestinationState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DestinationState")
            .field("running", &self.stats.running())
            .field("prefix_blocks", &self.prefix.len())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_cache_follows_the_learnt_ratio_only_when_it_moved() {
        let state = DestinationState::new(&DestinationConfig::default());
        state.scraped(Some(1024), Some(16), Instant::now());
        assert_eq!(state.prefix.capacity(), 1024);
        // 3% fewer engine tokens: not worth a rebuild.
        for _ in 0..100 {
            state.engine_tokens.observe(1000, 970);
        }
        state.scraped(Some(1024), Some(16), Instant::now());
        assert_eq!(state.prefix.capacity(), 1024);
        // 0.62 as many (the simulator's dummy tokenizer): 1 / 0.62 the text.
        for _ in 0..100 {
            state.engine_tokens.observe(1000, 620);
        }
        state.scraped(Some(1024), Some(16), Instant::now());
        let coarse = state.prefix.capacity();
        assert!((1640..1660).contains(&coarse), "{coarse}");
        // A cache 2% larger is a new cache: followed at once.
        state.scraped(Some(1044), Some(16), Instant::now());
        assert!(state.prefix.capacity() > coarse);
    }

    #[test]
    fn a_first_scrape_near_the_default_size_is_followed() {
        let state = DestinationState::new(&DestinationConfig::default());
        state.scraped(Some(16_000), Some(16), Instant::now());
        assert_eq!(state.prefix.capacity(), 16_000);
    }
}
