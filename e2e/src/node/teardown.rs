//! Leaving nothing behind. A node changes the host outside its private
//! directory: mounts (container root filesystems, shm, network namespaces,
//! kubelet volumes), a bridge, iptables chains of the CNI plugins, cgroups,
//! a few sysctls (the kubelet's kernel tunables, IP forwarding), libcni's
//! cache files, kubelet's /var/log/containers links and containerd's shim
//! sockets. [`HostState`] records, before start, what is needed to undo all
//! of that and is saved in the node's directory, so that a run killed
//! without unwinding is undone by the next one ([`sweep_stale_nodes`]).

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, Serialize};
use std::io::BufRead as _;

use super::cni::{self, NETWORK_NAME};
use super::kubelet::cgroup_hierarchies;
use super::process::{run, signal};
use crate::cluster::KEEP_DIR_ENV;

/// Prefix of node directories under the temp dir: `kinference-node-<pid>-<hex>`.
pub(crate) const DIR_PREFIX: &str = "kinference-node-";
/// Prefixes of the iptables chains that CNI plugins (and kubelets) create.
const CHAIN_PREFIXES: [&str; 2] = ["CNI-", "KUBE-"];
const IPTABLES_TABLES: [&str; 4] = ["filter", "nat", "mangle", "raw"];
/// Kernel settings the kubelet (kernel tunables) and the bridge plugin
/// (forwarding) change.
const SYSCTLS: [&str; 5] = [
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "net/ipv4/ip_forward",
];
/// Host directories that node components create if missing (removed
/// afterwards only if they did not exist before and are empty then).
const HOST_DIRS: [&str; 7] = [
    // The kubelet's device manager ignores --root-dir: its socket and
    // checkpoint are always in /var/lib/kubelet/device-plugins.
    KUBELET_DEVICE_PLUGINS_DIR,
    "/var/lib/kubelet",
    "/var/lib/cni/results",
    "/var/lib/cni",
    "/var/log/containers",
    "/run/containerd/s",
    "/run/containerd",
];
const KUBELET_DEVICE_PLUGINS_DIR: &str = "/var/lib/kubelet/device-plugins";
const SHIM_SOCKET_DIR: &str = "/run/containerd/s";
const LIBCNI_CACHE_DIR: &str = "/var/lib/cni/results";
const POD_LOG_LINKS_DIR: &str = "/var/log/containers";
const STATE_FILE: &str = "host-state.json";

/// What to undo on the host; see the module docs.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct HostState {
    pub dir: PathBuf,
    pub cgroup_name: String,
    /// `<iptables|ip6tables> <table> <chain>` present before start.
    pub chains_before: BTreeSet<String>,
    /// `(key under /proc/sys, value)` before start.
    pub sysctls_before: Vec<(String, String)>,
    pub shim_sockets_before: BTreeSet<String>,
    pub missing_host_dirs: Vec<String>,
}

impl HostState {
    /// Record the host before a node starts in `dir`, and save the record there.
    pub(crate) fn capture(dir: &Path, cgroup_name: &str) -> Result<Self> {
        let state = Self {
            dir: dir.to_owned(),
            cgroup_name: cgroup_name.to_owned(),
            chains_before: list_chains(),
            sysctls_before: SYSCTLS
                .iter()
                .filter_map(|k| {
                    let v = fs::read_to_string(Path::new("/proc/sys").join(k)).ok()?;
                    Some(((*k).to_owned(), v.trim().to_owned()))
                })
                .collect(),
            shim_sockets_before: dir_entries(Path::new(SHIM_SOCKET_DIR)),
            missing_host_dirs: HOST_DIRS
                .iter()
                .filter(|d| !Path::new(d).exists())
                .map(|d| (*d).to_owned())
                .collect(),
        };
        fs::write(dir.join(STATE_FILE), serde_json::to_vec_pretty(&state)?)?;
        Ok(state)
    }

    fn load(dir: &Path) -> Result<Self> {
        let bytes = fs::read(dir.join(STATE_FILE))?;
        Ok(serde_json::from_slice(&bytes)?)
    }

