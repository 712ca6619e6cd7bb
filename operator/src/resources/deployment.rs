//! The EPP Deployment.
//!
//! Provider API keys reach the EPP as files: the Secrets the policy names are
//! projected into the Pod (only the keys it names, `optional` so a missing
//! one does not stop the Pod) and read with `--provider-secrets-dir`. The
//! kubelet mounts them, so neither the operator nor the EPP needs any RBAC
//! on Secrets. The price: a rotated key reaches the EPP when the kubelet
//! refreshes the volume (about a minute), and a change in the set of
//! Secrets the policy names rolls the EPP Pods.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, GRPCAction,
    ImageVolumeSource, KeyToPath, ObjectFieldSelector, PodSecurityContext, PodSpec,
    PodTemplateSpec, Probe, ProjectedVolumeSource, ResourceRequirements, SeccompProfile,
    SecretProjection, SecretVolumeSource, SecurityContext, TopologySpreadConstraint, Volume,
    VolumeMount, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kinference_api::{EndpointPickerSpec, EppLogFormat, InferencePolicy, POLICY_LABEL};
use kinference_policy::CompiledPolicy;
use kinference_policy::spec::DEFAULT_SECRET_KEY;

use super::{EppSettings, Names, common_labels, object_meta};

/// ext_proc (gRPC) port, as the reference EPP and GIE gateways expect.
pub const EPP_GRPC_PORT: i32 = 9002;
/// gRPC health (`liveness`, `readiness`, ...).
pub const EPP_HEALTH_PORT: i32 = 9003;
pub const EPP_METRICS_PORT: i32 = 9090;
/// Distroless "nonroot".
const RUN_AS_USER: i64 = 65532;
/// Where the provider Secrets are projected, as `<secret>/<key>`.
pub const PROVIDER_SECRETS_DIR: &str = "/var/run/kinference/provider-secrets";
/// Where the gateways' client CA is mounted (mTLS on ext_proc).
pub const CLIENT_CA_DIR: &str = "/etc/kinference/client-ca";
pub const CLIENT_CA_FILE: &str = "ca.crt";
/// Where the tokenizer image of precise prefix mode is mounted.
pub const TOKENIZER_DIR: &str = "/var/run/kinference/tokenizer";
/// Owner and group read only; the group is the Pod's fsGroup, the EPP's.
const SECRET_FILE_MODE: i32 = 0o440;

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

/// The Secret keys `compiled`'s providers read, by Secret.
fn provider_secret_keys(compiled: &CompiledPolicy) -> BTreeMap<String, BTreeSet<String>> {
    let mut keys: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for secret in compiled.providers.iter().filter_map(|p| p.secret.as_ref()) {
        if secret.name.is_empty() {
            continue;
        }
        keys.entry(secret.name.clone()).or_default().insert(
            secret
                .key
                .clone()
                .unwrap_or_else(|| DEFAULT_SECRET_KEY.to_string()),
        );
    }
    keys
}

pub fn deployment(
    policy: &InferencePolicy,
    names: &Names,
    epp: &EppSettings,
    compiled: &CompiledPolicy,
) -> Deployment {
    let epp_name = names.epp();
    let mut pod_labels = common_labels(&names.policy);
    pod_labels.extend(epp_object_labels(names));
    pod_labels.extend(epp_selector(names));
    let tuned = policy.spec.endpoint_picker().cloned().unwrap_or_default();
    let mut parts = PodParts::new(policy, names);
    parts.provider_secrets(compiled);
    parts.client_ca(policy);
    parts.tuning(&tuned);
    parts.precise_prefix(policy);
    let PodParts {
        args,
        mounts,
        volumes,
        ports,
    } = parts;
    let container = Container {
        args: Some(args),
        ports: Some(ports),
        volume_mounts: Some(mounts),
        ..epp_container(&epp.image, &tuned)
    };
    Deployment {
        metadata: object_meta(policy, &epp_name, epp_object_labels(names)),
        spec: Some(DeploymentSpec {
            // Unset: not ours, so server-side apply leaves an HPA's number.
            replicas: epp.replicas_for(policy),
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
                    volumes: Some(volumes),
                    ..pod_spec(names, &tuned)
                }),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    }
}

