//! The EPP Service the InferencePool's `endpointPickerRef` points at.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kinference_api::InferencePolicy;

use super::deployment::epp_object_labels;
use super::{EPP_GRPC_PORT, EPP_METRICS_PORT, Names, epp_selector, events_ports, object_meta};

pub fn epp_service(policy: &InferencePolicy, names: &Names) -> Service {
    let port = |name: &str, number: i32, app_protocol: Option<&str>| ServicePort {
        name: Some(name.into()),
        port: number,
        target_port: Some(IntOrString::Int(number)),
        protocol: Some("TCP".into()),
        app_protocol: app_protocol.map(Into::into),
        ..ServicePort::default()
    };
    Service {
        metadata: object_meta(policy, &names.epp(), epp_object_labels(names)),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            selector: Some(epp_selector(names)),
            ports: Some(
                [
                    // Gateways speak ext_proc (gRPC) to it: appProtocol tells
                    // them to use HTTP/2.
                    port("grpc", EPP_GRPC_PORT, Some("http2")),
                    port("metrics", EPP_METRICS_PORT, None),
                ]
                .into_iter()
                // The model servers publish their KV-cache events here.
                .chain(
                    policy
                        .spec
                        .precise_prefix()
                        .map(events_ports)
                        .unwrap_or_default()
                        .iter()
                        .map(|(name, number)| port(name, *number, None)),
                )
                .collect(),
            ),
            ..ServiceSpec::default()
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
        insta::assert_yaml_snapshot!(
            "epp_service",
            desired(&policy, &compiled, &settings()).epp_service
        );
    }

    #[test]
    fn precise_prefix_adds_the_events_port() {
        let (policy, compiled) = example_precise();
        let service = desired(&policy, &compiled, &settings()).epp_service;
        let ports = service.spec.unwrap().ports.unwrap();
        let names: Vec<(&str, i32)> = ports
            .iter()
            .map(|p| (p.name.as_deref().unwrap(), p.port))
            .collect();
        assert_eq!(
            names,
            [("grpc", 9002), ("metrics", 9090), ("kv-events", 5600)]
        );
    }

    #[test]
    fn when_the_engines_bind_the_service_has_no_events_port() {
        let (mut policy, compiled) = example_precise();
        precise_mut(&mut policy).publisher_mode = Some(kinference_api::PublisherMode::Bind);
        let service = desired(&policy, &compiled, &settings()).epp_service;
        assert_eq!(service.spec.unwrap().ports.unwrap().len(), 2);
    }

    #[test]
    fn each_data_parallel_rank_has_an_events_port() {
        let (mut policy, compiled) = example_precise();
        precise_mut(&mut policy).data_parallel_size = Some(3);
        let service = desired(&policy, &compiled, &settings()).epp_service;
        let ports = service.spec.unwrap().ports.unwrap();
        let events: Vec<(&str, i32)> = ports
            .iter()
            .skip(2)
            .map(|p| (p.name.as_deref().unwrap(), p.port))
            .collect();
        assert_eq!(
            events,
            [
                ("kv-events", 5600),
                ("kv-events-1", 5601),
                ("kv-events-2", 5602)
            ]
        );
    }
}
