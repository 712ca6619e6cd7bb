//! Rendering the bootstrap templates of `crates/testbed/envoy/`.

use std::net::SocketAddr;
use std::path::Path;

/// Which template, i.e. how Envoy talks to the EPP and reaches the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Template {
    /// The reference chart: `FULL_DUPLEX_STREAMED`, `ORIGINAL_DST` cluster.
    Streamed,
    /// The reference test config: `BUFFERED` body, response headers skipped.
    Buffered,
    /// Streamed, with the override-host policy consuming the fallback list.
    Fallback,
    /// No ext_proc: a static route to the pool (a baseline).
    Static,
}

impl Template {
    fn text(self) -> &'static str {
        match self {
            Template::Streamed => include_str!("../../envoy/streamed.yaml"),
            Template::Buffered => include_str!("../../envoy/buffered.yaml"),
            Template::Fallback => include_str!("../../envoy/fallback.yaml"),
            Template::Static => include_str!("../../envoy/static.yaml"),
        }
    }
}

/// How a [`Template::Fallback`] gateway tells the EPP which host answered
/// a request, a fallback's or the pick's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServedReport {
    /// The override-host policy's `selected_host_key`: `envoy.lb`
    /// `x-gateway-destination-endpoint-served` metadata, the protocol's.
    Metadata,
    /// The ext_proc filter's `response_attributes: [upstream.address]`.
    Attribute,
    /// Neither: the EPP cannot tell a fallback from its pick.
    None,
}

/// Everything a template needs. Build with struct update syntax from
/// [`Bootstrap::new`].
#[derive(Debug, Clone)]
pub struct Bootstrap {
    pub template: Template,
    /// The EPP's ext_proc address (unused by [`Template::Static`]).
    pub epp: SocketAddr,
    /// More EPP replicas beside `epp`: Envoy spreads the ext_proc streams
    /// over all of them, round robin, as over an EPP Service's Pods.
    pub epp_replicas: Vec<SocketAddr>,
    /// Route a request on without the EPP when its ext_proc stream fails
    /// (`failure_mode_allow`): what a gateway does for an InferencePool
    /// with `failureMode: FailOpen`.
    pub fail_open: bool,
    /// Talk TLS to the EPP (its default), without verifying its certificate,
    /// as the reference configurations do.
    pub epp_tls: bool,
    /// With `epp_tls`: the client certificate Envoy presents to the EPP
    /// (mTLS, for an EPP started with a client CA).
    pub epp_client_cert: Option<ClientCert>,
    /// The pool's endpoints, for the templates with a static pool cluster.
    pub pool: Vec<SocketAddr>,
    /// Provider name → the address serving it (plain HTTP on loopback).
    pub providers: Vec<(String, SocketAddr)>,
    /// Puts `envoy.lb.subset_hint` filter metadata on every request, as a
    /// gateway that pre-filters endpoints would.
    pub subset_hint: Option<Vec<String>>,
    /// Overrides the template's `response_header_mode` (`SEND` / `SKIP`).
    pub response_header_mode: Option<&'static str>,
    /// [`Template::Fallback`] only: a `BUFFERED` request body (no response
    /// body or trailers) instead of `FULL_DUPLEX_STREAMED` both ways.
    pub buffered: bool,
    /// [`Template::Fallback`] only.
    pub served_report: ServedReport,
    /// The reference chart's 32 KiB unless set.
    pub listener_buffer_bytes: u32,
    /// Envoy worker threads.
    pub concurrency: usize,
    pub log_level: String,
}

/// A certificate chain and its private key, both PEM, inlined into the
/// bootstrap (no files to clean up).
#[derive(Debug, Clone)]
pub struct ClientCert {
    pub cert_pem: String,
    pub key_pem: String,
}

/// Access-log line, space-separated: status, response flags, upstream host,
/// request id, attempts, bytes received, the destination header as the
/// router saw it, the `envoy.lb` destination metadata Envoy accepted, the
/// rule the EPP named (`x-kinference-rule`), and the ms from the request's
/// start to the upstream's first response byte. `-` where a field is absent.
/// [`super::AccessRecord`] reads it back.
pub const ACCESS_LOG_FORMAT: &str = "%RESPONSE_CODE% %RESPONSE_FLAGS% %UPSTREAM_HOST% %REQ(X-REQUEST-ID)% %UPSTREAM_REQUEST_ATTEMPT_COUNT% %BYTES_RECEIVED% %REQ(X-GATEWAY-DESTINATION-ENDPOINT)% %DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)% %REQ(X-KINFERENCE-RULE)% %RESPONSE_DURATION% %DYNAMIC_METADATA(envoy.lb:x-kinference-decision-detail)%";

impl Bootstrap {
    pub fn new(template: Template, epp: SocketAddr) -> Self {
        Bootstrap {
            template,
            epp,
            epp_replicas: Vec::new(),
            fail_open: false,
            epp_tls: true,
            epp_client_cert: None,
            pool: Vec::new(),
            providers: Vec::new(),
            subset_hint: None,
            response_header_mode: None,
            buffered: false,
            served_report: ServedReport::Metadata,
            listener_buffer_bytes: 32 * 1024,
            concurrency: 1,
            log_level: "warning".into(),
        }
    }

