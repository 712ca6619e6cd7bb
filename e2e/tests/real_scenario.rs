//! The user's scenario of `e2e/kind.sh`, end to end as real Pods on a real
//! node (`kinference_e2e::node`): the same install (`helm install` of
//! `charts/kinference` with `ci/kind-values.yaml`, then `e2e/kind/*.yaml`) and the same
//! request (`e2e/kind/smoke-request.env`), with the workspace's release
//! binaries as images, real Envoy on the host in place of agentgateway, and
//! the real controllers, kubelet and kube-proxy. Needs root and kubectl.
//!
//! Steps: the operator Pod becomes Ready and holds its Lease; the simulators
//! and the policy are deployed; the EPP Pod loads the policy, discovers the
//! simulator Pods and reports the hash; Envoy, configured from the
//! InferencePool, reaches the EPP through its Service's ClusterIP and the
//! Pod the policy chose; a `helm upgrade` rolls the operator and keeps the
//! policy; a policy edit under load fails no request; a
//! deleted EPP Pod is replaced and requests resume; with two EPP replicas, a
//! deletion, an eviction and a rolling update fail no request; a new
//! simulator Pod gets traffic; precise prefix mode rolls the EPP out with its tokenizer
//! mounted from an image volume, and prompts are tokenized; a policy
//! attached to a team's own InferencePool serves it; the reference EPP's
//! Deployment is switched to ours under load; printer columns come from the server; deleting the policy lets
//! the garbage collector remove everything it owned, and nothing else.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kinference_api::{EppPodStatus, InferencePolicy};
use kinference_e2e::cluster::yaml_documents_to_json;
use kinference_e2e::helm;
use kinference_e2e::node::images::{ImageConfig, LayerFile, binary_with_libraries};
use kinference_e2e::node::workspace_images::{self, Dockerfile, repo_root};
use kinference_e2e::node::{self, RealCluster};
use kinference_testbed::envoy::{AccessRecord, Bootstrap, Envoy, Template};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, EvictParams, GroupVersionKind, ListParams,
    LogParams, Patch, PatchParams, ValidationDirective,
};
use kube::discovery::{Discovery, Scope, verbs};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const OPERATOR_NS: &str = "kinference-system";
const OPERATOR: &str = "kinference-operator";
const DEMO_NS: &str = "kinference-demo";
const POLICY: &str = "chat";
const SIM: &str = "sim";
const SIM_SELECTOR: &str = "app=sim";
const POLICY_LABEL: &str = "kinference.io/policy";
const FIELD_MANAGER: &str = "kinference-e2e-scenario";
/// Rollouts on a busy 2-core machine take tens of seconds; room for that.
const TIMEOUT: Duration = Duration::from_secs(240);
const POLL: Duration = Duration::from_millis(500);

// ------------------------------------------------------------------ tests

/// The images built here agree with the Dockerfiles users build (the
/// Dockerfiles themselves cannot be built offline), and a Dockerfile that
/// drifts is noticed.
#[test]
fn workspace_images_agree_with_their_dockerfiles() -> Result<()> {
    let mut problems = Vec::new();
    for image in workspace_images::ALL {
        let dockerfile = Dockerfile::read(&repo_root().join(image.dockerfile))?;
        problems.extend(image.check_dockerfile(&dockerfile));
    }
    ensure!(problems.is_empty(), "{}", problems.join("\n"));

    let epp = std::fs::read_to_string(repo_root().join("Dockerfile.epp"))?;
    let drifted = Dockerfile::parse(&epp.replace("EXPOSE 9002 9003 9090", "EXPOSE 9002"))?;
    let problems = workspace_images::EPP.check_dockerfile(&drifted);
    ensure!(
        problems.len() == 1 && problems[0].contains("EXPOSE"),
        "a changed EXPOSE must be the one difference: {problems:?}"
    );
    Ok(())
}

