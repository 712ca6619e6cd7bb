//! The EPP's Kubernetes side: its policy ConfigMap, provider Secrets, Pod
//! discovery for the policy's pool or an existing InferencePool, and reporting what it has loaded in its
//! policy's EPP status ConfigMap (the operator's Ready and ResolvedRefs
//! conditions read it).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use backon::{BackoffBuilder as _, ExponentialBuilder};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kinference_api::{EppPodStatus, InferencePool, POLICY_KEY, SecretKeyStatus, epp_field_manager};
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use tokio_util::task::AbortOnDropHandle;

use crate::endpoints::run_pod_discovery;
use crate::provider_keys::{
    SecretCache, SharedSecretCache, current_key_refs, load_from_dir, secret_names,
};
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

/// A pool's model-server Pods: their label selector and target ports (in
/// order: the order names the data-parallel ranks).
pub(crate) type PoolTarget = (BTreeMap<String, String>, Vec<u16>);

/// Runs Pod discovery for the loaded policy's pool, restarting it when the
/// selector or the list of target ports (any of them, or their order) changes.
/// Returns when discovery itself stops, so the supervisor marks the EPP not
/// ready and starts it again: a frozen endpoint list must not look healthy.
pub async fn run_discovery(epp: Epp, client: Client, namespace: String) {
    let policy = epp.policy().clone();
    let targets = tokio_stream::wrappers::WatchStream::new(policy.subscribe()).map(move |_| {
        policy.current().and_then(|p| {
            let pool = p.compiled.pool.as_ref()?;
            (!pool.target_ports.is_empty())
                .then(|| (pool.selector.clone(), pool.target_ports.clone()))
        })
    });
    follow_pool(epp, client, namespace, targets).await;
}