/// What the EPP container's arguments, mounts and ports, and the Pod's
/// volumes, are made of: each feature of the policy adds its own.
struct PodParts {
    args: Vec<String>,
    mounts: Vec<VolumeMount>,
    volumes: Vec<Volume>,
    ports: Vec<ContainerPort>,
}

impl PodParts {
    /// What every EPP has: its policy, status and provider-key sources, and
    /// a writable /tmp.
    fn new(policy: &InferencePolicy, names: &Names) -> PodParts {
        let ns = policy.metadata.namespace.clone().unwrap_or_default();
        let mut args = vec![
            format!("--policy-configmap={}", names.config_map()),
            format!("--namespace={ns}"),
            // Expanded by the kubelet from the downward-API env below: the EPP
            // reports the policy hash it has loaded under its own Pod name.
            "--pod-name=$(POD_NAME)".into(),
            format!("--status-configmap={}", names.epp_status()),
            // Always files, never the API: the EPP's Role grants no Secrets.
            format!("--provider-secrets-dir={PROVIDER_SECRETS_DIR}"),
            // The Inference Extension's `inference_pool_*` series name the pool.
            format!("--metrics-pool-name={}", names.pool()),
        ];
        // An attached policy has no pool of its own: the EPP follows the
        // existing InferencePool's selector and target ports.
        if let Some(pool) = &names.attached_pool {
            args.push(format!("--pool-name={pool}"));
            args.push(format!("--pool-namespace={ns}"));
        }
        // The root filesystem is read-only; /tmp is the one writable place
        // (e.g. for a generated self-signed certificate).
        PodParts {
            args,
            mounts: vec![mount("tmp", "/tmp", false)],
            volumes: vec![Volume {
                name: "tmp".into(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Volume::default()
            }],
            ports: vec![
                port("grpc", EPP_GRPC_PORT),
                port("grpc-health", EPP_HEALTH_PORT),
                port("metrics", EPP_METRICS_PORT),
            ],
        }
    }

    /// The provider keys the policy reads, projected as files.
    fn provider_secrets(&mut self, compiled: &CompiledPolicy) {
        let secret_keys = provider_secret_keys(compiled);
        if secret_keys.is_empty() {
            return;
        }
        self.mounts
            .push(mount("provider-secrets", PROVIDER_SECRETS_DIR, true));
        self.volumes.push(Volume {
            name: "provider-secrets".into(),
            projected: Some(ProjectedVolumeSource {
                default_mode: Some(SECRET_FILE_MODE),
                sources: Some(
                    secret_keys
                        .iter()
                        .map(|(secret, keys)| VolumeProjection {
                            secret: Some(SecretProjection {
                                name: secret.clone(),
                                // The EPP reports a missing key; the Pod
                                // must not wait for it.
                                optional: Some(true),
                                items: Some(
                                    keys.iter()
                                        .map(|key| KeyToPath {
                                            key: key.clone(),
                                            path: format!("{secret}/{key}"),
                                            mode: None,
                                        })
                                        .collect(),
                                ),
                            }),
                            ..VolumeProjection::default()
                        })
                        .collect(),
                ),
            }),
            ..Volume::default()
        });
    }

    /// The gateways' client CA, for mTLS on ext_proc.
    fn client_ca(&mut self, policy: &InferencePolicy) {
        let Some(ca) = policy.spec.client_ca() else {
            return;
        };
        self.args
            .push(format!("--client-ca-file={CLIENT_CA_DIR}/{CLIENT_CA_FILE}"));
        self.mounts.push(mount("client-ca", CLIENT_CA_DIR, true));
        self.volumes.push(Volume {
            name: "client-ca".into(),
            // Not optional: without its CA the EPP could not start, and a
            // Pod stuck on the mount says why in its Events.
            secret: Some(SecretVolumeSource {
                secret_name: Some(ca.secret_name.clone()),
                items: Some(vec![KeyToPath {
                    key: ca.key().to_string(),
                    path: CLIENT_CA_FILE.into(),
                    mode: None,
                }]),
                default_mode: Some(SECRET_FILE_MODE),
                optional: None,
            }),
            ..Volume::default()
        });
    }

    /// `spec.endpointPicker`'s log format, decision log and scrape interval.
    fn tuning(&mut self, tuned: &EndpointPickerSpec) {
        if tuned.log_format == Some(EppLogFormat::Text) {
            self.args.push("--log-format=text".into());
        }
        if let Some(bytes) = tuned.decision_log.as_ref().and_then(decision_log_bytes) {
            self.args.push(format!(
                "--decision-log={DECISION_LOG_DIR}/{DECISION_LOG_FILE}"
            ));
            self.args.push(format!("--decision-log-max-bytes={bytes}"));
            if let Some(sample) = tuned.decision_log.as_ref().and_then(|d| d.sample) {
                self.args.push(format!("--decision-log-sample={sample}"));
            }
            self.mounts
                .push(mount("decision-log", DECISION_LOG_DIR, false));
            self.volumes.push(Volume {
                name: "decision-log".into(),
                empty_dir: Some(EmptyDirVolumeSource {
                    // The log's own bound, and room for the write buffer: the
                    // kubelet evicts a Pod over its volume's limit.
                    size_limit: Some(Quantity((bytes + (1 << 20)).to_string())),
                    ..EmptyDirVolumeSource::default()
                }),
                ..Volume::default()
            });
        }
        if let Some(interval) = tuned
            .scrape_interval
            .as_deref()
            .and_then(scrape_interval_ms)
        {
            self.args.push(format!("--scrape-interval-ms={interval}"));
        }
    }

    /// Precise prefix mode: the events flags and ports, and the tokenizer.
    fn precise_prefix(&mut self, policy: &InferencePolicy) {
        let Some(precise) = policy.spec.precise_prefix() else {
            return;
        };
        let args = &mut self.args;
        args.push(format!("--kv-events-port={}", precise.events_port()));
        args.push(format!("--kv-events-tokenizer={TOKENIZER_DIR}"));
        if !precise.epp_listens() {
            args.push("--kv-events-dial".into());
        }
        if precise.data_parallel_size() > 1 {
            args.push(format!(
                "--kv-events-data-parallel-size={}",
                precise.data_parallel_size()
            ));
        }
        if let Some(budget) = &precise.tokenize_budget {
            args.push(format!("--kv-events-tokenize-budget={budget}"));
        }
        if let Some(port) = precise.replay_port {
            args.push(format!("--kv-events-replay-port={port}"));
        }
        // An image volume: read-only, pulled and cached by the kubelet like
        // any image, with the Pod's pull secrets; no init container copying
        // 11 MB into an emptyDir, and no download from a model hub at start.
        self.mounts.push(VolumeMount {
            sub_path: precise.tokenizer.path.clone().filter(|p| !p.is_empty()),
            ..mount("tokenizer", TOKENIZER_DIR, true)
        });
        self.volumes.push(Volume {
            name: "tokenizer".into(),
            image: Some(ImageVolumeSource {
                reference: Some(precise.tokenizer.image.clone()),
                pull_policy: Some("IfNotPresent".into()),
            }),
            ..Volume::default()
        });
        self.ports.extend(
            super::events_ports(precise)
                .iter()
                .map(|(name, number)| port(name, *number)),
        );
    }
}

/// The EPP container but for its arguments, ports and mounts.
fn epp_container(image: &str, tuned: &EndpointPickerSpec) -> Container {
    Container {
        name: "epp".into(),
        image: Some(image.to_string()),
        image_pull_policy: Some("IfNotPresent".into()),
        env: Some(
            [
                Some(field_env("POD_NAME", "metadata.name")),
                Some(field_env("POD_NAMESPACE", "metadata.namespace")),
                tuned.log_level.map(|level| EnvVar {
                    name: "RUST_LOG".into(),
                    value: Some(level.as_str().into()),
                    ..EnvVar::default()
                }),
            ]
            .into_iter()
            .flatten()
            .collect(),
        ),
        readiness_probe: Some(grpc_probe("readiness", 5)),
        liveness_probe: Some(grpc_probe("liveness", 10)),
        // No CPU limit by default: the EPP sits on every request's latency
        // path and CFS throttling would show up as TTFT; the memory limit
        // bounds a leak.
        resources: Some(
            tuned
                .resources
                .clone()
                .unwrap_or_else(|| ResourceRequirements {
                    requests: Some(BTreeMap::from([
                        ("cpu".to_string(), Quantity("250m".into())),
                        ("memory".to_string(), Quantity("256Mi".into())),
                    ])),
                    limits: Some(BTreeMap::from([(
                        "memory".to_string(),
                        Quantity("1Gi".into()),
                    )])),
                    ..ResourceRequirements::default()
                }),
        ),
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
        ..Container::default()
    }
}

/// The EPP Pod's security context and scheduling, but for its containers,
/// service account and volumes.
fn pod_spec(names: &Names, tuned: &EndpointPickerSpec) -> PodSpec {
    PodSpec {
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(RUN_AS_USER),
            run_as_group: Some(RUN_AS_USER),
            // Mounted Secret files belong to this group, so the
            // EPP can read them with mode 0440.
            fs_group: Some(RUN_AS_USER),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..SeccompProfile::default()
            }),
            ..PodSecurityContext::default()
        }),
        topology_spread_constraints: Some(
            tuned
                .topology_spread_constraints
                .clone()
                .unwrap_or_else(|| vec![spread_over_nodes(names)]),
        ),
        node_selector: tuned.node_selector.clone(),
        tolerations: tuned.tolerations.clone(),
        affinity: tuned.affinity.clone(),
        priority_class_name: tuned.priority_class_name.clone(),
        ..PodSpec::default()
    }
}

