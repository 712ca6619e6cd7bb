//! Container images without a registry or a container engine: a one-layer
//! OCI image layout written by hand (uncompressed tar layer, config,
//! manifest, `index.json` naming the image for containerd), packed as the
//! tar archive that `ctr images import` reads.
//!
//! ```ignore
//! let mut files = binary_with_libraries(Path::new("target/release/kinference-sim"), "/kinference-sim")?;
//! files.push(LayerFile::bytes("/etc/passwd", b"nonroot:x:65532:65532::/:/sbin/nologin\n".to_vec(), 0o644));
//! let config = ImageConfig { entrypoint: vec!["/kinference-sim".into()], user: Some("65532:65532".into()), ..Default::default() };
//! write_oci_archive("kinference.local/sim:dev", &files, &config, &dir.join("sim.tar"))?;
//! cluster.import_image(&dir.join("sim.tar")).await?;   // RealCluster
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::json;
use sha2::{Digest as _, Sha256};

/// One entry of the image's single layer.
#[derive(Clone, Debug)]
pub struct LayerFile {
    /// Absolute path inside the image, e.g. `/usr/bin/app`. Parent
    /// directories are added automatically (mode 0755).
    pub path: String,
    pub contents: FileContents,
    /// Permission bits, e.g. `0o755` or `0o1777` (a sticky `/tmp`);
    /// ignored for symlinks.
    pub mode: u32,
}

#[derive(Clone, Debug)]
pub enum FileContents {
    Bytes(Vec<u8>),
    /// Read from this host file when the layer is written (symlinks followed).
    HostFile(PathBuf),
    /// A symbolic link to this target.
    Symlink(String),
    Directory,
}

impl LayerFile {
    pub fn bytes(path: &str, bytes: Vec<u8>, mode: u32) -> Self {
        Self {
            path: path.to_owned(),
            contents: FileContents::Bytes(bytes),
            mode,
        }
    }

    pub fn host_file(path: &str, host: &Path, mode: u32) -> Self {
        Self {
            path: path.to_owned(),
            contents: FileContents::HostFile(host.to_owned()),
            mode,
        }
    }
}

/// The runtime part of an OCI image config (`config` in the config blob).
#[derive(Clone, Debug, Default)]
pub struct ImageConfig {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// `NAME=value` pairs.
    pub env: Vec<String>,
    /// `uid[:gid]` or a name from the image's `/etc/passwd`.
    pub user: Option<String>,
    pub working_dir: Option<String>,
    /// e.g. `8080/tcp`.
    pub exposed_ports: Vec<String>,
    pub labels: BTreeMap<String, String>,
}

/// Digests of a written image.
#[derive(Clone, Debug)]
pub struct ImageDigests {
    /// `sha256:…` of the manifest (what containerd calls the image digest).
    pub manifest: String,
    /// `sha256:…` of the config blob (the image ID the CRI reports).
    pub config: String,
    /// `sha256:…` of the uncompressed layer.
    pub layer: String,
}

/// Write `reference` (e.g. `kinference.local/app:dev`; use a non-`latest`
/// tag or `imagePullPolicy: Never`, there is no registry) as an OCI image
/// layout packed in a tar archive at `archive`, ready for
/// `ctr -n k8s.io images import`.
pub fn write_oci_archive(
    reference: &str,
    files: &[LayerFile],
    config: &ImageConfig,
    archive: &Path,
) -> Result<ImageDigests> {
    ensure!(
        reference.contains(':') && !reference.ends_with(':'),
        "image reference {reference:?} needs a tag"
    );
    let layer = layer_tar(files)?;
    let layer_digest = sha256_digest(&layer);
    let config_blob = serde_json::to_vec(&config_json(config, &layer_digest))?;
    let config_digest = sha256_digest(&config_blob);
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_blob.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": layer_digest,
            "size": layer.len(),
        }],
    }))?;
    let manifest_digest = sha256_digest(&manifest);
    let tag = reference.rsplit(':').next().unwrap_or_default();
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest,
            "size": manifest.len(),
            "platform": { "architecture": oci_architecture(), "os": "linux" },
            "annotations": {
                // containerd names the imported image after this annotation.
                "io.containerd.image.name": reference,
                "org.opencontainers.image.ref.name": tag,
            },
        }],
    }))?;

    let mut tar = TarWriter::default();
    tar.file("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#, 0o644)?;
    tar.file("index.json", &index, 0o644)?;
    tar.directory("blobs/")?;
    tar.directory("blobs/sha256/")?;
    for (digest, blob) in [
        (&layer_digest, &layer),
        (&config_digest, &config_blob),
        (&manifest_digest, &manifest),
    ] {
        let hex = digest.trim_start_matches("sha256:");
        tar.file(&format!("blobs/sha256/{hex}"), blob, 0o644)?;
    }
    fs::write(archive, tar.finish())
        .with_context(|| format!("writing image archive {}", archive.display()))?;
    Ok(ImageDigests {
        manifest: manifest_digest,
        config: config_digest,
        layer: layer_digest,
    })
}

