//! A one-node Kubernetes cluster with real Pods: etcd + kube-apiserver (a
//! [`TestCluster`]), kube-controller-manager, kube-scheduler, containerd
//! with runc, a CNI bridge network, a kubelet registered as a Node, and
//! kube-proxy. Pods get ServiceAccount tokens and reach kube-apiserver
//! through the `kubernetes` Service. Needs root; see e2e/README.md ("Real
//! node") for versions and settings.
//!
//! ```ignore
//! let cluster = RealCluster::start().await?;        // Node Ready
//! let client = cluster.client();                     // admin (system:masters)
//! cluster.import_image(&archive)?;                   // see images::write_oci_archive
//! // … create Deployments, reach Pods at their IPs …
//! cluster.shutdown()?;                               // or drop it
//! ```
//!
//! Everything lives in a private directory `$TMPDIR/kinference-node-<pid>-<hex>/`
//! (certificates, kubeconfigs, containerd's root and state, the kubelet's
//! root, logs under `logs/`). [`RealCluster::shutdown`] (also run on drop)
//! stops the components, removes every container, unmounts, and deletes the
//! bridge, the CNI iptables chains, the cgroups and the directory; see
//! [`teardown`]. One RealCluster runs per machine at a time (a host lock).

mod cni;
mod containerd;
mod control_plane;
pub mod images;
mod kube_proxy;
mod kubelet;
mod pki;
mod process;
mod teardown;
pub mod workspace_images;

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use tokio::sync::OnceCell;

use crate::cluster::{FIELD_MANAGER, StartOptions, TestCluster};
pub use cni::{BRIDGE, CNI_BIN_DIR, NETWORK_NAME, POD_SUBNET};
use containerd::{ContainerdBinaries, ContainerdPaths, Ctr};
pub use images::{
    FileContents, ImageConfig, ImageDigests, LayerFile, binary_with_libraries, write_oci_archive,
};
use pki::NodePki;
use process::NodeProcess;
pub use teardown::{HOST_LOCK_PATH, mounts_under};
use teardown::{HostLock, HostState};

/// Directory with every binary (see `tools/install-node.sh`); skips the script.
pub const NODE_BIN_DIR_ENV: &str = "KINFERENCE_NODE_BIN_DIR";
/// The name the kubelet registers its Node as.
pub const NODE_NAME: &str = "kinference-e2e-node";
/// The sandbox ("pause") image, built from `kinference-pause` and imported
/// at start; with `-http :PORT` its binary is also a tiny HTTP server.
pub const PAUSE_IMAGE: &str = "kinference.local/pause:v1";
/// Path of the pause binary inside [`PAUSE_IMAGE`].
pub const PAUSE_BINARY_IN_IMAGE: &str = "/kinference-pause";

const LOCK_TIMEOUT: Duration = Duration::from_secs(900);
const NODE_READY_TIMEOUT: Duration = Duration::from_secs(120);
const CONTROLLERS_TIMEOUT: Duration = Duration::from_secs(60);
const SERVICE_ROUTES_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Paths of the node's binaries.
#[derive(Clone, Debug)]
pub struct NodeBinaries {
    dir: PathBuf,
}

impl NodeBinaries {
    /// `$KINFERENCE_NODE_BIN_DIR` if set, else the directory printed by
    /// `e2e/tools/install-node.sh` (which installs and builds on first use).
    pub async fn locate() -> Result<Self> {
        static DIR: OnceCell<PathBuf> = OnceCell::const_new();
        let dir = DIR
            .get_or_try_init(|| async {
                if let Some(dir) = std::env::var_os(NODE_BIN_DIR_ENV).filter(|d| !d.is_empty()) {
                    return Ok(PathBuf::from(dir));
                }
                crate::cluster::run_install_script(&install_script_path(), NODE_BIN_DIR_ENV).await
            })
            .await?;
        let bins = Self { dir: dir.clone() };
        for name in [
            "kube-apiserver",
            "etcd",
            "kubelet",
            "kube-controller-manager",
            "kube-scheduler",
            "kube-proxy",
            "kinference-pause",
            "containerd",
            "containerd-shim-runc-v2",
            "runc",
            "ctr",
        ] {
            ensure!(
                bins.path(name).is_file(),
                "missing binary {}",
                bins.path(name).display()
            );
        }
        Ok(bins)
    }

    /// `<dir>/<name>`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// Path of `tools/install-node.sh`.
pub fn install_script_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/install-node.sh")
}

/// Whether this process runs as root (the tier needs it).
pub fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    })
}

