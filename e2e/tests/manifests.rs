//! The deploy manifests (`manifests/`, `kustomize/`, the kind scenario in
//! `e2e/kind/`) and the Dockerfiles, checked without a container runtime:
//!
//! - every object of `manifests/` and `e2e/kind/`, and of the rendered
//!   kustomize overlays, is accepted by a real API server (server-side apply,
//!   `dryRun=All`, strict field validation) — and a broken object is not;
//! - the operator, running in-process as the manifests' ServiceAccount
//!   (impersonated) with only the manifests' RBAC, reconciles a policy end to
//!   end (apply, prune, status, Events, leader Lease) with no failed
//!   reconcile, and is denied what it does not need;
//! - static requirements: hardened Deployment, kind overlay patches, the
//!   scenario policy compiles, Dockerfile pins.
//!
//! Overlays are rendered with `kubectl kustomize` when `kubectl` is on PATH;
//! without it the overlays are only checked structurally (patch targets and
//! image names exist in the base), and a note is printed.

use std::collections::BTreeSet;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use kinference_api::{EppPodStatus, InferencePolicy, SecretKeyStatus, epp_field_manager};
use kinference_e2e::cluster::{StartOptions, TestCluster, yaml_documents_to_json};
use kinference_operator::{Config, LeaderElectionConfig, Metrics, Requeue};
use kube::api::{
    Api, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
    ValidationDirective,
};
use kube::discovery::{Discovery, Scope};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

const FIELD_MANAGER: &str = "kinference-test";
const OPERATOR_NS: &str = "kinference-system";
const OPERATOR_SA: &str = "kinference-operator";
const OPERATOR_USER: &str = "system:serviceaccount:kinference-system:kinference-operator";
const TIMEOUT: Duration = Duration::from_secs(60);
/// The namespace `kustomize/overlays/namespaced` installs into and manages.
const NAMESPACED_NS: &str = "llm";

// ------------------------------------------------------------------ files

fn repo_root() -> PathBuf {
    let e2e = Path::new(env!("CARGO_MANIFEST_DIR"));
    e2e.parent().unwrap_or(e2e).to_path_buf()
}

/// One Kubernetes object read from a file (or a rendered overlay).
#[derive(Clone, Debug)]
struct Doc {
    source: String,
    value: Value,
}

impl Doc {
    fn str_at(&self, pointer: &str) -> &str {
        self.value
            .pointer(pointer)
            .and_then(Value::as_str)
            .unwrap_or_default()
    }
    fn kind(&self) -> &str {
        self.str_at("/kind")
    }
    fn name(&self) -> &str {
        self.str_at("/metadata/name")
    }
    fn namespace(&self) -> Option<&str> {
        self.value
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
    }
    fn describe(&self) -> String {
        match self.namespace() {
            Some(ns) => format!("{} {ns}/{} ({})", self.kind(), self.name(), self.source),
            None => format!("{} {} ({})", self.kind(), self.name(), self.source),
        }
    }
}

fn is_kustomization(path: &Path) -> bool {
    matches!(
        path.file_name().and_then(|n| n.to_str()),
        Some("kustomization.yaml" | "kustomization.yml" | "Kustomization")
    )
}

/// `*.yaml`/`*.yml` in `dir` (not recursive), sorted, without kustomization files.
fn yaml_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        let yaml = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e == "yaml" || e == "yml");
        if yaml && path.is_file() && !is_kustomization(&path) {
            files.push(path);
        }
    }
    files.sort();
    ensure!(!files.is_empty(), "no YAML files in {}", dir.display());
    Ok(files)
}

/// Parses multi-document YAML; every document must be an object with
/// apiVersion, kind and metadata.name.
fn parse_docs(source: &str, text: &str) -> Result<Vec<Doc>> {
    let values = yaml_documents_to_json(text).with_context(|| format!("parsing {source}"))?;
    let mut docs = Vec::new();
    for (i, value) in values.into_iter().enumerate() {
        let doc = Doc {
            source: format!("{source} #{i}"),
            value,
        };
        ensure!(
            doc.value.is_object()
                && !doc.str_at("/apiVersion").is_empty()
                && !doc.kind().is_empty()
                && !doc.name().is_empty(),
            "{}: not a Kubernetes object (apiVersion, kind and metadata.name are required)",
            doc.source
        );
        docs.push(doc);
    }
    Ok(docs)
}

fn load_file(path: &Path) -> Result<Vec<Doc>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let root = repo_root();
    let source = path
        .strip_prefix(&root)
        .unwrap_or(path)
        .display()
        .to_string();
    parse_docs(&source, &text)
}

fn load_dir(dir: &Path) -> Result<Vec<Doc>> {
    let mut docs = Vec::new();
    for file in yaml_files(dir)? {
        docs.extend(load_file(&file)?);
    }
    Ok(docs)
}

fn manifests() -> Result<Vec<Doc>> {
    load_dir(&repo_root().join("manifests"))
}

fn kind_scenario() -> Result<Vec<Doc>> {
    load_dir(&repo_root().join("e2e/kind"))
}

fn find<'a>(docs: &'a [Doc], kind: &str, name: &str) -> Result<&'a Doc> {
    docs.iter()
        .find(|d| d.kind() == kind && d.name() == name)
        .ok_or_else(|| anyhow!("no {kind} {name}"))
}

