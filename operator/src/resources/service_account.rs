//! The EPP's own identity, bound to its Role only.

use k8s_openapi::api::core::v1::ServiceAccount;
use kinference_api::InferencePolicy;

use super::deployment::epp_object_labels;
use super::{Names, object_meta};

pub fn service_account(policy: &InferencePolicy, names: &Names) -> ServiceAccount {
    ServiceAccount {
        metadata: object_meta(policy, &names.epp(), epp_object_labels(names)),
        ..ServiceAccount::default()
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
            "service_account",
            desired(&policy, &compiled, &settings()).service_account
        );
    }
}