/// The node's components, in the order they are stopped.
#[derive(Default)]
struct Components {
    kube_proxy: Option<NodeProcess>,
    kubelet: Option<NodeProcess>,
    scheduler: Option<NodeProcess>,
    controller_manager: Option<NodeProcess>,
    containerd: Option<NodeProcess>,
}

/// A running one-node cluster; see the module docs.
pub struct RealCluster {
    components: Components,
    control_plane: Option<TestCluster>,
    host: Option<HostState>,
    /// Released last: other nodes may start once the host is clean.
    host_lock: Option<HostLock>,
    bins: NodeBinaries,
    dir: PathBuf,
    ctr: Ctr,
    client: Client,
    node_ip: IpAddr,
    admin_kubeconfig: PathBuf,
}

impl std::fmt::Debug for RealCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealCluster")
            .field("dir", &self.dir)
            .field("node", &NODE_NAME)
            .field("node_ip", &self.node_ip)
            .finish_non_exhaustive()
    }
}

impl RealCluster {
    /// Start everything and wait until the Node is `Ready` and the
    /// controllers run. Fails unless running as root.
    pub async fn start() -> Result<Self> {
        ensure!(running_as_root(), "the real-node cluster needs root");
        let bins = NodeBinaries::locate().await?;
        let lock = HostLock::acquire(LOCK_TIMEOUT).await?;
        let stale = teardown::sweep_stale_nodes();
        ensure!(
            stale.is_empty(),
            "cleaning up after an earlier run failed: {stale:?}"
        );
        cni::check_subnet_unused()?;

        let dir = std::env::temp_dir().join(format!(
            "{}{}-{:016x}",
            teardown::DIR_PREFIX,
            std::process::id(),
            unique_suffix()
        ));
        std::fs::create_dir_all(dir.join("logs"))
            .with_context(|| format!("creating {}", dir.display()))?;
        let cgroup_name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let host = HostState::capture(&dir, &cgroup_name)?;
        let paths = ContainerdPaths::new(&dir);
        let ctr = Ctr {
            bin: bins.path("ctr"),
            socket: paths.socket.clone(),
        };
        let node_ip = kubelet::host_ip()?;
        let pki = NodePki::create(&dir.join("pki"), NODE_NAME, node_ip)?;

        let control_plane = match start_control_plane(&pki, node_ip).await {
            Ok(control_plane) => control_plane,
            Err(e) => {
                let problems = host.undo();
                return Err(e.context(format!("(cleanup: {problems:?})")));
            }
        };
        let mut cluster = Self {
            components: Components::default(),
            client: control_plane.client(),
            admin_kubeconfig: control_plane.kubeconfig_path().to_owned(),
            control_plane: Some(control_plane),
            host: Some(host),
            host_lock: Some(lock),
            bins,
            ctr,
            node_ip,
            dir,
        };
        // From here on, a failure drops `cluster`, which tears down what started.
        cluster.start_containerd(&paths).await?;
        cluster.import_pause_image()?;
        cluster.start_kubelet(&pki, &paths, &cgroup_name)?;
        cluster.start_controllers(&pki)?;
        cluster.start_kube_proxy(&pki)?;
        cluster.wait_ready().await?;
        Ok(cluster)
    }

    /// A client authenticated as the admin (group `system:masters`).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The admin kubeconfig (for `KUBECONFIG=` of a subprocess).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// The Node's name.
    pub fn node_name(&self) -> &str {
        NODE_NAME
    }

    /// The Node's InternalIP (the host's outgoing IPv4 address).
    pub fn node_ip(&self) -> IpAddr {
        self.node_ip
    }

    /// The private directory (logs under `logs/`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The etcd + kube-apiserver part.
    pub fn control_plane(&self) -> &TestCluster {
        self.control_plane
            .as_ref()
            .expect("control plane runs until shutdown")
    }

    /// The node's binaries (for `kinference-pause`, …).
    pub fn binaries(&self) -> &NodeBinaries {
        &self.bins
    }

    /// Path of a component's log: `kubelet`, `containerd`,
    /// `kube-controller-manager`, `kube-scheduler`, `kube-proxy`.
    pub fn log_path(&self, component: &str) -> PathBuf {
        self.dir.join("logs").join(format!("{component}.log"))
    }

    /// The last `lines` lines of a component's log.
    pub fn log_tail(&self, component: &str, lines: usize) -> String {
        process::log_tail(&self.log_path(component), lines)
    }

    /// Free space and inodes where the node keeps its Pods and images, for
    /// failure reports: the host's disk is shared with cargo's builds.
    pub fn disk_free(&self) -> String {
        let dir = self.dir.to_string_lossy();
        ["-h", "-i"]
            .iter()
            .map(|flag| process::run("df", &[flag, &dir]).unwrap_or_else(|e| format!("{e:#}\n")))
            .collect()
    }