/// `e2e/kind.sh` runs what this test runs: the same request file, the same
/// overlay and scenario directory, images of the same names from the same
/// Dockerfiles.
#[test]
fn kind_sh_shares_the_scenario() -> Result<()> {
    let script = std::fs::read_to_string(repo_root().join("e2e/kind.sh"))?;
    let mut needles = vec![
        "source \"${SCRIPT_DIR}/kind/smoke-request.env\"".to_owned(),
        "\"${SMOKE_BODY}\"".to_owned(),
        "${SMOKE_PATH}".to_owned(),
        "helm upgrade --install kinference \"${REPO_ROOT}/charts/kinference\"".to_owned(),
        "--values \"${REPO_ROOT}/charts/kinference/ci/kind-values.yaml\"".to_owned(),
        "k apply -f \"${REPO_ROOT}/e2e/kind/\"".to_owned(),
    ];
    let kind_vars = ["OPERATOR_IMAGE", "EPP_IMAGE", "SIM_IMAGE"];
    for (image, var) in workspace_images::ALL.iter().zip(kind_vars) {
        needles.push(format!("{var}=\"{}\"", image.reference));
        needles.push(format!("\"${{{var}}}={}\"", image.dockerfile));
    }
    let missing: Vec<&String> = needles
        .iter()
        .filter(|n| !script.contains(n.as_str()))
        .collect();
    ensure!(
        missing.is_empty(),
        "e2e/kind.sh does not contain {missing:?}"
    );
    let request = SmokeRequest::read()?;
    let body: Value = serde_json::from_str(&request.body)?;
    ensure!(
        body["model"] == request.model,
        "the request asks for another model than it expects"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kind_scenario_runs_on_a_real_node() -> Result<()> {
    if !node::running_as_root() {
        eprintln!("SKIPPED the_kind_scenario_runs_on_a_real_node: the real-node tier needs root");
        return Ok(());
    }
    let start = Instant::now();
    let release = tokio::task::spawn_blocking(workspace_images::image_binaries).await??;
    step(start, "release binaries ready");
    let cluster = RealCluster::start().await?;
    step(start, "node Ready");
    let result = scenario(&cluster, &release, start).await;
    if result.is_err() {
        print_diagnostics(&cluster).await;
    }
    let teardown = cluster.shutdown();
    step(start, "torn down");
    result?;
    teardown
}

fn step(start: Instant, what: &str) {
    eprintln!("[{:>6.1}s] {what}", start.elapsed().as_secs_f64());
}

async fn scenario(cluster: &RealCluster, release: &Path, start: Instant) -> Result<()> {
    // Hundreds of MB written and imported: off the async workers' hands.
    tokio::task::block_in_place(|| {
        workspace_images::import_all(cluster, release)?;
        import_reference_epp_image(cluster)?;
        import_tokenizer_image(cluster)
    })?;
    step(start, "images imported");
    let mut s = Scenario::new(cluster).await?;
    s.install_operator().await?;
    step(start, "operator Ready and leading");
    s.deploy_scenario().await?;
    step(start, "policy Ready, EPP reports its hash");
    s.create_bystanders().await?;
    let gateway = Gateway::start(&s).await?;
    step(start, "Envoy running");
    let pods = s.ready_sim_pods(2).await?;
    gateway.wait_until_serving().await?;
    step(start, "the gateway reaches the EPP");
    gateway.smoke_request(&pods).await?;
    step(start, "the kind request answered");
    s.upgrade_operator(&gateway).await?;
    step(start, "helm upgrade rolled the operator, the policy kept");
    let pinned = pods[0].name_any();
    s.edit_policy_under_load(&gateway, &pinned).await?;
    step(start, "policy edited, no request failed");
    s.replace_epp_pod(&gateway, &pinned).await?;
    step(start, "EPP Pod replaced, requests resumed");
    s.lose_epp_replicas_under_load(&gateway, &pinned).await?;
    step(
        start,
        "two EPP replicas: deletion, eviction and a rolling update fail no request, a SIGKILL few",
    );
    let pinned = s.scale_simulators(&gateway, &pods).await?;
    step(start, "new simulator Pod served");
    s.turn_on_precise_prefix(&gateway, &pinned).await?;
    step(
        start,
        "precise prefix mode: the tokenizer image mounted, prompts tokenized",
    );
    s.attach_to_an_existing_pool().await?;
    step(start, "a policy attached to the team's own pool serves it");
    s.swap_the_reference_epp_for_ours().await?;
    step(start, "the reference EPP's Deployment switched to ours");
    s.check_printer_columns().await?;
    s.delete_policy().await?;
    step(start, "policy deleted, owned objects collected");
    gateway.envoy.stop().await;
    Ok(())
}

// --------------------------------------------------------------- scenario

struct Scenario {
    client: Client,
    discovery: Discovery,
    /// Helm v4 from the Go module proxy.
    helm: PathBuf,
    kubeconfig: PathBuf,
}

impl Scenario {
    async fn new(cluster: &RealCluster) -> Result<Self> {
        let client = cluster.client();
        let discovery = Discovery::new(client.clone()).run().await?;
        Ok(Self {
            client,
            discovery,
            helm: helm::ensure()?,
            kubeconfig: cluster.kubeconfig_path().to_path_buf(),
        })
    }

    fn pods(&self, ns: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), ns)
    }

    fn policies(&self) -> Api<InferencePolicy> {
        Api::namespaced(self.client.clone(), DEMO_NS)
    }

    /// `helm install` of the chart with `ci/kind-values.yaml`, into a
    /// namespace labelled for the restricted Pod Security standard, as
    /// `e2e/kind.sh` does: the operator Pod becomes Ready and takes the
    /// leader Lease.
    async fn install_operator(&mut self) -> Result<()> {
        self.apply(&json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": { "name": OPERATOR_NS,
                          "labels": { "pod-security.kubernetes.io/enforce": "restricted" } }
        }))
        .await?;
        self.helm(&["install", "--wait"])?;
        // The chart brought the InferencePolicy kind.
        self.discovery = Discovery::new(self.client.clone()).run().await?;
        self.wait_operator_leading().await?;
        Ok(())
    }

    /// `helm <verb> kinference charts/kinference -n kinference-system
    /// --values ci/kind-values.yaml [extra]` against this cluster.
    fn helm(&self, verb_and_extra: &[&str]) -> Result<String> {
        let chart = helm::chart_dir();
        let values = chart.join("ci/kind-values.yaml");
        let (chart, values) = (chart.to_string_lossy(), values.to_string_lossy());
        let kubeconfig = self.kubeconfig.to_string_lossy();
        let (verb, extra) = verb_and_extra.split_first().context("no helm verb")?;
        let mut args = vec![*verb, "kinference", &chart, "--namespace", OPERATOR_NS];
        args.extend(["--values", &values, "--kubeconfig", &kubeconfig]);
        args.extend(extra);
        helm::run(&self.helm, &args)
    }

    /// The operator Pod that is Ready and holds the leader Lease.
    async fn wait_operator_leading(&self) -> Result<Pod> {
        let pod = self
            .wait_ready_pod(OPERATOR_NS, "app.kubernetes.io/name=kinference-operator")
            .await?;
        let holder = eventually("the operator's Lease", || async {
            let lease = Api::<Lease>::namespaced(self.client.clone(), OPERATOR_NS)
                .get_opt(OPERATOR)
                .await?;
            Ok(lease.and_then(|l| l.spec?.holder_identity))
        })
        .await?;
        ensure!(
            holder == pod.name_any(),
            "Lease held by {holder}, not the operator Pod {}",
            pod.name_any()
        );
        Ok(pod)
    }

    /// `helm upgrade` with one value changed (a Pod annotation), while
    /// requests flow: the operator's Deployment rolls to a new Pod, which
    /// takes the Lease; the policy is the same object, still Ready, its EPP
    /// untouched; no request fails (the operator is not on the data path).
    async fn upgrade_operator(&self, gateway: &Gateway) -> Result<()> {
        let before = self.wait_operator_leading().await?;
        let policy = self.policies().get(POLICY).await?;
        let epp = Api::<Deployment>::namespaced(self.client.clone(), DEMO_NS)
            .get(&format!("{POLICY}-epp"))
            .await?;
        let load = Load::start(gateway);
        self.helm(&[
            "upgrade",
            "--set",
            "podAnnotations.kinference\\.io/upgraded=yes",
        ])?;
        let after = eventually("a new operator Pod leading", || async {
            let pod = self.wait_operator_leading().await?;
            let annotated = pod.metadata.annotations.as_ref().is_some_and(|a| {
                a.get("kinference.io/upgraded").map(String::as_str) == Some("yes")
            });
            let only = self
                .pods(OPERATOR_NS)
                .list(&ListParams::default().labels("app.kubernetes.io/name=kinference-operator"))
                .await?
                .items
                .len()
                == 1;
            Ok((annotated && only && pod.name_any() != before.name_any()).then_some(pod))
        })
        .await?;
        self.wait_policy_loaded().await?;
        let answered = Self::expect_no_failure(load, "upgrading the operator").await?;
        let same = self.policies().get(POLICY).await?;
        ensure!(
            same.uid() == policy.uid() && same.metadata.generation == policy.metadata.generation,
            "the policy was replaced or changed by the upgrade"
        );
        let epp_after = Api::<Deployment>::namespaced(self.client.clone(), DEMO_NS)
            .get(&format!("{POLICY}-epp"))
            .await?;
        ensure!(
            epp_after.metadata.generation == epp.metadata.generation,
            "the upgrade rolled the EPP too"
        );
        eprintln!(
            "  helm upgrade: operator {} → {}, policy {POLICY} kept, {answered} requests, none failed",
            before.name_any(),
            after.name_any()
        );
        Ok(())
    }

    /// `kubectl apply -f e2e/kind/`: the simulators roll out, the EPP Pod
    /// loads the policy and discovers them, the policy becomes Ready.
    async fn deploy_scenario(&self) -> Result<()> {
        self.apply_all(&kind_manifests()?).await?;
        let sims = self.ready_sim_pods(2).await?;
        self.wait_policy_loaded().await?;
        self.wait_epp_discovers(&sims).await
    }

    /// The policy is Ready for its current generation, and every EPP Pod
    /// reports the hash in the policy's status; returns that hash.
    async fn wait_policy_loaded(&self) -> Result<String> {
        eventually(
            "the policy Ready with its hash loaded by every EPP Pod",
            || async {
                let policy = self.policies().get(POLICY).await?;
                let generation = policy.metadata.generation;
                let Some(status) = policy.status.as_ref() else {
                    return Ok(None);
                };
                let ready = status.conditions.iter().any(|c| {
                    c.type_ == "Ready" && c.status == "True" && c.observed_generation == generation
                });
                let (Some(hash), true) = (status.policy_hash.clone(), ready) else {
                    return Ok(None);
                };
                let reported = self.epp_reports().await?;
                let epp_pods = self.ready_epp_pods().await?;
                let all_loaded = !epp_pods.is_empty()
                    && epp_pods.iter().all(|p| {
                        reported
                            .get(&p.name_any())
                            .is_some_and(|r| r.loaded_hash == hash)
                    });
                Ok(all_loaded.then_some(hash))
            },
        )
        .await
    }

    /// The EPP status ConfigMap: what each EPP Pod says it has loaded.
    async fn epp_reports(&self) -> Result<BTreeMap<String, EppPodStatus>> {
        let cm = Api::<ConfigMap>::namespaced(self.client.clone(), DEMO_NS)
            .get_opt(&format!("{POLICY}-epp-status"))
            .await?;
        let data = cm.and_then(|c| c.data).unwrap_or_default();
        data.into_iter()
            .map(|(pod, json)| Ok((pod, serde_json::from_str(&json)?)))
            .collect()
    }

    async fn ready_epp_pods(&self) -> Result<Vec<Pod>> {
        let pods = self.epp_pods().await?;
        Ok(pods.into_iter().filter(is_ready).collect())
    }

    /// The policy's EPP Pods, Ready or not.
    async fn epp_pods(&self) -> Result<Vec<Pod>> {
        let list = self
            .pods(DEMO_NS)
            .list(&ListParams::default().labels(&format!(
                "{POLICY_LABEL}={POLICY},app.kubernetes.io/name=kinference-epp"
            )))
            .await?;
        Ok(list.items)
    }

    /// Every EPP Pod's `/metrics` (at its Pod IP) lists exactly `sims` as
    /// its endpoints: it discovered them through the API server.
    async fn wait_epp_discovers(&self, sims: &[Pod]) -> Result<()> {
        let want: BTreeSet<(String, String)> = sims
            .iter()
            .map(|p| (p.name_any(), format!("{}:8000", pod_ip(p))))
            .collect();
        eventually("the EPP to discover the simulator Pods", || async {
            let epps = self.ready_epp_pods().await?;
            let mut all_see = !epps.is_empty();
            for epp in epps {
                let metrics = http_get(&format!("{}:9090", pod_ip(&epp)), "/metrics").await?;
                all_see &= metric_endpoints(&metrics) == want;
            }
            Ok(all_see.then_some(()))
        })
        .await
        .with_context(|| format!("expected endpoints {want:?}"))
    }

    async fn ready_sim_pods(&self, count: usize) -> Result<Vec<Pod>> {
        eventually(&format!("{count} Ready simulator Pods"), || async {
            let pods = self
                .pods(DEMO_NS)
                .list(&ListParams::default().labels(SIM_SELECTOR))
                .await?;
            let ready: Vec<Pod> = pods.items.into_iter().filter(is_ready).collect();
            Ok((ready.len() == count).then_some(ready))
        })
        .await
    }

    async fn wait_ready_pod(&self, ns: &str, selector: &str) -> Result<Pod> {
        eventually(&format!("a Ready Pod {selector} in {ns}"), || async {
            let pods = self
                .pods(ns)
                .list(&ListParams::default().labels(selector))
                .await?;
            Ok(pods.items.into_iter().find(is_ready))
        })
        .await
    }

    /// Objects a user made, with the labels of the policy's objects but not
    /// owned by it: neither the operator's pruning nor the garbage
    /// collector may touch them.
    async fn create_bystanders(&self) -> Result<()> {
        let labels = json!({
            POLICY_LABEL: POLICY,
            "app.kubernetes.io/managed-by": "kinference-operator",
            "app.kubernetes.io/part-of": "kinference",
        });
        let docs = [
            json!({ "apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": { "name": "user-notes", "namespace": DEMO_NS, "labels": labels },
                    "data": { "note": "mine" } }),
            json!({ "apiVersion": "v1", "kind": "Service",
                    "metadata": { "name": "user-service", "namespace": DEMO_NS, "labels": labels },
                    "spec": { "ports": [{ "port": 80 }] } }),
        ];
        self.apply_all(&docs).await
    }

    /// Apply a policy pinned to `target` while requests flow: none may fail,
    /// and once the EPP has loaded it, requests take the new rule to `target`.
    async fn edit_policy_under_load(&self, gateway: &Gateway, target: &str) -> Result<()> {
        let load = Load::start(gateway);
        self.apply_all(&[pinned_policy(target)?]).await?;
        self.wait_policy_loaded().await?;
        let after = gateway.send_many(5).await?;
        let during = load.stop().await?;
        let failed: Vec<&Sent> = during.iter().filter(|s| s.status != 200).collect();
        ensure!(
            failed.is_empty(),
            "{} of {} requests failed during the edit: {failed:?}",
            failed.len(),
            during.len()
        );
        eprintln!("  {} requests during the edit, all 200", during.len());
        for sent in &after {
            gateway.expect_served(sent, "pinned", target).await?;
        }
        Ok(())
    }

    /// Delete the EPP Pod while requests flow: its Deployment makes another,
    /// which loads the (edited) policy, and requests succeed again. Requests
    /// sent while no EPP Pod is Ready may fail: the pool fails closed.
    async fn replace_epp_pod(&self, gateway: &Gateway, pinned: &str) -> Result<()> {
        let old = self.ready_epp_pods().await?;
        ensure!(old.len() == 1, "expected one EPP Pod, found {}", old.len());
        let old_name = old[0].name_any();
        let load = Load::start(gateway);
        self.pods(DEMO_NS)
            .delete(&old_name, &DeleteParams::default())
            .await?;
        eventually("a new EPP Pod", || async {
            let pods = self.ready_epp_pods().await?;
            Ok(pods.iter().any(|p| p.name_any() != old_name).then_some(()))
        })
        .await?;
        self.wait_policy_loaded().await?;
        let resumed = eventually("requests to succeed again", || async {
            let sent = gateway.send().await?;
            if sent.status == 200 {
                return Ok(Some(sent));
            }
            // An error, so that a timeout reports the last answer.
            let record = gateway.envoy.access(&sent.id);
            Err(anyhow!(
                "the last request got {}: {} ({record:?})",
                sent.status,
                sent.body
            ))
        })
        .await;
        let resumed = match resumed {
            Ok(sent) => sent,
            Err(e) => return Err(e.context(gateway.state().await)),
        };
        gateway.expect_served(&resumed, "pinned", pinned).await?;
        let during = load.stop().await?;
        let failed = during.iter().filter(|s| s.status != 200).count();
        ensure!(
            during.last().is_some_and(|s| s.status == 200),
            "the load's requests did not resume: {:?}",
            during.last()
        );
        eprintln!(
            "  replaced EPP Pod {old_name}: {failed} of {} requests failed meanwhile",
            during.len()
        );
        Ok(())
    }

    /// Two EPP replicas behind Envoy, a steady stream of requests, and
    /// every disruption an SRE causes on purpose: one replica deleted (it
    /// turns not Ready, keeps serving while the Service moves, then drains),
    /// one evicted through the PodDisruptionBudget (which then allows no
    /// other until the replacement is Ready), and a rolling update of the Deployment (a policy
    /// setting that changes the Pod template). Each must fail no request;
    /// each waits until the old Pod is gone, so its whole drain is counted.
    async fn lose_epp_replicas_under_load(&self, gateway: &Gateway, pinned: &str) -> Result<()> {
        let mut policy = pinned_policy(pinned)?;
        policy["spec"]["endpointPicker"]["replicas"] = json!(2);
        self.apply_all(&[policy.clone()]).await?;
        let pods = self.wait_epp_replicas(2, &[]).await?;
        gateway.wait_until_serving().await?;

        let deleted = pods[0].name_any();
        let load = Load::start(gateway);
        self.pods(DEMO_NS)
            .delete(&deleted, &DeleteParams::default())
            .await?;
        let pods = self.wait_epp_replicas(2, &[&deleted]).await?;
        let deletion = Self::expect_no_failure(load, "deleting an EPP replica").await?;

        let load = Load::start(gateway);
        let evicted = pods[0].name_any();
        let evictions = self.pods(DEMO_NS);
        // The disruption controller computes the budget once both are Ready.
        eventually("the budget to allow one eviction", || async {
            match evictions.evict(&evicted, &EvictParams::default()).await {
                Ok(_) => Ok(Some(())),
                Err(e) => Err(anyhow!("evicting {evicted}: {e}")),
            }
        })
        .await?;
        // What `kubectl drain` reads before its next eviction: none allowed
        // while the evicted replica is down.
        let budgets = Api::<PodDisruptionBudget>::namespaced(self.client.clone(), DEMO_NS);
        let budget = budgets.get(&format!("{POLICY}-epp")).await?.status;
        ensure!(
            budget
                .as_ref()
                .is_some_and(|b| b.disruptions_allowed == Some(0)),
            "the budget after one eviction: {budget:?}"
        );
        self.wait_epp_replicas(2, &[&evicted]).await?;
        let eviction = Self::expect_no_failure(load, "evicting an EPP replica").await?;

        let load = Load::start(gateway);
        policy["spec"]["endpointPicker"]["scrapeInterval"] = json!("100ms");
        self.apply_all(&[policy]).await?;
        let rolled = eventually("the EPP rolled out with the new template", || async {
            let pods = self.epp_pods().await?;
            let new = |p: &Pod| {
                p.spec.as_ref().is_some_and(|s| {
                    s.containers[0]
                        .args
                        .iter()
                        .flatten()
                        .any(|a| a == "--scrape-interval-ms=100")
                })
            };
            let done = pods.len() == 2 && pods.iter().all(|p| new(p) && is_ready(p));
            Ok(done.then_some(pods))
        })
        .await?;
        let names: Vec<String> = rolled.iter().map(ResourceExt::name_any).collect();
        self.wait_epp_replicas(2, &[]).await?;
        let rollout = Self::expect_no_failure(load, "a rolling update of the EPP").await?;

        // A crash: SIGKILL to one replica's process (as the OOM killer
        // sends it). Its container restarts in place; requests resume.
        let load = Load::start(gateway);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let victim = rolled[0].name_any();
        kill_epp_process(&victim)?;
        eventually("the killed EPP restarted and Ready", || async {
            let pod = self.pods(DEMO_NS).get(&victim).await?;
            let restarted = pod
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.restart_count >= 1));
            Ok((restarted && is_ready(&pod)).then_some(()))
        })
        .await?;
        self.wait_epp_replicas(2, &[]).await?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let sent = load.stop().await?;
        let failed = sent.iter().filter(|s| s.status != 200).count();
        let tail = &sent[sent.len().saturating_sub(10)..];
        ensure!(
            tail.iter().all(|s| s.status == 200),
            "requests did not resume after the SIGKILL: {tail:?}"
        );
        eprintln!(
            "  two EPP replicas, requests answered / failed: deletion {deletion}/0, \
             eviction {eviction}/0 (the budget then allowing none), rolling update \
             {rollout}/0 (now {names:?}), SIGKILL of {victim}: {}/{failed}",
            sent.len()
        );
        Ok(())
    }

    /// Waits until the policy's EPP has exactly `count` Pods, all Ready and
    /// serving the policy's hash, none of them named in `gone`.
    async fn wait_epp_replicas(&self, count: usize, gone: &[&str]) -> Result<Vec<Pod>> {
        let pods = eventually(&format!("{count} EPP replicas"), || async {
            let pods = self.epp_pods().await?;
            let settled = pods.len() == count
                && pods.iter().all(is_ready)
                && pods.iter().all(|p| !gone.contains(&p.name_any().as_str()));
            Ok(settled.then_some(pods))
        })
        .await?;
        self.wait_policy_loaded().await?;
        Ok(pods)
    }

    /// Stops `load`; fails unless every request was answered 200. Returns
    /// how many were sent.
    async fn expect_no_failure(load: Load, what: &str) -> Result<usize> {
        let sent = load.stop().await?;
        let failed: Vec<&Sent> = sent.iter().filter(|s| s.status != 200).collect();
        ensure!(
            failed.is_empty(),
            "{what}: {} of {} requests failed: {failed:?}",
            failed.len(),
            sent.len()
        );
        Ok(sent.len())
    }

    /// Scale the simulators to 3: the EPP discovers the new Pod, and a
    /// policy pinned to it sends traffic there. Returns that Pod's name.
    async fn scale_simulators(&self, gateway: &Gateway, before: &[Pod]) -> Result<String> {
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), DEMO_NS);
        deployments
            .patch(
                SIM,
                &PatchParams::default(),
                &Patch::Merge(json!({ "spec": { "replicas": 3 } })),
            )
            .await?;
        let sims = self.ready_sim_pods(3).await?;
        self.wait_epp_discovers(&sims).await?;
        let old: BTreeSet<String> = before.iter().map(ResourceExt::name_any).collect();
        let new = sims
            .iter()
            .map(ResourceExt::name_any)
            .find(|n| !old.contains(n))
            .context("no new simulator Pod")?;
        self.apply_all(&[pinned_policy(&new)?]).await?;
        self.wait_policy_loaded().await?;
        let sent = gateway.send().await?;
        gateway.expect_served(&sent, "pinned", &new).await?;
        Ok(new)
    }

    /// Turn on precise prefix mode with the Qwen3 tokenizer image: the
    /// operator rolls the EPP out with the image as a volume, the kubelet
    /// mounts it (containerd 2.1+), the EPP loads the 11 MB tokenizer from
    /// it at start and tokenizes the prompts of requests through the
    /// gateway. The simulators publish no KV events, so precise mode knows
    /// each of them as `empty` and routing is unchanged.
    async fn turn_on_precise_prefix(&self, gateway: &Gateway, pinned: &str) -> Result<()> {
        let mut policy = pinned_policy(pinned)?;
        policy["spec"]["endpointPicker"]["precisePrefix"] = json!({
            "tokenizer": { "image": TOKENIZER_IMAGE, "path": TOKENIZER_PATH },
            // Debug builds tokenize a short prompt in milliseconds, not
            // microseconds: the default 5ms budget could refuse some.
            "tokenizeBudget": "1s",
        });
        self.apply_all(&[policy]).await?;
        let epp = eventually("one EPP Pod, Ready, with the tokenizer volume", || async {
            let mut all = self.epp_pods().await?;
            let only = (all.len() == 1).then(|| all.remove(0));
            Ok(only.filter(|p| is_ready(p) && tokenizer_volume(p).is_some()))
        })
        .await?;
        let (reference, sub_path) = tokenizer_volume(&epp).context("no tokenizer volume")?;
        ensure!(
            reference == TOKENIZER_IMAGE && sub_path.as_deref() == Some(TOKENIZER_PATH),
            "the EPP Pod mounts {reference} at {sub_path:?}"
        );
        self.wait_policy_loaded().await?;
        gateway.wait_until_serving().await?;
        let sent = gateway.send_many(3).await?;
        for sent in &sent {
            gateway.expect_served(sent, "pinned", pinned).await?;
        }
        let metrics = http_get(&format!("{}:9090", pod_ip(&epp)), "/metrics").await?;
        let tokenized = metric_value(
            &metrics,
            "kinference_epp_prompt_tokenizations_total{outcome=\"ok\"}",
        )
        .unwrap_or(0.0);
        ensure!(
            tokenized >= sent.len() as f64,
            "{tokenized} prompts tokenized by {} after {} requests:\n{}",
            epp.name_any(),
            sent.len(),
            metrics
                .lines()
                .filter(|l| l.contains("tokeniz") || l.contains("kv_events"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        let sims = self.ready_sim_pods(3).await?;
        for sim in &sims {
            let line = format!(
                "kinference_epp_kv_events_index{{endpoint=\"{}\",address=\"{}:8000\",state=\"empty\"}}",
                sim.name_any(),
                pod_ip(sim)
            );
            ensure!(
                metric_value(&metrics, &line) == Some(1.0),
                "no `{line} 1` in the EPP's metrics"
            );
        }
        eprintln!(
            "  {} mounted {TOKENIZER_IMAGE}, tokenized {tokenized} prompts",
            epp.name_any()
        );
        Ok(())
    }

    /// A team's own InferencePool (its EPP named `attached-epp`) and a policy
    /// attached to it with `targetRefs`: the operator rolls out the policy's
    /// EPP only, which reads the pool under its narrow Role (list and watch
    /// of that one pool), discovers the simulators by the pool's selector,
    /// and loads the policy; the policy is Ready; the pool is never written.
    async fn attach_to_an_existing_pool(&self) -> Result<()> {
        const ATTACHED: &str = "attached";
        const TEAM_POOL: &str = "team-pool";
        let pool = json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": { "name": TEAM_POOL, "namespace": DEMO_NS },
            "spec": {
                "selector": { "matchLabels": { "app": SIM } },
                "targetPorts": [{ "number": 8000 }],
                "endpointPickerRef": { "name": format!("{ATTACHED}-epp"), "port": { "number": 9002 } }
            }
        });
        let policy = json!({
            "apiVersion": "kinference.io/v1alpha1",
            "kind": "InferencePolicy",
            "metadata": { "name": ATTACHED, "namespace": DEMO_NS },
            "spec": {
                "targetRefs": [{ "group": "inference.networking.k8s.io", "kind": "InferencePool", "name": TEAM_POOL }],
                "rules": [{ "name": "least-queued", "route": { "select": [{ "minimize": "QueueDepth" }] } }]
            }
        });
        self.apply_all(&[pool, policy]).await?;
        let policies = self.policies();
        eventually("the attached policy Ready", || async {
            let policy = policies.get(ATTACHED).await?;
            let generation = policy.metadata.generation;
            let ready = policy.status.as_ref().and_then(|s| {
                s.conditions
                    .iter()
                    .find(|c| c.type_ == "Ready" && c.observed_generation == generation)
                    .cloned()
            });
            match ready {
                Some(c) if c.status == "True" => Ok(Some(())),
                other => Err(anyhow!("Ready is {other:?}")),
            }
        })
        .await?;
        let sims = self.ready_sim_pods(3).await?;
        let want: BTreeSet<(String, String)> = sims
            .iter()
            .map(|p| (p.name_any(), format!("{}:8000", pod_ip(p))))
            .collect();
        let selector = format!("{POLICY_LABEL}={ATTACHED},app.kubernetes.io/name=kinference-epp");
        let epp = self.wait_ready_pod(DEMO_NS, &selector).await?;
        eventually("the attached EPP to discover the pool's Pods", || async {
            let metrics = http_get(&format!("{}:9090", pod_ip(&epp)), "/metrics").await?;
            let seen = metric_endpoints(&metrics);
            if seen == want {
                return Ok(Some(()));
            }
            Err(anyhow!("the attached EPP sees {seen:?}, not {want:?}"))
        })
        .await?;
        let pools = Api::<DynamicObject>::namespaced_with(
            self.client.clone(),
            DEMO_NS,
            &ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool"),
                "inferencepools",
            ),
        );
        let managers = kinference_e2e::field_managers(&pools.get(TEAM_POOL).await?.metadata);
        ensure!(
            managers == [FIELD_MANAGER],
            "the team's pool was written by {managers:?}"
        );
        policies.delete(ATTACHED, &DeleteParams::default()).await?;
        pools.delete(TEAM_POOL, &DeleteParams::default()).await?;
        eprintln!(
            "  {} serves {TEAM_POOL} for policy {ATTACHED}: {} endpoints",
            epp.name_any(),
            want.len()
        );
        Ok(())
    }

    /// A pool served the way the Inference Extension's chart serves it: the
    /// reference EPP (v1.5.0, built from the Go module proxy, as an image)
    /// in a Deployment with the chart's ports, probes and Role, behind its
    /// own Envoy. Under a steady stream of requests the Deployment's image
    /// and arguments are switched to ours (`--pool-name`, nothing else):
    /// the default rolling update replaces the Pod; once ours answers (it
    /// names its rule), no request fails. The ones that fail before are the
    /// reference Pod's at its shutdown (counted and printed).
    async fn swap_the_reference_epp_for_ours(&self) -> Result<()> {
        let docs = reference_epp_manifests()?;
        self.apply_all(&docs).await?;
        let selector = "app=vllm-epp";
        let reference = self.wait_ready_pod(DEMO_NS, selector).await?;
        let service = Api::<Service>::namespaced(self.client.clone(), DEMO_NS)
            .get(REFERENCE_EPP)
            .await?;
        let ip = service
            .spec
            .and_then(|s| s.cluster_ip)
            .context("the reference EPP's Service has no ClusterIP")?;
        let gateway = Gateway::in_front_of(SocketAddr::new(ip.parse()?, 9002)).await?;
        gateway.wait_until_serving().await?;
        let before = gateway.send().await?;
        let record = gateway.access(&before).await?;
        ensure!(
            before.status == 200 && record.rule.is_none(),
            "the reference EPP's answer: {} {record:?}",
            before.status
        );

        let load = Load::start(&gateway);
        let switch = json!({ "spec": { "template": { "spec": { "containers": [{
            "name": "epp",
            "image": workspace_images::EPP.reference,
            "args": ["--pool-name", REFERENCE_POOL, "--pool-namespace", DEMO_NS],
        }] } } } });
        Api::<Deployment>::namespaced(self.client.clone(), DEMO_NS)
            .patch(
                REFERENCE_EPP,
                &PatchParams::default(),
                &Patch::Strategic(switch),
            )
            .await?;
        let ours = eventually("our EPP to replace the reference's", || async {
            let pods = self
                .pods(DEMO_NS)
                .list(&ListParams::default().labels(selector))
                .await?
                .items;
            let ours = |p: &Pod| {
                p.spec.as_ref().is_some_and(|s| {
                    s.containers[0].image.as_deref() == Some(workspace_images::EPP.reference)
                })
            };
            let done = pods.len() == 1 && ours(&pods[0]) && is_ready(&pods[0]);
            Ok(done.then(|| pods[0].clone()))
        })
        .await?;
        let sent = load.stop().await?;
        // Which EPP answered each: ours names its rule.
        let mut ours_from = None;
        for (i, one) in sent.iter().enumerate() {
            let record = gateway.access(one).await?;
            if one.status == 200 && record.rule.is_some() && ours_from.is_none() {
                ours_from = Some(i);
            }
        }
        let ours_from =
            ours_from.context("no request was answered by our EPP during the switch")?;
        let failed: Vec<usize> = (0..sent.len()).filter(|&i| sent[i].status != 200).collect();
        // The reference's gRPC server stops listening at SIGTERM, while the
        // Service still sends it new connections for a moment: those
        // requests fail (FailClose). Once ours answers, none may.
        ensure!(
            failed.iter().all(|&i| i < ours_from),
            "requests failed after our EPP took over: {:?} (ours from #{ours_from})",
            failed.iter().map(|&i| &sent[i]).collect::<Vec<_>>()
        );
        let after = gateway.send_many(3).await?;
        for sent in &after {
            let record = gateway.access(sent).await?;
            ensure!(
                sent.status == 200 && record.rule.as_deref() == Some("default"),
                "after the switch: {} {record:?}",
                sent.status
            );
        }
        gateway.envoy.stop().await;
        Api::<Deployment>::namespaced(self.client.clone(), DEMO_NS)
            .delete(REFERENCE_EPP, &DeleteParams::default())
            .await?;
        eprintln!(
            "  {} (reference v1.5.0) replaced by {} (ours): {} requests, {} failed, all before ours answered",
            reference.name_any(),
            ours.name_any(),
            sent.len(),
            failed.len()
        );
        Ok(())
    }

    /// `kubectl get inferencepolicy`: the CRD's printer columns, as the API
    /// server computes them (a Table request).
    async fn check_printer_columns(&self) -> Result<()> {
        let request = http::Request::get(format!(
            "/apis/kinference.io/v1alpha1/namespaces/{DEMO_NS}/inferencepolicies"
        ))
        .header("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
        .body(Vec::new())?;
        let table: Value = self.client.request(request).await?;
        let columns: Vec<&str> = table["columnDefinitions"]
            .as_array()
            .context("no columnDefinitions")?
            .iter()
            .filter_map(|c| c["name"].as_str())
            .collect();
        ensure!(
            columns == ["Name", "Accepted", "Ready", "Pool", "Rules", "Age"],
            "columns {columns:?}"
        );
        let cells = &table["rows"][0]["cells"];
        let policy = self.policies().get(POLICY).await?;
        let status = policy.status.context("no status")?;
        let want = json!([POLICY, "True", "True", status.pool, status.rules]);
        let got = json!([cells[0], cells[1], cells[2], cells[3], cells[4]]);
        ensure!(got == want, "printer columns {got} != {want}");
        eprintln!("  kubectl get inferencepolicy: {columns:?} {cells}");
        Ok(())
    }

    /// Delete the policy: the garbage collector removes every object it
    /// owned (and what those own: ReplicaSets, Pods); the bystanders stay.
    async fn delete_policy(&self) -> Result<()> {
        let bystanders = self.bystander_uids().await?;
        let owned = self.labelled_objects().await?;
        let owned: BTreeSet<String> = owned
            .into_iter()
            .filter(|(_, uid)| !bystanders.values().any(|b| b == uid))
            .map(|(name, _)| name)
            .collect();
        for kind in [
            "Deployment",
            "Service",
            "ConfigMap",
            "InferencePool",
            "HTTPRoute",
            "Role",
        ] {
            ensure!(
                owned.iter().any(|o| o.starts_with(&format!("{kind}/"))),
                "no {kind} of the policy among {owned:?}"
            );
        }
        self.policies()
            .delete(POLICY, &DeleteParams::default())
            .await?;
        eventually(
            "the garbage collector to remove the policy's objects",
            || async {
                let left: Vec<String> = self
                    .labelled_objects()
                    .await?
                    .into_iter()
                    .filter(|(_, uid)| !bystanders.values().any(|b| b == uid))
                    .map(|(name, _)| name)
                    .collect();
                Ok(left.is_empty().then_some(()))
            },
        )
        .await?;
        ensure!(
            self.bystander_uids().await? == bystanders,
            "a user object with the policy's labels was deleted or replaced"
        );
        eprintln!("  collected: {owned:?}");
        Ok(())
    }

    /// The one object of `kind` (in `group`, preferred version) labelled
    /// with the policy's name.
    async fn only_labelled(&self, group: &str, kind: &str) -> Result<Value> {
        let (resource, _) = self
            .discovery
            .groups()
            .filter(|g| g.name() == group)
            .flat_map(|g| g.recommended_resources())
            .find(|(r, _)| r.kind == kind)
            .with_context(|| format!("the API server does not serve {kind}"))?;
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), DEMO_NS, &resource);
        let params = ListParams::default().labels(&format!("{POLICY_LABEL}={POLICY}"));
        let mut items = api.list(&params).await?.items;
        ensure!(
            items.len() == 1,
            "expected one {kind} of the policy, found {}",
            items.len()
        );
        Ok(serde_json::to_value(items.remove(0))?)
    }

    async fn bystander_uids(&self) -> Result<BTreeMap<String, String>> {
        let mut uids = BTreeMap::new();
        let cm = Api::<ConfigMap>::namespaced(self.client.clone(), DEMO_NS)
            .get("user-notes")
            .await?;
        uids.insert("ConfigMap/user-notes".into(), cm.uid().unwrap_or_default());
        let svc = Api::<Service>::namespaced(self.client.clone(), DEMO_NS)
            .get("user-service")
            .await?;
        uids.insert("Service/user-service".into(), svc.uid().unwrap_or_default());
        Ok(uids)
    }

    /// `Kind/name` and UID of every object in the demo namespace, of every
    /// listable kind, labelled with the policy's name.
    async fn labelled_objects(&self) -> Result<Vec<(String, String)>> {
        let params = ListParams::default().labels(&format!("{POLICY_LABEL}={POLICY}"));
        let mut found = Vec::new();
        for group in self.discovery.groups() {
            for (resource, caps) in group.recommended_resources() {
                if caps.scope != Scope::Namespaced || !caps.supports_operation(verbs::LIST) {
                    continue;
                }
                let api: Api<DynamicObject> =
                    Api::namespaced_with(self.client.clone(), DEMO_NS, &resource);
                for object in api.list(&params).await?.items {
                    found.push((
                        format!("{}/{}", resource.kind, object.name_any()),
                        object.uid().unwrap_or_default(),
                    ));
                }
            }
        }
        Ok(found)
    }

    /// Server-side apply with strict field validation, Namespaces first.
    async fn apply_all(&self, docs: &[Value]) -> Result<()> {
        let mut ordered: Vec<&Value> = docs.iter().collect();
        ordered.sort_by_key(|d| d["kind"] != "Namespace");
        for doc in ordered {
            self.apply(doc).await?;
        }
        Ok(())
    }

    async fn apply(&self, doc: &Value) -> Result<()> {
        let api_version = doc["apiVersion"].as_str().unwrap_or_default();
        let kind = doc["kind"].as_str().unwrap_or_default();
        let name = doc["metadata"]["name"].as_str().unwrap_or_default();
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        let (resource, caps) = self
            .discovery
            .resolve_gvk(&GroupVersionKind::gvk(group, version, kind))
            .ok_or_else(|| anyhow!("the API server does not serve {api_version} {kind}"))?;
        let api: Api<DynamicObject> = match (caps.scope, doc["metadata"]["namespace"].as_str()) {
            (Scope::Namespaced, Some(ns)) => {
                Api::namespaced_with(self.client.clone(), ns, &resource)
            }
            (Scope::Namespaced, None) => bail!("{kind} {name} names no namespace"),
            (Scope::Cluster, _) => Api::all_with(self.client.clone(), &resource),
        };
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            field_validation: Some(ValidationDirective::Strict),
            ..PatchParams::default()
        };
        api.patch(name, &params, &Patch::Apply(doc))
            .await
            .with_context(|| format!("applying {kind} {name}"))?;
        Ok(())
    }
}