/// `kubectl` if it is on PATH and can render kustomizations.
fn kubectl() -> Option<PathBuf> {
    let ok = Command::new("kubectl")
        .args(["kustomize", "--help"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then(|| PathBuf::from("kubectl"))
}

fn render_overlay(kubectl: &Path, overlay: &str) -> Result<Vec<Doc>> {
    let dir = repo_root().join("kustomize/overlays").join(overlay);
    let out = Command::new(kubectl)
        .arg("kustomize")
        .arg(&dir)
        .output()
        .with_context(|| format!("running kubectl kustomize {}", dir.display()))?;
    ensure!(
        out.status.success(),
        "kubectl kustomize {} failed: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    parse_docs(
        &format!("kustomize/overlays/{overlay} (rendered)"),
        &String::from_utf8_lossy(&out.stdout),
    )
}

fn read_kustomization(dir: &str) -> Result<Value> {
    let path = repo_root().join(dir).join("kustomization.yaml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut docs = yaml_documents_to_json(&text)?;
    ensure!(docs.len() == 1, "{}: expected one document", path.display());
    Ok(docs.remove(0))
}

fn strings(value: Option<&Value>) -> Vec<String> {
    value
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

// ------------------------------------------------------------- API server

/// Applies documents as `DynamicObject`s, resolving kinds by discovery.
struct Applier {
    client: Client,
    discovery: Discovery,
}

impl Applier {
    async fn new(client: Client) -> Result<Self> {
        let discovery = Discovery::new(client.clone())
            .run()
            .await
            .context("API discovery")?;
        Ok(Self { client, discovery })
    }

    fn api_for(&self, doc: &Doc) -> Result<Api<DynamicObject>> {
        let api_version = doc.str_at("/apiVersion");
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        let gvk = GroupVersionKind::gvk(group, version, doc.kind());
        let (resource, caps) = self.discovery.resolve_gvk(&gvk).ok_or_else(|| {
            anyhow!(
                "{}: the API server does not serve {api_version} {}",
                doc.describe(),
                doc.kind()
            )
        })?;
        Ok(match caps.scope {
            Scope::Namespaced => {
                // Our files always name their namespace, so `kubectl apply -f`
                // never drops them into whatever namespace is current.
                let ns = doc.namespace().ok_or_else(|| {
                    anyhow!(
                        "{}: namespaced object without metadata.namespace",
                        doc.source
                    )
                })?;
                Api::namespaced_with(self.client.clone(), ns, &resource)
            }
            Scope::Cluster => Api::all_with(self.client.clone(), &resource),
        })
    }

    /// Server-side apply with strict field validation; `dry_run` sends
    /// `dryRun=All`: full validation and admission, nothing persisted.
    async fn apply(&self, doc: &Doc, dry_run: bool) -> Result<DynamicObject> {
        let api = self.api_for(doc)?;
        let params = PatchParams {
            dry_run,
            force: false,
            field_manager: Some(FIELD_MANAGER.into()),
            field_validation: Some(ValidationDirective::Strict),
        };
        api.patch(doc.name(), &params, &Patch::Apply(&doc.value))
            .await
            .with_context(|| {
                format!(
                    "{} rejected: {}",
                    if dry_run { "dry-run apply" } else { "apply" },
                    doc.describe()
                )
            })
    }

    /// Namespaces (and CRDs) for real first, so namespaced objects have
    /// somewhere to go; then everything with `dryRun=All`. Every rejection
    /// is reported, not only the first.
    async fn apply_all(&self, docs: &[Doc], dry_run: bool) -> Result<usize> {
        let first = |d: &Doc| matches!(d.kind(), "Namespace" | "CustomResourceDefinition");
        let mut errors = Vec::new();
        for doc in docs.iter().filter(|d| first(d)) {
            if let Err(e) = self.apply(doc, false).await {
                errors.push(format!("{e:#}"));
            }
        }
        for doc in docs.iter().filter(|d| !first(d)) {
            if let Err(e) = self.apply(doc, dry_run).await {
                errors.push(format!("{e:#}"));
            }
        }
        if !errors.is_empty() {
            bail!(
                "{} of {} objects rejected:\n  {}",
                errors.len(),
                docs.len(),
                errors.join("\n  ")
            );
        }
        Ok(docs.len())
    }
}

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
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// ------------------------------------------------------------------ tests

/// Every object of `manifests/`, `e2e/kind/` and the rendered overlays is
/// accepted by the API server; a broken one is rejected.
#[tokio::test]
async fn manifests_are_accepted_by_the_api_server() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let applier = Applier::new(cluster.client()).await?;

    let manifests = manifests()?;
    let scenario = kind_scenario()?;
    let n = applier.apply_all(&manifests, true).await?;
    eprintln!("manifests/: {n} objects accepted");
    let n = applier.apply_all(&scenario, true).await?;
    eprintln!("e2e/kind/: {n} objects accepted");

    // What the issue asks for is there.
    let kinds: BTreeSet<(String, String)> = manifests
        .iter()
        .map(|d| (d.kind().to_string(), d.name().to_string()))
        .collect();
    for (kind, name) in [
        ("Namespace", OPERATOR_NS),
        ("ServiceAccount", OPERATOR_SA),
        ("ClusterRole", "kinference-operator"),
        ("ClusterRoleBinding", "kinference-operator"),
        ("Deployment", "kinference-operator"),
        ("Service", "kinference-operator-metrics"),
        ("NetworkPolicy", "kinference-operator"),
    ] {
        ensure!(
            kinds.contains(&(kind.to_string(), name.to_string())),
            "manifests/ has no {kind} {name}"
        );
    }
    for kind in ["Namespace", "Deployment", "Gateway", "InferencePolicy"] {
        ensure!(
            scenario.iter().any(|d| d.kind() == kind),
            "e2e/kind/ has no {kind}"
        );
    }

    // The rendered overlays.
    match kubectl() {
        Some(kubectl) => {
            for overlay in ["default", "kind"] {
                let docs = render_overlay(&kubectl, overlay)?;
                let n = applier.apply_all(&docs, true).await?;
                eprintln!("kustomize/overlays/{overlay}: {n} rendered objects accepted");
                // The base is crds/ plus manifests/: the same objects, none lost.
                let rendered: BTreeSet<(String, String)> = docs
                    .iter()
                    .map(|d| (d.kind().to_string(), d.name().to_string()))
                    .collect();
                let mut expected = kinds.clone();
                for kind in [
                    "CustomResourceDefinition",
                    "ValidatingAdmissionPolicy",
                    "ValidatingAdmissionPolicyBinding",
                ] {
                    expected.insert((
                        kind.to_string(),
                        "inferencepolicies.kinference.io".to_string(),
                    ));
                }
                ensure!(
                    rendered == expected,
                    "overlay {overlay} renders {rendered:?}, crds/ + manifests/ have {expected:?}"
                );
                if overlay == "kind" {
                    check_kind_overlay(&docs)?;
                } else {
                    let base = find(&manifests, "Deployment", "kinference-operator")?;
                    let rendered = find(&docs, "Deployment", "kinference-operator")?;
                    ensure!(
                        base.value == rendered.value,
                        "the default overlay changed the Deployment"
                    );
                }
            }
            let docs = render_overlay(&kubectl, "namespaced")?;
            // Its namespace is the user's, not created by the overlay.
            applier
                .apply(
                    &Doc {
                        source: "test".into(),
                        value: json!({"apiVersion": "v1", "kind": "Namespace",
                                      "metadata": {"name": NAMESPACED_NS}}),
                    },
                    false,
                )
                .await?;
            let n = applier.apply_all(&docs, true).await?;
            eprintln!("kustomize/overlays/namespaced: {n} rendered objects accepted");
            check_namespaced_overlay(&manifests, &docs)?;
        }
        None => eprintln!(
            "NOTE: kubectl not found: overlays were not rendered, only checked structurally \
             (overlays_patch_what_the_base_has)"
        ),
    }

    // The check has teeth: broken objects are rejected.
    let deployment = find(&manifests, "Deployment", "kinference-operator")?;
    type Breakage = (&'static str, fn(&mut Value));
    let breakages: [Breakage; 4] = [
        ("unknown field spec.replica", |v| {
            v["spec"]["replica"] = json!(3);
        }),
        ("invalid imagePullPolicy", |v| {
            v["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = json!("Sometimes");
        }),
        ("selector not matching the template labels", |v| {
            v["spec"]["selector"]["matchLabels"] = json!({"app": "other"});
        }),
        ("string where an integer belongs", |v| {
            v["spec"]["replicas"] = json!("two");
        }),
    ];
    for (what, breakage) in breakages {
        let mut broken = deployment.clone();
        breakage(&mut broken.value);
        ensure!(
            applier.apply(&broken, true).await.is_err(),
            "a Deployment with {what} was accepted"
        );
    }
    let mut policy = find(&scenario, "InferencePolicy", "chat")?.clone();
    policy.value["spec"]["rules"] = json!("not-a-list");
    ensure!(
        applier.apply(&policy, true).await.is_err(),
        "an InferencePolicy with rules: \"not-a-list\" was accepted"
    );
    Ok(())
}

/// The namespaced overlay: nothing cluster-scoped, everything in its one
/// namespace, the operator told to watch it, and the ClusterRole's rules as
/// a Role, rule for rule.
fn check_namespaced_overlay(manifests: &[Doc], docs: &[Doc]) -> Result<()> {
    for doc in docs {
        ensure!(
            doc.namespace() == Some(NAMESPACED_NS),
            "namespaced overlay: {} is not in {NAMESPACED_NS}",
            doc.describe()
        );
        ensure!(
            !matches!(
                doc.kind(),
                "ClusterRole" | "ClusterRoleBinding" | "Namespace" | "CustomResourceDefinition"
            ),
            "namespaced overlay: cluster-scoped {}",
            doc.describe()
        );
    }
    let expected: BTreeSet<(String, String)> = manifests
        .iter()
        .filter(|d| !matches!(d.kind(), "ClusterRole" | "ClusterRoleBinding" | "Namespace"))
        .map(|d| (d.kind().to_string(), d.name().to_string()))
        .chain([
            ("Role".to_string(), OPERATOR_SA.to_string()),
            ("RoleBinding".to_string(), OPERATOR_SA.to_string()),
        ])
        .collect();
    let rendered: BTreeSet<(String, String)> = docs
        .iter()
        .map(|d| (d.kind().to_string(), d.name().to_string()))
        .collect();
    ensure!(
        rendered == expected,
        "namespaced overlay renders {rendered:?}, expected {expected:?}"
    );
    let cluster_role = find(manifests, "ClusterRole", OPERATOR_SA)?;
    let role = find(docs, "Role", OPERATOR_SA)?;
    ensure!(
        cluster_role.value["rules"] == role.value["rules"],
        "the namespaced Role's rules differ from the ClusterRole's"
    );
    let binding = find(docs, "RoleBinding", OPERATOR_SA)?;
    ensure!(
        binding.value["subjects"]
            == json!([{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": NAMESPACED_NS}])
            && binding.value["roleRef"]["kind"] == json!("Role"),
        "namespaced overlay: {}",
        binding.value
    );
    let d = find(docs, "Deployment", "kinference-operator")?;
    let args = strings(d.value["spec"]["template"]["spec"]["containers"][0].get("args"));
    for wanted in [
        "--namespace=$(POD_NAMESPACE)",
        "--leader-election-namespace=$(POD_NAMESPACE)",
    ] {
        ensure!(
            args.iter().any(|a| a == wanted),
            "namespaced overlay: {args:?}"
        );
    }
    Ok(())
}

fn check_kind_overlay(docs: &[Doc]) -> Result<()> {
    let d = find(docs, "Deployment", "kinference-operator")?;
    let c = &d.value["spec"]["template"]["spec"]["containers"][0];
    ensure!(d.value["spec"]["replicas"] == json!(1), "kind: replicas");
    ensure!(
        c["image"] == json!("kinference/operator:dev"),
        "kind: image"
    );
    ensure!(
        c["imagePullPolicy"] == json!("IfNotPresent"),
        "kind: imagePullPolicy"
    );
    let epp = c["env"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["name"] == json!("KINFERENCE_EPP_IMAGE"))
        .ok_or_else(|| anyhow!("kind: no KINFERENCE_EPP_IMAGE"))?;
    ensure!(
        epp["value"] == json!("kinference/epp:dev"),
        "kind: EPP image is {}",
        epp["value"]
    );
    Ok(())
}

/// Without rendering: every patch target and image of every overlay exists
/// in the base, and the base's resources exist.
#[test]
fn overlays_patch_what_the_base_has() -> Result<()> {
    let root = repo_root();
    let base = read_kustomization("kustomize/base")?;
    let resources = strings(base.get("resources"));
    ensure!(
        resources.iter().any(|r| r == "../../manifests"),
        "the base does not include manifests/"
    );
    for r in &resources {
        let path = root.join("kustomize/base").join(r);
        ensure!(path.exists(), "base resource {r} does not exist");
    }
    // manifests/kustomization.yaml lists every manifest file, and only those.
    let listed: BTreeSet<String> = strings(read_kustomization("manifests")?.get("resources"))
        .into_iter()
        .collect();
    let files: BTreeSet<String> = yaml_files(&root.join("manifests"))?
        .iter()
        .filter_map(|p| p.file_name()?.to_str().map(str::to_string))
        .collect();
    ensure!(
        listed == files,
        "manifests/kustomization.yaml lists {listed:?}, the directory has {files:?}"
    );

    let docs = manifests()?;
    let images: BTreeSet<String> = docs
        .iter()
        .filter(|d| d.kind() == "Deployment")
        .flat_map(|d| {
            d.value["spec"]["template"]["spec"]["containers"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|c| c["image"].as_str().map(str::to_string))
        .collect();
    for overlay in ["default", "kind"] {
        let k = read_kustomization(&format!("kustomize/overlays/{overlay}"))?;
        ensure!(
            strings(k.get("resources")) == ["../../base"],
            "overlay {overlay} must build on ../../base"
        );
        for image in k["images"].as_array().into_iter().flatten() {
            let name = image["name"].as_str().unwrap_or_default();
            ensure!(
                images.iter().any(|i| i.split(':').next() == Some(name)),
                "overlay {overlay}: image {name} is not used in the base ({images:?})"
            );
        }
        for patch in k["patches"].as_array().into_iter().flatten() {
            let t = &patch["target"];
            let (kind, name) = (t["kind"].as_str(), t["name"].as_str());
            ensure!(
                docs.iter().any(|d| Some(d.kind()) == kind
                    && Some(d.name()) == name
                    && t["namespace"]
                        .as_str()
                        .is_none_or(|ns| d.namespace() == Some(ns))),
                "overlay {overlay}: patch target {t} not in the base"
            );
        }
    }
    // The namespaced overlay builds on manifests/ (not the base: no CRDs)
    // and patches what is there.
    let namespaced = read_kustomization("kustomize/overlays/namespaced")?;
    ensure!(
        strings(namespaced.get("resources")) == ["../../../manifests", "rbac.yaml"],
        "the namespaced overlay must build on manifests/ and its rbac.yaml"
    );
    ensure!(
        namespaced["namespace"] == json!(NAMESPACED_NS),
        "the namespaced overlay installs into {}",
        namespaced["namespace"]
    );
    for patch in namespaced["patches"].as_array().into_iter().flatten() {
        let t = &patch["target"];
        let (kind, name) = (t["kind"].as_str(), t["name"].as_str());
        ensure!(
            docs.iter()
                .any(|d| Some(d.kind()) == kind && Some(d.name()) == name),
            "overlay namespaced: patch target {t} not in manifests/"
        );
    }
    // The kind overlay, and the chart's kind values that e2e/kind.sh
    // installs, run the images it loads.
    let kind = read_kustomization("kustomize/overlays/kind")?;
    let text = serde_json::to_string(&kind)?;
    for needle in ["kinference/operator", "kinference/epp:dev", "IfNotPresent"] {
        ensure!(text.contains(needle), "kind overlay does not set {needle}");
    }
    let values = std::fs::read_to_string(root.join("charts/kinference/ci/kind-values.yaml"))?;
    for needle in [
        "repository: kinference/operator",
        "tag: dev",
        "repository: kinference/epp",
    ] {
        ensure!(
            values.contains(needle),
            "the chart's kind values do not set {needle}"
        );
    }
    let script = std::fs::read_to_string(root.join("e2e/kind.sh"))?;
    for needle in [
        "charts/kinference/ci/kind-values.yaml",
        "kinference/operator:dev",
        "kinference/epp:dev",
        "kinference/sim:dev",
    ] {
        ensure!(script.contains(needle), "e2e/kind.sh does not use {needle}");
    }
    Ok(())
}

/// The operator Deployment is hardened and wired as the issue asks; the
/// Services, bindings and the kind scenario fit together.
#[test]
fn manifests_fit_together() -> Result<()> {
    let docs = manifests()?;
    let d = find(&docs, "Deployment", "kinference-operator")?;
    ensure!(d.namespace() == Some(OPERATOR_NS));
    let pod = &d.value["spec"]["template"]["spec"];
    ensure!(pod["serviceAccountName"] == json!(OPERATOR_SA));
    ensure!(pod["securityContext"]["runAsNonRoot"] == json!(true));
    ensure!(pod["securityContext"]["seccompProfile"]["type"] == json!("RuntimeDefault"));
    let containers = pod["containers"].as_array().context("containers")?;
    ensure!(containers.len() == 1);
    let c = &containers[0];
    ensure!(c["image"] == json!("ghcr.io/kinference/operator:0.1.0"));
    let sc = &c["securityContext"];
    ensure!(sc["readOnlyRootFilesystem"] == json!(true));
    ensure!(sc["allowPrivilegeEscalation"] == json!(false));
    ensure!(sc["capabilities"]["drop"] == json!(["ALL"]));
    ensure!(!c["resources"]["requests"]["cpu"].is_null());
    ensure!(!c["resources"]["requests"]["memory"].is_null());
    ensure!(!c["resources"]["limits"]["memory"].is_null());
    let args = strings(c.get("args"));
    ensure!(args.iter().any(|a| a == "--leader-elect"), "{args:?}");
    ensure!(c["livenessProbe"]["httpGet"]["path"] == json!("/healthz"));
    ensure!(c["readinessProbe"]["httpGet"]["path"] == json!("/readyz"));
    for probe in ["livenessProbe", "readinessProbe"] {
        let port = &c[probe]["httpGet"]["port"];
        let by_name = c["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| &p["name"] == port && p["containerPort"] == json!(8080));
        ensure!(
            by_name || *port == json!(8080),
            "{probe} is not on port 8080"
        );
    }
    let pod_name = c["env"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["name"] == json!("POD_NAME"))
        .context("POD_NAME env")?;
    ensure!(pod_name["valueFrom"]["fieldRef"]["fieldPath"] == json!("metadata.name"));

    // The metrics Service selects the operator Pods and targets :8080.
    let labels = &d.value["spec"]["template"]["metadata"]["labels"];
    let svc = find(&docs, "Service", "kinference-operator-metrics")?;
    for (k, v) in svc.value["spec"]["selector"]
        .as_object()
        .context("selector")?
    {
        ensure!(
            &labels[k] == v,
            "Service selector {k}={v} does not match the Pods"
        );
    }
    for (k, v) in d.value["spec"]["selector"]["matchLabels"]
        .as_object()
        .context("matchLabels")?
    {
        ensure!(
            &labels[k] == v,
            "Deployment selector {k}={v} does not match its Pods"
        );
    }

    // Bindings point at roles that exist, for the operator's ServiceAccount.
    for binding in docs
        .iter()
        .filter(|d| matches!(d.kind(), "ClusterRoleBinding" | "RoleBinding"))
    {
        let role = &binding.value["roleRef"];
        find(
            &docs,
            role["kind"].as_str().unwrap_or_default(),
            role["name"].as_str().unwrap_or_default(),
        )
        .with_context(|| binding.describe())?;
        ensure!(
            binding.value["subjects"]
                == json!([{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": OPERATOR_NS}]),
            "{}: subjects",
            binding.describe()
        );
    }

    // The kind scenario: the policy compiles (as the operator compiles it),
    // selects the simulator Pods, which serve its model, and attaches to the
    // scenario's Gateway.
    let scenario = kind_scenario()?;
    let doc = find(&scenario, "InferencePolicy", "chat")?;
    let policy: InferencePolicy =
        serde_json::from_value(doc.value.clone()).context("decoding the InferencePolicy")?;
    let spec = &policy.spec.policy;
    kinference_policy::compile(spec)
        .map_err(|e| anyhow!("e2e/kind policy does not compile: {e:?}"))?;
    let name_errors = kinference_operator::resources::validate_names(doc.name(), spec);
    ensure!(name_errors.is_empty(), "{name_errors:?}");
    let sim = find(&scenario, "Deployment", "sim")?;
    let sim_labels = &sim.value["spec"]["template"]["metadata"]["labels"];
    let selector = &doc.value["spec"]["pool"]["selector"];
    for (k, v) in selector.as_object().context("pool selector")? {
        ensure!(
            &sim_labels[k] == v,
            "pool selector {k}={v} misses the simulator Pods"
        );
    }
    let models = sim_labels["kinference.io/models"]
        .as_str()
        .unwrap_or_default();
    ensure!(
        models.split(',').any(|m| m.trim() == "qwen-2.5"),
        "simulator Pods do not label qwen-2.5"
    );
    let sim_args = strings(sim.value["spec"]["template"]["spec"]["containers"][0].get("args"));
    ensure!(
        sim_args.iter().any(|a| a == "--model=qwen-2.5"),
        "{sim_args:?}"
    );
    let gateway = scenario
        .iter()
        .find(|d| d.kind() == "Gateway")
        .context("Gateway")?;
    ensure!(
        doc.value["spec"]["route"]["parentRefs"][0]["name"] == json!(gateway.name())
            && gateway.namespace() == doc.namespace()
            && sim.namespace() == doc.namespace(),
        "the policy, Gateway and simulator must share a namespace and the parentRef must name the Gateway"
    );
    Ok(())
}

/// Dockerfiles: pinned builder at or above the workspace rust-version,
/// locked release build of the right package, distroless nonroot runtime.
#[test]
fn dockerfiles_are_pinned_and_minimal() -> Result<()> {
    let root = repo_root();
    let workspace = std::fs::read_to_string(root.join("Cargo.toml"))?;
    let msrv = workspace
        .lines()
        .find_map(|l| l.trim().strip_prefix("rust-version = "))
        .map(|v| v.trim_matches('"').to_string())
        .context("workspace rust-version")?;
    let minor = |v: &str| -> Result<u32> {
        let mut parts = v.split('.');
        ensure!(parts.next() == Some("1"), "unexpected Rust version {v}");
        Ok(parts.next().context("minor")?.parse()?)
    };
    let msrv_minor = minor(&msrv)?;
    for (file, package, binary) in [
        (
            "Dockerfile.operator",
            "kinference-operator",
            "kinference-operator",
        ),
        ("Dockerfile.epp", "kinference-epp", "kinference-epp"),
        (
            "Dockerfile.simulator",
            "kinference-simulator",
            "kinference-sim",
        ),
    ] {
        let text = std::fs::read_to_string(root.join(file))?;
        let froms: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("FROM "))
            .collect();
        ensure!(
            froms.len() == 2,
            "{file}: expected a builder and a runtime stage"
        );
        let builder = froms[0]
            .strip_prefix("rust:")
            .and_then(|s| s.split_whitespace().next())
            .with_context(|| format!("{file}: builder is not rust:<version>-bookworm"))?;
        let version = builder
            .strip_suffix("-bookworm")
            .with_context(|| format!("{file}: builder {builder} is not bookworm"))?;
        ensure!(
            minor(version)? >= msrv_minor,
            "{file}: rust {version} is older than rust-version {msrv}"
        );
        ensure!(
            froms[1].trim() == "gcr.io/distroless/cc-debian12:nonroot",
            "{file}: runtime is {}",
            froms[1]
        );
        ensure!(
            text.contains(&format!(
                "--profile dist --locked -p {package} --bin {binary}"
            )),
            "{file}: no locked dist (stripped release) build of {package}"
        );
        ensure!(
            text.lines().any(|l| l.trim() == "USER nonroot"),
            "{file}: USER nonroot"
        );
        ensure!(
            text.contains(&format!("ENTRYPOINT [\"/usr/local/bin/{binary}\"]")),
            "{file}: entrypoint"
        );
    }
    let ignore = std::fs::read_to_string(root.join(".dockerignore"))?;
    for needle in ["target/", ".git/"] {
        ensure!(
            ignore.lines().any(|l| l.trim() == needle),
            ".dockerignore lacks {needle}"
        );
    }
    Ok(())
}

// --------------------------------------------------------- RBAC, for real

fn policy_with_provider() -> Value {
    json!({
        "pool": {
            "selector": {"app": "sim"},
            "targetPorts": [{"number": 8000}],
            "models": [{"name": "qwen-2.5"}]
        },
        "route": {"parentRefs": [{"name": "inference-gateway"}], "pathPrefix": "/v1"},
        "providers": [{
            "name": "openai",
            "baseURL": "https://api.openai.com/v1",
            "secretRef": {"name": "openai-key"},
            "models": [{"name": "qwen-2.5", "targetModel": "gpt-4o-mini"}]
        }],
        "rules": [{
            "name": "local-then-openai",
            "route": {
                "consider": [{"backends": {}}],
                "select": [
                    {"type": "Local", "minimize": "QueueDepth"},
                    {"type": "Provider", "order": ["openai"]}
                ]
            }
        }]
    })
}

fn condition(policy: &InferencePolicy, type_: &str) -> Option<(String, Option<i64>)> {
    let status = serde_json::to_value(policy.status.as_ref()?).ok()?;
    let conditions = status.get("conditions")?.as_array()?;
    let c = conditions.iter().find(|c| c["type"] == json!(type_))?;
    Some((
        c["status"].as_str()?.to_string(),
        c["observedGeneration"].as_i64(),
    ))
}

/// Waits until the policy's current generation has `type_` = `status`. On
/// timeout the error carries the namespace's Warning Events: the operator's
/// error policy publishes each failed reconcile (e.g. a 403) as one.
async fn wait_condition(
    api: &Api<InferencePolicy>,
    name: &str,
    type_: &str,
    status: &str,
) -> Result<()> {
    let waited = eventually(&format!("{name}: {type_}={status}"), || async {
        let p = api.get(name).await?;
        let generation = p.metadata.generation;
        Ok(condition(&p, type_)
            .filter(|(s, g)| s == status && (g.is_none() || *g == generation))
            .map(|_| ()))
    })
    .await;
    let Err(e) = waited else { return Ok(()) };
    let ns = api.namespace().unwrap_or("default").to_string();
    let events: Api<Event> = Api::namespaced(api.clone().into_client(), &ns);
    let warnings: Vec<String> = match events.list(&ListParams::default()).await {
        Ok(list) => list
            .items
            .into_iter()
            .filter(|e| e.type_.as_deref() == Some("Warning"))
            .map(|e| {
                format!(
                    "{}: {}",
                    e.reason.unwrap_or_default(),
                    e.note.unwrap_or_default()
                )
            })
            .collect(),
        Err(list_error) => vec![format!("(could not list Events: {list_error})")],
    };
    Err(e.context(format!("Warning Events: {warnings:#?}")))
}

async fn exists(applier: &Applier, doc: &Doc) -> Result<bool> {
    Ok(applier.api_for(doc)?.get_opt(doc.name()).await?.is_some())
}

fn object(api_version: &str, kind: &str, ns: &str, name: &str) -> Doc {
    Doc {
        source: "test".into(),
        value: json!({
            "apiVersion": api_version,
            "kind": kind,
            "metadata": {"name": name, "namespace": ns}
        }),
    }
}

async fn access_allowed(
    admin: &Client,
    user: &str,
    verb: &str,
    group: &str,
    resource: &str,
    ns: &str,
    name: Option<&str>,
) -> Result<bool> {
    // `resource/subresource`, as RBAC rules spell it.
    let (resource, subresource) = match resource.split_once('/') {
        Some((r, s)) => (r, Some(s.to_string())),
        None => (resource, None),
    };
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.into()),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.into()),
                group: Some(group.into()),
                resource: Some(resource.into()),
                subresource,
                namespace: Some(ns.into()),
                name: name.map(str::to_string),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    };
    let answer = Api::<SubjectAccessReview>::all(admin.clone())
        .create(&PostParams::default(), &review)
        .await?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

/// Kinds the operator watches, as (API group, resource).
const WATCHED: [(&str, &str); 14] = [
    ("kinference.io", "inferencepolicies"),
    ("", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "roles"),
    ("rbac.authorization.k8s.io", "rolebindings"),
    ("", "configmaps"),
    ("", "services"),
    ("apps", "deployments"),
    ("networking.k8s.io", "networkpolicies"),
    ("policy", "poddisruptionbudgets"),
    ("inference.networking.k8s.io", "inferencepools"),
    ("gateway.networking.k8s.io", "httproutes"),
    ("gateway.networking.k8s.io", "backendtlspolicies"),
    ("", "pods"),
    ("gateway.networking.k8s.io", "gateways"),
];

/// Installs `docs` for real, runs the operator in-process as `operator_user`
/// (impersonated, so only the installed RBAC authorizes it), with its
/// leader Lease in `operator_ns` and watching `watch` (None: every
/// namespace), and drives a policy in `ns` through create (every generated
/// object, including the provider's Service and BackendTLSPolicy and the
/// NetworkPolicy), the EPP's report (written as the EPP's ServiceAccount,
/// under the Role the operator generated), an update that prunes the
/// provider, and a refused update. Asserts no failed reconcile, an Event,
/// the Lease taken and released.
async fn drive_a_policy_as_the_operator(
    cluster: &TestCluster,
    docs: &[Doc],
    operator_user: &str,
    operator_ns: &str,
    watch: Option<&str>,
    ns: &str,
) -> Result<()> {
    let admin = cluster.client();
    let applier = Applier::new(admin.clone()).await?;
    let namespace = |name: &str| Doc {
        source: "test".into(),
        value: json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}),
    };
    for name in [operator_ns, ns] {
        applier.apply(&namespace(name), false).await?;
    }
    // For real this time: the ServiceAccount, the roles and their bindings.
    applier.apply_all(docs, false).await?;
    let operator_client = cluster.client_as(operator_user).await?;
    // Impersonation is in effect: the operator may neither list nor get
    // Secrets.
    let secrets = Api::<Secret>::namespaced(operator_client.clone(), ns);
    let listed = secrets.list(&ListParams::default()).await;
    ensure!(
        matches!(&listed, Err(kube::Error::Api(s)) if s.code == 403),
        "expected 403 listing Secrets as the operator, got {listed:?}"
    );
    let got = secrets.get("openai-key").await;
    ensure!(
        matches!(&got, Err(kube::Error::Api(s)) if s.code == 403),
        "expected 403 getting a Secret as the operator, got {got:?}"
    );

    applier
        .apply(
            &Doc {
                source: "test".into(),
                value: json!({
                    "apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": "openai-key", "namespace": ns},
                    "stringData": {"apiKey": "sk-test"}
                }),
            },
            false,
        )
        .await?;
    applier
        .apply(
            &Doc {
                source: "test".into(),
                value: json!({
                    "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
                    "metadata": {"name": "inference-gateway", "namespace": ns},
                    "spec": {
                        "gatewayClassName": "test",
                        "listeners": [{"name": "http", "protocol": "HTTP", "port": 80}]
                    }
                }),
            },
            false,
        )
        .await?;

    let metrics = Metrics::new();
    let identity = "kinference-operator-rbac-test";
    let operator = kinference_operator::spawn(
        operator_client,
        Config {
            epp_image: "example.invalid/kinference/epp:test".into(),
            namespace: watch.map(str::to_string),
            leader_election: Some(LeaderElectionConfig::new(operator_ns, identity)),
            instance: Some(identity.into()),
            requeue: Requeue {
                resync: Duration::from_secs(60),
                pending: Duration::from_millis(500),
                error: Duration::from_millis(500),
            },
            metrics: metrics.clone(),
            ..Config::default()
        },
    );

    let policies: Api<InferencePolicy> = Api::namespaced(admin.clone(), ns);
    let policy: InferencePolicy = serde_json::from_value(json!({
        "apiVersion": "kinference.io/v1alpha1",
        "kind": "InferencePolicy",
        "metadata": {"name": "chat", "namespace": ns},
        "spec": policy_with_provider()
    }))?;
    policies.create(&PostParams::default(), &policy).await?;
    wait_condition(&policies, "chat", "Accepted", "True").await?;

    let generated = [
        object("v1", "ServiceAccount", ns, "chat-epp"),
        object("rbac.authorization.k8s.io/v1", "Role", ns, "chat-epp"),
        object(
            "rbac.authorization.k8s.io/v1",
            "RoleBinding",
            ns,
            "chat-epp",
        ),
        object("v1", "ConfigMap", ns, "chat-policy"),
        object("v1", "ConfigMap", ns, "chat-epp-status"),
        object("v1", "Service", ns, "chat-epp"),
        object("apps/v1", "Deployment", ns, "chat-epp"),
        object("networking.k8s.io/v1", "NetworkPolicy", ns, "chat-epp"),
        object(
            "inference.networking.k8s.io/v1",
            "InferencePool",
            ns,
            "chat",
        ),
        object("gateway.networking.k8s.io/v1", "HTTPRoute", ns, "chat"),
    ];
    let provider_service = object("v1", "Service", ns, "chat-provider-openai");
    for doc in generated.iter().chain([&provider_service]) {
        ensure!(
            exists(&applier, doc).await?,
            "the operator did not create {}",
            doc.describe()
        );
    }
    // BackendTLSPolicy: the https provider's, whatever its name.
    let tls = applier.api_for(&object(
        "gateway.networking.k8s.io/v1",
        "BackendTLSPolicy",
        ns,
        "x",
    ))?;
    ensure!(
        !tls.list(&ListParams::default()).await?.items.is_empty(),
        "no BackendTLSPolicy for the https provider"
    );

    // The EPP's side, as its ServiceAccount with only the generated Role:
    // its Pod reports the key found in its mounted Secret, and ResolvedRefs
    // follows. It may not patch Pods, nor read Secrets.
    play_the_epp(cluster, &applier, ns).await?;
    wait_condition(&policies, "chat", "ResolvedRefs", "True").await?;

    // Pruning (delete): drop the provider.
    let mut current = policies.get("chat").await?;
    current.spec = serde_json::from_value(
        find(&kind_scenario()?, "InferencePolicy", "chat")?.value["spec"].clone(),
    )?;
    policies
        .replace("chat", &PostParams::default(), &current)
        .await?;
    wait_condition(&policies, "chat", "Accepted", "True").await?;
    eventually(
        "the provider Service and BackendTLSPolicy to be pruned",
        || async {
            let svc = exists(&applier, &provider_service).await?;
            let tls_left = tls.list(&ListParams::default()).await?.items.len();
            Ok((!svc && tls_left == 0).then_some(()))
        },
    )
    .await?;

    // A refused policy: the status reads the ConfigMap's last good hash.
    let mut current = policies.get("chat").await?;
    let mut spec = serde_json::to_value(&current.spec)?;
    spec["rules"][0]["route"]["select"] = json!([{"type": "Provider", "order": ["nope"]}]);
    current.spec = serde_json::from_value(spec)?;
    policies
        .replace("chat", &PostParams::default(), &current)
        .await?;
    wait_condition(&policies, "chat", "Accepted", "False").await?;

    // Events were published (create) in the policy's namespace.
    let events = Api::<Event>::namespaced(admin.clone(), ns)
        .list(&ListParams::default())
        .await?;
    ensure!(
        events
            .items
            .iter()
            .any(|e| e.reporting_controller.as_deref() == Some("kinference-operator")),
        "no Event from kinference-operator: {:?}",
        events.items.iter().map(|e| &e.reason).collect::<Vec<_>>()
    );
    // The leader Lease (create, get, update).
    let leases = Api::<Lease>::namespaced(admin.clone(), operator_ns);
    let lease = leases.get("kinference-operator").await?;
    ensure!(
        lease.spec.and_then(|s| s.holder_identity).as_deref() == Some(identity),
        "the operator does not hold the Lease"
    );

    operator
        .stop()
        .await
        .map_err(|e| anyhow!("operator stopped with an error: {e}"))?;
    // Released on shutdown (get + update).
    let lease = leases.get("kinference-operator").await?;
    ensure!(
        lease.spec.and_then(|s| s.holder_identity).is_none(),
        "the Lease was not released"
    );
    ensure!(
        metrics.reconciles("error") == 0,
        "{} reconciles failed (missing permissions?); {} succeeded",
        metrics.reconciles("error"),
        metrics.reconciles("success")
    );
    Ok(())
}

/// What the EPP of policy `chat` in `ns` does against the API, as its
/// ServiceAccount: its Pod (created here, no kubelet) reports the policy's
/// hash and the provider key found under its own key of the EPP status
/// ConfigMap. The generated Role must allow exactly that, and not patching
/// a Pod, writing its policy ConfigMap or reading a Secret.
async fn play_the_epp(cluster: &TestCluster, applier: &Applier, ns: &str) -> Result<()> {
    let admin = cluster.client();
    let deployment = applier
        .api_for(&object("apps/v1", "Deployment", ns, "chat-epp"))?
        .get("chat-epp")
        .await?;
    let labels = deployment.data["spec"]["template"]["metadata"]["labels"].clone();
    let pod = "chat-epp-5c7d9-abcde";
    Api::<Pod>::namespaced(admin.clone(), ns)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": pod, "labels": labels},
                "spec": {"containers": [{"name": "epp", "image": "example.invalid/epp:test"}]}
            }))?,
        )
        .await?;
    let hash = Api::<ConfigMap>::namespaced(admin.clone(), ns)
        .get("chat-policy")
        .await?
        .data
        .and_then(|d| d.get(kinference_api::POLICY_HASH_KEY).cloned())
        .context("the policy hash")?;
    let epp = cluster
        .client_as(&format!("system:serviceaccount:{ns}:chat-epp"))
        .await?;
    let report = EppPodStatus {
        loaded_hash: hash,
        secret_keys: Some(vec![SecretKeyStatus {
            secret: "openai-key".into(),
            key: "apiKey".into(),
            found: true,
        }]),
    };
    let configmaps = Api::<ConfigMap>::namespaced(epp.clone(), ns);
    configmaps
        .patch(
            "chat-epp-status",
            &PatchParams {
                field_manager: Some(epp_field_manager(pod)),
                ..PatchParams::default()
            },
            &Patch::Merge(json!({"data": {pod: report.to_json()}})),
        )
        .await
        .context("the EPP reporting in its status ConfigMap")?;
    let forbidden = |what: &str, result: Result<(), kube::Error>| {
        ensure!(
            matches!(&result, Err(kube::Error::Api(s)) if s.code == 403),
            "the EPP may {what}: {result:?}"
        );
        Ok(())
    };
    let label = json!({"metadata": {"labels": {"e2e": "x"}}});
    forbidden(
        "patch its own Pod",
        Api::<Pod>::namespaced(epp.clone(), ns)
            .patch(pod, &PatchParams::default(), &Patch::Merge(&label))
            .await
            .map(drop),
    )?;
    forbidden(
        "patch its policy ConfigMap",
        configmaps
            .patch(
                "chat-policy",
                &PatchParams::default(),
                &Patch::Merge(&label),
            )
            .await
            .map(drop),
    )?;
    forbidden(
        "read a provider Secret",
        Api::<Secret>::namespaced(epp, ns)
            .get("openai-key")
            .await
            .map(drop),
    )?;
    Ok(())
}

/// The operator, as the manifests' ServiceAccount with only the manifests'
/// RBAC, reconciles a policy end to end without a single failed reconcile,
/// and the ServiceAccount is denied what the operator does not use.
#[tokio::test]
async fn operator_runs_with_the_manifest_rbac() -> Result<()> {
    // Owner references with blockOwnerDeletion need update on the owner's
    // finalizers where this plugin runs (OpenShift enables it).
    let cluster = TestCluster::start_with(StartOptions {
        extra_apiserver_args: vec![
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement".into(),
        ],
        ..StartOptions::default()
    })
    .await?;
    let admin = cluster.client();
    let ns = "team-rbac";
    drive_a_policy_as_the_operator(
        &cluster,
        &manifests()?,
        OPERATOR_USER,
        OPERATOR_NS,
        None,
        ns,
    )
    .await?;

    // Owner references with blockOwnerDeletion, where the API server
    // enforces owner-reference permissions.
    ensure!(
        access_allowed(
            &admin,
            OPERATOR_USER,
            "update",
            "kinference.io",
            "inferencepolicies/finalizers",
            ns,
            None
        )
        .await?,
        "the operator may not set blockOwnerDeletion on its objects"
    );
    // What the watches need but a short run might not show.
    for (group, resource) in WATCHED {
        for verb in ["list", "watch"] {
            ensure!(
                access_allowed(&admin, OPERATOR_USER, verb, group, resource, "", None).await?,
                "the operator may not {verb} {resource} cluster-wide"
            );
        }
    }
    // Least privilege: what the operator never does is denied.
    let denied: [(&str, &str, &str, &str, Option<&str>); 21] = [
        ("get", "", "secrets", ns, Some("openai-key")),
        ("list", "", "secrets", ns, None),
        ("watch", "", "secrets", ns, None),
        ("update", "", "secrets", ns, Some("openai-key")),
        ("delete", "", "pods", ns, None),
        ("create", "", "pods", ns, None),
        ("patch", "", "pods", ns, None),
        ("update", "apps", "deployments", ns, None),
        ("delete", "apps", "deployments", ns, None),
        ("delete", "", "configmaps", ns, None),
        ("deletecollection", "", "services", ns, None),
        ("delete", "rbac.authorization.k8s.io", "roles", ns, None),
        ("escalate", "rbac.authorization.k8s.io", "roles", ns, None),
        ("bind", "rbac.authorization.k8s.io", "roles", ns, None),
        (
            "create",
            "rbac.authorization.k8s.io",
            "clusterroles",
            "",
            None,
        ),
        ("update", "kinference.io", "inferencepolicies", ns, None),
        ("delete", "kinference.io", "inferencepolicies", ns, None),
        ("patch", "gateway.networking.k8s.io", "gateways", ns, None),
        ("update", "networking.k8s.io", "networkpolicies", ns, None),
        (
            "update",
            "coordination.k8s.io",
            "leases",
            OPERATOR_NS,
            Some("someone-else"),
        ),
        (
            "get",
            "coordination.k8s.io",
            "leases",
            ns,
            Some("kinference-operator"),
        ),
    ];
    for (verb, group, resource, namespace, name) in denied {
        ensure!(
            !access_allowed(
                &admin,
                OPERATOR_USER,
                verb,
                group,
                resource,
                namespace,
                name
            )
            .await?,
            "the operator may {verb} {group}/{resource} in {namespace:?} {name:?}: more than it needs"
        );
    }
    Ok(())
}

/// The namespace-scoped install (`kustomize/overlays/namespaced`): the
/// operator, in the namespace it manages, with a Role instead of the
/// ClusterRole, reconciles a policy there end to end, and may do nothing in
/// any other namespace.
#[tokio::test]
async fn operator_runs_with_the_namespaced_rbac() -> Result<()> {
    let Some(kubectl) = kubectl() else {
        eprintln!("NOTE: kubectl not found: the namespaced overlay was not rendered nor run");
        return Ok(());
    };
    let docs = render_overlay(&kubectl, "namespaced")?;
    let ns = NAMESPACED_NS;
    let user = format!("system:serviceaccount:{ns}:{OPERATOR_SA}");
    let cluster = TestCluster::start().await?;
    let admin = cluster.client();
    drive_a_policy_as_the_operator(&cluster, &docs, &user, ns, Some(ns), ns).await?;

    for (group, resource) in WATCHED {
        for verb in ["list", "watch"] {
            ensure!(
                access_allowed(&admin, &user, verb, group, resource, ns, None).await?,
                "the operator may not {verb} {resource} in {ns}"
            );
            ensure!(
                !access_allowed(&admin, &user, verb, group, resource, "", None).await?,
                "the namespaced operator may {verb} {resource} cluster-wide"
            );
            ensure!(
                !access_allowed(&admin, &user, verb, group, resource, "default", None).await?,
                "the namespaced operator may {verb} {resource} in another namespace"
            );
        }
    }
    for (verb, group, resource, name) in [
        ("get", "", "secrets", Some("openai-key")),
        ("patch", "", "pods", None),
        ("escalate", "rbac.authorization.k8s.io", "roles", None),
    ] {
        ensure!(
            !access_allowed(&admin, &user, verb, group, resource, ns, name).await?,
            "the namespaced operator may {verb} {resource}"
        );
    }
    Ok(())
}

/// Every object of `manifests/` carries the part-of label (for
/// `kubectl get all -l app.kubernetes.io/part-of=kinference`).
fn operator_ns_objects_are_labelled(docs: &[Doc]) -> Result<()> {
    for doc in docs {
        ensure!(
            doc.value["metadata"]["labels"]["app.kubernetes.io/part-of"] == json!("kinference"),
            "{} lacks app.kubernetes.io/part-of",
            doc.describe()
        );
    }
    Ok(())
}

#[test]
fn manifests_are_labelled() -> Result<()> {
    operator_ns_objects_are_labelled(&manifests()?)
}

#[test]
fn the_policy_resource_names_are_what_the_rbac_test_expects() -> Result<()> {
    // Guards the object names hard-coded in operator_runs_with_the_manifest_rbac.
    let policy: InferencePolicy = serde_json::from_value(json!({
        "apiVersion": "kinference.io/v1alpha1",
        "kind": "InferencePolicy",
        "metadata": {"name": "chat", "namespace": "team-rbac"},
        "spec": policy_with_provider()
    }))?;
    let names = kinference_operator::resources::Names::of(&policy);
    ensure!(names.epp() == "chat-epp" && names.config_map() == "chat-policy");
    ensure!(names.pool() == "chat");
    ensure!(policy.name_any() == "chat");
    Ok(())
}