    /// Import an image archive written by [`write_oci_archive`] into
    /// containerd's `k8s.io` namespace, where the kubelet finds it.
    pub fn import_image(&self, archive: &Path) -> Result<()> {
        self.ctr
            .import(archive)
            .with_context(|| format!("importing {}", archive.display()))
    }

    /// Write `files` + `config` as image `reference` and import it.
    /// Where image archives are written before they are imported.
    pub fn images_dir(&self) -> PathBuf {
        self.dir.join("images")
    }

    pub fn build_image(
        &self,
        reference: &str,
        files: &[LayerFile],
        config: &ImageConfig,
    ) -> Result<ImageDigests> {
        let name: String = reference
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let archive = self.images_dir().join(format!("{name}.tar"));
        std::fs::create_dir_all(self.images_dir())?;
        let digests = write_oci_archive(reference, files, config, &archive)?;
        self.import_image(&archive)?;
        Ok(digests)
    }

    /// Stop everything and undo every change to the host; the errors name
    /// what could not be undone. Dropping the cluster does the same.
    pub fn shutdown(mut self) -> Result<()> {
        let problems = self.teardown();
        if problems.is_empty() {
            Ok(())
        } else {
            bail!("teardown left things behind:\n  {}", problems.join("\n  "))
        }
    }

    async fn start_containerd(&mut self, paths: &ContainerdPaths) -> Result<()> {
        cni::write_config(&paths.cni_conf_dir, &self.dir.join("cni/ipam"))?;
        let bins = ContainerdBinaries {
            containerd: &self.bins.path("containerd"),
            shim: &self.bins.path("containerd-shim-runc-v2"),
            runc: &self.bins.path("runc"),
            cni_dir: Path::new(CNI_BIN_DIR),
        };
        let process = containerd::start(
            &bins,
            &self.ctr,
            paths,
            PAUSE_IMAGE,
            &self.log_path("containerd"),
        )
        .await?;
        self.components.containerd = Some(process);
        Ok(())
    }

    fn import_pause_image(&self) -> Result<()> {
        let files = [LayerFile::host_file(
            PAUSE_BINARY_IN_IMAGE,
            &self.bins.path("kinference-pause"),
            0o755,
        )];
        let config = ImageConfig {
            entrypoint: vec![PAUSE_BINARY_IN_IMAGE.to_owned()],
            user: Some("65535:65535".to_owned()),
            ..ImageConfig::default()
        };
        self.build_image(PAUSE_IMAGE, &files, &config)
            .context("building the pause image")
            .map(|_| ())
    }

    fn start_kubelet(
        &mut self,
        pki: &NodePki,
        paths: &ContainerdPaths,
        cgroup_name: &str,
    ) -> Result<()> {
        kubelet::create_cgroup_root(cgroup_name)?;
        let dir = self.dir.join("kubelet");
        std::fs::create_dir_all(&dir)?;
        let kubeconfig = dir.join("kubeconfig");
        self.write_component_kubeconfig(
            &kubeconfig,
            &format!("system:node:{NODE_NAME}"),
            &pki.kubelet_client,
        )?;
        let settings = kubelet::KubeletSettings {
            bin: &self.bins.path("kubelet"),
            dir: &dir,
            node_name: NODE_NAME,
            node_ip: self.node_ip,
            kubeconfig: &kubeconfig,
            client_ca: &pki.ca_cert,
            serving: &pki.kubelet_serving,
            cri_endpoint: &paths.endpoint(),
            cgroup_root: &format!("/{cgroup_name}"),
            port: free_port()?,
            healthz_port: free_port()?,
            log: &self.log_path("kubelet"),
        };
        self.components.kubelet = Some(kubelet::start(&settings)?);
        Ok(())
    }

