use std::ops::RangeInclusive;

use k8s_openapi::api::core::v1::{
    Affinity, ResourceRequirements, Toleration, TopologySpreadConstraint,
};
use k8s_openapi::api::networking::v1::NetworkPolicyPeer;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kinference_policy::PolicySpec;
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Routes LLM inference requests to a pool of model servers and off-cluster
/// providers by ordered rules.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, JsonSchema)]
#[kube(
    group = "kinference.io",
    version = "v1alpha1",
    kind = "InferencePolicy",
    namespaced,
    status = "InferencePolicyStatus",
    shortname = "ipol",
    category = "kinference",
    printcolumn = r#"{"name":"Accepted","type":"string","jsonPath":".status.conditions[?(@.type==\"Accepted\")].status"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Pool","type":"string","jsonPath":".status.pool"}"#,
    printcolumn = r#"{"name":"Rules","type":"integer","jsonPath":".status.rules"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePolicySpec {
    #[serde(flatten)]
    pub policy: PolicySpec,
    /// Who may reach the generated endpoint picker (EPP), and how gateways
    /// authenticate to it. Not part of the policy language: it changes the
    /// EPP's Deployment and NetworkPolicy, never its policy hash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker: Option<EndpointPickerSpec>,
    /// The existing InferencePool this policy serves, in place of `pool`
    /// (Gateway API policy attachment: group `inference.networking.k8s.io`,
    /// kind `InferencePool`, in the policy's namespace). The operator then
    /// generates the EPP and its compiled policy only, never the pool or a
    /// route; the pool's `endpointPickerRef` must name the EPP Service
    /// `<policy>-epp` (the status says so when it does not).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1))]
    pub target_refs: Vec<PolicyTargetReference>,
}

/// A Gateway API `LocalPolicyTargetReference`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyTargetReference {
    #[schemars(length(max = 253))]
    pub group: String,
    #[schemars(length(min = 1, max = 63))]
    pub kind: String,
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// The API group of the Inference Extension's InferencePool.
pub const INFERENCE_POOL_GROUP: &str = "inference.networking.k8s.io";

/// By hand rather than derived: a derived `flatten` buffers the whole spec
/// in serde's generic form first, recursing into every value, so a predicate
/// nested past serde_json's limit (which the API server stores) would fail
/// the spec, and with it a watch's whole list. Here each top-level field is
/// taken as raw JSON (scanned without recursion) and the policy is decoded
/// from the rest by serde_json itself, where free-form values bound their
/// own depth (`kinference_policy::spec::FreeForm`).
impl<'de> Deserialize<'de> for InferencePolicySpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        use serde_json::value::RawValue;

        let mut fields = std::collections::BTreeMap::<String, Box<RawValue>>::deserialize(d)?;
        let endpoint_picker = fields
            .remove("endpointPicker")
            .map(|raw| serde_json::from_str(raw.get()))
            .transpose()
            .map_err(|e| D::Error::custom(format!("endpointPicker: {e}")))?;
        let target_refs = fields
            .remove("targetRefs")
            .map(|raw| serde_json::from_str(raw.get()))
            .transpose()
            .map_err(|e| D::Error::custom(format!("targetRefs: {e}")))?
            .unwrap_or_default();
        let rest = serde_json::to_string(&fields).map_err(D::Error::custom)?;
        let policy = serde_json::from_str(&rest).map_err(D::Error::custom)?;
        Ok(Self {
            policy,
            endpoint_picker,
            target_refs,
        })
    }
}

impl InferencePolicySpec {
    /// A spec with only the policy and every EPP setting at its default.
    pub fn new(policy: PolicySpec) -> Self {
        Self {
            policy,
            endpoint_picker: None,
            target_refs: Vec::new(),
        }
    }

    /// The InferencePool a policy is attached to: the name its one target
    /// reference gives, whatever the reference's kind (the operator refuses
    /// any other kind, with the path).
    pub fn attached_pool(&self) -> Option<&str> {
        match self.target_refs.as_slice() {
            [target] => Some(&target.name),
            _ => None,
        }
    }

