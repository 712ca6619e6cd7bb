//! The ConfigMap the EPP loads its policy from.
//!
//! `policy.json` is the validated source spec, not a compiled form: the EPP
//! compiles it again with the same library, so there is no second wire format
//! to keep in sync. It is compact JSON, i.e. exactly the bytes
//! `kinference_policy::policy_hash` digests, so `policy.sha256` is both the
//! hash of the spec and the SHA-256 of the `policy.json` text.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use kinference_api::{InferencePolicy, POLICY_HASH_KEY, POLICY_KEY};
use kinference_policy::CompiledPolicy;

use super::{COMPONENT_LABEL, EPP_STATUS_COMPONENT, Names, object_meta};
use crate::error::TooLarge;

/// What the API server accepts in one ConfigMap: the keys and values of
/// `data` and `binaryData` together (its validation's `MaxSecretSize`).
pub const MAX_CONFIG_MAP_BYTES: usize = 1024 * 1024;

/// Refuses a ConfigMap the API server would reject for its size, before any
/// object is applied, with the sizes in the message.
pub fn check_config_map_size(cm: &ConfigMap) -> Result<(), TooLarge> {
    let text: usize = cm
        .data
        .iter()
        .flatten()
        .map(|(k, v)| k.len() + v.len())
        .sum();
    let binary: usize = cm
        .binary_data
        .iter()
        .flatten()
        .map(|(k, v)| k.len() + v.0.len())
        .sum();
    let bytes = text + binary;
    if bytes <= MAX_CONFIG_MAP_BYTES {
        return Ok(());
    }
    Err(TooLarge {
        kind: "ConfigMap".into(),
        object: format!(
            "{}/{}",
            cm.metadata.namespace.as_deref().unwrap_or_default(),
            cm.metadata.name.as_deref().unwrap_or_default()
        ),
        bytes,
        limit: MAX_CONFIG_MAP_BYTES,
    })
}

/// The EPP status ConfigMap, without `data`: the EPP Pods own its keys (one
/// each, see [`kinference_api::EppPodStatus`]). Applying it without `data`
/// is what keeps the operator's field manager from owning, and so from ever
/// removing, what the Pods wrote.
pub fn epp_status_config_map(policy: &InferencePolicy, names: &Names) -> ConfigMap {
    ConfigMap {
        metadata: object_meta(
            policy,
            &names.epp_status(),
            [(
                COMPONENT_LABEL.to_string(),
                EPP_STATUS_COMPONENT.to_string(),
            )],
        ),
        ..ConfigMap::default()
    }
}

pub fn config_map(policy: &InferencePolicy, names: &Names, compiled: &CompiledPolicy) -> ConfigMap {
    let json = serde_json::to_string(&compiled.source).expect("a policy spec always serializes");
    ConfigMap {
        metadata: object_meta(
            policy,
            &names.config_map(),
            [(
                "app.kubernetes.io/component".to_string(),
                "policy".to_string(),
            )],
        ),
        data: Some(BTreeMap::from([
            (POLICY_KEY.to_string(), json),
            (POLICY_HASH_KEY.to_string(), compiled.hash.clone()),
        ])),
        ..ConfigMap::default()
    }
}

#[cfg(test)]
mod tests {
    use kinference_api::{POLICY_HASH_KEY, POLICY_KEY};
    use kinference_policy::PolicySpec;
    use sha2::{Digest, Sha256};

    use crate::resources::desired;
    use crate::resources::testing::*;

    #[test]
    fn an_oversized_config_map_is_refused_with_its_size_and_the_limit() {
        let (policy, compiled) = example();
        let mut cm = desired(&policy, &compiled, &settings()).config_map;
        assert!(super::check_config_map_size(&cm).is_ok());
        let data = cm.data.get_or_insert_default();
        data.insert(
            "policy.json".into(),
            "x".repeat(super::MAX_CONFIG_MAP_BYTES),
        );
        let error = super::check_config_map_size(&cm).unwrap_err().to_string();
        insta::assert_snapshot!(error);
    }

    #[test]
    fn round_trips_to_the_same_hash() {
        let (policy, compiled) = example();
        let cm = desired(&policy, &compiled, &settings()).config_map;
        let data = cm.data.unwrap();
        let spec: PolicySpec = serde_json::from_str(&data[POLICY_KEY]).unwrap();
        let again = kinference_policy::compile(&spec).unwrap();
        assert_eq!(again.hash, data[POLICY_HASH_KEY]);
        assert_eq!(again.hash, compiled.hash);
        let text_hash: String = Sha256::digest(data[POLICY_KEY].as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(text_hash, compiled.hash);
    }

    #[test]
    fn snapshot() {
        let (policy, compiled) = example();
        let cm = desired(&policy, &compiled, &settings()).config_map;
        insta::assert_yaml_snapshot!("config_map", cm);
    }

    #[test]
    fn the_status_config_map_carries_no_data() {
        let (policy, compiled) = example();
        let cm = desired(&policy, &compiled, &settings()).epp_status_config_map;
        assert_eq!(cm.metadata.name.as_deref(), Some("chat-epp-status"));
        // Sent as the apply body: no `data` (nor `binaryData`) key at all,
        // not even an empty one, which would claim ownership of the map.
        let body = serde_json::to_value(&cm).unwrap();
        let keys: Vec<&String> = body.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["apiVersion", "kind", "metadata"], "{body}");
    }
}
