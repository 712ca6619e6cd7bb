//! The node's certificates and kubeconfigs, made at start with rcgen (ECDSA
//! P-256): one cluster CA that kube-apiserver trusts for client certificates
//! (`--client-ca-file`) and that signs
//!
//! - a client certificate per component, whose subject is the identity the
//!   upstream RBAC bootstrap policy expects (`system:node:<name>` in
//!   `system:nodes`, `system:kube-controller-manager`, `system:kube-scheduler`,
//!   `system:kube-proxy`),
//! - kube-apiserver's client certificate for the kubelet API (logs, exec),
//! - the kubelet's serving certificate (for the node's IP and name), which
//!   kube-apiserver verifies (`--kubelet-certificate-authority`).
//!
//! kube-apiserver's own serving certificate stays the self-signed one
//! [`TestCluster`](crate::cluster::TestCluster) already trusts.

use std::fs;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

/// A certificate and its key, as PEM files.
#[derive(Clone, Debug)]
pub(crate) struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

pub(crate) struct NodePki {
    pub ca_cert: PathBuf,
    pub kubelet_client: CertFiles,
    pub kubelet_serving: CertFiles,
    pub controller_manager: CertFiles,
    pub scheduler: CertFiles,
    pub kube_proxy: CertFiles,
    pub apiserver_kubelet_client: CertFiles,
}

impl NodePki {
    /// Create the CA and every certificate under `dir`.
    pub(crate) fn create(dir: &Path, node_name: &str, node_ip: IpAddr) -> Result<Self> {
        fs::create_dir_all(dir)?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.distinguished_name
            .push(DnType::CommonName, "kinference-e2e node CA");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?;
        let ca_cert = dir.join("ca.crt");
        fs::write(&ca_cert, ca.pem())?;

        let client = |file: &str, user: &str, group: Option<&str>| {
            let mut params = CertificateParams::new(Vec::<String>::new())?;
            params.distinguished_name.push(DnType::CommonName, user);
            if let Some(group) = group {
                params
                    .distinguished_name
                    .push(DnType::OrganizationName, group);
            }
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            issue(dir, file, params, &ca)
        };
        let kubelet_client = client(
            "kubelet-client",
            &format!("system:node:{node_name}"),
            Some("system:nodes"),
        )?;
        let controller_manager =
            client("controller-manager", "system:kube-controller-manager", None)?;
        let scheduler = client("scheduler", "system:kube-scheduler", None)?;
        // Bound to ClusterRole system:node-proxier by the bootstrap policy.
        let kube_proxy = client("kube-proxy", "system:kube-proxy", None)?;
        let apiserver_kubelet_client = client(
            "apiserver-kubelet-client",
            "kube-apiserver-kubelet-client",
            Some("system:masters"),
        )?;

        let mut serving = CertificateParams::new(vec![node_name.to_owned()])?;
        serving.subject_alt_names.push(SanType::IpAddress(node_ip));
        serving
            .distinguished_name
            .push(DnType::CommonName, format!("system:node:{node_name}"));
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let kubelet_serving = issue(dir, "kubelet-serving", serving, &ca)?;

        Ok(Self {
            ca_cert,
            kubelet_client,
            kubelet_serving,
            controller_manager,
            scheduler,
            kube_proxy,
            apiserver_kubelet_client,
        })
    }
}

fn issue(
    dir: &Path,
    file: &str,
    params: CertificateParams,
    ca: &CertifiedIssuer<'_, KeyPair>,
) -> Result<CertFiles> {
    let key = KeyPair::generate()?;
    let cert = params
        .signed_by(&key, ca)
        .with_context(|| format!("signing the {file} certificate"))?;
    let files = CertFiles {
        cert: dir.join(format!("{file}.crt")),
        key: dir.join(format!("{file}.key")),
    };
    fs::write(&files.cert, cert.pem())?;
    fs::write(&files.key, key.serialize_pem())?;
    Ok(files)
}

/// A kubeconfig for `server` that trusts `server_ca` and authenticates with
/// the client certificate `cert`.
pub(crate) fn write_kubeconfig(
    path: &Path,
    server: &str,
    server_ca: &Path,
    user: &str,
    cert: &CertFiles,
) -> Result<()> {
    let text = format!(
        "apiVersion: v1
kind: Config
clusters:
- name: kinference-e2e
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: {user}
  user:
    client-certificate: {cert}
    client-key: {key}
contexts:
- name: kinference-e2e
  context:
    cluster: kinference-e2e
    user: {user}
current-context: kinference-e2e
",
        ca = server_ca.display(),
        cert = cert.cert.display(),
        key = cert.key.display(),
    );
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