    /// The NetworkPolicy settings, defaults filled in when unset.
    pub fn network_policy(&self) -> EppNetworkPolicySpec {
        self.endpoint_picker
            .as_ref()
            .and_then(|e| e.network_policy.clone())
            .unwrap_or_default()
    }

    pub fn client_ca(&self) -> Option<&ClientCaRef> {
        self.endpoint_picker.as_ref()?.client_ca.as_ref()
    }

    pub fn precise_prefix(&self) -> Option<&PrecisePrefixSpec> {
        self.endpoint_picker.as_ref()?.precise_prefix.as_ref()
    }

    /// The policy's own EPP settings, if it has any.
    pub fn endpoint_picker(&self) -> Option<&EndpointPickerSpec> {
        self.endpoint_picker.as_ref()
    }

    /// The replicas the policy asks for, if it does.
    pub fn epp_replicas(&self) -> Option<i32> {
        self.endpoint_picker.as_ref()?.replicas
    }

    pub fn failure_mode(&self) -> FailureMode {
        self.endpoint_picker
            .as_ref()
            .and_then(|e| e.failure_mode)
            .unwrap_or_default()
    }
}

/// Securing the EPP's ports. The ext_proc port (9002) answers provider picks
/// with the provider's API key in a header, so only gateways may reach it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerSpec {
    /// The NetworkPolicy generated for the EPP Pods (on by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<EppNetworkPolicySpec>,
    /// Require and verify a client certificate on the ext_proc port (mTLS):
    /// only gateways holding a certificate signed by this CA may connect.
    #[serde(default, rename = "clientCA", skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<ClientCaRef>,
    /// Precise prefix-cache routing: the model servers publish their
    /// KV-cache events to the EPP, which then knows which prompt prefixes
    /// each Pod holds instead of estimating it. Off unless set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precise_prefix: Option<PrecisePrefixSpec>,
    /// What the gateway does with a request while no EPP replica answers,
    /// written to the InferencePool's `endpointPickerRef.failureMode`.
    /// Default `FailClose`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<FailureMode>,
    /// EPP replicas, each deciding on its own (default: the operator's
    /// `--epp-replicas`; when that is unset too, the operator leaves the
    /// Deployment's count to an HPA, starting at 1). With more than one, or
    /// with the count left to an HPA, a PodDisruptionBudget lets one go at
    /// a time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub replicas: Option<i32>,
    /// The EPP container's resources, in place of the default (requests
    /// 250m CPU and 256Mi memory, a 1Gi memory limit, no CPU limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Scheduling of the EPP Pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<std::collections::BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// In place of the default: one replica per node where possible.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology_spread_constraints: Option<Vec<TopologySpreadConstraint>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// The EPP's log format: `json` (the default) or `text`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_format: Option<EppLogFormat>,
    /// The EPP's log level (default `info`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_level: Option<EppLogLevel>,
    /// A decision log for `kinference replay` and `kinference diff`, on a
    /// volume of each EPP Pod, bounded in size. Off unless set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_log: Option<DecisionLogSpec>,
    /// How often the EPP scrapes each model server's metrics (default
    /// `50ms`; from `10ms` to `60s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scrape_interval: Option<String>,
}

/// The EPP's log format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EppLogFormat {
    Json,
    Text,
}

/// The EPP's log level (`RUST_LOG`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EppLogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl EppLogLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            EppLogLevel::Error => "error",
            EppLogLevel::Warn => "warn",
            EppLogLevel::Info => "info",
            EppLogLevel::Debug => "debug",
            EppLogLevel::Trace => "trace",
        }
    }
}

/// The EPP's decision log: one JSON line per sampled decision (never prompt
/// text), in a file on an `emptyDir` volume of the Pod.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DecisionLogSpec {
    /// The most the log takes on disk, as a quantity (`64Mi` by default;
    /// from `1Mi` to `10Gi`): the file is rotated at half of it, keeping
    /// one previous file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_size: Option<String>,
    /// The share of decisions logged, from 0 to 1 (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample: Option<f64>,
}

/// The largest `spec.endpointPicker.replicas`.
pub const MAX_EPP_REPLICAS: i32 = 100;

