//! The EPP's NetworkPolicy. A provider pick answers ext_proc with the
//! provider's API key in a header, so whoever reaches port 9002 can collect
//! the keys: only the gateway may. `/metrics` (9090) is for scrapers only.
//! In precise prefix mode the events port admits the pool's own Pods only:
//! an event stream decides where prompts go. Nothing else is admitted; the
//! gRPC health port (9003) serves the kubelet's probes, which come from the node (the common CNIs, e.g. Calico,
//! Cilium and Antrea, always admit a Pod's own node).
//!
//! Gateways are Pods the gateway implementation runs, so by default they
//! are selected by the labels implementations put on them, per parent
//! Gateway: `gateway.networking.k8s.io/gateway-name` (the Gateway API's
//! recommended label, set by Istio, kgateway and agentgateway) in the
//! Gateway's namespace, and Envoy Gateway's
//! `gateway.envoyproxy.io/owning-gateway-{name,namespace}` in the Gateway's
//! namespace or in `envoy-gateway-system` (Envoy Gateway runs its proxies in
//! its controller's namespace unless in Gateway Namespace Mode). Each peer
//! is limited to those namespaces, so a Pod elsewhere cannot get in by
//! copying the labels.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::RangeInclusive;

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kinference_api::InferencePolicy;
use kinference_policy::CompiledPolicy;

use super::deployment::epp_object_labels;
use super::{EPP_GRPC_PORT, EPP_METRICS_PORT, Names, epp_selector, object_meta};

/// The label every namespace carries with its own name (Kubernetes ≥ 1.22).
const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";
/// Gateway API's label for a Gateway's generated resources (GEP-1762).
pub const GATEWAY_NAME_LABEL: &str = "gateway.networking.k8s.io/gateway-name";
pub const ENVOY_GATEWAY_NAME_LABEL: &str = "gateway.envoyproxy.io/owning-gateway-name";
pub const ENVOY_GATEWAY_NAMESPACE_LABEL: &str = "gateway.envoyproxy.io/owning-gateway-namespace";
/// Where Envoy Gateway runs its proxies by default (its install namespace).
pub const ENVOY_GATEWAY_NAMESPACE: &str = "envoy-gateway-system";
/// What the Prometheus Operator labels its Prometheus server Pods.
pub const PROMETHEUS_LABEL: (&str, &str) = ("app.kubernetes.io/name", "prometheus");

/// The NetworkPolicy for `policy`'s EPP Pods, or None when it is disabled or
/// no gateway is known (no `extProcFrom` and no parent Gateway): admitting
/// no one to ext_proc would fail every request of a pool whose gateway
/// attaches through a route of its own.
pub fn network_policy(
    policy: &InferencePolicy,
    names: &Names,
    compiled: &CompiledPolicy,
    engines: Option<&BTreeMap<String, String>>,
) -> Option<NetworkPolicy> {
    let settings = policy.spec.network_policy();
    if !settings.enabled {
        return None;
    }
    let ns = policy.metadata.namespace.clone().unwrap_or_default();
    let ext_proc_from = match settings.ext_proc_from {
        Some(peers) => peers,
        None if compiled.route.parent_refs.is_empty() => return None,
        None => {
            let gateways: BTreeSet<(String, String)> = compiled
                .route
                .parent_refs
                .iter()
                .map(|p| {
                    (
                        p.namespace.clone().unwrap_or_else(|| ns.clone()),
                        p.name.clone(),
                    )
                })
                .collect();
            gateways
                .iter()
                .flat_map(|(gw_ns, gw)| gateway_peers(gw_ns, gw))
                .collect()
        }
    };
    let metrics_from = settings.metrics_from.unwrap_or_else(|| {
        vec![NetworkPolicyPeer {
            // Present but empty: every namespace.
            namespace_selector: Some(LabelSelector::default()),
            pod_selector: Some(match_labels([PROMETHEUS_LABEL])),
            ..NetworkPolicyPeer::default()
        }]
    });
    // A rule with no peers would admit everyone (an absent `from` means all
    // sources): an empty list is no rule, so the port stays closed.
    let rule = |ports: RangeInclusive<i32>, from: Vec<NetworkPolicyPeer>| {
        (!from.is_empty()).then(|| NetworkPolicyIngressRule {
            from: Some(from),
            ports: Some(vec![NetworkPolicyPort {
                port: Some(IntOrString::Int(*ports.start())),
                end_port: (ports.end() > ports.start()).then_some(*ports.end()),
                protocol: Some("TCP".into()),
            }]),
        })
    };
    // The model servers: the pool's Pods, in the policy's namespace.
    let events = policy
        .spec
        .precise_prefix()
        .filter(|p| p.epp_listens())
        .and_then(|p| {
            let pool = NetworkPolicyPeer {
                pod_selector: Some(match_labels(
                    engines?.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                )),
                ..NetworkPolicyPeer::default()
            };
            // One port per data-parallel rank.
            rule(p.events_ports(), vec![pool])
        });
    let ingress: Vec<NetworkPolicyIngressRule> = [
        rule(EPP_GRPC_PORT..=EPP_GRPC_PORT, ext_proc_from),
        rule(EPP_METRICS_PORT..=EPP_METRICS_PORT, metrics_from),
        events,
    ]
    .into_iter()
    .flatten()
    .collect();
    Some(NetworkPolicy {
        metadata: object_meta(policy, &names.epp(), epp_object_labels(names)),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(epp_selector(names)),
                ..LabelSelector::default()
            }),
            // Ingress only: isolating egress would cut the EPP off from the
            // API server, the model servers and DNS, which differ per cluster.
            policy_types: Some(vec!["Ingress".into()]),
            // Always present, even empty: an isolated Pod with no rule
            // admits nothing, which is what an empty override asks for.
            ingress: Some(ingress),
            egress: None,
        }),
    })
}