/// Runs Pod discovery for an existing InferencePool (`--pool-name`): its
/// selector and target ports are read from the pool, and followed when they
/// change. A pool that does not exist, or is deleted, has no endpoints.
pub async fn run_inference_pool_discovery(
    epp: Epp,
    client: Client,
    namespace: String,
    name: String,
) {
    let api: Api<InferencePool> = Api::namespaced(client.clone(), &namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let (pool_ns, pool_name) = (namespace.clone(), name.clone());
    let targets = watcher(api, config)
        .default_backoff()
        .filter_map(move |event| {
            let target = match event {
                Ok(watcher::Event::Apply(pool) | watcher::Event::InitApply(pool)) => {
                    Some(Some((pool.spec.selector.match_labels.clone(), pool.spec.ports())))
                }
                Ok(watcher::Event::Delete(_)) => {
                    tracing::warn!(namespace = %pool_ns, pool = %pool_name, "the InferencePool was deleted: no endpoints");
                    Some(None)
                }
                Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
                Err(error) => {
                    tracing::warn!(namespace = %pool_ns, pool = %pool_name, %error, "InferencePool watch error");
                    None
                }
            };
            std::future::ready(target)
        });
    follow_pool(epp, client, namespace, targets).await;
}

/// Keeps one Pod discovery running for the latest target of `targets`,
/// replacing it when the target changes; with no target, the registry is
/// emptied. Returns when `targets` or the discovery ends.
async fn follow_pool(
    epp: Epp,
    client: Client,
    namespace: String,
    targets: impl futures::Stream<Item = Option<PoolTarget>>,
) {
    let mut targets = std::pin::pin!(targets);
    let mut current: Option<PoolTarget> = None;
    // The discovery task, aborted when replaced or when this returns.
    let mut task: Option<AbortOnDropHandle<()>> = None;
    loop {
        let ended = async {
            match task.as_mut() {
                Some(t) => {
                    let _ = t.await;
                }
                None => std::future::pending().await,
            }
        };
        let wanted = tokio::select! {
            next = targets.next() => match next {
                Some(wanted) => wanted,
                None => return,
            },
            () = ended => return,
        };
        if wanted == current {
            continue;
        }
        if wanted.is_none() {
            epp.registry().replace_all(Vec::new());
        }
        task = wanted.clone().map(|(selector, ports)| {
            let (client, ns, registry) =
                (client.clone(), namespace.clone(), epp.registry().clone());
            AbortOnDropHandle::new(tokio::spawn(async move {
                if let Err(error) = run_pod_discovery(client, ns, selector, ports, registry).await {
                    tracing::error!(%error, "pod discovery stopped");
                }
            }))
        });
        current = wanted;
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
pub(crate) const SECRET_REFRESH: Duration = Duration::from_secs(2);

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

/// Where this EPP Pod reports: its key `pod` in the ConfigMap `configmap`.
#[derive(Debug, Clone)]
pub struct StatusReport {
    pub configmap: String,
    pub pod: String,
    /// `--provider-secrets-dir`: when set, the report says which provider
    /// keys were found there. Through the API the EPP cannot tell a Secret
    /// it may not read from one that is missing, so it reports none.
    pub secrets_dir: Option<PathBuf>,
}

/// How often the report is checked again without a policy change: mounted
/// Secrets change without notice, and a key someone deleted comes back.
pub(crate) const STATUS_RECHECK: Duration = Duration::from_secs(5);
/// Rewrites an unchanged report this often, in case the ConfigMap was
/// recreated (a merge patch of unchanged data writes nothing).
pub(crate) const STATUS_REASSERT: Duration = Duration::from_secs(60);

/// Keeps this Pod's entry in the EPP status ConfigMap current: the policy
/// hash it has loaded and, with a secrets dir, which provider keys it has.
/// A merge patch of its own key only, under its own field manager, so Pods
/// never overwrite each other and the operator's apply (which sets no
/// `data`) never removes them. The Role allows `patch` on that one
/// ConfigMap and nothing else. Failed writes are retried with jittered
/// exponential backoff, each retry with the newest report.
pub async fn report_status(epp: Epp, client: Client, namespace: String, target: StatusReport) {
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let params = PatchParams {
        field_manager: Some(epp_field_manager(&target.pod)),
        ..PatchParams::default()
    };
    let mut changes = epp.policy().subscribe();
    let mut written: Option<(EppPodStatus, tokio::time::Instant)> = None;
    let mut backoff = retry_backoff();
    let mut failures = 0u32;
    loop {
        let report = current_status(&epp, target.secrets_dir.clone()).await;
        let due = report.as_ref().is_some_and(|r| {
            written
                .as_ref()
                .is_none_or(|(w, at)| w != r || at.elapsed() >= STATUS_REASSERT)
        });
        let mut wait = STATUS_RECHECK;
        if let (true, Some(report)) = (due, report) {
            let patch = serde_json::json!({ "data": { target.pod.as_str(): report.to_json() } });
            match api
                .patch(&target.configmap, &params, &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    if failures > 0 {
                        tracing::info!(configmap = %target.configmap, failures, "reported the loaded policy again");
                    }
                    tracing::debug!(configmap = %target.configmap, hash = %report.loaded_hash, "reported status");
                    written = Some((report, tokio::time::Instant::now()));
                    backoff = retry_backoff();
                    failures = 0;
                }
                Err(error) => {
                    failures += 1;
                    wait = backoff.next().unwrap_or(STATUS_RECHECK);
                    tracing::warn!(%error, configmap = %target.configmap, pod = %target.pod, failures, retry_in = ?wait, "cannot report the loaded policy hash; retrying");
                }
            }
        }
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// 0.5 s doubling to 30 s, each delay jittered so that the EPP Pods of a
/// Deployment do not retry in step after an API server outage.
fn retry_backoff() -> impl Iterator<Item = Duration> {
    ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(Duration::from_secs(30))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

/// This Pod's report now; None before a policy is loaded.
async fn current_status(epp: &Epp, secrets_dir: Option<PathBuf>) -> Option<EppPodStatus> {
    let loaded_hash = epp.policy().loaded_hash()?;
    let secret_keys = match secrets_dir {
        None => None,
        Some(dir) => {
            let refs = current_key_refs(epp);
            // Files: off the async threads, as the key loader reads them.
            let checked = tokio::task::spawn_blocking(move || {
                let missing: BTreeSet<(String, String)> = load_from_dir(&dir, &refs)
                    .missing
                    .into_iter()
                    .map(|m| (m.key_ref.secret, m.key_ref.key))
                    .collect();
                refs.into_iter()
                    .map(|r| SecretKeyStatus {
                        found: !missing.contains(&(r.secret.clone(), r.key.clone())),
                        secret: r.secret,
                        key: r.key,
                    })
                    .collect::<BTreeSet<_>>()
            })
            .await;
            match checked {
                Ok(keys) => Some(keys.into_iter().collect()),
                Err(error) => {
                    tracing::warn!(%error, "checking the provider keys failed");
                    return None;
                }
            }
        }
    };
    Some(EppPodStatus {
        loaded_hash,
        secret_keys,
    })
}
