//! The Helm chart (`charts/kinference`) against Helm v4 itself (built from
//! the Go module proxy): it lints, and with its defaults renders exactly the
//! objects of the kustomize install (`kustomize/overlays/default`, rendered
//! by the release's kubectl), namespaced as the namespaced overlay; its
//! copies of generated files stay equal to their sources; its settings reach
//! the objects they name. `e2e/tests/real_scenario.rs` installs and upgrades
//! it on the real node.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context as _, Result, ensure};
use kinference_e2e::cluster::yaml_documents_to_json;
use kinference_e2e::helm;
use kinference_e2e::node::NodeBinaries;
use serde_json::Value;

fn repo_root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Objects by `Kind namespace/name`, numbers as JSON compares them
/// (kustomize writes the CRD's `maximum: 64.0` as `64`).
fn by_identity(docs: Vec<Value>) -> BTreeMap<String, Value> {
    docs.into_iter()
        .map(integral_numbers)
        .map(|d| {
            let key = format!(
                "{} {}/{}",
                d["kind"].as_str().unwrap_or_default(),
                d["metadata"]["namespace"].as_str().unwrap_or_default(),
                d["metadata"]["name"].as_str().unwrap_or_default()
            );
            (key, d)
        })
        .collect()
}

fn integral_numbers(value: Value) -> Value {
    match value {
        Value::Number(n) => match n.as_f64() {
            Some(f) if f.fract() == 0.0 && n.is_f64() => Value::from(f as i64),
            _ => Value::Number(n),
        },
        Value::Array(items) => Value::Array(items.into_iter().map(integral_numbers).collect()),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (k, integral_numbers(v)))
                .collect(),
        ),
        other => other,
    }
}

async fn kustomize(overlay: &str) -> Result<BTreeMap<String, Value>> {
    let kubectl = NodeBinaries::locate().await?.path("kubectl");
    let dir = repo_root().join("kustomize/overlays").join(overlay);
    let out = std::process::Command::new(&kubectl)
        .arg("kustomize")
        .arg(&dir)
        .output()
        .with_context(|| format!("running {}", kubectl.display()))?;
    ensure!(
        out.status.success(),
        "kubectl kustomize {overlay}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(by_identity(yaml_documents_to_json(
        &String::from_utf8_lossy(&out.stdout),
    )?))
}

/// Fails naming every object one side has and the other lacks or renders
/// differently.
fn assert_same(helm: &BTreeMap<String, Value>, kustomize: &BTreeMap<String, Value>) {
    let mut differences = Vec::new();
    for key in helm.keys().chain(kustomize.keys()) {
        match (helm.get(key), kustomize.get(key)) {
            (Some(a), Some(b)) if a == b => {}
            (Some(a), Some(b)) => differences.push(format!(
                "{key} differs:\n  helm:      {a}\n  kustomize: {b}"
            )),
            (Some(_), None) => differences.push(format!("{key}: only in the chart")),
            (None, Some(_)) => differences.push(format!("{key}: only in kustomize")),
            (None, None) => {}
        }
    }
    differences.dedup();
    assert!(differences.is_empty(), "{}", differences.join("\n"));
}

#[test]
fn the_chart_lints_with_every_switch() -> Result<()> {
    let helm = helm::ensure()?;
    let chart = helm::chart_dir();
    let chart = chart.to_string_lossy();
    for set in [
        "",
        "namespaced=true,admissionPolicy.enabled=false",
        "monitoring.podMonitors.enabled=true,monitoring.prometheusRule.enabled=true,\
         monitoring.grafanaDashboard.enabled=true,epp.replicas=2,networkPolicy.enabled=false",
    ] {
        let mut args = vec!["lint", "--strict", &chart];
        if !set.is_empty() {
            args.extend(["--set", set]);
        }
        helm::run(&helm, &args)?;
    }
    Ok(())
}

#[tokio::test]
async fn the_defaults_render_the_kustomize_install_but_its_namespace() -> Result<()> {
    let helm = helm::ensure()?;
    let chart = by_identity(helm::template(&helm, "kinference-system", &[])?);
    let mut kustomize = kustomize("default").await?;
    // Helm installs into a namespace it does not own (`--create-namespace`).
    let namespace = kustomize.remove("Namespace /kinference-system");
    ensure!(
        namespace.is_some(),
        "the kustomize install has no Namespace"
    );
    assert_same(&chart, &kustomize);
    Ok(())
}