    /// The bootstrap YAML, writing the access log to `access_log`.
    pub fn render(&self, access_log: &Path) -> String {
        let scalars: Vec<(&str, String)> = vec![
            ("LISTENER_PORT", "0".into()),
            (
                "LISTENER_BUFFER_BYTES",
                self.listener_buffer_bytes.to_string(),
            ),
            ("ACCESS_LOG", access_log.display().to_string()),
            ("ACCESS_LOG_FORMAT", ACCESS_LOG_FORMAT.into()),
            ("EPP_ADDRESS", self.epp.ip().to_string()),
            ("EPP_PORT", self.epp.port().to_string()),
            ("FAILURE_MODE_ALLOW", self.fail_open.to_string()),
            (
                "RESPONSE_HEADER_MODE",
                self.response_header_mode
                    .unwrap_or(match self.template {
                        Template::Buffered => "SKIP",
                        _ => "SEND",
                    })
                    .into(),
            ),
            (
                "REQUEST_BODY_MODE",
                if self.buffered {
                    "BUFFERED"
                } else {
                    "FULL_DUPLEX_STREAMED"
                }
                .into(),
            ),
            (
                "RESPONSE_BODY_MODE",
                if self.buffered {
                    "NONE"
                } else {
                    "FULL_DUPLEX_STREAMED"
                }
                .into(),
            ),
            (
                "TRAILER_MODE",
                if self.buffered { "SKIP" } else { "SEND" }.into(),
            ),
        ];
        let blocks: Vec<(&str, Vec<String>)> = vec![
            ("PROVIDER_ROUTES", self.provider_routes()),
            ("PROVIDER_CLUSTERS", self.provider_clusters()),
            (
                "POOL_ENDPOINTS",
                self.pool.iter().map(|a| endpoint(*a)).collect(),
            ),
            (
                "EPP_REPLICAS",
                self.epp_replicas.iter().map(|a| endpoint(*a)).collect(),
            ),
            ("PRE_FILTERS", self.pre_filters()),
            ("EPP_TRANSPORT_SOCKET", self.epp_transport_socket()),
            ("SELECTED_HOST_KEY", self.selected_host_key()),
            ("RESPONSE_ATTRIBUTES", self.response_attributes()),
        ];
        render(self.template.text(), &scalars, &blocks)
    }

    fn provider_routes(&self) -> Vec<String> {
        self.providers
            .iter()
            .map(|(name, _)| {
                format!(
                    "- {{ match: {{ prefix: \"/\", headers: [{{ name: x-kinference-destination, \
                     string_match: {{ exact: \"provider/{name}\" }} }}] }}, \
                     route: {{ cluster: \"provider-{name}\", timeout: 86400s }} }}"
                )
            })
            .collect()
    }

    fn provider_clusters(&self) -> Vec<String> {
        self.providers
            .iter()
            .map(|(name, addr)| {
                format!(
                    "- {{ name: \"provider-{name}\", type: STATIC, connect_timeout: 5s, \
                     load_assignment: {{ cluster_name: \"provider-{name}\", endpoints: \
                     [{{ lb_endpoints: [{}] }}] }} }}",
                    endpoint_flow(*addr)
                )
            })
            .collect()
    }

    fn pre_filters(&self) -> Vec<String> {
        let Some(subset) = &self.subset_hint else {
            return Vec::new();
        };
        let list = subset
            .iter()
            .map(|s| format!("\"{s}\""))
            .collect::<Vec<_>>()
            .join(", ");
        vec![format!(
            "- {{ name: envoy.filters.http.set_metadata, typed_config: {{ \"@type\": \
             type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config, \
             metadata: [{{ metadata_namespace: envoy.lb.subset_hint, value: \
             {{ x-gateway-destination-endpoint-subset: [{list}] }} }}] }} }}"
        )]
    }

    fn selected_host_key(&self) -> Vec<String> {
        match self.served_report {
            ServedReport::Metadata => vec![
                "selected_host_key: { key: envoy.lb, path: [{ key: x-gateway-destination-endpoint-served }] }"
                    .into(),
            ],
            _ => Vec::new(),
        }
    }

    fn response_attributes(&self) -> Vec<String> {
        match self.served_report {
            ServedReport::Attribute => vec!["response_attributes: [upstream.address]".into()],
            _ => Vec::new(),
        }
    }

    fn epp_transport_socket(&self) -> Vec<String> {
        if !self.epp_tls {
            return Vec::new();
        }
        // The EPP's certificate is self-signed: encrypted, not verified, as
        // the reference chart configures it.
        let client_cert = match &self.epp_client_cert {
            None => String::new(),
            // JSON strings are YAML double-quoted scalars: the PEM's newlines
            // survive as \n escapes on one line.
            Some(c) => format!(
                ", tls_certificates: [{{ certificate_chain: {{ inline_string: {} }}, \
                 private_key: {{ inline_string: {} }} }}]",
                serde_json::Value::from(c.cert_pem.as_str()),
                serde_json::Value::from(c.key_pem.as_str())
            ),
        };
        vec![format!(
            "transport_socket: {{ name: envoy.transport_sockets.tls, typed_config: {{ \"@type\": \
             type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext, \
             sni: kinference-epp, common_tls_context: {{ alpn_protocols: [h2]{client_cert} }} }} }}"
        )]
    }
}

