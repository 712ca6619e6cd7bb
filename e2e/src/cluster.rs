//! A real Kubernetes control plane for tests: `etcd` + `kube-apiserver`, no
//! kubelet, scheduler or controller-manager, no containers.
//!
//! [`TestCluster::start`] builds (once, cached) and starts pinned binaries on
//! free loopback ports, writes a kubeconfig, returns a ready [`kube::Client`]
//! authenticated as a `system:masters` user, and installs the upstream CRDs
//! from `e2e/fixtures/crds/` plus the project's own CRDs from `crds/`.
//!
//! Everything lives in a private temporary directory (etcd data, certificates,
//! logs, kubeconfig). Dropping the [`TestCluster`] kills both processes, waits
//! for them and removes the directory. Child processes are additionally started
//! under `setpriv --pdeathsig KILL` (when available) so they die with the test
//! process even if it is killed without unwinding.
//!
//! Because there is no controller-manager, nothing reconciles: namespaces
//! deleted stay `Terminating`, ownerReference garbage collection does not run,
//! Deployments create no Pods and Pods are never scheduled or started. Tests
//! create Pods and then set their `status` themselves (see
//! `tests/cluster_smoke.rs`).

use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions};
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, ResourceExt as _};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::OnceCell;
use yaml_rust2::{Yaml, YamlLoader};

/// Kubernetes release that `tools/install-k8s.sh` builds by default.
pub const K8S_VERSION: &str = "v1.36.3";
/// etcd release that `tools/install-k8s.sh` builds by default.
pub const ETCD_VERSION: &str = "v3.6.16";
/// Directory holding `kube-apiserver` and `etcd`; skips running the install script.
pub const BIN_DIR_ENV: &str = "KINFERENCE_K8S_BIN_DIR";
/// When set (to anything but `0`), the cluster's directory is kept after drop.
pub const KEEP_DIR_ENV: &str = "KINFERENCE_E2E_KEEP_DIR";
/// User name of the admin identity in the kubeconfig (group `system:masters`).
pub const ADMIN_USER: &str = "kinference-e2e-admin";
/// Field manager used when installing CRDs with server-side apply.
pub const FIELD_MANAGER: &str = "kinference-e2e";

const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(60);
const APISERVER_READY_TIMEOUT: Duration = Duration::from_secs(180);
const APISERVER_STOP_GRACE: Duration = Duration::from_secs(15);
const CRD_ESTABLISHED_TIMEOUT: Duration = Duration::from_secs(60);
const START_ATTEMPTS: usize = 3;
const LOG_TAIL_LINES: usize = 40;

/// Paths of the two control-plane binaries.
#[derive(Clone, Debug)]
pub struct Binaries {
    pub kube_apiserver: PathBuf,
    pub etcd: PathBuf,
}

impl Binaries {
    fn in_dir(dir: &Path) -> Result<Self> {
        let bins = Self {
            kube_apiserver: dir.join("kube-apiserver"),
            etcd: dir.join("etcd"),
        };
        for bin in [&bins.kube_apiserver, &bins.etcd] {
            ensure!(bin.is_file(), "missing binary {}", bin.display());
        }
        Ok(bins)
    }

    /// Locate the binaries: `$KINFERENCE_K8S_BIN_DIR` if set, else the
    /// directory printed by `e2e/tools/install-k8s.sh` (which builds and caches
    /// them on first use). The result is memoised for the whole process.
    pub async fn locate() -> Result<Self> {
        static DIR: OnceCell<PathBuf> = OnceCell::const_new();
        let dir = DIR
            .get_or_try_init(|| async {
                if let Some(dir) = std::env::var_os(BIN_DIR_ENV).filter(|d| !d.is_empty()) {
                    return Ok(PathBuf::from(dir));
                }
                run_install_script(&install_script_path(), BIN_DIR_ENV).await
            })
            .await?;
        Self::in_dir(dir)
    }
}

/// Path of the install script inside this crate.
pub fn install_script_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/install-k8s.sh")
}

/// The upstream CRD fixtures (`e2e/fixtures/crds`).
pub fn fixture_crds_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/crds")
}

/// The project's own generated CRDs (`crds/` at the repository root).
pub fn project_crds_dir() -> PathBuf {
    let e2e = Path::new(env!("CARGO_MANIFEST_DIR"));
    e2e.parent().unwrap_or(e2e).join("crds")
}

