//! llm-d-inference-sim, the llm-d project's model-server simulator, as the
//! real publisher of KV-cache events in the precise-prefix tests: built from
//! the Go module proxy by `bench/peers/install.sh llmd-sim` and cached.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context as _, bail};

use crate::admission_front::AdmissionFront;
use tokio::process::{Child, Command};

/// `$KINFERENCE_LLMD_SIM`, else the cached build, building it when missing
/// (minutes, cold; needs Go and the module proxy).
pub async fn ensure_llmd_sim() -> anyhow::Result<PathBuf> {
    tokio::task::spawn_blocking(|| crate::peers::peer("llmd-sim", "KINFERENCE_LLMD_SIM")).await?
}

/// One simulator process: a Pod at `ip` serving `model` on `port`,
/// publishing its KV events to `events`. The simulator itself listens on
/// every address, at a port of its own, behind an [`AdmissionFront`] on
/// `ip:port`: a streamed answer's headers come at admission, as vLLM's.
pub struct LlmdSim {
    child: Child,
    front: AdmissionFront,
    /// The simulator's own address, behind the front.
    upstream: SocketAddr,
    pub addr: SocketAddr,
}

impl LlmdSim {
    pub async fn start(
        bin: &Path,
        ip: IpAddr,
        port: u16,
        model: &str,
        block_size: u32,
        events: SocketAddr,
    ) -> anyhow::Result<LlmdSim> {
        Self::start_with(bin, ip, port, model, block_size, events, &[]).await
    }

    /// [`LlmdSim::start`] with more of the simulator's flags (its LoRA
    /// adapters, latencies).
    pub async fn start_with(
        bin: &Path,
        ip: IpAddr,
        port: u16,
        model: &str,
        block_size: u32,
        events: SocketAddr,
        extra: &[String],
    ) -> anyhow::Result<LlmdSim> {
        let own = crate::free_port()?;
        let child = Command::new(bin)
            .args(extra)
            .args(["--port", &own.to_string(), "--model", model])
            .args(["--enable-kvcache", "--kv-cache-size", "1024"])
            .args(["--block-size", &block_size.to_string()])
            .args(["--force-dummy-tokenizer", "--max-model-len", "100000"])
            .arg("--zmq-endpoint")
            .arg(format!("tcp://{events}"))
            .env("POD_IP", ip.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let upstream = SocketAddr::from(([127, 0, 0, 1], own));
        let front = AdmissionFront::start(SocketAddr::new(ip, port), upstream, &[]).await?;
        let sim = LlmdSim {
            child,
            front,
            upstream,
            addr: SocketAddr::new(ip, port),
        };
        sim.wait_serving().await?;
        Ok(sim)
    }

    async fn wait_serving(&self) -> anyhow::Result<()> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while tokio::net::TcpStream::connect(self.upstream).await.is_err() {
            if std::time::Instant::now() > deadline {
                bail!(
                    "llm-d-inference-sim not serving on {} after 30 s",
                    self.addr
                );
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        Ok(())
    }

    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
        self.front.stop().await;
    }
}
