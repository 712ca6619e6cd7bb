//! Learns local endpoints by watching the Pods that match the pool selector.
//!
//! A Pod is an endpoint while it is Ready (condition `Ready=True`, phase
//! `Running`, an IP assigned, not terminating). Every watch event is applied
//! to the registry at once, so a Pod that stops being Ready is gone from the
//! very next snapshot. After each full (re)listing the registry is replaced
//! wholesale, which also removes Pods deleted while the watch was down.
//!
//! # Target ports and data-parallel ranks
//!
//! An InferencePool lists up to eight `targetPorts`; like the reference EPP,
//! every Ready Pod yields one endpoint per target port (a data-parallel
//! "rank": rank `i` is `targetPorts[i]`), all at the Pod's IP. The Pod
//! annotation [`ACTIVE_PORTS_ANNOTATION`] narrows that down per Pod: when
//! present, only the target ports it lists become endpoints (see
//! [`parse_active_ports`] for how malformed values are treated). Registry
//! names are unique per rank (see [`endpoint_name`]); everything else the
//! policy sees about an endpoint (namespace, labels, backend, zone, node)
//! is the Pod's, identical for all its ranks.
//!
//! The models a Pod serves come from its OpenAI `GET /v1/models`, or from
//! its `kinference.io/models` label, which then names its base models and
//! leaves the LoRA adapters to `/v1/models` (they are loaded and unloaded
//! at run time; no label keeps up). That call runs in a background task per
//! endpoint (never in the watch loop; each rank is its own server on its
//! own port), retried with backoff until it answers and then refreshed now
//! and then. Until it answers, an unlabelled endpoint is in the registry
//! with an empty model list (scraped, but serving nothing).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

use super::registry::{Endpoint, EndpointRegistry};
use crate::lists::comma_separated;

/// Pod label listing the models a Pod serves, comma-separated.
pub const MODELS_LABEL: &str = "kinference.io/models";
/// Pod label naming the backend (serving stack) a Pod belongs to.
pub const BACKEND_LABEL: &str = "kinference.io/backend";
/// Well-known zone label.
pub(crate) const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// Label the Deployment controller puts on Pods (and in ReplicaSet names).
const POD_TEMPLATE_HASH_LABEL: &str = "pod-template-hash";
/// Pod annotation of the Inference Extension listing, comma-separated, which
/// of the pool's target ports the Pod really serves (e.g. `"8000,8002"`).
/// Absent: all of them.
pub(crate) const ACTIVE_PORTS_ANNOTATION: &str = "inference.networking.k8s.io/active-ports";

/// Timeout of one `GET /v1/models`.
pub(crate) const MODELS_FETCH_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a Pod's `/v1/models` is re-read once it has answered.
const MODELS_REFRESH: Duration = Duration::from_secs(30);
const MODELS_RETRY_MIN: Duration = Duration::from_millis(500);
const MODELS_RETRY_MAX: Duration = Duration::from_secs(30);

/// The registry name of rank `rank` (the index of its port in the pool's
/// `targetPorts`) of Pod `pod`, in a pool with `ports` target ports:
///
/// * one target port: the Pod name itself, so single-port pools (the common
///   case) keep `endpoint: <pod>` in policies, logs and metrics;
/// * several: `<pod>-rank-<rank>`, the reference EPP's name for a
///   data-parallel rank. The rank is the index among the pool's target ports,
///   not among the Pod's active ones, so a rank keeps its name (and with it
///   its metrics, models and prefix-cache state) when the active-ports
///   annotation changes.
///
/// Names never collide within a pool: rank numbers are digits only, so the
/// last `-rank-` of a name always splits it back into (Pod name, rank).
/// The `endpoint` attribute policies see is this name; labels, backend, zone
/// and node are the Pod's, the same for all its ranks.
pub(crate) fn endpoint_name(pod: &str, rank: usize, ports: usize) -> String {
    if ports <= 1 {
        pod.to_string()
    } else {
        format!("{pod}-rank-{rank}")
    }
}

/// All registry names a Pod can have in a pool with `ports` target ports.
fn endpoint_names(pod: &str, ports: usize) -> impl Iterator<Item = String> + '_ {
    (0..ports.max(1)).map(move |rank| endpoint_name(pod, rank, ports))
}

/// The Pod's [`ACTIVE_PORTS_ANNOTATION`], parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ActivePorts {
    /// The valid port numbers listed (1..=65535).
    pub ports: BTreeSet<u16>,
    /// Entries that are not port numbers (non-numeric, 0, out of range); they
    /// are ignored.
    pub invalid: Vec<String>,
}

