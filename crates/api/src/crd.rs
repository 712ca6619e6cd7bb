use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kinference_policy::PolicySpec;
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Routes LLM inference requests to a pool of model servers and off-cluster
/// providers by ordered rules.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kinference.io",
    version = "v1alpha1",
    kind = "InferencePolicy",
    namespaced,
    status = "InferencePolicyStatus",
    shortname = "ipol",
    category = "kinference",
    printcolumn = r#"{"name":"Accepted","type":"string","jsonPath":".status.conditions[?(@.type==\"Accepted\")].status"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Pool","type":"string","jsonPath":".status.pool"}"#,
    printcolumn = r#"{"name":"Rules","type":"integer","jsonPath":".status.rules"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct InferencePolicySpec {
    #[serde(flatten)]
    pub policy: PolicySpec,
}

/// Observed state, written only by the operator.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InferencePolicyStatus {
    /// The generation the conditions describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Accepted`, `ResolvedRefs` and `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Name of the generated InferencePool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Number of rules in the accepted policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules: Option<i32>,
    /// Hash of the accepted policy, as loaded by the EPP when Ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_hash: Option<String>,
}

/// The CRD, with schema details the API server insists on fixed up.
pub fn crd() -> CustomResourceDefinition {
    let mut value = serde_json::to_value(InferencePolicy::crd()).expect("CRD serializes");
    strip_closed_objects(&mut value);
    serde_json::from_value(value).expect("CRD round-trips")
}

/// The CRD as YAML, as committed under `crds/`.
pub fn crd_yaml() -> String {
    let value = serde_json::to_value(crd()).expect("CRD serializes");
    kinference_policy::yaml::to_yaml(&value)
}

/// `deny_unknown_fields` (which makes `kinference lint` catch typos) renders
/// as `additionalProperties: false`, which structural schemas forbid beside
/// `properties`; the API server prunes unknown fields anyway.
fn strip_closed_objects(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            if map.get("additionalProperties") == Some(&serde_json::Value::Bool(false)) {
                map.remove("additionalProperties");
            }
            map.values_mut().for_each(strip_closed_objects);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(strip_closed_objects),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crd_has_no_closed_objects_and_keeps_cel_rules() {
        let text = serde_json::to_string(&crd()).unwrap();
        assert!(!text.contains("\"additionalProperties\":false"));
        assert!(text.contains("must be the last rule"));
        assert!(text.contains("at most one of minimize, maximize and order"));
    }

    #[test]
    fn spec_flattens_the_policy() {
        let p: InferencePolicySpec = serde_json::from_value(serde_json::json!({
            "pool": {"selector": {"app": "vllm"}, "targetPorts": [{"number": 8000}]},
            "rules": [{"name": "all", "route": {"select": [{"minimize": "QueueDepth"}]}}]
        }))
        .unwrap();
        assert_eq!(p.policy.rules.len(), 1);
        assert_eq!(p.policy.pool.target_ports[0].number, 8000);
    }
}