#[tokio::test]
async fn namespaced_it_renders_the_namespaced_overlay() -> Result<()> {
    let helm = helm::ensure()?;
    let set = ["namespaced=true", "admissionPolicy.enabled=false"];
    let mut chart = by_identity(helm::template(&helm, "llm", &set)?);
    // A cluster admin's part, as the overlay leaves it out.
    chart.retain(|key, _| !key.starts_with("CustomResourceDefinition "));
    assert_same(&chart, &kustomize("namespaced").await?);
    Ok(())
}

/// Helm reads only files inside the chart: these are copies, and must stay
/// equal to what `kinference crds` generates and what `manifests/` ships.
#[test]
fn the_charts_copies_equal_their_sources() -> Result<()> {
    let root = repo_root();
    for (copy, source) in [
        (
            "charts/kinference/crds/inferencepolicies.kinference.io.yaml",
            "crds/inferencepolicies.kinference.io.yaml",
        ),
        (
            "charts/kinference/files/admission-policy.yaml",
            "crds/inferencepolicies.kinference.io-admission.yaml",
        ),
        (
            "charts/kinference/files/prometheus-rules.yaml",
            "manifests/monitoring/prometheus-rules.yaml",
        ),
        (
            "charts/kinference/files/grafana-dashboard.json",
            "manifests/monitoring/grafana-dashboard.json",
        ),
    ] {
        let read = |p: &str| std::fs::read(root.join(p)).with_context(|| p.to_string());
        ensure!(
            read(copy)? == read(source)?,
            "{copy} differs from {source}: cp {source} {copy}"
        );
    }
    Ok(())
}

#[test]
fn values_reach_the_objects_they_name() -> Result<()> {
    let helm = helm::ensure()?;
    let set = [
        "image.tag=1.2.3",
        "epp.image.repository=registry.example/epp",
        "epp.image.tag=9",
        "epp.replicas=3",
        "replicas=1",
        "monitoring.podMonitors.enabled=true",
        "monitoring.prometheusRule.enabled=true",
        "monitoring.grafanaDashboard.enabled=true",
        "networkPolicy.metricsFrom[0].podSelector.matchLabels.app=vmagent",
    ];
    let objects = by_identity(helm::template(&helm, "ops", &set)?);
    let deployment = &objects["Deployment ops/kinference-operator"];
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(deployment["spec"]["replicas"], 1);
    assert_eq!(container["image"], "ghcr.io/kinference/operator:1.2.3");
    let args: Vec<&str> = container["args"]
        .as_array()
        .context("args")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(args.contains(&"--epp-replicas=3"), "{args:?}");
    let env = container["env"].as_array().context("env")?;
    let epp_image = env
        .iter()
        .find(|e| e["name"] == "KINFERENCE_EPP_IMAGE")
        .context("no KINFERENCE_EPP_IMAGE")?;
    assert_eq!(epp_image["value"], "registry.example/epp:9");
    let from = &objects["NetworkPolicy ops/kinference-operator"]["spec"]["ingress"][0]["from"][0];
    assert_eq!(from["podSelector"]["matchLabels"]["app"], "vmagent");

    // Monitoring: the operator's PodMonitor in the release's namespace, the
    // rules as shipped, the dashboard for Grafana's sidecar.
    let operator_monitor = &objects["PodMonitor ops/kinference-operator"];
    assert_eq!(
        operator_monitor["spec"]["namespaceSelector"]["matchNames"][0],
        "ops"
    );
    assert!(objects.contains_key("PodMonitor ops/kinference-epp"));
    let rules = objects
        .iter()
        .find(|(k, _)| k.starts_with("PrometheusRule "))
        .map(|(_, v)| v)
        .context("no PrometheusRule")?;
    let shipped = yaml_documents_to_json(&std::fs::read_to_string(
        repo_root().join("manifests/monitoring/prometheus-rules.yaml"),
    )?)?;
    assert_eq!(rules["spec"], shipped[0]["spec"]);
    let dashboard = &objects["ConfigMap ops/kinference-grafana-dashboard"];
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: Value = serde_json::from_str(
        dashboard["data"]["kinference.json"]
            .as_str()
            .context("no dashboard")?,
    )?;
    let file: Value = serde_json::from_str(&std::fs::read_to_string(
        repo_root().join("manifests/monitoring/grafana-dashboard.json"),
    )?)?;
    assert_eq!(json, file);
    Ok(())
}
