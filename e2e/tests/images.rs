//! The images `kinference-images` writes, read by containers/image, the
//! library under `skopeo copy` and `podman load` (e2e/tools/imagecopy,
//! from the Go module proxy): each archive copies to an OCI layout and to
//! a directory with every digest verified, and the copy's config runs the
//! binary as nonroot. A damaged archive is refused. (`ctr images import`,
//! which `kind load image-archive` runs on its nodes, imports them in the
//! real-node tier.)

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, Result, ensure};
use kinference_e2e::node::workspace_images::{self, ALL, archive_name};

fn imagecopy() -> Result<PathBuf> {
    kinference_e2e::tools::installed("imagecopy", "KINFERENCE_IMAGECOPY")
}

/// `imagecopy src dst`: the copied image's config, or what it printed.
fn copy(src: &str, dst: &str) -> Result<serde_json::Value, String> {
    let out = Command::new(imagecopy().map_err(|e| e.to_string())?)
        .args([src, dst])
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
}

fn archives(dir: &Path) -> Result<()> {
    let bins = workspace_images::image_binaries()?;
    workspace_images::write_archives(&bins, dir).context("writing the archives")?;
    Ok(())
}

#[test]
fn every_archive_copies_with_its_digests_verified_and_runs_as_nonroot() -> Result<()> {
    let dir = tempfile::tempdir()?;
    archives(dir.path())?;
    for image in ALL {
        let archive = dir.path().join(archive_name(&image));
        let src = format!("oci-archive:{}", archive.display());
        let layout = format!(
            "oci:{}:{}",
            dir.path().join("layout").display(),
            image.binary
        );
        let config = copy(&src, &layout).map_err(anyhow::Error::msg)?;
        ensure!(config["config"]["User"] == "nonroot", "{config}");
        ensure!(
            config["config"]["Entrypoint"] == serde_json::json!([image.binary_path()]),
            "{config}"
        );
        ensure!(config["os"] == "linux", "{config}");
        let plain = format!("dir:{}", dir.path().join(image.binary).display());
        let again = copy(&src, &plain).map_err(anyhow::Error::msg)?;
        ensure!(again == config, "{again} differs from {config}");
    }
    Ok(())
}

#[test]
fn a_damaged_archive_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    archives(dir.path())?;
    let image = ALL[0];
    let archive = dir.path().join(archive_name(&image));
    let mut bytes = std::fs::read(&archive)?;
    // A byte in the middle of the layer (the binary): its digest no longer holds.
    let at = bytes.len() / 2;
    bytes[at] ^= 0xff;
    std::fs::write(&archive, bytes)?;
    let layout = format!("oci:{}:x", dir.path().join("layout").display());
    let refused = copy(&format!("oci-archive:{}", archive.display()), &layout);
    let error = refused.err().context("a damaged archive was copied")?;
    ensure!(error.contains("Digest did not match"), "{error}");
    Ok(())
}
