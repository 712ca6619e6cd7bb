//! A tokenized prompt, to look up in the engines' indexes.

use std::sync::Arc;

use kinference_runtime::sync::lock;

use super::MAX_BLOCKS;
use super::index::{chain_root, token_chain};

/// A chain, keyed by its block size and its root.
type Chains = Vec<(u32, u64, Arc<[u64]>)>;

/// A request's prompt tokens, and its chain per block size (engines may
/// use different ones) and LoRA adapter.
#[derive(Debug)]
pub struct PromptTokens {
    tokens: Vec<u32>,
    /// (block size, chain root) → the chain.
    chains: std::sync::Mutex<Chains>,
}

impl PromptTokens {
    pub fn new(tokens: Vec<u32>) -> PromptTokens {
        PromptTokens {
            tokens,
            chains: Default::default(),
        }
    }

    /// The token ids.
    pub fn ids(&self) -> &[u32] {
        &self.tokens
    }

    /// The chain of full blocks of `block_size` tokens, rooted at the LoRA
    /// adapter the request names (`None`: the base model), as the engine
    /// roots the blocks it stores.
    pub fn chain(&self, block_size: u32, adapter: Option<&str>) -> Arc<[u64]> {
        let root = chain_root(adapter);
        let mut chains = lock(&self.chains);
        if let Some((_, _, c)) = chains
            .iter()
            .find(|(bs, r, _)| *bs == block_size && *r == root)
        {
            return Arc::clone(c);
        }
        let mut out = Vec::new();
        token_chain(
            root,
            &self.tokens,
            block_size as usize,
            MAX_BLOCKS,
            &mut out,
        );
        let chain: Arc<[u64]> = out.into();
        chains.push((block_size, root, Arc::clone(&chain)));
        chain
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_are_cached_per_block_size() {
        let p = PromptTokens::new((0..40).collect());
        assert_eq!(p.chain(16, None).len(), 2);
        assert_eq!(p.chain(8, None).len(), 5);
        assert!(Arc::ptr_eq(&p.chain(16, None), &p.chain(16, None)));
        // An adapter's chain is its own: no block in common with the base's.
        let lora = p.chain(16, Some("sql-lora"));
        assert_eq!(lora.len(), 2);
        assert!(lora.iter().all(|b| !p.chain(16, None).contains(b)));
    }
}