/// An env var from the Pod's own fields (downward API).
fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

fn port(name: &str, number: i32) -> ContainerPort {
    ContainerPort {
        name: Some(name.into()),
        container_port: number,
        protocol: Some("TCP".into()),
        ..ContainerPort::default()
    }
}

fn grpc_probe(service: &str, period: i32) -> Probe {
    Probe {
        grpc: Some(GRPCAction {
            port: EPP_HEALTH_PORT,
            service: Some(service.into()),
        }),
        period_seconds: Some(period),
        failure_threshold: Some(3),
        timeout_seconds: Some(1),
        ..Probe::default()
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    }
}

/// The EPP's `--scrape-interval-ms` for a policy's `scrapeInterval`, if it
/// is a duration within [`SCRAPE_INTERVALS`].
pub fn scrape_interval_ms(text: &str) -> Option<u64> {
    let d = kinference_policy::duration::parse_duration(text).ok()?;
    SCRAPE_INTERVALS
        .contains(&d)
        .then(|| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Where the EPP writes its decision log: an `emptyDir` of its own.
pub const DECISION_LOG_DIR: &str = "/var/log/kinference";
const DECISION_LOG_FILE: &str = "decisions.jsonl";
/// The decision log's bound on disk when the policy names none.
const DEFAULT_DECISION_LOG_BYTES: u64 = 64 << 20;
/// The bounds a policy may set.
pub const DECISION_LOG_SIZES: std::ops::RangeInclusive<u64> = (1 << 20)..=(10 << 30);

/// The decision log's bound in bytes, if `spec` is valid (see
/// [`decision_log_errors`]).
pub fn decision_log_bytes(spec: &kinference_api::DecisionLogSpec) -> Option<u64> {
    if !decision_log_errors(spec).is_empty() {
        return None;
    }
    Some(
        spec.max_size
            .as_deref()
            .and_then(quantity_bytes)
            .unwrap_or(DEFAULT_DECISION_LOG_BYTES),
    )
}

/// What is wrong with `spec`, as `path: message`: its size must be within
/// [`DECISION_LOG_SIZES`], its sample from 0 to 1.
pub fn decision_log_errors(spec: &kinference_api::DecisionLogSpec) -> Vec<String> {
    let mut errors = Vec::new();
    if let Some(max) = &spec.max_size
        && !quantity_bytes(max).is_some_and(|b| DECISION_LOG_SIZES.contains(&b))
    {
        errors.push(format!(
            "spec.endpointPicker.decisionLog.maxSize: {max:?} is not a size from 1Mi to 10Gi"
        ));
    }
    if let Some(sample) = spec.sample
        && !(0.0..=1.0).contains(&sample)
    {
        errors.push(format!(
            "spec.endpointPicker.decisionLog.sample: {sample} is not from 0 to 1"
        ));
    }
    errors
}

/// The bytes a Kubernetes quantity of bytes says (`64Mi`, `1Gi`, `500M`,
/// `1048576`); None for anything else (fractions, `m`, exponents).
pub fn quantity_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, suffix) = text.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let unit: u64 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(unit)
}