/// Runs an install script of `tools/` and returns the directory it prints
/// last; `skip_env` names the variable that skips it.
pub(crate) async fn run_install_script(script: &Path, skip_env: &str) -> Result<PathBuf> {
    // stderr is inherited so a (slow, one-off) cold build shows progress.
    let out = tokio::process::Command::new("bash")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("running {}", script.display()))?;
    ensure!(
        out.status.success(),
        "{} failed with {} (set {skip_env} to use prebuilt binaries)",
        script.display(),
        out.status
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let dir = stdout
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .ok_or_else(|| anyhow!("{} printed no directory", script.display()))?;
    Ok(PathBuf::from(dir))
}

/// How [`TestCluster::start_with`] starts the cluster; the default is what
/// [`TestCluster::start`] does.
#[derive(Clone, Debug, Default)]
pub struct StartOptions {
    /// Write an audit log: every request at level `Metadata`, stages
    /// ResponseStarted (watches) and ResponseComplete, one JSON event per
    /// line, never rotated, at [`TestCluster::audit_log_path`].
    pub audit_log: bool,
    /// More kube-apiserver flags (`--name=value`). One named like a default
    /// flag replaces it (list flags such as `--authorization-mode` would
    /// otherwise be given twice); others are appended. Kept for
    /// [`TestCluster::start_apiserver`].
    pub extra_apiserver_args: Vec<String>,
    /// Install only the upstream fixture CRDs, not the project's (`crds/`):
    /// for a test that installs them itself, as a user would (`helm install`).
    pub skip_project_crds: bool,
}

/// The audit policy of [`StartOptions::audit_log`]: request metadata only
/// (no bodies), and no event on receipt, so a request is one event (a watch
/// two: when it starts and when it ends).
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
";

impl StartOptions {
    /// The kube-apiserver flags for these options, writing what they refer
    /// to (the audit policy) into the cluster directory `dir`.
    fn apiserver_args(&self, dir: &Path) -> Result<Vec<String>> {
        let mut args = Vec::new();
        if self.audit_log {
            let policy = dir.join("audit-policy.yaml");
            fs::write(&policy, AUDIT_POLICY)?;
            args.extend([
                format!("--audit-policy-file={}", policy.display()),
                format!("--audit-log-path={}", audit_log_path(dir).display()),
                "--audit-log-format=json".to_owned(),
                // Rotation would split the log under a reader's feet.
                "--audit-log-maxsize=1000000".to_owned(),
            ]);
        }
        args.extend(self.extra_apiserver_args.iter().cloned());
        Ok(args)
    }
}

fn audit_log_path(dir: &Path) -> PathBuf {
    dir.join("logs/audit.log")
}

/// A running etcd + kube-apiserver pair. See the module docs.
pub struct TestCluster {
    bins: Binaries,
    dir: ScratchDir,
    etcd: Option<ManagedProcess>,
    apiserver: Option<ManagedProcess>,
    etcd_client_port: u16,
    etcd_peer_port: u16,
    apiserver_port: u16,
    kubeconfig_path: PathBuf,
    client: Client,
    token: String,
    /// Flags from [`StartOptions`], for every start of kube-apiserver.
    apiserver_args: Vec<String>,
}

impl std::fmt::Debug for TestCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCluster")
            .field("dir", &self.dir.path)
            .field("server", &self.server_url())
            .field("etcd", &self.etcd_url())
            .finish_non_exhaustive()
    }
}

impl TestCluster {
    /// Start etcd and kube-apiserver, wait until `/readyz` passes, and install
    /// the upstream fixture CRDs and the project's CRDs (waiting until each is
    /// `Established`).
    pub async fn start() -> Result<Self> {
        Self::start_with(StartOptions::default()).await
    }

    /// Like [`TestCluster::start`], as `options` say.
    pub async fn start_with(options: StartOptions) -> Result<Self> {
        let cluster = Self::start_without_crds_with(&options).await?;
        cluster.install_crds_from_dir(&fixture_crds_dir()).await?;
        let project = project_crds_dir();
        if project.is_dir() && !options.skip_project_crds {
            cluster.install_crds_from_dir(&project).await?;
        }
        Ok(cluster)
    }

    /// Like [`TestCluster::start`], but installs no CRDs.
    pub async fn start_without_crds() -> Result<Self> {
        Self::start_without_crds_with(&StartOptions::default()).await
    }

