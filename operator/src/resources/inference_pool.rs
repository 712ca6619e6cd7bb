//! The `InferencePool` a policy that declares its pool owns
//! ([`kinference_api::InferencePool`]).

use kinference_api::{
    EndpointPickerRef, InferencePolicy, InferencePool, InferencePoolSpec, PoolSelector, PortNumber,
};
use kinference_policy::Pool;

use super::{EPP_GRPC_PORT, Names, object_meta};

pub fn inference_pool(policy: &InferencePolicy, names: &Names, declared: &Pool) -> InferencePool {
    let mut pool = InferencePool::new(
        &names.pool(),
        InferencePoolSpec {
            selector: PoolSelector {
                match_labels: declared.selector.clone(),
            },
            target_ports: declared
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
                // FailClose unless the policy says otherwise: without its
                // EPP the gateway must not route around the policy (e.g.
                // send PII to a provider).
                failure_mode: Some(policy.spec.failure_mode().as_str().into()),
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

    #[test]
    fn the_policy_chooses_the_failure_mode() {
        let (mut policy, compiled) = example();
        let mode = |policy: &kinference_api::InferencePolicy| {
            let pool = desired(policy, &compiled, &settings()).inference_pool;
            pool.unwrap().spec.endpoint_picker_ref.failure_mode
        };
        assert_eq!(mode(&policy).as_deref(), Some("FailClose"));
        policy.spec.endpoint_picker = Some(kinference_api::EndpointPickerSpec {
            failure_mode: Some(kinference_api::FailureMode::FailOpen),
            ..Default::default()
        });
        assert_eq!(mode(&policy).as_deref(), Some("FailOpen"));
    }
}
