//! The operator at scale, for `benches/operator_scale.rs`: its release
//! binary run out of cluster under the shipped RBAC, many policies created
//! at once, the EPPs played, and the operator's requests counted in the API
//! server's audit log.
//!
//! The cluster has no controller-manager, kubelet or EPP, so [`play_epps`]
//! does what they would for every EPP Deployment the operator creates: a Pod
//! with the template's labels, one available replica, and the Pod's report
//! of the loaded policy in the EPP status ConfigMap.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::jiff::Timestamp;
use kinference_api::{
    CONDITION_ACCEPTED, CONDITION_READY, EppPodStatus, InferencePolicy, InferencePolicySpec,
    POLICY_LABEL, SecretKeyStatus, epp_field_manager,
};
use kinference_policy::PolicySpec;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::config::Kubeconfig;
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Client, ResourceExt as _};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::cluster::{FIELD_MANAGER, TestCluster, yaml_documents_to_json};

/// The operator's ServiceAccount in `manifests/`, which its RBAC binds.
pub const OPERATOR_USER: &str = "system:serviceaccount:kinference-system:kinference-operator";
/// The Gateway every policy's route names; one per namespace.
pub const GATEWAY: &str = "inference-gateway";
/// Requests the bench keeps in flight when creating objects.
const CONCURRENCY: usize = 16;

// ------------------------------------------------------------ the layout

/// Which policies a run creates: `policies`, round-robin over `namespaces`.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub policies: usize,
    pub namespaces: usize,
}

impl Layout {
    pub fn namespace_names(&self) -> Vec<String> {
        (0..self.namespaces)
            .map(|i| format!("scale-{i:03}"))
            .collect()
    }

    /// (namespace, name) of every policy.
    pub fn policy_names(&self) -> Vec<(String, String)> {
        let namespaces = self.namespace_names();
        (0..self.policies)
            .map(|i| (namespaces[i % self.namespaces].clone(), format!("p{i:04}")))
            .collect()
    }
}

/// A valid policy: a route on [`GATEWAY`], two providers (so two provider
/// Services and a BackendTLSPolicy), two rules.
pub fn policy_spec() -> Value {
    json!({
        "pool": {
            "selector": {"app": "vllm-llama"},
            "targetPorts": [{"number": 8000}],
            "models": [{"name": "llama-3-8b"}]
        },
        "route": {
            "parentRefs": [{"name": GATEWAY, "sectionName": "http"}],
            "hostnames": ["llm.example.com"],
            "pathPrefix": "/v1"
        },
        "providers": [
            {
                "name": "openai",
                "baseURL": "https://api.openai.com/v1",
                "secretRef": {"name": "openai-key", "key": "apiKey"},
                "models": [{"name": "gpt-4o-mini"}]
            },
            {
                "name": "internal",
                "baseURL": "http://llm-proxy.corp.example:8080/v1",
                "secretRef": {"name": "proxy-token", "key": "apiKey"},
                "models": [{"name": "llama-3-70b"}]
            }
        ],
        "rules": [
            {
                "name": "to-providers",
                "matches": [{"model": ["gpt-4o-mini", "llama-3-70b"]}],
                "route": {
                    "consider": [{"backends": {"type": "Provider"}}],
                    "select": [{"type": "Provider", "minimize": "ErrorRate"}]
                }
            },
            {"name": "default", "route": {"select": [{"minimize": "QueueDepth"}]}}
        ]
    })
}

/// The provider keys of [`policy_spec`], as (Secret, key).
const PROVIDER_KEYS: [(&str, &str); 2] = [("openai-key", "apiKey"), ("proxy-token", "apiKey")];

/// The hash the operator gives the compiled `spec`, which an EPP reports
/// once it has loaded it.
pub fn policy_hash(spec: &Value) -> Result<String> {
    let spec: PolicySpec = serde_json::from_value(spec.clone())?;
    Ok(kinference_policy::compile(&spec)
        .map_err(|e| anyhow!("{e}"))?
        .hash)
}

