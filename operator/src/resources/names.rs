//! Names of generated objects, and the checks that they will be valid
//! Kubernetes names. The policy compiler knows nothing of Kubernetes, so a
//! provider called `My_Provider` compiles; the operator reports it as an
//! invalid policy instead of failing every apply.

use kinference_api::InferencePolicy;
use kinference_policy::{CompileError, PolicySpec};
use kube::ResourceExt;

use super::provider_service::ProviderEndpoint;

/// A DNS-1035 label (Service names) is at most this long.
const MAX_LABEL: usize = 63;
const EPP_SUFFIX: &str = "-epp";
const PROVIDER_INFIX: &str = "-provider-";
/// An HTTPRoute holds at most 16 rules: one per provider plus the default.
pub const MAX_PROVIDERS_WITH_ROUTE: usize = 15;

/// Every generated name of one policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    pub policy: String,
    /// The existing InferencePool an attached policy serves.
    pub attached_pool: Option<String>,
}

impl Names {
    pub fn of(policy: &InferencePolicy) -> Self {
        Self {
            policy: policy.name_any(),
            attached_pool: policy.spec.attached_pool().map(str::to_string),
        }
    }

    pub fn new(policy: impl Into<String>) -> Self {
        Self {
            policy: policy.into(),
            attached_pool: None,
        }
    }

    /// The pool an attached policy names; otherwise the policy's own name,
    /// which the InferencePool it generates takes: it is what a Gateway
    /// operator sees in `kubectl get inferencepools`.
    pub fn pool(&self) -> String {
        self.attached_pool
            .clone()
            .unwrap_or_else(|| self.policy.clone())
    }

    pub fn route(&self) -> String {
        self.policy.clone()
    }

    pub fn config_map(&self) -> String {
        format!("{}-policy", self.policy)
    }

    /// Where each EPP Pod reports the policy hash it has loaded (one data
    /// key per Pod).
    pub fn epp_status(&self) -> String {
        format!("{}{EPP_SUFFIX}-status", self.policy)
    }

    /// Deployment, Service, ServiceAccount, Role, RoleBinding and
    /// NetworkPolicy of the EPP.
    pub fn epp(&self) -> String {
        format!("{}{EPP_SUFFIX}", self.policy)
    }

    /// ExternalName Service (and BackendTLSPolicy) of one provider.
    pub fn provider(&self, provider: &str) -> String {
        format!("{}{PROVIDER_INFIX}{provider}", self.policy)
    }
}

/// Problems that would make generated objects invalid, as compile errors
/// (`metadata.name`, `spec.providers[i].name`, `spec.providers[i].baseUrl`).
pub fn validate_names(policy_name: &str, spec: &PolicySpec) -> Vec<CompileError> {
    let mut errors = Vec::new();
    let epp = format!("{policy_name}{EPP_SUFFIX}");
    if !is_dns1035_label(&epp) {
        errors.push(CompileError {
            path: "metadata.name".into(),
            message: format!(
                "the EPP Service {epp:?} derived from this name would not be a valid Service name: \
                 use lower-case letters, digits and '-', starting with a letter, at most {} characters",
                MAX_LABEL - EPP_SUFFIX.len()
            ),
        });
    }
    for (i, provider) in spec.providers.iter().enumerate() {
        let service = format!("{policy_name}{PROVIDER_INFIX}{}", provider.name);
        if !provider.name.is_empty() && !is_dns1035_label(&service) {
            errors.push(CompileError {
                path: format!("spec.providers[{i}].name"),
                message: format!(
                    "the provider Service {service:?} would not be a valid Service name: \
                     use lower-case letters, digits and '-', at most {MAX_LABEL} characters with the policy name"
                ),
            });
        }
        let url = provider.url().unwrap_or_default();
        let has_scheme = url.starts_with("https://") || url.starts_with("http://");
        if has_scheme && ProviderEndpoint::parse(url).is_none() {
            let field = if provider.base_url.is_some() {
                "baseURL"
            } else {
                "baseUrl"
            };
            errors.push(CompileError {
                path: format!("spec.providers[{i}].{field}"),
                message: format!(
                    "{url:?} has no usable host name and port for an ExternalName Service"
                ),
            });
        }
    }
    let has_route = spec
        .route
        .as_ref()
        .is_some_and(|r| !r.parent_refs.is_empty());
    if has_route && spec.providers.len() > MAX_PROVIDERS_WITH_ROUTE {
        errors.push(CompileError {
            path: "spec.providers".into(),
            message: format!(
                "{} providers declared, but the generated HTTPRoute fits at most {MAX_PROVIDERS_WITH_ROUTE} \
                 (Gateway API allows 16 rules: one per provider plus the default rule)",
                spec.providers.len()
            ),
        });
    }
    errors
}

/// `[a-z]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub fn is_dns1035_label(s: &str) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= MAX_LABEL
        && bytes[0].is_ascii_lowercase()
        && bytes[bytes.len() - 1] != b'-'
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::testing::example_spec;

    #[test]
    fn names() {
        let n = Names::new("chat");
        assert_eq!(n.pool(), "chat");
        assert_eq!(n.config_map(), "chat-policy");
        assert_eq!(n.epp(), "chat-epp");
        assert_eq!(n.epp_status(), "chat-epp-status");
        assert_eq!(n.provider("openai"), "chat-provider-openai");
    }

    #[test]
    fn dns1035() {
        assert!(is_dns1035_label("chat-epp"));
        assert!(!is_dns1035_label("1chat-epp"));
        assert!(!is_dns1035_label("chat.v2-epp"));
        assert!(!is_dns1035_label("Chat-epp"));
        assert!(!is_dns1035_label("chat-"));
        assert!(!is_dns1035_label(&"a".repeat(64)));
    }

    #[test]
    fn valid_example_has_no_name_errors() {
        assert!(validate_names("chat", &example_spec()).is_empty());
    }

    #[test]
    fn bad_names_are_reported_with_paths() {
        let mut spec = example_spec();
        spec.providers[1].name = "Internal_Proxy".into();
        spec.providers[0].base_url = Some("https:///v1".into());
        let errors = validate_names("chat.v2", &spec);
        let paths: Vec<&str> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "metadata.name",
                "spec.providers[0].name",
                "spec.providers[0].baseURL",
                "spec.providers[1].name"
            ]
        );
        let long = "p".repeat(60);
        let errors = validate_names(&long, &example_spec());
        assert!(
            errors[0].message.contains("at most 59 characters"),
            "{}",
            errors[0].message
        );
    }
}
