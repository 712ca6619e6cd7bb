//! Endpoints without a cluster, for `kinference demo` and local runs: from a
//! YAML/JSON file, or built in process.
//!
//! File shape (YAML or JSON; a bare list, or `{endpoints: [...]}`; several
//! YAML documents are concatenated):
//!
//! ```yaml
//! - name: vllm-a              # optional, defaults to the address
//!   address: 127.0.0.1:8001   # ip:port ([::1]:8001 for IPv6; localhost:8001 allowed)
//!   models: [llama-3-8b, sql-lora]
//!   backend: vllm             # optional
//!   zone: local-a             # optional
//!   node: laptop              # optional
//!   namespace: default        # optional
//!   labels: {tier: gpu}       # optional
//! ```

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;

use anyhow::{Context, anyhow, bail};
use serde::Deserialize;
use serde_json::Value;

use super::registry::Endpoint;

/// One endpoint as written in an endpoints file or built in process.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointSpec {
    /// Unique name; defaults to the address.
    #[serde(default)]
    pub name: Option<String>,
    /// `ip:port`, `[v6]:port` or `localhost:port`.
    pub address: String,
    /// Models (and adapters) served.
    #[serde(default)]
    pub models: Vec<String>,
    /// Which of `models` are LoRA adapters.
    #[serde(default)]
    pub adapters: Vec<String>,
    /// Backend (serving stack) name.
    #[serde(default)]
    pub backend: Option<String>,
    /// Zone.
    #[serde(default)]
    pub zone: Option<String>,
    /// Node.
    #[serde(default)]
    pub node: Option<String>,
    /// Namespace (empty by default).
    #[serde(default)]
    pub namespace: Option<String>,
    /// Free-form labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

impl EndpointSpec {
    /// A spec with just an address and models.
    pub fn new(address: impl Into<String>, models: &[&str]) -> Self {
        Self {
            address: address.into(),
            models: models.iter().map(|m| m.to_string()).collect(),
            ..Self::default()
        }
    }
}

/// Reads an endpoints file (YAML or JSON) into endpoints.
pub fn load_endpoints_file(path: &Path) -> anyhow::Result<Vec<Endpoint>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading endpoints file {}", path.display()))?;
    parse_endpoints(&text).with_context(|| format!("in endpoints file {}", path.display()))
}

/// Parses endpoints from YAML or JSON text (see the module docs for the
/// shape).
pub(crate) fn parse_endpoints(text: &str) -> anyhow::Result<Vec<Endpoint>> {
    let docs = kinference_policy::source::parse_documents(text).map_err(|d| anyhow!("{d}"))?;
    let mut specs = Vec::new();
    for doc in docs {
        let list = match doc.value {
            Value::Null => continue,
            Value::Array(items) => items,
            Value::Object(mut map) => match map.remove("endpoints") {
                Some(Value::Array(items)) => items,
                Some(Value::Null) => continue,
                _ => bail!("expected a list of endpoints or an object with an `endpoints` list"),
            },
            _ => bail!("expected a list of endpoints or an object with an `endpoints` list"),
        };
        for item in list {
            let i = specs.len();
            let spec: EndpointSpec =
                serde_json::from_value(item).with_context(|| format!("endpoint #{}", i + 1))?;
            specs.push(spec);
        }
    }
    endpoints_from_specs(specs)
}

