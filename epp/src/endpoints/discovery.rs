//! Learns local endpoints by watching the Pods that match the pool selector.
//!
//! A Pod is an endpoint while it is Ready (condition `Ready=True`, phase
//! `Running`, an IP assigned, not terminating). Every watch event is applied
//! to the registry at once, so a Pod that stops being Ready is gone from the
//! very next snapshot. After each full (re)listing the registry is replaced
//! wholesale, which also removes Pods deleted while the watch was down.
//!
//! The models a Pod serves come from its `kinference.io/models` label, or,
//! without one, from its OpenAI `GET /v1/models`. That call runs in a
//! background task per Pod (never in the watch loop), retried with backoff
//! until it answers and then refreshed now and then, because dynamically
//! loaded LoRA adapters show up there. Until it answers, the endpoint is in
//! the registry with an empty model list (scraped, but serving nothing).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::registry::{Endpoint, EndpointRegistry};

/// Pod label listing the models a Pod serves, comma-separated.
pub const MODELS_LABEL: &str = "kinference.io/models";
/// Pod label naming the backend (serving stack) a Pod belongs to.
pub const BACKEND_LABEL: &str = "kinference.io/backend";
/// Well-known zone label.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// Label the Deployment controller puts on Pods (and in ReplicaSet names).
const POD_TEMPLATE_HASH_LABEL: &str = "pod-template-hash";

/// Timeout of one `GET /v1/models`.
pub const MODELS_FETCH_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a Pod's `/v1/models` is re-read once it has answered.
const MODELS_REFRESH: Duration = Duration::from_secs(30);
const MODELS_RETRY_MIN: Duration = Duration::from_millis(500);
const MODELS_RETRY_MAX: Duration = Duration::from_secs(30);

/// Turns a Pod into an endpoint, or `None` when it must not receive traffic
/// (not Ready, not Running, no IP, terminating). Pure.
///
/// `models` is empty when the Pod has no (non-empty) `kinference.io/models`
/// label; the caller then asks the Pod's `/v1/models`.
pub fn pod_to_endpoint(pod: &Pod, target_port: u16) -> Option<Endpoint> {
    let meta = &pod.metadata;
    if meta.deletion_timestamp.is_some() {
        return None;
    }
    let name = meta.name.clone()?;
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") {
        return None;
    }
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    let ip: IpAddr = status.pod_ip.as_deref()?.trim().parse().ok()?;
    let labels = meta.labels.clone().unwrap_or_default();
    let models = labels
        .get(MODELS_LABEL)
        .map(|v| parse_model_list(v))
        .unwrap_or_default();
    let backend = labels
        .get(BACKEND_LABEL)
        .map(|b| b.trim().to_string())
        .filter(|b| !b.is_empty())
        .or_else(|| owner_workload(pod, &labels));
    let zone = labels.get(ZONE_LABEL).cloned().filter(|z| !z.is_empty());
    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    Some(Endpoint {
        name,
        namespace: meta.namespace.clone().unwrap_or_default(),
        ip,
        port: target_port,
        models,
        backend,
        zone,
        node,
        labels,
    })
}

/// Splits a comma-separated model list, trimming and dropping empties.
fn parse_model_list(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .map(str::to_string)
        .collect()
}

/// The workload that owns the Pod: a ReplicaSet's Deployment (its name minus
/// the pod-template-hash suffix), a StatefulSet, or whatever controller owns
/// it (LeaderWorkerSet, Job, ...), by name.
fn owner_workload(pod: &Pod, labels: &BTreeMap<String, String>) -> Option<String> {
    let owners = pod.metadata.owner_references.as_deref()?;
    let owner = owners
        .iter()
        .find(|o| o.controller == Some(true))
        .or_else(|| owners.first())?;
    if owner.kind != "ReplicaSet" {
        return Some(owner.name.clone());
    }
    // Deployment `web` owns ReplicaSet `web-5d4f8c7b9` owns the Pod.
    if let Some(hash) = labels.get(POD_TEMPLATE_HASH_LABEL)
        && let Some(base) = owner.name.strip_suffix(hash.as_str())
        && let Some(base) = base.strip_suffix('-')
        && !base.is_empty()
    {
        return Some(base.to_string());
    }
    match owner.name.rsplit_once('-') {
        Some((base, hash))
            if !base.is_empty()
                && !hash.is_empty()
                && hash.bytes().all(|b| b.is_ascii_alphanumeric()) =>
        {
            Some(base.to_string())
        }
        _ => Some(owner.name.clone()),
    }
}

