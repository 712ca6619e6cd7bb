//! The EPP's Kubernetes side: its policy ConfigMap, provider Secrets, Pod
//! discovery for the policy's pool, and reporting the loaded policy hash on
//! its own Pod (the operator's Ready condition reads it).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kinference_api::{LOADED_HASH_ANNOTATION, POLICY_KEY};
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;

use crate::endpoints::run_pod_discovery;
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
/// selector or port changes.
pub async fn run_discovery(epp: Epp, client: Client, namespace: String) {
    let mut changes = epp.policy().subscribe();
    let mut current: Option<(BTreeMap<String, String>, u16)> = None;
    let mut task: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        let wanted = epp.policy().current().and_then(|p| {
            let pool = &p.compiled.pool;
            pool.target_ports
                .first()
                .map(|port| (pool.selector.clone(), *port))
        });
        if wanted != current {
            if let Some(t) = task.take() {
                t.abort();
            }
            if let Some((selector, port)) = wanted.clone() {
                let (client, ns, registry) =
                    (client.clone(), namespace.clone(), epp.registry().clone());
                task = Some(tokio::spawn(async move {
                    if let Err(error) =
                        run_pod_discovery(client, ns, selector, port, registry).await
                    {
                        tracing::error!(%error, "pod discovery stopped");
                    }
                }));
            }
            current = wanted;
        }
        if changes.changed().await.is_err() {
            return;
        }
    }
}

/// Keeps provider API keys in memory, read from the Secrets the policy names.
pub async fn refresh_provider_keys(epp: Epp, client: Client, namespace: String, every: Duration) {
    let api: Api<Secret> = Api::namespaced(client, &namespace);
    loop {
        if let Some(policy) = epp.policy().current() {
            let mut keys = BTreeMap::new();
            for provider in &policy.compiled.providers {
                let Some(secret_ref) = &provider.secret else {
                    continue;
                };
                let key = secret_ref.key.as_deref().unwrap_or("apiKey");
                match api.get_opt(&secret_ref.name).await {
                    Ok(Some(secret)) => {
                        if let Some(v) = secret.data.as_ref().and_then(|d| d.get(key)) {
                            keys.insert(
                                provider.name.clone(),
                                String::from_utf8_lossy(&v.0).trim().to_string(),
                            );
                        }
                    }
                    Ok(None) => {
                        tracing::warn!(provider = %provider.name, secret = %secret_ref.name, "provider Secret not found")
                    }
                    Err(error) => {
                        tracing::warn!(provider = %provider.name, %error, "cannot read provider Secret")
                    }
                }
            }
            epp.picker.provider_keys.store(Arc::new(keys));
        }
        tokio::time::sleep(every).await;
    }
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