/// The namespaces of `layout`, each with the Gateway the policies name.
pub async fn create_namespaces(client: &Client, layout: &Layout) -> Result<()> {
    for ns in layout.namespace_names() {
        crate::kubelet::create_namespace(client, &ns).await?;
        create_gateway(client, &ns).await?;
    }
    Ok(())
}

async fn create_gateway(client: &Client, ns: &str) -> Result<()> {
    let gvk = GroupVersionKind::gvk("gateway.networking.k8s.io", "v1", "Gateway");
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::from_gvk_with_plural(&gvk, "gateways"),
    );
    let gateway: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": {"name": GATEWAY},
        "spec": {
            "gatewayClassName": "example",
            "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}]
        }
    }))?;
    api.create(&PostParams::default(), &gateway).await?;
    Ok(())
}

/// Creates every policy of `layout` with `spec`, [`CONCURRENCY`] at a time.
pub async fn create_policies(client: &Client, layout: &Layout, spec: &Value) -> Result<()> {
    let spec: PolicySpec = serde_json::from_value(spec.clone())?;
    futures::stream::iter(layout.policy_names())
        .map(|(ns, name)| {
            let api = Api::<InferencePolicy>::namespaced(client.clone(), &ns);
            let policy = InferencePolicy::new(&name, InferencePolicySpec::new(spec.clone()));
            async move {
                api.create(&PostParams::default(), &policy)
                    .await
                    .with_context(|| format!("creating policy {ns}/{name}"))
            }
        })
        .buffer_unordered(CONCURRENCY)
        .try_for_each(|_| async { Ok(()) })
        .await
}

// ---------------------------------------------------------- the operator

/// Applies the operator's Namespace, ServiceAccount and RBAC from
/// `manifests/`, as shipped, so the operator runs with exactly the
/// permissions it has in a cluster.
pub async fn install_operator_rbac(client: &Client) -> Result<()> {
    let manifests = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests");
    for file in ["namespace.yaml", "service-account.yaml", "rbac.yaml"] {
        let path = manifests.join(file);
        let text = fs::read_to_string(&path).with_context(|| format!("reading {path:?}"))?;
        for doc in yaml_documents_to_json(&text)? {
            apply_manifest(client, &doc)
                .await
                .with_context(|| format!("applying {}", path.display()))?;
        }
    }
    Ok(())
}

async fn apply_manifest(client: &Client, doc: &Value) -> Result<()> {
    let kind = doc["kind"].as_str().unwrap_or_default();
    let resource = match kind {
        "Namespace" => ApiResource::erase::<Namespace>(&()),
        "ServiceAccount" => ApiResource::erase::<ServiceAccount>(&()),
        "ClusterRole" => ApiResource::erase::<ClusterRole>(&()),
        "ClusterRoleBinding" => ApiResource::erase::<ClusterRoleBinding>(&()),
        "Role" => ApiResource::erase::<Role>(&()),
        "RoleBinding" => ApiResource::erase::<RoleBinding>(&()),
        other => bail!("unexpected kind {other:?} among the operator's RBAC"),
    };
    let name = doc["metadata"]["name"].as_str().context("metadata.name")?;
    // The manifests name the namespace of every namespaced object.
    let api: Api<DynamicObject> = match doc["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    api.patch(name, &PatchParams::apply(FIELD_MANAGER), &Patch::Apply(doc))
        .await?;
    Ok(())
}

/// Writes a kubeconfig for `cluster` that acts as `user` (the admin
/// impersonates it): the requests are authorized by RBAC as `user`'s, and
/// the audit log names `user` as `impersonatedUser`.
pub fn impersonating_kubeconfig(cluster: &TestCluster, user: &str) -> Result<PathBuf> {
    let mut config = Kubeconfig::read_from(cluster.kubeconfig_path())?;
    for named in &mut config.auth_infos {
        if let Some(auth) = named.auth_info.as_mut() {
            auth.impersonate = Some(user.to_owned());
        }
    }
    let path = cluster.dir().join("kubeconfig-operator");
    // JSON is YAML: any kubeconfig reader takes it.
    fs::write(&path, serde_json::to_vec_pretty(&config)?)?;
    Ok(path)
}

/// CPU time and peak memory of a process, from `/proc`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub cpu_seconds: f64,
    pub peak_rss_bytes: u64,
}

