//! containerd 2 (built from the Go module proxy by `tools/install-node.sh`)
//! started by hand with everything it writes in the node's private
//! directory: root, state, socket, runc's state, the CRI plugin's network
//! namespaces, and CNI configuration. Version 2.1 or later is what mounts a
//! Pod's image volumes (the tokenizer of precise prefix mode).
//!
//! Settings that matter here (see e2e/README.md):
//! - `restrict_oom_score_adj = true`: the sandbox lacks CAP_SYS_RESOURCE, so
//!   runc cannot lower a container's oom_score_adj below its own; without
//!   this every pod sandbox fails with "can't get final child's PID from pipe".
//! - `SystemdCgroup = false`: no systemd here; cgroupfs like the kubelet.
//! - `netns_mounts_under_state_dir = true`: pod network namespaces are bind
//!   mounts under the private state dir instead of the global /run/netns.
//! - `runtime_path` and `BinaryName`: the shim and runc of the node's binary
//!   directory, never whichever a host's `PATH` finds first.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

use super::process::{NodeProcess, run, run_with_stdin};

/// containerd namespace of the CRI plugin (the kubelet's containers).
pub(crate) const K8S_NAMESPACE: &str = "k8s.io";
/// The snapshotter the CRI unpacks images with (and `ctr import` into).
const CRI_SNAPSHOTTER: &str = "overlayfs";
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Paths of one containerd instance.
#[derive(Clone, Debug)]
pub(crate) struct ContainerdPaths {
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub config: PathBuf,
    pub cni_conf_dir: PathBuf,
}

impl ContainerdPaths {
    pub(crate) fn new(node_dir: &Path) -> Self {
        let dir = node_dir.join("containerd");
        Self {
            socket: dir.join("containerd.sock"),
            config: dir.join("config.toml"),
            cni_conf_dir: node_dir.join("cni/net.d"),
            dir,
        }
    }

    /// The CRI endpoint for the kubelet.
    pub(crate) fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }
}

/// The binaries one containerd runs.
pub(crate) struct ContainerdBinaries<'a> {
    pub containerd: &'a Path,
    pub shim: &'a Path,
    pub runc: &'a Path,
    pub cni_dir: &'a Path,
}

/// Write the config and start containerd; returns once it answers `ctr version`.
pub(crate) async fn start(
    bins: &ContainerdBinaries<'_>,
    ctr: &Ctr,
    paths: &ContainerdPaths,
    sandbox_image: &str,
    log: &Path,
) -> Result<NodeProcess> {
    fs::create_dir_all(&paths.dir)?;
    fs::create_dir_all(&paths.cni_conf_dir)?;
    fs::write(&paths.config, config_toml(paths, bins, sandbox_image))
        .with_context(|| format!("writing {}", paths.config.display()))?;
    let args = vec![
        "--config".to_owned(),
        paths.config.display().to_string(),
        "--log-level".to_owned(),
        "info".to_owned(),
    ];
    let mut process = NodeProcess::spawn("containerd", bins.containerd, &args, log)?;
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        process.check_alive()?;
        if paths.socket.exists() && ctr.run(&["version"]).is_ok() {
            return Ok(process);
        }
        if Instant::now() > deadline {
            process.check_alive()?;
            bail!(
                "containerd did not answer on {} within {READY_TIMEOUT:?}",
                paths.socket.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn config_toml(
    paths: &ContainerdPaths,
    bins: &ContainerdBinaries<'_>,
    sandbox_image: &str,
) -> String {
    let dir = paths.dir.display();
    format!(
        r#"version = 3
root = "{dir}/root"
state = "{dir}/state"
# Snapshotters that cannot work here only add noise to the log.
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.erofs"]

[grpc]
  address = "{socket}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{dir}/opt"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "{CRI_SNAPSHOTTER}"

  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{sandbox_image}"

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false

  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"

    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      runtime_path = "{shim}"

      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{runc}"
        Root = "{dir}/runc"

  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{cni_conf}"
    max_conf_num = 1

# NRI, on by default since containerd 2.0, would leave its socket in
# /run/nri on the host; nothing here uses it.
[plugins."io.containerd.nri.v1.nri"]
  disable = true

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"#,
        socket = paths.socket.display(),
        shim = bins.shim.display(),
        runc = bins.runc.display(),
        cni_bin = bins.cni_dir.display(),
        cni_conf = paths.cni_conf_dir.display(),
    )
}

/// `ctr` against one containerd.
#[derive(Clone, Debug)]
pub(crate) struct Ctr {
    pub bin: PathBuf,
    pub socket: PathBuf,
}

impl Ctr {
    /// Run `ctr --address <socket> <args>` and return its stdout.
    pub(crate) fn run(&self, args: &[&str]) -> Result<String> {
        let socket = self.socket.display().to_string();
        let bin = self.bin.display().to_string();
        let mut all = vec!["--address", socket.as_str(), "--timeout", "30s"];
        all.extend_from_slice(args);
        run(&bin, &all)
    }

    /// Import an image archive (OCI layout as a tar) for the kubelet, as
    /// `kind load image-archive` does on a kind node (kind v0.33's
    /// `nodeutils.LoadImageArchive`: these flags, the archive on stdin,
    /// the snapshotter the CRI uses).
    pub(crate) fn import(&self, archive: &Path) -> Result<()> {
        let file = std::fs::File::open(archive)
            .with_context(|| format!("opening {}", archive.display()))?;
        let namespace = format!("--namespace={K8S_NAMESPACE}");
        let snapshotter = format!("--snapshotter={CRI_SNAPSHOTTER}");
        let args = [
            namespace.as_str(),
            "images",
            "import",
            "--all-platforms",
            "--digests",
            &snapshotter,
            "-",
        ];
        let socket = self.socket.display().to_string();
        let mut all = vec!["--address", socket.as_str(), "--timeout", "30s"];
        all.extend_from_slice(&args);
        run_with_stdin(&self.bin.display().to_string(), &all, file).map(|_| ())
    }

    /// Kill and delete every task and container in every namespace, so the
    /// shims exit and unmount the containers' root filesystems.
    ///
    /// Single commands may fail in benign races (the CRI plugin deletes an
    /// exited task itself, a pod's shim exits with its last task: "not
    /// found", "ttrpc: closed"), so they are retried and only what is still
    /// there at the end counts as an error.
    pub(crate) fn remove_all_containers(&self) -> Result<()> {
        let mut last_errors = Vec::new();
        for _ in 0..5 {
            last_errors.clear();
            let mut left = 0;
            for ns in self.run(&["namespaces", "list", "-q"])?.lines() {
                let ns = ns.trim();
                for task in self.ids(ns, "tasks")? {
                    left += 1;
                    // SIGKILLs a running task, then deletes it.
                    if let Err(e) = self.run(&["-n", ns, "tasks", "delete", "-f", &task]) {
                        last_errors.push(format!("task {ns}/{task}: {e:#}"));
                    }
                }
                for container in self.ids(ns, "containers")? {
                    left += 1;
                    if let Err(e) = self.run(&["-n", ns, "containers", "delete", &container]) {
                        last_errors.push(format!("container {ns}/{container}: {e:#}"));
                    }
                }
            }
            if left == 0 {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        bail!(
            "containers survive deletion; last errors: {}",
            last_errors.join("; ")
        )
    }

    fn ids(&self, ns: &str, kind: &str) -> Result<Vec<String>> {
        Ok(self
            .run(&["-n", ns, kind, "list", "-q"])?
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect())
    }
}
