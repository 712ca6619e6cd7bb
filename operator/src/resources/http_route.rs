//! The HTTPRoute in front of the pool. One rule per provider, matched on the
//! destination header the EPP sets (`x-kinference-destination:
//! provider/<name>`), then the default rule to the InferencePool, whose EPP
//! decides every request first. Gateway API ranks a match with more header
//! matches above one with only the same path, so provider rules win when the
//! header is present regardless of order; listing them first keeps that
//! obvious to readers.

use gateway_api::apis::standard::httproutes::{
    HttpRoute, HttpRouteParentRefs, HttpRouteRules, HttpRouteRulesBackendRefs,
    HttpRouteRulesFilters, HttpRouteRulesFiltersType, HttpRouteRulesFiltersUrlRewrite,
    HttpRouteRulesMatches, HttpRouteRulesMatchesHeaders, HttpRouteRulesMatchesHeadersType,
    HttpRouteRulesMatchesPath, HttpRouteRulesMatchesPathType, HttpRouteSpec,
};
use kinference_api::{DESTINATION_HEADER, InferencePolicy};
use kinference_policy::CompiledPolicy;

use super::{Names, ProviderEndpoint, object_meta};

pub const DEFAULT_PATH_PREFIX: &str = "/";

pub fn http_route(
    policy: &InferencePolicy,
    names: &Names,
    compiled: &CompiledPolicy,
    providers: &[(String, ProviderEndpoint)],
) -> HttpRoute {
    let route = &compiled.route;
    let prefix = route
        .path_prefix
        .clone()
        .unwrap_or_else(|| DEFAULT_PATH_PREFIX.to_string());
    let path = HttpRouteRulesMatchesPath {
        r#type: Some(HttpRouteRulesMatchesPathType::PathPrefix),
        value: Some(prefix),
    };

    let mut rules: Vec<HttpRouteRules> = providers
        .iter()
        .map(|(name, endpoint)| HttpRouteRules {
            name: Some(format!("provider-{name}")),
            matches: Some(vec![HttpRouteRulesMatches {
                path: Some(path.clone()),
                headers: Some(vec![HttpRouteRulesMatchesHeaders {
                    name: DESTINATION_HEADER.into(),
                    r#type: Some(HttpRouteRulesMatchesHeadersType::Exact),
                    value: format!("provider/{name}"),
                }]),
                ..HttpRouteRulesMatches::default()
            }]),
            // The provider serves its own virtual host (and TLS SNI): the
            // gateway's Host header would be refused.
            filters: Some(vec![HttpRouteRulesFilters {
                r#type: HttpRouteRulesFiltersType::UrlRewrite,
                url_rewrite: Some(HttpRouteRulesFiltersUrlRewrite {
                    hostname: Some(endpoint.host.clone()),
                    path: None,
                }),
                ..HttpRouteRulesFilters::default()
            }]),
            backend_refs: Some(vec![HttpRouteRulesBackendRefs {
                name: names.provider(name),
                port: Some(endpoint.port.into()),
                ..HttpRouteRulesBackendRefs::default()
            }]),
            ..HttpRouteRules::default()
        })
        .collect();
    rules.push(HttpRouteRules {
        name: Some("default".into()),
        matches: Some(vec![HttpRouteRulesMatches {
            path: Some(path),
            ..HttpRouteRulesMatches::default()
        }]),
        backend_refs: Some(vec![HttpRouteRulesBackendRefs {
            group: Some("inference.networking.k8s.io".into()),
            kind: Some("InferencePool".into()),
            name: names.pool(),
            ..HttpRouteRulesBackendRefs::default()
        }]),
        ..HttpRouteRules::default()
    });

    let mut http_route = HttpRoute::new(
        &names.route(),
        HttpRouteSpec {
            parent_refs: Some(
                route
                    .parent_refs
                    .iter()
                    .map(|p| HttpRouteParentRefs {
                        group: Some("gateway.networking.k8s.io".into()),
                        kind: Some("Gateway".into()),
                        name: p.name.clone(),
                        namespace: p.namespace.clone(),
                        section_name: p.section_name.clone(),
                        port: None,
                    })
                    .collect(),
            ),
            hostnames: (!route.hostnames.is_empty()).then(|| route.hostnames.clone()),
            rules: Some(rules),
        },
    );
    http_route.metadata = object_meta(policy, &names.route(), []);
    http_route
}

#[cfg(test)]
mod tests {
    use crate::resources::desired;
    use crate::resources::testing::*;

    #[test]
    fn snapshot() {
        let (policy, compiled) = example();
        insta::assert_yaml_snapshot!(
            "http_route",
            desired(&policy, &compiled, &settings()).http_route.unwrap()
        );
    }

    #[test]
    fn default_path_prefix_is_root() {
        let mut spec = example_spec();
        spec.route.as_mut().unwrap().path_prefix = None;
        spec.providers.clear();
        spec.rules.remove(0);
        let compiled = kinference_policy::compile(&spec).unwrap();
        let route = desired(&example_policy(spec), &compiled, &settings())
            .http_route
            .unwrap();
        let rules = route.spec.rules.unwrap();
        assert_eq!(rules.len(), 1);
        let path = rules[0].matches.as_ref().unwrap()[0].path.as_ref().unwrap();
        assert_eq!(path.value.as_deref(), Some("/"));
    }
}
