//! The Inference Extension's `InferenceObjective`
//! (`inference.networking.x-k8s.io/v1alpha2`, as of its v1.5.0 release): a
//! priority for the requests that name it in `x-gateway-inference-objective`.
//! The EPP only reads it; this is the subset it reads
//! (`e2e/fixtures/crds/inference.networking.x-k8s.io_inferenceobjectives.yaml`
//! is the whole schema).

use kube::CustomResource;
use serde::{Deserialize, Serialize};

#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "inference.networking.x-k8s.io",
    version = "v1alpha2",
    kind = "InferenceObjective",
    plural = "inferenceobjectives",
    namespaced,
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct InferenceObjectiveSpec {
    /// Unset means 0, as the reference EPP reads it. Higher is served first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    pub pool_ref: ObjectivePoolRef,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ObjectivePoolRef {
    /// Defaulted by the schema to `inference.networking.k8s.io`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
}

impl InferenceObjective {
    /// Whether it names the pool `name` (in its own namespace, the only
    /// place a pool reference can point).
    pub fn names_pool(&self, name: &str) -> bool {
        let pool = &self.spec.pool_ref;
        let group = pool.group.as_deref().unwrap_or(crate::INFERENCE_POOL_GROUP);
        pool.name == name && group == crate::INFERENCE_POOL_GROUP
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn objective(json: serde_json::Value) -> InferenceObjective {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn an_objective_names_its_pool_by_name_in_the_v1_group() {
        let o = objective(serde_json::json!({
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": {"name": "chat", "namespace": "llm"},
            "spec": {"priority": 2, "poolRef": {"name": "vllm"}},
        }));
        assert_eq!(o.spec.priority, Some(2));
        assert!(o.names_pool("vllm"));
        assert!(!o.names_pool("other"));
        let alpha = objective(serde_json::json!({
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": {"name": "chat"},
            "spec": {"poolRef": {"name": "vllm", "group": "inference.networking.x-k8s.io"}},
        }));
        assert!(
            !alpha.names_pool("vllm"),
            "an x-k8s.io pool is another pool"
        );
        assert_eq!(alpha.spec.priority, None);
    }
}