/// The operator binary running out of cluster; killed on drop.
pub struct OperatorProcess {
    child: tokio::process::Child,
    pid: u32,
    metrics_port: u16,
}

impl OperatorProcess {
    /// Starts `binary` against the cluster in `kubeconfig` (all namespaces,
    /// no leader election, its default requeue intervals), logging to
    /// `log`, and waits until its `/readyz` passes.
    pub async fn start(binary: &Path, kubeconfig: &Path, log: &Path) -> Result<Self> {
        let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let log = fs::File::create(log)?;
        // setpriv: the kernel kills the operator if the bench dies without
        // unwinding (as the cluster's processes are).
        let mut cmd = tokio::process::Command::new("setpriv");
        cmd.args(["--pdeathsig", "KILL", "--"])
            .arg(binary)
            .args(["--log-format", "text", "--metrics-addr"])
            .arg(format!("127.0.0.1:{metrics_port}"))
            .env("KUBECONFIG", kubeconfig)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let pid = child.id().context("the operator exited at once")?;
        let mut operator = Self {
            child,
            pid,
            metrics_port,
        };
        operator.wait_ready().await?;
        Ok(operator)
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("the operator exited with {status}");
            }
            if let Ok((200, _)) = http_get(self.metrics_port, "/readyz").await {
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "the operator is not ready after 60 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// CPU seconds so far and the peak resident set size.
    pub fn usage(&self) -> Result<Usage> {
        let stat = fs::read_to_string(format!("/proc/{}/stat", self.pid))?;
        // utime and stime are fields 14 and 15; the command name (field 2)
        // is in parentheses and may hold spaces, so count after it.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .context("malformed /proc/<pid>/stat")?
            .1
            .split_whitespace()
            .collect();
        let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
        let status = fs::read_to_string(format!("/proc/{}/status", self.pid))?;
        let hwm_kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .context("no VmHWM in /proc/<pid>/status")?;
        Ok(Usage {
            cpu_seconds: ticks as f64 / clock_ticks_per_second() as f64,
            peak_rss_bytes: hwm_kib * 1024,
        })
    }

    /// Reconciles finished so far, whatever their result (its `/metrics`).
    pub async fn reconciles(&self) -> Result<u64> {
        let (code, body) = http_get(self.metrics_port, "/metrics").await?;
        ensure!(code == 200, "/metrics answered {code}");
        Ok(body
            .lines()
            .filter(|l| l.starts_with("kinference_operator_reconciles_total{"))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum::<f64>() as u64)
    }
}

fn clock_ticks_per_second() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse().ok())
        .unwrap_or(100)
}

/// `GET path` over HTTP/1.0 on loopback: (status code, body).
async fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut response)).await??;
    let code = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no HTTP status line")?;
    let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Ok((code, body.to_owned()))
}

// ---------------------------------------------------------- the EPPs

/// Makes every EPP Deployment the operator creates serve `hash`, as the
/// Deployment controller, the kubelet and the EPP would: runs until aborted
/// (the handle aborts the task when dropped).
pub fn play_epps(client: Client, hash: String) -> AbortOnDrop {
    AbortOnDrop(tokio::spawn(async move {
        let deployments: Api<Deployment> = Api::all(client.clone());
        let config = watcher::Config::default().labels(POLICY_LABEL);
        let mut stream = pin!(
            watcher(deployments, config)
                .default_backoff()
                .applied_objects()
        );
        let mut seen = HashSet::new();
        let limit = Arc::new(Semaphore::new(CONCURRENCY));
        while let Some(deployment) = stream.next().await {
            let Ok(deployment) = deployment else { continue };
            let key = (deployment.namespace(), deployment.name_any());
            if !seen.insert(key) {
                continue;
            }
            let (client, hash, limit) = (client.clone(), hash.clone(), limit.clone());
            tokio::spawn(async move {
                let _permit = limit.acquire().await;
                if let Err(e) = serve(&client, &deployment, &hash).await {
                    eprintln!("playing the EPP {}: {e:#}", deployment.name_any());
                }
            });
        }
    }))
}

