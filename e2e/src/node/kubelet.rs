//! The kubelet: registers the Node, runs its Pods through containerd's CRI.
//!
//! Settings that matter here (see e2e/README.md):
//! - `failCgroupV1: false`: the machine has cgroup v1 (hybrid), which v1.36
//!   refuses unless told otherwise; `cgroupDriver: cgroupfs` (no systemd).
//! - `cgroupRoot`: a private cgroup created for this node in every v1
//!   hierarchy, so all Pod cgroups are under it and are removed with it.
//! - `makeIPTablesUtilChains: false`: no KUBE-* canary chains in the host's
//!   iptables (nothing here needs them).
//! - private `--root-dir` and `podLogsDir`; no disk eviction thresholds
//!   ("0%" turns a signal off) and no image GC. The node shares the host's
//!   disk with cargo's builds; under 1% free once made the kubelet evict
//!   the test's Pod and delete its image, and a test node must not.

use std::fs;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::Client;

use super::pki::CertFiles;
use super::process::{LOG_TAIL_LINES, NodeProcess, log_tail, run};

const CGROUP_FS: &str = "/sys/fs/cgroup";

/// What the kubelet is started with.
pub(crate) struct KubeletSettings<'a> {
    pub bin: &'a Path,
    pub dir: &'a Path,
    pub node_name: &'a str,
    pub node_ip: IpAddr,
    pub kubeconfig: &'a Path,
    pub client_ca: &'a Path,
    pub serving: &'a CertFiles,
    pub cri_endpoint: &'a str,
    pub cgroup_root: &'a str,
    pub port: u16,
    pub healthz_port: u16,
    pub log: &'a Path,
}

pub(crate) fn start(settings: &KubeletSettings<'_>) -> Result<NodeProcess> {
    let root_dir = settings.dir.join("root");
    fs::create_dir_all(&root_dir)?;
    let config = settings.dir.join("config.yaml");
    fs::write(&config, config_yaml(settings))
        .with_context(|| format!("writing {}", config.display()))?;
    let args = vec![
        format!("--config={}", config.display()),
        format!("--kubeconfig={}", settings.kubeconfig.display()),
        format!("--root-dir={}", root_dir.display()),
        format!("--cert-dir={}", settings.dir.join("pki").display()),
        format!("--hostname-override={}", settings.node_name),
        format!("--node-ip={}", settings.node_ip),
        "--v=2".to_owned(),
    ];
    NodeProcess::spawn("kubelet", settings.bin, &args, settings.log)
}

fn config_yaml(s: &KubeletSettings<'_>) -> String {
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: {cgroup_root}
containerRuntimeEndpoint: {cri}
address: {node_ip}
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz_port}
tlsCertFile: {tls_cert}
tlsPrivateKeyFile: {tls_key}
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {client_ca}
authorization:
  mode: Webhook
registerNode: true
failSwapOn: false
makeIPTablesUtilChains: false
podLogsDir: {pod_logs}
resolvConf: /etc/resolv.conf
maxPods: 30
serializeImagePulls: false
evictionHard:
  memory.available: 100Mi
  nodefs.available: "0%"
  nodefs.inodesFree: "0%"
  imagefs.available: "0%"
  imagefs.inodesFree: "0%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
nodeStatusUpdateFrequency: 2s
syncFrequency: 10s
"#,
        cgroup_root = s.cgroup_root,
        cri = s.cri_endpoint,
        node_ip = s.node_ip,
        port = s.port,
        healthz_port = s.healthz_port,
        tls_cert = s.serving.cert.display(),
        tls_key = s.serving.key.display(),
        client_ca = s.client_ca.display(),
        pod_logs = s.dir.join("pod-logs").display(),
    )
}

/// The IPv4 address the host uses for outgoing traffic: the Node's
/// InternalIP (kube-apiserver reaches the kubelet there).
pub(crate) fn host_ip() -> Result<IpAddr> {
    let route = run("ip", &["-4", "-o", "route", "get", "1.1.1.1"])?;
    let mut words = route.split_whitespace();
    while let Some(word) = words.next() {
        if word == "src" {
            let ip = words
                .next()
                .ok_or_else(|| anyhow!("no address after src"))?;
            return ip.parse().with_context(|| format!("parsing {ip}"));
        }
    }
    bail!("no source address in `ip route get 1.1.1.1`: {route}")
}

/// The cgroup v1 hierarchies (and the v2 one of a hybrid setup).
pub(crate) fn cgroup_hierarchies() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(CGROUP_FS)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("cgroup.procs").exists())
        .collect();
    dirs.sort();
    dirs
}

/// Create `/<name>` in every hierarchy (the kubelet requires its
/// `cgroupRoot` to exist), with cpuset's CPUs and memory nodes copied from
/// the root so processes may join it.
pub(crate) fn create_cgroup_root(name: &str) -> Result<()> {
    for hierarchy in cgroup_hierarchies() {
        let dir = hierarchy.join(name);
        fs::create_dir_all(&dir).with_context(|| format!("creating cgroup {}", dir.display()))?;
        for file in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(value) = fs::read_to_string(hierarchy.join(file)) {
                fs::write(dir.join(file), value.trim())
                    .with_context(|| format!("writing {}", dir.join(file).display()))?;
            }
        }
    }
    Ok(())
}

/// Wait until the Node exists and reports `Ready=True`.
pub(crate) async fn wait_node_ready(
    client: &Client,
    name: &str,
    kubelet: &mut NodeProcess,
    containerd: &mut NodeProcess,
    timeout: Duration,
) -> Result<Node> {
    let nodes: Api<Node> = Api::all(client.clone());
    let deadline = Instant::now() + timeout;
    loop {
        kubelet.check_alive()?;
        containerd.check_alive()?;
        let node = nodes.get_opt(name).await?;
        let ready = node
            .as_ref()
            .and_then(|n| n.status.as_ref())
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
        if ready.is_some_and(|c| c.status == "True") {
            return node.ok_or_else(|| anyhow!("node vanished"));
        }
        if Instant::now() > deadline {
            bail!(
                "Node {name} not Ready after {timeout:?} (Ready condition: {ready:?}); kubelet log ({}):\n{}\ncontainerd log ({}):\n{}",
                kubelet.log_path().display(),
                log_tail(kubelet.log_path(), LOG_TAIL_LINES),
                containerd.log_path().display(),
                log_tail(containerd.log_path(), LOG_TAIL_LINES),
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
