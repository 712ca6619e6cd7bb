//! Builders for every object the operator generates from one accepted
//! policy. Pure functions of (policy object, compiled policy, operator
//! config): no I/O, so each builder is snapshot-tested beside its code and the
//! reconciler only has to apply what [`desired`] returns.

mod backend_tls_policy;
mod config_map;
mod deployment;
mod epp_service;
mod http_route;
mod inference_pool;
mod names;
mod network_policy;
mod pod_disruption_budget;
mod provider_service;
mod role;
mod role_binding;
mod service_account;

use std::collections::BTreeMap;

use gateway_api::apis::standard::backendtlspolicies::BackendTlsPolicy;
use gateway_api::apis::standard::httproutes::HttpRoute;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kinference_api::{InferencePolicy, POLICY_LABEL};
use kinference_policy::CompiledPolicy;
use kube::{Resource, ResourceExt};

pub use backend_tls_policy::backend_tls_policy;
pub use config_map::{check_config_map_size, config_map, epp_status_config_map};
pub use deployment::{
    CLIENT_CA_DIR, CLIENT_CA_FILE, EPP_GRPC_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT,
    PROVIDER_SECRETS_DIR, SCRAPE_INTERVALS, TOKENIZER_DIR, decision_log_errors, deployment,
    epp_selector, scrape_interval_ms,
};

/// The EPP's own ports, which no other setting may take.
pub const EPP_PORTS: [i32; 3] = [EPP_GRPC_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT];
pub use epp_service::epp_service;
pub use http_route::http_route;
pub use inference_pool::inference_pool;
pub use kinference_api::{InferencePool, InferencePoolSpec};
pub use names::{Names, validate_names};
pub use network_policy::network_policy;
pub use pod_disruption_budget::pod_disruption_budget;
pub use provider_service::{ProviderEndpoint, provider_service};
pub use role::role;
pub use role_binding::role_binding;
pub use service_account::service_account;

/// The EPP's events ports, named: `kv-events` for data-parallel rank 0,
/// `kv-events-<r>` for rank r (vLLM's rank r publishes to the port + r).
/// None when the engines bind and the EPP connects to them.
pub fn events_ports(precise: &kinference_api::PrecisePrefixSpec) -> Vec<(String, i32)> {
    if !precise.epp_listens() {
        return Vec::new();
    }
    precise
        .events_ports()
        .enumerate()
        .map(|(rank, port)| match rank {
            0 => ("kv-events".to_string(), port),
            r => (format!("kv-events-{r}"), port),
        })
        .collect()
}

/// Field manager of every server-side apply the operator sends.
pub const FIELD_MANAGER: &str = "kinference-operator";
/// Label naming the provider an ExternalName Service stands for.
pub const PROVIDER_LABEL: &str = "kinference.io/provider";
/// Says which part of the product an object is (Kubernetes' recommended label).
pub const COMPONENT_LABEL: &str = "app.kubernetes.io/component";
/// The component of the EPP status ConfigMap, which the operator watches
/// whole (the policy ConfigMaps only by metadata).
pub const EPP_STATUS_COMPONENT: &str = "endpoint-picker-status";
const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
const PART_OF: &str = "app.kubernetes.io/part-of";

/// Operator settings the generated objects depend on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EppSettings {
    pub image: String,
    /// EPP replicas of a policy that names none; None: the operator leaves
    /// `spec.replicas` to whoever scales the Deployment (an HPA).
    pub replicas: Option<i32>,
}

impl EppSettings {
    /// The EPP replicas of `policy`: its own number, or the operator's, if
    /// either is set.
    pub fn replicas_for(&self, policy: &InferencePolicy) -> Option<i32> {
        policy.spec.epp_replicas().or(self.replicas)
    }
}

/// Everything one accepted policy turns into. Objects with a variable set of
/// names (one per provider, or none without a route) are lists, so pruning
/// can compare names.
#[derive(Clone, Debug)]
pub struct Desired {
    pub service_account: ServiceAccount,
    pub role: Role,
    pub role_binding: RoleBinding,
    pub config_map: ConfigMap,
    /// Where the EPP Pods report what they loaded; applied without `data`.
    pub epp_status_config_map: ConfigMap,
    pub epp_service: Service,
    pub deployment: Deployment,
    /// Only with more than one EPP replica.
    pub pod_disruption_budget: Option<PodDisruptionBudget>,
    /// None when disabled, or when no gateway is known to admit.
    pub network_policy: Option<NetworkPolicy>,
    pub provider_services: Vec<Service>,
    pub backend_tls_policies: Vec<BackendTlsPolicy>,
    /// None for a rules-only policy: its pool is an existing one.
    pub inference_pool: Option<InferencePool>,
    /// None when the policy declares no Gateway to attach to: a route without
    /// parentRefs would attach nowhere.
    pub http_route: Option<HttpRoute>,
}