/// Label selector string (`k=v,k2=v2`) for a selector map.
fn selector_string(selector: &BTreeMap<String, String>) -> String {
    selector
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Watches Pods in `namespace` matching `selector` and keeps `registry` in
/// step; marks it synced after the first full listing. Runs until the task
/// is dropped: API-server outages are retried by the watcher's backoff.
pub async fn run_pod_discovery(
    client: Client,
    namespace: String,
    selector: BTreeMap<String, String>,
    target_port: u16,
    registry: Arc<EndpointRegistry>,
) -> anyhow::Result<()> {
    let selector_str = selector_string(&selector);
    if selector.is_empty() {
        warn!(%namespace, "empty pool selector: every Pod in the namespace is a candidate");
    }
    let api: Api<Pod> = Api::namespaced(client, &namespace);
    let mut config = watcher::Config::default();
    if !selector_str.is_empty() {
        config = config.labels(&selector_str);
    }
    let stream = watcher(api, config).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let (mut state, mut rx) = DiscoveryState::new(target_port, registry);
    info!(%namespace, selector = %selector_str, target_port, "starting pod discovery");
    loop {
        tokio::select! {
            event = stream.next() => match event {
                None => return Ok(()),
                Some(Ok(event)) => state.on_event(event),
                Some(Err(error)) => {
                    warn!(%namespace, %error, "pod watch failed; retrying with backoff");
                }
            },
            Some(found) = rx.recv() => state.on_models(found),
        }
    }
}

/// A `/v1/models` answer for one Pod at one address.
struct ModelsFound {
    name: String,
    ip: IpAddr,
    port: u16,
    models: Vec<String>,
}

struct Tracked {
    /// The endpoint as last handed to the registry (models filled in).
    endpoint: Endpoint,
    /// Running `/v1/models` poller, for Pods without the models label.
    poller: Option<AbortOnDrop>,
}

struct DiscoveryState {
    target_port: u16,
    registry: Arc<EndpointRegistry>,
    http: reqwest::Client,
    tx: mpsc::UnboundedSender<ModelsFound>,
    tracked: HashMap<String, Tracked>,
    /// Endpoints collected during a (re)listing, applied at `InitDone`.
    init: Option<Vec<Endpoint>>,
}

impl DiscoveryState {
    fn new(
        target_port: u16,
        registry: Arc<EndpointRegistry>,
    ) -> (Self, mpsc::UnboundedReceiver<ModelsFound>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let state = Self {
            target_port,
            registry,
            http: models_client(),
            tx,
            tracked: HashMap::new(),
            init: None,
        };
        (state, rx)
    }

    fn on_event(&mut self, event: watcher::Event<Pod>) {
        match event {
            watcher::Event::Init => {
                debug!("pod listing started");
                self.init = Some(Vec::new());
            }
            watcher::Event::InitApply(pod) => {
                if let Some(ep) = pod_to_endpoint(&pod, self.target_port) {
                    self.init.get_or_insert_with(Vec::new).push(ep);
                }
            }
            watcher::Event::InitDone => {
                let listed = self.init.take().unwrap_or_default();
                let mut next = HashMap::with_capacity(listed.len());
                for ep in listed {
                    let name = ep.name.clone();
                    let prev = self.tracked.remove(&name);
                    next.insert(name, self.prepare(ep, prev));
                }
                // Whatever is left was deleted (or stopped being Ready) while
                // we were not watching; dropping it stops its poller.
                for name in self.tracked.keys() {
                    info!(pod = %name, "pod gone after relist; removing endpoint");
                }
                self.tracked = next;
                let eps: Vec<Endpoint> =
                    self.tracked.values().map(|t| t.endpoint.clone()).collect();
                let n = eps.len();
                self.registry.replace_all(eps);
                self.registry.mark_synced();
                info!(endpoints = n, "pod discovery synced");
            }
            watcher::Event::Apply(pod) => {
                let name = pod.metadata.name.clone().unwrap_or_default();
                match pod_to_endpoint(&pod, self.target_port) {
                    Some(ep) => {
                        let prev = self.tracked.remove(&name);
                        if prev.is_none() {
                            info!(pod = %name, address = %ep.address(), "pod ready; adding endpoint");
                        }
                        let t = self.prepare(ep, prev);
                        self.registry.upsert(t.endpoint.clone());
                        self.tracked.insert(name, t);
                    }
                    None => self.forget(&name, "pod not ready"),
                }
            }
            watcher::Event::Delete(pod) => {
                let name = pod.metadata.name.clone().unwrap_or_default();
                self.forget(&name, "pod deleted");
            }
        }
    }

    fn forget(&mut self, name: &str, why: &str) {
        if self.tracked.remove(name).is_some() {
            info!(pod = %name, reason = why, "removing endpoint");
        }
        self.registry.remove(name);
    }

    /// Fills in models already learned from `/v1/models` and starts or stops
    /// the poller as needed.
    fn prepare(&self, mut ep: Endpoint, prev: Option<Tracked>) -> Tracked {
        if !ep.models.is_empty() {
            // Labelled: the label is authoritative, no poller.
            return Tracked {
                endpoint: ep,
                poller: None,
            };
        }
        if let Some(prev) = prev
            && prev.endpoint.ip == ep.ip
            && prev.endpoint.port == ep.port
            && let Some(poller) = prev.poller
        {
            ep.models = prev.endpoint.models;
            return Tracked {
                endpoint: ep,
                poller: Some(poller),
            };
        }
        let poller = tokio::spawn(poll_models(
            self.http.clone(),
            ep.name.clone(),
            ep.ip,
            ep.port,
            self.tx.clone(),
        ));
        Tracked {
            endpoint: ep,
            poller: Some(AbortOnDrop(poller)),
        }
    }

    fn on_models(&mut self, found: ModelsFound) {
        let Some(t) = self.tracked.get_mut(&found.name) else {
            return;
        };
        // A late answer from a previous incarnation of the Pod is dropped.
        if t.poller.is_none() || t.endpoint.ip != found.ip || t.endpoint.port != found.port {
            return;
        }
        if t.endpoint.models != found.models {
            info!(pod = %found.name, models = ?found.models, "learned models from /v1/models");
            t.endpoint.models = found.models;
            self.registry.upsert(t.endpoint.clone());
        }
    }
}

/// Aborts the task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// HTTP client for `/v1/models`: direct (never through a proxy), short
/// timeouts.
fn models_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(MODELS_FETCH_TIMEOUT)
        .timeout(MODELS_FETCH_TIMEOUT)
        .pool_max_idle_per_host(0)
        .build()
        .unwrap_or_else(|_| reqwest::Client::new())
}

