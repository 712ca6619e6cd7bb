//! `kinference-epp`: the endpoint picker process.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use kinference_epp::cli::{Args, KvEventsTokenizer};
use kinference_epp::endpoints::load_endpoints_file;
use kinference_epp::extproc::ExtProcConfig;
use kinference_epp::k8s;
use kinference_epp::kv_events::subscriber::{Replay, Source};
use kinference_epp::kv_events::tokenize::PromptTokenizer;
use kinference_epp::picker::{DecisionLog, LogTarget, PickerConfig};
use kinference_epp::policy_store::DEFAULT_POLICY;
use kinference_epp::server::{Epp, Settings, bind, bind_events_ports, events_ports};
use kinference_epp::{objectives, policy_file, provider_keys};
use kinference_runtime::{AbortOnDrop, Supervisor, logs, shutdown_signal};
use kinference_tokenizer::Tokenizer;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    logs::init(args.log_format());
    if args.text_logs {
        tracing::warn!("--text-logs is deprecated: use --log-format=text");
    }
    // Compile the classifiers' patterns now, not on the first request.
    kinference_classifiers::warm_up();
    let epp = Epp::new(settings(&args)?);
    // Every background task runs supervised: one that stops (returns or
    // panics) turns readiness off (gRPC `readiness`, /readyz), is logged and
    // is started again with backoff. Dropping `tasks` stops them all.
    let mut tasks = Supervisor::new(epp.readiness().clone());
    start_local_sources(&args, &epp, &mut tasks)?;
    load_built_in_policy(&args, &epp)?;
    if args.policy_configmap.is_some() || args.endpoints_file.is_none() {
        let client = kube::Client::try_default()
            .await
            .context("connecting to the Kubernetes API")?;
        start_kubernetes_watches(&args, &epp, &client, &mut tasks);
    }
    {
        let epp = epp.clone();
        tasks.spawn("scraper", move || AbortOnDrop::new(epp.spawn_scraper()));
    }
    let listeners = Listeners::bind(&args).await?;
    enable_precise_prefix(&args, &epp)?;
    tracing::info!(
        address = %args.bind_address,
        kv_events = ?args.kv_events_port,
        kv_events_ranks = args.kv_events_data_parallel_size,
        kv_events_dial = args.kv_events_dial,
        kv_events_replay = ?args.kv_events_replay_port,
        grpc = args.grpc_port,
        health = args.grpc_health_port,
        metrics = args.metrics_port,
        tasks = ?tasks.names().collect::<Vec<_>>(),
        "serving"
    );
    let result = serve_until_stopped(&args, &epp, listeners).await;
    tasks.shutdown();
    result
}

/// The EPP's settings from its flags.
fn settings(args: &Args) -> anyhow::Result<Settings> {
    Ok(Settings {
        ext_proc: ExtProcConfig {
            max_body_bytes: args.max_body_bytes,
            conformance_hooks: args.enable_conformance_hooks,
            fallbacks: args.fallback_endpoints,
            idle_timeout: args.stream_idle_timeout,
            body_budget_bytes: args.max_buffered_body_bytes,
        },
        picker: PickerConfig {
            decision_detail: args.decision_detail,
            ..PickerConfig::default()
        },
        scrape_interval: Duration::from_millis(args.scrape_interval_ms),
        secure_serving: args.secure_serving,
        client_ca_pem: client_ca_pem(args)?,
        ..Settings::default()
    })
}

