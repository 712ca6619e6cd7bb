//! Reads the state the status reports on: parent Gateways, the EPP
//! Deployment, what its Pods report in the EPP status ConfigMap (all from the
//! watches' caches), and the policy ConfigMap's hash. The operator reads no Secret: whether the
//! provider keys exist is what the EPP Pods, which have them mounted, report.

use std::collections::{BTreeMap, BTreeSet};

use gateway_api::apis::standard::gateways::Gateway;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kinference_api::{EppPodStatus, POLICY_HASH_KEY};
use kinference_policy::PolicySpec;
use kinference_policy::spec::DEFAULT_SECRET_KEY;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};

use crate::cache::Caches;
use crate::error::{Error, Verb, api_code};
use crate::resources::{FIELD_MANAGER, Names};
use crate::status::{EppReport, RefReport};

/// Which provider Secret keys and Gateway parentRefs are missing, and which
/// keys no EPP Pod has reported on yet (`secret_keys` is
/// [`EppReport::secret_keys`]). Works from the raw spec, so it is reported
/// even while the policy is invalid.
pub async fn refs(
    client: &Client,
    caches: &Caches,
    ns: &str,
    spec: &PolicySpec,
    secret_keys: &BTreeMap<(String, String), bool>,
) -> Result<RefReport, Error> {
    let wanted: BTreeSet<(String, String)> = spec
        .providers
        .iter()
        .filter_map(|p| p.secret_ref.as_ref().filter(|r| !r.name.is_empty()))
        .map(|r| {
            let key = r.key.as_deref().unwrap_or(DEFAULT_SECRET_KEY);
            (r.name.clone(), key.to_string())
        })
        .collect();
    let mut missing_secrets = Vec::new();
    let mut unchecked_secrets = Vec::new();
    for (secret, key) in wanted {
        let shown = format!("{secret} (key {key})");
        match secret_keys.get(&(secret, key)) {
            Some(true) => {}
            Some(false) => missing_secrets.push(shown),
            None => unchecked_secrets.push(shown),
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
        if caches.covers(gw_ns) {
            if !caches.gateway_exists(gw_ns, &parent.name) {
                missing_gateways.push(format!("{gw_ns}/{}", parent.name));
            }
            continue;
        }
        // Outside the watched namespace (a namespace-scoped operator): ask.
        // Metadata only: existence is all ResolvedRefs needs. A cluster
        // without the Gateway CRD answers 404 like a missing Gateway.
        let gateways: Api<Gateway> = Api::namespaced(client.clone(), gw_ns);
        match gateways.get_metadata_opt(&parent.name).await {
            Ok(Some(_)) => {}
            Ok(None) => missing_gateways.push(format!("{gw_ns}/{}", parent.name)),
            // A namespace-scoped operator may not read Gateways elsewhere:
            // say so instead of failing every reconcile.
            Err(e) if api_code(&e) == Some(403) => missing_gateways.push(format!(
                "{gw_ns}/{} (the operator may not read Gateways in {gw_ns})",
                parent.name
            )),
            Err(e) => {
                return Err(Error::kube(
                    Verb::Get,
                    "Gateway",
                    format!("{gw_ns}/{}", parent.name),
                    e,
                ));
            }
        }
    }
    Ok(RefReport {
        namespace: ns.to_string(),
        missing_secrets,
        unchecked_secrets,
        missing_gateways,
        missing_pool: None,
    })
}

/// Availability of the EPP Deployment and what its live Pods report (the
/// policy hash each has loaded, the provider keys each found), as the
/// watches show them. Keys of Pods that no longer exist are deleted from the
/// status ConfigMap.
pub async fn epp(
    client: &Client,
    caches: &Caches,
    ns: &str,
    names: &Names,
) -> Result<EppReport, Error> {
    let name = names.epp();
    let mut report = EppReport {
        deployment: name.clone(),
        ..EppReport::default()
    };
    let Some(deployment) = caches.deployment(ns, &name) else {
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

    let status_name = names.epp_status();
    let reported: BTreeMap<String, String> = caches
        .epp_report(ns, &status_name)
        .and_then(|cm| cm.data.clone())
        .unwrap_or_default();
    let pods = caches.pods_matching(ns, selector);
    let existing: BTreeSet<String> = pods.iter().filter_map(|p| p.name.clone()).collect();
    // A terminating Pod may still write its key: ignored, but not pruned.
    let live: BTreeSet<String> = pods
        .iter()
        .filter(|p| p.deletion_timestamp.is_none())
        .filter_map(|p| p.name.clone())
        .collect();

    let mut unseen = Vec::new();
    for (pod, text) in &reported {
        if !existing.contains(pod) {
            unseen.push(pod.clone());
            continue;
        }
        if !live.contains(pod) {
            continue;
        }
        let status = match EppPodStatus::from_json(text) {
            Ok(status) => status,
            Err(error) => {
                tracing::debug!(%ns, %pod, %error, "unreadable EPP Pod report; ignored");
                continue;
            }
        };
        report.loaded_hashes.insert(status.loaded_hash);
        for k in status.secret_keys.into_iter().flatten() {
            // Found by any live Pod: the Secret has the key. Pods of one
            // template mount the same Secrets; they differ only while a
            // rollout replaces Pods that lack a newly named Secret.
            *report.secret_keys.entry((k.secret, k.key)).or_insert(false) |= k.found;
        }
    }
    if !unseen.is_empty() {
        let gone = gone_pods(client, ns, unseen).await?;
        if !gone.is_empty() {
            let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
            prune_reports(&configmaps, ns, &status_name, &gone).await?;
        }
    }
    Ok(report)
}

/// Of Pods that wrote a report but are not in the Pod cache, those that do
/// not exist. The cache may simply not have seen a new Pod yet (its report
/// can arrive first), so absence is confirmed with the API server; this
/// happens only when a Pod went away.
async fn gone_pods(client: &Client, ns: &str, unseen: Vec<String>) -> Result<Vec<String>, Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut gone = Vec::new();
    for pod in unseen {
        let found = pods
            .get_metadata_opt(&pod)
            .await
            .map_err(|e| Error::kube(Verb::Get, "Pod", format!("{ns}/{pod}"), e))?;
        if found.is_none() {
            gone.push(pod);
        }
    }
    Ok(gone)
}

/// Deletes the keys of Pods that are gone, with a merge patch: only those
/// keys, whoever owns the others.
async fn prune_reports(
    configmaps: &Api<ConfigMap>,
    ns: &str,
    name: &str,
    pods: &[String],
) -> Result<(), Error> {
    let data: serde_json::Map<String, serde_json::Value> = pods
        .iter()
        .map(|p| (p.clone(), serde_json::Value::Null))
        .collect();
    let patch = serde_json::json!({ "data": data });
    match configmaps
        .patch(
            name,
            &PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..PatchParams::default()
            },
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => {
            tracing::info!(%ns, configmap = %name, ?pods, "removed the reports of EPP Pods that are gone");
            Ok(())
        }
        // Deleted meanwhile: nothing left to prune.
        Err(e) if api_code(&e) == Some(404) => Ok(()),
        Err(e) => Err(Error::kube(
            Verb::Patch,
            "ConfigMap",
            format!("{ns}/{name}"),
            e,
        )),
    }
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
