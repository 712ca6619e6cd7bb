//! The operator against a real API server (`kinference_e2e::cluster`: etcd and
//! kube-apiserver with the upstream Gateway API and InferencePool CRDs, no
//! kube-controller-manager, no kubelet). The operator runs in-process
//! (`kinference_operator::spawn`).
//!
//! Because nothing else runs, the tests play the missing parts themselves:
//! they write the EPP Deployment's status (availableReplicas), create the EPP
//! Pod, and write its report (the policy hash it "loaded", the provider keys
//! it "found") into the EPP status ConfigMap, as an EPP would.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::Timestamp;
use kinference_api::{
    EppPodStatus, InferencePolicy, InferencePolicySpec, POLICY_HASH_KEY, POLICY_KEY, POLICY_LABEL,
    SecretKeyStatus, epp_field_manager,
};
use kinference_e2e::cluster::{StartOptions, TestCluster};
use kinference_e2e::scale::{RequestCounts, read_audit_log};
use kinference_operator::leader::LeaseLock;
use kinference_operator::{Config, LeaderElectionConfig, Metrics, OperatorHandle, Requeue};
use kinference_policy::PolicySpec;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use kube::{Client, Resource, ResourceExt};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(60);
const NS: &str = "team-a";

// ---------------------------------------------------------------- helpers

/// A cluster with the upstream CRDs and ours (`crds/`, which a test keeps
/// equal to `kinference crds`).
async fn start_cluster() -> Result<TestCluster> {
    TestCluster::start().await
}

fn test_config(metrics: &Metrics) -> Config {
    Config {
        epp_image: "example.invalid/kinference/epp:test".into(),
        requeue: Requeue {
            resync: Duration::from_secs(60),
            // Only Gateways outside a namespaced operator's scope are polled.
            pending: Duration::from_millis(500),
            error: Duration::from_millis(500),
        },
        metrics: metrics.clone(),
        ..Config::default()
    }
}

fn start_operator(client: &Client) -> (OperatorHandle, Metrics) {
    let metrics = Metrics::new();
    (
        kinference_operator::spawn(client.clone(), test_config(&metrics)),
        metrics,
    )
}

async fn create_namespace(client: &Client, name: &str) -> Result<()> {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    Ok(())
}

async fn create_secret(client: &Client, name: &str, key: &str) -> Result<()> {
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": name},
        "stringData": {key: "sk-test"}
    }))?;
    Api::<Secret>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &secret)
        .await?;
    Ok(())
}

fn dynamic_api(
    client: &Client,
    group: &str,
    version: &str,
    kind: &str,
    plural: &str,
) -> Api<DynamicObject> {
    let res =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural);
    Api::namespaced_with(client.clone(), NS, &res)
}

fn pools(client: &Client) -> Api<DynamicObject> {
    dynamic_api(
        client,
        "inference.networking.k8s.io",
        "v1",
        "InferencePool",
        "inferencepools",
    )
}

fn routes(client: &Client) -> Api<DynamicObject> {
    dynamic_api(
        client,
        "gateway.networking.k8s.io",
        "v1",
        "HTTPRoute",
        "httproutes",
    )
}

fn tls_policies(client: &Client) -> Api<DynamicObject> {
    dynamic_api(
        client,
        "gateway.networking.k8s.io",
        "v1",
        "BackendTLSPolicy",
        "backendtlspolicies",
    )
}

async fn create_gateway(client: &Client, name: &str) -> Result<()> {
    let gw: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": {"name": name},
        "spec": {
            "gatewayClassName": "example",
            "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}]
        }
    }))?;
    dynamic_api(
        client,
        "gateway.networking.k8s.io",
        "v1",
        "Gateway",
        "gateways",
    )
    .create(&PostParams::default(), &gw)
    .await?;
    Ok(())
}

/// Two providers (https and http with a port), a route on a Gateway, two rules.
fn valid_spec() -> Value {
    json!({
        "pool": {
            "selector": {"app": "vllm-llama"},
            "targetPorts": [{"number": 8000}],
            "models": [{"name": "llama-3-8b"}]
        },
        "route": {
            "parentRefs": [{"name": "inference-gateway", "sectionName": "http"}],
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
                "secretRef": {"name": "proxy-token"},
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
            {"name": "default", "route": {"select": [{"minimize": "QueueDepth"}], "tieBreak": "Random"}}
        ]
    })
}

fn policy(name: &str, spec: Value) -> Result<InferencePolicy> {
    let spec: PolicySpec = serde_json::from_value(spec)?;
    Ok(InferencePolicy::new(name, InferencePolicySpec::new(spec)))
}

fn hash_of(spec: &Value) -> Result<String> {
    let spec: PolicySpec = serde_json::from_value(spec.clone())?;
    Ok(kinference_policy::compile(&spec)
        .map_err(|e| anyhow!("{e}"))?
        .hash)
}

/// Replaces the whole spec (GET + PUT, retried on conflicts with the
/// operator's status writes); returns the new generation.
async fn replace_spec(api: &Api<InferencePolicy>, name: &str, spec: Value) -> Result<i64> {
    let spec: PolicySpec = serde_json::from_value(spec)?;
    eventually(&format!("spec of {name} replaced"), async || {
        let mut p = api.get(name).await?;
        p.spec.policy = spec.clone();
        match api.replace(name, &PostParams::default(), &p).await {
            Ok(p) => Ok(Some(p.metadata.generation.context("generation")?)),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
            Err(e) => Err(e.into()),
        }
    })
    .await
}

fn condition(policy: &InferencePolicy, type_: &str) -> Option<Condition> {
    policy
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .cloned()
}

/// Polls `f` every 200 ms until it returns `Some`, or fails after
/// [`TIMEOUT`] with the last observation.
async fn eventually<T>(what: &str, mut f: impl AsyncFnMut() -> Result<Option<T>>) -> Result<T> {
    let deadline = Instant::now() + TIMEOUT;
    let mut last = String::new();
    loop {
        match f().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        if Instant::now() > deadline {
            bail!("timed out waiting for {what} (last error: {last})");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Fails naming each of `wanted` missing from a container's `args`.
fn assert_has_args(args: &[String], wanted: &[&str]) {
    let missing: Vec<&&str> = wanted
        .iter()
        .filter(|w| !args.iter().any(|a| a == *w))
        .collect();
    assert!(missing.is_empty(), "{missing:?} not in {args:?}");
}

/// Waits until `type_` has `status` for the policy's current generation.
async fn wait_condition(
    api: &Api<InferencePolicy>,
    name: &str,
    type_: &str,
    status: &str,
) -> Result<(InferencePolicy, Condition)> {
    let what = format!("{type_}={status}");
    wait_for_condition(api, name, type_, &what, |p, c| {
        c.status == status && c.observed_generation == p.metadata.generation
    })
    .await
}

/// Waits until the policy's `type_` condition has `reason`.
async fn wait_reason(
    api: &Api<InferencePolicy>,
    name: &str,
    type_: &str,
    reason: &str,
) -> Result<(InferencePolicy, Condition)> {
    wait_for_condition(api, name, type_, reason, |_, c| c.reason == reason).await
}

/// Waits until the policy's `type_` condition passes `holds`.
async fn wait_for_condition(
    api: &Api<InferencePolicy>,
    name: &str,
    type_: &str,
    what: &str,
    holds: impl Fn(&InferencePolicy, &Condition) -> bool,
) -> Result<(InferencePolicy, Condition)> {
    eventually(&format!("{name} {type_} {what}"), async || {
        let p = api.get(name).await?;
        Ok(condition(&p, type_)
            .filter(|c| holds(&p, c))
            .map(|c| (p, c)))
    })
    .await
}

/// `Kind/name` -> resourceVersion of everything labelled for `policy`, plus
/// the policy itself.
async fn resource_versions(client: &Client, policy: &str) -> Result<BTreeMap<String, String>> {
    let mut out = generated_versions(client, policy).await?;
    let p = Api::<InferencePolicy>::namespaced(client.clone(), NS)
        .get(policy)
        .await?;
    out.insert(
        format!("InferencePolicy/{policy}"),
        p.resource_version().unwrap_or_default(),
    );
    Ok(out)
}

/// Waits until the generated objects stop changing (two equal snapshots
/// 1.5 s apart), so a following comparison measures only what comes after.
async fn settled_versions(client: &Client, policy: &str) -> Result<BTreeMap<String, String>> {
    let mut prev = resource_versions(client, policy).await?;
    let deadline = Instant::now() + TIMEOUT;
    loop {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let now = resource_versions(client, policy).await?;
        if now == prev {
            return Ok(now);
        }
        ensure!(
            Instant::now() < deadline,
            "objects of {policy} keep changing: {prev:?} -> {now:?}"
        );
        prev = now;
    }
}

/// Waits until the operator with `metrics` has finished `n` more successful
/// reconciles than `start`.
async fn wait_reconciles(metrics: &Metrics, start: u64, n: u64) -> Result<()> {
    eventually("reconciles", async || {
        Ok((metrics.reconciles("success") >= start + n).then_some(()))
    })
    .await
}

/// The name the test gives the one EPP Pod of `policy`.
fn epp_pod(policy: &str) -> String {
    format!("{policy}-epp-7d9f8-x2x4q")
}

/// The EPP Pod a Deployment would create: the template's labels, no report.
async fn create_epp_pod(client: &Client, policy: &str) -> Result<()> {
    let deployment = Api::<Deployment>::namespaced(client.clone(), NS)
        .get(&format!("{policy}-epp"))
        .await?;
    let template = deployment.spec.context("spec")?.template;
    let labels = template.metadata.and_then(|m| m.labels).unwrap_or_default();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": epp_pod(policy), "labels": labels},
        "spec": {"containers": [{"name": "epp", "image": "example.invalid/kinference/epp:test"}]}
    }))?;
    Api::<Pod>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &pod)
        .await?;
    Ok(())
}

/// Writes Pod `pod`'s report into `policy`'s EPP status ConfigMap exactly as
/// the EPP does (`kinference_epp::k8s::report_status`): a merge patch of
/// its own key, under its own field manager. `keys`: (Secret, key, found).
async fn report(
    client: &Client,
    policy: &str,
    pod: &str,
    hash: &str,
    keys: &[(&str, &str, bool)],
) -> Result<()> {
    let status = EppPodStatus {
        loaded_hash: hash.to_string(),
        secret_keys: Some(
            keys.iter()
                .map(|(secret, key, found)| SecretKeyStatus {
                    secret: secret.to_string(),
                    key: key.to_string(),
                    found: *found,
                })
                .collect(),
        ),
    };
    Api::<ConfigMap>::namespaced(client.clone(), NS)
        .patch(
            &format!("{policy}-epp-status"),
            &PatchParams {
                field_manager: Some(epp_field_manager(pod)),
                ..PatchParams::default()
            },
            &Patch::Merge(json!({"data": {pod: status.to_json()}})),
        )
        .await?;
    Ok(())
}

