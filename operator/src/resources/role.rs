//! The EPP's permissions: as narrow as RBAC can express, and nothing on
//! Secrets or on Pods beyond reading them.
//!
//! The operator can only create a Role granting what it holds itself (RBAC
//! escalation prevention), so every rule here is also in the operator's
//! ClusterRole: keeping these rules small keeps the operator's small too.

use k8s_openapi::api::rbac::v1::{PolicyRule, Role};
use kinference_api::{INFERENCE_POOL_GROUP, InferencePolicy};

use super::deployment::epp_object_labels;
use super::{Names, object_meta};

/// The Inference Extension's experimental group, where InferenceObjective is.
const OBJECTIVE_GROUP: &str = "inference.networking.x-k8s.io";

pub fn role(policy: &InferencePolicy, names: &Names) -> Role {
    let rule = |resources: &str, verbs: &[&str], resource_names: Option<Vec<String>>| PolicyRule {
        api_groups: Some(vec![String::new()]),
        resources: Some(vec![resources.into()]),
        verbs: verbs.iter().map(|v| v.to_string()).collect(),
        resource_names,
        ..PolicyRule::default()
    };
    let mut rules = vec![
        // The EPP discovers model-server Pods by the pool selector.
        rule("pods", &["get", "list", "watch"], None),
        // Only its own policy ConfigMap. (list/watch with resourceNames work
        // when the client uses a metadata.name field selector.)
        rule(
            "configmaps",
            &["get", "list", "watch"],
            Some(vec![names.config_map()]),
        ),
        // Each EPP Pod reports the policy hash it has loaded (and which
        // provider keys it found) under its own key of this one ConfigMap,
        // with a merge patch; it never reads it back. This replaces patching
        // its own Pod: RBAC cannot narrow `patch` to the EPP's Pods, whose
        // names the ReplicaSet generates, so that grant reached every Pod
        // of the namespace (images included).
        rule("configmaps", &["patch"], Some(vec![names.epp_status()])),
    ];
    // An attached policy's EPP reads its pool (list and watch by name).
    if let Some(pool) = &names.attached_pool {
        rules.push(PolicyRule {
            api_groups: Some(vec![INFERENCE_POOL_GROUP.into()]),
            resources: Some(vec!["inferencepools".into()]),
            verbs: vec!["list".into(), "watch".into()],
            resource_names: Some(vec![pool.clone()]),
            ..PolicyRule::default()
        });
    }
    // Requests name an InferenceObjective for their priority; the EPP
    // follows those of its pool's namespace.
    rules.push(PolicyRule {
        api_groups: Some(vec![OBJECTIVE_GROUP.into()]),
        resources: Some(vec!["inferenceobjectives".into()]),
        verbs: vec!["list".into(), "watch".into()],
        ..PolicyRule::default()
    });
    // No Secrets: provider keys are projected into the Pod as files (see
    // deployment.rs), which needs no RBAC.
    Role {
        metadata: object_meta(policy, &names.epp(), epp_object_labels(names)),
        rules: Some(rules),
    }
}

#[cfg(test)]
mod tests {
    use crate::resources::testing::*;
    use crate::resources::{desired, role};

    #[test]
    fn snapshot() {
        let (policy, compiled) = example();
        insta::assert_yaml_snapshot!("role", desired(&policy, &compiled, &settings()).role);
    }

    #[test]
    fn no_secrets_no_pod_writes_and_one_writable_config_map() {
        let (policy, _) = example();
        let rules = role(&policy, &crate::resources::Names::of(&policy))
            .rules
            .unwrap();
        for r in &rules {
            let resource = r.resources.as_ref().unwrap()[0].as_str();
            assert_ne!(resource, "secrets", "{r:?}");
            let writes = r
                .verbs
                .iter()
                .any(|v| !matches!(v.as_str(), "get" | "list" | "watch"));
            if writes {
                // The one write: patch, on the status ConfigMap only.
                assert_eq!(resource, "configmaps", "{r:?}");
                assert_eq!(r.verbs, ["patch"]);
                assert_eq!(r.resource_names, Some(vec!["chat-epp-status".to_string()]));
            }
        }
    }
}