fn endpoint(addr: SocketAddr) -> String {
    format!("- {}", endpoint_flow(addr))
}

fn endpoint_flow(addr: SocketAddr) -> String {
    format!(
        "{{ endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }} }}",
        addr.ip(),
        addr.port()
    )
}

/// `${NAME}` standing alone on a line becomes the block's lines at that
/// indentation (nothing when empty); elsewhere `${NAME}` is a scalar.
fn render(template: &str, scalars: &[(&str, String)], blocks: &[(&str, Vec<String>)]) -> String {
    let mut out = String::with_capacity(template.len() + 1024);
    for line in template.lines() {
        let trimmed = line.trim();
        if let Some((_, items)) = blocks
            .iter()
            .find(|(name, _)| trimmed == format!("${{{name}}}"))
        {
            let indent = &line[..line.len() - line.trim_start().len()];
            for item in items {
                out.push_str(indent);
                out.push_str(item);
                out.push('\n');
            }
            continue;
        }
        let mut line = line.to_string();
        for (name, value) in scalars {
            line = line.replace(&format!("${{{name}}}"), value);
        }
        out.push_str(&line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Template; 4] = [
        Template::Streamed,
        Template::Buffered,
        Template::Fallback,
        Template::Static,
    ];

    /// `template` with every optional block filled.
    fn full(template: Template) -> Bootstrap {
        Bootstrap {
            pool: vec!["127.0.0.1:8000".parse().unwrap()],
            providers: vec![("cloud".into(), "127.0.0.1:9000".parse().unwrap())],
            subset_hint: Some(vec!["127.0.0.1:8000".into()]),
            epp_replicas: vec!["127.0.0.1:9012".parse().unwrap()],
            ..Bootstrap::new(template, "127.0.0.1:9002".parse().unwrap())
        }
    }

    #[test]
    fn epp_replicas_are_endpoints_of_the_epp_cluster() {
        let text = full(Template::Streamed).render(Path::new("/tmp/access.log"));
        let cluster = &text[text.find("- name: epp").unwrap()..text.find("- name: pool").unwrap()];
        for port in ["9002", "9012"] {
            assert!(
                cluster.contains(&format!("port_value: {port}")),
                "{cluster}"
            );
        }
    }

    #[test]
    fn every_placeholder_is_filled() {
        for template in ALL {
            let text = full(template).render(Path::new("/tmp/access.log"));
            assert!(
                !text.contains("${"),
                "{template:?} left a placeholder:\n{text}"
            );
        }
    }

    #[test]
    fn a_client_certificate_is_inlined_into_the_epp_cluster() {
        let text = Bootstrap {
            epp_client_cert: Some(ClientCert {
                cert_pem: "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".into(),
                key_pem: "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n".into(),
            }),
            ..full(Template::Streamed)
        }
        .render(Path::new("/tmp/access.log"));
        let socket = text
            .lines()
            .find(|l| l.contains("UpstreamTlsContext"))
            .expect("a TLS transport socket");
        assert!(
            socket.contains(
                "tls_certificates: [{ certificate_chain: { inline_string: \"-----BEGIN CERTIFICATE-----\\nMIIB\\n-----END CERTIFICATE-----\\n\" }"
            ),
            "{socket}"
        );
        assert!(
            socket.contains("private_key: { inline_string: \"-----BEGIN PRIVATE KEY-----\\nMIIE"),
            "{socket}"
        );
        // Without one, the same TLS socket and no certificate.
        let plain = full(Template::Streamed).render(Path::new("/tmp/access.log"));
        assert!(plain.contains("alpn_protocols: [h2] } } }"), "{plain}");
        assert!(!plain.contains("tls_certificates"));
    }

    #[test]
    fn block_placeholders_keep_their_indentation() {
        let out = render(
            "a:\n  ${LIST}\nb: ${X}\n",
            &[("X", "1".into())],
            &[("LIST", vec!["- one".into(), "- two".into()])],
        );
        assert_eq!(out, "a:\n  - one\n  - two\nb: 1\n");
    }

    /// Every template, with every optional block filled, is a configuration
    /// the pinned Envoy accepts (`envoy --mode validate`).
    #[test]
    fn the_pinned_envoy_accepts_every_template() {
        let envoy = crate::envoy::ensure_envoy().expect("Envoy is installed");
        let dir = tempfile::tempdir().unwrap();
        for template in ALL {
            let path = dir.path().join("envoy.yaml");
            let text = full(template).render(&dir.path().join("access.log"));
            std::fs::write(&path, text).unwrap();
            let out = std::process::Command::new(&envoy)
                .args(["--mode", "validate", "--disable-hot-restart", "-c"])
                .arg(&path)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{template:?}:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