/// The scrape intervals a policy may ask for: more often than 10 ms
/// loads the model servers (LLD#2118), less often than a minute leaves
/// the picker blind.
pub const SCRAPE_INTERVALS: std::ops::RangeInclusive<std::time::Duration> =
    std::time::Duration::from_millis(10)..=std::time::Duration::from_secs(60);

/// Replicas on different nodes where the scheduler can place them so: one
/// node lost takes one replica. A preference (`ScheduleAnyway`), so a
/// one-node cluster still runs them all.
fn spread_over_nodes(names: &Names) -> TopologySpreadConstraint {
    TopologySpreadConstraint {
        max_skew: 1,
        topology_key: "kubernetes.io/hostname".into(),
        when_unsatisfiable: "ScheduleAnyway".into(),
        label_selector: Some(LabelSelector {
            match_labels: Some(epp_selector(names)),
            ..LabelSelector::default()
        }),
        ..TopologySpreadConstraint::default()
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::{PodSpec, Volume};
    use kinference_api::{ClientCaRef, EndpointPickerSpec};

    use crate::resources::desired;
    use crate::resources::testing::*;

    #[test]
    fn snapshot() {
        let (policy, compiled) = example();
        let d = desired(&policy, &compiled, &settings()).deployment;
        insta::assert_yaml_snapshot!("deployment", d);
    }

    fn pod_spec(d: Deployment) -> PodSpec {
        d.spec.unwrap().template.spec.unwrap()
    }

    fn arg<'a>(pod: &'a PodSpec, flag: &str) -> Option<&'a str> {
        pod.containers[0]
            .args
            .as_ref()?
            .iter()
            .find_map(|a| a.strip_prefix(flag)?.strip_prefix('='))
    }

    fn volume<'a>(pod: &'a PodSpec, name: &str) -> Option<&'a Volume> {
        pod.volumes.as_ref()?.iter().find(|v| v.name == name)
    }

    fn mount_path<'a>(pod: &'a PodSpec, name: &str) -> Option<&'a str> {
        pod.containers[0]
            .volume_mounts
            .as_ref()?
            .iter()
            .find(|m| m.name == name && m.read_only == Some(true))
            .map(|m| m.mount_path.as_str())
    }

    #[test]
    fn provider_keys_are_projected_files_not_api_reads() {
        let (policy, compiled) = example();
        let pod = pod_spec(desired(&policy, &compiled, &settings()).deployment);
        assert_eq!(
            arg(&pod, "--provider-secrets-dir"),
            Some("/var/run/kinference/provider-secrets")
        );
        assert_eq!(arg(&pod, "--status-configmap"), Some("chat-epp-status"));
        assert_eq!(
            mount_path(&pod, "provider-secrets"),
            Some("/var/run/kinference/provider-secrets")
        );
        let projected = volume(&pod, "provider-secrets")
            .and_then(|v| v.projected.clone())
            .expect("a projected volume");
        assert_eq!(projected.default_mode, Some(0o440));
        // Exactly the keys the policy names, each under <secret>/<key>, and
        // optional: a missing Secret is reported, not a Pod stuck on a mount.
        assert_eq!(
            serde_json::to_value(projected.sources).unwrap(),
            serde_json::json!([
                {"secret": {"name": "openai-key", "optional": true,
                            "items": [{"key": "apiKey", "path": "openai-key/apiKey"}]}},
                {"secret": {"name": "proxy-token", "optional": true,
                            "items": [{"key": "apiKey", "path": "proxy-token/apiKey"}]}}
            ])
        );
        assert_eq!(pod.security_context.unwrap().fs_group, Some(65532));
    }

    #[test]
    fn no_secret_volume_without_secrets_and_no_client_ca_by_default() {
        let mut spec = example_spec();
        for p in &mut spec.providers {
            p.secret_ref = None;
        }
        let compiled = kinference_policy::compile(&spec).unwrap();
        let pod = pod_spec(desired(&example_policy(spec), &compiled, &settings()).deployment);
        assert!(volume(&pod, "provider-secrets").is_none());
        assert!(volume(&pod, "client-ca").is_none());
        assert_eq!(arg(&pod, "--client-ca-file"), None);
        // The flag stays: with no Secret to read the EPP reads none, and it
        // never falls back to reading Secrets through the API.
        assert!(arg(&pod, "--provider-secrets-dir").is_some());
    }

    #[test]
    fn client_ca_is_mounted_and_required_by_flag() {
        let (mut policy, compiled) = example();
        policy.spec.endpoint_picker = Some(EndpointPickerSpec {
            client_ca: Some(ClientCaRef {
                secret_name: "gateway-client-ca".into(),
                key: Some("bundle.pem".into()),
            }),
            ..EndpointPickerSpec::default()
        });
        let d = desired(&policy, &compiled, &settings()).deployment;
        insta::assert_yaml_snapshot!("deployment_mtls", d.spec.as_ref().unwrap().template);
        let pod = pod_spec(d);
        assert_eq!(
            arg(&pod, "--client-ca-file"),
            Some("/etc/kinference/client-ca/ca.crt")
        );
        assert_eq!(
            mount_path(&pod, "client-ca"),
            Some("/etc/kinference/client-ca")
        );
        let secret = volume(&pod, "client-ca")
            .and_then(|v| v.secret.clone())
            .expect("a Secret volume");
        assert_eq!(secret.secret_name.as_deref(), Some("gateway-client-ca"));
        // Required: an EPP without its CA could not start anyway.
        assert_eq!(secret.optional, None);
        let items = secret.items.unwrap();
        assert_eq!(
            (items[0].key.as_str(), items[0].path.as_str()),
            ("bundle.pem", "ca.crt")
        );
    }

    #[test]
    fn precise_prefix_mounts_the_tokenizer_image_and_opens_the_events_port() {
        let (policy, compiled) = example_precise();
        let pod = pod_spec(desired(&policy, &compiled, &settings()).deployment);
        assert_eq!(arg(&pod, "--kv-events-port"), Some("5600"));
        assert_eq!(
            arg(&pod, "--kv-events-tokenizer"),
            Some("/var/run/kinference/tokenizer")
        );
        assert_eq!(arg(&pod, "--kv-events-tokenize-budget"), Some("8ms"));
        assert_eq!(arg(&pod, "--kv-events-replay-port"), Some("5558"));
        let image = volume(&pod, "tokenizer")
            .and_then(|v| v.image.clone())
            .expect("an image volume");
        assert_eq!(image.reference.as_deref(), Some("reg.example/tok/qwen3:1"));
        let mount = pod.containers[0]
            .volume_mounts
            .as_ref()
            .unwrap()
            .iter()
            .find(|m| m.name == "tokenizer")
            .unwrap();
        assert_eq!(
            (mount.mount_path.as_str(), mount.sub_path.as_deref()),
            ("/var/run/kinference/tokenizer", Some("tokenizer"))
        );
        assert_eq!(mount.read_only, Some(true));
        let ports = pod.containers[0].ports.as_ref().unwrap();
        assert!(
            ports
                .iter()
                .any(|p| p.name.as_deref() == Some("kv-events") && p.container_port == 5600)
        );

        // Off by default: no flag, no volume, no port.
        let (policy, compiled) = example();
        let pod = pod_spec(desired(&policy, &compiled, &settings()).deployment);
        assert_eq!(arg(&pod, "--kv-events-port"), None);
        assert_eq!(arg(&pod, "--kv-events-replay-port"), None);
        assert!(volume(&pod, "tokenizer").is_none());
        assert_eq!(pod.containers[0].ports.as_ref().unwrap().len(), 3);
    }

    #[test]
    fn each_data_parallel_rank_gets_an_events_port() {
        let (mut policy, compiled) = example_precise();
        let pod = pod_spec(desired(&policy, &compiled, &settings()).deployment);
        assert_eq!(arg(&pod, "--kv-events-data-parallel-size"), None);
        precise_mut(&mut policy).data_parallel_size = Some(2);
        let pod = pod_spec(desired(&policy, &compiled, &settings()).deployment);
        assert_eq!(arg(&pod, "--kv-events-data-parallel-size"), Some("2"));
        let events: Vec<(&str, i32)> = pod.containers[0]
            .ports
            .as_ref()
            .unwrap()
            .iter()
            .filter(|p| p.name.as_deref().unwrap().starts_with("kv-events"))
            .map(|p| (p.name.as_deref().unwrap(), p.container_port))
            .collect();
        assert_eq!(events, [("kv-events", 5600), ("kv-events-1", 5601)]);
    }

    #[test]
    fn when_the_engines_bind_the_epp_dials_them_and_opens_no_events_port() {
        let (mut policy, compiled) = example_precise();
        let pod = pod_spec(desired(&policy, &compiled, &settings()).deployment);
        assert!(
            !pod.containers[0]
                .args
                .as_ref()
                .unwrap()
                .contains(&"--kv-events-dial".into())
        );
        precise_mut(&mut policy).publisher_mode = Some(kinference_api::PublisherMode::Bind);
        let pod = pod_spec(desired(&policy, &compiled, &settings()).deployment);
        let args = pod.containers[0].args.as_ref().unwrap();
        assert!(args.contains(&"--kv-events-dial".into()), "{args:?}");
        assert_eq!(arg(&pod, "--kv-events-port"), Some("5600"));
        assert_eq!(pod.containers[0].ports.as_ref().unwrap().len(), 3);
        assert!(volume(&pod, "tokenizer").is_some());
    }

    /// `spec.endpointPicker`'s tuning reaches the Pod; unset, the defaults
    /// (the snapshot's) stay.
    #[test]
    fn the_policy_tunes_its_epp_pods() {
        let (mut policy, compiled) = example();
        let tuning: EndpointPickerSpec = serde_json::from_value(serde_json::json!({
            "resources": {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "epp", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
            }}},
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}],
            "priorityClassName": "system-cluster-critical",
            "logFormat": "text",
            "scrapeInterval": "200ms"
        }))
        .unwrap();
        policy.spec.endpoint_picker = Some(tuning);
        let d = desired(&policy, &compiled, &settings()).deployment;
        let pod = d.spec.unwrap().template.spec.unwrap();
        let container = &pod.containers[0];
        let requests = container
            .resources
            .as_ref()
            .unwrap()
            .requests
            .as_ref()
            .unwrap();
        assert_eq!(requests["cpu"].0, "2");
        assert_eq!(pod.node_selector.unwrap()["pool"], "cpu");
        assert_eq!(
            pod.tolerations.unwrap()[0].key.as_deref(),
            Some("dedicated")
        );
        assert!(pod.affinity.unwrap().node_affinity.is_some());
        let spread = pod.topology_spread_constraints.unwrap();
        assert_eq!(spread.len(), 1);
        assert_eq!(spread[0].topology_key, "topology.kubernetes.io/zone");
        assert_eq!(
            pod.priority_class_name.as_deref(),
            Some("system-cluster-critical")
        );
        let args = container.args.as_ref().unwrap();
        assert!(args.contains(&"--log-format=text".to_string()), "{args:?}");
        assert!(
            args.contains(&"--scrape-interval-ms=200".to_string()),
            "{args:?}"
        );
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

    #[test]
    fn quantities_of_bytes_are_read_and_others_refused() {
        for (text, bytes) in [
            ("64Mi", Some(64 << 20)),
            ("1Gi", Some(1 << 30)),
            ("500M", Some(500_000_000)),
            ("1048576", Some(1 << 20)),
            ("1.5Gi", None),
            ("100m", None),
            ("1e6", None),
            ("Mi", None),
            ("", None),
        ] {
            assert_eq!(super::quantity_bytes(text), bytes, "{text}");
        }
    }

    #[test]
    fn a_decision_log_gets_its_volume_bound_and_arguments_and_a_log_level_its_env() {
        let (mut policy, compiled) = example();
        policy.spec.endpoint_picker = Some(kinference_api::EndpointPickerSpec {
            decision_log: Some(kinference_api::DecisionLogSpec {
                max_size: Some("16Mi".into()),
                sample: Some(0.25),
            }),
            log_level: Some(kinference_api::EppLogLevel::Debug),
            ..Default::default()
        });
        let pod = desired(&policy, &compiled, &settings())
            .deployment
            .spec
            .unwrap()
            .template
            .spec
            .unwrap();
        let container = &pod.containers[0];
        let args = container.args.clone().unwrap();
        for arg in [
            "--decision-log=/var/log/kinference/decisions.jsonl",
            "--decision-log-max-bytes=16777216",
            "--decision-log-sample=0.25",
        ] {
            assert!(args.contains(&arg.to_string()), "{arg} not in {args:?}");
        }
        let volume = pod
            .volumes
            .unwrap()
            .into_iter()
            .find(|v| v.name == "decision-log")
            .expect("the decision log's volume");
        assert_eq!(
            volume.empty_dir.unwrap().size_limit.unwrap().0,
            (17u64 << 20).to_string()
        );
        let mount = container
            .volume_mounts
            .as_ref()
            .unwrap()
            .iter()
            .find(|m| m.name == "decision-log")
            .expect("mounted");
        assert_eq!(mount.mount_path, "/var/log/kinference");
        assert_eq!(mount.read_only, None);
        let env = container.env.as_ref().unwrap();
        let level = env.iter().find(|e| e.name == "RUST_LOG").expect("RUST_LOG");
        assert_eq!(level.value.as_deref(), Some("debug"));
        // Off by default: no volume, no argument.
        let (plain, _) = example();
        let d = desired(&plain, &compiled, &settings()).deployment;
        let args = d.spec.unwrap().template.spec.unwrap().containers[0]
            .args
            .clone()
            .unwrap();
        assert!(
            !args.iter().any(|a| a.starts_with("--decision-log")),
            "{args:?}"
        );
    }
}
