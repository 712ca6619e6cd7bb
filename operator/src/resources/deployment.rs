//! The EPP Deployment.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, GRPCAction,
    ObjectFieldSelector, PodSecurityContext, PodSpec, PodTemplateSpec, Probe, ResourceRequirements,
    SeccompProfile, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kinference_api::{InferencePolicy, POLICY_LABEL};

use super::{EppSettings, Names, common_labels, object_meta};

/// ext_proc (gRPC) port, as the reference EPP and GIE gateways expect.
pub const EPP_GRPC_PORT: i32 = 9002;
/// gRPC health (`liveness`, `readiness`, ...).
pub const EPP_HEALTH_PORT: i32 = 9003;
pub const EPP_METRICS_PORT: i32 = 9090;
/// Distroless "nonroot".
const RUN_AS_USER: i64 = 65532;

/// Labels every EPP object carries (the instance label names the policy).
pub(crate) fn epp_object_labels(names: &Names) -> Vec<(String, String)> {
    vec![
        (
            "app.kubernetes.io/name".to_string(),
            "kinference-epp".to_string(),
        ),
        (
            "app.kubernetes.io/component".to_string(),
            "endpoint-picker".to_string(),
        ),
        (
            "app.kubernetes.io/instance".to_string(),
            names.policy.clone(),
        ),
    ]
}

/// The Deployment's selector (immutable once created, so kept minimal) and
/// the EPP Service's selector. It includes `POLICY_LABEL`, which the
/// operator's Pod watch selects on to notice a loaded-policy annotation.
pub fn epp_selector(names: &Names) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "app.kubernetes.io/name".to_string(),
            "kinference-epp".to_string(),
        ),
        (POLICY_LABEL.to_string(), names.policy.clone()),
    ])
}

pub fn deployment(policy: &InferencePolicy, names: &Names, epp: &EppSettings) -> Deployment {
    let epp_name = names.epp();
    let mut pod_labels = common_labels(&names.policy);
    pod_labels.extend(epp_object_labels(names));
    pod_labels.extend(epp_selector(names));
    let ns = policy.metadata.namespace.clone().unwrap_or_default();

    let field_env = |name: &str, path: &str| EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    };
    let port = |name: &str, number: i32| ContainerPort {
        name: Some(name.into()),
        container_port: number,
        protocol: Some("TCP".into()),
        ..ContainerPort::default()
    };
    let grpc_probe = |service: &str, period: i32| Probe {
        grpc: Some(GRPCAction {
            port: EPP_HEALTH_PORT,
            service: Some(service.into()),
        }),
        period_seconds: Some(period),
        failure_threshold: Some(3),
        timeout_seconds: Some(1),
        ..Probe::default()
    };
    let quantity = |s: &str| Quantity(s.into());

    let container = Container {
        name: "epp".into(),
        image: Some(epp.image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        args: Some(vec![
            format!("--policy-configmap={}", names.config_map()),
            format!("--namespace={ns}"),
            // Expanded by the kubelet from the downward-API env below: the EPP
            // annotates its own Pod with the policy hash it has loaded.
            "--pod-name=$(POD_NAME)".into(),
        ]),
        env: Some(vec![
            field_env("POD_NAME", "metadata.name"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
        ]),
        ports: Some(vec![
            port("grpc", EPP_GRPC_PORT),
            port("grpc-health", EPP_HEALTH_PORT),
            port("metrics", EPP_METRICS_PORT),
        ]),
        readiness_probe: Some(grpc_probe("readiness", 5)),
        liveness_probe: Some(grpc_probe("liveness", 10)),
        // No CPU limit: the EPP sits on every request's latency path and CFS
        // throttling would show up as TTFT; the memory limit bounds a leak.
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), quantity("250m")),
                ("memory".to_string(), quantity("256Mi")),
            ])),
            limits: Some(BTreeMap::from([("memory".to_string(), quantity("1Gi"))])),
            ..ResourceRequirements::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Capabilities::default()
            }),
            ..SecurityContext::default()
        }),
        // The root filesystem is read-only; /tmp is the one writable place
        // (e.g. for a generated self-signed certificate).
        volume_mounts: Some(vec![VolumeMount {
            name: "tmp".into(),
            mount_path: "/tmp".into(),
            ..VolumeMount::default()
        }]),
        ..Container::default()
    };

    Deployment {
        metadata: object_meta(policy, &epp_name, epp_object_labels(names)),
        spec: Some(DeploymentSpec {
            replicas: Some(epp.replicas),
            selector: LabelSelector {
                match_labels: Some(epp_selector(names)),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                // Deliberately no policy hash here: the EPP reloads its policy
                // from the ConfigMap, so a policy change must not roll Pods.
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(epp_name.clone()),
                    containers: vec![container],
                    security_context: Some(PodSecurityContext {
                        run_as_non_root: Some(true),
                        run_as_user: Some(RUN_AS_USER),
                        run_as_group: Some(RUN_AS_USER),
                        seccomp_profile: Some(SeccompProfile {
                            type_: "RuntimeDefault".into(),
                            ..SeccompProfile::default()
                        }),
                        ..PodSecurityContext::default()
                    }),
                    volumes: Some(vec![Volume {
                        name: "tmp".into(),
                        empty_dir: Some(EmptyDirVolumeSource::default()),
                        ..Volume::default()
                    }]),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use crate::resources::desired;
    use crate::resources::testing::*;

    #[test]
    fn snapshot() {
        let (policy, compiled) = example();
        let d = desired(&policy, &compiled, &settings()).deployment;
        insta::assert_yaml_snapshot!("deployment", d);
    }

    #[test]
    fn selector_is_a_subset_of_the_pod_labels() {
        let (policy, compiled) = example();
        let d = desired(&policy, &compiled, &settings()).deployment;
        let spec = d.spec.unwrap();
        let selector = spec.selector.match_labels.unwrap();
        let labels = spec.template.metadata.unwrap().labels.unwrap();
        for (k, v) in &selector {
            assert_eq!(labels.get(k), Some(v), "{k}");
        }
    }
}
