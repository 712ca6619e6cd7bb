//! kube-proxy in iptables mode: Service ClusterIPs route to their endpoints,
//! for Pods (the `kubernetes` Service is how they reach kube-apiserver) and
//! for host processes (a gateway dialling a Service).
//!
//! Settings that matter:
//! - `clusterCIDR` = the Pod subnet (`detectLocalMode: ClusterCIDR`): traffic
//!   from outside it, e.g. the host, is masqueraded, so replies come back
//!   through the host's conntrack;
//! - `iptables.localhostNodePorts: false` and every `conntrack` setting 0:
//!   kube-proxy changes no sysctl (route_localnet, nf_conntrack_*);
//! - `oomScoreAdj: 0`: lowering it needs CAP_SYS_RESOURCE, which the sandbox
//!   lacks;
//! - healthz and metrics on free loopback ports.
//!
//! Its KUBE-* chains are removed by the teardown like the CNI plugins'.

use std::fs;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use kube::Client;

use super::process::{LOG_TAIL_LINES, NodeProcess, log_tail};

pub(crate) struct KubeProxySettings<'a> {
    pub bin: &'a Path,
    pub dir: &'a Path,
    pub kubeconfig: &'a Path,
    pub node_name: &'a str,
    pub cluster_cidr: &'a str,
    pub healthz_port: u16,
    pub metrics_port: u16,
    pub log: &'a Path,
}

pub(crate) fn start(s: &KubeProxySettings<'_>) -> Result<NodeProcess> {
    fs::create_dir_all(s.dir)?;
    let config = s.dir.join("config.yaml");
    fs::write(&config, config_yaml(s)).with_context(|| format!("writing {}", config.display()))?;
    let args = vec![format!("--config={}", config.display()), "--v=2".to_owned()];
    NodeProcess::spawn("kube-proxy", s.bin, &args, s.log)
}

fn config_yaml(s: &KubeProxySettings<'_>) -> String {
    format!(
        r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: {kubeconfig}
hostnameOverride: {node_name}
mode: iptables
clusterCIDR: {cluster_cidr}
detectLocalMode: ClusterCIDR
healthzBindAddress: 127.0.0.1:{healthz_port}
metricsBindAddress: 127.0.0.1:{metrics_port}
oomScoreAdj: 0
iptables:
  localhostNodePorts: false
  masqueradeAll: false
  minSyncPeriod: 0s
  syncPeriod: 30s
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"#,
        kubeconfig = s.kubeconfig.display(),
        node_name = s.node_name,
        cluster_cidr = s.cluster_cidr,
        healthz_port = s.healthz_port,
        metrics_port = s.metrics_port,
    )
}

/// Wait until `client` (whose server URL is a Service's ClusterIP) gets
/// kube-apiserver's version: kube-proxy routes the Service to its endpoint.
/// A bare TCP connect would not do: before kube-proxy's rules exist, a
/// ClusterIP leaves through the default route, where a proxy may answer.
pub(crate) async fn wait_service_routes(
    kube_proxy: &mut NodeProcess,
    service: SocketAddr,
    client: &Client,
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        kube_proxy.check_alive()?;
        let attempt =
            tokio::time::timeout(Duration::from_secs(2), client.apiserver_version()).await;
        let last = match attempt {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".to_owned(),
        };
        if Instant::now() > deadline {
            bail!(
                "kube-apiserver was not reachable at {service} within {timeout:?} ({last}); kube-proxy log ({}):\n{}",
                kube_proxy.log_path().display(),
                log_tail(kube_proxy.log_path(), LOG_TAIL_LINES)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