/// Aborts the task when dropped.
pub struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One EPP Pod for `deployment`, the Deployment available, and the Pod's
/// report that it loaded `hash` and found every provider key.
async fn serve(client: &Client, deployment: &Deployment, hash: &str) -> Result<()> {
    let ns = deployment.namespace().context("namespace")?;
    let name = deployment.name_any();
    let policy = deployment
        .labels()
        .get(POLICY_LABEL)
        .context("policy label")?;
    let pod = format!("{name}-bench");
    let labels = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    crate::kubelet::create_pod(&pods, &pod, json!(labels)).await?;
    Api::<Deployment>::namespaced(client.clone(), &ns)
        .patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1
            }})),
        )
        .await?;
    report_loaded(client, &ns, policy, &pod, hash).await
}

/// Writes `pod`'s report into the EPP status ConfigMap as the EPP does (a
/// merge patch of its own key under its own field manager), waiting for the
/// operator to have created the ConfigMap.
async fn report_loaded(
    client: &Client,
    ns: &str,
    policy: &str,
    pod: &str,
    hash: &str,
) -> Result<()> {
    let status = EppPodStatus {
        loaded_hash: hash.to_owned(),
        secret_keys: Some(
            PROVIDER_KEYS
                .iter()
                .map(|(secret, key)| SecretKeyStatus {
                    secret: (*secret).to_owned(),
                    key: (*key).to_owned(),
                    found: true,
                })
                .collect(),
        ),
    };
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let params = PatchParams {
        field_manager: Some(epp_field_manager(pod)),
        ..PatchParams::default()
    };
    let patch = Patch::Merge(json!({"data": {pod: status.to_json()}}));
    let name = format!("{policy}-epp-status");
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        match configmaps.patch(&name, &params, &patch).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("reporting into {ns}/{name}")),
        }
    }
}

// ---------------------------------------------------------- convergence

/// Whether `type_` has `status` for the policy's current generation, and
/// the status as a whole describes that generation.
pub fn has_condition(policy: &InferencePolicy, type_: &str, status: &str) -> bool {
    let generation = policy.metadata.generation;
    policy.status.as_ref().is_some_and(|s| {
        s.observed_generation == generation
            && s.conditions.iter().any(|c| {
                c.type_ == type_ && c.status == status && c.observed_generation == generation
            })
    })
}

/// Ready: the EPP serves the current generation.
pub fn is_ready(policy: &InferencePolicy) -> bool {
    has_condition(policy, CONDITION_READY, "True")
}

/// Accepted, and not Ready for this generation: where a policy stays
/// while no EPP is available.
pub fn is_accepted_not_ready(policy: &InferencePolicy) -> bool {
    has_condition(policy, CONDITION_ACCEPTED, "True")
        && has_condition(policy, CONDITION_READY, "False")
}