/// What the EPP reads from its own files: the policy file and provider
/// keys (watched), the decision log, a static endpoints file.
fn start_local_sources(args: &Args, epp: &Epp, tasks: &mut Supervisor) -> anyhow::Result<()> {
    if let Some(path) = args.policy_file.clone() {
        let epp = epp.clone();
        tasks.spawn("policy-file", move || {
            AbortOnDrop::new(policy_file::watch(epp.policy().clone(), path.clone()))
        });
    }
    if let Some(dir) = args.provider_secrets_dir.clone() {
        let epp = epp.clone();
        tasks.spawn("provider-secrets-dir", move || {
            AbortOnDrop::new(provider_keys::watch_secrets_dir(
                epp.clone(),
                dir.clone(),
                Duration::from_secs(2),
            ))
        });
    }
    if let Some(target) = &args.decision_log {
        let target = LogTarget::parse(target);
        let dropped = epp.picker.metrics().decision_log_dropped();
        let log = DecisionLog::start(
            &target,
            args.decision_log_sample,
            dropped,
            args.decision_log_max_bytes,
        )
        .with_context(|| format!("opening the decision log {target:?}"))?;
        let _ = epp.picker.decision_log().set(log);
        tracing::info!(target = ?target, sample = args.decision_log_sample, "writing a decision log");
    }
    if let Some(path) = &args.endpoints_file {
        let endpoints =
            load_endpoints_file(path).with_context(|| format!("loading {}", path.display()))?;
        epp.registry().replace_all(endpoints);
        epp.registry().mark_synced();
    }
    if let Some(name) = args.metrics_pool_name.as_ref().or(args.pool_name.as_ref()) {
        epp.picker.metrics().pool.set_pool_name(name);
    }
    Ok(())
}

/// Serving an InferencePool with no policy given: the built-in default.
fn load_built_in_policy(args: &Args, epp: &Epp) -> anyhow::Result<()> {
    let given = args.policy_file.is_some() || args.policy_configmap.is_some();
    if args.inference_pool().is_some() && !given {
        epp.policy()
            .load_text(DEFAULT_POLICY)
            .map_err(|e| anyhow::anyhow!("the built-in default policy: {e}"))?;
        tracing::info!("serving the built-in default policy");
    }
    Ok(())
}

/// What the EPP follows in the API server: its policy ConfigMap, the pool's
/// Pods (through the InferencePool, or the policy's selector), the pool's
/// InferenceObjectives, provider Secrets, and its status report.
fn start_kubernetes_watches(args: &Args, epp: &Epp, client: &kube::Client, tasks: &mut Supervisor) {
    let ns = &args.namespace;
    if let Some(name) = args.policy_configmap.clone() {
        let (epp, client, ns) = (epp.clone(), client.clone(), ns.clone());
        tasks.spawn("policy-configmap", move || {
            k8s::watch_policy_configmap(epp.clone(), client.clone(), ns.clone(), name.clone())
        });
    }
    if let Some((pool_ns, pool)) = args.inference_pool() {
        let (epp, client) = (epp.clone(), client.clone());
        tasks.spawn("discovery", move || {
            k8s::run_inference_pool_discovery(
                epp.clone(),
                client.clone(),
                pool_ns.clone(),
                pool.clone(),
            )
        });
    } else if args.endpoints_file.is_none() {
        let (epp, client, ns) = (epp.clone(), client.clone(), ns.clone());
        tasks.spawn("discovery", move || {
            k8s::run_discovery(epp.clone(), client.clone(), ns.clone())
        });
    }
    if let Some(pool) = args.metrics_pool_name.clone().or(args.pool_name.clone()) {
        let objectives = epp.picker.objectives().clone();
        let pool_ns = args.pool_namespace.clone().unwrap_or(ns.clone());
        let client = client.clone();
        tasks.spawn("objectives", move || {
            objectives::watch_objectives(
                objectives.clone(),
                client.clone(),
                pool_ns.clone(),
                pool.clone(),
            )
        });
    }
    if args.provider_secrets_dir.is_none() {
        let (epp, client, ns) = (epp.clone(), client.clone(), ns.clone());
        tasks.spawn("provider-secrets", move || {
            k8s::watch_provider_secrets(epp.clone(), client.clone(), ns.clone())
        });
    }
    match (args.status_configmap.clone(), args.pod_name.clone()) {
        (Some(configmap), Some(pod)) => {
            let (epp, client, ns) = (epp.clone(), client.clone(), ns.clone());
            let target = k8s::StatusReport {
                configmap,
                pod,
                secrets_dir: args.provider_secrets_dir.clone(),
            };
            tasks.spawn("status-report", move || {
                k8s::report_status(epp.clone(), client.clone(), ns.clone(), target.clone())
            });
        }
        (Some(_), None) => tracing::warn!(
            "--status-configmap needs --pod-name (or POD_NAME): the loaded policy is not reported"
        ),
        (None, _) => {}
    }
}

