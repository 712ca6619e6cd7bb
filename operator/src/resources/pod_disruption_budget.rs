//! The EPP's PodDisruptionBudget: with more than one replica, a node drain
//! or any other eviction takes one EPP Pod at a time, so the gateway always
//! has one to ask. With one replica there is none: nothing to keep. With
//! replicas left to an HPA there is one, as the count can grow
//! (`maxUnavailable: 1` never blocks a drain of a single replica).

use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kinference_api::InferencePolicy;

use super::deployment::{epp_object_labels, epp_selector};
use super::{Names, object_meta};

pub fn pod_disruption_budget(
    policy: &InferencePolicy,
    names: &Names,
    replicas: Option<i32>,
) -> Option<PodDisruptionBudget> {
    replicas.is_none_or(|r| r > 1).then(|| PodDisruptionBudget {
        metadata: object_meta(policy, &names.epp(), epp_object_labels(names)),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(epp_selector(names)),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        ..PodDisruptionBudget::default()
    })
}

#[cfg(test)]
mod tests {
    use crate::resources::testing::*;
    use crate::resources::{EppSettings, desired};

    #[test]
    fn snapshot() {
        let (mut policy, compiled) = example();
        policy.spec.endpoint_picker = Some(kinference_api::EndpointPickerSpec {
            replicas: Some(3),
            ..Default::default()
        });
        insta::assert_yaml_snapshot!(
            "pod_disruption_budget",
            desired(&policy, &compiled, &settings()).pod_disruption_budget
        );
    }

    #[test]
    fn one_replica_has_no_budget_and_the_policy_overrides_the_operator() {
        let (mut policy, compiled) = example();
        let replicas = |policy: &kinference_api::InferencePolicy| {
            let d = desired(policy, &compiled, &settings());
            let deployment = d.deployment.spec.unwrap().replicas;
            (deployment, d.pod_disruption_budget.is_some())
        };
        // The operator's default (settings(): one replica).
        assert_eq!(replicas(&policy), (Some(1), false));
        policy.spec.endpoint_picker = Some(kinference_api::EndpointPickerSpec {
            replicas: Some(2),
            ..Default::default()
        });
        assert_eq!(replicas(&policy), (Some(2), true));
        // Neither sets a number: the Deployment's is an HPA's to set.
        policy.spec.endpoint_picker = None;
        let hpa = EppSettings {
            replicas: None,
            ..settings()
        };
        let d = desired(&policy, &compiled, &hpa);
        assert_eq!(d.deployment.spec.unwrap().replicas, None);
        assert!(d.pod_disruption_budget.is_some());
    }
}