/// The Secrets projected into the EPP Pods.
fn projected_secrets(deployment: &Deployment) -> Vec<String> {
    let value = serde_json::to_value(deployment).unwrap_or_default();
    value["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["name"] == "provider-secrets")
        .flat_map(|v| {
            v["projected"]["sources"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|s| s["secret"]["name"].as_str().map(str::to_string))
        .collect()
}

/// Both provider keys of [`valid_spec`] found.
const KEYS_FOUND: &[(&str, &str, bool)] = &[
    ("openai-key", "apiKey", true),
    ("proxy-token", "apiKey", true),
];

/// The data keys of `policy`'s EPP status ConfigMap.
async fn status_keys(client: &Client, policy: &str) -> Result<Vec<String>> {
    let cm = Api::<ConfigMap>::namespaced(client.clone(), NS)
        .get(&format!("{policy}-epp-status"))
        .await?;
    Ok(cm.data.unwrap_or_default().into_keys().collect())
}

/// Plays the Deployment controller: one available replica.
async fn make_epp_available(client: &Client, policy: &str) -> Result<()> {
    Api::<Deployment>::namespaced(client.clone(), NS)
        .patch_status(
            &format!("{policy}-epp"),
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1
            }})),
        )
        .await?;
    Ok(())
}

fn assert_owned(meta: &kube::api::ObjectMeta, policy: &InferencePolicy) {
    let name = meta.name.clone().unwrap_or_default();
    assert_eq!(
        meta.labels
            .as_ref()
            .and_then(|l| l.get(POLICY_LABEL))
            .map(String::as_str),
        Some(policy.name_any().as_str()),
        "{name}: policy label"
    );
    let owners = meta.owner_references.clone().unwrap_or_default();
    assert_eq!(owners.len(), 1, "{name}: {owners:?}");
    let owner = &owners[0];
    assert_eq!(owner.api_version, "kinference.io/v1alpha1", "{name}");
    assert_eq!(owner.kind, "InferencePolicy", "{name}");
    assert_eq!(owner.name, policy.name_any(), "{name}");
    assert_eq!(Some(&owner.uid), policy.metadata.uid.as_ref(), "{name}");
    assert_eq!(owner.controller, Some(true), "{name}");
}

async fn event_reasons(client: &Client, policy: &str) -> Result<Vec<String>> {
    let events = Api::<Event>::namespaced(client.clone(), NS)
        .list(&ListParams::default())
        .await?;
    Ok(events
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(policy))
        .filter_map(|e| e.reason)
        .collect())
}

// ------------------------------------------------------------------ tests

/// Argo CD's health of `policy` by `manifests/gitops/argocd-health.lua`,
/// run as Argo CD runs it: `obj` is the object, the chunk returns the health.
fn argocd_health(policy: &InferencePolicy) -> Result<(String, String)> {
    use mlua::LuaSerdeExt as _;
    let script = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../manifests/gitops/argocd-health.lua"
    ))?;
    let lua = mlua::Lua::new();
    let obj = lua
        .to_value(&serde_json::to_value(policy)?)
        .map_err(|e| anyhow!("{e}"))?;
    lua.globals().set("obj", obj).map_err(|e| anyhow!("{e}"))?;
    let hs: mlua::Table = lua.load(&script).eval().map_err(|e| anyhow!("{e}"))?;
    let field = |k: &str| hs.get::<String>(k).map_err(|e| anyhow!("{e}"));
    Ok((field("status")?, field("message")?))
}

/// What Flux's health checks compute, by cli-utils' own kstatus (v0.37.2,
/// built from the Go module proxy): a policy that must change is Failed,
/// one whose EPP does not serve it yet InProgress, a served one Current.
#[tokio::test]
async fn kstatus_reads_an_invalid_policy_as_failed_a_pending_one_in_progress_and_a_served_one_current()
-> Result<()> {
    let kstatus = kinference_e2e::kstatus::ensure()?;
    let cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let (operator, _metrics) = start_operator(&client);
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    let rules = json!([{"name": "r", "route": {"select": [{"minimize": "QueueDepth"}]}}]);
    // kstatus's verdict, and Argo CD's health by the shipped Lua check,
    // which must agree with it.
    let verdict = async |name: &str| {
        let policy = policies.get(name).await?;
        let (status, message) = kinference_e2e::kstatus::compute(&kstatus, &policy)?;
        let health = argocd_health(&policy)?;
        let agrees = match status.as_str() {
            "Failed" => "Degraded",
            "InProgress" => "Progressing",
            "Current" => "Healthy",
            other => other,
        };
        anyhow::ensure!(health.0 == agrees, "kstatus {status}, Argo CD {health:?}");
        Ok::<_, anyhow::Error>((status, message))
    };

    // Without a pool the operator cannot make one: the policy must change.
    policies
        .create(
            &PostParams::default(),
            &policy("bad", json!({"rules": rules}))?,
        )
        .await?;
    wait_condition(&policies, "bad", "Accepted", "False").await?;
    let (status, message) = verdict("bad").await?;
    assert_eq!(status, "Failed", "{message}");
    assert!(message.starts_with("spec.pool: required"), "{message}");

    let spec = json!({"pool": {"selector": {"app": "v"}, "targetPorts": [{"number": 8000}]}, "rules": rules});
    policies
        .create(&PostParams::default(), &policy("good", spec.clone())?)
        .await?;
    wait_condition(&policies, "good", "Accepted", "True").await?;
    let (status, message) = verdict("good").await?;
    assert_eq!(status, "InProgress", "no EPP yet: {message}");

    make_epp_available(&client, "good").await?;
    create_epp_pod(&client, "good").await?;
    report(&client, "good", &epp_pod("good"), &hash_of(&spec)?, &[]).await?;
    wait_condition(&policies, "good", "Ready", "True").await?;
    let (status, message) = verdict("good").await?;
    assert_eq!(status, "Current", "{message}");
    operator.stop().await?;
    Ok(())
}

/// The policy's failure mode reaches the InferencePool as the upstream
/// schema takes it; its replicas reach the Deployment, with a
/// PodDisruptionBudget beyond one; a rules-only policy, which the operator
/// cannot make a pool of, is refused with the reason.
#[tokio::test]
async fn failure_mode_and_replicas_reach_their_objects_and_a_policy_without_a_pool_is_refused()
-> Result<()> {
    let cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let (operator, _metrics) = start_operator(&client);
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    let rules = json!([{"name": "r", "route": {"select": [{"minimize": "QueueDepth"}]}}]);
    let mut open = policy(
        "open",
        json!({"pool": {"selector": {"app": "v"}, "targetPorts": [{"number": 8000}]}, "rules": rules}),
    )?;
    open.spec.endpoint_picker = Some(kinference_api::EndpointPickerSpec {
        failure_mode: Some(kinference_api::FailureMode::FailOpen),
        node_selector: Some([("pool".to_string(), "cpu".to_string())].into()),
        priority_class_name: Some("system-cluster-critical".into()),
        scrape_interval: Some("250ms".into()),
        log_level: Some(kinference_api::EppLogLevel::Debug),
        decision_log: Some(kinference_api::DecisionLogSpec {
            max_size: Some("32Mi".into()),
            sample: Some(0.5),
        }),
        ..Default::default()
    });
    policies.create(&PostParams::default(), &open).await?;
    wait_condition(&policies, "open", "Accepted", "True").await?;
    let pool = eventually("the pool", async || {
        Ok(pools(&client).get("open").await.ok())
    })
    .await?;
    assert_eq!(
        pool.data["spec"]["endpointPickerRef"]["failureMode"],
        "FailOpen"
    );

    // The tuning reaches the Pod template, as the API server stores it.
    let deployment = eventually("the EPP", async || {
        Ok(Api::<Deployment>::namespaced(client.clone(), NS)
            .get("open-epp")
            .await
            .ok())
    })
    .await?;
    let pod = deployment
        .spec
        .context("spec")?
        .template
        .spec
        .context("pod")?;
    assert_eq!(pod.node_selector.context("nodeSelector")?["pool"], "cpu");
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-cluster-critical")
    );
    let args = pod.containers[0].args.clone().unwrap_or_default();
    assert_has_args(
        &args,
        &[
            "--scrape-interval-ms=250",
            "--decision-log=/var/log/kinference/decisions.jsonl",
            "--decision-log-max-bytes=33554432",
            "--decision-log-sample=0.5",
        ],
    );
    // The decision log's volume, as the API server stored its limit.
    let volume = pod
        .volumes
        .clone()
        .unwrap_or_default()
        .into_iter()
        .find(|v| v.name == "decision-log")
        .context("no decision-log volume")?;
    assert_eq!(
        volume.empty_dir.and_then(|e| e.size_limit).map(|q| q.0),
        Some("34603008".to_string())
    );
    let env = pod.containers[0].env.clone().unwrap_or_default();
    assert!(
        env.iter()
            .any(|e| e.name == "RUST_LOG" && e.value.as_deref() == Some("debug")),
        "{env:?}"
    );

    // Two replicas: a budget lets one go at a time; back to one: none.
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), NS);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let replicas = async |n: i32| {
        let patch = json!({"spec": {"endpointPicker": {"replicas": n}}});
        policies
            .patch("open", &PatchParams::default(), &Patch::Merge(patch))
            .await
    };
    replicas(2).await?;
    let pdb = eventually("the budget", async || Ok(pdbs.get("open-epp").await.ok())).await?;
    let spec = pdb.spec.context("budget spec")?;
    assert_eq!(spec.max_unavailable, Some(IntOrString::Int(1)));
    let deployment = eventually("two replicas", async || {
        let d = deployments.get("open-epp").await?;
        Ok((d.spec.as_ref().and_then(|s| s.replicas) == Some(2)).then_some(d))
    })
    .await?;
    assert!(deployment.metadata.name.is_some());
    replicas(1).await?;
    eventually("the budget gone", async || {
        Ok(pdbs.get("open-epp").await.is_err().then_some(()))
    })
    .await?;
    let deployment = deployments.get("open-epp").await?;
    assert_eq!(deployment.spec.and_then(|s| s.replicas), Some(1));
    // The API server refuses what the operator would too.
    assert!(replicas(0).await.is_err(), "replicas 0 accepted");

    // Neither the policy nor the operator names a count: an HPA's scale
    // (the scale subresource, another field manager) outlives reconciles,
    // and a budget covers whatever count it picks.
    policies
        .patch(
            "open",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"endpointPicker": {"replicas": null}}})),
        )
        .await?;
    eventually("a budget for the HPA's replicas", async || {
        Ok(pdbs.get("open-epp").await.ok())
    })
    .await?;
    deployments
        .patch_scale(
            "open-epp",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 3}})),
        )
        .await?;
    let generation = policies
        .patch(
            "open",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"endpointPicker": {"scrapeInterval": "500ms"}}})),
        )
        .await?
        .metadata
        .generation;
    wait_condition(&policies, "open", "Accepted", "True").await?;
    let deployment = eventually("the new scrape interval applied", async || {
        let d = deployments.get("open-epp").await?;
        let args = d
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|p| p.containers[0].args.clone())
            .unwrap_or_default();
        Ok(args
            .contains(&"--scrape-interval-ms=500".to_string())
            .then_some(d))
    })
    .await?;
    assert!(generation.is_some());
    assert_eq!(
        deployment.spec.and_then(|s| s.replicas),
        Some(3),
        "the operator took back the HPA's replicas"
    );

    policies
        .create(
            &PostParams::default(),
            &policy("rules-only", json!({"rules": rules}))?,
        )
        .await?;
    let (_, accepted) = wait_condition(&policies, "rules-only", "Accepted", "False").await?;
    assert_eq!(accepted.reason, "InvalidPolicy");
    assert!(
        accepted.message.starts_with(
            "spec.pool: required unless spec.targetRefs names the existing InferencePool"
        ),
        "{accepted:?}"
    );
    assert!(
        pools(&client).get("rules-only").await.is_err(),
        "no pool without one declared"
    );
    operator.stop().await?;
    Ok(())
}