/// Builds endpoints from specs, checking addresses and name uniqueness.
pub fn endpoints_from_specs(
    specs: impl IntoIterator<Item = EndpointSpec>,
) -> anyhow::Result<Vec<Endpoint>> {
    let mut names = HashSet::new();
    let mut out = Vec::new();
    for (i, spec) in specs.into_iter().enumerate() {
        let addr = parse_address(&spec.address)
            .with_context(|| format!("endpoint #{}: bad address {:?}", i + 1, spec.address))?;
        let name = spec
            .name
            .filter(|n| !n.trim().is_empty())
            .unwrap_or_else(|| addr.to_string());
        if !names.insert(name.clone()) {
            bail!("endpoint #{}: duplicate name {name:?}", i + 1);
        }
        out.push(Endpoint {
            pod: name.clone(),
            uid: None,
            name,
            namespace: spec.namespace.unwrap_or_default(),
            ip: addr.ip(),
            port: addr.port(),
            models: spec
                .models
                .into_iter()
                .map(|m| m.trim().to_string())
                .filter(|m| !m.is_empty())
                .collect(),
            adapters: spec
                .adapters
                .into_iter()
                .map(|m| m.trim().to_string())
                .filter(|m| !m.is_empty())
                .collect(),
            backend: spec.backend,
            zone: spec.zone,
            node: spec.node,
            labels: spec.labels,
        });
    }
    Ok(out)
}

/// `ip:port`, `[v6]:port`, or `localhost:port` (no DNS: the request path
/// needs literal IPs, and a local run has nothing else to resolve).
fn parse_address(s: &str) -> anyhow::Result<SocketAddr> {
    let s = s.trim();
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(addr);
    }
    if let Some(port) = s.strip_prefix("localhost:") {
        let port: u16 = port.parse().context("bad port")?;
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    bail!("expected ip:port")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_list() {
        let eps = parse_endpoints(
            "- name: a\n  address: 127.0.0.1:8001\n  models: [m1, ' m2 ']\n  backend: vllm\n  zone: z1\n  labels: {tier: gpu}\n\
             - address: '[::1]:8002'\n  models: [m1]\n",
        )
        .unwrap();
        assert_eq!(eps.len(), 2);
        assert_eq!(eps[0].name, "a");
        assert_eq!(eps[0].address(), "127.0.0.1:8001");
        assert_eq!(eps[0].models, ["m1", "m2"]);
        assert_eq!(eps[0].backend.as_deref(), Some("vllm"));
        assert_eq!(eps[0].zone.as_deref(), Some("z1"));
        assert_eq!(eps[0].labels["tier"], "gpu");
        assert_eq!(eps[1].name, "[::1]:8002");
        assert_eq!(eps[1].port, 8002);
    }

    #[test]
    fn json_and_wrapped_and_multi_doc() {
        let eps =
            parse_endpoints(r#"{"endpoints": [{"address": "localhost:9000", "models": ["x"]}]}"#)
                .unwrap();
        assert_eq!(eps[0].address(), "127.0.0.1:9000");
        let eps =
            parse_endpoints("- address: 10.0.0.1:1\n---\n- address: 10.0.0.2:1\n---\n").unwrap();
        assert_eq!(eps.len(), 2);
        assert!(parse_endpoints("").unwrap().is_empty());
    }

    #[test]
    fn errors_are_clear() {
        let e = parse_endpoints("- address: nope\n").unwrap_err();
        assert!(format!("{e:#}").contains("bad address"), "{e:#}");
        let e = parse_endpoints("- address: 1.2.3.4:1\n  modles: [x]\n").unwrap_err();
        assert!(format!("{e:#}").contains("modles"), "{e:#}");
        let e =
            parse_endpoints("- {name: a, address: 1.2.3.4:1}\n- {name: a, address: 1.2.3.4:2}\n")
                .unwrap_err();
        assert!(format!("{e:#}").contains("duplicate"), "{e:#}");
        assert!(parse_endpoints("42").is_err());
        assert!(parse_endpoints("- [").is_err());
    }

    #[test]
    fn specs_in_process() {
        let eps = endpoints_from_specs([
            EndpointSpec::new("127.0.0.1:1", &["a"]),
            EndpointSpec {
                name: Some("b".into()),
                ..EndpointSpec::new("127.0.0.1:2", &["b"])
            },
        ])
        .unwrap();
        assert_eq!(eps[0].name, "127.0.0.1:1");
        assert_eq!(eps[1].name, "b");
    }
}