/// The gateway's behaviour without its EPP (the Inference Extension's
/// `endpointPickerRef.failureMode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum FailureMode {
    /// The request fails (5xx): no request escapes the policy, e.g. a
    /// prompt with personal data never reaches a provider.
    #[default]
    FailClose,
    /// The gateway picks a Pod of the pool itself: requests keep being
    /// served, routed by the gateway's own load balancing, not the policy.
    FailOpen,
}

impl FailureMode {
    /// As the InferencePool spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureMode::FailClose => "FailClose",
            FailureMode::FailOpen => "FailOpen",
        }
    }
}

/// How the engines' publishers open their socket. `Connect` (the default):
/// each engine connects to the EPP Service (vLLM `endpoint:
/// tcp://<policy>-epp.<namespace>.svc:<eventsPort>`), so its events reach
/// one EPP replica. `Bind`: each engine binds (vLLM `endpoint:
/// tcp://*:<eventsPort>`) and every EPP replica connects to every Pod of
/// the pool, so each replica sees every engine's events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PublisherMode {
    /// The engines connect to the EPP Service; the EPP listens.
    #[default]
    Connect,
    /// The engines bind; the EPP connects to each Pod.
    Bind,
}

/// The events port, vLLM's default publisher port.
pub const DEFAULT_KV_EVENTS_PORT: i32 = 5557;

/// Precise prefix mode. Each model server publishes to
/// `tcp://<policy>-epp.<namespace>.svc:<eventsPort>` with the topic
/// `kv@<its Pod IP>@<model>` (vLLM: `--kv-events-config`; see the README).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PrecisePrefixSpec {
    /// The served model's tokenizer, which must be the engine's: prompts
    /// are matched by token ids.
    pub tokenizer: TokenizerSource,
    /// The events port (ZeroMQ); default 5557. With `publisherMode:
    /// Connect` the EPP listens on it and the generated NetworkPolicy admits
    /// only the pool's Pods; with `Bind` the engines bind it and the EPP
    /// connects to each Pod on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub events_port: Option<i32>,
    /// How the engines' publishers open their socket (see the type).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publisher_mode: Option<PublisherMode>,
    /// The engines' data-parallel size (vLLM `--data-parallel-size`; default
    /// 1, at most 64). vLLM's rank `r` publishes on `eventsPort` + `r` (and
    /// replays on `replayPort` + `r`), so the EPP listens on, or connects
    /// to, that many consecutive ports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = MAX_DATA_PARALLEL_SIZE))]
    pub data_parallel_size: Option<i32>,
    /// A prompt not tokenized within this time is matched by the estimate
    /// instead (e.g. `5ms`, the default; at most `1s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenize_budget: Option<String>,
    /// The port of each model server's replay endpoint (vLLM
    /// `replay_endpoint: tcp://*:<port>`; data-parallel rank r on port + r).
    /// After a sequence gap the EPP asks it for the lost events. Unset: a
    /// gap leaves the Pod estimated until its cache is cleared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub replay_port: Option<i32>,
}

/// Where the tokenizer files come from: an OCI image (or artifact) mounted
/// read-only as an image volume (Kubernetes 1.35+, or 1.33+ with the
/// `ImageVolume` feature gate). A ConfigMap cannot hold them (a Qwen3
/// `tokenizer.json` is 11 MB, over the 1 MiB limit).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TokenizerSource {
    /// The image reference, e.g. `registry.example/tokenizers/qwen3:2507`.
    #[schemars(length(min = 1, max = 4096))]
    pub image: String,
    /// The directory in the image holding `tokenizer.json` and the chat
    /// template (`chat_template.jinja` or `tokenizer_config.json`); default:
    /// the image's root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub path: Option<String>,
}

/// Why `first..=last`, one port per data-parallel rank, is not a range of
/// ports.
fn port_range_error(first: i32, last: i32, size: i32) -> Option<String> {
    if !(1..=65535).contains(&first) {
        Some(format!("{first} is not a port number"))
    } else if last > 65535 {
        Some(format!(
            "{first} + {size} data-parallel ranks goes past port 65535 (rank r uses port {first} + r)"
        ))
    } else {
        None
    }
}

/// Data-parallel ranks of one engine, at most (one events port each).
pub const MAX_DATA_PARALLEL_SIZE: i32 = 64;