    fn start_controllers(&mut self, pki: &NodePki) -> Result<()> {
        let control_plane = self.control_plane();
        let cm_dir = self.dir.join("kube-controller-manager");
        std::fs::create_dir_all(&cm_dir)?;
        let cm_kubeconfig = cm_dir.join("kubeconfig");
        self.write_component_kubeconfig(
            &cm_kubeconfig,
            "system:kube-controller-manager",
            &pki.controller_manager,
        )?;
        let controller_manager =
            control_plane::start_controller_manager(&control_plane::ControllerManagerSettings {
                bin: &self.bins.path("kube-controller-manager"),
                kubeconfig: &cm_kubeconfig,
                service_account_key: &control_plane.service_account_key_path(),
                root_ca: &control_plane.apiserver_ca_path(),
                cert_dir: &cm_dir.join("serving"),
                port: free_port()?,
                log: &self.log_path("kube-controller-manager"),
            })?;

        let scheduler_dir = self.dir.join("kube-scheduler");
        std::fs::create_dir_all(&scheduler_dir)?;
        let scheduler_kubeconfig = scheduler_dir.join("kubeconfig");
        self.write_component_kubeconfig(
            &scheduler_kubeconfig,
            "system:kube-scheduler",
            &pki.scheduler,
        )?;
        let scheduler = control_plane::start_scheduler(
            &self.bins.path("kube-scheduler"),
            &scheduler_kubeconfig,
            &scheduler_dir.join("serving"),
            free_port()?,
            &self.log_path("kube-scheduler"),
        )?;
        self.components.controller_manager = Some(controller_manager);
        self.components.scheduler = Some(scheduler);
        Ok(())
    }

    fn start_kube_proxy(&mut self, pki: &NodePki) -> Result<()> {
        let dir = self.dir.join("kube-proxy");
        std::fs::create_dir_all(&dir)?;
        let kubeconfig = dir.join("kubeconfig");
        self.write_component_kubeconfig(&kubeconfig, "system:kube-proxy", &pki.kube_proxy)?;
        let process = kube_proxy::start(&kube_proxy::KubeProxySettings {
            bin: &self.bins.path("kube-proxy"),
            dir: &dir,
            kubeconfig: &kubeconfig,
            node_name: NODE_NAME,
            cluster_cidr: POD_SUBNET,
            healthz_port: free_port()?,
            metrics_port: free_port()?,
            log: &self.log_path("kube-proxy"),
        })?;
        self.components.kube_proxy = Some(process);
        Ok(())
    }

    fn write_component_kubeconfig(
        &self,
        path: &Path,
        user: &str,
        cert: &pki::CertFiles,
    ) -> Result<()> {
        let control_plane = self.control_plane();
        pki::write_kubeconfig(
            path,
            &control_plane.server_url(),
            &control_plane.apiserver_ca_path(),
            user,
            cert,
        )
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let components = &mut self.components;
        let (Some(kubelet), Some(containerd), Some(cm), Some(scheduler), Some(kube_proxy)) = (
            components.kubelet.as_mut(),
            components.containerd.as_mut(),
            components.controller_manager.as_mut(),
            components.scheduler.as_mut(),
            components.kube_proxy.as_mut(),
        ) else {
            bail!("components not started");
        };
        kubelet::wait_node_ready(
            &self.client,
            NODE_NAME,
            kubelet,
            containerd,
            NODE_READY_TIMEOUT,
        )
        .await?;
        control_plane::wait_controllers_running(&self.client, cm, CONTROLLERS_TIMEOUT).await?;
        scheduler.check_alive()?;
        // What Pods dial for the API (KUBERNETES_SERVICE_HOST/PORT).
        let kubernetes = kubernetes_service_address(&self.client).await?;
        let via_service = admin_client_at(&self.admin_kubeconfig, kubernetes).await?;
        kube_proxy::wait_service_routes(
            kube_proxy,
            kubernetes,
            &via_service,
            SERVICE_ROUTES_TIMEOUT,
        )
        .await
    }

    /// Stop the components, remove containers, undo host changes; returns
    /// what could not be undone. Idempotent.
    fn teardown(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        // Nothing may restart containers while they are removed.
        for mut process in [
            self.components.kube_proxy.take(),
            self.components.kubelet.take(),
            self.components.scheduler.take(),
            self.components.controller_manager.take(),
        ]
        .into_iter()
        .flatten()
        {
            process.stop(STOP_GRACE);
        }
        if let Some(mut containerd) = self.components.containerd.take() {
            // With containerd still up, shims exit cleanly and unmount.
            if containerd.check_alive().is_ok()
                && let Err(e) = self.ctr.remove_all_containers()
            {
                problems.push(format!("{e:#}"));
            }
            containerd.stop(STOP_GRACE);
        }
        if let Some(host) = self.host.take() {
            problems.extend(host.undo());
        }
        // etcd + kube-apiserver, and their own directory.
        drop(self.control_plane.take());
        drop(self.host_lock.take());
        problems
    }
}

impl Drop for RealCluster {
    fn drop(&mut self) {
        let problems = self.teardown();
        if !problems.is_empty() {
            eprintln!("kinference-e2e: real-node teardown left things behind: {problems:?}");
        }
    }
}