/// A policy attached to an InferencePool it does not own (`targetRefs`):
/// the operator writes its EPP and compiled policy, never the pool or a
/// route; it is Ready once the pool names its EPP; a second policy on the
/// same pool is refused until the first goes.
#[tokio::test]
async fn a_policy_attached_to_an_existing_pool_gets_its_epp_and_leaves_the_pool_alone() -> Result<()>
{
    let cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let (operator, _metrics) = start_operator(&client);
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    let rules = json!([{"name": "r", "route": {"select": [{"minimize": "QueueDepth"}]}}]);
    let attached = |name: &str, pool: &str| -> Result<InferencePolicy> {
        let mut p = policy(name, json!({"rules": rules}))?;
        p.spec.target_refs = vec![kinference_api::PolicyTargetReference {
            group: "inference.networking.k8s.io".into(),
            kind: "InferencePool".into(),
            name: pool.into(),
        }];
        Ok(p)
    };

    // Not there yet: the reference says so, and the EPP is generated anyway.
    policies
        .create(&PostParams::default(), &attached("chat", "shared")?)
        .await?;
    let (_, refs) = wait_condition(&policies, "chat", "ResolvedRefs", "False").await?;
    assert_eq!(refs.reason, "InferencePoolNotFound");
    assert_eq!(refs.message, "InferencePool not found: team-a/shared");

    // The team's own pool, served by the reference EPP.
    let pool: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "shared", "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "vllm-epp", "port": {"number": 9002}}
        }
    }))?;
    let created = pools(&client).create(&PostParams::default(), &pool).await?;
    wait_condition(&policies, "chat", "ResolvedRefs", "True").await?;
    let deployment = Api::<Deployment>::namespaced(client.clone(), NS)
        .get("chat-epp")
        .await?;
    let args = deployment
        .spec
        .context("spec")?
        .template
        .spec
        .context("pod")?
        .containers[0]
        .args
        .clone()
        .unwrap_or_default();
    assert_has_args(&args, &["--pool-name=shared", "--pool-namespace=team-a"]);
    assert!(
        Api::<ConfigMap>::namespaced(client.clone(), NS)
            .get("chat-policy")
            .await
            .is_ok()
    );
    let all = ListParams::default();
    assert!(routes(&client).list(&all).await?.items.is_empty());
    assert_eq!(
        pools(&client).list(&all).await?.items.len(),
        1,
        "a pool was written"
    );

    // Served by its EPP, but the pool still names the reference's.
    let spec = json!({"rules": rules});
    make_epp_available(&client, "chat").await?;
    create_epp_pod(&client, "chat").await?;
    report(&client, "chat", &epp_pod("chat"), &hash_of(&spec)?, &[]).await?;
    let (_, ready) = wait_reason(&policies, "chat", "Ready", "NotAttached").await?;
    assert_eq!(
        ready.message,
        "InferencePool team-a/shared sends its requests to the EPP Service \"vllm-epp\", not to \
         this policy's: set its spec.endpointPickerRef to {name: chat-epp, port: {number: 9002}}"
    );
    // The team switches the pool over: Ready, by the pool's watch alone.
    pools(&client)
        .patch(
            "shared",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"endpointPickerRef": {"name": "chat-epp"}}})),
        )
        .await?;
    wait_condition(&policies, "chat", "Ready", "True").await?;
    let pool = pools(&client).get("shared").await?;
    let managers = kinference_e2e::field_managers(&pool.metadata);
    assert!(
        !managers.iter().any(|m| m == "kinference-operator"),
        "the operator wrote the pool: {managers:?}"
    );
    assert!(created.metadata.owner_references.is_none());

    // A second policy on the same pool: refused, nothing of it runs.
    policies
        .create(&PostParams::default(), &attached("later", "shared")?)
        .await?;
    let (_, stalled) = wait_condition(&policies, "later", "Stalled", "True").await?;
    assert_eq!(stalled.reason, "Conflict");
    assert_eq!(
        stalled.message,
        "InferencePolicy chat attached to InferencePool team-a/shared first; one pool has one policy"
    );
    let deployments = Api::<Deployment>::namespaced(client.clone(), NS);
    assert!(deployments.get("later-epp").await.is_err());
    // The first goes: the second takes the pool over.
    policies.delete("chat", &DeleteParams::default()).await?;
    eventually("later's EPP", async || {
        Ok(deployments.get("later-epp").await.ok())
    })
    .await?;
    wait_condition(&policies, "later", "Stalled", "False").await?;
    operator.stop().await?;
    Ok(())
}