    async fn start_without_crds_with(options: &StartOptions) -> Result<Self> {
        let bins = Binaries::locate().await?;
        let mut last_err = None;
        for attempt in 1..=START_ATTEMPTS {
            match Self::try_start(&bins, options).await {
                Ok(cluster) => return Ok(cluster),
                // A port picked as free may have been taken by someone else
                // before the server bound it: retry on fresh ports.
                Err(e)
                    if attempt < START_ATTEMPTS
                        && format!("{e:#}").contains("address already in use") =>
                {
                    last_err = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow!("cluster did not start")))
    }

    async fn try_start(bins: &Binaries, options: &StartOptions) -> Result<Self> {
        let dir = ScratchDir::new()?;
        let apiserver_args = options.apiserver_args(&dir.path)?;
        let token = format!("kinference-e2e-{:016x}", unique_u64());
        let pki = dir.path.join("pki");
        fs::create_dir_all(&pki)?;
        generate_rsa_key(&pki.join("sa.key")).await?;
        fs::write(
            pki.join("tokens.csv"),
            format!("{token},{ADMIN_USER},{ADMIN_USER},\"system:masters\"\n"),
        )?;

        let etcd_client_port = free_port()?;
        let etcd_peer_port = free_port()?;
        let apiserver_port = free_port()?;
        let kubeconfig_path = dir.path.join("kubeconfig");

        let mut etcd = spawn_etcd(bins, &dir.path, etcd_client_port, etcd_peer_port)?;
        wait_etcd_healthy(&mut etcd, etcd_client_port).await?;

        let mut apiserver = spawn_apiserver(
            bins,
            &dir.path,
            etcd_client_port,
            apiserver_port,
            &apiserver_args,
        )?;
        let server_url = format!("https://127.0.0.1:{apiserver_port}");
        let client = write_kubeconfig(
            &mut apiserver,
            &dir.path,
            &server_url,
            &token,
            &kubeconfig_path,
        )
        .await?;
        let mut cluster = Self {
            bins: bins.clone(),
            dir,
            etcd: Some(etcd),
            apiserver: Some(apiserver),
            etcd_client_port,
            etcd_peer_port,
            apiserver_port,
            kubeconfig_path,
            client,
            token,
            apiserver_args,
        };
        cluster.wait_apiserver_ready().await?;
        Ok(cluster)
    }

    /// A client authenticated as [`ADMIN_USER`] (group `system:masters`).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// A client acting as `user` (e.g. a ServiceAccount,
    /// `system:serviceaccount:<ns>:<name>`) through impersonation: every
    /// request is authorized by RBAC as that user's, with no group of its own.
    pub async fn client_as(&self, user: &str) -> Result<Client> {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig_path)?;
        let mut config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
        config.auth_info.impersonate = Some(user.to_string());
        Ok(Client::try_from(config)?)
    }

