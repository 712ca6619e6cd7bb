//! Go commands the tests run (kstatus, Helm, actionlint), built from the Go
//! module proxy by `e2e/tools/install-<name>.sh` and cached.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};

/// `$env_var` when set (CI installs the tool first), else the path
/// `e2e/tools/install-<name>.sh` prints (building it when missing).
pub fn installed(name: &str, env_var: &str) -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os(env_var).filter(|p| !p.is_empty()) {
        return Ok(path.into());
    }
    let script = format!("{}/tools/install-{name}.sh", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {script}"))?;
    if !out.status.success() {
        bail!("{script} failed");
    }
    let path = String::from_utf8_lossy(&out.stdout);
    Ok(PathBuf::from(
        path.lines().last().context("no path printed")?.trim(),
    ))
}
