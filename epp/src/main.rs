//! `kinference-epp`: the endpoint picker process.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use kinference_epp::cli::Args;
use kinference_epp::endpoints::load_endpoints_file;
use kinference_epp::extproc::ExtProcConfig;
use kinference_epp::k8s;
use kinference_epp::provider_keys;
use kinference_epp::server::{Epp, Settings, bind};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    init_logs(args.text_logs);
    // Compile the classifiers' patterns now, not on the first request.
    kinference_classifiers::warm_up();
    let epp = Epp::new(Settings {
        ext_proc: ExtProcConfig {
            max_body_bytes: args.max_body_bytes,
            conformance_hooks: args.enable_conformance_hooks,
            fallbacks: args.fallback_endpoints,
        },
        scrape_interval: Duration::from_millis(args.scrape_interval_ms),
        secure_serving: args.secure_serving,
        ..Settings::default()
    });
    let mut background = Vec::new();
    if let Some(path) = &args.policy_file {
        background.push(epp.watch_policy_file(path.clone(), Duration::from_secs(1)));
    }
    if let Some(dir) = &args.provider_secrets_dir {
        background.push(provider_keys::watch_secrets_dir(
            epp.clone(),
            dir.clone(),
            Duration::from_secs(2),
        ));
    }
    if let Some(path) = &args.endpoints_file {
        let endpoints =
            load_endpoints_file(path).with_context(|| format!("loading {}", path.display()))?;
        epp.registry().replace_all(endpoints);
        epp.registry().mark_synced();
    }
    if args.policy_configmap.is_some() || args.endpoints_file.is_none() {
        let client = kube::Client::try_default()
            .await
            .context("connecting to the Kubernetes API")?;
        if let Some(name) = args.policy_configmap.clone() {
            background.push(tokio::spawn(k8s::watch_policy_configmap(
                epp.clone(),
                client.clone(),
                args.namespace.clone(),
                name,
            )));
        }
        if args.endpoints_file.is_none() {
            background.push(tokio::spawn(k8s::run_discovery(
                epp.clone(),
                client.clone(),
                args.namespace.clone(),
            )));
        }
        if args.provider_secrets_dir.is_none() {
            background.push(tokio::spawn(k8s::watch_provider_secrets(
                epp.clone(),
                client.clone(),
                args.namespace.clone(),
            )));
        }
        if let Some(pod) = args.pod_name.clone() {
            background.push(tokio::spawn(k8s::report_loaded_hash(
                epp.clone(),
                client,
                args.namespace.clone(),
                pod,
            )));
        }
    }
    background.push(epp.spawn_scraper());

    let at = |port| SocketAddr::new(args.bind_address, port);
    let (grpc, health, http) = (
        bind(at(args.grpc_port)).await?,
        bind(at(args.grpc_health_port)).await?,
        bind(at(args.metrics_port)).await?,
    );
    tracing::info!(
        address = %args.bind_address,
        grpc = args.grpc_port,
        health = args.grpc_health_port,
        metrics = args.metrics_port,
        "serving"
    );
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    let servers = tokio::spawn({
        let epp = epp.clone();
        let stopped = stopped.clone();
        async move {
            tokio::try_join!(
                epp.serve_ext_proc(grpc, stopped()),
                epp.serve_health(health, stopped()),
                epp.serve_http(http, stopped()),
            )
        }
    });
    shutdown_signal().await;
    tracing::info!("shutting down: finishing in-flight streams");
    let _ = stop_tx.send(true);
    let result = tokio::time::timeout(Duration::from_secs(25), servers).await;
    for task in background {
        task.abort();
    }
    match result {
        Ok(Ok(Ok(_))) => Ok(()),
        Ok(Ok(Err(e))) => Err(e),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => {
            tracing::warn!("in-flight streams did not finish in time");
            Ok(())
        }
    }
}

fn init_logs(text: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    if text {
        builder.init();
    } else {
        builder.json().init();
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