    /// A kubeconfig for this cluster (token auth, the apiserver's own CA), for
    /// handing to a subprocess via `KUBECONFIG`.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig_path
    }

    /// `https://127.0.0.1:<port>`; stable across [`TestCluster::restart_apiserver`].
    pub fn server_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.apiserver_port)
    }

    /// `http://127.0.0.1:<port>` of the etcd client endpoint.
    pub fn etcd_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.etcd_client_port)
    }

    /// The bearer token of [`ADMIN_USER`].
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The cluster's scratch directory (logs, pki, etcd data, kubeconfig).
    pub fn dir(&self) -> &Path {
        &self.dir.path
    }

    /// Paths of the binaries in use.
    pub fn binaries(&self) -> &Binaries {
        &self.bins
    }

    /// Path of the kube-apiserver log (all runs appended).
    pub fn apiserver_log_path(&self) -> PathBuf {
        self.dir.path.join("logs/kube-apiserver.log")
    }

    /// Path of the audit log ([`StartOptions::audit_log`]).
    pub fn audit_log_path(&self) -> PathBuf {
        audit_log_path(&self.dir.path)
    }

    /// The CA that signed kube-apiserver's serving certificate (PEM), for
    /// other clients of the cluster (kubelet, controllers).
    pub fn apiserver_ca_path(&self) -> PathBuf {
        self.dir.path.join("pki/apiserver-ca.crt")
    }

    /// The RSA key kube-apiserver signs and verifies ServiceAccount tokens
    /// with; a controller-manager signs with it too.
    pub fn service_account_key_path(&self) -> PathBuf {
        self.dir.path.join("pki/sa.key")
    }

    /// Path of the etcd log.
    pub fn etcd_log_path(&self) -> PathBuf {
        self.dir.path.join("logs/etcd.log")
    }

    /// The last `lines` lines of the kube-apiserver log.
    pub fn apiserver_log_tail(&self, lines: usize) -> String {
        log_tail(&self.apiserver_log_path(), lines)
    }

    /// Whether kube-apiserver is currently running.
    pub fn apiserver_running(&mut self) -> bool {
        self.apiserver
            .as_mut()
            .is_some_and(ManagedProcess::is_running)
    }

    /// Stop etcd (SIGTERM, then SIGKILL after a grace period); its data
    /// stays. kube-apiserver keeps running and answers with errors until
    /// [`TestCluster::start_etcd`].
    pub async fn stop_etcd(&mut self) -> Result<()> {
        if let Some(mut p) = self.etcd.take() {
            p.terminate(APISERVER_STOP_GRACE).await?;
        }
        Ok(())
    }

    /// Start etcd again on the same ports with the same data, and wait until
    /// it is healthy. No-op if running.
    pub async fn start_etcd(&mut self) -> Result<()> {
        if self.etcd.as_mut().is_some_and(ManagedProcess::is_running) {
            return Ok(());
        }
        let mut etcd = spawn_etcd(
            &self.bins,
            &self.dir.path,
            self.etcd_client_port,
            self.etcd_peer_port,
        )?;
        wait_etcd_healthy(&mut etcd, self.etcd_client_port).await?;
        self.etcd = Some(etcd);
        Ok(())
    }

    /// Stop kube-apiserver (SIGTERM, then SIGKILL after a grace period).
    /// etcd keeps running; clients see connection errors until
    /// [`TestCluster::start_apiserver`]. No-op if it is already stopped.
    pub async fn stop_apiserver(&mut self) -> Result<()> {
        if let Some(mut p) = self.apiserver.take() {
            p.terminate(APISERVER_STOP_GRACE).await?;
        }
        Ok(())
    }

    /// Start kube-apiserver again on the same port with the same etcd,
    /// certificates and token, and wait until it is ready. No-op if running.
    pub async fn start_apiserver(&mut self) -> Result<()> {
        if self.apiserver_running() {
            return Ok(());
        }
        self.apiserver = Some(spawn_apiserver(
            &self.bins,
            &self.dir.path,
            self.etcd_client_port,
            self.apiserver_port,
            &self.apiserver_args,
        )?);
        self.wait_apiserver_ready().await
    }

    /// [`TestCluster::stop_apiserver`] then [`TestCluster::start_apiserver`].
    /// Existing clients keep working afterwards (same URL, CA and token).
    pub async fn restart_apiserver(&mut self) -> Result<()> {
        self.stop_apiserver().await?;
        self.start_apiserver().await
    }

    /// Apply every `*.yaml`/`*.yml` file in `dir` (sorted by name) as
    /// CustomResourceDefinitions and wait until all are `Established`.
    /// Returns the CRD names. A missing or empty directory installs nothing.
    pub async fn install_crds_from_dir(&self, dir: &Path) -> Result<Vec<String>> {
        let mut files = Vec::new();
        if dir.is_dir() {
            for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
                let path = entry?.path();
                let is_yaml = path
                    .extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| e == "yaml" || e == "yml");
                if is_yaml && path.is_file() {
                    files.push(path);
                }
            }
        }
        files.sort();
        let api: Api<CustomResourceDefinition> = Api::all(self.client());
        let mut names = Vec::new();
        let mut admission = Vec::new();
        for file in &files {
            let docs = load_cluster_docs(file)?;
            for crd in docs.crds {
                let name = apply_crd(&api, crd)
                    .await
                    .with_context(|| format!("installing CRDs from {}", file.display()))?;
                names.push(name);
            }
            admission.push((file, docs.policies, docs.bindings));
        }
        for name in &names {
            wait_crd_established(&api, name).await?;
        }
        for (file, policies, bindings) in admission {
            self.apply_admission(policies, bindings)
                .await
                .with_context(|| {
                    format!("installing admission policies from {}", file.display())
                })?;
        }
        Ok(names)
    }

    /// Server-side apply admission policies and their bindings. The API
    /// server enforces a policy shortly after, not at once.
    async fn apply_admission(
        &self,
        policies: Vec<ValidatingAdmissionPolicy>,
        bindings: Vec<ValidatingAdmissionPolicyBinding>,
    ) -> Result<()> {
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let api: Api<ValidatingAdmissionPolicy> = Api::all(self.client());
        for policy in policies {
            api.patch(&policy.name_any(), &params, &Patch::Apply(&policy))
                .await?;
        }
        let api: Api<ValidatingAdmissionPolicyBinding> = Api::all(self.client());
        for binding in bindings {
            api.patch(&binding.name_any(), &params, &Patch::Apply(&binding))
                .await?;
        }
        Ok(())
    }

    /// Server-side apply the given CRDs and wait until all are `Established`.
    pub async fn install_crds(&self, crds: Vec<CustomResourceDefinition>) -> Result<Vec<String>> {
        let api: Api<CustomResourceDefinition> = Api::all(self.client());
        let mut names = Vec::with_capacity(crds.len());
        for crd in crds {
            names.push(apply_crd(&api, crd).await?);
        }
        for name in &names {
            wait_crd_established(&api, name).await?;
        }
        Ok(names)
    }

    fn check_apiserver_alive(&mut self) -> Result<()> {
        match self.apiserver.as_mut() {
            Some(p) => p.check_alive(),
            None => bail!("kube-apiserver is not running"),
        }
    }

    async fn wait_apiserver_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + APISERVER_READY_TIMEOUT;
        loop {
            self.check_apiserver_alive()?;
            let req = http::Request::get("/readyz?verbose").body(Vec::new())?;
            let last = match self.client.request_text(req).await {
                Ok(_) => return Ok(()),
                Err(e) => e.to_string(),
            };
            if Instant::now() > deadline {
                bail!(
                    "kube-apiserver at {} not ready after {:?} (last /readyz: {last}); last log lines ({}):\n{}",
                    self.server_url(),
                    APISERVER_READY_TIMEOUT,
                    self.apiserver_log_path().display(),
                    self.apiserver_log_tail(LOG_TAIL_LINES)
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        // apiserver first (it depends on etcd); both are killed and reaped
        // before the scratch dir (a later field) is removed.
        drop(self.apiserver.take());
        drop(self.etcd.take());
    }
}

/// Parse every CustomResourceDefinition in a (multi-document) YAML file.
pub fn load_crds(path: &Path) -> Result<Vec<CustomResourceDefinition>> {
    Ok(load_cluster_docs(path)?.crds)
}

/// What a cluster admin installs once: CRDs, and the admission policies that
/// bound what their schemas cannot.
#[derive(Default)]
pub struct ClusterDocs {
    pub crds: Vec<CustomResourceDefinition>,
    pub policies: Vec<ValidatingAdmissionPolicy>,
    pub bindings: Vec<ValidatingAdmissionPolicyBinding>,
}

pub fn load_cluster_docs(path: &Path) -> Result<ClusterDocs> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let docs =
        yaml_documents_to_json(&text).with_context(|| format!("parsing {}", path.display()))?;
    let mut out = ClusterDocs::default();
    for doc in docs {
        let kind = doc
            .get("kind")
            .and_then(|k| k.as_str())
            .unwrap_or_default()
            .to_string();
        let decoded = match kind.as_str() {
            "CustomResourceDefinition" => serde_json::from_value(doc).map(|d| out.crds.push(d)),
            "ValidatingAdmissionPolicy" => {
                serde_json::from_value(doc).map(|d| out.policies.push(d))
            }
            "ValidatingAdmissionPolicyBinding" => {
                serde_json::from_value(doc).map(|d| out.bindings.push(d))
            }
            _ => bail!(
                "{}: expected CustomResourceDefinitions and admission policies, found kind {kind:?}",
                path.display()
            ),
        };
        decoded.with_context(|| format!("decoding a {kind} in {}", path.display()))?;
    }
    Ok(out)
}

