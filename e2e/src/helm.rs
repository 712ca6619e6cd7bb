//! Helm v4, built from the Go module proxy by `e2e/tools/install-helm.sh`,
//! and the project's chart (`charts/kinference`) run through it.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};
use serde_json::Value;

use crate::cluster::yaml_documents_to_json;

/// `$KINFERENCE_HELM`, else the cached build (built when missing).
pub fn ensure() -> anyhow::Result<PathBuf> {
    crate::tools::installed("helm", "KINFERENCE_HELM")
}

/// The chart's directory.
pub fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/kinference")
}

/// Runs `helm <args>`; its stdout, or an error with its stderr.
pub fn run(helm: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(helm)
        .args(args)
        // No user configuration, cache or repositories leak in.
        .env("HELM_CONFIG_HOME", scratch("config"))
        .env("HELM_CACHE_HOME", scratch("cache"))
        .env("HELM_DATA_HOME", scratch("data"))
        .output()
        .with_context(|| format!("running helm {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "helm {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `helm template` of the chart as release `kinference` in `namespace`
/// with `--set` values, CRDs included, as JSON objects.
pub fn template(helm: &Path, namespace: &str, set: &[&str]) -> anyhow::Result<Vec<Value>> {
    let chart = chart_dir();
    let chart = chart.to_string_lossy();
    let mut args = vec![
        "template",
        "kinference",
        &chart,
        "--namespace",
        namespace,
        "--include-crds",
    ];
    for value in set {
        args.extend(["--set", value]);
    }
    yaml_documents_to_json(&run(helm, &args)?)
}

fn scratch(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kinference-helm-{}-{what}", std::process::id()))
}