/// A dynamically linked host binary at `image_path`, plus every shared
/// library `ldd` resolves for it (and the dynamic loader) at the same paths
/// as on the host, so it runs in an otherwise empty image. A static binary
/// yields just itself.
pub fn binary_with_libraries(host_binary: &Path, image_path: &str) -> Result<Vec<LayerFile>> {
    let mut files = vec![LayerFile::host_file(image_path, host_binary, 0o755)];
    for library in shared_libraries(host_binary)? {
        let path = library.to_string_lossy().into_owned();
        files.push(LayerFile::host_file(&path, &library, 0o755));
    }
    Ok(files)
}

/// Host paths of the shared libraries of `binary`, per `ldd`.
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = std::process::Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // Static binaries make ldd fail with "not a dynamic executable".
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stdout.contains("not a dynamic executable")
            || stderr.contains("not a dynamic executable")
        {
            return Ok(Vec::new());
        }
        bail!("ldd {} failed: {}", binary.display(), stderr.trim());
    }
    let mut libraries = Vec::new();
    for line in stdout.lines() {
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)`, or the
        // loader: `/lib64/ld-linux-x86-64.so.2 (0x…)`; the vDSO has no file.
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        match path {
            Some(p) if p.starts_with('/') => libraries.push(PathBuf::from(p)),
            Some(p) if line.contains("not found") => {
                bail!("ldd: {p} not found for {}", binary.display())
            }
            _ => {}
        }
    }
    Ok(libraries)
}

fn config_json(config: &ImageConfig, layer_digest: &str) -> serde_json::Value {
    let ports: serde_json::Map<String, serde_json::Value> = config
        .exposed_ports
        .iter()
        .map(|p| (p.clone(), json!({})))
        .collect();
    let mut runtime = json!({
        "Env": config.env,
        "Entrypoint": config.entrypoint,
        "Cmd": config.cmd,
        "ExposedPorts": ports,
        "Labels": config.labels,
    });
    if let Some(user) = &config.user {
        runtime["User"] = json!(user);
    }
    if let Some(dir) = &config.working_dir {
        runtime["WorkingDir"] = json!(dir);
    }
    json!({
        "architecture": oci_architecture(),
        "os": "linux",
        "config": runtime,
        "rootfs": { "type": "layers", "diff_ids": [layer_digest] },
        "history": [{ "created_by": "kinference-e2e write_oci_archive" }],
    })
}

/// The layer as an uncompressed tar: every parent directory first, then the
/// entries sorted by path (deterministic bytes for the same inputs).
fn layer_tar(files: &[LayerFile]) -> Result<Vec<u8>> {
    let mut by_path = BTreeMap::new();
    for file in files {
        let rel = file.path.trim_start_matches('/').trim_end_matches('/');
        ensure!(
            !rel.is_empty()
                && !rel
                    .split('/')
                    .any(|c| c == ".." || c == "." || c.is_empty()),
            "bad image path {:?}",
            file.path
        );
        by_path.insert(rel.to_owned(), file);
    }
    let mut dirs = BTreeSet::new();
    for rel in by_path.keys() {
        let mut parent = Path::new(rel).parent();
        while let Some(p) = parent.filter(|p| !p.as_os_str().is_empty()) {
            dirs.insert(p.to_string_lossy().into_owned());
            parent = p.parent();
        }
    }
    let mut tar = TarWriter::default();
    for dir in &dirs {
        if !by_path.contains_key(dir) {
            tar.directory(&format!("{dir}/"))?;
        }
    }
    for (rel, file) in &by_path {
        match &file.contents {
            FileContents::Bytes(bytes) => tar.file(rel, bytes, file.mode)?,
            FileContents::HostFile(host) => {
                let bytes =
                    fs::read(host).with_context(|| format!("reading {}", host.display()))?;
                tar.file(rel, &bytes, file.mode)?;
            }
            FileContents::Symlink(target) => tar.symlink(rel, target)?,
            FileContents::Directory => tar.directory_with_mode(&format!("{rel}/"), file.mode)?,
        }
    }
    Ok(tar.finish())
}

fn sha256_digest(bytes: &[u8]) -> String {
    let hash = Sha256::digest(bytes);
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

fn oci_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// A minimal ustar writer: regular files, directories and symlinks owned by
/// root, mtime 0.
#[derive(Default)]
struct TarWriter {
    out: Vec<u8>,
}

impl TarWriter {
    fn file(&mut self, path: &str, bytes: &[u8], mode: u32) -> Result<()> {
        self.header(path, b'0', mode, bytes.len() as u64, "")?;
        self.out.extend_from_slice(bytes);
        self.pad();
        Ok(())
    }

    fn directory(&mut self, path: &str) -> Result<()> {
        self.directory_with_mode(path, 0o755)
    }

    fn directory_with_mode(&mut self, path: &str, mode: u32) -> Result<()> {
        self.header(path, b'5', mode, 0, "")
    }

    fn symlink(&mut self, path: &str, target: &str) -> Result<()> {
        self.header(path, b'2', 0o777, 0, target)
    }

    fn finish(mut self) -> Vec<u8> {
        // Two zero blocks end the archive.
        self.out.extend_from_slice(&[0; 1024]);
        self.out
    }

    fn pad(&mut self) {
        let rem = self.out.len() % 512;
        if rem != 0 {
            self.out.extend(std::iter::repeat_n(0, 512 - rem));
        }
    }

    fn header(&mut self, path: &str, kind: u8, mode: u32, size: u64, link: &str) -> Result<()> {
        let (prefix, name) = split_ustar_path(path)?;
        ensure!(link.len() <= 100, "symlink target too long: {link}");
        let mut h = [0u8; 512];
        put(&mut h[0..100], name.as_bytes());
        put(&mut h[100..108], format!("{mode:07o}\0").as_bytes());
        put(&mut h[108..116], b"0000000\0"); // uid
        put(&mut h[116..124], b"0000000\0"); // gid
        put(&mut h[124..136], format!("{size:011o}\0").as_bytes());
        put(&mut h[136..148], b"00000000000\0"); // mtime
        put(&mut h[148..156], b"        "); // checksum placeholder
        h[156] = kind;
        put(&mut h[157..257], link.as_bytes());
        put(&mut h[257..265], b"ustar\x0000");
        put(&mut h[265..269], b"root");
        put(&mut h[297..301], b"root");
        put(&mut h[345..500], prefix.as_bytes());
        let checksum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        put(&mut h[148..156], format!("{checksum:06o}\0 ").as_bytes());
        self.out.extend_from_slice(&h);
        Ok(())
    }
}

fn put(field: &mut [u8], value: &[u8]) {
    field[..value.len()].copy_from_slice(value);
}

/// ustar keeps names of up to 100 bytes, plus a 155-byte prefix split at a `/`.
fn split_ustar_path(path: &str) -> Result<(&str, &str)> {
    if path.len() <= 100 {
        return Ok(("", path));
    }
    let trimmed = path.trim_end_matches('/');
    for (i, _) in trimmed.match_indices('/') {
        let (prefix, name) = (&path[..i], &path[i + 1..]);
        if prefix.len() <= 155 && name.len() <= 100 {
            return Ok((prefix, name));
        }
    }
    bail!("path too long for a ustar archive: {path}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_lists_parents_before_children() {
        let files = [LayerFile::bytes("/a/b/c.txt", b"hi".to_vec(), 0o644)];
        let tar = layer_tar(&files).unwrap();
        let names: Vec<String> = tar
            .chunks(512)
            .filter(|h| h[257..262] == *b"ustar")
            .map(|h| {
                String::from_utf8_lossy(&h[..100])
                    .trim_end_matches('\0')
                    .to_owned()
            })
            .collect();
        assert_eq!(names, ["a/", "a/b/", "a/b/c.txt"]);
    }

    #[test]
    fn long_paths_use_the_prefix_field() {
        let long = format!("{}/{}", "d".repeat(120), "f".repeat(50));
        let (prefix, name) = split_ustar_path(&long).unwrap();
        assert_eq!(prefix.len(), 120);
        assert_eq!(name.len(), 50);
    }
}