#[tokio::test]
async fn policy_lifecycle() -> Result<()> {
    let cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    create_secret(&client, "openai-key", "apiKey").await?;
    let (operator, metrics) = start_operator(&client);
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);

    // --- A valid policy: every object, owned and labelled, right fields.
    let created = policies
        .create(&PostParams::default(), &policy("chat", valid_spec())?)
        .await?;
    let hash = hash_of(&valid_spec())?;
    let (p, accepted) = wait_condition(&policies, "chat", "Accepted", "True").await?;
    assert_eq!(accepted.reason, "Accepted");
    assert_eq!(p.metadata.uid, created.metadata.uid);
    let status = p.status.clone().context("status")?;
    assert_eq!(status.observed_generation, p.metadata.generation);
    assert_eq!(status.pool.as_deref(), Some("chat"));
    assert_eq!(status.rules, Some(2));
    assert_eq!(status.policy_hash.as_deref(), Some(hash.as_str()));

    // The Gateway does not exist yet, and no EPP has said whether the
    // provider keys do: the operator cannot read Secrets itself.
    let refs = condition(&p, "ResolvedRefs").context("ResolvedRefs")?;
    assert_eq!(
        (refs.status.as_str(), refs.reason.as_str()),
        ("False", "GatewayNotFound"),
        "{refs:?}"
    );
    assert_eq!(
        refs.message,
        "Gateway not found: team-a/inference-gateway; not reported by an EPP Pod yet: \
         openai-key (key apiKey), proxy-token (key apiKey)"
    );
    let ready = condition(&p, "Ready").context("Ready")?;
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "EppUnavailable"),
        "{ready:?}"
    );

    let pool = pools(&client).get("chat").await?;
    assert_owned(&pool.metadata, &p);
    assert_eq!(
        pool.data["spec"],
        json!({
            // appProtocol, group and kind are the upstream schema's defaults.
            "appProtocol": "http",
            "selector": {"matchLabels": {"app": "vllm-llama"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {
                "group": "", "kind": "Service", "name": "chat-epp",
                "port": {"number": 9002}, "failureMode": "FailClose"
            }
        })
    );

    let route = routes(&client).get("chat").await?;
    assert_owned(&route.metadata, &p);
    let spec = &route.data["spec"];
    assert_eq!(spec["hostnames"], json!(["llm.example.com"]));
    assert_eq!(spec["parentRefs"][0]["name"], "inference-gateway");
    assert_eq!(spec["parentRefs"][0]["sectionName"], "http");
    let rules = spec["rules"].as_array().context("rules")?;
    assert_eq!(rules.len(), 3, "{rules:#?}");
    for (rule, provider, port) in [(&rules[0], "openai", 443), (&rules[1], "internal", 8080)] {
        let m = &rule["matches"][0];
        assert_eq!(m["path"], json!({"type": "PathPrefix", "value": "/v1"}));
        assert_eq!(
            m["headers"],
            json!([{"name": "x-kinference-destination", "type": "Exact", "value": format!("provider/{provider}")}])
        );
        assert_eq!(
            rule["backendRefs"][0]["name"],
            format!("chat-provider-{provider}")
        );
        assert_eq!(rule["backendRefs"][0]["port"], port);
    }
    assert_eq!(rules[2]["matches"][0]["path"]["value"], "/v1");
    assert_eq!(
        rules[2]["backendRefs"][0]["group"],
        "inference.networking.k8s.io"
    );
    assert_eq!(rules[2]["backendRefs"][0]["kind"], "InferencePool");
    assert_eq!(rules[2]["backendRefs"][0]["name"], "chat");

    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    for (name, host, port) in [
        ("chat-provider-openai", "api.openai.com", 443),
        ("chat-provider-internal", "llm-proxy.corp.example", 8080),
    ] {
        let svc = services.get(name).await?;
        assert_owned(&svc.metadata, &p);
        let spec = svc.spec.context("service spec")?;
        assert_eq!(spec.type_.as_deref(), Some("ExternalName"), "{name}");
        assert_eq!(spec.external_name.as_deref(), Some(host), "{name}");
        assert_eq!(spec.ports.context("ports")?[0].port, port, "{name}");
    }
    let tls = tls_policies(&client).get("chat-provider-openai").await?;
    assert_owned(&tls.metadata, &p);
    assert_eq!(tls.data["spec"]["validation"]["hostname"], "api.openai.com");
    assert!(
        tls_policies(&client)
            .get_opt("chat-provider-internal")
            .await?
            .is_none()
    );

    let epp_svc = services.get("chat-epp").await?;
    assert_owned(&epp_svc.metadata, &p);
    let ports = epp_svc.spec.context("spec")?.ports.context("ports")?;
    assert_eq!(
        (ports[0].port, ports[0].app_protocol.as_deref()),
        (9002, Some("http2"))
    );
    assert_eq!(ports[1].port, 9090);

    let cm = Api::<ConfigMap>::namespaced(client.clone(), NS)
        .get("chat-policy")
        .await?;
    assert_owned(&cm.metadata, &p);
    let data = cm.data.clone().context("data")?;
    assert_eq!(data[POLICY_HASH_KEY], hash);
    // The EPP compiles policy.json with the same library: same hash.
    assert_eq!(hash_of(&serde_json::from_str(&data[POLICY_KEY])?)?, hash);

    let deployment = Api::<Deployment>::namespaced(client.clone(), NS)
        .get("chat-epp")
        .await?;
    assert_owned(&deployment.metadata, &p);
    let pod_spec = deployment
        .spec
        .clone()
        .context("spec")?
        .template
        .spec
        .context("pod spec")?;
    let container = &pod_spec.containers[0];
    assert_eq!(
        container.image.as_deref(),
        Some("example.invalid/kinference/epp:test")
    );
    let args = container.args.clone().unwrap_or_default();
    assert!(
        args.contains(&"--policy-configmap=chat-policy".to_string()),
        "{args:?}"
    );
    assert!(args.contains(&format!("--namespace={NS}")), "{args:?}");
    assert!(
        args.contains(&"--status-configmap=chat-epp-status".to_string()),
        "{args:?}"
    );
    assert_eq!(pod_spec.service_account_name.as_deref(), Some("chat-epp"));
    assert_eq!(
        projected_secrets(&deployment),
        ["openai-key", "proxy-token"]
    );

    let sa = Api::<ServiceAccount>::namespaced(client.clone(), NS)
        .get("chat-epp")
        .await?;
    assert_owned(&sa.metadata, &p);
    let role = Api::<Role>::namespaced(client.clone(), NS)
        .get("chat-epp")
        .await?;
    assert_owned(&role.metadata, &p);
    // Nothing on Secrets (they are mounted), and the one write is a patch of
    // the EPP status ConfigMap.
    assert_eq!(
        serde_json::to_value(&role.rules)?,
        json!([
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["chat-policy"],
             "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["chat-epp-status"],
             "verbs": ["patch"]},
            {"apiGroups": ["inference.networking.x-k8s.io"], "resources": ["inferenceobjectives"],
             "verbs": ["list", "watch"]}
        ])
    );
    let status_cm = Api::<ConfigMap>::namespaced(client.clone(), NS)
        .get("chat-epp-status")
        .await?;
    assert_owned(&status_cm.metadata, &p);
    assert_eq!(status_cm.data, None, "the operator writes no report");
    let np = Api::<NetworkPolicy>::namespaced(client.clone(), NS)
        .get("chat-epp")
        .await?;
    assert_owned(&np.metadata, &p);
    let np_spec = serde_json::to_value(np.spec.context("spec")?)?;
    assert_eq!(
        np_spec["ingress"][0]["ports"],
        json!([{"port": 9002, "protocol": "TCP"}])
    );
    assert_eq!(
        np_spec["ingress"][0]["from"][0],
        json!({
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NS}},
            "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}}
        })
    );
    let binding = Api::<RoleBinding>::namespaced(client.clone(), NS)
        .get("chat-epp")
        .await?;
    assert_owned(&binding.metadata, &p);
    assert_eq!(binding.role_ref.name, "chat-epp");

    // --- An EPP Pod starts with an older policy loaded and reports the
    // keys it finds in its mounted Secrets: proxy-token is missing.
    create_epp_pod(&client, "chat").await?;
    let old_hash = "0".repeat(64);
    report(
        &client,
        "chat",
        &epp_pod("chat"),
        &old_hash,
        &[
            ("openai-key", "apiKey", true),
            ("proxy-token", "apiKey", false),
        ],
    )
    .await?;
    let refs = eventually("ResolvedRefs=False/SecretNotFound", async || {
        let p = policies.get("chat").await?;
        Ok(condition(&p, "ResolvedRefs").filter(|c| c.reason == "SecretNotFound"))
    })
    .await?;
    assert_eq!(
        refs.message,
        "Secret key missing or empty in namespace team-a: proxy-token (key apiKey); \
         Gateway not found: team-a/inference-gateway"
    );

    // --- References appear: ResolvedRefs flips. The Gateway is polled; the
    // key arrives with the EPP's report (a watched ConfigMap).
    create_secret(&client, "proxy-token", "apiKey").await?;
    create_gateway(&client, "inference-gateway").await?;
    report(&client, "chat", &epp_pod("chat"), &old_hash, KEYS_FOUND).await?;
    let (_, refs) = wait_condition(&policies, "chat", "ResolvedRefs", "True").await?;
    assert_eq!(refs.reason, "ResolvedRefs");

    // --- Ready: the Deployment becomes available, then the EPP Pod reports
    // the accepted hash.
    make_epp_available(&client, "chat").await?;
    let (_, ready) = wait_reason(&policies, "chat", "Ready", "PolicyNotLoaded").await?;
    assert_eq!(ready.status, "False");
    assert!(
        ready.message.contains("(loaded: 000000000000)"),
        "{}",
        ready.message
    );
    report(&client, "chat", &epp_pod("chat"), &hash, KEYS_FOUND).await?;
    let (_, ready) = wait_condition(&policies, "chat", "Ready", "True").await?;
    assert_eq!(ready.reason, "Ready");
    assert!(ready.message.contains(&hash[..12]), "{}", ready.message);

    // --- A reconcile with nothing to change writes nothing: not the
    // objects (server-side apply of identical content is a no-op that keeps
    // resourceVersion) and not the status.
    let before = settled_versions(&client, "chat").await?;
    assert_eq!(before.len(), 14, "{before:#?}");
    let start = metrics.reconciles("success");
    // Touching the policy's metadata triggers a reconcile without a new
    // generation.
    let touched = policies
        .patch(
            "chat",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"e2e/touch": "1"}}})),
        )
        .await?;
    wait_reconciles(&metrics, start, 1).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut expected = before.clone();
    expected.insert(
        "InferencePolicy/chat".into(),
        touched.resource_version().unwrap_or_default(),
    );
    assert_eq!(
        resource_versions(&client, "chat").await?,
        expected,
        "a no-change reconcile wrote something"
    );

    // --- An invalid edit: Accepted=False with the path; the ConfigMap (and
    // everything else) untouched, so the EPP keeps the last good policy.
    let mut invalid = valid_spec();
    invalid["rules"][1]["route"]["select"][0]["minimize"] = json!("Speed");
    let invalid_spec: PolicySpec = serde_json::from_value(invalid.clone())?;
    let expected_message = kinference_policy::compile(&invalid_spec)
        .err()
        .context("the invalid spec compiles")?
        .prefixed("spec")
        .to_string();
    assert!(
        expected_message.starts_with("spec.rules[1].route.select[0]"),
        "{expected_message}"
    );
    let generation = replace_spec(&policies, "chat", invalid).await?;
    let (p, accepted) = wait_condition(&policies, "chat", "Accepted", "False").await?;
    assert_eq!(accepted.reason, "InvalidPolicy");
    assert_eq!(accepted.message, expected_message);
    assert_eq!(accepted.observed_generation, Some(generation));
    let ready = condition(&p, "Ready").context("Ready")?;
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "InvalidPolicy")
    );
    assert!(
        ready.message.contains(&format!(
            "keeps serving the last accepted policy {}",
            &hash[..12]
        )),
        "{}",
        ready.message
    );
    let status = p.status.clone().context("status")?;
    assert_eq!(status.policy_hash.as_deref(), Some(hash.as_str()));
    assert_eq!(status.observed_generation, Some(generation));
    let mut after = resource_versions(&client, "chat").await?;
    after.remove("InferencePolicy/chat");
    let mut objects_before = before.clone();
    objects_before.remove("InferencePolicy/chat");
    assert_eq!(
        after, objects_before,
        "an invalid policy changed generated objects"
    );
    let cm_now = Api::<ConfigMap>::namespaced(client.clone(), NS)
        .get("chat-policy")
        .await?;
    assert_eq!(cm_now.data, cm.data);

    // --- Fixed: accepted again, and Ready at once (the EPP never stopped
    // serving this hash).
    replace_spec(&policies, "chat", valid_spec()).await?;
    wait_condition(&policies, "chat", "Accepted", "True").await?;
    wait_condition(&policies, "chat", "Ready", "True").await?;

    // --- Remove a provider: its Service is deleted, its route rule is gone,
    // the Role no longer names its Secret, the ConfigMap has the new policy.
    let mut one_provider = valid_spec();
    one_provider["providers"]
        .as_array_mut()
        .context("providers")?
        .remove(1);
    one_provider["rules"][0]["matches"] = json!([{"model": "gpt-4o-mini"}]);
    let new_hash = hash_of(&one_provider)?;
    replace_spec(&policies, "chat", one_provider).await?;
    wait_condition(&policies, "chat", "Accepted", "True").await?;
    eventually("provider Service deleted", async || {
        Ok(services
            .get_opt("chat-provider-internal")
            .await?
            .is_none()
            .then_some(()))
    })
    .await?;
    let route = routes(&client).get("chat").await?;
    let rules = route.data["spec"]["rules"]
        .as_array()
        .context("rules")?
        .clone();
    assert_eq!(rules.len(), 2, "{rules:#?}");
    assert!(!serde_json::to_string(&rules)?.contains("provider/internal"));
    let deployment = Api::<Deployment>::namespaced(client.clone(), NS)
        .get("chat-epp")
        .await?;
    assert_eq!(projected_secrets(&deployment), ["openai-key"]);
    let cm = Api::<ConfigMap>::namespaced(client.clone(), NS)
        .get("chat-policy")
        .await?;
    assert_eq!(cm.data.context("data")?[POLICY_HASH_KEY], new_hash);
    // The EPP has not loaded the new hash yet.
    let (p, _) = wait_reason(&policies, "chat", "Ready", "PolicyNotLoaded").await?;
    assert_eq!(
        p.status.context("status")?.policy_hash.as_deref(),
        Some(new_hash.as_str())
    );
    report(&client, "chat", &epp_pod("chat"), &new_hash, KEYS_FOUND).await?;
    wait_condition(&policies, "chat", "Ready", "True").await?;

    // --- Restart the operator: the new instance reconciles everything once
    // and writes nothing.
    operator.stop().await?;
    let before = settled_versions(&client, "chat").await?;
    let (operator, metrics) = start_operator(&client);
    wait_reconciles(&metrics, 0, 1).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        resource_versions(&client, "chat").await?,
        before,
        "a restarted operator rewrote objects"
    );

    // --- Edited while the operator is down: it converges when it is back.
    operator.stop().await?;
    let mut v2 = valid_spec();
    v2["route"]["pathPrefix"] = json!("/v2");
    let v2_hash = hash_of(&v2)?;
    let generation = replace_spec(&policies, "chat", v2).await?;
    let (operator, _metrics) = start_operator(&client);
    let (p, _) = wait_condition(&policies, "chat", "Accepted", "True").await?;
    assert_eq!(p.metadata.generation, Some(generation));
    let route = routes(&client).get("chat").await?;
    assert_eq!(
        route.data["spec"]["rules"][2]["matches"][0]["path"]["value"],
        "/v2"
    );
    assert_eq!(
        route.data["spec"]["rules"].as_array().map(Vec::len),
        Some(3)
    );
    eventually("provider Service re-created", async || {
        Ok(services
            .get_opt("chat-provider-internal")
            .await?
            .map(|_| ()))
    })
    .await?;
    report(&client, "chat", &epp_pod("chat"), &v2_hash, KEYS_FOUND).await?;
    wait_condition(&policies, "chat", "Ready", "True").await?;

    // Events were published for the state changes.
    let reasons = event_reasons(&client, "chat").await?;
    for reason in [
        "Accepted",
        "InvalidPolicy",
        "Ready",
        "ResolvedRefs",
        "SecretNotFound",
    ] {
        assert!(
            reasons.iter().any(|r| r == reason),
            "no {reason} event in {reasons:?}"
        );
    }

    // --- Delete the policy. This harness has no kube-controller-manager,
    // hence no garbage collector: the generated objects stay. What makes a
    // real cluster delete them is their ownerReference to the policy with
    // controller=true, asserted here on every generated object.
    let uid = p.metadata.uid.clone();
    policies.delete("chat", &DeleteParams::default()).await?;
    eventually("policy deleted", async || {
        Ok(policies.get_opt("chat").await?.is_none().then_some(()))
    })
    .await?;
    let mut owned = 0;
    for key in generated_versions(&client, "chat").await?.into_keys() {
        let (kind, name) = key.split_once('/').context("key")?;
        let owners = owner_refs(&client, kind, name).await?;
        assert!(
            owners
                .iter()
                .any(|o| Some(&o.uid) == uid.as_ref() && o.controller == Some(true)),
            "{key}: {owners:?}"
        );
        owned += 1;
    }
    assert_eq!(owned, 13);
    operator.stop().await?;
    Ok(())
}