/// Parses an [`ACTIVE_PORTS_ANNOTATION`] value: comma-separated port numbers,
/// whitespace around entries allowed, empty entries (`"8000,"`) skipped.
///
/// Malformed entries are ignored rather than failing the whole value, and a
/// value with no valid entry at all (`""`, `"abc"`) means *no* active port:
/// the annotation is an explicit list, so the Pod then gets no traffic rather
/// than traffic on ports it may not serve. Both match the reference EPP; the
/// discovery loop logs a warning once per Pod and annotation value.
pub(crate) fn parse_active_ports(value: &str) -> ActivePorts {
    let mut out = ActivePorts::default();
    for entry in comma_separated(value) {
        match entry.parse::<u16>() {
            Ok(port) if port > 0 => {
                out.ports.insert(port);
            }
            _ => out.invalid.push(entry.to_string()),
        }
    }
    out
}

/// The Pod's active-ports annotation, parsed; `None` when it has none (all
/// target ports are active).
pub(crate) fn active_ports(pod: &Pod) -> Option<ActivePorts> {
    pod.metadata
        .annotations
        .as_ref()?
        .get(ACTIVE_PORTS_ANNOTATION)
        .map(|v| parse_active_ports(v))
}

/// Turns a Pod into its endpoints, one per target port it serves (all of
/// `target_ports`, or those its [`ACTIVE_PORTS_ANNOTATION`] lists), named by
/// [`endpoint_name`] and in `target_ports` order. Empty when the Pod must not
/// receive traffic (not Ready, not Running, no IP, terminating). Pure.
pub fn pod_to_endpoints(pod: &Pod, target_ports: &[u16]) -> Vec<Endpoint> {
    endpoints_for(pod, target_ports, active_ports(pod).as_ref()).unwrap_or_default()
}

/// Single-port form of [`pod_to_endpoints`]: the endpoint named after the
/// Pod, or `None` when it must not receive traffic (including when its
/// active-ports annotation leaves `target_port` out).
#[cfg(test)]
fn pod_to_endpoint(pod: &Pod, target_port: u16) -> Option<Endpoint> {
    pod_to_endpoints(pod, &[target_port]).pop()
}

/// The Pod's endpoints given its parsed annotation; `None` when the Pod is
/// not Ready (as opposed to Ready with no active target port: `Some(empty)`).
fn endpoints_for(
    pod: &Pod,
    target_ports: &[u16],
    active: Option<&ActivePorts>,
) -> Option<Vec<Endpoint>> {
    let base = ready_endpoint(pod)?;
    let n = target_ports.len();
    Some(
        target_ports
            .iter()
            .enumerate()
            .filter(|(_, port)| active.is_none_or(|a| a.ports.contains(port)))
            .map(|(rank, &port)| Endpoint {
                name: endpoint_name(&base.name, rank, n),
                port,
                ..base.clone()
            })
            .collect(),
    )
}

/// The Pod as an endpoint (named after the Pod, port 0), or `None` when it
/// must not receive traffic (not Ready, not Running, no IP, terminating).
///
/// `models` is empty when the Pod has no (non-empty) `kinference.io/models`
/// label; the caller then asks the endpoint's `/v1/models`.
fn ready_endpoint(pod: &Pod) -> Option<Endpoint> {
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
        pod: name.clone(),
        uid: meta.uid.clone(),
        name,
        namespace: meta.namespace.clone().unwrap_or_default(),
        ip,
        port: 0,
        models,
        // Only `/v1/models` says which are adapters (the poller, for Pods
        // without the models label).
        adapters: Vec::new(),
        backend,
        zone,
        node,
        labels,
    })
}