/// The default peers of one parent Gateway (see the module docs).
fn gateway_peers(gw_ns: &str, gw: &str) -> [NetworkPolicyPeer; 2] {
    let envoy_gateway_namespaces: BTreeSet<String> =
        [gw_ns.to_string(), ENVOY_GATEWAY_NAMESPACE.to_string()].into();
    [
        NetworkPolicyPeer {
            namespace_selector: Some(match_labels([(NAMESPACE_NAME_LABEL, gw_ns)])),
            pod_selector: Some(match_labels([(GATEWAY_NAME_LABEL, gw)])),
            ..NetworkPolicyPeer::default()
        },
        NetworkPolicyPeer {
            namespace_selector: Some(LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: NAMESPACE_NAME_LABEL.into(),
                    operator: "In".into(),
                    values: Some(envoy_gateway_namespaces.into_iter().collect()),
                }]),
                ..LabelSelector::default()
            }),
            pod_selector: Some(match_labels([
                (ENVOY_GATEWAY_NAME_LABEL, gw),
                (ENVOY_GATEWAY_NAMESPACE_LABEL, gw_ns),
            ])),
            ..NetworkPolicyPeer::default()
        },
    ]
}

fn match_labels<'a>(labels: impl IntoIterator<Item = (&'a str, &'a str)>) -> LabelSelector {
    LabelSelector {
        match_labels: Some(
            labels
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
        ),
        ..LabelSelector::default()
    }
}

#[cfg(test)]
mod tests {
    /// The declared pool's selector, as `desired` passes it.
    fn engines(
        compiled: &kinference_policy::CompiledPolicy,
    ) -> Option<&std::collections::BTreeMap<String, String>> {
        compiled.pool.as_ref().map(|p| &p.selector)
    }

    use k8s_openapi::api::networking::v1::NetworkPolicyPeer;
    use kinference_api::{EndpointPickerSpec, EppNetworkPolicySpec};
    use serde_json::json;

    use crate::resources::testing::*;
    use crate::resources::{Names, desired, network_policy};

    fn with_settings(
        np: EppNetworkPolicySpec,
    ) -> Option<k8s_openapi::api::networking::v1::NetworkPolicy> {
        let (mut policy, compiled) = example();
        policy.spec.endpoint_picker = Some(EndpointPickerSpec {
            network_policy: Some(np),
            ..EndpointPickerSpec::default()
        });
        network_policy(&policy, &Names::of(&policy), &compiled, engines(&compiled))
    }

    /// Port → the peers admitted to it, as JSON.
    fn admitted(
        np: &k8s_openapi::api::networking::v1::NetworkPolicy,
    ) -> Vec<(i64, serde_json::Value)> {
        let spec = serde_json::to_value(np.spec.as_ref().unwrap()).unwrap();
        spec["ingress"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (r["ports"][0]["port"].as_i64().unwrap(), r["from"].clone()))
            .collect()
    }

    #[test]
    fn precise_prefix_admits_only_the_pools_pods_to_the_events_port() {
        let (policy, compiled) = example_precise();
        let np =
            network_policy(&policy, &Names::of(&policy), &compiled, engines(&compiled)).unwrap();
        let events: Vec<_> = admitted(&np)
            .into_iter()
            .filter(|(port, _)| *port == 5600)
            .collect();
        // A bare podSelector: the policy's own namespace only.
        assert_eq!(
            events,
            [(
                5600,
                json!([{ "podSelector": { "matchLabels": { "app": "vllm-llama" } } }])
            )]
        );
        let (policy, compiled) = example();
        let np =
            network_policy(&policy, &Names::of(&policy), &compiled, engines(&compiled)).unwrap();
        assert_eq!(admitted(&np).len(), 2, "no events rule when off");
    }

    #[test]
    fn when_the_engines_bind_no_one_is_admitted_to_an_events_port() {
        let (mut policy, compiled) = example_precise();
        precise_mut(&mut policy).publisher_mode = Some(kinference_api::PublisherMode::Bind);
        let np =
            network_policy(&policy, &Names::of(&policy), &compiled, engines(&compiled)).unwrap();
        let ports: Vec<i64> = admitted(&np).into_iter().map(|(port, _)| port).collect();
        assert_eq!(ports, [9002, 9090]);
    }

