//! Binds the EPP's Role to its ServiceAccount.

use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};
use kinference_api::InferencePolicy;
use kube::ResourceExt;

use super::deployment::epp_object_labels;
use super::{Names, object_meta};

pub fn role_binding(policy: &InferencePolicy, names: &Names) -> RoleBinding {
    RoleBinding {
        metadata: object_meta(policy, &names.epp(), epp_object_labels(names)),
        // roleRef is immutable; it never changes for a given policy name.
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: names.epp(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: names.epp(),
            namespace: policy.namespace(),
            ..Subject::default()
        }]),
    }
}

#[cfg(test)]
mod tests {
    use crate::resources::desired;
    use crate::resources::testing::*;

    #[test]
    fn snapshot() {
        let (policy, compiled) = example();
        insta::assert_yaml_snapshot!(
            "role_binding",
            desired(&policy, &compiled, &settings()).role_binding
        );
    }
}