impl Desired {
    /// Names of the Services the operator wants (EPP + providers).
    pub fn service_names(&self) -> Vec<String> {
        std::iter::once(&self.epp_service)
            .chain(&self.provider_services)
            .map(|s| s.name_any())
            .collect()
    }
}

/// Builds every object for `policy`, which must have a namespace and uid
/// (it comes from the API server) and whose spec compiled to `compiled`.
pub fn desired(policy: &InferencePolicy, compiled: &CompiledPolicy, epp: &EppSettings) -> Desired {
    desired_for(policy, compiled, epp, None)
}

/// [`desired`], for a policy attached to `attached` (the InferencePool it
/// names, when it exists), whose selector picks the model servers.
pub fn desired_for(
    policy: &InferencePolicy,
    compiled: &CompiledPolicy,
    epp: &EppSettings,
    attached: Option<&InferencePool>,
) -> Desired {
    let names = Names::of(policy);
    let engines = compiled
        .pool
        .as_ref()
        .map(|p| &p.selector)
        .or(attached.map(|p| &p.spec.selector.match_labels));
    let endpoints: Vec<(String, ProviderEndpoint)> = compiled
        .providers
        .iter()
        .filter_map(|p| ProviderEndpoint::parse(&p.base_url).map(|e| (p.name.clone(), e)))
        .collect();
    Desired {
        service_account: service_account(policy, &names),
        role: role(policy, &names),
        role_binding: role_binding(policy, &names),
        config_map: config_map(policy, &names, compiled),
        epp_status_config_map: epp_status_config_map(policy, &names),
        epp_service: epp_service(policy, &names),
        deployment: deployment(policy, &names, epp, compiled),
        pod_disruption_budget: pod_disruption_budget(policy, &names, epp.replicas_for(policy)),
        network_policy: network_policy(policy, &names, compiled, engines),
        provider_services: endpoints
            .iter()
            .map(|(name, e)| provider_service(policy, &names, name, e))
            .collect(),
        backend_tls_policies: endpoints
            .iter()
            .filter(|(_, e)| e.tls)
            .map(|(name, e)| backend_tls_policy(policy, &names, name, e))
            .collect(),
        inference_pool: compiled
            .pool
            .as_ref()
            .map(|pool| inference_pool(policy, &names, pool)),
        http_route: (!compiled.route.parent_refs.is_empty())
            .then(|| http_route(policy, &names, compiled, &endpoints)),
    }
}

/// Labels every generated object carries; `POLICY_LABEL` is what watches and
/// pruning select on.
pub fn common_labels(policy_name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (POLICY_LABEL.to_string(), policy_name.to_string()),
        (MANAGED_BY.to_string(), FIELD_MANAGER.to_string()),
        (PART_OF.to_string(), "kinference".to_string()),
    ])
}

