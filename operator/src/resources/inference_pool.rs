//! The Gateway API Inference Extension `InferencePool`
//! (`inference.networking.k8s.io/v1`). The gateway-api crate does not carry
//! it, so this is a small typed subset of the upstream v1 schema
//! (`e2e/fixtures/crds/inference.networking.k8s.io_inferencepools.yaml`):
//! only the fields the operator sets. Unknown fields in objects read back
//! (status, defaults) are ignored by serde.

use std::collections::BTreeMap;

use kinference_api::InferencePolicy;
use kinference_policy::CompiledPolicy;
use kube::CustomResource;
use serde::{Deserialize, Serialize};

use super::{EPP_GRPC_PORT, Names, object_meta};

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

pub fn inference_pool(
    policy: &InferencePolicy,
    names: &Names,
    compiled: &CompiledPolicy,
) -> InferencePool {
    let mut pool = InferencePool::new(
        &names.pool(),
        InferencePoolSpec {
            selector: PoolSelector {
                match_labels: compiled.pool.selector.clone(),
            },
            target_ports: compiled
                .pool
                .target_ports
                .iter()
                .map(|&number| PortNumber {
                    number: number.into(),
                })
                .collect(),
            endpoint_picker_ref: EndpointPickerRef {
                group: None,
                kind: None,
                name: names.epp(),
                port: Some(PortNumber {
                    number: EPP_GRPC_PORT,
                }),
                // Without its EPP the gateway must not route around the
                // policy (e.g. send PII to a provider): fail closed.
                failure_mode: Some("FailClose".into()),
            },
        },
    );
    pool.metadata = object_meta(policy, &names.pool(), []);
    pool
}

#[cfg(test)]
mod tests {
    use crate::resources::desired;
    use crate::resources::testing::*;

    #[test]
    fn snapshot() {
        let (policy, compiled) = example();
        insta::assert_yaml_snapshot!(
            "inference_pool",
            desired(&policy, &compiled, &settings()).inference_pool
        );
    }
}