    #[test]
    fn data_parallel_ranks_are_admitted_to_a_range_of_events_ports() {
        let (mut policy, compiled) = example_precise();
        precise_mut(&mut policy).data_parallel_size = Some(4);
        let np =
            network_policy(&policy, &Names::of(&policy), &compiled, engines(&compiled)).unwrap();
        let spec = serde_json::to_value(np.spec.unwrap()).unwrap();
        let ports: Vec<&serde_json::Value> = spec["ingress"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| &r["ports"][0])
            .collect();
        assert_eq!(
            ports,
            [
                &json!({ "port": 9002, "protocol": "TCP" }),
                &json!({ "port": 9090, "protocol": "TCP" }),
                &json!({ "port": 5600, "endPort": 5603, "protocol": "TCP" }),
            ]
        );
    }

    #[test]
    fn snapshot() {
        let (policy, compiled) = example();
        let np = desired(&policy, &compiled, &settings()).network_policy;
        insta::assert_yaml_snapshot!("network_policy", np.expect("generated by default"));
    }

    #[test]
    fn only_the_parent_gateway_reaches_ext_proc_and_only_prometheus_the_metrics() {
        let (policy, compiled) = example();
        let np = desired(&policy, &compiled, &settings())
            .network_policy
            .unwrap();
        let spec = np.spec.as_ref().unwrap();
        assert_eq!(
            spec.policy_types.as_deref(),
            Some(&["Ingress".to_string()][..])
        );
        // The EPP Pods, by the Deployment's own selector.
        let d = desired(&policy, &compiled, &settings()).deployment;
        assert_eq!(
            spec.pod_selector.as_ref().unwrap().match_labels,
            d.spec.unwrap().selector.match_labels
        );
        assert_eq!(
            admitted(&np),
            [
                (
                    9002,
                    json!([
                        {
                            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}},
                            "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}}
                        },
                        {
                            "namespaceSelector": {"matchExpressions": [{
                                "key": "kubernetes.io/metadata.name",
                                "operator": "In",
                                "values": ["envoy-gateway-system", "gateways"]
                            }]},
                            "podSelector": {"matchLabels": {
                                "gateway.envoyproxy.io/owning-gateway-name": "inference-gateway",
                                "gateway.envoyproxy.io/owning-gateway-namespace": "gateways"
                            }}
                        }
                    ])
                ),
                (
                    9090,
                    json!([{
                        "namespaceSelector": {},
                        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
                    }])
                ),
            ]
        );
    }

    #[test]
    fn a_parent_gateway_without_namespace_is_in_the_policys() {
        let mut spec = example_spec();
        spec.route.as_mut().unwrap().parent_refs[0].namespace = None;
        let compiled = kinference_policy::compile(&spec).unwrap();
        let policy = example_policy(spec);
        let np =
            network_policy(&policy, &Names::of(&policy), &compiled, engines(&compiled)).unwrap();
        let (port, from) = &admitted(&np)[0];
        assert_eq!(*port, 9002);
        assert_eq!(
            from[0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
            "team-a"
        );
        assert_eq!(
            from[1]["podSelector"]["matchLabels"]["gateway.envoyproxy.io/owning-gateway-namespace"],
            "team-a"
        );
    }

    #[test]
    fn overrides_replace_the_defaults() {
        let peer: NetworkPolicyPeer = serde_json::from_value(json!({
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}},
            "podSelector": {"matchLabels": {"app": "my-envoy"}}
        }))
        .unwrap();
        let np = with_settings(EppNetworkPolicySpec {
            ext_proc_from: Some(vec![peer.clone()]),
            metrics_from: Some(vec![]),
            ..EppNetworkPolicySpec::default()
        })
        .unwrap();
        // metricsFrom: [] closes the metrics port: no rule at all, never a
        // rule without `from` (which would admit everyone).
        assert_eq!(
            admitted(&np),
            [(9002, serde_json::to_value(vec![peer]).unwrap())]
        );

        let closed = with_settings(EppNetworkPolicySpec {
            ext_proc_from: Some(vec![]),
            metrics_from: Some(vec![]),
            ..EppNetworkPolicySpec::default()
        })
        .unwrap();
        assert_eq!(closed.spec.unwrap().ingress, Some(vec![]));
    }

    #[test]
    fn none_when_disabled_or_no_gateway_is_known() {
        assert!(
            with_settings(EppNetworkPolicySpec {
                enabled: false,
                ..EppNetworkPolicySpec::default()
            })
            .is_none()
        );
        let mut spec = example_spec();
        spec.route = None;
        let compiled = kinference_policy::compile(&spec).unwrap();
        let policy = example_policy(spec);
        assert!(
            network_policy(&policy, &Names::of(&policy), &compiled, engines(&compiled)).is_none()
        );
    }
}