// ---------------------------------------------------------------- gateway

/// Real Envoy on the host with the Inference Extension's reference
/// configuration, standing in for the Gateway (agentgateway cannot run
/// here): ext_proc to the EPP Service's ClusterIP (through kube-proxy), and
/// the chosen Pod dialled at its IP.
struct Gateway {
    envoy: Envoy,
    /// The EPP Service's ClusterIP and port, as Envoy dials it.
    epp: SocketAddr,
    request: SmokeRequest,
}

impl Gateway {
    async fn start(s: &Scenario) -> Result<Self> {
        let epp = epp_address(s).await?;
        let bootstrap = Bootstrap::new(Template::Streamed, epp);
        check_gateway_config(s, &bootstrap, epp).await?;
        Self::with_bootstrap(&bootstrap, epp).await
    }

    /// Envoy in front of the EPP at `epp` (a Service's ClusterIP and port).
    async fn in_front_of(epp: SocketAddr) -> Result<Self> {
        Self::with_bootstrap(&Bootstrap::new(Template::Streamed, epp), epp).await
    }

    async fn with_bootstrap(bootstrap: &Bootstrap, epp: SocketAddr) -> Result<Self> {
        wait_service_programmed(epp).await?;
        let envoy = Envoy::start(bootstrap).await?;
        Ok(Self {
            envoy,
            epp,
            request: SmokeRequest::read()?,
        })
    }

