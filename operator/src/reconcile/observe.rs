//! Reads the state the status reports on: referenced Secrets and Gateways,
//! the EPP Deployment and its Pods, the ConfigMap's policy hash.

use std::collections::{BTreeMap, BTreeSet};

use gateway_api::apis::standard::gateways::Gateway;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kinference_api::{LOADED_HASH_ANNOTATION, POLICY_HASH_KEY};
use kinference_policy::PolicySpec;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};

use crate::error::{Error, Verb};
use crate::resources::Names;
use crate::status::{EppReport, RefReport};

use kinference_policy::spec::DEFAULT_SECRET_KEY;

/// Which provider Secrets (with their key) and Gateway parentRefs are
/// missing. Works from the raw spec, so it is reported even while the
/// policy is invalid.
pub async fn refs(client: &Client, ns: &str, spec: &PolicySpec) -> Result<RefReport, Error> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let mut wanted: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for p in &spec.providers {
        if let Some(r) = p.secret_ref.as_ref().filter(|r| !r.name.is_empty()) {
            wanted
                .entry(&r.name)
                .or_default()
                .insert(r.key.as_deref().unwrap_or(DEFAULT_SECRET_KEY));
        }
    }
    let mut missing_secrets = Vec::new();
    for (name, keys) in wanted {
        let secret = secrets
            .get_opt(name)
            .await
            .map_err(|e| Error::kube(Verb::Get, "Secret", format!("{ns}/{name}"), e))?;
        match secret {
            None => missing_secrets.push(name.to_string()),
            Some(secret) => {
                let has = |key: &str| {
                    secret.data.as_ref().is_some_and(|d| d.contains_key(key))
                        || secret
                            .string_data
                            .as_ref()
                            .is_some_and(|d| d.contains_key(key))
                };
                for key in keys.into_iter().filter(|k| !has(k)) {
                    missing_secrets.push(format!("{name} (key {key})"));
                }
            }
        }
    }

    let mut missing_gateways = Vec::new();
    let parents = spec
        .route
        .as_ref()
        .map(|r| r.parent_refs.as_slice())
        .unwrap_or_default();
    let mut seen = BTreeSet::new();
    for parent in parents {
        let gw_ns = parent.namespace.as_deref().unwrap_or(ns);
        if !seen.insert((gw_ns, parent.name.as_str())) {
            continue;
        }
        // Metadata only: existence is all ResolvedRefs needs. A cluster
        // without the Gateway CRD answers 404 like a missing Gateway.
        let gateways: Api<Gateway> = Api::namespaced(client.clone(), gw_ns);
        let found = gateways.get_metadata_opt(&parent.name).await.map_err(|e| {
            Error::kube(Verb::Get, "Gateway", format!("{gw_ns}/{}", parent.name), e)
        })?;
        if found.is_none() {
            missing_gateways.push(format!("{gw_ns}/{}", parent.name));
        }
    }
    Ok(RefReport {
        namespace: ns.to_string(),
        missing_secrets,
        missing_gateways,
    })
}

/// Availability of the EPP Deployment and the policy hashes its live Pods
/// report having loaded.
pub async fn epp(client: &Client, ns: &str, names: &Names) -> Result<EppReport, Error> {
    let name = names.epp();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let deployment = deployments
        .get_opt(&name)
        .await
        .map_err(|e| Error::kube(Verb::Get, "Deployment", format!("{ns}/{name}"), e))?;
    let mut report = EppReport {
        deployment: name.clone(),
        ..EppReport::default()
    };
    let Some(deployment) = deployment else {
        return Ok(report);
    };
    report.available_replicas = deployment
        .status
        .as_ref()
        .and_then(|s| s.available_replicas)
        .unwrap_or(0);
    // The Deployment's own selector, as stored: it decides which Pods are
    // the EPP's.
    let selector = deployment
        .spec
        .as_ref()
        .and_then(|s| s.selector.match_labels.as_ref())
        .filter(|m| !m.is_empty());
    let Some(selector) = selector else {
        return Ok(report);
    };
    let label_selector = selector
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let list = pods
        .list_metadata(&ListParams::default().labels(&label_selector))
        .await
        .map_err(|e| Error::kube(Verb::List, "Pod", format!("{ns} ({label_selector})"), e))?;
    report.loaded_hashes = list
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| p.annotations().get(LOADED_HASH_ANNOTATION).cloned())
        .collect();
    Ok(report)
}

/// The hash in the policy ConfigMap: the last accepted policy.
pub async fn configured_hash(
    client: &Client,
    ns: &str,
    names: &Names,
) -> Result<Option<String>, Error> {
    let name = names.config_map();
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let cm = cms
        .get_opt(&name)
        .await
        .map_err(|e| Error::kube(Verb::Get, "ConfigMap", format!("{ns}/{name}"), e))?;
    Ok(cm
        .and_then(|cm| cm.data)
        .and_then(|mut d| d.remove(POLICY_HASH_KEY)))
}