impl PrecisePrefixSpec {
    pub fn events_port(&self) -> i32 {
        self.events_port.unwrap_or(DEFAULT_KV_EVENTS_PORT)
    }

    pub fn publisher_mode(&self) -> PublisherMode {
        self.publisher_mode.unwrap_or_default()
    }

    /// The EPP listens for the engines (they connect to its Service).
    pub fn epp_listens(&self) -> bool {
        self.publisher_mode() == PublisherMode::Connect
    }

    pub fn data_parallel_size(&self) -> i32 {
        self.data_parallel_size.unwrap_or(1)
    }

    /// The events ports: one per data-parallel rank, from
    /// [`PrecisePrefixSpec::events_port`] on.
    pub fn events_ports(&self) -> RangeInclusive<i32> {
        self.rank_ports(self.events_port())
    }

    /// The engines' replay ports, one per data-parallel rank, if set.
    pub fn replay_ports(&self) -> Option<RangeInclusive<i32>> {
        self.replay_port.map(|first| self.rank_ports(first))
    }

    /// `first` for rank 0, `first + r` for rank r: vLLM offsets each
    /// endpoint by the rank.
    fn rank_ports(&self, first: i32) -> RangeInclusive<i32> {
        first..=first.saturating_add(self.data_parallel_size().max(1) - 1)
    }

    /// What is wrong with the settings, as `path: message` under
    /// `spec.endpointPicker.precisePrefix`.
    ///
    /// `reserved_ports` are the EPP's own; `engine_ports` the model
    /// servers' (the pool's target ports), which `Bind` must not reuse.
    pub fn errors(&self, reserved_ports: &[i32], engine_ports: &[i32]) -> Vec<String> {
        let at = "spec.endpointPicker.precisePrefix";
        let mut errors = Vec::new();
        if self.tokenizer.image.trim().is_empty() {
            errors.push(format!("{at}.tokenizer.image: must name an image"));
        }
        if let Some(path) = &self.tokenizer.path {
            let parts: Vec<&str> = path.split('/').collect();
            if path.starts_with('/') || parts.contains(&"..") {
                errors.push(format!(
                    "{at}.tokenizer.path: {path:?} must be a relative path inside the image, without `..`"
                ));
            }
        }
        let size = self.data_parallel_size();
        if !(1..=MAX_DATA_PARALLEL_SIZE).contains(&size) {
            errors.push(format!(
                "{at}.dataParallelSize: {size} is not between 1 and {MAX_DATA_PARALLEL_SIZE}"
            ));
        }
        let ports = self.events_ports();
        let (first, last) = (*ports.start(), *ports.end());
        let ranks = if size > 1 {
            format!(" (through {last} for {size} data-parallel ranks)")
        } else {
            String::new()
        };
        if let Some(message) = port_range_error(first, last, size) {
            errors.push(format!("{at}.eventsPort: {message}"));
        } else if let Some(taken) = reserved_ports.iter().find(|p| ports.contains(p))
            && self.epp_listens()
        {
            errors.push(format!(
                "{at}.eventsPort: {first}{ranks} takes the EPP's own port {taken} (its ports: {reserved_ports:?})"
            ));
        }
        if let Some(replays) = self.replay_ports()
            && let Some(message) = port_range_error(*replays.start(), *replays.end(), size)
        {
            errors.push(format!("{at}.replayPort: {message}"));
        }
        if !self.epp_listens() {
            errors.extend(self.engine_port_clashes(engine_ports));
        }
        if let Some(budget) = &self.tokenize_budget {
            match kinference_policy::duration::parse_duration(budget) {
                Ok(d) if d <= std::time::Duration::from_secs(1) => {}
                Ok(_) => errors.push(format!("{at}.tokenizeBudget: {budget:?} is over 1s")),
                Err(e) => errors.push(format!("{at}.tokenizeBudget: {e}")),
            }
        }
        errors
    }