    /// Envoy reaches the EPP through its Service's ClusterIP, which kube-proxy
    /// routes only after the EPP Pod is Ready and the next iptables sync, a
    /// second or two after the policy turned Ready (the EPP reports its hash
    /// before its readiness probe passes). Until then Envoy answers 500
    /// (failure mode FailClose): wait for the first answer that is not.
    async fn wait_until_serving(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let sent = self.send().await?;
            if sent.status != 500 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                // Why Envoy could not reach the EPP: its ext_proc cluster's
                // connection counters and log, and what the ClusterIP's
                // rules were.
                bail!(
                    "Envoy still answers 500 after 60 s: {:?} ({:?})\n{}\n{}",
                    sent.body,
                    self.envoy.access(&sent.id),
                    self.state().await,
                    service_rules(self.epp)
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The kind request, answered as `smoke-request.env` says, by the Pod
    /// whose address the EPP put in the destination header.
    async fn smoke_request(&self, sims: &[Pod]) -> Result<()> {
        let sent = self.send().await?;
        ensure!(
            sent.status == self.request.status,
            "status {} (expected {}): {}",
            sent.status,
            self.request.status,
            sent.body
        );
        let answer: Value = serde_json::from_str(&sent.body)?;
        ensure!(
            answer["object"] == self.request.object && answer["model"] == self.request.model,
            "unexpected answer: {answer}"
        );
        let chosen = self.access(&sent).await?;
        let pod = sims
            .iter()
            .find(|p| chosen.destination_header.as_deref() == Some(&format!("{}:8000", pod_ip(p))))
            .with_context(|| format!("the EPP chose no simulator Pod: {chosen:?}"))?;
        self.expect_served(&sent, &self.request.rule, &pod.name_any())
            .await?;
        eprintln!(
            "  {} → rule {}, Pod {}",
            self.request.path,
            self.request.rule,
            pod.name_any()
        );
        Ok(())
    }

    /// `sent` was a 200 that took `rule` and was served by Pod `pod`.
    async fn expect_served(&self, sent: &Sent, rule: &str, pod: &str) -> Result<()> {
        let record = self.access(sent).await?;
        ensure!(
            sent.status == 200 && record.rule.as_deref() == Some(rule) && sent.server == pod,
            "expected a 200 by rule {rule} from {pod}; got {} from {:?} ({record:?})",
            sent.status,
            sent.server
        );
        Ok(())
    }

    /// Envoy's access record of `sent` (flushed every 50 ms).
    async fn access(&self, sent: &Sent) -> Result<AccessRecord> {
        for _ in 0..100 {
            if let Some(record) = self.envoy.access(&sent.id) {
                return Ok(record);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!(
            "no access record for {}:\n{}",
            sent.id,
            self.envoy.access_log_text()
        )
    }

    async fn send(&self) -> Result<Sent> {
        send(self.envoy.listener(), &self.request).await
    }

    /// Envoy's log and its connections to the EPP, for failure reports.
    async fn state(&self) -> String {
        let clusters = self
            .envoy
            .admin_get("/clusters")
            .await
            .unwrap_or_else(|e| format!("{e:#}"));
        let epp: Vec<&str> = clusters
            .lines()
            .filter(|l| l.starts_with("epp::"))
            .collect();
        let stats = self
            .envoy
            .admin_get("/stats?filter=cluster.epp.upstream_")
            .await
            .unwrap_or_else(|e| format!("{e:#}"));
        format!(
            "Envoy's epp cluster:\n{}\n{stats}\nWho answers at {} (curl):\n{}\nconntrack:\n{}\nEnvoy's log:\n{}",
            epp.join("\n"),
            self.epp,
            probe_ext_proc(self.epp),
            conntrack_of(self.epp),
            self.envoy.log_tail()
        )
    }

    async fn send_many(&self, n: usize) -> Result<Vec<Sent>> {
        let mut all = Vec::with_capacity(n);
        for _ in 0..n {
            all.push(self.send().await?);
        }
        Ok(all)
    }
}

/// Sends SIGKILL to the EPP process of Pod `pod` (found by the `POD_NAME`
/// its container's environment carries; the node's containers are this
/// host's processes).
fn kill_epp_process(pod: &str) -> Result<()> {
    let want = format!("POD_NAME={pod}");
    for entry in std::fs::read_dir("/proc")? {
        let dir = entry?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim() != "kinference-epp" {
            continue;
        }
        let environ = std::fs::read(dir.join("environ")).unwrap_or_default();
        if environ.split(|b| *b == 0).any(|v| v == want.as_bytes()) {
            let pid = dir
                .file_name()
                .context("pid")?
                .to_string_lossy()
                .into_owned();
            let status = std::process::Command::new("kill")
                .args(["-KILL", &pid])
                .status()?;
            ensure!(status.success(), "kill -KILL {pid}: {status}");
            return Ok(());
        }
    }
    bail!("no kinference-epp process of Pod {pod}")
}

/// One ext_proc call by curl (TLS, HTTP/2) to `epp`: the certificate and
/// the answer's status line and headers say which server took it.
fn probe_ext_proc(epp: SocketAddr) -> String {
    let out = std::process::Command::new("curl")
        .args([
            "-sk",
            "-v",
            "--http2",
            "--max-time",
            "3",
            "-o",
            "/dev/null",
            "-X",
            "POST",
        ])
        .args(["-H", "content-type: application/grpc", "-H", "te: trailers"])
        .arg(format!(
            "https://{epp}/envoy.service.ext_proc.v3.ExternalProcessor/Process"
        ))
        .output();
    match out {
        Ok(out) => String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter(|l| l.starts_with("< ") || l.contains("subject:") || l.contains("issuer:"))
            .collect::<Vec<_>>()
            .join("\n"),
        Err(e) => format!("curl: {e}"),
    }
}

/// The kernel's connection tracking entries for `epp` (where kube-proxy's
/// DNAT sent each connection).
fn conntrack_of(epp: SocketAddr) -> String {
    let ip = epp.ip().to_string();
    match std::fs::read_to_string("/proc/net/nf_conntrack") {
        Ok(text) => text
            .lines()
            .filter(|l| l.contains(&ip))
            .take(20)
            .collect::<Vec<_>>()
            .join("\n"),
        Err(e) => format!("/proc/net/nf_conntrack: {e}"),
    }
}

/// kube-proxy's iptables rules that mention the EPP Service (its ClusterIP
/// or its name), for an error message.
fn service_rules(epp: SocketAddr) -> String {
    let ip = epp.ip().to_string();
    let mut rules = String::from("iptables rules of the EPP Service:\n");
    for table in ["nat", "filter"] {
        match std::process::Command::new("iptables-save")
            .args(["-t", table])
            .output()
        {
            Ok(out) => String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.contains(&ip) || l.contains("chat-epp"))
                .for_each(|l| {
                    rules.push_str(l);
                    rules.push('\n');
                }),
            Err(e) => rules.push_str(&format!("iptables-save -t {table}: {e}\n")),
        }
    }
    rules
}

/// Waits until kube-proxy has rules sending `epp` (a ClusterIP and port) to
/// an endpoint. Until then a connection to the ClusterIP is not translated
/// and leaves by the host's default route: on a VM whose network has a
/// host at that address, Envoy kept that stranger as its ext_proc
/// connection (every stream answered 404, gRPC 12) for the whole test.
async fn wait_service_programmed(epp: SocketAddr) -> Result<()> {
    let (ip, port) = (epp.ip().to_string(), epp.port().to_string());
    eventually(&format!("kube-proxy's rules for {epp}"), || async {
        let out = tokio::process::Command::new("iptables-save")
            .args(["-t", "nat"])
            .output()
            .await?;
        let rules = String::from_utf8_lossy(&out.stdout);
        let service_chain = rules.lines().find_map(|l| {
            let matches = l.contains(&format!("-d {ip}/32"))
                && l.contains(&format!("--dport {port}"))
                && l.contains("-j KUBE-SVC-");
            matches.then(|| {
                l.rsplit("-j ")
                    .next()
                    .unwrap_or_default()
                    .trim()
                    .to_string()
            })
        });
        let programmed = service_chain.is_some_and(|chain| {
            rules
                .lines()
                .any(|l| l.starts_with(&format!("-A {chain} ")) && l.contains("-j KUBE-SEP-"))
        });
        Ok(programmed.then_some(()))
    })
    .await
}

/// The EPP as the InferencePool names it: its Service's ClusterIP and the
/// pool's `endpointPickerRef` port.
async fn epp_address(s: &Scenario) -> Result<SocketAddr> {
    let pool = inference_pool(s).await?;
    let picker = &pool["spec"]["endpointPickerRef"];
    let name = picker["name"].as_str().context("endpointPickerRef.name")?;
    let port = picker["port"]["number"]
        .as_u64()
        .context("endpointPickerRef.port")?;
    let service = Api::<Service>::namespaced(s.client.clone(), DEMO_NS)
        .get(name)
        .await?;
    let ip: IpAddr = service
        .spec
        .and_then(|s| s.cluster_ip)
        .context("EPP Service without ClusterIP")?
        .parse()?;
    Ok(SocketAddr::new(ip, u16::try_from(port)?))
}

/// The InferencePool the policy's status names.
async fn inference_pool(s: &Scenario) -> Result<Value> {
    let policy = s.policies().get(POLICY).await?;
    let name = policy
        .status
        .and_then(|st| st.pool)
        .context("no pool in the policy's status")?;
    let pool = s
        .only_labelled("inference.networking.k8s.io", "InferencePool")
        .await?;
    ensure!(
        pool["metadata"]["name"] == name,
        "the policy names pool {name}, not {}",
        pool["metadata"]["name"]
    );
    Ok(pool)
}

/// The Envoy configuration used in place of agentgateway implements what
/// the cluster's objects ask of a gateway: ext_proc to the pool's EPP over
/// TLS (the EPP's default), failing closed as the pool says, the pool
/// reached at the address the EPP picks, and the HTTPRoute's path routed.
async fn check_gateway_config(s: &Scenario, bootstrap: &Bootstrap, epp: SocketAddr) -> Result<()> {
    let pool = inference_pool(s).await?;
    let config = yaml_documents_to_json(&bootstrap.render(Path::new("/dev/null")))?
        .pop()
        .context("empty bootstrap")?;
    let hcm = &config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let ext_proc = hcm["http_filters"]
        .as_array()
        .and_then(|f| {
            f.iter()
                .find(|f| f["name"] == "envoy.filters.http.ext_proc")
        })
        .context("no ext_proc filter")?;
    let fail_open = pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen";
    ensure!(
        ext_proc["typed_config"]["failure_mode_allow"] == fail_open,
        "ext_proc failure_mode_allow must be {fail_open}"
    );
    let clusters = config["static_resources"]["clusters"]
        .as_array()
        .context("no clusters")?;
    let cluster = |name: &str| {
        clusters
            .iter()
            .find(|c| c["name"] == name)
            .cloned()
            .unwrap_or_default()
    };
    let epp_cluster = cluster("epp");
    let address = &epp_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        ["socket_address"];
    ensure!(
        address["address"] == epp.ip().to_string() && address["port_value"] == epp.port(),
        "EPP cluster dials {address}, not {epp}"
    );
    ensure!(
        !epp_cluster["transport_socket"].is_null(),
        "ext_proc without TLS"
    );
    let pool_cluster = cluster("pool");
    ensure!(
        pool_cluster["type"] == "ORIGINAL_DST"
            && pool_cluster["original_dst_lb_config"]["http_header_name"]
                == "x-gateway-destination-endpoint",
        "the pool cluster does not dial the EPP's destination header: {pool_cluster}"
    );
    let prefix = route_path_prefix(s).await?;
    let routes = &hcm["route_config"]["virtual_hosts"][0]["routes"];
    let routed = routes.as_array().into_iter().flatten().any(|r| {
        r["route"]["cluster"] == "pool"
            && r["match"]["prefix"]
                .as_str()
                .is_some_and(|p| prefix.starts_with(p))
    });
    ensure!(
        routed,
        "no route to the pool covers the HTTPRoute's {prefix}"
    );
    Ok(())
}

/// The path prefix of the HTTPRoute the operator made for the policy.
async fn route_path_prefix(s: &Scenario) -> Result<String> {
    let route = s
        .only_labelled("gateway.networking.k8s.io", "HTTPRoute")
        .await?;
    route["spec"]["rules"][0]["matches"][0]["path"]["value"]
        .as_str()
        .map(str::to_owned)
        .context("HTTPRoute without a path match")
}

// ---------------------------------------------------------------- traffic

/// `e2e/kind/smoke-request.env`, which `e2e/kind.sh` sources.
#[derive(Clone, Debug)]
struct SmokeRequest {
    path: String,
    body: String,
    status: u16,
    rule: String,
    object: String,
    model: String,
}

impl SmokeRequest {
    fn read() -> Result<Self> {
        let path = repo_root().join("e2e/kind/smoke-request.env");
        let text = std::fs::read_to_string(&path)?;
        let mut vars = BTreeMap::new();
        for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
            if let Some((key, value)) = line.split_once('=') {
                let value = value.strip_prefix('\'').and_then(|v| v.strip_suffix('\''));
                vars.insert(
                    key.trim(),
                    value.context("values are single-quoted")?.to_owned(),
                );
            }
        }
        let var = |key: &str| {
            vars.get(key)
                .cloned()
                .with_context(|| format!("{key} missing in {}", path.display()))
        };
        Ok(Self {
            path: var("SMOKE_PATH")?,
            body: var("SMOKE_BODY")?,
            status: var("SMOKE_STATUS")?.parse()?,
            rule: var("SMOKE_RULE")?,
            object: var("SMOKE_OBJECT")?,
            model: var("SMOKE_MODEL")?,
        })
    }
}

/// One request through the gateway.
#[derive(Clone, Debug)]
struct Sent {
    /// Its `x-request-id`, to find Envoy's access record.
    id: String,
    status: u16,
    /// `x-sim-server`: the simulator Pod that answered.
    server: String,
    body: String,
}

async fn send(gateway: SocketAddr, request: &SmokeRequest) -> Result<Sent> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = format!("scenario-{}", NEXT.fetch_add(1, Ordering::Relaxed));
    let head = format!(
        "POST {} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n\
         x-request-id: {id}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        request.path,
        request.body.len()
    );
    let response = http_exchange(gateway, format!("{head}{}", request.body)).await?;
    Ok(Sent {
        id,
        status: response.status,
        server: response
            .headers
            .get("x-sim-server")
            .cloned()
            .unwrap_or_default(),
        body: response.body,
    })
}

/// Requests sent one after another, a few milliseconds apart (a steady
/// client, not a flood of instant failures while no EPP is up), until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Result<Vec<Sent>>>,
}

