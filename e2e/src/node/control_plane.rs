//! kube-controller-manager and kube-scheduler, next to the
//! [`TestCluster`](crate::cluster::TestCluster)'s etcd + kube-apiserver.
//! Both authenticate with client certificates of the identities the RBAC
//! bootstrap policy grants their permissions to, serve (healthz, metrics) on
//! free loopback ports only, and run without leader election.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::{Api, Client};
use tokio::time::Instant;

use super::process::{LOG_TAIL_LINES, NodeProcess, log_tail};

pub(crate) struct ControllerManagerSettings<'a> {
    pub bin: &'a Path,
    pub kubeconfig: &'a Path,
    pub service_account_key: &'a Path,
    pub root_ca: &'a Path,
    pub cert_dir: &'a Path,
    pub port: u16,
    pub log: &'a Path,
}

pub(crate) fn start_controller_manager(s: &ControllerManagerSettings<'_>) -> Result<NodeProcess> {
    let kubeconfig = s.kubeconfig.display();
    let args = vec![
        format!("--kubeconfig={kubeconfig}"),
        format!("--authentication-kubeconfig={kubeconfig}"),
        format!("--authorization-kubeconfig={kubeconfig}"),
        "--bind-address=127.0.0.1".to_owned(),
        format!("--secure-port={}", s.port),
        format!("--cert-dir={}", s.cert_dir.display()),
        "--leader-elect=false".to_owned(),
        // As kubeadm: each controller acts as its own ServiceAccount in
        // kube-system, with the bootstrap policy's per-controller roles.
        "--use-service-account-credentials=true".to_owned(),
        format!(
            "--service-account-private-key-file={}",
            s.service_account_key.display()
        ),
        // Published to every namespace as the kube-root-ca.crt ConfigMap.
        format!("--root-ca-file={}", s.root_ca.display()),
        "--cluster-name=kinference-e2e".to_owned(),
        "--profiling=false".to_owned(),
        "--v=1".to_owned(),
    ];
    NodeProcess::spawn("kube-controller-manager", s.bin, &args, s.log)
}

pub(crate) fn start_scheduler(
    bin: &Path,
    kubeconfig: &Path,
    cert_dir: &Path,
    port: u16,
    log: &Path,
) -> Result<NodeProcess> {
    let kubeconfig = kubeconfig.display();
    let args = vec![
        format!("--kubeconfig={kubeconfig}"),
        format!("--authentication-kubeconfig={kubeconfig}"),
        format!("--authorization-kubeconfig={kubeconfig}"),
        "--bind-address=127.0.0.1".to_owned(),
        format!("--secure-port={port}"),
        format!("--cert-dir={}", cert_dir.display()),
        "--leader-elect=false".to_owned(),
        "--profiling=false".to_owned(),
        "--v=1".to_owned(),
    ];
    NodeProcess::spawn("kube-scheduler", bin, &args, log)
}

/// Wait until the controller-manager's ServiceAccount controller has made
/// the `default` ServiceAccount of the `default` namespace: controllers run.
pub(crate) async fn wait_controllers_running(
    client: &Client,
    controller_manager: &mut NodeProcess,
    timeout: Duration,
) -> Result<()> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
    let deadline = Instant::now() + timeout;
    loop {
        controller_manager.check_alive()?;
        if accounts
            .get_opt("default")
            .await
            .context("reading ServiceAccount default/default")?
            .is_some()
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "kube-controller-manager made no default ServiceAccount within {timeout:?}; log ({}):\n{}",
                controller_manager.log_path().display(),
                log_tail(controller_manager.log_path(), LOG_TAIL_LINES)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
