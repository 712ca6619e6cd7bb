//! Images of the workspace's own binaries (the operator, the EPP, the
//! simulator), built from its release binaries the way `Dockerfile.operator`,
//! `Dockerfile.epp` and `Dockerfile.simulator` build them, and imported
//! under the names `e2e/kind.sh` gives them (`kinference/<name>:dev`).
//!
//! The Dockerfiles cannot be built here (no registry to pull the distroless
//! base from), so each image is the binary plus what the base provides that
//! it uses: the host's glibc and libgcc (the base is Debian 12, as is the
//! host that built the binary), CA certificates, the `nonroot` user and a
//! sticky `/tmp`. [`WorkspaceImage::check_dockerfile`] keeps the two honest:
//! the Dockerfile's runtime stage must copy the same binary to the same
//! path, as the same user, with the same entrypoint and exposed ports.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context as _, Result, anyhow, ensure};

use super::images::{
    FileContents, ImageConfig, LayerFile, binary_with_libraries, write_oci_archive,
};
use super::{ImageDigests, RealCluster};

/// The runtime base every Dockerfile uses, which these images stand in for.
pub const DISTROLESS_BASE: &str = "gcr.io/distroless/cc-debian12:nonroot";
/// The base's `nonroot` user (`USER nonroot` in the Dockerfiles).
pub const NONROOT_USER: &str = "nonroot";
pub const NONROOT_UID: u32 = 65532;
/// Skip `cargo build --profile dist` and take the binaries from this directory
/// (CI passes its debug build: the same code, without a second compile of
/// every dependency in release mode).
pub const IMAGE_BIN_DIR_ENV: &str = "KINFERENCE_IMAGE_BIN_DIR";

const BINARY_DIR: &str = "/usr/local/bin";
const CA_CERTIFICATES: &str = "/etc/ssl/certs/ca-certificates.crt";
/// As the distroless base's image config.
const BASE_ENV: [&str; 2] = [
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
];

/// One of the workspace's images.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkspaceImage {
    /// The Dockerfile at the repository root that builds it.
    pub dockerfile: &'static str,
    /// `cargo build -p <package> --bin <binary>`.
    pub package: &'static str,
    pub binary: &'static str,
    /// The tag `e2e/kind.sh` builds and the kind manifests run.
    pub reference: &'static str,
    /// TCP ports the image exposes.
    pub ports: &'static [u16],
}

pub const OPERATOR: WorkspaceImage = WorkspaceImage {
    dockerfile: "Dockerfile.operator",
    package: "kinference-operator",
    binary: "kinference-operator",
    reference: "kinference/operator:dev",
    ports: &[8080],
};

pub const EPP: WorkspaceImage = WorkspaceImage {
    dockerfile: "Dockerfile.epp",
    package: "kinference-epp",
    binary: "kinference-epp",
    reference: "kinference/epp:dev",
    ports: &[9002, 9003, 9090],
};

pub const SIMULATOR: WorkspaceImage = WorkspaceImage {
    dockerfile: "Dockerfile.simulator",
    package: "kinference-simulator",
    binary: "kinference-sim",
    reference: "kinference/sim:dev",
    ports: &[8000],
};

pub const ALL: [WorkspaceImage; 3] = [OPERATOR, EPP, SIMULATOR];

impl WorkspaceImage {
    /// Where the binary is in the image (the Dockerfile's COPY destination).
    pub fn binary_path(&self) -> String {
        format!("{BINARY_DIR}/{}", self.binary)
    }

    /// The name containerd (and so the kubelet) knows the image by: Docker
    /// Hub's normalised form of [`WorkspaceImage::reference`].
    pub fn containerd_name(&self) -> String {
        normalized_reference(self.reference)
    }