/// Watches every policy until `expected` of them satisfy `done`, printing
/// progress to stderr; fails after `timeout` naming how many did.
pub async fn wait_all(
    client: &Client,
    expected: usize,
    timeout: Duration,
    done: fn(&InferencePolicy) -> bool,
) -> Result<()> {
    let api: Api<InferencePolicy> = Api::all(client.clone());
    let mut stream = pin!(
        watcher(api, watcher::Config::default())
            .default_backoff()
            .applied_objects()
    );
    let deadline = tokio::time::Instant::now() + timeout;
    let mut progress = tokio::time::interval(Duration::from_secs(10));
    let mut state: HashMap<(Option<String>, String), bool> = HashMap::new();
    let mut count = 0;
    while count < expected {
        tokio::select! {
            event = stream.next() => match event {
                Some(Ok(policy)) => {
                    let now = done(&policy);
                    let key = (policy.namespace(), policy.name_any());
                    let before = state.insert(key, now).unwrap_or(false);
                    count = count + usize::from(now) - usize::from(before);
                }
                Some(Err(_)) => {} // the watcher retries with backoff
                None => bail!("the policy watch ended"),
            },
            _ = progress.tick() => eprintln!("  {count} of {expected} policies done"),
            _ = tokio::time::sleep_until(deadline) => {
                bail!("timed out after {timeout:?}: {count} of {expected} policies done")
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------- the audit log

/// One request in the audit log, what the bench needs of it.
#[derive(Clone, Debug)]
pub struct AuditEvent {
    pub audit_id: String,
    /// When the API server received the request.
    pub received: Timestamp,
    pub stage: String,
    pub verb: String,
    /// `resource[/subresource]`, or the path of a non-resource request.
    pub resource: String,
    /// The impersonated user if any, else the authenticated one.
    pub user: String,
    /// The response's status code, once there is one.
    pub code: Option<u64>,
}

/// Reads every event of the audit log at `path` (JSON lines).
pub fn read_audit_log(path: &Path) -> Result<Vec<AuditEvent>> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {path:?}"))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| parse_audit_event(&serde_json::from_str(line)?))
        .collect()
}

fn parse_audit_event(e: &Value) -> Result<AuditEvent> {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let object = &e["objectRef"];
    let resource = match (object["resource"].as_str(), object["subresource"].as_str()) {
        (Some(r), Some(s)) => format!("{r}/{s}"),
        (Some(r), None) => r.to_owned(),
        _ => text(&e["requestURI"])
            .split('?')
            .next()
            .unwrap_or_default()
            .to_owned(),
    };
    let user = e["impersonatedUser"]["username"]
        .as_str()
        .or(e["user"]["username"].as_str())
        .unwrap_or_default()
        .to_owned();
    Ok(AuditEvent {
        audit_id: text(&e["auditID"]),
        received: e["requestReceivedTimestamp"]
            .as_str()
            .context("requestReceivedTimestamp")?
            .parse()?,
        stage: text(&e["stage"]),
        verb: text(&e["verb"]),
        resource,
        user,
        code: e["responseStatus"]["code"].as_u64(),
    })
}

/// The requests one user sent in a time window.
#[derive(Clone, Debug, Default)]
pub struct RequestCounts {
    /// `verb resource` -> completed requests; watches not included.
    pub by_kind: BTreeMap<String, u64>,
    /// Watch requests started (each stays open for minutes).
    pub watches: u64,
    /// Completed requests answered with an error (4xx, 5xx), watches not included.
    pub failed: u64,
}

impl RequestCounts {
    /// Completed requests, watches not included.
    pub fn total(&self) -> u64 {
        self.by_kind.values().sum()
    }

    /// Counts the requests `user` sent in `[from, to)`: each completed
    /// request by verb and resource, and watches apart (by audit ID, as a
    /// watch has an event when it starts and one when it ends).
    pub fn of(events: &[AuditEvent], user: &str, from: Timestamp, to: Timestamp) -> Self {
        let mut counts = Self::default();
        let mut watches = HashSet::new();
        let in_window = |e: &&AuditEvent| e.user == user && e.received >= from && e.received < to;
        for e in events.iter().filter(in_window) {
            if e.verb == "watch" {
                watches.insert(e.audit_id.as_str());
            } else if e.stage == "ResponseComplete" {
                *counts
                    .by_kind
                    .entry(format!("{} {}", e.verb, e.resource))
                    .or_default() += 1;
                counts.failed += u64::from(e.code.is_some_and(|c| c >= 400));
            }
        }
        counts.watches = watches.len() as u64;
        counts
    }
}