/// Every kind the operator generates, as `(kind, Api)`.
fn generated_apis(client: &Client) -> Vec<(&'static str, Api<DynamicObject>)> {
    vec![
        ("ServiceAccount", erased::<ServiceAccount>(client)),
        ("Role", erased::<Role>(client)),
        ("RoleBinding", erased::<RoleBinding>(client)),
        ("ConfigMap", erased::<ConfigMap>(client)),
        ("Service", erased::<Service>(client)),
        ("Deployment", erased::<Deployment>(client)),
        ("NetworkPolicy", erased::<NetworkPolicy>(client)),
        ("InferencePool", pools(client)),
        ("HTTPRoute", routes(client)),
        ("BackendTLSPolicy", tls_policies(client)),
    ]
}

/// `Kind/name` -> resourceVersion of everything labelled for `policy`.
async fn generated_versions(client: &Client, policy: &str) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for (kind, api) in generated_apis(client) {
        let list = api
            .list_metadata(&ListParams::default().labels(&format!("{POLICY_LABEL}={policy}")))
            .await?;
        for o in list.items {
            out.insert(
                format!("{kind}/{}", o.name_any()),
                o.resource_version().unwrap_or_default(),
            );
        }
    }
    Ok(out)
}

fn erased<K: Resource<DynamicType = ()>>(client: &Client) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), NS, &ApiResource::erase::<K>(&()))
}

async fn owner_refs(client: &Client, kind: &str, name: &str) -> Result<Vec<OwnerReference>> {
    let (_, api) = generated_apis(client)
        .into_iter()
        .find(|(k, _)| *k == kind)
        .with_context(|| format!("unexpected kind {kind}"))?;
    Ok(api
        .get_metadata(name)
        .await?
        .metadata
        .owner_references
        .unwrap_or_default())
}

#[tokio::test]
async fn keeps_reconciling_after_an_apiserver_restart() -> Result<()> {
    let mut cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let (operator, _metrics) = start_operator(&client);
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    policies
        .create(&PostParams::default(), &policy("before", valid_spec())?)
        .await?;
    wait_condition(&policies, "before", "Accepted", "True").await?;

    // A policy invalid from the start generates nothing at all, and says
    // that nothing was ever accepted.
    let mut invalid = valid_spec();
    invalid["pool"]["targetPorts"] = json!([]);
    policies
        .create(&PostParams::default(), &policy("broken", invalid)?)
        .await?;
    let (p, accepted) = wait_condition(&policies, "broken", "Accepted", "False").await?;
    assert!(
        accepted.message.starts_with("spec.pool.targetPorts: "),
        "{}",
        accepted.message
    );
    let ready = condition(&p, "Ready").context("Ready")?;
    assert!(
        ready.message.ends_with("no policy has been accepted yet"),
        "{}",
        ready.message
    );
    assert_eq!(p.status.context("status")?.policy_hash, None);
    assert!(generated_versions(&client, "broken").await?.is_empty());

    cluster.restart_apiserver().await?;

    // The operator's watches reconnect: a policy created after the restart
    // is reconciled, and so is an edit of the old one.
    policies
        .create(&PostParams::default(), &policy("after", valid_spec())?)
        .await?;
    // Within seconds: each watch reconnects on its own backoff (see
    // `run_controller` in operator/src/runtime.rs).
    let restarted = Instant::now();
    wait_condition(&policies, "after", "Accepted", "True").await?;
    assert!(
        restarted.elapsed() < Duration::from_secs(30),
        "took {:?}",
        restarted.elapsed()
    );
    let cm = Api::<ConfigMap>::namespaced(client.clone(), NS)
        .get("after-policy")
        .await?;
    assert_eq!(
        cm.data.context("data")?[POLICY_HASH_KEY],
        hash_of(&valid_spec())?
    );
    let mut edited = valid_spec();
    edited["route"]["pathPrefix"] = json!("/edited");
    let generation = replace_spec(&policies, "before", edited).await?;
    let (p, _) = wait_condition(&policies, "before", "Accepted", "True").await?;
    assert_eq!(p.metadata.generation, Some(generation));
    assert!(!operator.is_finished());
    operator.stop().await?;
    Ok(())
}

/// Generated names taken by a user's objects: the objects are left exactly
/// as they were (no keys added, no owner reference that a garbage collector
/// would follow), and the policy says which object is in the way.
#[tokio::test]
async fn objects_it_did_not_create_are_never_taken_over() -> Result<()> {
    let cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let (operator, _metrics) = start_operator(&client);
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let services: Api<Service> = Api::namespaced(client.clone(), NS);

    let user_cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "cm-policy"},
        "data": {"mine": "keep me"}
    }))?;
    let user_deploy: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "dep-epp"},
        "spec": {
            "selector": {"matchLabels": {"app": "mine"}},
            "template": {
                "metadata": {"labels": {"app": "mine"}},
                "spec": {"containers": [{"name": "c", "image": "example.invalid/mine:1"}]}
            }
        }
    }))?;
    let user_svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "svc-epp"},
        "spec": {"ports": [{"port": 80}]}
    }))?;
    let pp = PostParams::default();
    let versions = [
        configmaps.create(&pp, &user_cm).await?.resource_version(),
        deployments
            .create(&pp, &user_deploy)
            .await?
            .resource_version(),
        services.create(&pp, &user_svc).await?.resource_version(),
    ];

    for (policy_name, object) in [
        ("cm", format!("ConfigMap {NS}/cm-policy")),
        ("dep", format!("Deployment {NS}/dep-epp")),
        ("svc", format!("Service {NS}/svc-epp")),
    ] {
        policies
            .create(&pp, &policy(policy_name, valid_spec())?)
            .await?;
        let (_, ready) = wait_condition(&policies, policy_name, "Ready", "False").await?;
        let ready = eventually(&format!("{policy_name} Conflict"), async || {
            let p = policies.get(policy_name).await?;
            Ok(condition(&p, "Ready").filter(|c| c.reason == "Conflict"))
        })
        .await
        .with_context(|| format!("last Ready: {ready:?}"))?;
        assert!(
            ready.message.starts_with(&format!(
                "{object} already exists and is not controlled by this policy"
            )),
            "{}",
            ready.message
        );
    }

    let cm = configmaps.get("cm-policy").await?;
    let dep = deployments.get("dep-epp").await?;
    let svc = services.get("svc-epp").await?;
    assert_eq!(
        [
            cm.resource_version(),
            dep.resource_version(),
            svc.resource_version()
        ],
        versions,
        "the user's objects were not written"
    );
    assert_eq!(
        cm.data.unwrap_or_default().keys().collect::<Vec<_>>(),
        ["mine"]
    );
    for meta in [&cm.metadata, &dep.metadata, &svc.metadata] {
        assert!(meta.owner_references.is_none(), "{meta:?}");
    }
    // The applies stop at the object in the way: what comes before the
    // ConfigMap (the EPP's identity and permissions) was created and is the
    // policy's; nothing after it was created.
    let cm_policy = policies.get("cm").await?;
    let created = generated_versions(&client, "cm").await?;
    assert_eq!(
        created.keys().collect::<Vec<_>>(),
        ["Role/cm-epp", "RoleBinding/cm-epp", "ServiceAccount/cm-epp"]
    );
    for key in created.keys() {
        let (kind, name) = key.split_once('/').context("Kind/name")?;
        let refs = owner_refs(&client, kind, name).await?;
        assert!(
            refs.iter()
                .any(|r| r.controller == Some(true)
                    && Some(&r.uid) == cm_policy.metadata.uid.as_ref()),
            "{key}: {refs:?}"
        );
    }

    // Once the user's object is gone, the policy proceeds.
    configmaps.delete("cm-policy", &Default::default()).await?;
    eventually("cm-policy recreated by the operator", async || {
        let cm = configmaps.get_opt("cm-policy").await?;
        Ok(cm.filter(|c| {
            c.owner_references()
                .iter()
                .any(|o| o.kind == "InferencePolicy")
        }))
    })
    .await?;
    operator.stop().await?;
    Ok(())
}

/// After a long outage every watch has retried many times; kube's default
/// backoff then sleeps up to 30 s more, so an edit made right after the API
/// server returned waited up to 27 s. Requeues are set far out here so that
/// only the watches can notice the edit.
#[tokio::test]
async fn an_edit_right_after_a_long_api_server_outage_is_reconciled_within_seconds() -> Result<()> {
    let mut cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let metrics = Metrics::new();
    let far = Duration::from_secs(600);
    let config = Config {
        requeue: Requeue {
            resync: far,
            pending: far,
            error: far,
        },
        ..test_config(&metrics)
    };
    let operator = kinference_operator::spawn(client.clone(), config);
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    policies
        .create(&PostParams::default(), &policy("steady", valid_spec())?)
        .await?;
    wait_condition(&policies, "steady", "Accepted", "True").await?;

    cluster.stop_apiserver().await?;
    tokio::time::sleep(Duration::from_secs(20)).await;
    cluster.start_apiserver().await?;

    let mut edited = valid_spec();
    edited["route"]["pathPrefix"] = json!("/after-outage");
    let edited_at = Instant::now();
    replace_spec(&policies, "steady", edited.clone()).await?;
    let hash = hash_of(&edited)?;
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), NS);
    eventually("the edit reaches the ConfigMap", async || {
        let cm = configmaps.get("steady-policy").await?;
        Ok((cm.data.unwrap_or_default().get(POLICY_HASH_KEY) == Some(&hash)).then_some(()))
    })
    .await?;
    let took = edited_at.elapsed();
    wait_condition(&policies, "steady", "Accepted", "True").await?;
    eprintln!("edit after a 20 s outage reconciled in {took:?}");
    assert!(
        took < Duration::from_secs(10),
        "an edit after the outage took {took:?}"
    );
    operator.stop().await?;
    Ok(())
}

