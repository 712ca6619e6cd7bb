//! A `BackendTLSPolicy` (gateway.networking.k8s.io/v1) per https provider.
//! Without it a Gateway sends plain HTTP to the provider's port 443; with it
//! the Gateway originates TLS, verifying the provider's certificate for its
//! host name against the system CA bundle.

use gateway_api::apis::standard::backendtlspolicies::{
    BackendTlsPolicy, BackendTlsPolicySpec, BackendTlsPolicyTargetRefs, BackendTlsPolicyValidation,
};
use kinference_api::InferencePolicy;

use super::{Names, PROVIDER_LABEL, ProviderEndpoint, object_meta};

pub fn backend_tls_policy(
    policy: &InferencePolicy,
    names: &Names,
    provider: &str,
    endpoint: &ProviderEndpoint,
) -> BackendTlsPolicy {
    let name = names.provider(provider);
    BackendTlsPolicy {
        metadata: object_meta(
            policy,
            &name,
            [
                (
                    "app.kubernetes.io/component".to_string(),
                    "provider".to_string(),
                ),
                (PROVIDER_LABEL.to_string(), provider.to_string()),
            ],
        ),
        spec: BackendTlsPolicySpec {
            options: None,
            target_refs: vec![BackendTlsPolicyTargetRefs {
                group: String::new(),
                kind: "Service".into(),
                name,
                section_name: None,
            }],
            validation: BackendTlsPolicyValidation {
                hostname: endpoint.host.clone(),
                well_known_ca_certificates: Some("System".into()),
                ..BackendTlsPolicyValidation::default()
            },
        },
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
        let d = desired(&policy, &compiled, &settings());
        insta::assert_yaml_snapshot!("backend_tls_policy_openai", d.backend_tls_policies[0]);
    }
}