    /// The image config: the Dockerfile's ENTRYPOINT, USER and EXPOSE on the
    /// base's environment.
    pub fn config(&self) -> ImageConfig {
        ImageConfig {
            entrypoint: vec![self.binary_path()],
            env: BASE_ENV.iter().map(|e| (*e).to_owned()).collect(),
            user: Some(NONROOT_USER.to_owned()),
            working_dir: Some("/".to_owned()),
            exposed_ports: self.ports.iter().map(|p| format!("{p}/tcp")).collect(),
            ..ImageConfig::default()
        }
    }

    /// The layer: the binary from `release_dir`, its shared libraries and
    /// the base's files.
    pub fn files(&self, release_dir: &Path) -> Result<Vec<LayerFile>> {
        let binary = release_dir.join(self.binary);
        ensure!(
            binary.is_file(),
            "{} is missing: build it with `cargo build [--release] --locked -p {} --bin {}`",
            binary.display(),
            self.package,
            self.binary
        );
        let mut files = binary_with_libraries(&binary, &self.binary_path())?;
        files.extend(distroless_files());
        Ok(files)
    }

    /// Differences between this image and the runtime stage of its
    /// Dockerfile (empty when they agree).
    pub fn check_dockerfile(&self, dockerfile: &Dockerfile) -> Vec<String> {
        let mut problems = Vec::new();
        let mut expect = |what: &str, dockerfile: String, here: String| {
            if dockerfile != here {
                problems.push(format!(
                    "{}: {what}: Dockerfile {dockerfile:?}, e2e image {here:?}",
                    self.dockerfile
                ));
            }
        };
        let config = self.config();
        expect(
            "runtime base",
            dockerfile.base.clone(),
            DISTROLESS_BASE.into(),
        );
        expect(
            "COPY destination",
            dockerfile.copy_destinations.join(" "),
            self.binary_path(),
        );
        expect(
            "USER",
            dockerfile.user.clone().unwrap_or_default(),
            config.user.unwrap_or_default(),
        );
        expect(
            "EXPOSE",
            dockerfile.exposed_ports.join(" "),
            config.exposed_ports.join(" "),
        );
        expect(
            "ENTRYPOINT",
            dockerfile.entrypoint.join(" "),
            config.entrypoint.join(" "),
        );
        expect(
            "cargo build -p/--bin",
            dockerfile.cargo_targets.join(" "),
            format!("{}/{}", self.package, self.binary),
        );
        problems
    }
}

/// What the distroless base holds that the binaries use.
fn distroless_files() -> Vec<LayerFile> {
    let mut files = vec![
        LayerFile::bytes(
            "/etc/passwd",
            format!(
                "root:x:0:0:root:/root:/sbin/nologin\n\
                 nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n\
                 {NONROOT_USER}:x:{NONROOT_UID}:{NONROOT_UID}:nonroot:/home/nonroot:/sbin/nologin\n"
            )
            .into_bytes(),
            0o644,
        ),
        LayerFile::bytes(
            "/etc/group",
            format!("root:x:0:\nnobody:x:65534:\n{NONROOT_USER}:x:{NONROOT_UID}:\n").into_bytes(),
            0o644,
        ),
        LayerFile {
            path: "/tmp".into(),
            contents: FileContents::Directory,
            mode: 0o1777,
        },
    ];
    if Path::new(CA_CERTIFICATES).is_file() {
        files.push(LayerFile::host_file(
            CA_CERTIFICATES,
            Path::new(CA_CERTIFICATES),
            0o644,
        ));
    }
    files
}

/// `kinference/operator:dev` → `docker.io/kinference/operator:dev`, as the
/// CRI normalises image names (a first component without `.` or `:` is not
/// a registry).
pub fn normalized_reference(reference: &str) -> String {
    let first = reference.split('/').next().unwrap_or_default();
    let has_registry = reference.contains('/')
        && (first.contains('.') || first.contains(':') || first == "localhost");
    match (has_registry, reference.contains('/')) {
        (true, _) => reference.to_owned(),
        (false, true) => format!("docker.io/{reference}"),
        (false, false) => format!("docker.io/library/{reference}"),
    }
}

