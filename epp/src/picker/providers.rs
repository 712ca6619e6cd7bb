//! Provider destinations' state, kept per provider name for as long as the
//! loaded policy declares the provider.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kinference_policy::CompiledPolicy;

use crate::predict::{DestinationConfig, DestinationState};
use kinference_runtime::sync::lock;

#[derive(Default)]
pub struct ProviderStates {
    config: DestinationConfig,
    /// The policy hash the map was last pruned for, and the states.
    inner: Mutex<(String, HashMap<String, Arc<DestinationState>>)>,
}

impl ProviderStates {
    /// The state of each provider of `policy`, in its order. A provider the
    /// policy no longer declares is dropped; one it keeps keeps its state
    /// (statistics, breaker) across policy edits.
    pub fn for_policy(&self, policy: &CompiledPolicy) -> Vec<Arc<DestinationState>> {
        let mut inner = lock(&self.inner);
        let (hash, states) = &mut *inner;
        if *hash != policy.hash {
            states.retain(|name, _| policy.providers.iter().any(|p| &p.name == name));
            hash.clone_from(&policy.hash);
        }
        policy
            .providers
            .iter()
            .map(|p| {
                Arc::clone(
                    states
                        .entry(p.name.clone())
                        .or_insert_with(|| DestinationState::new(&self.config)),
                )
            })
            .collect()
    }

    /// Providers tracked now.
    pub fn len(&self) -> usize {
        lock(&self.inner).1.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