/// etcd + kube-apiserver, trusting the node CA for client certificates,
/// able to reach the kubelet, and reachable by Pods; see [`apiserver_flags`].
async fn start_control_plane(pki: &NodePki, node_ip: IpAddr) -> Result<TestCluster> {
    let options = StartOptions {
        extra_apiserver_args: apiserver_flags(pki),
        // The scenario installs them with the operator (`helm install`).
        skip_project_crds: true,
        ..StartOptions::default()
    };
    let control_plane = TestCluster::start_with(options)
        .await
        .context("starting etcd + kube-apiserver")?;
    publish_apiserver_endpoint(&control_plane, node_ip).await?;
    Ok(control_plane)
}

/// kube-apiserver flags on top of (or replacing) the TestCluster's.
fn apiserver_flags(pki: &NodePki) -> Vec<String> {
    vec![
        // Components authenticate with certificates of the node CA.
        format!("--client-ca-file={}", pki.ca_cert.display()),
        format!(
            "--kubelet-client-certificate={}",
            pki.apiserver_kubelet_client.cert.display()
        ),
        format!(
            "--kubelet-client-key={}",
            pki.apiserver_kubelet_client.key.display()
        ),
        format!("--kubelet-certificate-authority={}", pki.ca_cert.display()),
        "--kubelet-preferred-address-types=InternalIP".to_owned(),
        // Pods reach kube-apiserver at the node's address (through the
        // `kubernetes` Service). The advertised address stays 127.0.0.1: it
        // is in the self-signed serving certificate the TestCluster's
        // clients verify, as is the Service's ClusterIP that Pods dial.
        "--bind-address=0.0.0.0".to_owned(),
        // A controller-manager makes the `default` ServiceAccounts now, so
        // ServiceAccount admission can run: Pods get projected tokens.
        "--disable-admission-plugins=".to_owned(),
        // As in kubeadm clusters: the kubelet is authorized as a node, and
        // only for its own Pods' objects.
        "--authorization-mode=Node,RBAC".to_owned(),
        "--enable-admission-plugins=NodeRestriction".to_owned(),
    ]
}

/// Point the `kubernetes` Service at `node_ip`:<secure port>. The
/// TestCluster runs `--endpoint-reconciler-type=none` (its advertised
/// address is loopback, which Pods cannot reach), so the harness writes the
/// EndpointSlice kube-apiserver's reconciler would.
async fn publish_apiserver_endpoint(control_plane: &TestCluster, node_ip: IpAddr) -> Result<()> {
    let server = control_plane.server_url();
    let port: u16 = server
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no port in {server}"))?;
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {
            "name": "kubernetes",
            "namespace": "default",
            "labels": {
                "kubernetes.io/service-name": "kubernetes",
                "endpointslice.kubernetes.io/managed-by": "kinference-e2e",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{ "addresses": [node_ip.to_string()], "conditions": { "ready": true } }],
        "ports": [{ "name": "https", "port": port, "protocol": "TCP" }],
    }))?;
    Api::<EndpointSlice>::namespaced(control_plane.client(), "default")
        .patch(
            "kubernetes",
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&slice),
        )
        .await
        .context("writing the EndpointSlice of the kubernetes Service")?;
    Ok(())
}

/// ClusterIP:port of the `kubernetes` Service (made by kube-apiserver).
async fn kubernetes_service_address(client: &Client) -> Result<std::net::SocketAddr> {
    let deadline = std::time::Instant::now() + CONTROLLERS_TIMEOUT;
    loop {
        let service = Api::<Service>::namespaced(client.clone(), "default")
            .get_opt("kubernetes")
            .await?;
        let spec = service.and_then(|s| s.spec);
        let ip = spec
            .as_ref()
            .and_then(|s| s.cluster_ip.as_deref()?.parse().ok());
        let port = spec
            .as_ref()
            .and_then(|s| Some(s.ports.as_ref()?.first()?.port));
        if let (Some(ip), Some(port)) = (ip, port) {
            return Ok(std::net::SocketAddr::new(ip, u16::try_from(port)?));
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "kube-apiserver made no kubernetes Service"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The admin client of `kubeconfig`, talking to `address` instead (the
/// `kubernetes` Service's ClusterIP is in kube-apiserver's certificate).
async fn admin_client_at(kubeconfig: &Path, address: std::net::SocketAddr) -> Result<Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    config.cluster_url = format!("https://{address}").parse()?;
    Ok(Client::try_from(config)?)
}

/// A free loopback TCP port (the kubelet's and controllers' serving ports),
/// never one this process handed out before.
fn free_port() -> Result<u16> {
    Ok(kinference_testbed::free_port()?)
}

fn unique_suffix() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default();
    nanos ^ (u64::from(std::process::id()) << 40)
}