#[tokio::test]
async fn only_the_leader_reconciles_and_hands_over_on_shutdown() -> Result<()> {
    let cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    create_namespace(&client, "kinference-system").await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kinference-system");
    let holder = async || -> Result<Option<String>> {
        Ok(leases
            .get_opt("kinference-operator")
            .await?
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity))
    };
    let elect = |identity: &str| LeaderElectionConfig {
        lease_duration: Duration::from_secs(4),
        retry_period: Duration::from_millis(300),
        renew_deadline: Duration::from_secs(3),
        ..LeaderElectionConfig::new("kinference-system", identity)
    };
    let start = |identity: &str| {
        let metrics = Metrics::new();
        let config = Config {
            leader_election: Some(elect(identity)),
            instance: Some(identity.to_string()),
            ..test_config(&metrics)
        };
        (kinference_operator::spawn(client.clone(), config), metrics)
    };

    let (a, a_metrics) = start("operator-a");
    eventually("a leads", async || {
        Ok((holder().await?.as_deref() == Some("operator-a")).then_some(()))
    })
    .await?;
    let (b, b_metrics) = start("operator-b");

    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    policies
        .create(&PostParams::default(), &policy("first", valid_spec())?)
        .await?;
    wait_condition(&policies, "first", "Accepted", "True").await?;
    // Longer than a lease duration: the standby must not take over a Lease
    // that is being renewed, nor reconcile.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(holder().await?.as_deref(), Some("operator-a"));
    assert!(a_metrics.reconciles_total() > 0);
    assert_eq!(b_metrics.reconciles_total(), 0);

    // A graceful stop releases the Lease; the standby takes over at once
    // (well before the lease duration would expire it).
    a.stop().await?;
    let released = Instant::now();
    eventually("b leads", async || {
        Ok((holder().await?.as_deref() == Some("operator-b")).then_some(()))
    })
    .await?;
    assert!(
        released.elapsed() < Duration::from_secs(4),
        "took {:?}",
        released.elapsed()
    );
    policies
        .create(&PostParams::default(), &policy("second", valid_spec())?)
        .await?;
    wait_condition(&policies, "second", "Accepted", "True").await?;
    // The status is written before the reconcile is counted.
    eventually("b counts its reconcile", async || {
        Ok((b_metrics.reconciles_total() > 0).then_some(()))
    })
    .await?;
    b.stop().await?;
    Ok(())
}

/// The EPP status ConfigMap is shared: the operator applies it (without
/// `data`), each EPP Pod patches its own key. The operator's applies never
/// take or drop a Pod's key, the keys of Pods that are gone are deleted, and
/// only a live Pod's report makes the policy Ready.
#[tokio::test]
async fn epp_reports_outlive_the_operators_applies_and_go_with_their_pods() -> Result<()> {
    let cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let (operator, metrics) = start_operator(&client);
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    let mut spec = valid_spec();
    spec["providers"] = json!([]);
    spec["rules"].as_array_mut().context("rules")?.remove(0);
    let hash = hash_of(&spec)?;
    policies
        .create(&PostParams::default(), &policy("chat", spec)?)
        .await?;
    wait_condition(&policies, "chat", "Accepted", "True").await?;
    make_epp_available(&client, "chat").await?;
    create_epp_pod(&client, "chat").await?;
    let live = epp_pod("chat");
    report(&client, "chat", &live, &hash, &[]).await?;
    // A Pod that no longer exists (deleted while the operator was down).
    report(&client, "chat", "chat-epp-7d9f8-gone1", &hash, &[]).await?;
    wait_condition(&policies, "chat", "Ready", "True").await?;
    eventually("the gone Pod's key deleted", async || {
        Ok((status_keys(&client, "chat").await? == [live.clone()]).then_some(()))
    })
    .await?;

    // Reconciles re-apply the ConfigMap: the Pod's key stays, owned by the
    // Pod's field manager alone.
    let start = metrics.reconciles("success");
    policies
        .patch(
            "chat",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"e2e/touch": "1"}}})),
        )
        .await?;
    wait_reconciles(&metrics, start, 1).await?;
    operator.stop().await?;
    let (operator, metrics) = start_operator(&client);
    wait_reconciles(&metrics, 0, 1).await?;
    assert_eq!(
        status_keys(&client, "chat").await?,
        std::slice::from_ref(&live)
    );
    let cm = Api::<ConfigMap>::namespaced(client.clone(), NS)
        .get("chat-epp-status")
        .await?;
    let owners: Vec<(String, String)> = cm
        .metadata
        .managed_fields
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|m| {
            let fields = serde_json::to_string(&m.fields_v1).unwrap_or_default();
            (m.manager.unwrap_or_default(), fields)
        })
        .collect();
    for (manager, fields) in &owners {
        let owns_data = fields.contains("f:data");
        assert_eq!(
            owns_data,
            *manager == epp_field_manager(&live),
            "{manager} owns {fields}"
        );
    }
    assert!(
        owners.iter().any(|(m, _)| m == "kinference-operator"),
        "{owners:?}"
    );

    // The Pod goes: its report no longer counts, and its key is deleted.
    Api::<Pod>::namespaced(client.clone(), NS)
        .delete(&live, &DeleteParams::default().grace_period(0))
        .await?;
    let (_, ready) = wait_condition(&policies, "chat", "Ready", "False").await?;
    assert_eq!(ready.reason, "PolicyNotLoaded");
    eventually("the deleted Pod's key deleted", async || {
        Ok(status_keys(&client, "chat").await?.is_empty().then_some(()))
    })
    .await?;
    operator.stop().await?;
    Ok(())
}

/// `spec.endpointPicker`: disabling the NetworkPolicy deletes it, and a
/// client CA mounts its Secret into the EPP and turns on `--client-ca-file`.
/// A cluster with the operator running and the policy `chat`
/// ([`valid_spec`]) accepted in [`NS`].
async fn accepted_chat_policy()
-> Result<(TestCluster, Client, OperatorHandle, Api<InferencePolicy>)> {
    let cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let (operator, _metrics) = start_operator(&client);
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    policies
        .create(&PostParams::default(), &policy("chat", valid_spec())?)
        .await?;
    wait_condition(&policies, "chat", "Accepted", "True").await?;
    Ok((cluster, client, operator, policies))
}

#[tokio::test]
async fn endpoint_picker_settings_reach_the_network_policy_and_the_deployment() -> Result<()> {
    let (_cluster, client, operator, policies) = accepted_chat_policy().await?;
    let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), NS);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    ensure!(
        nps.get_opt("chat-epp").await?.is_some(),
        "no NetworkPolicy by default"
    );

    policies
        .patch(
            "chat",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"endpointPicker": {
                "networkPolicy": {"enabled": false},
                "clientCA": {"secretName": "gateway-client-ca"}
            }}})),
        )
        .await?;
    eventually("the NetworkPolicy deleted", async || {
        Ok(nps.get_opt("chat-epp").await?.is_none().then_some(()))
    })
    .await?;
    let pod_spec = eventually("the client CA mounted", async || {
        let d = deployments.get("chat-epp").await?;
        let pod = d.spec.and_then(|s| s.template.spec).context("pod spec")?;
        let mounted = pod.volumes.iter().flatten().any(|v| {
            v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some("gateway-client-ca")
        });
        Ok(mounted.then_some(pod))
    })
    .await?;
    let args = pod_spec.containers[0].args.clone().unwrap_or_default();
    assert!(
        args.contains(&"--client-ca-file=/etc/kinference/client-ca/ca.crt".to_string()),
        "{args:?}"
    );
    // Not part of the policy: the hash the EPP serves does not move.
    let p = policies.get("chat").await?;
    assert_eq!(
        p.status.and_then(|s| s.policy_hash),
        Some(hash_of(&valid_spec())?)
    );
    operator.stop().await?;
    Ok(())
}

#[tokio::test]
async fn precise_prefix_settings_reach_the_epp_and_bad_ones_are_conditions() -> Result<()> {
    let (_cluster, client, operator, policies) = accepted_chat_policy().await?;
    let precise = |settings: Value| {
        Patch::Merge(json!({"spec": {"endpointPicker": {"precisePrefix": settings}}}))
    };

    // The schema takes it; the operator refuses it, saying where and why.
    let taken = json!({"tokenizer": {"image": "reg.example/tok/qwen3:1"}, "eventsPort": 9090});
    policies
        .patch("chat", &PatchParams::default(), &precise(taken))
        .await?;
    let (_, accepted) = wait_condition(&policies, "chat", "Accepted", "False").await?;
    ensure!(
        accepted.message.contains(
            "spec.endpointPicker.precisePrefix.eventsPort: 9090 takes the EPP's own port 9090"
        ),
        "{accepted:?}"
    );

    // The schema refuses a replay port out of range, and ranks past 64,
    // before the operator.
    for (field, value) in [("replayPort", 70000), ("dataParallelSize", 65)] {
        let mut settings = json!({"tokenizer": {"image": "reg.example/tok/qwen3:1"}});
        settings[field] = json!(value);
        let refused = policies
            .patch("chat", &PatchParams::default(), &precise(settings))
            .await;
        ensure!(
            refused
                .as_ref()
                .is_err_and(|e| e.to_string().contains(field)),
            "{refused:?}"
        );
    }

    let good = json!({
        "tokenizer": {"image": "reg.example/tok/qwen3:1", "path": "qwen3"},
        "eventsPort": 5557,
        "replayPort": 5558,
        "dataParallelSize": 2
    });
    policies
        .patch("chat", &PatchParams::default(), &precise(good))
        .await?;
    wait_condition(&policies, "chat", "Accepted", "True").await?;
    // The API server stored the image volume as generated (it drops fields
    // it does not know).
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let pod = eventually("the tokenizer image mounted", async || {
        let d = deployments.get("chat-epp").await?;
        let pod = d.spec.and_then(|s| s.template.spec).context("pod spec")?;
        let image = pod.volumes.iter().flatten().find_map(|v| v.image.clone());
        Ok(image.map(|i| (i, pod)))
    })
    .await?;
    let (image, pod) = pod;
    assert_eq!(image.reference.as_deref(), Some("reg.example/tok/qwen3:1"));
    let args = pod.containers[0].args.clone().unwrap_or_default();
    assert_has_args(
        &args,
        &[
            "--kv-events-port=5557",
            "--kv-events-tokenizer=/var/run/kinference/tokenizer",
            "--kv-events-replay-port=5558",
            "--kv-events-data-parallel-size=2",
        ],
    );
    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    let ports = services.get("chat-epp").await?.spec.and_then(|s| s.ports);
    let events: Vec<(Option<&str>, i32)> = ports
        .iter()
        .flatten()
        .filter(|p| {
            p.name
                .as_deref()
                .is_some_and(|n| n.starts_with("kv-events"))
        })
        .map(|p| (p.name.as_deref(), p.port))
        .collect();
    assert_eq!(
        events,
        [(Some("kv-events"), 5557), (Some("kv-events-1"), 5558)],
        "one port per data-parallel rank: {ports:?}"
    );
    let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), NS);
    let np = serde_json::to_value(nps.get("chat-epp").await?.spec)?;
    let events = np["ingress"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["ports"][0]["port"] == 5557)
        .cloned();
    assert_eq!(
        events.as_ref().map(|r| r["from"].clone()),
        Some(json!([{"podSelector": {"matchLabels": {"app": "vllm-llama"}}}]))
    );
    assert_eq!(
        events.map(|r| r["ports"][0]["endPort"].clone()),
        Some(json!(5558)),
        "both ranks' ports admitted"
    );

    // The engines bind instead: the EPP dials them, and the events ports
    // leave the Service and the NetworkPolicy (server-side apply prunes).
    policies
        .patch(
            "chat",
            &PatchParams::default(),
            // Replay ports off the events ports: both are bound in the
            // engine's Pod now.
            &precise(json!({"publisherMode": "Bind", "replayPort": 5600})),
        )
        .await?;
    let (names, admitted) = eventually("the EPP dialling the engines", async || {
        let d = deployments.get("chat-epp").await?;
        let pod = d.spec.and_then(|s| s.template.spec).context("pod spec")?;
        let args = pod.containers[0].args.clone().unwrap_or_default();
        let ports = services.get("chat-epp").await?.spec.and_then(|s| s.ports);
        let names: Vec<String> = ports
            .iter()
            .flatten()
            .filter_map(|p| p.name.clone())
            .collect();
        let np = serde_json::to_value(nps.get("chat-epp").await?.spec)?;
        let admitted: Vec<Value> = np["ingress"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| r["ports"][0]["port"].clone())
            .collect();
        let dialling = args.contains(&"--kv-events-dial".to_string());
        Ok((dialling && names.len() == 2 && admitted.len() == 2).then_some((names, admitted)))
    })
    .await?;
    assert_eq!(names, ["grpc", "metrics"]);
    assert_eq!(admitted, [json!(9002), json!(9090)]);
    operator.stop().await?;
    Ok(())
}