/// Every socket the EPP serves on, bound before it says it is serving.
struct Listeners {
    grpc: tokio::net::TcpListener,
    health: tokio::net::TcpListener,
    http: tokio::net::TcpListener,
    debug: Option<tokio::net::TcpListener>,
    kv_events: Option<Source>,
}

impl Listeners {
    async fn bind(args: &Args) -> anyhow::Result<Listeners> {
        let at = |port| SocketAddr::new(args.bind_address, port);
        let (grpc, health, http) = (
            bind(at(args.grpc_port)).await?,
            bind(at(args.grpc_health_port)).await?,
            bind(at(args.metrics_port)).await?,
        );
        // Loopback only, whatever --bind-address says: see `--debug-port`.
        let debug = match args.debug_port {
            Some(port) => Some(bind(SocketAddr::from(([127, 0, 0, 1], port))).await?),
            None => None,
        };
        let kv_events = match args.kv_events_port {
            Some(port) => {
                let ports = events_ports(port, args.kv_events_data_parallel_size)?;
                Some(if args.kv_events_dial {
                    Source::Dial(ports)
                } else {
                    Source::Listen(bind_events_ports(args.bind_address, ports).await?)
                })
            }
            None => None,
        };
        Ok(Listeners {
            grpc,
            health,
            http,
            debug,
            kv_events,
        })
    }
}

/// Precise prefix mode, when a tokenizer is given.
fn enable_precise_prefix(args: &Args, epp: &Epp) -> anyhow::Result<()> {
    let Some(choice) = &args.kv_events_tokenizer else {
        return Ok(());
    };
    let tokenizer = match choice {
        KvEventsTokenizer::SimulatorDummy => Tokenizer::simulator_dummy(),
        KvEventsTokenizer::Directory(dir) => Tokenizer::hugging_face(dir)
            .map_err(|e| anyhow::anyhow!("--kv-events-tokenizer: {e}"))?,
    };
    let budget = args.kv_events_tokenize_budget;
    epp.picker
        .enable_precise_prefix(PromptTokenizer::new(tokenizer, budget));
    Ok(())
}

/// Serves until SIGTERM / Ctrl-C, or until a server fails (then exits
/// non-zero rather than run on without it). On a signal: not Ready while
/// still serving for `--shutdown-delay`, then the open streams finish,
/// within `--drain-timeout`.
async fn serve_until_stopped(args: &Args, epp: &Epp, listeners: Listeners) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    let replay = args.kv_events_replay_port.map(Replay::on_port);
    let mut servers = tokio::spawn({
        let epp = epp.clone();
        let stopped = stopped.clone();
        let Listeners {
            grpc,
            health,
            http,
            debug,
            kv_events,
        } = listeners;
        async move {
            tokio::try_join!(
                epp.serve_ext_proc(grpc, stopped()),
                epp.serve_health(health, stopped()),
                epp.serve_http(http, stopped()),
                epp.serve_debug(debug, stopped()),
                epp.serve_kv_events(kv_events, replay, stopped()),
            )
        }
    });
    let failed = tokio::select! {
        _ = shutdown_signal() => None,
        result = &mut servers => Some(result),
    };
    let failed = match failed {
        Some(result) => Some(result),
        None => {
            tracing::info!(delay = ?args.shutdown_delay, "shutting down: not ready, still serving");
            tokio::select! {
                () = epp.leave(args.shutdown_delay) => None,
                result = &mut servers => Some(result),
            }
        }
    };
    let _ = stop_tx.send(true);
    let (early, result) = match failed {
        Some(result) => (true, Ok(result)),
        None => {
            tracing::info!(timeout = ?args.drain_timeout, "shutting down: finishing in-flight streams");
            (
                false,
                tokio::time::timeout(args.drain_timeout, servers).await,
            )
        }
    };
    match result {
        Ok(Ok(Ok(_))) if early => Err(anyhow::anyhow!("the servers stopped unasked")),
        Ok(Ok(Ok(_))) => Ok(()),
        Ok(Ok(Err(e))) => Err(e),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => {
            tracing::warn!("in-flight streams did not finish in time");
            Ok(())
        }
    }
}