/// Asks the Pod for its models until it answers, then re-reads them every
/// [`MODELS_REFRESH`]; reports only changes.
async fn poll_models(
    client: reqwest::Client,
    name: String,
    ip: IpAddr,
    port: u16,
    tx: mpsc::UnboundedSender<ModelsFound>,
) {
    let address = std::net::SocketAddr::new(ip, port).to_string();
    let mut retry = MODELS_RETRY_MIN;
    let mut last: Option<Vec<String>> = None;
    loop {
        match fetch_models(&client, &address, MODELS_FETCH_TIMEOUT).await {
            Ok(models) => {
                retry = MODELS_RETRY_MIN;
                if last.as_ref() != Some(&models) {
                    last = Some(models.clone());
                    let found = ModelsFound {
                        name: name.clone(),
                        ip,
                        port,
                        models,
                    };
                    if tx.send(found).is_err() {
                        return; // discovery stopped
                    }
                }
                tokio::time::sleep(MODELS_REFRESH).await;
            }
            Err(error) => {
                debug!(pod = %name, %address, %error, retry_in = ?retry, "GET /v1/models failed");
                tokio::time::sleep(retry).await;
                retry = (retry * 2).min(MODELS_RETRY_MAX);
            }
        }
    }
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
}

/// `GET http://<address>/v1/models` (OpenAI list shape `{"data":[{"id":..}]}`)
/// and returns the model ids.
pub async fn fetch_models(
    client: &reqwest::Client,
    address: &str,
    timeout: Duration,
) -> anyhow::Result<Vec<String>> {
    let list: ModelList = client
        .get(format!("http://{address}/v1/models"))
        .timeout(timeout)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let mut models: Vec<String> = list
        .data
        .into_iter()
        .map(|m| m.id.trim().to_string())
        .filter(|m| !m.is_empty())
        .collect();
    models.dedup();
    Ok(models)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};

    fn ready_pod(name: &str, labels: &[(&str, &str)]) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("llm".into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some("node-a".into()),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                pod_ip: Some("10.1.2.3".into()),
                conditions: Some(vec![
                    PodCondition {
                        type_: "PodScheduled".into(),
                        status: "True".into(),
                        ..Default::default()
                    },
                    PodCondition {
                        type_: "Ready".into(),
                        status: "True".into(),
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            }),
        }
    }

    fn owned_by(mut pod: Pod, kind: &str, name: &str, controller: Option<bool>) -> Pod {
        pod.metadata
            .owner_references
            .get_or_insert_with(Vec::new)
            .push(OwnerReference {
                api_version: "apps/v1".into(),
                kind: kind.into(),
                name: name.into(),
                uid: "u".into(),
                controller,
                block_owner_deletion: None,
            });
        pod
    }

    #[test]
    fn ready_pod_becomes_endpoint() {
        let pod = ready_pod(
            "vllm-0",
            &[
                (MODELS_LABEL, " llama-3-8b , sql-lora,, "),
                (BACKEND_LABEL, "vllm-h100"),
                (ZONE_LABEL, "eu-west-1a"),
                ("app", "vllm"),
            ],
        );
        let ep = pod_to_endpoint(&pod, 8000).unwrap();
        assert_eq!(ep.name, "vllm-0");
        assert_eq!(ep.namespace, "llm");
        assert_eq!(ep.address(), "10.1.2.3:8000");
        assert_eq!(ep.models, ["llama-3-8b", "sql-lora"]);
        assert_eq!(ep.backend.as_deref(), Some("vllm-h100"));
        assert_eq!(ep.zone.as_deref(), Some("eu-west-1a"));
        assert_eq!(ep.node.as_deref(), Some("node-a"));
        assert_eq!(ep.labels.get("app").map(String::as_str), Some("vllm"));
    }

    #[test]
    fn not_ready_pods_are_not_endpoints() {
        let base = ready_pod("p", &[]);
        assert!(pod_to_endpoint(&base, 1).is_some());

        let mut p = base.clone();
        p.status.as_mut().unwrap().conditions.as_mut().unwrap()[1].status = "False".into();
        assert!(pod_to_endpoint(&p, 1).is_none(), "Ready=False");

        let mut p = base.clone();
        p.status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()
            .remove(1);
        assert!(pod_to_endpoint(&p, 1).is_none(), "no Ready condition");

        let mut p = base.clone();
        p.status.as_mut().unwrap().conditions = None;
        assert!(pod_to_endpoint(&p, 1).is_none(), "no conditions");

        let mut p = base.clone();
        p.status.as_mut().unwrap().phase = Some("Pending".into());
        assert!(pod_to_endpoint(&p, 1).is_none(), "pending");

        let mut p = base.clone();
        p.status.as_mut().unwrap().phase = Some("Succeeded".into());
        assert!(pod_to_endpoint(&p, 1).is_none(), "finished");

        let mut p = base.clone();
        p.status.as_mut().unwrap().pod_ip = None;
        assert!(pod_to_endpoint(&p, 1).is_none(), "no IP");

        let mut p = base.clone();
        p.status.as_mut().unwrap().pod_ip = Some("not-an-ip".into());
        assert!(pod_to_endpoint(&p, 1).is_none(), "bad IP");

        let mut p = base.clone();
        p.status = None;
        assert!(pod_to_endpoint(&p, 1).is_none(), "no status");

        let mut p = base.clone();
        p.metadata.deletion_timestamp = Some(Time(Default::default()));
        assert!(pod_to_endpoint(&p, 1).is_none(), "terminating");

        let mut p = base;
        p.metadata.name = None;
        assert!(pod_to_endpoint(&p, 1).is_none(), "nameless");
    }

    #[test]
    fn ipv6_and_no_optional_fields() {
        let mut p = ready_pod("p", &[]);
        p.status.as_mut().unwrap().pod_ip = Some("fd00::5".into());
        p.spec = None;
        p.metadata.namespace = None;
        let ep = pod_to_endpoint(&p, 8000).unwrap();
        assert_eq!(ep.address(), "[fd00::5]:8000");
        assert!(
            ep.models.is_empty(),
            "no label: models come from /v1/models"
        );
        assert_eq!((ep.backend, ep.zone, ep.node), (None, None, None));
        assert_eq!(ep.namespace, "");
    }

    #[test]
    fn empty_models_label_means_unknown() {
        let p = ready_pod("p", &[(MODELS_LABEL, " , ")]);
        assert!(pod_to_endpoint(&p, 1).unwrap().models.is_empty());
    }

    #[test]
    fn backend_from_owner_references() {
        let rs = owned_by(
            ready_pod(
                "web-5d4f8c7b9-x2x7q",
                &[(POD_TEMPLATE_HASH_LABEL, "5d4f8c7b9")],
            ),
            "ReplicaSet",
            "web-5d4f8c7b9",
            Some(true),
        );
        assert_eq!(
            pod_to_endpoint(&rs, 1).unwrap().backend.as_deref(),
            Some("web")
        );

        // Without the hash label the last dash-separated segment goes.
        let rs = owned_by(ready_pod("p", &[]), "ReplicaSet", "vllm-llama-7c9f", None);
        assert_eq!(
            pod_to_endpoint(&rs, 1).unwrap().backend.as_deref(),
            Some("vllm-llama")
        );

        let rs = owned_by(ready_pod("p", &[]), "ReplicaSet", "nodash", None);
        assert_eq!(
            pod_to_endpoint(&rs, 1).unwrap().backend.as_deref(),
            Some("nodash")
        );

        let sts = owned_by(ready_pod("sg-0", &[]), "StatefulSet", "sglang", Some(true));
        assert_eq!(
            pod_to_endpoint(&sts, 1).unwrap().backend.as_deref(),
            Some("sglang")
        );

        // The controller reference wins over others.
        let p = owned_by(ready_pod("p", &[]), "ConfigMap", "not-me", None);
        let p = owned_by(p, "StatefulSet", "me", Some(true));
        assert_eq!(
            pod_to_endpoint(&p, 1).unwrap().backend.as_deref(),
            Some("me")
        );

        // The label beats the owner.
        let p = owned_by(
            ready_pod("p", &[(BACKEND_LABEL, "pinned")]),
            "StatefulSet",
            "sts",
            Some(true),
        );
        assert_eq!(
            pod_to_endpoint(&p, 1).unwrap().backend.as_deref(),
            Some("pinned")
        );

        assert_eq!(
            pod_to_endpoint(&ready_pod("p", &[]), 1).unwrap().backend,
            None
        );
    }

    fn names(reg: &EndpointRegistry) -> Vec<String> {
        let mut n: Vec<_> = reg.endpoints().iter().map(|e| e.name.clone()).collect();
        n.sort();
        n
    }

    fn labelled(name: &str) -> Pod {
        ready_pod(name, &[(MODELS_LABEL, "m")])
    }

    #[tokio::test]
    async fn watch_events_drive_the_registry() {
        use watcher::Event;
        let reg = EndpointRegistry::new(Duration::from_secs(5));
        let (mut st, _rx) = DiscoveryState::new(8000, Arc::clone(&reg));

        // Initial listing: nothing visible before InitDone.
        st.on_event(Event::Init);
        st.on_event(Event::InitApply(labelled("a")));
        st.on_event(Event::InitApply(labelled("b")));
        let mut not_ready = labelled("c");
        not_ready.status.as_mut().unwrap().phase = Some("Pending".into());
        st.on_event(Event::InitApply(not_ready.clone()));
        assert!(reg.is_empty() && !reg.synced());
        st.on_event(Event::InitDone);
        assert!(reg.synced());
        assert_eq!(names(&reg), ["a", "b"]);

        // c becomes ready, a stops being ready, b is deleted.
        st.on_event(Event::Apply(labelled("c")));
        let mut a = labelled("a");
        a.status.as_mut().unwrap().conditions.as_mut().unwrap()[1].status = "False".into();
        st.on_event(Event::Apply(a));
        st.on_event(Event::Delete(labelled("b")));
        assert_eq!(names(&reg), ["c"]);
        st.on_event(Event::Apply(not_ready));
        assert!(reg.is_empty());

        // A relist drops what is no longer there and adds what is new.
        st.on_event(Event::Apply(labelled("x")));
        st.on_event(Event::Init);
        st.on_event(Event::InitApply(labelled("y")));
        assert_eq!(names(&reg), ["x"], "old state served during the relist");
        st.on_event(Event::InitDone);
        assert_eq!(names(&reg), ["y"]);
    }

    #[tokio::test]
    async fn models_from_v1_models_are_applied_to_the_right_pod() {
        use watcher::Event;
        let reg = EndpointRegistry::new(Duration::from_secs(5));
        let (mut st, _rx) = DiscoveryState::new(8000, Arc::clone(&reg));
        st.on_event(Event::Init);
        st.on_event(Event::InitApply(ready_pod("u", &[])));
        st.on_event(Event::InitDone);
        assert!(reg.get("u").unwrap().models.is_empty());
        assert!(st.tracked["u"].poller.is_some(), "unlabelled: poller runs");

        let ip: IpAddr = "10.1.2.3".parse().unwrap();
        let stale_ip: IpAddr = "10.9.9.9".parse().unwrap();
        st.on_models(ModelsFound {
            name: "u".into(),
            ip: stale_ip,
            port: 8000,
            models: vec!["old".into()],
        });
        assert!(
            reg.get("u").unwrap().models.is_empty(),
            "answer from another address ignored"
        );
        st.on_models(ModelsFound {
            name: "u".into(),
            ip,
            port: 8000,
            models: vec!["llama".into()],
        });
        assert_eq!(reg.get("u").unwrap().models, ["llama"]);
        st.on_models(ModelsFound {
            name: "gone".into(),
            ip,
            port: 8000,
            models: vec![],
        });

        // A status update keeps the learned models (and the poller).
        st.on_event(Event::Apply(ready_pod("u", &[("extra", "1")])));
        assert_eq!(reg.get("u").unwrap().models, ["llama"]);
        // Labelling the Pod makes the label authoritative and stops polling.
        st.on_event(Event::Apply(ready_pod("u", &[(MODELS_LABEL, "pinned")])));
        assert_eq!(reg.get("u").unwrap().models, ["pinned"]);
        assert!(st.tracked["u"].poller.is_none());
        st.on_models(ModelsFound {
            name: "u".into(),
            ip,
            port: 8000,
            models: vec!["llama".into()],
        });
        assert_eq!(reg.get("u").unwrap().models, ["pinned"]);
    }

    #[test]
    fn selector_string_joins_pairs() {
        let mut s = BTreeMap::new();
        assert_eq!(selector_string(&s), "");
        s.insert("app".to_string(), "vllm".to_string());
        s.insert("tier".to_string(), "gpu".to_string());
        assert_eq!(selector_string(&s), "app=vllm,tier=gpu");
    }
}