/// Convert a multi-document YAML string to JSON values, skipping empty documents.
pub fn yaml_documents_to_json(text: &str) -> Result<Vec<serde_json::Value>> {
    let docs = YamlLoader::load_from_str(text)?;
    docs.iter()
        .filter(|d| !matches!(d, Yaml::Null))
        .map(yaml_to_json)
        .collect()
}

fn yaml_to_json(y: &Yaml) -> Result<serde_json::Value> {
    use serde_json::Value;
    Ok(match y {
        Yaml::Null => Value::Null,
        Yaml::Boolean(b) => Value::Bool(*b),
        Yaml::Integer(i) => Value::from(*i),
        Yaml::Real(_) => {
            let f = y
                .as_f64()
                .ok_or_else(|| anyhow!("invalid YAML float {y:?}"))?;
            Value::Number(
                serde_json::Number::from_f64(f)
                    .ok_or_else(|| anyhow!("non-finite YAML float {y:?}"))?,
            )
        }
        Yaml::String(s) => Value::String(s.clone()),
        Yaml::Array(items) => Value::Array(items.iter().map(yaml_to_json).collect::<Result<_>>()?),
        Yaml::Hash(map) => {
            let mut out = serde_json::Map::with_capacity(map.len());
            for (k, v) in map {
                let key = match k {
                    Yaml::String(s) | Yaml::Real(s) => s.clone(),
                    Yaml::Integer(i) => i.to_string(),
                    Yaml::Boolean(b) => b.to_string(),
                    Yaml::Null => "null".to_owned(),
                    other => bail!("unsupported YAML mapping key {other:?}"),
                };
                out.insert(key, yaml_to_json(v)?);
            }
            Value::Object(out)
        }
        Yaml::Alias(_) => bail!("YAML aliases are not supported"),
        Yaml::BadValue => bail!("invalid YAML value"),
    })
}

