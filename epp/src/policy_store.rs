//! The policy the EPP serves: swapped atomically, never replaced by one that
//! fails to compile (the last good policy keeps serving).

use std::sync::{Arc, Mutex};

use arc_swap::ArcSwapOption;
use kinference_policy::{CompiledPolicy, PolicySpec, compile};
use kinference_runtime::sync::lock;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;

/// What `--pool-name` serves when given no policy: a rules-only policy
/// (the pool is the InferencePool's).
pub const DEFAULT_POLICY: &str = include_str!("../policies/default.yaml");

/// A compiled policy as the EPP serves it.
pub struct LoadedPolicy {
    pub compiled: CompiledPolicy,
}

impl LoadedPolicy {
    pub fn new(compiled: CompiledPolicy) -> Self {
        LoadedPolicy { compiled }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadState {
    Empty,
    Loaded {
        hash: String,
    },
    /// The newest input was refused; `serving` is still in force.
    Refused {
        serving: Option<String>,
        error: String,
    },
}

pub struct PolicyStore {
    current: ArcSwapOption<LoadedPolicy>,
    state: Mutex<LoadState>,
    changes: watch::Sender<Option<String>>,
    /// Inputs refused (`kinference_epp_policy_refusals_total`).
    refusals: Counter,
}

impl Default for PolicyStore {
    fn default() -> Self {
        PolicyStore {
            current: ArcSwapOption::empty(),
            state: Mutex::new(LoadState::Empty),
            changes: watch::channel(None).0,
            refusals: Counter::default(),
        }
    }
}

impl PolicyStore {
    pub fn current(&self) -> Option<Arc<LoadedPolicy>> {
        self.current.load_full()
    }

    pub fn loaded_hash(&self) -> Option<String> {
        self.current().map(|p| p.compiled.hash.clone())
    }

    pub fn state(&self) -> LoadState {
        lock(&self.state).clone()
    }

    /// Notified with the hash each time a new policy takes effect.
    pub fn subscribe(&self) -> watch::Receiver<Option<String>> {
        self.changes.subscribe()
    }

    /// The refusal counter, to register with the metrics.
    pub(crate) fn refusals(&self) -> Counter {
        self.refusals.clone()
    }

    /// Records that the newest input could not even be read; the last good
    /// policy keeps serving.
    pub fn refuse(&self, error: String) {
        let _ = self.apply(Err(error));
    }

    /// Loads the operator's ConfigMap payload (the policy spec as JSON).
    pub fn load_json(&self, json: &str) -> Result<String, String> {
        let spec = serde_json::from_str::<PolicySpec>(json)
            .map_err(|e| format!("the policy is not valid JSON for a policy spec: {e}"));
        self.apply(spec.and_then(|s| compile(&s).map_err(|e| e.to_string())))
    }

    /// Loads a policy file (YAML or JSON; bare or an InferencePolicy).
    pub fn load_text(&self, text: &str) -> Result<String, String> {
        let compiled = kinference_policy::source::compile_text(text).map_err(|errors| {
            errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        });
        self.apply(compiled)
    }

    pub fn install(&self, compiled: CompiledPolicy) -> String {
        self.apply(Ok(compiled))
            .expect("an already compiled policy installs")
    }

    fn apply(&self, compiled: Result<CompiledPolicy, String>) -> Result<String, String> {
        let mut state = lock(&self.state);
        match compiled {
            Ok(compiled) => {
                let hash = compiled.hash.clone();
                if self.loaded_hash().as_deref() != Some(hash.as_str()) {
                    // In-flight requests keep the Arc they loaded; new ones see this.
                    self.current
                        .store(Some(Arc::new(LoadedPolicy::new(compiled))));
                    self.changes.send_replace(Some(hash.clone()));
                }
                *state = LoadState::Loaded { hash: hash.clone() };
                Ok(hash)
            }
            Err(error) => {
                self.refusals.inc();
                tracing::warn!(%error, "refusing a new policy; the last good one keeps serving");
                *state = LoadState::Refused {
                    serving: self.loaded_hash(),
                    error: error.clone(),
                };
                Err(error)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "pool: { selector: { app: x }, targetPorts: [{ number: 8000 }] }\nrules:\n  - name: r\n    route: { select: [{ minimize: QueueDepth }] }\n";

    #[test]
    fn the_default_policy_is_rules_only_and_minimizes_predicted_ttft() {
        let store = PolicyStore::default();
        store.load_text(DEFAULT_POLICY).unwrap();
        let policy = store.current().unwrap();
        assert!(policy.compiled.pool.is_none());
        let rules: Vec<&str> = policy
            .compiled
            .rules
            .iter()
            .map(|r| r.name.as_str())
            .collect();
        assert_eq!(rules, ["adapter", "default"]);
        assert!(kinference_policy::lint::warnings(&policy.compiled).is_empty());
    }

    #[test]
    fn keeps_the_last_good_policy_when_a_new_one_fails() {
        let store = PolicyStore::default();
        let hash = store.load_text(GOOD).unwrap();
        let err = store
            .load_text("rules: [{ name: r, route: {} }]")
            .unwrap_err();
        assert!(err.contains("select is required"), "{err}");
        assert_eq!(store.loaded_hash(), Some(hash.clone()));
        assert!(matches!(store.state(), LoadState::Refused { serving: Some(h), .. } if h == hash));
        assert!(store.load_json("{not json").is_err());
        assert_eq!(store.loaded_hash(), Some(hash));
        assert_eq!(store.refusals().get(), 2);
    }
}
