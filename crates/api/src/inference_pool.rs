//! The Gateway API Inference Extension's `InferencePool`
//! (`inference.networking.k8s.io/v1`), which the operator writes and a
//! standalone EPP reads. The gateway-api crate does not carry it, so this is
//! a small typed subset of the upstream v1 schema
//! (`shared/fixtures/crds/inference.networking.k8s.io_inferencepools.yaml`):
//! the fields Kinference sets or reads. Unknown fields in objects read back
//! (status, defaults) are ignored by serde.

use std::collections::BTreeMap;

use kube::CustomResource;
use serde::{Deserialize, Serialize};

#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "inference.networking.k8s.io",
    version = "v1",
    kind = "InferencePool",
    plural = "inferencepools",
    namespaced,
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    pub selector: PoolSelector,
    pub target_ports: Vec<PortNumber>,
    pub endpoint_picker_ref: EndpointPickerRef,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PortNumber {
    pub number: i32,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    /// Empty (core) group and kind `Service` are the schema defaults; they
    /// are left to the server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<PortNumber>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
}

impl InferencePoolSpec {
    /// The target ports as TCP ports, in their order (which names the
    /// data-parallel ranks); a number out of range, which the schema
    /// refuses, is left out.
    pub fn ports(&self) -> Vec<u16> {
        self.target_ports
            .iter()
            .filter_map(|p| u16::try_from(p.number).ok().filter(|&n| n > 0))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_upstream_shape_and_ignores_what_it_does_not_use() {
        let pool: InferencePool = serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": { "name": "vllm", "namespace": "llm" },
            "spec": {
                "selector": { "matchLabels": { "app": "vllm" } },
                "targetPorts": [{ "number": 8000 }, { "number": 8001 }, { "number": 70000 }],
                "endpointPickerRef": { "name": "vllm-epp", "port": { "number": 9002 }, "failureMode": "FailOpen" }
            },
            "status": { "parents": [] }
        }))
        .unwrap();
        assert_eq!(pool.spec.selector.match_labels["app"], "vllm");
        assert_eq!(pool.spec.ports(), [8000, 8001]);
        assert_eq!(pool.spec.endpoint_picker_ref.name, "vllm-epp");
        assert_eq!(
            pool.spec.endpoint_picker_ref.failure_mode.as_deref(),
            Some("FailOpen")
        );
    }
}