/// What leader election rests on, and why it is not delegated to the
/// `kube-leader-election` crate (whose acquire and renew are merge patches
/// without a resourceVersion): candidates racing for a free Lease in the
/// same instant never both win it, because each write is a `replace`
/// guarded by the resourceVersion it read.
#[tokio::test]
async fn racing_candidates_never_both_win_a_round() -> Result<()> {
    let cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, "kinference-system").await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kinference-system");
    for round in 0..5 {
        // All candidates read the free Lease (none at all in round 0,
        // released afterwards) and write at once.
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(4));
        let mut race = tokio::task::JoinSet::new();
        for i in 0..4 {
            let mut lock = LeaseLock::new(
                client.clone(),
                LeaderElectionConfig::new("kinference-system", format!("c{round}-{i}")),
            );
            let start = start.clone();
            race.spawn(async move {
                start.wait().await;
                let won = lock.try_acquire_or_renew().await;
                (lock, won)
            });
        }
        let mut winners = Vec::new();
        while let Some(joined) = race.join_next().await {
            let (lock, won) = joined?;
            if won.with_context(|| lock.identity().to_string())? {
                winners.push(lock);
            }
        }
        let names: Vec<&str> = winners.iter().map(|l| l.identity()).collect();
        ensure!(winners.len() == 1, "round {round}: winners {names:?}");
        let holder = leases
            .get("kinference-operator")
            .await?
            .spec
            .and_then(|s| s.holder_identity);
        ensure!(
            holder.as_deref() == Some(winners[0].identity()),
            "round {round}: {holder:?}"
        );
        winners[0].release().await?;
    }
    Ok(())
}

/// Creates an InferencePolicy from JSON text, bypassing typed encoding:
/// what a user's `kubectl apply` of a hostile or huge manifest sends.
async fn create_raw_policy(client: &Client, body: String) -> Result<()> {
    post_raw_policy(client, body, "").await
}

/// Whether the API server would store it (admission included), storing nothing.
async fn dry_run_raw_policy(client: &Client, body: String) -> Result<()> {
    post_raw_policy(client, body, "?dryRun=All").await
}

async fn post_raw_policy(client: &Client, body: String, query: &str) -> Result<()> {
    let request = http::Request::post(format!(
        "/apis/kinference.io/v1alpha1/namespaces/{NS}/inferencepolicies{query}"
    ))
    .header("content-type", "application/json")
    .body(body.into_bytes())?;
    client
        .request_text(request)
        .await
        .context("creating a policy from raw JSON")?;
    Ok(())
}

fn raw_policy(name: &str, rule_matches: &str) -> String {
    format!(
        r#"{{"apiVersion":"kinference.io/v1alpha1","kind":"InferencePolicy",
        "metadata":{{"name":"{name}"}},
        "spec":{{"pool":{{"selector":{{"app":"vllm"}},"targetPorts":[{{"number":8000}}]}},
        "rules":[{{"name":"first","matches":{rule_matches},"route":{{"select":[{{"minimize":"QueueDepth"}}]}}}},
                 {{"name":"rest","route":{{"select":[{{"minimize":"QueueDepth"}}]}}}}]}}}}"#
    )
}

const PREDICATE_SHAPE: &str = "predicate values (rules[].matches, exclude[].if, exclude[].drop, select[].if) are a scalar, a list of scalars, or a one-key operator map over those";

/// A policy whose `rules[0]` has these `matches`, `exclude` and tier.
fn raw_policy_with(name: &str, matches: &str, exclude: &str, tier: &str) -> String {
    format!(
        r#"{{"apiVersion":"kinference.io/v1alpha1","kind":"InferencePolicy",
        "metadata":{{"name":"{name}"}},
        "spec":{{"pool":{{"selector":{{"app":"vllm"}},"targetPorts":[{{"number":8000}}]}},
        "rules":[{{"name":"first","matches":{matches},"route":{{"exclude":{exclude},"select":[{tier}]}}}},
                 {{"name":"rest","route":{{"select":[{{"minimize":"QueueDepth"}}]}}}}]}}}}"#
    )
}

/// Waits until the API server enforces the admission policy (it compiles a
/// new one in the background) and returns the refusal.
async fn refused_once_enforced(client: &Client, body: String) -> Result<String> {
    eventually("the admission policy to be enforced", async || {
        Ok(dry_run_raw_policy(client, body.clone())
            .await
            .err()
            .map(|e| format!("{e:#}")))
    })
    .await
}