/// The repository root (the Dockerfiles, `manifests/`, `kustomize/`).
pub fn repo_root() -> PathBuf {
    let e2e = Path::new(env!("CARGO_MANIFEST_DIR"));
    e2e.parent().unwrap_or(e2e).to_owned()
}

/// The directory with the images' binaries: `$KINFERENCE_IMAGE_BIN_DIR`, else
/// `cargo build --profile dist --locked` of the three images' binaries (a
/// no-op when they are up to date) and its `target/dist`.
pub fn image_binaries() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os(IMAGE_BIN_DIR_ENV).filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = std::process::Command::new(cargo);
    command.args(["build", "--profile", "dist", "--locked"]);
    for image in ALL {
        command.args(["-p", image.package, "--bin", image.binary]);
    }
    // stderr is inherited: a cold release build takes minutes.
    let status = command
        .current_dir(repo_root())
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .status()
        .context("running cargo build --profile dist")?;
    ensure!(
        status.success(),
        "cargo build --profile dist failed: {status}"
    );
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    Ok(target.join("dist"))
}

/// Writes every workspace image, from the binaries in `bin_dir` (stripped
/// on the way), as an OCI archive in `out_dir` named as [`archive_name`]
/// says, under its [`WorkspaceImage::reference`]. What `kinference-images`
/// runs, and what the real-node tier imports.
pub fn write_archives(bin_dir: &Path, out_dir: &Path) -> Result<Vec<(PathBuf, ImageDigests)>> {
    let stripped = out_dir.join(".stripped");
    std::fs::create_dir_all(&stripped)
        .with_context(|| format!("creating {}", stripped.display()))?;
    let written = ALL
        .iter()
        .map(|image| {
            strip_into(&bin_dir.join(image.binary), &stripped.join(image.binary))?;
            let archive = out_dir.join(archive_name(image));
            let digests = write_oci_archive(
                &image.containerd_name(),
                &image.files(&stripped)?,
                &image.config(),
                &archive,
            )
            .with_context(|| format!("writing {}", image.reference))?;
            Ok((archive, digests))
        })
        .collect();
    let _ = std::fs::remove_dir_all(&stripped);
    written
}

/// `<binary>.oci.tar`.
pub fn archive_name(image: &WorkspaceImage) -> String {
    format!("{}.oci.tar", image.binary)
}

/// A copy of `binary` without symbols or debug sections (binutils'
/// `strip`), as `cargo build --profile dist` makes them: the images carry
/// no line tables (139 to 168 MB of the release binaries are).
fn strip_into(binary: &Path, out: &Path) -> Result<()> {
    ensure!(
        binary.is_file(),
        "{} is missing: build it with `cargo build --profile dist --locked` (or pass --bin-dir)",
        binary.display()
    );
    let status = std::process::Command::new("strip")
        .arg("--strip-all")
        .arg("-o")
        .arg(out)
        .arg(binary)
        .status()
        .context("running strip (binutils)")?;
    ensure!(
        status.success(),
        "strip {} failed: {status}",
        binary.display()
    );
    Ok(())
}

/// Writes every workspace image from `bin_dir` and imports it into the
/// real node's containerd (`ctr images import`).
pub fn import_all(cluster: &RealCluster, bin_dir: &Path) -> Result<Vec<ImageDigests>> {
    let out = cluster.images_dir();
    write_archives(bin_dir, &out)?
        .into_iter()
        .map(|(archive, digests)| {
            cluster.import_image(&archive)?;
            Ok(digests)
        })
        .collect()
}

/// The parts of a Dockerfile these images must agree with: its last stage
/// (the runtime image) and the `cargo build` of the builder.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dockerfile {
    /// The last stage's `FROM` image.
    pub base: String,
    /// Destinations of the last stage's `COPY`s.
    pub copy_destinations: Vec<String>,
    pub user: Option<String>,
    /// `EXPOSE` entries, with `/tcp` added where no protocol is given.
    pub exposed_ports: Vec<String>,
    /// The exec-form `ENTRYPOINT`.
    pub entrypoint: Vec<String>,
    /// `<package>/<binary>` of each `cargo build -p <package> --bin <binary>`.
    pub cargo_targets: Vec<String>,
}

