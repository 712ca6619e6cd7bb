//! One Envoy process on loopback, started from a rendered bootstrap and
//! killed when dropped.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::process::{Child, Command};

use super::binary::ensure_envoy;
use super::bootstrap::Bootstrap;

/// How long Envoy may take to come up (a cold start is well under a second;
/// a loaded CI machine gets room).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A running Envoy. Its listener and admin API are bound to ports the kernel
/// chose, read back from Envoy itself, so parallel tests never collide.
pub struct Envoy {
    child: Child,
    dir: tempfile::TempDir,
    admin: SocketAddr,
    listener: SocketAddr,
    http: reqwest::Client,
}

impl Envoy {
    /// Installs Envoy if needed, starts it with `bootstrap` and waits until it
    /// is live and its listener is bound.
    pub async fn start(bootstrap: &Bootstrap) -> anyhow::Result<Envoy> {
        let binary = ensure_envoy()?;
        let dir = tempfile::Builder::new()
            .prefix("kinference-envoy-")
            .tempdir()?;
        let access_log = dir.path().join("access.log");
        let config = dir.path().join("envoy.yaml");
        std::fs::write(&config, bootstrap.render(&access_log))?;
        let admin_file = dir.path().join("admin-address");
        let log = std::fs::File::create(dir.path().join("envoy.log"))?;
        let child = Command::new(&binary)
            .arg("--config-path")
            .arg(&config)
            .arg("--admin-address-path")
            .arg(&admin_file)
            // Several Envoys share this machine: no shared-memory hot restart.
            .arg("--disable-hot-restart")
            .args(["--concurrency", &bootstrap.concurrency.to_string()])
            .args(["--log-level", &bootstrap.log_level])
            // Access records are read back by tests: flush them promptly
            // (Envoy's default is every 10 s).
            .args(["--file-flush-interval-msec", "50"])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut envoy = Envoy {
            child,
            dir,
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
            listener: SocketAddr::from(([127, 0, 0, 1], 0)),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()?,
        };
        envoy
            .wait_until_live(&admin_file)
            .await
            .with_context(|| format!("Envoy did not start; its log:\n{}", envoy.log_tail()))?;
        Ok(envoy)
    }

    async fn wait_until_live(&mut self, admin_file: &Path) -> anyhow::Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("Envoy exited with {status}");
            }
            if Instant::now() > deadline {
                bail!("Envoy was not live after {START_TIMEOUT:?}");
            }
            if self.admin.port() == 0
                && let Ok(text) = std::fs::read_to_string(admin_file)
                && let Ok(addr) = text.trim().parse()
            {
                self.admin = addr;
            }
            if self.admin.port() != 0
                && self
                    .admin_get("/ready")
                    .await
                    .is_ok_and(|s| s.trim() == "LIVE")
                && let Some(addr) = self.bound_listener().await
            {
                self.listener = addr;
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn bound_listener(&self) -> Option<SocketAddr> {
        let text = self.admin_get("/listeners?format=json").await.ok()?;
        let json: serde_json::Value = serde_json::from_str(&text).ok()?;
        json["listener_statuses"].as_array()?.iter().find_map(|l| {
            let socket = &l["local_address"]["socket_address"];
            let port = socket["port_value"].as_u64()?;
            let ip = socket["address"].as_str()?.parse().ok()?;
            (port != 0).then(|| SocketAddr::new(ip, port as u16))
        })
    }

    /// The gateway listener, e.g. for `http://{listener}/v1/chat/completions`.
    pub fn listener(&self) -> SocketAddr {
        self.listener
    }

    /// `http://<listener><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.listener)
    }

    /// A GET on the admin API, e.g. `/clusters` or `/stats`.
    pub async fn admin_get(&self, path: &str) -> anyhow::Result<String> {
        let url = format!("http://{}{path}", self.admin);
        let response = self.http.get(&url).send().await?;
        let status = response.status();
        let text = response.text().await?;
        if !status.is_success() {
            bail!("GET {path} on the Envoy admin API: {status}: {text}");
        }
        Ok(text)
    }

    /// One counter or gauge by its full name (`cluster.pool.upstream_rq_retry`);
    /// `None` when Envoy has no such stat.
    pub async fn stat(&self, name: &str) -> anyhow::Result<Option<u64>> {
        let text = self.admin_get(&format!("/stats?filter=^{name}$")).await?;
        Ok(text
            .lines()
            .filter_map(|l| l.split_once(": "))
            .find(|(k, _)| *k == name)
            .and_then(|(_, v)| v.trim().parse().ok()))
    }

    /// The access log so far: one record per finished request.
    pub fn access_log(&self) -> Vec<AccessRecord> {
        self.access_log_text()
            .lines()
            .filter_map(AccessRecord::parse)
            .collect()
    }

    /// The access log as Envoy wrote it.
    pub fn access_log_text(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default()
    }

    /// The access record of the request with this `x-request-id`.
    pub fn access(&self, request_id: &str) -> Option<AccessRecord> {
        self.access_log()
            .into_iter()
            .find(|r| r.request_id.as_deref() == Some(request_id))
    }

    /// The last lines of Envoy's own log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Stops Envoy and waits for it to exit.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// One line of the access log ([`super::ACCESS_LOG_FORMAT`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessRecord {
    pub status: u16,
    /// Envoy's response flags (`UF`, `URX`, `UH`, …); empty when none.
    pub flags: String,
    /// The upstream `ip:port` that answered last.
    pub upstream: Option<String>,
    pub request_id: Option<String>,
    /// Upstream attempts (retries included).
    pub attempts: u32,
    pub bytes_received: u64,
    /// `x-gateway-destination-endpoint` as the router saw it.
    pub destination_header: Option<String>,
    /// `envoy.lb` / `x-gateway-destination-endpoint` metadata Envoy accepted.
    pub destination_metadata: Option<String>,
    /// `x-kinference-rule`, the rule the EPP named.
    pub rule: Option<String>,
    /// Request start to the upstream's first response byte.
    pub response_ms: Option<u64>,
    /// `envoy.lb` / `x-kinference-decision-detail` (the EPP's
    /// `--decision-detail`); last, as it may hold spaces.
    pub decision_detail: Option<String>,
}

impl AccessRecord {
    fn parse(line: &str) -> Option<AccessRecord> {
        let f: Vec<&str> = line.splitn(11, ' ').collect();
        if f.len() != 11 {
            return None;
        }
        let text = |s: &str| (s != "-").then(|| s.to_string());
        Some(AccessRecord {
            status: f[0].parse().unwrap_or(0),
            flags: text(f[1]).unwrap_or_default(),
            upstream: text(f[2]),
            request_id: text(f[3]),
            attempts: f[4].parse().unwrap_or(0),
            bytes_received: f[5].parse().unwrap_or(0),
            destination_header: text(f[6]),
            destination_metadata: text(f[7]),
            rule: text(f[8]),
            response_ms: f[9].parse().ok(),
            decision_detail: text(f[10]),
        })
    }
}