/// The CRD schema must leave predicate values open (they are unions), so
/// the admission policy shipped in crds/ bounds them: a value nested deeper
/// than the language reads is refused with the message, in every place
/// predicates appear, and every shape the language has is stored.
#[tokio::test]
async fn the_api_server_refuses_predicate_values_nested_deeper_than_the_language() -> Result<()> {
    let cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let deep = format!(
        r#"{{"model":{}1{}}}"#,
        r#"{"a":"#.repeat(3000),
        "}".repeat(3000)
    );
    let refusal = refused_once_enforced(&client, raw_policy("deep", &format!("[{deep}]"))).await?;
    assert!(refusal.contains(PREDICATE_SHAPE), "{refusal}");

    let fits = [
        (
            r#"[{"model":"m","tenant":["a","b"]}]"#,
            "[]",
            r#"{"minimize":"QueueDepth"}"#,
        ),
        (
            r#"[{"promptTokens":{"greaterThan":{"request":"maxTokens"}}}]"#,
            r#"[{"if":{"tag":{"containsNone":["pii-none"]}},"drop":[{"backend.type":"Provider"},{"provider.name":["x"]}]}]"#,
            r#"{"if":[{"kvCacheUtilization":{"lessThan":0.8}}],"minimize":"QueueDepth"}"#,
        ),
    ];
    for (i, (matches, exclude, tier)) in fits.iter().enumerate() {
        create_raw_policy(
            &client,
            raw_policy_with(&format!("fits-{i}"), matches, exclude, tier),
        )
        .await
        .with_context(|| format!("{matches} {exclude} {tier} was refused"))?;
    }
    let fine = (r#"[{"model":"m"}]"#, "[]", r#"{"minimize":"QueueDepth"}"#);
    let too_deep = [
        (r#"[{"model":[["m"]]}]"#, fine.1, fine.2),
        (r#"[{"model":{"notIn":[["m"]]}}]"#, fine.1, fine.2),
        (
            r#"[{"promptTokens":{"greaterThan":{"request":{"a":1}}}}]"#,
            fine.1,
            fine.2,
        ),
        (fine.0, r#"[{"if":{"model":[[1]]}}]"#, fine.2),
        (
            fine.0,
            r#"[{"drop":[{"backend.name":{"prefix":{"a":{"b":"c"}}}}]}]"#,
            fine.2,
        ),
        (fine.0, r#"[{"drop":[["a"]]}]"#, fine.2),
        (
            fine.0,
            fine.1,
            r#"{"if":{"queueDepth":{"lessThan":{"a":{"b":1}}}}}"#,
        ),
    ];
    for (matches, exclude, tier) in too_deep {
        let error = create_raw_policy(&client, raw_policy_with("too-deep", matches, exclude, tier))
            .await
            .expect_err(&format!("{matches} {exclude} {tier} was stored"));
        assert!(format!("{error:#}").contains(PREDICATE_SHAPE), "{error:#}");
    }
    Ok(())
}

/// `baseURL` follows the API conventions for acronyms; the old spelling
/// `baseUrl` is still stored for one release, but never beside the new one.
#[tokio::test]
async fn the_api_server_takes_either_spelling_of_base_url_but_not_both() -> Result<()> {
    let cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let with_provider = |name: &str, fields: &str| {
        format!(
            r#"{{"apiVersion":"kinference.io/v1alpha1","kind":"InferencePolicy",
            "metadata":{{"name":"{name}"}},
            "spec":{{"pool":{{"selector":{{"app":"vllm"}},"targetPorts":[{{"number":8000}}]}},
            "providers":[{{"name":"openai",{fields}"models":[{{"name":"m"}}]}}],
            "rules":[{{"name":"rest","route":{{"select":[{{"minimize":"QueueDepth"}}]}}}}]}}}}"#
        )
    };
    create_raw_policy(
        &client,
        with_provider("new", r#""baseURL":"https://a.example/v1","#),
    )
    .await?;
    create_raw_policy(
        &client,
        with_provider("old", r#""baseUrl":"https://a.example/v1","#),
    )
    .await?;
    for fields in [
        r#""baseURL":"https://a.example/v1","baseUrl":"https://a.example/v1","#,
        "",
    ] {
        let error = create_raw_policy(&client, with_provider("bad", fields))
            .await
            .expect_err(fields);
        assert!(
            format!("{error:#}")
                .contains("set baseURL (baseUrl is its deprecated spelling), exactly once"),
            "{error:#}"
        );
    }
    Ok(())
}

/// A `matches` nested 3,000 deep, stored before the admission policy of
/// crds/ existed (the schema leaves predicate values open), used to fail the decoding of the whole
/// policy list, and with it the operator's watch. A policy of 1.2 MB compiles
/// to a ConfigMap over the 1 MiB limit. Both exist before the operator
/// starts, so its first list holds them; each gets a status naming its
/// problem, and the other policies are reconciled as usual.
#[tokio::test]
async fn a_deeply_nested_or_oversized_policy_gets_a_status_and_stops_nothing_else() -> Result<()> {
    let cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let deep = format!(
        r#"[{{"model":{}1{}}}]"#,
        r#"{"a":"#.repeat(3000),
        "}".repeat(3000)
    );
    // Stored as before the admission policy existed (an upgrade).
    let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(client.clone());
    let binding = bindings.get("inferencepolicies.kinference.io").await?;
    bindings
        .delete(&binding.name_any(), &DeleteParams::default())
        .await?;
    eventually("the admission policy to be lifted", async || {
        Ok(dry_run_raw_policy(&client, raw_policy("deep", &deep))
            .await
            .is_ok()
            .then_some(()))
    })
    .await?;
    create_raw_policy(&client, raw_policy("deep", &deep)).await?;
    let tenants: Vec<String> = (0..12_000)
        .map(|i| format!("tenant-{i:06}-{}", "x".repeat(88)))
        .collect();
    let big = serde_json::to_string(&json!([{ "tenant": tenants }]))?;
    create_raw_policy(&client, raw_policy("big", &big)).await?;
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    policies
        .create(&PostParams::default(), &policy("fine", valid_spec())?)
        .await?;

    let (operator, _metrics) = start_operator(&client);
    let (_, accepted) = wait_condition(&policies, "deep", "Accepted", "False").await?;
    assert_eq!(accepted.reason, "InvalidPolicy");
    assert!(
        accepted.message.contains(
            "spec.rules[0].matches[0].model: nested deeper than 16 levels; predicates need at most 3"
        ),
        "{}",
        accepted.message
    );
    let (_, ready) = wait_condition(&policies, "big", "Ready", "False").await?;
    assert_eq!(ready.reason, "ApplyFailed", "{ready:?}");
    assert!(
        ready
            .message
            .contains("ConfigMap team-a/big-policy would hold")
            && ready
                .message
                .contains("over the API server's limit of 1048576 bytes"),
        "{}",
        ready.message
    );
    assert!(
        generated_versions(&client, "big").await?.is_empty(),
        "an oversized policy changes nothing"
    );
    wait_condition(&policies, "fine", "Accepted", "True").await?;
    // The watch is alive: a policy created now is reconciled too.
    policies
        .create(&PostParams::default(), &policy("later", valid_spec())?)
        .await?;
    wait_condition(&policies, "later", "Accepted", "True").await?;
    operator.stop().await?;
    Ok(())
}

/// `valid_spec` routing one more model name to providers: a new hash.
fn spec_variant(i: usize) -> Value {
    let mut spec = valid_spec();
    spec["rules"][0]["matches"][0]["model"] = json!(["gpt-4o-mini", format!("m{i}")]);
    spec
}

/// Waits until every policy's Accepted condition is True for its current
/// generation and its ConfigMap holds the hash of its current spec.
async fn wait_converged(client: &Client, specs: &BTreeMap<String, Value>) -> Result<()> {
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    for (name, spec) in specs {
        wait_condition(&policies, name, "Accepted", "True").await?;
        let want = hash_of(spec)?;
        eventually(
            &format!("{name}'s ConfigMap at the last spec"),
            async || {
                let cm = configmaps.get(&format!("{name}-policy")).await?;
                let hash = cm.data.unwrap_or_default().remove(POLICY_HASH_KEY);
                Ok((hash.as_deref() == Some(want.as_str())).then_some(()))
            },
        )
        .await?;
    }
    Ok(())
}

/// etcd goes away for 10 s under a running API server and operator: the
/// operator rides it out, and an edit made once etcd is back is reconciled
/// within seconds.
#[tokio::test]
async fn an_etcd_restart_is_ridden_out_and_edits_after_it_are_reconciled() -> Result<()> {
    let mut cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let (operator, _metrics) = start_operator(&client);
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    policies
        .create(&PostParams::default(), &policy("chat", valid_spec())?)
        .await?;
    wait_condition(&policies, "chat", "Accepted", "True").await?;

    cluster.stop_etcd().await?;
    tokio::time::sleep(Duration::from_secs(10)).await;
    cluster.start_etcd().await?;
    let back = Instant::now();
    let spec = spec_variant(1);
    replace_spec(&policies, "chat", spec.clone()).await?;
    policies
        .create(
            &PostParams::default(),
            &policy("created-after", valid_spec())?,
        )
        .await?;
    let edited = Instant::now();
    eprintln!(
        "the API server took writes {:?} after etcd came back",
        back.elapsed()
    );
    let specs = BTreeMap::from([
        ("chat".to_string(), spec),
        ("created-after".to_string(), valid_spec()),
    ]);
    wait_converged(&client, &specs).await?;
    eprintln!("reconciled {:?} after the edits", edited.elapsed());
    assert!(!operator.is_finished(), "the operator kept running");
    operator.stop().await?;
    Ok(())
}

/// 50 edits over 10 policies; the operator is killed (no graceful stop)
/// halfway through and a new one takes over: every policy ends at its last
/// spec, with exactly the objects it should have.
#[tokio::test]
async fn an_operator_killed_mid_burst_is_replaced_and_nothing_is_lost() -> Result<()> {
    let cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    let (first, _metrics) = start_operator(&client);
    let mut specs = BTreeMap::new();
    for p in 0..10 {
        let name = format!("p{p}");
        policies
            .create(&PostParams::default(), &policy(&name, valid_spec())?)
            .await?;
        specs.insert(name, valid_spec());
    }
    let mut first = Some(first);
    for i in 0..50 {
        let name = format!("p{}", i % 10);
        let spec = spec_variant(i);
        replace_spec(&policies, &name, spec.clone()).await?;
        specs.insert(name, spec);
        if i == 25 {
            first.take().context("killed once")?.kill().await;
        }
    }
    let (second, _metrics) = start_operator(&client);
    wait_converged(&client, &specs).await?;
    let expected: Vec<String> = generated_versions(&client, "p0")
        .await?
        .keys()
        .map(|k| k.replace("p0", "{p}"))
        .collect();
    for p in 0..10 {
        let name = format!("p{p}");
        let objects: Vec<String> = generated_versions(&client, &name)
            .await?
            .keys()
            .map(|k| k.replace(&name, "{p}"))
            .collect();
        assert_eq!(objects, expected, "{name}: orphans or missing objects");
    }
    second.stop().await?;
    Ok(())
}

/// The leader is killed without releasing its Lease: the standby takes over
/// once the Lease expires, and reconciles what changed meanwhile.
#[tokio::test]
async fn a_killed_leader_is_replaced_when_its_lease_expires() -> Result<()> {
    let cluster = start_cluster().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    create_namespace(&client, "kinference-system").await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kinference-system");
    let holder = async || -> Result<Option<String>> {
        Ok(leases
            .get_opt("kinference-operator")
            .await?
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity))
    };
    let start = |identity: &str| {
        let metrics = Metrics::new();
        let config = Config {
            leader_election: Some(LeaderElectionConfig {
                lease_duration: Duration::from_secs(4),
                retry_period: Duration::from_millis(300),
                renew_deadline: Duration::from_secs(3),
                ..LeaderElectionConfig::new("kinference-system", identity)
            }),
            instance: Some(identity.to_string()),
            ..test_config(&metrics)
        };
        (kinference_operator::spawn(client.clone(), config), metrics)
    };
    let (a, a_metrics) = start("operator-a");
    eventually("a leads", async || {
        Ok((holder().await?.as_deref() == Some("operator-a")).then_some(()))
    })
    .await?;
    let (b, b_metrics) = start("operator-b");

    a.kill().await;
    let killed = Instant::now();
    let a_reconciles = a_metrics.reconciles_total();
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    policies
        .create(
            &PostParams::default(),
            &policy("while-leaderless", valid_spec())?,
        )
        .await?;
    eventually("b leads", async || {
        Ok((holder().await?.as_deref() == Some("operator-b")).then_some(()))
    })
    .await?;
    let took = killed.elapsed();
    assert!(
        took >= Duration::from_secs(3),
        "b took a Lease that was not expired ({took:?})"
    );
    wait_condition(&policies, "while-leaderless", "Accepted", "True").await?;
    eprintln!("standby took over {took:?} after the leader was killed");
    // The status is written before the reconcile is counted.
    eventually("b counts its reconcile", async || {
        Ok((b_metrics.reconciles_total() > 0).then_some(()))
    })
    .await?;
    // Nothing of a, its controller included, outlives the kill.
    assert_eq!(a_metrics.reconciles_total(), a_reconciles);
    b.stop().await?;
    Ok(())
}

/// The operator as its own user (impersonated, in `system:masters`), so the
/// audit log tells its requests apart from the test's.
async fn client_as_operator(cluster: &TestCluster) -> Result<Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(cluster.kubeconfig_path())?;
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    config.auth_info.impersonate = Some(AUDITED_OPERATOR.into());
    config.auth_info.impersonate_groups = Some(vec!["system:masters".into()]);
    Ok(Client::try_from(config)?)
}

const AUDITED_OPERATOR: &str = "kinference-operator-audited";

/// What the operator sent during `window`, from the audit log, after the
/// last writes have settled; fails unless it reconciled about once a second
/// meanwhile.
async fn requests_while_idle(
    cluster: &TestCluster,
    metrics: &Metrics,
    window: Duration,
) -> Result<RequestCounts> {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (from, before) = (Timestamp::now(), metrics.reconciles_total());
    tokio::time::sleep(window).await;
    let (to, reconciles) = (Timestamp::now(), metrics.reconciles_total() - before);
    ensure!(
        reconciles + 1 >= window.as_secs(),
        "only {reconciles} reconciles in {window:?}"
    );
    let events = read_audit_log(&cluster.audit_log_path())?;
    Ok(RequestCounts::of(&events, AUDITED_OPERATOR, from, to))
}

/// With a reconcile every second, a policy waiting for its EPP and then a
/// Ready one cost no request at all beyond the watches: everything a
/// reconcile reads is in the watches' caches, and nothing is re-applied
/// unchanged. Counted by the API server's audit log. Drift is still undone.
#[tokio::test]
async fn a_reconcile_that_finds_nothing_to_do_sends_nothing() -> Result<()> {
    let cluster = TestCluster::start_with(StartOptions {
        audit_log: true,
        ..StartOptions::default()
    })
    .await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let metrics = Metrics::new();
    let mut config = test_config(&metrics);
    config.requeue.resync = Duration::from_secs(1);
    let operator = kinference_operator::spawn(client_as_operator(&cluster).await?, config);
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    policies
        .create(&PostParams::default(), &policy("chat", valid_spec())?)
        .await?;
    wait_condition(&policies, "chat", "Accepted", "True").await?;

    let waiting = requests_while_idle(&cluster, &metrics, Duration::from_secs(6)).await?;
    assert_eq!(waiting.total(), 0, "while waiting for the EPP: {waiting:?}");

    create_gateway(&client, "inference-gateway").await?;
    create_epp_pod(&client, "chat").await?;
    make_epp_available(&client, "chat").await?;
    let hash = hash_of(&valid_spec())?;
    let reported = Timestamp::now();
    report(&client, "chat", &epp_pod("chat"), &hash, KEYS_FOUND).await?;
    wait_condition(&policies, "chat", "Ready", "True").await?;
    let ready = requests_while_idle(&cluster, &metrics, Duration::from_secs(6)).await?;
    assert_eq!(ready.total(), 0, "with the EPP Ready: {ready:?}");
    // The report moved the shared status ConfigMap's version; that alone is
    // no reason to apply it again.
    let events = read_audit_log(&cluster.audit_log_path())?;
    let since_report = RequestCounts::of(&events, AUDITED_OPERATOR, reported, Timestamp::now());
    assert_eq!(
        since_report.by_kind.get("patch configmaps"),
        None,
        "{since_report:?}"
    );

    // Someone edits a generated object: it is applied again at once.
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    configmaps
        .patch(
            "chat-policy",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {POLICY_HASH_KEY: "tampered"}})),
        )
        .await?;
    eventually("the ConfigMap restored", async || {
        let cm = configmaps.get("chat-policy").await?;
        Ok((cm.data.unwrap_or_default()[POLICY_HASH_KEY] == hash).then_some(()))
    })
    .await?;
    operator.stop().await?;
    Ok(())
}