impl Load {
    fn start(gateway: &Gateway) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, listener, request) = (
            stop.clone(),
            gateway.envoy.listener(),
            gateway.request.clone(),
        );
        let task = tokio::spawn(async move {
            let mut sent = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                sent.push(send(listener, &request).await?);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(sent)
        });
        Self { stop, task }
    }

    async fn stop(self) -> Result<Vec<Sent>> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await?
    }
}

struct Response {
    status: u16,
    headers: BTreeMap<String, String>,
    body: String,
}

async fn http_get(addr: &str, path: &str) -> Result<String> {
    let addr: SocketAddr = addr.parse()?;
    let response = http_exchange(
        addr,
        format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"),
    )
    .await?;
    ensure!(
        response.status == 200,
        "GET {addr}{path}: {}",
        response.status
    );
    Ok(response.body)
}

/// One HTTP/1.1 exchange on a fresh connection (`connection: close`);
/// chunked bodies are decoded (Envoy streams bodies it lets ext_proc see).
async fn http_exchange(addr: SocketAddr, request: String) -> Result<Response> {
    let io = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        anyhow::Ok(raw)
    };
    let raw = tokio::time::timeout(Duration::from_secs(20), io)
        .await
        .with_context(|| format!("HTTP to {addr} timed out"))??;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").context("no HTTP header end")?;
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .context("no HTTP status")?;
    let headers: BTreeMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .get("transfer-encoding")
        .is_some_and(|v| v.contains("chunked"));
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_owned()
    };
    Ok(Response {
        status,
        headers,
        body,
    })
}