/// The `--client-ca-file` PEM, read once at start so a bad path fails here
/// and not at the first connection.
fn client_ca_pem(args: &Args) -> anyhow::Result<Option<String>> {
    let Some(path) = &args.client_ca_file else {
        return Ok(None);
    };
    anyhow::ensure!(
        args.secure_serving,
        "--client-ca-file needs TLS on the ext_proc port: drop --secure-serving=false"
    );
    let pem = std::fs::read_to_string(path)
        .with_context(|| format!("reading --client-ca-file {}", path.display()))?;
    Ok(Some(pem))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use kinference_epp::endpoints::{EndpointSpec, endpoints_from_specs};
    use kinference_epp::server::{Epp, Settings, bind};
    use kinference_runtime::{RestartPolicy, Supervisor};
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    const POLICY: &str = "pool: { selector: { app: x }, targetPorts: [{ number: 8000 }] }\nrules:\n  - name: only\n    route: { select: [{ minimize: QueueDepth }] }\n";

    /// Polls `probe` until it returns `want` (the gRPC readiness follows
    /// every 200 ms).
    async fn eventually<F, Fut, T>(what: &str, want: T, probe: F)
    where
        F: Fn() -> Fut,
        Fut: Future<Output = T>,
        T: PartialEq + std::fmt::Debug,
    {
        let mut last = None;
        for _ in 0..100 {
            let got = probe().await;
            if got == want {
                return;
            }
            last = Some(got);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{what}: wanted {want:?}, last {last:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stopped_background_task_turns_readiness_off_until_restarted() {
        let epp = Epp::new(Settings::default());
        epp.policy().load_text(POLICY).unwrap();
        epp.registry()
            .replace_all(endpoints_from_specs([EndpointSpec::new("127.0.0.1:9", &["m"])]).unwrap());
        epp.registry().mark_synced();
        let (http, health) = (
            bind("127.0.0.1:0".parse().unwrap()).await.unwrap(),
            bind("127.0.0.1:0".parse().unwrap()).await.unwrap(),
        );
        let (http_addr, health_addr) = (http.local_addr().unwrap(), health.local_addr().unwrap());
        tokio::spawn({
            let epp = epp.clone();
            async move { epp.serve_http(http, std::future::pending()).await }
        });
        tokio::spawn({
            let epp = epp.clone();
            async move { epp.serve_health(health, std::future::pending()).await }
        });
        let readyz = || async move {
            let r = reqwest::get(format!("http://{http_addr}/readyz"))
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        };
        let grpc_readiness = || async move {
            let Ok(channel) =
                tonic::transport::Channel::from_shared(format!("http://{health_addr}"))
                    .unwrap()
                    .connect()
                    .await
            else {
                return -1;
            };
            HealthClient::new(channel)
                .check(HealthCheckRequest {
                    service: "readiness".into(),
                })
                .await
                .map(|r| r.into_inner().status)
                .unwrap_or(-1)
        };

        let stop = Arc::new(tokio::sync::Notify::new());
        let mut tasks = Supervisor::new(epp.readiness().clone()).with_policy(RestartPolicy {
            min_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(1),
            reset_after: Duration::from_secs(60),
            ready_after: Duration::from_millis(500),
        });
        tasks.spawn("discovery", {
            let stop = stop.clone();
            move || {
                let stop = stop.clone();
                async move { stop.notified().await }
            }
        });
        assert!(epp.ready());
        assert_eq!(readyz().await.0, 200);
        eventually("gRPC readiness SERVING", 1, grpc_readiness).await;

        stop.notify_one();
        eventually("ready() off", false, || async { epp.ready() }).await;
        let (status, why) = readyz().await;
        assert_eq!(status, 503);
        assert!(why.contains("discovery") && why.contains("exited"), "{why}");
        eventually("gRPC readiness NOT_SERVING", 2, grpc_readiness).await;

        // Restarted after 0.5-1 s, running again 0.5 s later.
        eventually("ready() back", true, || async { epp.ready() }).await;
        assert_eq!(readyz().await, (200, "ready".to_string()));
        eventually("gRPC readiness SERVING again", 1, grpc_readiness).await;
        tasks.shutdown();
    }
}