async fn apply_crd(
    api: &Api<CustomResourceDefinition>,
    mut crd: CustomResourceDefinition,
) -> Result<String> {
    let name = crd
        .metadata
        .name
        .clone()
        .ok_or_else(|| anyhow!("CustomResourceDefinition without metadata.name"))?;
    crd.status = None;
    let params = PatchParams::apply(FIELD_MANAGER).force();
    api.patch(&name, &params, &Patch::Apply(&crd))
        .await
        .with_context(|| format!("applying CRD {name}"))?;
    Ok(name)
}

async fn wait_crd_established(api: &Api<CustomResourceDefinition>, name: &str) -> Result<()> {
    let deadline = Instant::now() + CRD_ESTABLISHED_TIMEOUT;
    loop {
        let crd = api
            .get(name)
            .await
            .with_context(|| format!("reading CRD {name}"))?;
        let conditions = crd.status.as_ref().and_then(|s| s.conditions.as_ref());
        if conditions
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "Established" && c.status == "True")
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("CRD {name} not Established after {CRD_ESTABLISHED_TIMEOUT:?}: {conditions:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn last_pem_certificate(pem: &str) -> Option<String> {
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let start = pem.rfind(BEGIN)?;
    let end = pem[start..].find(END)? + start + END.len();
    Some(format!("{}\n", &pem[start..end]))
}

/// Wait for kube-apiserver's self-signed serving certificate, extract its CA,
/// write the kubeconfig and build a client from it.
async fn write_kubeconfig(
    apiserver: &mut ManagedProcess,
    dir: &Path,
    server_url: &str,
    token: &str,
    kubeconfig_path: &Path,
) -> Result<Client> {
    let ca_path = dir.join("pki/apiserver-ca.crt");
    let cert_file = dir.join("pki/serving/apiserver.crt");
    let deadline = Instant::now() + APISERVER_READY_TIMEOUT;
    // kube-apiserver writes its self-signed serving cert (leaf followed by
    // the CA that signed it) to --cert-dir early during start-up.
    let ca = loop {
        if let Ok(pem) = fs::read_to_string(&cert_file)
            && let Some(ca) = last_pem_certificate(&pem)
        {
            break ca;
        }
        apiserver.check_alive()?;
        if Instant::now() > deadline {
            bail!(
                "kube-apiserver wrote no serving certificate to {} within {APISERVER_READY_TIMEOUT:?}\n{}",
                cert_file.display(),
                log_tail(&apiserver.log_path, LOG_TAIL_LINES)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    fs::write(&ca_path, ca)?;
    let kubeconfig = format!(
        "apiVersion: v1
kind: Config
clusters:
- name: kinference-e2e
  cluster:
    server: {server_url}
    certificate-authority: {ca}
users:
- name: {ADMIN_USER}
  user:
    token: {token}
contexts:
- name: kinference-e2e
  context:
    cluster: kinference-e2e
    user: {ADMIN_USER}
    namespace: default
current-context: kinference-e2e
",
        ca = ca_path.display(),
    );
    fs::write(kubeconfig_path, kubeconfig)?;
    let kc = Kubeconfig::read_from(kubeconfig_path)?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

async fn generate_rsa_key(path: &Path) -> Result<()> {
    let out = tokio::process::Command::new("openssl")
        .args(["genrsa", "-out"])
        .arg(path)
        .arg("2048")
        .stdin(Stdio::null())
        .output()
        .await
        .context("running `openssl genrsa` (is the openssl CLI installed?)")?;
    ensure!(
        out.status.success(),
        "openssl genrsa failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn spawn_etcd(
    bins: &Binaries,
    dir: &Path,
    client_port: u16,
    peer_port: u16,
) -> Result<ManagedProcess> {
    let client_url = format!("http://127.0.0.1:{client_port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let data_dir = dir.join("etcd-data");
    let args = vec![
        "--name=e2e".to_owned(),
        format!("--data-dir={}", data_dir.display()),
        format!("--listen-client-urls={client_url}"),
        format!("--advertise-client-urls={client_url}"),
        format!("--listen-peer-urls={peer_url}"),
        format!("--initial-advertise-peer-urls={peer_url}"),
        format!("--initial-cluster=e2e={peer_url}"),
        "--initial-cluster-state=new".to_owned(),
        // Throwaway data: skip fsync, it dominates latency on slow disks.
        "--unsafe-no-fsync=true".to_owned(),
        "--log-level=warn".to_owned(),
    ];
    ManagedProcess::spawn("etcd", &bins.etcd, &args, &dir.join("logs/etcd.log"))
}

fn spawn_apiserver(
    bins: &Binaries,
    dir: &Path,
    etcd_port: u16,
    port: u16,
    extra_args: &[String],
) -> Result<ManagedProcess> {
    let pki = dir.join("pki");
    let sa_key = pki.join("sa.key");
    let mut args = vec![
        format!("--etcd-servers=http://127.0.0.1:{etcd_port}"),
        "--bind-address=127.0.0.1".to_owned(),
        "--advertise-address=127.0.0.1".to_owned(),
        format!("--secure-port={port}"),
        // Self-signed serving cert + CA, generated on first start and reused
        // on restarts (so clients keep trusting it).
        format!("--cert-dir={}", pki.join("serving").display()),
        format!("--token-auth-file={}", pki.join("tokens.csv").display()),
        "--authorization-mode=RBAC".to_owned(),
        format!("--service-account-key-file={}", sa_key.display()),
        format!("--service-account-signing-key-file={}", sa_key.display()),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_owned(),
        // No controller-manager creates `default` ServiceAccounts, so the
        // ServiceAccount admission plugin would reject every Pod.
        "--disable-admission-plugins=ServiceAccount".to_owned(),
        // Do not publish the loopback address as `default/kubernetes` endpoints.
        "--endpoint-reconciler-type=none".to_owned(),
        "--service-cluster-ip-range=10.96.0.0/16".to_owned(),
        "--profiling=false".to_owned(),
    ];
    merge_flags(&mut args, extra_args);
    ManagedProcess::spawn(
        "kube-apiserver",
        &bins.kube_apiserver,
        &args,
        &dir.join("logs/kube-apiserver.log"),
    )
}

/// Add `extra` flags to `args`: one with the name of a flag already there
/// (`--name` of `--name=value`) takes its place, the others go at the end.
fn merge_flags(args: &mut Vec<String>, extra: &[String]) {
    let name = |flag: &str| flag.split('=').next().unwrap_or_default().to_owned();
    for flag in extra {
        match args.iter_mut().find(|a| name(a) == name(flag)) {
            Some(existing) => existing.clone_from(flag),
            None => args.push(flag.clone()),
        }
    }
}

async fn wait_etcd_healthy(etcd: &mut ManagedProcess, port: u16) -> Result<()> {
    let deadline = Instant::now() + ETCD_READY_TIMEOUT;
    loop {
        etcd.check_alive()?;
        let last = match etcd_health(port).await {
            Ok(body) if body.contains("\"health\":\"true\"") => return Ok(()),
            Ok(body) => body,
            Err(e) => e.to_string(),
        };
        if Instant::now() > deadline {
            bail!(
                "etcd on port {port} not healthy after {ETCD_READY_TIMEOUT:?} (last: {last}); log:\n{}",
                log_tail(&etcd.log_path, LOG_TAIL_LINES)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `GET /health` over plain HTTP/1.0 (etcd's client port speaks HTTP/1.1 and gRPC).
async fn etcd_health(port: u16) -> Result<String> {
    let io = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        stream
            .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .await?;
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await?;
        anyhow::Ok(String::from_utf8_lossy(&buf).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(2), io)
        .await
        .map_err(|_| anyhow!("timed out"))?
}

/// A child process that is killed and reaped on drop.
struct ManagedProcess {
    name: &'static str,
    child: Child,
    log_path: PathBuf,
}

impl ManagedProcess {
    fn spawn(name: &'static str, bin: &Path, args: &[String], log_path: &Path) -> Result<Self> {
        if let Some(parent) = log_path.parent() {
            fs::create_dir_all(parent)?;
        }
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)?;
        writeln!(log, "==== starting {} {}", bin.display(), args.join(" "))?;
        let mut cmd = match setpriv() {
            // Make the kernel kill the child if the test process dies
            // without running destructors (e.g. SIGKILL on timeout).
            Some(setpriv) => {
                let mut c = Command::new(setpriv);
                c.args(["--pdeathsig", "KILL", "--"]).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = cmd
            .spawn()
            .with_context(|| format!("spawning {}", bin.display()))?;
        Ok(Self {
            name,
            child,
            log_path: log_path.to_owned(),
        })
    }

    fn exited(&mut self) -> Result<Option<std::process::ExitStatus>> {
        self.child
            .try_wait()
            .with_context(|| format!("waiting for {}", self.name))
    }

    fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.exited()? {
            bail!(
                "{} exited with {status}; last log lines ({}):\n{}",
                self.name,
                self.log_path.display(),
                log_tail(&self.log_path, LOG_TAIL_LINES)
            );
        }
        Ok(())
    }

    fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM, wait up to `grace`, then SIGKILL.
    async fn terminate(&mut self, grace: Duration) -> Result<()> {
        if self.exited()?.is_some() {
            return Ok(());
        }
        let pid = self.child.id().to_string();
        let sent = Command::new("kill")
            .args(["-TERM", &pid])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if sent {
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline {
                if self.exited()?.is_some() {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        self.kill();
        Ok(())
    }

    fn kill(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

fn setpriv() -> Option<&'static Path> {
    static SETPRIV: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    SETPRIV
        .get_or_init(|| {
            let ok = Command::new("setpriv")
                .args(["--pdeathsig", "KILL", "--", "true"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            ok.then(|| PathBuf::from("setpriv"))
        })
        .as_deref()
}

fn log_tail(path: &Path, lines: usize) -> String {
    let mut text = String::new();
    if let Ok(mut f) = File::open(path) {
        let _ = f.read_to_string(&mut text);
    }
    let all: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    for line in &all[all.len().saturating_sub(lines)..] {
        let _ = writeln!(out, "    {line}");
    }
    out
}

fn unique_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default();
    nanos
        ^ (u64::from(std::process::id()) << 32)
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// A loopback TCP port that is free now and was not handed out before in this
/// process (so parallel clusters never pick the same one).
fn free_port() -> Result<u16> {
    Ok(kinference_testbed::free_port()?)
}

/// A uniquely named directory under the system temp dir, removed on drop
/// unless [`KEEP_DIR_ENV`] is set.
struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    const PREFIX: &'static str = "kinference-e2e-";

    fn new() -> Result<Self> {
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(Self::remove_stale);
        let name = format!(
            "{}{}-{:016x}",
            Self::PREFIX,
            std::process::id(),
            unique_u64()
        );
        let path = std::env::temp_dir().join(name);
        fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path })
    }

    /// Best effort: remove directories left by test processes that were
    /// killed without unwinding (their processes died with them, see
    /// `setpriv --pdeathsig`). Directories of live processes are kept.
    fn remove_stale() {
        let keep = std::env::var_os(KEEP_DIR_ENV).is_some_and(|v| !v.is_empty() && v != "0");
        if keep || !Path::new("/proc/self").exists() {
            return;
        }
        let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|n| n.strip_prefix(Self::PREFIX))
                .and_then(|rest| rest.split_once('-'))
                .and_then(|(pid, _)| pid.parse::<u32>().ok())
            else {
                continue;
            };
            if pid != std::process::id() && !Path::new("/proc").join(pid.to_string()).exists() {
                let _ = fs::remove_dir_all(entry.path());
            }
        }
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let keep = std::env::var_os(KEEP_DIR_ENV).is_some_and(|v| !v.is_empty() && v != "0");
        if keep {
            eprintln!(
                "kinference-e2e: keeping cluster dir {}",
                self.path.display()
            );
        } else {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::merge_flags;

    #[test]
    fn an_extra_flag_replaces_the_default_of_the_same_name() {
        let mut args = vec![
            "--authorization-mode=RBAC".to_owned(),
            "--disable-admission-plugins=ServiceAccount".to_owned(),
        ];
        merge_flags(
            &mut args,
            &[
                "--authorization-mode=Node,RBAC".to_owned(),
                "--disable-admission-plugins=".to_owned(),
                "--client-ca-file=/ca.crt".to_owned(),
            ],
        );
        assert_eq!(
            args,
            [
                "--authorization-mode=Node,RBAC",
                "--disable-admission-plugins=",
                "--client-ca-file=/ca.crt",
            ]
        );
    }
}