impl Dockerfile {
    pub fn read(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("parsing {}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Self> {
        let mut out = Self::default();
        for (instruction, args) in instructions(text) {
            match instruction.as_str() {
                "FROM" => {
                    let image = args.split_whitespace().next().unwrap_or_default();
                    out = Self {
                        base: image.to_owned(),
                        cargo_targets: std::mem::take(&mut out.cargo_targets),
                        ..Self::default()
                    };
                }
                "COPY" => {
                    let words: Vec<&str> = args.split_whitespace().collect();
                    let destination = words.last().ok_or_else(|| anyhow!("empty COPY"))?;
                    out.copy_destinations.push((*destination).to_owned());
                }
                "USER" => out.user = Some(args.trim().to_owned()),
                "EXPOSE" => out.exposed_ports.extend(args.split_whitespace().map(|p| {
                    if p.contains('/') {
                        p.to_owned()
                    } else {
                        format!("{p}/tcp")
                    }
                })),
                "ENTRYPOINT" => {
                    out.entrypoint = serde_json::from_str(args.trim())
                        .context("ENTRYPOINT is not in exec (JSON) form")?;
                }
                "RUN" => out.cargo_targets.extend(cargo_targets(&args)),
                _ => {}
            }
        }
        ensure!(!out.base.is_empty(), "no FROM");
        Ok(out)
    }
}

/// `(INSTRUCTION, arguments)` with comments dropped and `\` continuations joined.
fn instructions(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                let (instruction, args) = current.split_once(' ').unwrap_or((&current, ""));
                out.push((instruction.to_ascii_uppercase(), args.to_owned()));
                current.clear();
            }
        }
    }
    out
}

/// `<package>/<binary>` of every `cargo build … -p P --bin B` in a RUN.
fn cargo_targets(run: &str) -> Vec<String> {
    let words: Vec<&str> = run.split_whitespace().collect();
    let mut targets = Vec::new();
    for (i, window) in words.windows(2).enumerate() {
        if window != ["cargo", "build"] {
            continue;
        }
        let command: Vec<&str> = words[i..]
            .iter()
            .copied()
            .take_while(|w| *w != "&&")
            .collect();
        let value = |flag: &str| {
            command
                .windows(2)
                .find(|w| w[0] == flag)
                .map(|w| w[1].to_owned())
        };
        if let (Some(package), Some(binary)) = (value("-p"), value("--bin")) {
            targets.push(format!("{package}/{binary}"));
        }
    }
    targets
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_are_normalised_as_the_cri_does() {
        assert_eq!(
            normalized_reference("kinference/epp:dev"),
            "docker.io/kinference/epp:dev"
        );
        assert_eq!(
            normalized_reference("busybox:1"),
            "docker.io/library/busybox:1"
        );
        assert_eq!(
            normalized_reference("kinference.local/pause:v1"),
            "kinference.local/pause:v1"
        );
    }

    #[test]
    fn the_last_stage_is_parsed() {
        let parsed = Dockerfile::parse(
            "FROM rust AS builder\nRUN --mount=x \\\n    cargo build --release -p a --bin b \\\n && install b /out/b\n\
             FROM base:tag\nCOPY --from=builder /out/b /usr/bin/b\n# a comment\nUSER nonroot\nEXPOSE 80 53/udp\n\
             ENTRYPOINT [\"/usr/bin/b\"]\n",
        )
        .unwrap();
        assert_eq!(
            parsed,
            Dockerfile {
                base: "base:tag".into(),
                copy_destinations: vec!["/usr/bin/b".into()],
                user: Some("nonroot".into()),
                exposed_ports: vec!["80/tcp".into(), "53/udp".into()],
                entrypoint: vec!["/usr/bin/b".into()],
                cargo_targets: vec!["a/b".into()],
            }
        );
    }
}
