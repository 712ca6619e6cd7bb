//! The pool's InferenceObjectives: the priority of the requests that name
//! one in `x-gateway-inference-objective`, as the reference EPP reads them
//! (an objective the EPP does not know, or none, is priority 0).

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use futures::StreamExt;
use kinference_api::InferenceObjective;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

/// The header a request names its objective in (the reference EPP's).
pub(crate) const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// The header a request names its flow in: flows of one priority take
/// turns (the reference EPP's).
pub(crate) const FAIRNESS_HEADER: &str = "x-gateway-inference-fairness-id";

/// Priorities by objective name.
#[derive(Default)]
pub struct Objectives {
    by_name: ArcSwap<HashMap<String, i32>>,
}

impl Objectives {
    /// The priority of the objective `name`; 0 for none or an unknown one.
    pub fn priority(&self, name: Option<&str>) -> i32 {
        name.and_then(|n| self.by_name.load().get(n).copied())
            .unwrap_or(0)
    }

    pub fn replace(&self, by_name: HashMap<String, i32>) {
        self.by_name.store(Arc::new(by_name));
    }

    pub fn len(&self) -> usize {
        self.by_name.load().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn update(&self, change: impl FnOnce(&mut HashMap<String, i32>)) {
        let mut next = HashMap::clone(&self.by_name.load());
        change(&mut next);
        self.replace(next);
    }

    /// An objective was added or changed: kept if it names `pool`, dropped
    /// if it no longer does.
    fn apply(&self, objective: &InferenceObjective, pool: &str) {
        let name = objective.name_any();
        let priority = objective.spec.priority.unwrap_or(0);
        let ours = objective.names_pool(pool);
        self.update(|m| {
            if ours {
                m.insert(name, priority);
            } else {
                m.remove(&name);
            }
        });
    }
}

/// Follows the InferenceObjectives of `namespace` that name `pool`. Without
/// the CRD, or without the right to list it, every request stays at
/// priority 0 and the watch keeps retrying: priorities are an addition,
/// never a reason to stop routing.
pub async fn watch_objectives(
    objectives: Arc<Objectives>,
    client: Client,
    namespace: String,
    pool: String,
) {
    let api: Api<InferenceObjective> = Api::namespaced(client, &namespace);
    let mut stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut listing: Option<HashMap<String, i32>> = None;
    let mut warned = false;
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Init) => listing = Some(HashMap::new()),
            Ok(watcher::Event::InitApply(o)) => {
                if let Some(m) = listing.as_mut()
                    && o.names_pool(&pool)
                {
                    m.insert(o.name_any(), o.spec.priority.unwrap_or(0));
                }
            }
            Ok(watcher::Event::InitDone) => {
                let listed = listing.take().unwrap_or_default();
                tracing::info!(%namespace, %pool, objectives = listed.len(), "InferenceObjectives listed");
                objectives.replace(listed);
                warned = false;
            }
            Ok(watcher::Event::Apply(o)) => objectives.apply(&o, &pool),
            Ok(watcher::Event::Delete(o)) => objectives.update(|m| {
                m.remove(&o.name_any());
            }),
            Err(error) if !warned => {
                warned = true;
                tracing::warn!(%namespace, %error, "cannot watch InferenceObjectives (is the CRD installed?): requests keep priority 0 until it can");
            }
            Err(error) => tracing::debug!(%namespace, %error, "InferenceObjective watch error"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn objective(name: &str, pool: &str, priority: Option<i32>) -> InferenceObjective {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": {"name": name},
            "spec": {"priority": priority, "poolRef": {"name": pool}},
        }))
        .unwrap()
    }

    #[test]
    fn an_unknown_or_missing_objective_is_priority_zero() {
        let o = Objectives::default();
        o.apply(&objective("chat", "vllm", Some(5)), "vllm");
        assert_eq!(o.priority(Some("chat")), 5);
        assert_eq!(o.priority(Some("batch")), 0);
        assert_eq!(o.priority(None), 0);
    }

    #[test]
    fn an_objective_moved_to_another_pool_is_forgotten() {
        let o = Objectives::default();
        o.apply(&objective("chat", "vllm", Some(5)), "vllm");
        o.apply(&objective("chat", "other", Some(5)), "vllm");
        assert_eq!(o.priority(Some("chat")), 0);
        assert!(o.is_empty());
        o.apply(&objective("unset", "vllm", None), "vllm");
        assert_eq!(o.len(), 1);
        assert_eq!(o.priority(Some("unset")), 0);
    }
}