    /// With `Bind`, the engine binds every rank's events and replay port
    /// beside its own serving ports: any overlap fails its start.
    fn engine_port_clashes(&self, engine_ports: &[i32]) -> Vec<String> {
        let at = "spec.endpointPicker.precisePrefix";
        let size = self.data_parallel_size().max(1);
        let events = self.events_ports();
        let mut errors = Vec::new();
        if let Some(port) = engine_ports.iter().find(|p| events.contains(p)) {
            errors.push(format!(
                "{at}.eventsPort: {} takes the model servers' port {port} (with publisherMode Bind the engines bind it)",
                events.start()
            ));
        }
        if let Some(replays) = self.replay_ports()
            && replays.start() <= events.end()
            && events.start() <= replays.end()
        {
            errors.push(format!(
                "{at}.replayPort: ports {}-{} overlap the events ports {}-{} that the engines bind beside them (publisherMode Bind, {size} data-parallel ranks)",
                replays.start(),
                replays.end(),
                events.start(),
                events.end()
            ));
        }
        errors
    }
}

/// Which peers the generated NetworkPolicy admits. Ports not listed here
/// (gRPC health, 9003) admit nothing but the node's own probes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EppNetworkPolicySpec {
    /// false: no NetworkPolicy is generated (and an existing one is deleted).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Peers admitted to the ext_proc port 9002. Unset: the Pods of each
    /// Gateway in `route.parentRefs`, selected by the labels in-cluster
    /// gateways put on them: `gateway.networking.k8s.io/gateway-name` in the
    /// Gateway's namespace (Istio, kgateway, agentgateway), and
    /// `gateway.envoyproxy.io/owning-gateway-name`/`-namespace` in the
    /// Gateway's namespace or `envoy-gateway-system` (Envoy Gateway). Unset
    /// and no parentRefs: no NetworkPolicy, as the gateway is unknown. An
    /// empty list admits no one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ext_proc_from: Option<Vec<NetworkPolicyPeer>>,
    /// Peers admitted to the metrics port 9090. Unset: Pods labelled
    /// `app.kubernetes.io/name: prometheus` in any namespace (what the
    /// Prometheus Operator labels its servers). An empty list admits no one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_from: Option<Vec<NetworkPolicyPeer>>,
}

impl Default for EppNetworkPolicySpec {
    fn default() -> Self {
        Self {
            enabled: true,
            ext_proc_from: None,
            metrics_from: None,
        }
    }
}

fn default_true() -> bool {
    true
}

/// A CA certificate (PEM) in a Secret of the policy's namespace, mounted
/// into the EPP Pods. The operator never reads it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClientCaRef {
    #[schemars(length(min = 1, max = 253))]
    pub secret_name: String,
    /// Key of the PEM bundle in the Secret; default `ca.crt`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub key: Option<String>,
}

impl ClientCaRef {
    pub const DEFAULT_KEY: &str = "ca.crt";

    pub fn key(&self) -> &str {
        self.key.as_deref().unwrap_or(Self::DEFAULT_KEY)
    }
}

/// Observed state, written only by the operator.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InferencePolicyStatus {
    /// The generation the conditions describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Accepted`, `ResolvedRefs` and `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Name of the generated InferencePool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Number of rules in the accepted policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules: Option<i32>,
    /// Hash of the accepted policy, as loaded by the EPP when Ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_hash: Option<String>,
}

/// The CRD, with schema details the API server insists on fixed up.
pub fn crd() -> CustomResourceDefinition {
    let mut value = serde_json::to_value(InferencePolicy::crd()).expect("CRD serializes");
    strip_closed_objects(&mut value);
    serde_json::from_value(value).expect("CRD round-trips")
}

/// The CRD as YAML, as committed under `crds/`.
pub fn crd_yaml() -> String {
    let value = serde_json::to_value(crd()).expect("CRD serializes");
    kinference_policy::yaml::to_yaml(&value)
}

