//! `kinference-operator`: the CLI around [`kinference_operator::run`].
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use kinference_operator::{
    Config, DEFAULT_EPP_IMAGE, Health, LeaderElectionConfig, Metrics, Requeue, metrics,
    shutdown_channel,
};
use kinference_runtime::{LogArgs, admin, logs, shutdown_signal};

/// Reconciles InferencePolicies into InferencePools, HTTPRoutes and EPPs.
#[derive(Debug, Parser)]
#[command(name = "kinference-operator", version)]
struct Args {
    /// Image of the endpoint picker Deployments.
    #[arg(long, env = "KINFERENCE_EPP_IMAGE", default_value = DEFAULT_EPP_IMAGE)]
    epp_image: String,
    /// Replicas of each EPP Deployment whose policy names none. Unset: the
    /// operator leaves `spec.replicas` alone (1 when created), so an HPA
    /// can scale the EPP.
    #[arg(long, env = "KINFERENCE_EPP_REPLICAS", value_parser = clap::value_parser!(i32).range(1..=100))]
    epp_replicas: Option<i32>,
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "KINFERENCE_NAMESPACE")]
    namespace: Option<String>,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "KINFERENCE_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Reconcile only while holding the Lease `kinference-operator`.
    #[arg(long, env = "KINFERENCE_LEADER_ELECT")]
    leader_elect: bool,
    /// Namespace of the leader Lease (default: the client's namespace, i.e.
    /// the operator's own namespace in a cluster).
    #[arg(long, env = "KINFERENCE_LEADER_ELECTION_NAMESPACE")]
    leader_election_namespace: Option<String>,
    /// Identity in the Lease and in Events (default: $POD_NAME, else the host name).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Seconds between reconciles of a settled policy (fallback for missed events).
    #[arg(long, default_value_t = 300)]
    resync_seconds: u64,
    // `--log-format json|text`, the same flag as the EPP's.
    #[command(flatten)]
    logs: LogArgs,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    logs::init(args.logs.log_format);
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "operator failed");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let client = kube::Client::try_default()
        .await
        .context("creating the Kubernetes client")?;
    let identity = args
        .identity
        .clone()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| format!("kinference-operator-{}", std::process::id()));
    let leader_election = args.leader_elect.then(|| {
        let ns = args
            .leader_election_namespace
            .clone()
            .unwrap_or_else(|| client.default_namespace().to_string());
        LeaderElectionConfig::new(ns, identity.clone())
    });
    let metrics = Metrics::new();
    let health = Health::default();
    let config = Config {
        epp_image: args.epp_image,
        epp_replicas: args.epp_replicas,
        namespace: args.namespace,
        requeue: Requeue {
            resync: Duration::from_secs(args.resync_seconds),
            ..Requeue::default()
        },
        leader_election,
        instance: Some(identity),
        metrics: metrics.clone(),
        health: health.clone(),
        ..Config::default()
    };

    let (trigger, shutdown) = shutdown_channel();
    let listener = admin::bind(args.metrics_addr).await?;
    let http = tokio::spawn(admin::serve(listener, metrics::router(metrics, health), {
        let shutdown = shutdown.clone();
        async move { shutdown.wait().await }
    }));
    let operator = tokio::spawn(kinference_operator::run(client, config, shutdown));
    tokio::pin!(operator);

    // Graceful shutdown on SIGTERM (kubelet) or Ctrl-C: stop taking work,
    // let in-flight reconciles finish, release the Lease.
    let result = tokio::select! {
        _ = shutdown_signal() => {
            tracing::info!("shutting down");
            trigger.trigger();
            operator.await
        }
        result = &mut operator => {
            trigger.trigger();
            result
        }
    };
    match http.await {
        Ok(Err(e)) => tracing::error!(error = %e, "HTTP server failed"),
        Err(e) => tracing::error!(error = %e, "HTTP server task failed"),
        Ok(Ok(())) => {}
    }
    match result {
        Ok(Ok(())) => Ok(()),
        // Including RunError::LeadershipLost: exit non-zero so the Pod
        // restarts as a clean standby.
        Ok(Err(e)) => Err(e.into()),
        Err(e) => Err(anyhow::anyhow!("operator task failed: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};
    use kinference_runtime::LogFormat;

    use super::Args;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("kinference-operator").chain(args.iter().copied()))
    }

    #[test]
    fn command_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn log_format_is_json_by_default_and_text_on_request() {
        // Assumes KINFERENCE_LOG_FORMAT is unset, as in CI.
        assert_eq!(parse(&[]).unwrap().logs.log_format, LogFormat::Json);
        assert_eq!(
            parse(&["--log-format", "text"]).unwrap().logs.log_format,
            LogFormat::Text
        );
        assert_eq!(
            parse(&["--log-format=json"]).unwrap().logs.log_format,
            LogFormat::Json
        );
        assert!(parse(&["--log-format", "yaml"]).is_err());
    }
}
