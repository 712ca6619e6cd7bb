//! The processes under test: an EPP, and the Envoy in front of it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context as _, Result};
use kinference_testbed::envoy::{Bootstrap, Envoy};
use kinference_testbed::load::cpu;
use kinference_testbed::{free_port, ttft_fit};
use tokio::process::{Child, Command};

use super::contenders::Peer;
use super::settings::{NS, POOL};

pub(crate) struct EppProcess {
    pub(crate) child: Child,
    pub(crate) pid: u32,
    pub(crate) grpc: SocketAddr,
    /// Its `/metrics` (ours reports its TTFT prediction errors there).
    pub(crate) metrics: SocketAddr,
    pub(crate) peer: Peer,
    /// Its config and log; removed when it stops.
    pub(crate) dir: PathBuf,
}

/// The EPP's command line: the same ports and plaintext for all, logs at each
/// one's default level (ours with one debug line per TTFT sample).
pub(crate) fn epp_command(
    peer: Peer,
    binary: &Path,
    config: Option<&Path>,
    kubeconfig: &Path,
    ports: [u16; 3],
    kv_events: Vec<std::ffi::OsString>,
) -> Command {
    let [grpc, health, metrics] = ports.map(|p| p.to_string());
    let mut cmd = Command::new(binary);
    cmd.env("KUBECONFIG", kubeconfig);
    match peer {
        Peer::Kinference => {
            cmd.args(["--bind-address", "127.0.0.1", "--namespace", NS])
                // Its InferenceObjectives, and the pool-level series.
                .args(["--metrics-pool-name", POOL])
                .args(["--grpc-port", &grpc, "--grpc-health-port", &health])
                .args(["--metrics-port", &metrics, "--secure-serving=false"])
                .args(["--log-format", "text"])
                // Each TTFT sample its model learns, for the hindsight fit
                // of its inputs (`ttft_fit`): a debug line per request.
                .env("RUST_LOG", "info,kinference_epp::ttft_samples=debug")
                .env("NO_COLOR", "1");
            if let Some(c) = config {
                cmd.arg("--policy-file").arg(c);
            }
            // Each decision's candidates and values, for looking into a
            // result (every contender and rep of the run appends to the
            // file this names; the policy hash and times tell them apart).
            if let Some(log) = std::env::var_os("KINFERENCE_BENCH_DECISION_LOG") {
                cmd.arg("--decision-log").arg(log);
            }
            cmd.args(kv_events);
        }
        Peer::Gie | Peer::Llmd => {
            cmd.args(["--pool-name", POOL, "--pool-namespace", NS])
                .args(["--grpc-port", &grpc, "--grpc-health-port", &health])
                .args(["--metrics-port", &metrics, "--secure-serving=false"])
                .args(["--metrics-endpoint-auth=false", "--tracing=false"]);
            if let Some(c) = config {
                cmd.arg("--config-file").arg(c);
            }
        }
    }
    cmd
}

impl EppProcess {
    pub(crate) async fn start(
        peer: Peer,
        binary: &Path,
        config: Option<&str>,
        port: u16,
        kubeconfig: &Path,
        kv_events: Vec<std::ffi::OsString>,
    ) -> Result<EppProcess> {
        let dir = scratch_dir()?;
        let config_path = match config {
            Some(text) => {
                let path = dir.join("config.yaml");
                std::fs::write(&path, text.replace("${PORT}", &port.to_string()))?;
                Some(path)
            }
            None => None,
        };
        let ports = [free_port()?, free_port()?, free_port()?];
        let log = std::fs::File::create(dir.join("epp.log"))?;
        let child = epp_command(
            peer,
            binary,
            config_path.as_deref(),
            kubeconfig,
            ports,
            kv_events,
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
        let pid = child.id().context("the EPP exited at once")?;
        Ok(EppProcess {
            child,
            pid,
            grpc: SocketAddr::from(([127, 0, 0, 1], ports[0])),
            metrics: SocketAddr::from(([127, 0, 0, 1], ports[2])),
            peer,
            dir,
        })
    }

    /// Bytes of its log so far: where a phase's lines start.
    pub(crate) fn log_len(&self) -> u64 {
        std::fs::metadata(self.dir.join("epp.log")).map_or(0, |m| m.len())
    }

    /// The TTFT samples it logged from byte `from` of its log on (only
    /// that part is read: the log grows by a line per request).
    pub(crate) fn ttft_samples_since(&self, from: u64) -> Vec<ttft_fit::Sample> {
        use std::io::{Read, Seek, SeekFrom};
        let mut bytes = Vec::new();
        let read = std::fs::File::open(self.dir.join("epp.log")).and_then(|mut log| {
            log.seek(SeekFrom::Start(from))?;
            log.read_to_end(&mut bytes)
        });
        if read.is_err() {
            return Vec::new();
        }
        ttft_fit::parse_log(&String::from_utf8_lossy(&bytes))
    }

    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("epp.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    pub(crate) async fn stop(mut self) {
        let _ = self.child.kill().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh directory for one EPP's files.
pub(crate) fn scratch_dir() -> Result<PathBuf> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("kinference-peer-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// An Envoy and the pid whose CPU it uses.
pub(crate) struct Gateway {
    pub(crate) envoy: Envoy,
    pub(crate) pid: Option<u32>,
}

pub(crate) async fn start_gateway(bootstrap: Bootstrap) -> Result<Gateway> {
    let before = cpu::children_named("envoy");
    let envoy = Envoy::start(&bootstrap).await?;
    let pid = cpu::children_named("envoy")
        .into_iter()
        .find(|p| !before.contains(p));
    Ok(Gateway { envoy, pid })
}

// ---------------------------------------------------------------------------
// Load.
// ---------------------------------------------------------------------------