fn dechunk(mut rest: &str) -> Result<String> {
    let mut body = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n").context("bad chunk")?;
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)?;
        if size == 0 {
            return Ok(body);
        }
        body.push_str(after.get(..size).context("short chunk")?);
        rest = after.get(size + 2..).context("short chunk")?;
    }
}

// ---------------------------------------------------------------- helpers

/// Every manifest `kubectl apply -f e2e/kind/` applies.
fn kind_manifests() -> Result<Vec<Value>> {
    let dir = repo_root().join("e2e/kind");
    let mut files: Vec<_> = std::fs::read_dir(&dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.retain(|p| {
        p.extension()
            .is_some_and(|e| e == "yaml" || e == "yml" || e == "json")
    });
    files.sort();
    let mut docs = Vec::new();
    for file in files {
        docs.extend(yaml_documents_to_json(&std::fs::read_to_string(&file)?)?);
    }
    Ok(docs)
}

/// `e2e/kind/30-policy.yaml` with a first rule, `pinned`, that takes every
/// request for the pool's model and drops every simulator Pod but `pod`.
fn pinned_policy(pod: &str) -> Result<Value> {
    let mut policy = kind_manifests()?
        .into_iter()
        .find(|d| d["kind"] == "InferencePolicy")
        .context("no InferencePolicy in e2e/kind/")?;
    let model = policy["spec"]["pool"]["models"][0]["name"].clone();
    let rules = policy["spec"]["rules"].as_array_mut().context("no rules")?;
    rules.insert(
        0,
        json!({
            "name": "pinned",
            "matches": [{ "model": model }],
            "route": {
                "exclude": [{ "drop": { "endpoint": { "notEquals": pod } } }],
                "select": [{ "minimize": "QueueDepth" }],
            },
        }),
    );
    Ok(policy)
}

/// The reference EPP's Deployment, Service and pool names.
const REFERENCE_EPP: &str = "vllm-epp";
const REFERENCE_POOL: &str = "vllm";
const REFERENCE_IMAGE: &str = "kinference.local/gie-epp:v1.5.0";

/// The reference EPP (`bench/peers/install.sh gie-epp`) as an image: the
/// binary at `/epp` with the libraries it links, run as nonroot.
fn import_reference_epp_image(cluster: &RealCluster) -> Result<()> {
    let binary = kinference_testbed::peers::peer("gie-epp", "KINFERENCE_GIE_EPP")?;
    let files = binary_with_libraries(&binary, "/epp")?;
    let config = ImageConfig {
        entrypoint: vec!["/epp".into()],
        user: Some("65532".into()),
        exposed_ports: ["9002/tcp", "9003/tcp", "9090/tcp"]
            .map(String::from)
            .to_vec(),
        ..ImageConfig::default()
    };
    cluster.build_image(
        &workspace_images::normalized_reference(REFERENCE_IMAGE),
        &files,
        &config,
    )?;
    Ok(())
}

/// What the Inference Extension's `inferencepool` chart (v1.5.0) installs
/// for one pool with one EPP replica: the pool (over the simulators), the
/// EPP's ServiceAccount, Role and RoleBinding, its Service and Deployment
/// (the chart's arguments, ports and gRPC probes).
fn reference_epp_manifests() -> Result<Vec<Value>> {
    let meta = |name: &str| json!({ "name": name, "namespace": DEMO_NS });
    Ok(vec![
        json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": meta(REFERENCE_POOL),
            "spec": {
                "selector": { "matchLabels": { "app": SIM } },
                "targetPorts": [{ "number": 8000 }],
                "endpointPickerRef": { "name": REFERENCE_EPP, "port": { "number": 9002 } }
            }
        }),
        json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(REFERENCE_EPP) }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": meta(REFERENCE_EPP),
            "rules": [
                { "apiGroups": ["inference.networking.x-k8s.io"],
                  "resources": ["inferenceobjectives", "inferencemodelrewrites"],
                  "verbs": ["get", "watch", "list"] },
                { "apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
                  "verbs": ["get", "watch", "list"] },
                { "apiGroups": [""], "resources": ["pods"], "verbs": ["get", "watch", "list"] }
            ]
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": meta(REFERENCE_EPP),
            "subjects": [{ "kind": "ServiceAccount", "name": REFERENCE_EPP, "namespace": DEMO_NS }],
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": REFERENCE_EPP }
        }),
        json!({
            "apiVersion": "v1", "kind": "Service", "metadata": meta(REFERENCE_EPP),
            "spec": {
                "selector": { "app": REFERENCE_EPP },
                "ports": [
                    { "name": "grpc-ext-proc", "port": 9002, "protocol": "TCP", "appProtocol": "http2" },
                    { "name": "http-metrics", "port": 9090, "protocol": "TCP" }
                ]
            }
        }),
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(REFERENCE_EPP),
            "spec": {
                "replicas": 1,
                "selector": { "matchLabels": { "app": REFERENCE_EPP } },
                "template": {
                    "metadata": { "labels": { "app": REFERENCE_EPP } },
                    "spec": {
                        "serviceAccountName": REFERENCE_EPP,
                        "terminationGracePeriodSeconds": 130,
                        "containers": [{
                            "name": "epp",
                            "image": REFERENCE_IMAGE,
                            "imagePullPolicy": "IfNotPresent",
                            "args": [
                                "--pool-name", REFERENCE_POOL, "--pool-namespace", DEMO_NS,
                                "--pool-group", "inference.networking.k8s.io",
                                "--zap-encoder", "json", "--tracing=false",
                                "--metrics-endpoint-auth=false"
                            ],
                            "ports": [
                                { "name": "grpc", "containerPort": 9002 },
                                { "name": "grpc-health", "containerPort": 9003 },
                                { "name": "metrics", "containerPort": 9090 }
                            ],
                            "livenessProbe": {
                                "grpc": { "port": 9003, "service": "inference-extension" },
                                "initialDelaySeconds": 5, "periodSeconds": 10
                            },
                            "readinessProbe": {
                                "grpc": { "port": 9003, "service": "inference-extension" },
                                "periodSeconds": 2
                            },
                            "env": [
                                { "name": "NAMESPACE", "valueFrom": { "fieldRef": { "fieldPath": "metadata.namespace" } } },
                                { "name": "POD_NAME", "valueFrom": { "fieldRef": { "fieldPath": "metadata.name" } } }
                            ]
                        }]
                    }
                }
            }
        }),
    ])
}