    /// Undo everything; the node's own processes (kubelet, containerd, …)
    /// must be stopped already. Returns what could not be undone.
    pub(crate) fn undo(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let mut step = |what: &str, result: Result<()>| {
            if let Err(e) = result {
                problems.push(format!("{what}: {e:#}"));
            }
        };
        step(
            "killing container processes",
            self.kill_leftover_processes(),
        );
        step("unmounting", unmount_under(&self.dir));
        step("deleting the bridge", cni::delete_bridge());
        step("removing iptables chains", self.remove_new_chains());
        step("removing cgroups", self.remove_cgroups());
        step("restoring sysctls", self.restore_sysctls());
        step("removing host files", self.remove_host_files());
        step("removing the node directory", self.remove_dir());
        problems
    }

    /// Processes in the node's cgroups (containers) and any process whose
    /// command line names the node's directory (shims, a stray component).
    fn kill_leftover_processes(&self) -> Result<()> {
        for _ in 0..20 {
            let mut pids = self.cgroup_pids();
            pids.extend(pids_mentioning(&self.dir.to_string_lossy()));
            if pids.is_empty() {
                return Ok(());
            }
            for pid in &pids {
                signal(*pid, "KILL");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        bail!("processes survive SIGKILL: {:?}", self.cgroup_pids())
    }

    fn cgroup_pids(&self) -> BTreeSet<u32> {
        let mut pids = BTreeSet::new();
        for hierarchy in cgroup_hierarchies() {
            for dir in cgroup_tree(&hierarchy.join(&self.cgroup_name)) {
                let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
                pids.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
            }
        }
        pids
    }

    fn remove_cgroups(&self) -> Result<()> {
        let mut failed = Vec::new();
        for hierarchy in cgroup_hierarchies() {
            // Deepest first: a cgroup with children cannot be removed.
            for dir in cgroup_tree(&hierarchy.join(&self.cgroup_name)).iter().rev() {
                if fs::remove_dir(dir).is_err() && dir.exists() {
                    failed.push(dir.display().to_string());
                }
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            bail!("cgroups left: {failed:?}")
        }
    }

    /// Delete the CNI-*/KUBE-* chains that were not there before start, and
    /// every rule jumping to them.
    fn remove_new_chains(&self) -> Result<()> {
        let new: BTreeSet<String> = list_chains()
            .difference(&self.chains_before)
            .cloned()
            .collect();
        for family in ["iptables", "ip6tables"] {
            for table in IPTABLES_TABLES {
                let ours: BTreeSet<&str> = new
                    .iter()
                    .filter_map(|c| c.strip_prefix(&format!("{family} {table} ")))
                    .collect();
                if !ours.is_empty() {
                    remove_chains(family, table, &ours)?;
                }
            }
        }
        Ok(())
    }

    fn restore_sysctls(&self) -> Result<()> {
        for (key, value) in &self.sysctls_before {
            let path = Path::new("/proc/sys").join(key);
            let now = fs::read_to_string(&path).unwrap_or_default();
            if now.trim() != value {
                fs::write(&path, value).with_context(|| format!("restoring {key}={value}"))?;
            }
        }
        Ok(())
    }

    fn remove_host_files(&self) -> Result<()> {
        // libcni caches each attachment's result as
        // `<network>-<sandbox id>-<interface>`; CNI DEL would remove it. The
        // CRI plugin also attaches every sandbox to `cni-loopback`.
        let cache_prefix = format!("{NETWORK_NAME}-");
        let sandboxes = self.sandbox_ids();
        for name in dir_entries(Path::new(LIBCNI_CACHE_DIR)) {
            let ours = name.starts_with(&cache_prefix)
                || sandboxes.iter().any(|id| name.contains(&format!("-{id}-")));
            if ours {
                fs::remove_file(Path::new(LIBCNI_CACHE_DIR).join(&name))?;
            }
        }
        // The kubelet links each container's log into /var/log/containers.
        for name in dir_entries(Path::new(POD_LOG_LINKS_DIR)) {
            let link = Path::new(POD_LOG_LINKS_DIR).join(&name);
            if fs::read_link(&link).is_ok_and(|t| t.starts_with(&self.dir)) {
                fs::remove_file(&link)?;
            }
        }
        // Shim sockets left by shims that were killed rather than shut down.
        for name in dir_entries(Path::new(SHIM_SOCKET_DIR)) {
            if !self.shim_sockets_before.contains(&name) {
                let _ = fs::remove_file(Path::new(SHIM_SOCKET_DIR).join(&name));
            }
        }
        if self
            .missing_host_dirs
            .iter()
            .any(|d| d == KUBELET_DEVICE_PLUGINS_DIR)
        {
            // Only this node's kubelet wrote there (kubelet.sock, checkpoint).
            let _ = fs::remove_dir_all(KUBELET_DEVICE_PLUGINS_DIR);
        }
        for dir in &self.missing_host_dirs {
            // Only if empty: something else may have started using it.
            let _ = fs::remove_dir(dir);
        }
        Ok(())
    }

    /// IDs of the pod sandboxes containerd's CRI plugin made for this node
    /// (it keeps a directory per sandbox in its root and state).
    fn sandbox_ids(&self) -> BTreeSet<String> {
        ["root", "state"]
            .iter()
            .flat_map(|d| {
                dir_entries(
                    &self
                        .dir
                        .join("containerd")
                        .join(d)
                        .join("io.containerd.grpc.v1.cri/sandboxes"),
                )
            })
            .collect()
    }

    fn remove_dir(&self) -> Result<()> {
        // Never recurse into a mount that survived: it could be a host path.
        let left = mounts_under(&self.dir);
        if !left.is_empty() {
            bail!("keeping {}: still mounted: {left:?}", self.dir.display());
        }
        if keep_dir() {
            eprintln!("kinference-e2e: keeping node dir {}", self.dir.display());
        } else if self.dir.exists() {
            fs::remove_dir_all(&self.dir)
                .with_context(|| format!("removing {}", self.dir.display()))?;
        }
        Ok(())
    }
}

/// [`KEEP_DIR_ENV`] asks to keep directories (logs) for debugging; safe
/// once nothing is mounted there any more.
fn keep_dir() -> bool {
    std::env::var_os(KEEP_DIR_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Undo nodes of processes that died without tearing down (found by their
/// directories; the host lock must be held).
pub(crate) fn sweep_stale_nodes() -> Vec<String> {
    let mut problems = Vec::new();
    for name in dir_entries(&std::env::temp_dir()) {
        let Some(pid) = name
            .strip_prefix(DIR_PREFIX)
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if Path::new("/proc").join(pid.to_string()).exists() {
            continue;
        }
        let dir = std::env::temp_dir().join(&name);
        match HostState::load(&dir) {
            Ok(state) => problems.extend(state.undo()),
            Err(_) => {
                if let Err(e) =
                    unmount_under(&dir).and_then(|()| fs::remove_dir_all(&dir).context("removing"))
                {
                    problems.push(format!("{}: {e:#}", dir.display()));
                }
            }
        }
    }
    problems
}

/// Mount points under `dir` (deepest, i.e. most recently mounted, last).
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_mount_path(p)))
        .filter(|p| p.starts_with(dir))
        .collect()
}

/// Unmount everything under `dir`, most recent first (lazily if busy).
fn unmount_under(dir: &Path) -> Result<()> {
    for _ in 0..5 {
        let mounts = mounts_under(dir);
        if mounts.is_empty() {
            return Ok(());
        }
        for mount in mounts.iter().rev() {
            let path = mount.to_string_lossy();
            if run("umount", &[&path]).is_err() {
                let _ = run("umount", &["-l", &path]);
            }
        }
    }
    let left = mounts_under(dir);
    if left.is_empty() {
        Ok(())
    } else {
        bail!("still mounted: {left:?}")
    }
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mount_path(path: &str) -> String {
    path.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// `dir` and every cgroup below it, parents before children.
fn cgroup_tree(dir: &Path) -> Vec<PathBuf> {
    if !dir.is_dir() {
        return Vec::new();
    }
    let mut out = vec![dir.to_owned()];
    let mut i = 0;
    while i < out.len() {
        let children = fs::read_dir(&out[i]).into_iter().flatten().flatten();
        let children: Vec<PathBuf> = children
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
            .collect();
        out.extend(children);
        i += 1;
    }
    out
}

/// PIDs of processes (other than this one) whose command line contains `needle`.
fn pids_mentioning(needle: &str) -> BTreeSet<u32> {
    let me = std::process::id();
    let mut pids = BTreeSet::new();
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let cmdline = fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(needle) {
            pids.insert(pid);
        }
    }
    pids
}

/// Every CNI-*/KUBE-* chain, as `<family> <table> <chain>`.
pub(crate) fn list_chains() -> BTreeSet<String> {
    let mut chains = BTreeSet::new();
    for family in ["iptables", "ip6tables"] {
        for table in IPTABLES_TABLES {
            let Ok(rules) = run(family, &["-w", "-t", table, "-S"]) else {
                continue;
            };
            for chain in rules.lines().filter_map(|l| l.strip_prefix("-N ")) {
                if CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p)) {
                    chains.insert(format!("{family} {table} {chain}"));
                }
            }
        }
    }
    chains
}

/// Delete the rules of `table` that jump to one of `chains`, then the chains.
fn remove_chains(family: &str, table: &str, chains: &BTreeSet<&str>) -> Result<()> {
    let rules = run(family, &["-w", "-t", table, "-S"])?;
    // Rule numbers per chain, in order; delete from the last so earlier
    // numbers stay valid.
    let mut numbered: Vec<(String, usize)> = Vec::new();
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for rule in rules.lines().filter_map(|l| l.strip_prefix("-A ")) {
        let words: Vec<&str> = rule.split_whitespace().collect();
        let chain = words[0].to_owned();
        let n = counts.entry(chain.clone()).or_default();
        *n += 1;
        let target = words
            .windows(2)
            .find(|w| w[0] == "-j" || w[0] == "-g")
            .map(|w| w[1]);
        if !chains.contains(chain.as_str()) && target.is_some_and(|t| chains.contains(t)) {
            numbered.push((chain, *n));
        }
    }
    for (chain, n) in numbered.iter().rev() {
        run(family, &["-w", "-t", table, "-D", chain, &n.to_string()])?;
    }
    for chain in chains {
        run(family, &["-w", "-t", table, "-F", chain])?;
    }
    for chain in chains {
        run(family, &["-w", "-t", table, "-X", chain])?;
    }
    Ok(())
}

fn dir_entries(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// The machine-wide lock that serialises nodes (they share the bridge, the
/// Pod subnet and iptables): `flock --no-fork` holding [`HOST_LOCK_PATH`]
/// until its stdin closes, i.e. on drop or when this process dies.
pub(crate) struct HostLock {
    child: Child,
}

/// The lock file stays (empty) after use; removing it would race a waiter.
pub const HOST_LOCK_PATH: &str = "/run/lock/kinference-real-node.lock";

impl HostLock {
    pub(crate) async fn acquire(timeout: Duration) -> Result<Self> {
        if let Some(dir) = Path::new(HOST_LOCK_PATH).parent() {
            fs::create_dir_all(dir)?;
        }
        let mut child = Command::new("setpriv")
            .args([
                "--pdeathsig",
                "KILL",
                "--",
                "flock",
                "--exclusive",
                "--no-fork",
            ])
            .arg(format!("--timeout={}", timeout.as_secs()))
            .arg(HOST_LOCK_PATH)
            .args(["sh", "-c", "echo locked; exec cat >/dev/null"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("running flock (util-linux)")?;
        let stdout = child.stdout.take().context("flock's stdout")?;
        let line = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            std::io::BufReader::new(stdout)
                .read_line(&mut line)
                .map(|_| line)
        })
        .await??;
        if line.trim() != "locked" {
            let out = child.wait_with_output()?;
            bail!(
                "could not lock {HOST_LOCK_PATH} within {timeout:?} (only one real-node cluster runs per machine): {} {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(Self { child })
    }
}

impl Drop for HostLock {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