/// Metadata of a generated object: name, the policy's namespace, common
/// labels plus `extra`, and the policy as controlling owner so that deleting
/// the policy garbage-collects it (a foreground deletion waits for it:
/// `blockOwnerDeletion`).
pub fn object_meta(
    policy: &InferencePolicy,
    name: &str,
    extra: impl IntoIterator<Item = (String, String)>,
) -> ObjectMeta {
    let mut labels = common_labels(&policy.name_any());
    labels.extend(extra);
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: policy.namespace(),
        labels: Some(labels),
        owner_references: policy.controller_owner_ref(&()).map(|r| {
            vec![OwnerReference {
                block_owner_deletion: Some(true),
                ..r
            }]
        }),
        ..ObjectMeta::default()
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! One example policy with two providers, shared by the snapshot tests.

    use kinference_api::{InferencePolicy, InferencePolicySpec};
    use kinference_policy::{CompiledPolicy, PolicySpec};
    use kube::api::ObjectMeta;

    use super::EppSettings;

    pub fn example_spec() -> PolicySpec {
        serde_json::from_value(serde_json::json!({
            "pool": {
                "selector": {"app": "vllm-llama"},
                "targetPorts": [{"number": 8000}],
                "models": [{"name": "llama-3-8b"}]
            },
            "route": {
                "parentRefs": [{"name": "inference-gateway", "namespace": "gateways", "sectionName": "https"}],
                "hostnames": ["llm.example.com"],
                "pathPrefix": "/v1"
            },
            "providers": [
                {
                    "name": "openai",
                    "baseURL": "https://api.openai.com/v1",
                    "secretRef": {"name": "openai-key", "key": "apiKey"},
                    "models": [{"name": "gpt-4o-mini"}]
                },
                {
                    "name": "internal",
                    "baseURL": "http://llm-proxy.corp.example:8080/v1",
                    "secretRef": {"name": "proxy-token"},
                    "models": [{"name": "llama-3-70b"}]
                }
            ],
            "rules": [
                {"name": "big-to-provider", "matches": [{"model": "gpt-4o-mini"}],
                 "route": {
                     "consider": [{"models": {"names": ["gpt-4o-mini", "llama-3-70b"]}, "backends": {"type": "Provider"}}],
                     "select": [{"type": "Provider", "order": ["openai", "internal"]}]
                 }},
                {"name": "default", "route": {"select": [{"minimize": "QueueDepth"}]}}
            ]
        }))
        .expect("example policy parses")
    }

    pub fn example_policy(spec: PolicySpec) -> InferencePolicy {
        let mut policy = InferencePolicy::new("chat", InferencePolicySpec::new(spec));
        policy.metadata = ObjectMeta {
            name: Some("chat".into()),
            namespace: Some("team-a".into()),
            uid: Some("4c5f7c2e-0000-4000-8000-000000000001".into()),
            generation: Some(3),
            ..ObjectMeta::default()
        };
        policy
    }

    pub fn example() -> (InferencePolicy, CompiledPolicy) {
        let spec = example_spec();
        let compiled = kinference_policy::compile(&spec).expect("example policy compiles");
        (example_policy(spec), compiled)
    }

    /// The example with precise prefix mode on: `tokenizer` in the image
    /// `reg.example/tok/qwen3:1`, events on port 5600.
    pub fn example_precise() -> (InferencePolicy, CompiledPolicy) {
        let (mut policy, compiled) = example();
        policy.spec.endpoint_picker = Some(kinference_api::EndpointPickerSpec {
            precise_prefix: Some(
                serde_json::from_value(serde_json::json!({
                    "tokenizer": { "image": "reg.example/tok/qwen3:1", "path": "tokenizer" },
                    "eventsPort": 5600,
                    "tokenizeBudget": "8ms",
                    "replayPort": 5558
                }))
                .unwrap(),
            ),
            ..Default::default()
        });
        (policy, compiled)
    }

    /// The example attached to the existing InferencePool `shared`: no
    /// pool, no route of its own.
    pub fn example_attached() -> (InferencePolicy, CompiledPolicy) {
        let mut spec = example_spec();
        spec.pool = None;
        spec.route = None;
        let compiled = kinference_policy::compile(&spec).expect("attached example compiles");
        let mut policy = example_policy(spec);
        policy.spec.target_refs = vec![kinference_api::PolicyTargetReference {
            group: "inference.networking.k8s.io".into(),
            kind: "InferencePool".into(),
            name: "shared".into(),
        }];
        (policy, compiled)
    }

    /// The precise prefix settings of a policy made by [`example_precise`].
    pub fn precise_mut(policy: &mut InferencePolicy) -> &mut kinference_api::PrecisePrefixSpec {
        let picker = policy
            .spec
            .endpoint_picker
            .as_mut()
            .expect("endpointPicker");
        picker.precise_prefix.as_mut().expect("precisePrefix")
    }

    pub fn settings() -> EppSettings {
        EppSettings {
            image: "ghcr.io/kinference/epp:0.1.0".into(),
            replicas: Some(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    #[test]
    fn every_object_is_labelled_and_controlled_by_the_policy() {
        let (policy, compiled) = example();
        let d = desired(&policy, &compiled, &settings());
        let metas: Vec<&ObjectMeta> = vec![
            &d.service_account.metadata,
            &d.role.metadata,
            &d.role_binding.metadata,
            &d.config_map.metadata,
            &d.epp_status_config_map.metadata,
            &d.epp_service.metadata,
            &d.deployment.metadata,
            &d.network_policy.as_ref().unwrap().metadata,
            &d.provider_services[0].metadata,
            &d.provider_services[1].metadata,
            &d.backend_tls_policies[0].metadata,
            &d.inference_pool.as_ref().unwrap().metadata,
            &d.http_route.as_ref().unwrap().metadata,
        ];
        for meta in metas {
            let name = meta.name.as_deref().unwrap();
            assert_eq!(meta.namespace.as_deref(), Some("team-a"), "{name}");
            assert_eq!(
                meta.labels.as_ref().unwrap()[POLICY_LABEL],
                "chat",
                "{name}"
            );
            let owners = meta.owner_references.as_ref().unwrap();
            assert_eq!(owners.len(), 1, "{name}");
            assert_eq!(owners[0].kind, "InferencePolicy");
            assert_eq!(owners[0].uid, "4c5f7c2e-0000-4000-8000-000000000001");
            assert_eq!(owners[0].controller, Some(true));
        }
        assert_eq!(
            d.service_names(),
            ["chat-epp", "chat-provider-openai", "chat-provider-internal"]
        );
        // Only the https provider needs TLS origination.
        assert_eq!(d.backend_tls_policies.len(), 1);
    }

    #[test]
    fn an_attached_policy_generates_its_epp_and_never_a_pool_or_a_route() {
        let (mut policy, compiled) = example_attached();
        let mut pool = InferencePool::new("shared", InferencePoolSpec::default());
        pool.spec.selector.match_labels = [("app".to_string(), "vllm-shared".to_string())].into();
        let d = desired_for(&policy, &compiled, &settings(), Some(&pool));
        assert!(d.inference_pool.is_none());
        assert!(d.http_route.is_none());
        let pod = d.deployment.spec.unwrap().template.spec.unwrap();
        let args = pod.containers[0].args.clone().unwrap();
        for arg in [
            "--pool-name=shared",
            "--pool-namespace=team-a",
            "--metrics-pool-name=shared",
        ] {
            assert!(args.contains(&arg.to_string()), "{arg} not in {args:?}");
        }
        // The EPP may read that pool, and no other.
        let rules = d.role.rules.unwrap();
        let pools: Vec<_> = rules
            .iter()
            .filter(|r| r.resources.as_deref() == Some(&["inferencepools".to_string()]))
            .collect();
        assert_eq!(pools.len(), 1, "{rules:?}");
        assert_eq!(
            pools[0].api_groups.as_deref(),
            Some(&["inference.networking.k8s.io".to_string()][..])
        );
        assert_eq!(pools[0].verbs, ["list", "watch"]);
        assert_eq!(pools[0].resource_names, Some(vec!["shared".to_string()]));
        // No gateway known: no NetworkPolicy unless extProcFrom names one;
        // then, in precise mode, the events port admits the pool's Pods.
        assert!(d.network_policy.is_none());
        policy.spec.endpoint_picker = example_precise().0.spec.endpoint_picker;
        let picker = policy.spec.endpoint_picker.as_mut().unwrap();
        picker.network_policy = Some(
            serde_json::from_value(serde_json::json!({
                "extProcFrom": [{"podSelector": {"matchLabels": {"gateway": "envoy"}}}]
            }))
            .unwrap(),
        );
        let np = desired_for(&policy, &compiled, &settings(), Some(&pool))
            .network_policy
            .unwrap();
        let events = &np.spec.unwrap().ingress.unwrap()[2];
        let from = events.from.as_ref().unwrap()[0]
            .pod_selector
            .clone()
            .unwrap();
        assert_eq!(from.match_labels.unwrap()["app"], "vllm-shared");
        // Pool not there yet: the events port stays closed.
        let np = desired_for(&policy, &compiled, &settings(), None)
            .network_policy
            .unwrap();
        assert_eq!(np.spec.unwrap().ingress.unwrap().len(), 2);
    }

    #[test]
    fn no_parent_refs_means_no_route() {
        let mut spec = example_spec();
        spec.route = None;
        let compiled = kinference_policy::compile(&spec).unwrap();
        let d = desired(&example_policy(spec), &compiled, &settings());
        assert!(d.http_route.is_none());
    }
}