/// A comma-separated model list.
fn parse_model_list(v: &str) -> Vec<String> {
    comma_separated(v).map(str::to_string).collect()
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
/// step, one endpoint per Pod and active target port; marks it synced after
/// the first full listing. Runs until the task is dropped: API-server
/// outages are retried by the watcher's backoff.
pub async fn run_pod_discovery(
    client: Client,
    namespace: String,
    selector: BTreeMap<String, String>,
    target_ports: Vec<u16>,
    registry: Arc<EndpointRegistry>,
) -> anyhow::Result<()> {
    let selector_str = selector_string(&selector);
    if selector.is_empty() {
        warn!(%namespace, "empty pool selector: every Pod in the namespace is a candidate");
    }
    if target_ports.is_empty() {
        warn!(%namespace, "the pool has no target ports: no Pod becomes an endpoint");
    }
    let api: Api<Pod> = Api::namespaced(client, &namespace);
    let mut config = watcher::Config::default();
    if !selector_str.is_empty() {
        config = config.labels(&selector_str);
    }
    let stream = watcher(api, config).default_backoff();
    let mut stream = std::pin::pin!(stream);
    info!(%namespace, selector = %selector_str, ?target_ports, "starting pod discovery");
    let (mut state, mut rx) = DiscoveryState::new(target_ports, registry);
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

/// A `/v1/models` answer for one endpoint at one address.
struct ModelsFound {
    name: String,
    ip: IpAddr,
    port: u16,
    served: ServedModels,
}

struct Tracked {
    /// The endpoint as last handed to the registry (models filled in).
    endpoint: Endpoint,
    /// The models its label names, if it has one.
    labelled: Option<Vec<String>>,
    /// Its running `/v1/models` poller.
    poller: Option<AbortOnDropHandle<()>>,
}

struct DiscoveryState {
    /// The pool's target ports; rank `i` is `target_ports[i]`.
    target_ports: Vec<u16>,
    registry: Arc<EndpointRegistry>,
    http: reqwest::Client,
    tx: mpsc::UnboundedSender<ModelsFound>,
    /// Keyed by endpoint (registry) name, see [`endpoint_name`].
    tracked: HashMap<String, Tracked>,
    /// Endpoints collected during a (re)listing, applied at `InitDone`.
    init: Option<Vec<Endpoint>>,
    /// Pods seen during the current (re)listing.
    init_pods: HashSet<String>,
    /// Pod name → the active-ports annotation value last warned about, so a
    /// malformed value is logged once, not on every status update.
    warned: HashMap<String, String>,
}

impl DiscoveryState {
    fn new(
        target_ports: Vec<u16>,
        registry: Arc<EndpointRegistry>,
    ) -> (Self, mpsc::UnboundedReceiver<ModelsFound>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let state = Self {
            target_ports,
            registry,
            http: models_client(),
            tx,
            tracked: HashMap::new(),
            init: None,
            init_pods: HashSet::new(),
            warned: HashMap::new(),
        };
        (state, rx)
    }

    fn on_event(&mut self, event: watcher::Event<Pod>) {
        match event {
            watcher::Event::Init => {
                debug!("pod listing started");
                self.init = Some(Vec::new());
                self.init_pods.clear();
            }
            watcher::Event::InitApply(pod) => {
                let eps = self.pod_endpoints(&pod).unwrap_or_default();
                if let Some(name) = &pod.metadata.name {
                    self.init_pods.insert(name.clone());
                }
                self.init.get_or_insert_with(Vec::new).extend(eps);
            }
            watcher::Event::InitDone => {
                let listed = self.init.take().unwrap_or_default();
                let mut next = HashMap::with_capacity(listed.len());
                for ep in listed {
                    let name = ep.name.clone();
                    let prev = self.tracked.remove(&name);
                    next.insert(name, self.prepare(ep, prev));
                }
                // Whatever is left was deleted (or stopped being Ready, or
                // lost its port) while we were not watching; dropping it
                // stops its poller.
                for name in self.tracked.keys() {
                    info!(endpoint = %name, "endpoint gone after relist; removing it");
                }
                self.tracked = next;
                let pods = std::mem::take(&mut self.init_pods);
                self.warned.retain(|pod, _| pods.contains(pod));
                let eps: Vec<Endpoint> =
                    self.tracked.values().map(|t| t.endpoint.clone()).collect();
                let n = eps.len();
                self.registry.replace_all(eps);
                self.registry.mark_synced();
                info!(endpoints = n, "pod discovery synced");
            }
            watcher::Event::Apply(pod) => {
                let pod_name = pod.metadata.name.clone().unwrap_or_default();
                let eps = self.pod_endpoints(&pod);
                let why = if eps.is_some() {
                    "target port not active"
                } else {
                    "pod not ready"
                };
                let eps = eps.unwrap_or_default();
                // Ranks the Pod no longer serves (all of them when not Ready).
                let stale: Vec<String> = endpoint_names(&pod_name, self.target_ports.len())
                    .filter(|name| !eps.iter().any(|ep| &ep.name == name))
                    .collect();
                for name in &stale {
                    self.forget(name, why);
                }
                for ep in eps {
                    let name = ep.name.clone();
                    let prev = self.tracked.remove(&name);
                    if prev.is_none() {
                        info!(endpoint = %name, pod = %pod_name, address = %ep.address(), "adding endpoint");
                    }
                    let t = self.prepare(ep, prev);
                    self.registry.upsert(t.endpoint.clone());
                    self.tracked.insert(name, t);
                }
            }
            watcher::Event::Delete(pod) => {
                let pod_name = pod.metadata.name.clone().unwrap_or_default();
                let names: Vec<String> =
                    endpoint_names(&pod_name, self.target_ports.len()).collect();
                for name in &names {
                    self.forget(name, "pod deleted");
                }
                self.warned.remove(&pod_name);
            }
        }
    }

    /// The Pod's endpoints (`None` when not Ready), warning about a malformed
    /// active-ports annotation.
    fn pod_endpoints(&mut self, pod: &Pod) -> Option<Vec<Endpoint>> {
        let active = active_ports(pod);
        if let Some(name) = &pod.metadata.name {
            let value = pod
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ACTIVE_PORTS_ANNOTATION));
            self.check_active_ports(name, value.map(String::as_str), active.as_ref());
        }
        endpoints_for(pod, &self.target_ports, active.as_ref())
    }

    /// Warns, once per Pod and annotation value, about annotation entries
    /// that are not port numbers or not target ports of the pool, and about
    /// an annotation that leaves no port active. True when it warned.
    fn check_active_ports(
        &mut self,
        pod: &str,
        value: Option<&str>,
        active: Option<&ActivePorts>,
    ) -> bool {
        let (Some(value), Some(active)) = (value, active) else {
            self.warned.remove(pod);
            return false;
        };
        let not_target: Vec<u16> = active
            .ports
            .iter()
            .copied()
            .filter(|p| !self.target_ports.contains(p))
            .collect();
        let none_active = !self.target_ports.iter().any(|p| active.ports.contains(p));
        if active.invalid.is_empty() && not_target.is_empty() && !none_active {
            self.warned.remove(pod);
            return false;
        }
        if self.warned.get(pod).map(String::as_str) == Some(value) {
            return false;
        }
        warn!(
            pod = %pod,
            annotation = ACTIVE_PORTS_ANNOTATION,
            %value,
            invalid = ?active.invalid,
            not_target_ports = ?not_target,
            target_ports = ?self.target_ports,
            no_active_port = none_active,
            "active-ports annotation: ignoring entries that are not target ports of the pool \
             (a Pod left with no active target port gets no traffic)"
        );
        self.warned.insert(pod.to_string(), value.to_string());
        true
    }

    fn forget(&mut self, name: &str, why: &str) {
        if self.tracked.remove(name).is_some() {
            info!(endpoint = %name, reason = why, "removing endpoint");
        }
        self.registry.remove(name);
    }

    /// Fills in models already learned from `/v1/models` and starts the
    /// poller unless the endpoint's is already running.
    fn prepare(&self, mut ep: Endpoint, prev: Option<Tracked>) -> Tracked {
        let labelled = (!ep.models.is_empty()).then(|| ep.models.clone());
        if let Some(prev) = prev
            && prev.endpoint.ip == ep.ip
            && prev.endpoint.port == ep.port
            && let Some(poller) = prev.poller
        {
            let served = ServedModels {
                models: prev.endpoint.models,
                adapters: prev.endpoint.adapters,
            };
            (ep.models, ep.adapters) = served_by(labelled.as_deref(), served);
            return Tracked {
                endpoint: ep,
                labelled,
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
            labelled,
            poller: Some(AbortOnDropHandle::new(poller)),
        }
    }

    fn on_models(&mut self, found: ModelsFound) {
        let Some(t) = self.tracked.get_mut(&found.name) else {
            return;
        };
        // A late answer from a previous incarnation of the endpoint is dropped.
        if t.poller.is_none() || t.endpoint.ip != found.ip || t.endpoint.port != found.port {
            return;
        }
        let (models, adapters) = served_by(t.labelled.as_deref(), found.served);
        if t.endpoint.models != models || t.endpoint.adapters != adapters {
            info!(endpoint = %found.name, ?models, ?adapters, "learned models from /v1/models");
            t.endpoint.models = models;
            t.endpoint.adapters = adapters;
            self.registry.upsert(t.endpoint.clone());
        }
    }
}

/// The models and adapters an endpoint serves: what its `/v1/models` lists,
/// or the models its label names and the adapters `/v1/models` lists.
fn served_by(labelled: Option<&[String]>, served: ServedModels) -> (Vec<String>, Vec<String>) {
    let Some(label) = labelled else {
        return (served.models, served.adapters);
    };
    let mut models = label.to_vec();
    models.extend(
        served
            .adapters
            .iter()
            .filter(|a| !label.contains(a))
            .cloned(),
    );
    (models, served.adapters)
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
    let mut last: Option<ServedModels> = None;
    loop {
        match fetch_served_models(&client, &address, MODELS_FETCH_TIMEOUT).await {
            Ok(served) => {
                retry = MODELS_RETRY_MIN;
                if last.as_ref() != Some(&served) {
                    last = Some(served.clone());
                    let found = ModelsFound {
                        name: name.clone(),
                        ip,
                        port,
                        served,
                    };
                    if tx.send(found).is_err() {
                        return; // discovery stopped
                    }
                }
                tokio::time::sleep(MODELS_REFRESH).await;
            }
            Err(error) => {
                debug!(endpoint = %name, %address, %error, retry_in = ?retry, "GET /v1/models failed");
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
    /// vLLM (and llm-d-inference-sim) name a LoRA adapter's base model here;
    /// null for a base model.
    #[serde(default)]
    parent: Option<String>,
}

/// What one server's `/v1/models` lists.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServedModels {
    /// Every model id, adapters included.
    pub models: Vec<String>,
    /// The ids that are LoRA adapters (they name a parent model).
    pub adapters: Vec<String>,
}

impl ServedModels {
    /// Reads an OpenAI `/v1/models` answer (`{"data":[{"id":..,"parent":..}]}`).
    pub fn parse(body: &[u8]) -> anyhow::Result<ServedModels> {
        let list: ModelList = serde_json::from_slice(body)?;
        let mut served = ServedModels::default();
        for entry in list.data {
            let id = entry.id.trim().to_string();
            if id.is_empty() || served.models.contains(&id) {
                continue;
            }
            if entry.parent.is_some_and(|p| !p.trim().is_empty()) {
                served.adapters.push(id.clone());
            }
            served.models.push(id);
        }
        Ok(served)
    }
}

/// `GET http://<address>/v1/models`: the model ids and which are adapters.
pub async fn fetch_served_models(
    client: &reqwest::Client,
    address: &str,
    timeout: Duration,
) -> anyhow::Result<ServedModels> {
    let body = client
        .get(format!("http://{address}/v1/models"))
        .timeout(timeout)
        .send()
        .await?
        .error_for_status()?
        .bytes()
        .await?;
    ServedModels::parse(&body)
}

/// [`fetch_served_models`]' model ids.
pub async fn fetch_models(
    client: &reqwest::Client,
    address: &str,
    timeout: Duration,
) -> anyhow::Result<Vec<String>> {
    Ok(fetch_served_models(client, address, timeout).await?.models)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llm-d-inference-sim v0.10.2's answer with `--lora-modules` for two
    /// adapters (as it printed it), and vLLM's shape for a base model alone.
    #[test]
    fn adapters_are_the_models_that_name_a_parent() {
        let sim = br#"{"object":"list","data":[{"id":"base-model","object":"model","created":1796629745,"owned_by":"vllm","root":"base-model","parent":null,"max_model_len":1024},{"id":"tweet","object":"model","created":1796629745,"owned_by":"vllm","root":"/adapters/tweet","parent":"base-model","max_model_len":1024},{"id":"news","object":"model","created":1796629745,"owned_by":"vllm","root":"/adapters/news","parent":"base-model","max_model_len":1024}]}"#;
        let served = ServedModels::parse(sim).unwrap();
        assert_eq!(served.models, ["base-model", "tweet", "news"]);
        assert_eq!(served.adapters, ["tweet", "news"]);
        let base_only = br#"{"data":[{"id":"Qwen/Qwen3-8B"},{"id":"Qwen/Qwen3-8B"}]}"#;
        let served = ServedModels::parse(base_only).unwrap();
        assert_eq!(served.models, ["Qwen/Qwen3-8B"]);
        assert!(served.adapters.is_empty());
    }
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
        let (mut st, _rx) = DiscoveryState::new(vec![8000], Arc::clone(&reg));

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
        let (mut st, _rx) = DiscoveryState::new(vec![8000], Arc::clone(&reg));
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
            served: ServedModels {
                models: vec!["old".into()],
                adapters: Vec::new(),
            },
        });
        assert!(
            reg.get("u").unwrap().models.is_empty(),
            "answer from another address ignored"
        );
        st.on_models(ModelsFound {
            name: "u".into(),
            ip,
            port: 8000,
            served: ServedModels {
                models: vec!["llama".into()],
                adapters: Vec::new(),
            },
        });
        assert_eq!(reg.get("u").unwrap().models, ["llama"]);
        st.on_models(ModelsFound {
            name: "gone".into(),
            ip,
            port: 8000,
            served: ServedModels {
                models: vec![],
                adapters: Vec::new(),
            },
        });

        // A status update keeps the learned models (and the poller).
        st.on_event(Event::Apply(ready_pod("u", &[("extra", "1")])));
        assert_eq!(reg.get("u").unwrap().models, ["llama"]);
        // Labelling the Pod makes the label authoritative for base models;
        // its adapters still come from `/v1/models`.
        st.on_event(Event::Apply(ready_pod("u", &[(MODELS_LABEL, "pinned")])));
        assert_eq!(reg.get("u").unwrap().models, ["pinned"]);
        assert!(st.tracked["u"].poller.is_some());
        let served = |models: &[&str], adapters: &[&str]| ModelsFound {
            name: "u".into(),
            ip,
            port: 8000,
            served: ServedModels {
                models: models.iter().map(|m| m.to_string()).collect(),
                adapters: adapters.iter().map(|m| m.to_string()).collect(),
            },
        };
        st.on_models(served(&["llama"], &[]));
        assert_eq!(reg.get("u").unwrap().models, ["pinned"]);
        // An adapter loaded at run time joins the label's models.
        st.on_models(served(&["llama", "sql-lora"], &["sql-lora"]));
        let u = reg.get("u").unwrap();
        assert_eq!(
            (u.models.as_slice(), u.adapters.as_slice()),
            (
                &["pinned".to_string(), "sql-lora".to_string()][..],
                &["sql-lora".to_string()][..]
            )
        );
        // A status update keeps it; unloaded, it leaves.
        st.on_event(Event::Apply(ready_pod(
            "u",
            &[(MODELS_LABEL, "pinned"), ("extra", "2")],
        )));
        assert_eq!(reg.get("u").unwrap().adapters, ["sql-lora"]);
        st.on_models(served(&["llama"], &[]));
        assert_eq!(reg.get("u").unwrap().models, ["pinned"]);
        assert!(reg.get("u").unwrap().adapters.is_empty());
    }

    fn annotated(mut pod: Pod, active_ports: &str) -> Pod {
        pod.metadata.annotations = Some(BTreeMap::from([(
            "inference.networking.k8s.io/active-ports".to_string(),
            active_ports.to_string(),
        )]));
        pod
    }

    fn addresses(reg: &EndpointRegistry) -> Vec<String> {
        let mut a: Vec<_> = reg.endpoints().iter().map(|e| e.address()).collect();
        a.sort();
        a
    }

    #[test]
    fn annotation_name_is_the_inference_extension_one() {
        assert_eq!(
            ACTIVE_PORTS_ANNOTATION,
            "inference.networking.k8s.io/active-ports"
        );
    }

    #[test]
    fn endpoint_names_per_rank() {
        assert_eq!(endpoint_name("vllm-0", 0, 1), "vllm-0");
        assert_eq!(endpoint_name("vllm-0", 0, 2), "vllm-0-rank-0");
        assert_eq!(endpoint_name("vllm-0", 7, 8), "vllm-0-rank-7");
        assert_eq!(
            endpoint_names("p", 3).collect::<Vec<_>>(),
            ["p-rank-0", "p-rank-1", "p-rank-2"]
        );
        assert_eq!(endpoint_names("p", 1).collect::<Vec<_>>(), ["p"]);
        // A Pod whose own name ends like a rank cannot collide with another
        // Pod's rank.
        assert_ne!(endpoint_name("a-rank-0", 1, 2), endpoint_name("a", 0, 2));
    }

    #[test]
    fn two_target_ports_make_two_endpoints() {
        let pod = ready_pod(
            "vllm-0",
            &[
                (MODELS_LABEL, "llama"),
                (BACKEND_LABEL, "vllm-dp"),
                ("app", "vllm"),
            ],
        );
        let eps = pod_to_endpoints(&pod, &[8000, 8001]);
        let names: Vec<_> = eps.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["vllm-0-rank-0", "vllm-0-rank-1"]);
        let addrs: Vec<_> = eps.iter().map(Endpoint::address).collect();
        assert_eq!(addrs, ["10.1.2.3:8000", "10.1.2.3:8001"]);
        // Everything else identifies the Pod, the same for both ranks.
        for ep in &eps {
            assert_eq!(ep.pod, "vllm-0", "the policy's `endpoint` is the Pod");
            assert_eq!(ep.namespace, "llm");
            assert_eq!(ep.models, ["llama"]);
            assert_eq!(ep.backend.as_deref(), Some("vllm-dp"));
            assert_eq!(ep.node.as_deref(), Some("node-a"));
            assert_eq!(ep.labels.get("app").map(String::as_str), Some("vllm"));
        }
        // One port: the endpoint is named after the Pod, as before.
        let one = pod_to_endpoints(&pod, &[8000]);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].name, "vllm-0");
        assert_eq!(pod_to_endpoint(&pod, 8000), one.into_iter().next());
        // Not ready: no endpoint on any port.
        let mut p = pod.clone();
        p.status.as_mut().unwrap().phase = Some("Pending".into());
        assert!(pod_to_endpoints(&p, &[8000, 8001]).is_empty());
    }

    #[test]
    fn active_ports_annotation_restricts_the_ports() {
        let pod = ready_pod("p", &[]);
        let ports = [8000, 8001, 8002];
        let ranks = |pod: &Pod| -> Vec<(String, u16)> {
            pod_to_endpoints(pod, &ports)
                .into_iter()
                .map(|e| (e.name, e.port))
                .collect()
        };
        assert_eq!(ranks(&pod).len(), 3, "no annotation: every target port");
        assert_eq!(
            ranks(&annotated(pod.clone(), "8001")),
            [("p-rank-1".to_string(), 8001)],
            "the rank keeps its index among the target ports"
        );
        assert_eq!(
            ranks(&annotated(pod.clone(), " 8002 , 8000,")),
            [
                ("p-rank-0".to_string(), 8000),
                ("p-rank-2".to_string(), 8002)
            ]
        );
        assert!(
            ranks(&annotated(pod.clone(), "9000")).is_empty(),
            "ports outside the pool are ignored"
        );
        assert!(
            ranks(&annotated(pod.clone(), "")).is_empty(),
            "an empty list means no active port"
        );
        // Single-port pools honour it too.
        assert!(pod_to_endpoint(&annotated(pod.clone(), "8001"), 8000).is_none());
        assert!(pod_to_endpoint(&annotated(pod, "8000"), 8000).is_some());
    }

    #[test]
    fn bad_active_ports_entries_are_ignored() {
        let parsed = parse_active_ports("8000, abc,,-1,0,70000, 8001 ,80x1");
        assert_eq!(parsed.ports, BTreeSet::from([8000, 8001]));
        assert_eq!(parsed.invalid, ["abc", "-1", "0", "70000", "80x1"]);
        assert_eq!(parse_active_ports(""), ActivePorts::default());

        let pod = ready_pod("p", &[]);
        let eps = pod_to_endpoints(&annotated(pod.clone(), "abc,8001"), &[8000, 8001]);
        assert_eq!(eps.len(), 1, "valid entries still apply");
        assert_eq!(eps[0].address(), "10.1.2.3:8001");
        assert!(
            pod_to_endpoints(&annotated(pod, "abc"), &[8000, 8001]).is_empty(),
            "no valid entry: no active port (fail closed, like the reference EPP)"
        );
    }

    #[tokio::test]
    async fn bad_annotation_is_warned_about_once_per_value() {
        use watcher::Event;
        let reg = EndpointRegistry::new(Duration::from_secs(5));
        let (mut st, _rx) = DiscoveryState::new(vec![8000, 8001], Arc::clone(&reg));
        let active = |v: &str| Some(parse_active_ports(v));
        assert!(!st.check_active_ports("p", Some("8000"), active("8000").as_ref()));
        assert!(!st.check_active_ports("p", None, None));
        assert!(st.check_active_ports("p", Some("x,8000"), active("x,8000").as_ref()));
        assert!(
            !st.check_active_ports("p", Some("x,8000"), active("x,8000").as_ref()),
            "same value: logged once"
        );
        assert!(st.check_active_ports("p", Some("9000"), active("9000").as_ref()));
        assert!(st.check_active_ports("q", Some(""), active("").as_ref()));
        // Fixed, then broken the same way again: warned again.
        assert!(!st.check_active_ports("p", Some("8001"), active("8001").as_ref()));
        assert!(st.check_active_ports("p", Some("9000"), active("9000").as_ref()));

        // Through the event loop: a malformed value on repeated status
        // updates is remembered, and forgotten with the Pod.
        let bad = annotated(labelled("r"), "8001,junk");
        st.on_event(Event::Apply(bad.clone()));
        st.on_event(Event::Apply(bad.clone()));
        assert_eq!(st.warned.get("r").map(String::as_str), Some("8001,junk"));
        assert_eq!(names(&reg), ["r-rank-1"]);
        st.on_event(Event::Delete(bad));
        assert!(!st.warned.contains_key("r"));
        assert!(reg.is_empty());
    }

    #[tokio::test]
    async fn annotation_change_adds_and_removes_endpoints() {
        use watcher::Event;
        let reg = EndpointRegistry::new(Duration::from_secs(60));
        let (mut st, _rx) = DiscoveryState::new(vec![8000, 8001], Arc::clone(&reg));
        st.on_event(Event::Init);
        st.on_event(Event::InitApply(annotated(labelled("p"), "8000")));
        st.on_event(Event::InitDone);
        assert_eq!(names(&reg), ["p-rank-0"]);
        assert_eq!(addresses(&reg), ["10.1.2.3:8000"]);
        reg.set_metrics(
            "p-rank-0",
            crate::endpoints::ScrapedMetrics::empty(std::time::Instant::now()),
        );

        // Rank 1 comes up: added; rank 0 untouched (metrics kept).
        st.on_event(Event::Apply(annotated(labelled("p"), "8000,8001")));
        assert_eq!(names(&reg), ["p-rank-0", "p-rank-1"]);
        assert_eq!(addresses(&reg), ["10.1.2.3:8000", "10.1.2.3:8001"]);
        let snap = reg.snapshot();
        let rank0 = snap.iter().find(|v| v.endpoint.name == "p-rank-0").unwrap();
        assert!(
            rank0.metrics.is_some(),
            "an unchanged rank keeps its metrics"
        );

        // Rank 0 goes away.
        st.on_event(Event::Apply(annotated(labelled("p"), "8001")));
        assert_eq!(names(&reg), ["p-rank-1"]);
        assert_eq!(addresses(&reg), ["10.1.2.3:8001"]);
        assert!(!st.tracked.contains_key("p-rank-0"));

        // The annotation is removed: every target port.
        st.on_event(Event::Apply(labelled("p")));
        assert_eq!(names(&reg), ["p-rank-0", "p-rank-1"]);

        // None listed: the Pod stays, its endpoints go.
        st.on_event(Event::Apply(annotated(labelled("p"), "")));
        assert!(reg.is_empty());
        assert!(st.tracked.is_empty());
    }

    #[tokio::test]
    async fn pod_events_move_all_ranks_together() {
        use watcher::Event;
        let reg = EndpointRegistry::new(Duration::from_secs(5));
        let (mut st, _rx) = DiscoveryState::new(vec![8000, 8001], Arc::clone(&reg));
        st.on_event(Event::Init);
        st.on_event(Event::InitApply(labelled("a")));
        st.on_event(Event::InitApply(labelled("b")));
        st.on_event(Event::InitDone);
        assert_eq!(
            names(&reg),
            ["a-rank-0", "a-rank-1", "b-rank-0", "b-rank-1"]
        );

        // Deleting a Pod removes both of its endpoints, and only those.
        st.on_event(Event::Delete(labelled("a")));
        assert_eq!(names(&reg), ["b-rank-0", "b-rank-1"]);
        assert!(!st.tracked.contains_key("a-rank-0") && !st.tracked.contains_key("a-rank-1"));

        // Not Ready: both go; Ready again: both come back.
        let mut b = labelled("b");
        b.status.as_mut().unwrap().conditions.as_mut().unwrap()[1].status = "False".into();
        st.on_event(Event::Apply(b));
        assert!(reg.is_empty());
        st.on_event(Event::Apply(labelled("b")));
        assert_eq!(names(&reg), ["b-rank-0", "b-rank-1"]);

        // A relist drops ranks whose Pod vanished meanwhile.
        st.on_event(Event::Init);
        st.on_event(Event::InitApply(annotated(labelled("c"), "8001")));
        st.on_event(Event::InitDone);
        assert_eq!(names(&reg), ["c-rank-1"]);
    }

    #[tokio::test]
    async fn each_rank_learns_its_own_models() {
        use watcher::Event;
        let reg = EndpointRegistry::new(Duration::from_secs(5));
        let (mut st, _rx) = DiscoveryState::new(vec![8000, 8001], Arc::clone(&reg));
        st.on_event(Event::Apply(ready_pod("u", &[])));
        assert!(st.tracked["u-rank-0"].poller.is_some());
        assert!(st.tracked["u-rank-1"].poller.is_some());
        let ip: IpAddr = "10.1.2.3".parse().unwrap();
        st.on_models(ModelsFound {
            name: "u-rank-1".into(),
            ip,
            port: 8000,
            served: ServedModels {
                models: vec!["wrong-port".into()],
                adapters: Vec::new(),
            },
        });
        assert!(reg.get("u-rank-1").unwrap().models.is_empty());
        st.on_models(ModelsFound {
            name: "u-rank-1".into(),
            ip,
            port: 8001,
            served: ServedModels {
                models: vec!["llama".into()],
                adapters: Vec::new(),
            },
        });
        assert_eq!(reg.get("u-rank-1").unwrap().models, ["llama"]);
        assert!(reg.get("u-rank-0").unwrap().models.is_empty());
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
