//! cli-utils' kstatus (Flux's health checks), built from the Go module
//! proxy by `e2e/tools/install-kstatus.sh`: what it computes for an object.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};

/// `$KINFERENCE_KSTATUS`, else the cached build (built when missing).
pub fn ensure() -> anyhow::Result<PathBuf> {
    crate::tools::installed("kstatus", "KINFERENCE_KSTATUS")
}

/// kstatus's status (`Current`, `InProgress`, `Failed`, ...) and message
/// for `object`.
pub fn compute(
    kstatus: &std::path::Path,
    object: &impl serde::Serialize,
) -> anyhow::Result<(String, String)> {
    let mut child = Command::new(kstatus)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", kstatus.display()))?;
    let mut line = serde_json::to_vec(object)?;
    line.push(b'\n');
    child.stdin.take().context("stdin")?.write_all(&line)?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("kstatus: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let (status, message) = text.trim_end().split_once('\t').context("no verdict")?;
    Ok((status.to_string(), message.to_string()))
}
