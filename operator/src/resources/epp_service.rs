//! The EPP Service the InferencePool's `endpointPickerRef` points at.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kinference_api::InferencePolicy;

use super::deployment::epp_object_labels;
use super::{EPP_GRPC_PORT, EPP_METRICS_PORT, Names, epp_selector, object_meta};

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
            ports: Some(vec![
                // Gateways speak ext_proc (gRPC) to it: appProtocol tells them
                // to use HTTP/2.
                port("grpc", EPP_GRPC_PORT, Some("http2")),
                port("metrics", EPP_METRICS_PORT, None),
            ]),
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
}