/// The tokenizer image of precise prefix mode: Qwen3's `tokenizer.json`
/// (11 MB) and `tokenizer_config.json` (its chat template) under
/// [`TOKENIZER_PATH`], in an image holding nothing else.
const TOKENIZER_IMAGE: &str = "kinference.local/tokenizers/qwen3:3.7.2";
const TOKENIZER_PATH: &str = "qwen3";

fn import_tokenizer_image(cluster: &RealCluster) -> Result<()> {
    let dir = kinference_testbed::peers::qwen3_tokenizer()?;
    let files = ["tokenizer.json", "tokenizer_config.json"].map(|name| {
        LayerFile::host_file(&format!("/{TOKENIZER_PATH}/{name}"), &dir.join(name), 0o644)
    });
    cluster.build_image(
        &workspace_images::normalized_reference(TOKENIZER_IMAGE),
        &files,
        &ImageConfig::default(),
    )?;
    Ok(())
}

/// The image and sub-path of a Pod's `tokenizer` image volume.
fn tokenizer_volume(pod: &Pod) -> Option<(String, Option<String>)> {
    let spec = pod.spec.as_ref()?;
    let volume = spec
        .volumes
        .as_ref()?
        .iter()
        .find(|v| v.name == "tokenizer")?;
    let reference = volume.image.as_ref()?.reference.clone()?;
    let mount = spec.containers.iter().find(|c| c.name == "epp")?;
    let mount = mount
        .volume_mounts
        .as_ref()?
        .iter()
        .find(|m| m.name == "tokenizer")?;
    Some((reference, mount.sub_path.clone()))
}

