//! One `ExternalName` Service per provider: the HTTPRoute's provider rule
//! needs an in-cluster backendRef, and an ExternalName Service is how Gateway
//! API implementations reach a DNS name outside the cluster.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use kinference_api::InferencePolicy;

use super::{Names, PROVIDER_LABEL, object_meta};

/// Host and port of a provider's base URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderEndpoint {
    /// Lower-cased host name (what the ExternalName Service resolves).
    pub host: String,
    pub port: u16,
    /// `https://`: the gateway must originate TLS (BackendTLSPolicy).
    pub tls: bool,
}

impl ProviderEndpoint {
    /// Parses `http(s)://[user@]host[:port][/path]`. The port defaults to 443
    /// for https and 80 for http. None when there is no usable host or port
    /// (the policy is then reported invalid, see `validate_names`).
    pub fn parse(base_url: &str) -> Option<Self> {
        let (tls, rest) = if let Some(rest) = base_url.strip_prefix("https://") {
            (true, rest)
        } else {
            (false, base_url.strip_prefix("http://")?)
        };
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
        // An ExternalName must be a DNS name, so IPv6 literals ("[::1]") are
        // rejected rather than parsed.
        if host_port.starts_with('[') {
            return None;
        }
        let (host, port) = match host_port.split_once(':') {
            Some((host, port)) => (host, port.parse::<u16>().ok().filter(|p| *p != 0)?),
            None => (host_port, if tls { 443 } else { 80 }),
        };
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        let valid = !host.is_empty()
            && host.len() <= 253
            && host.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && !label.starts_with('-')
                    && !label.ends_with('-')
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            });
        valid.then_some(Self { host, port, tls })
    }

    /// Service port name: tells humans (and some meshes) the protocol.
    pub fn port_name(&self) -> &'static str {
        if self.tls { "https" } else { "http" }
    }
}

pub fn provider_service(
    policy: &InferencePolicy,
    names: &Names,
    provider: &str,
    endpoint: &ProviderEndpoint,
) -> Service {
    Service {
        metadata: object_meta(
            policy,
            &names.provider(provider),
            [
                (
                    "app.kubernetes.io/component".to_string(),
                    "provider".to_string(),
                ),
                (PROVIDER_LABEL.to_string(), provider.to_string()),
            ],
        ),
        spec: Some(ServiceSpec {
            type_: Some("ExternalName".into()),
            external_name: Some(endpoint.host.clone()),
            ports: Some(vec![ServicePort {
                name: Some(endpoint.port_name().into()),
                port: endpoint.port.into(),
                protocol: Some("TCP".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::testing::*;
    use crate::resources::{Names, desired};

    #[test]
    fn parses_base_urls() {
        let p = ProviderEndpoint::parse;
        assert_eq!(
            p("https://api.openai.com/v1"),
            Some(ProviderEndpoint {
                host: "api.openai.com".into(),
                port: 443,
                tls: true
            })
        );
        assert_eq!(
            p("http://Proxy.Corp:8080"),
            Some(ProviderEndpoint {
                host: "proxy.corp".into(),
                port: 8080,
                tls: false
            })
        );
        assert_eq!(p("http://proxy/v1").unwrap().port, 80);
        assert_eq!(
            p("https://user:pw@api.example.com:8443/x?y#z")
                .unwrap()
                .port,
            8443
        );
        assert_eq!(
            p("https://api.example.com./v1").unwrap().host,
            "api.example.com"
        );
        assert_eq!(p("https:///v1"), None);
        assert_eq!(p("https://[::1]:443/"), None);
        assert_eq!(p("https://api.example.com:0/"), None);
        assert_eq!(p("https://api.example.com:99999/"), None);
        assert_eq!(p("https://bad_host/"), None);
        assert_eq!(p("ftp://example.com"), None);
    }

    #[test]
    fn snapshot() {
        let (policy, compiled) = example();
        let d = desired(&policy, &compiled, &settings());
        assert_eq!(
            d.provider_services[0].metadata.name.as_deref(),
            Some(Names::new("chat").provider("openai").as_str())
        );
        insta::assert_yaml_snapshot!("provider_service_openai", d.provider_services[0]);
        insta::assert_yaml_snapshot!("provider_service_internal", d.provider_services[1]);
    }
}
