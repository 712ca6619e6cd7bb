//! `kinference-sim`: the model-server simulator as a standalone process, a
//! stand-in for vLLM Pods (e.g. in the kind scenario, `e2e/kind/`).
#![forbid(unsafe_code)]

use std::net::{Ipv4Addr, SocketAddr};

use clap::Parser;
use kinference_simulator::{SimConfig, spawn};

/// OpenAI-compatible model-server simulator with vLLM metrics.
#[derive(Debug, Parser)]
#[command(name = "kinference-sim", version)]
struct Args {
    /// Port to listen on (all interfaces).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Model served; repeat for several (the first is the primary model).
    #[arg(long = "model", required = true)]
    models: Vec<String>,
    /// Server name, echoed in the `x-sim-server` response header.
    #[arg(long, env = "POD_NAME", default_value = "sim")]
    name: String,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, args.port));
    let sim = spawn(SimConfig::new(args.name, args.models), addr).await?;
    eprintln!("kinference-sim {} serving on {}", sim.name(), sim.addr());
    shutdown_signal().await?;
    eprintln!("shutting down");
    sim.shutdown().await;
    Ok(())
}

async fn shutdown_signal() -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r,
            _ = term.recv() => Ok(()),
        }
    }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c().await
}