/// The value of the sample `series` (metric name and labels, as rendered).
fn metric_value(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// `(endpoint, address)` of the EPP's per-endpoint staleness gauge.
fn metric_endpoints(metrics: &str) -> BTreeSet<(String, String)> {
    let label = |line: &str, name: &str| {
        let start = line.find(&format!("{name}=\""))? + name.len() + 2;
        let len = line[start..].find('"')?;
        Some(line[start..start + len].to_owned())
    };
    metrics
        .lines()
        .filter(|l| l.starts_with("kinference_epp_endpoint_metrics_stale{"))
        .filter_map(|l| Some((label(l, "endpoint")?, label(l, "address")?)))
        .collect()
}

fn is_ready(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    pod.metadata.deletion_timestamp.is_none()
        && status.and_then(|s| s.pod_ip.as_ref()).is_some()
        && status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn pod_ip(pod: &Pod) -> String {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default()
}

/// Poll `check` until it yields a value; the last error (if any) explains a timeout.
async fn eventually<T, F, Fut>(what: &str, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let last = match check().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => None,
            Err(e) => Some(e),
        };
        if Instant::now() > deadline {
            return Err(match last {
                Some(e) => e.context(format!("timed out waiting for {what}")),
                None => anyhow!("timed out after {TIMEOUT:?} waiting for {what}"),
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// On failure: the Pods, the policy, and the logs of the operator and EPP
/// Pods (read through the kubelet) and of the node's components.
async fn print_diagnostics(cluster: &RealCluster) {
    let client = cluster.client();
    for ns in [OPERATOR_NS, DEMO_NS] {
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        for pod in pods
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
        {
            let phase = pod.status.as_ref().and_then(|s| s.phase.clone());
            eprintln!(
                "--- Pod {ns}/{} {phase:?}: {:?}",
                pod.name_any(),
                pod.status
                    .as_ref()
                    .and_then(|s| s.container_statuses.clone())
            );
            let params = LogParams {
                tail_lines: Some(30),
                ..LogParams::default()
            };
            if let Ok(log) = pods.logs(&pod.name_any(), &params).await {
                eprintln!("{log}");
            }
        }
    }
    if let Ok(policy) = Api::<InferencePolicy>::namespaced(client, DEMO_NS)
        .get(POLICY)
        .await
    {
        eprintln!("--- policy status: {:?}", policy.status);
    }
    for component in [
        "kubelet",
        "kube-proxy",
        "kube-controller-manager",
        "containerd",
    ] {
        eprintln!("--- {component}:\n{}", cluster.log_tail(component, 20));
    }
    eprintln!("--- disk:\n{}", cluster.disk_free());
}
