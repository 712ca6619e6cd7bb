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
use tracing_subscriber::EnvFilter;

/// Reconciles InferencePolicies into InferencePools, HTTPRoutes and EPPs.
#[derive(Debug, Parser)]
#[command(name = "kinference-operator", version)]
struct Args {
    /// Image of the endpoint picker Deployments.
    #[arg(long, env = "KINFERENCE_EPP_IMAGE", default_value = DEFAULT_EPP_IMAGE)]
    epp_image: String,
    /// Replicas of each EPP Deployment.
    #[arg(long, env = "KINFERENCE_EPP_REPLICAS", default_value_t = 1)]
    epp_replicas: i32,
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
    /// Log format: json or text.
    #[arg(long, env = "KINFERENCE_LOG_FORMAT", default_value = "json")]
    log_format: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    init_tracing(&args.log_format);
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
    let http = tokio::spawn(metrics::serve(
        args.metrics_addr,
        metrics,
        health,
        shutdown.clone(),
    ));
    let operator = tokio::spawn(kinference_operator::run(client, config, shutdown));
    tokio::pin!(operator);

    // Graceful shutdown on SIGTERM (kubelet) or Ctrl-C: stop taking work,
    // let in-flight reconciles finish, release the Lease.
    let result = tokio::select! {
        () = termination() => {
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

async fn termination() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGTERM; Ctrl-C only");
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

fn init_tracing(format: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    if format == "text" {
        builder.init();
    } else {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .init();
    }
}