/// `deny_unknown_fields` (which makes `kinference lint` catch typos) renders
/// as `additionalProperties: false`, which structural schemas forbid beside
/// `properties`; the API server prunes unknown fields anyway.
fn strip_closed_objects(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            if map.get("additionalProperties") == Some(&serde_json::Value::Bool(false)) {
                map.remove("additionalProperties");
            }
            map.values_mut().for_each(strip_closed_objects);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(strip_closed_objects),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(name: &str, model: &str) -> String {
        format!(
            r#"{{"apiVersion":"kinference.io/v1alpha1","kind":"InferencePolicy",
            "metadata":{{"name":"{name}","namespace":"a"}},
            "spec":{{"pool":{{"selector":{{"app":"x"}}}},
                     "endpointPicker":{{"networkPolicy":{{"enabled":false}}}},
                     "rules":[{{"name":"r","matches":[{{"model":{model}}}],"route":{{}}}}]}}}}"#
        )
    }

    #[test]
    fn a_list_decodes_whatever_one_policy_nests() {
        let deep = format!("{}1{}", "[".repeat(5000), "]".repeat(5000));
        let list = format!(
            r#"{{"apiVersion":"v1","kind":"List","metadata":{{}},"items":[{},{}]}}"#,
            item("deep", &deep),
            item("fine", r#""llama""#)
        );
        let list: kube::core::ObjectList<InferencePolicy> =
            serde_json::from_str(&list).expect("one deep policy must not fail the list");
        assert_eq!(list.items.len(), 2);
        let deep = &list.items[0].spec;
        assert!(
            !deep.network_policy().enabled,
            "fields beside the policy survive"
        );
        let matches = deep.policy.rules[0].matches.as_ref().unwrap();
        assert!(matches[0]["model"].0.json().is_err());
        let fine = &list.items[1].spec.policy.rules[0].matches.as_ref().unwrap()[0];
        assert_eq!(fine["model"].0.json().unwrap(), "llama");
    }

    #[test]
    fn spec_mistakes_still_fail_with_their_field() {
        let bad = r#"{"pool":{"selector":{"app":"x"}},"endpointPicker":{"clientCA":7}}"#;
        let err = serde_json::from_str::<InferencePolicySpec>(bad).unwrap_err();
        assert!(err.to_string().starts_with("endpointPicker: "), "{err}");
        let unknown = r#"{"pool":{"selector":{"app":"x"}},"rulez":[]}"#;
        let err = serde_json::from_str::<InferencePolicySpec>(unknown).unwrap_err();
        assert!(err.to_string().contains("rulez"), "{err}");
    }

    #[test]
    fn crd_has_no_closed_objects_and_keeps_cel_rules() {
        let text = serde_json::to_string(&crd()).unwrap();
        assert!(!text.contains("\"additionalProperties\":false"));
        assert!(text.contains("must be the last rule"));
        assert!(text.contains("at most one of minimize, maximize and order"));
    }

    #[test]
    fn spec_flattens_the_policy() {
        let p: InferencePolicySpec = serde_json::from_value(serde_json::json!({
            "pool": {"selector": {"app": "vllm"}, "targetPorts": [{"number": 8000}]},
            "rules": [{"name": "all", "route": {"select": [{"minimize": "QueueDepth"}]}}]
        }))
        .unwrap();
        assert_eq!(p.policy.rules.len(), 1);
        assert_eq!(p.policy.pool.as_ref().unwrap().target_ports[0].number, 8000);
        assert_eq!(p.endpoint_picker, None);
        assert!(p.network_policy().enabled);
    }

    #[test]
    fn endpoint_picker_settings_sit_beside_the_policy() {
        let p: InferencePolicySpec = serde_json::from_value(serde_json::json!({
            "pool": {"selector": {"app": "vllm"}, "targetPorts": [{"number": 8000}]},
            "rules": [{"name": "all", "route": {"select": [{"minimize": "QueueDepth"}]}}],
            "endpointPicker": {
                "networkPolicy": {"metricsFrom": []},
                "clientCA": {"secretName": "gateway-ca"}
            }
        }))
        .unwrap();
        // Not part of the policy: the policy hash cannot move with it.
        assert_eq!(p.policy.rules.len(), 1);
        let np = p.network_policy();
        assert!(np.enabled, "enabled defaults to true");
        assert_eq!(np.metrics_from, Some(vec![]));
        assert_eq!(np.ext_proc_from, None);
        let ca = p.client_ca().unwrap();
        assert_eq!(
            (ca.secret_name.as_str(), ca.key()),
            ("gateway-ca", "ca.crt")
        );
        let back = serde_json::to_value(&p).unwrap();
        assert_eq!(
            back["endpointPicker"]["clientCA"]["secretName"],
            "gateway-ca"
        );
    }
}
