//! `kinference-sim`: the model-server simulator as a standalone process, a
//! stand-in for vLLM Pods (e.g. in the kind scenario, `e2e/kind/`).
#![forbid(unsafe_code)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use clap::Parser;
use kinference_simulator::{SimConfig, spawn};

/// OpenAI-compatible model-server simulator with vLLM metrics.
#[derive(Debug, Parser)]
#[command(name = "kinference-sim", version)]
struct Args {
    /// Address to listen on (`::` for every IPv6 and IPv4 address).
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::UNSPECIFIED))]
    bind_address: IpAddr,
    /// Port to listen on.
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
    let addr = SocketAddr::new(args.bind_address, args.port);
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

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::Args;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(
            ["kinference-sim", "--model", "m"]
                .into_iter()
                .chain(args.iter().copied()),
        )
    }

    #[test]
    fn command_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn listens_on_every_ipv4_address_by_default() {
        let args = parse(&[]).unwrap();
        assert_eq!(
            (args.bind_address.to_string(), args.port),
            ("0.0.0.0".to_string(), 8000)
        );
    }

    #[test]
    fn bind_address_flag() {
        for addr in ["127.0.0.1", "::", "::1"] {
            let args = parse(&["--bind-address", addr, "--port", "9000"]).unwrap();
            assert_eq!(args.bind_address, addr.parse::<std::net::IpAddr>().unwrap());
            assert_eq!(args.port, 9000);
        }
        assert!(parse(&["--bind-address", "localhost"]).is_err());
    }
}
