//! The EPP's Kubernetes side: its policy ConfigMap, provider Secrets, Pod
//! discovery for the policy's pool, and reporting the loaded policy hash on
//! its own Pod (the operator's Ready condition reads it).

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kinference_api::{LOADED_HASH_ANNOTATION, POLICY_KEY};
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use tokio_util::task::AbortOnDropHandle;

use crate::endpoints::run_pod_discovery;
use crate::provider_keys::{SecretCache, SharedSecretCache, current_key_refs, secret_names};
use crate::server::Epp;

/// Watches the policy ConfigMap and loads each version; a bad one is refused
/// and the last good policy keeps serving.
pub async fn watch_policy_configmap(epp: Epp, client: Client, namespace: String, name: String) {
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = watcher::watcher(api, config)
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(item) = stream.next().await {
        match item {
            Ok(cm) => {
                let Some(json) = cm.data.as_ref().and_then(|d| d.get(POLICY_KEY)) else {
                    tracing::warn!(configmap = %name, "the policy ConfigMap has no {POLICY_KEY}");
                    continue;
                };
                match epp.policy().load_json(json) {
                    Ok(hash) => tracing::info!(configmap = %name, %hash, "policy loaded"),
                    Err(error) => tracing::warn!(configmap = %name, %error, "policy refused"),
                }
            }
            // The watcher retries with backoff; an API server restart is not fatal.
            Err(error) => tracing::warn!(configmap = %name, %error, "policy watch error"),
        }
    }
}

/// Runs Pod discovery for the loaded policy's pool, restarting it when the
/// selector or the list of target ports (any of them, or their order, which
/// fixes the rank names) changes. Returns when discovery itself stops, so
/// the supervisor marks the EPP not ready and starts it again: a frozen
/// endpoint list must not look healthy.
pub async fn run_discovery(epp: Epp, client: Client, namespace: String) {
    let mut changes = epp.policy().subscribe();
    let mut current: Option<(BTreeMap<String, String>, Vec<u16>)> = None;
    // The discovery task, aborted when replaced or when this returns.
    let mut task: Option<AbortOnDropHandle<()>> = None;
    loop {
        let wanted = epp.policy().current().and_then(|p| {
            let pool = &p.compiled.pool;
            (!pool.target_ports.is_empty())
                .then(|| (pool.selector.clone(), pool.target_ports.clone()))
        });
        if wanted != current {
            task = wanted.clone().map(|(selector, ports)| {
                let (client, ns, registry) =
                    (client.clone(), namespace.clone(), epp.registry().clone());
                AbortOnDropHandle::new(tokio::spawn(async move {
                    if let Err(error) =
                        run_pod_discovery(client, ns, selector, ports, registry).await
                    {
                        tracing::error!(%error, "pod discovery stopped");
                    }
                }))
            });
            current = wanted;
        }
        let ended = async {
            match task.as_mut() {
                Some(t) => {
                    let _ = t.await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = changes.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            () = ended => return,
        }
    }
}

/// Keeps provider API keys in memory, read from the Secrets the policy names:
/// one reader per referenced Secret, started at once and restarted when the
/// policy's set of Secret names changes. Each reads its Secret by name every
/// [`SECRET_REFRESH`]: the EPP's Role grants `get` on exactly those names and
/// nothing more (a watch would need `list`/`watch`, which the operator would
/// then have to hold on every Secret of the cluster to grant them). A Secret
/// created, rotated or deleted later is seen within that interval.
pub async fn watch_provider_secrets(epp: Epp, client: Client, namespace: String) {
    let api: Api<Secret> = Api::namespaced(client, &namespace);
    let cache = SharedSecretCache::default();
    let mut changes = epp.policy().subscribe();
    // Aborted when dropped: this task's end stops the readers it started.
    let mut readers: BTreeMap<String, AbortOnDropHandle<()>> = BTreeMap::new();
    loop {
        let wanted = secret_names(&current_key_refs(&epp));
        readers.retain(|name, _| wanted.contains(name));
        {
            let mut c = SecretCache::lock(&cache);
            c.secrets.retain(|name, _| wanted.contains(name));
        }
        for name in wanted {
            readers.entry(name).or_insert_with_key(|name| {
                AbortOnDropHandle::new(tokio::spawn(read_secret(
                    epp.clone(),
                    api.clone(),
                    name.clone(),
                    cache.clone(),
                )))
            });
        }
        SecretCache::lock(&cache).publish(&epp);
        if changes.changed().await.is_err() {
            return;
        }
    }
}

/// How often a provider Secret is read again.
pub const SECRET_REFRESH: Duration = Duration::from_secs(2);

/// Reads one Secret by name now and every [`SECRET_REFRESH`], mirroring its
/// data into `cache`. An error keeps the last data read (an API server
/// restart does not drop the keys) and is logged once until it changes.
async fn read_secret(epp: Epp, api: Api<Secret>, name: String, cache: SharedSecretCache) {
    let mut last_error: Option<String> = None;
    loop {
        match api.get_opt(&name).await {
            Ok(secret) => {
                if last_error.take().is_some() {
                    tracing::info!(secret = %name, "provider Secret readable again");
                }
                let mut c = SecretCache::lock(&cache);
                c.secrets
                    .insert(name.clone(), secret.map(|s| s.data.unwrap_or_default()));
                c.publish(&epp);
            }
            Err(error) => {
                let text = error.to_string();
                if last_error.as_deref() != Some(text.as_str()) {
                    if is_forbidden(&error) {
                        tracing::warn!(secret = %name, %error, "reading a provider Secret is forbidden: the EPP's Role needs get on it");
                    } else {
                        tracing::warn!(secret = %name, %error, "cannot read a provider Secret; keeping the last key read");
                    }
                    last_error = Some(text);
                }
            }
        }
        tokio::time::sleep(SECRET_REFRESH).await;
    }
}

fn is_forbidden(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(s) if s.is_forbidden())
}

/// Writes the loaded policy hash onto this EPP's Pod whenever it changes.
pub async fn report_loaded_hash(epp: Epp, client: Client, namespace: String, pod: String) {
    let api: Api<Pod> = Api::namespaced(client, &namespace);
    let mut changes = epp.policy().subscribe();
    loop {
        let hash = changes.borrow_and_update().clone();
        if let Some(hash) = hash {
            let patch = serde_json::json!({ "metadata": { "annotations": { LOADED_HASH_ANNOTATION: hash } } });
            let mut attempt = 0u32;
            while let Err(error) = api
                .patch(&pod, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                attempt += 1;
                tracing::warn!(%error, pod = %pod, attempt, "cannot report the loaded policy hash; retrying");
                tokio::time::sleep(Duration::from_millis(500 * u64::from(attempt.min(10)))).await;
            }
        }
        if changes.changed().await.is_err() {
            return;
        }
    }
}
