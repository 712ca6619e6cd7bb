//! Wiring: the ext_proc gRPC server, gRPC health, the HTTP side (metrics,
//! health, explain), policy delivery and endpoint discovery.

use std::future::Future;
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use futures::FutureExt as _;
use kinference_runtime::Readiness;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

use crate::endpoints::{EndpointRegistry, default_staleness, spawn_scraper_with_stats};
use crate::extproc::{ExtProcConfig, ExtProcService};
use crate::metrics::Metrics;
use crate::picker::{Picker, PickerConfig};
use crate::policy_store::PolicyStore;
use kinference_runtime::sync::lock;

/// gRPC health service names the reference EPP answers.
pub const HEALTH_SERVICES: &[&str] = &[
    "inference-extension",
    "liveness",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
];

#[derive(Debug, Clone)]
pub struct Settings {
    pub ext_proc: ExtProcConfig,
    pub picker: PickerConfig,
    pub scrape_interval: Duration,
    pub scrape_timeout: Duration,
    /// Serve ext_proc over TLS with a self-signed certificate (ALPN h2), as
    /// the reference EPP does by default; gateways skip verification.
    pub secure_serving: bool,
    /// With `secure_serving`: CA certificates (PEM) a client certificate
    /// must chain to. A client without a valid one is refused in the TLS
    /// handshake, so it never reaches ext_proc (nor the provider keys in its
    /// answers).
    pub client_ca_pem: Option<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            ext_proc: ExtProcConfig::default(),
            picker: PickerConfig::default(),
            scrape_interval: crate::endpoints::DEFAULT_SCRAPE_INTERVAL,
            scrape_timeout: crate::endpoints::DEFAULT_SCRAPE_TIMEOUT,
            secure_serving: false,
            client_ca_pem: None,
        }
    }
}

/// The running EPP's shared state.
#[derive(Clone)]
pub struct Epp {
    pub picker: Arc<Picker>,
    pub settings: Arc<Settings>,
    health: Arc<Health>,
    /// Readiness beyond policy and discovery: a background task supervisor
    /// marks a stopped task down here (see [`Epp::readiness`]).
    readiness: Readiness,
}

/// gRPC health statuses, shared by every server that answers
/// `grpc.health.v1.Health` (the health port and the ext_proc port): one
/// reporter, and one task making `readiness` follow [`Epp::ready`] while at
/// least one of them serves.
struct Health {
    reporter: HealthReporter,
    /// Servers using the statuses, and the readiness task while there are any.
    follower: Mutex<(usize, Option<tokio::task::JoinHandle<()>>)>,
}

impl Health {
    /// Every service name SERVING but `readiness`, NOT_SERVING until the
    /// follower sees [`Epp::ready`].
    fn new() -> Self {
        let reporter = HealthReporter::new();
        for name in HEALTH_SERVICES {
            let status = if *name == "readiness" {
                ServingStatus::NotServing
            } else {
                ServingStatus::Serving
            };
            // A reporter nobody else holds yet: its lock is free, so this
            // completes on the first poll.
            reporter
                .set_service_status(name, status)
                .now_or_never()
                .expect("a fresh health reporter is not locked");
        }
        Health {
            reporter,
            follower: Mutex::new((0, None)),
        }
    }
}

/// Keeps the readiness follower running while held (see [`Epp::health_service`]).
struct HealthUse(Arc<Health>);

impl Drop for HealthUse {
    fn drop(&mut self) {
        let mut follower = lock(&self.0.follower);
        follower.0 -= 1;
        if follower.0 == 0
            && let Some(task) = follower.1.take()
        {
            task.abort();
        }
    }
}

impl Epp {
    pub fn new(settings: Settings) -> Self {
        let registry = EndpointRegistry::new(default_staleness(settings.scrape_interval));
        let (policy, metrics) = (Arc::new(PolicyStore::default()), Metrics::default());
        metrics.register_policy_refusals(policy.refusals());
        let picker = Picker::new(policy, registry, Arc::new(metrics), settings.picker.clone());
        Epp {
            picker: Arc::new(picker),
            settings: Arc::new(settings),
            health: Arc::new(Health::new()),
            readiness: Readiness::default(),
        }
    }

    pub fn policy(&self) -> &Arc<PolicyStore> {
        &self.picker.policy
    }

    pub fn registry(&self) -> &Arc<EndpointRegistry> {
        &self.picker.registry
    }

    /// Ready: a policy is loaded, discovery has synced once and nothing is
    /// marked down in [`Epp::readiness`].
    pub fn ready(&self) -> bool {
        self.policy().current().is_some() && self.registry().synced() && self.readiness.is_ready()
    }

    /// What else keeps the EPP from being ready (gRPC `readiness` and
    /// `/readyz` follow it): hand it to a
    /// [`kinference_runtime::Supervisor`] so a stopped background task
    /// turns readiness off until it runs again.
    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// The first step of a graceful stop (SIGTERM): not Ready at once (gRPC
    /// `readiness`, `/readyz`), while new streams are still served for
    /// `delay`, the time gateways and the Service's endpoints take to move
    /// to the other replicas. Then stop the servers: open streams finish,
    /// new ones go elsewhere.
    pub async fn leave(&self, delay: Duration) {
        self.readiness.set_down("shutdown", "shutting down");
        tokio::time::sleep(delay).await;
    }

    /// Scrapes every endpoint's metrics until the handle is aborted.
    pub fn spawn_scraper(&self) -> tokio::task::JoinHandle<()> {
        // Attempts and failures by reason reach /metrics.
        spawn_scraper_with_stats(
            self.registry().clone(),
            self.settings.scrape_interval,
            self.settings.scrape_timeout,
            self.picker.metrics.scrape_stats(),
        )
    }

    /// Serves ext_proc on `listener` until `shutdown` resolves. In-flight
    /// streams finish; new ones are refused. gRPC health is served here too
    /// (gateways such as llm-d's Envoy health-check the ext_proc port), with
    /// the same statuses as [`Epp::serve_health`].
    pub async fn serve_ext_proc(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> anyhow::Result<()> {
        let service = ExtProcService::new(
            self.picker.clone(),
            self.picker.metrics.clone(),
            self.settings.ext_proc.clone(),
        );
        let mut builder = tonic::transport::Server::builder();
        if self.settings.secure_serving {
            builder = builder.tls_config(server_tls(self.settings.client_ca_pem.as_deref())?)?;
        } else if self.settings.client_ca_pem.is_some() {
            anyhow::bail!("a client CA needs TLS on the ext_proc port (secure_serving)");
        }
        let (health, _using) = self.health_service();
        builder
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .add_service(service.into_server())
            .add_service(health)
            .serve_with_incoming_shutdown(no_delay(listener), shutdown)
            .await?;
        Ok(())
    }

    /// gRPC health (`grpc.health.v1`) for the reference EPP's service names;
    /// `readiness` follows [`Epp::ready`].
    pub async fn serve_health(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> anyhow::Result<()> {
        let (health, _using) = self.health_service();
        tonic::transport::Server::builder()
            .add_service(health)
            .serve_with_incoming_shutdown(no_delay(listener), shutdown)
            .await?;
        Ok(())
    }

    /// A `grpc.health.v1.Health` service over the EPP's one set of statuses,
    /// and a guard keeping `readiness` up to date while it is held.
    fn health_service(&self) -> (HealthServer<HealthService>, HealthUse) {
        let health = &self.health;
        let mut follower = lock(&health.follower);
        follower.0 += 1;
        if follower.1.is_none() {
            let (epp, reporter) = (self.clone(), health.reporter.clone());
            follower.1 = Some(tokio::spawn(async move {
                let mut last = None;
                loop {
                    let ready = epp.ready();
                    if last != Some(ready) {
                        let status = if ready {
                            ServingStatus::Serving
                        } else {
                            ServingStatus::NotServing
                        };
                        reporter.set_service_status("readiness", status).await;
                        last = Some(ready);
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }));
        }
        let service = HealthService::from_health_reporter(health.reporter.clone());
        (HealthServer::new(service), HealthUse(health.clone()))
    }

    /// `/debug/explain` and `/debug/policy` on `listener` (the binary binds it
    /// to loopback); with none, waits for `shutdown`.
    pub async fn serve_debug(
        &self,
        listener: Option<TcpListener>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let Some(listener) = listener else {
            shutdown.await;
            return Ok(());
        };
        let app = axum::Router::new()
            .route("/debug/explain", get(explain))
            .route("/debug/policy", get(policy))
            .with_state(self.clone());
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await?;
        Ok(())
    }

    /// The KV-events port (precise prefix mode): engines publish here and
    /// each Pod's index follows what it holds. With no listener, waits for
    /// `shutdown`.
    pub async fn serve_kv_events(
        &self,
        source: Option<crate::kv_events::subscriber::Source>,
        replay: Option<crate::kv_events::subscriber::Replay>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let Some(source) = source else {
            shutdown.await;
            return Ok(());
        };
        let stats = Arc::new(crate::kv_events::subscriber::EventStats::default());
        stats.register(&self.picker.metrics);
        let registry = Arc::clone(self.registry());
        let limits = crate::kv_events::zmtp::Limits::default();
        tokio::select! {
            result = crate::kv_events::subscriber::serve(source, registry, stats, limits, replay) => result?,
            () = shutdown => {}
        }
        Ok(())
    }

    /// `/metrics`, `/healthz`, `/readyz`.
    pub async fn serve_http(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let app = axum::Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(|| async { "ok" }))
            .route("/readyz", get(readyz))
            .with_state(self.clone());
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await?;
        Ok(())
    }
}

/// Accepted connections with Nagle off: replies are small and must not wait
/// for a delayed ACK (tonic ignores its own nodelay setting for listeners it
/// is handed).
fn no_delay(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// TLS for the ext_proc port: a fresh self-signed certificate, and with
/// `client_ca_pem` a client certificate required and verified against it.
/// Gateways talk to the EPP inside the cluster and do not verify the EPP's
/// certificate (as with the reference EPP): the server side gives an
/// encrypted channel, the client CA gives the EPP its gateway's identity.
fn server_tls(client_ca_pem: Option<&str>) -> anyhow::Result<tonic::transport::ServerTlsConfig> {
    let names = vec!["kinference-epp".to_string(), "localhost".to_string()];
    let cert = rcgen::generate_simple_self_signed(names)?;
    let identity =
        tonic::transport::Identity::from_pem(cert.cert.pem(), cert.signing_key.serialize_pem());
    let mut tls = tonic::transport::ServerTlsConfig::new().identity(identity);
    if let Some(pem) = client_ca_pem {
        // rustls would accept a file without a certificate and then refuse
        // every client: say what is wrong at start instead.
        anyhow::ensure!(
            pem.contains("-----BEGIN CERTIFICATE-----"),
            "the client CA holds no PEM certificate"
        );
        // Required, not optional: tonic verifies the chain and refuses a
        // client that presents no certificate.
        tls = tls.client_ca_root(tonic::transport::Certificate::from_pem(pem));
    }
    Ok(tls)
}

/// Binds a loopback or wildcard address, for callers that need the port first.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))
}

/// The events ports of precise mode: `first` for data-parallel rank 0 and
/// `first + r` for rank r (at least one rank), where vLLM's rank r
/// publishes. A range past the last port is a setting's error, found at
/// start in either mode.
pub fn events_ports(first: u16, ranks: u16) -> anyhow::Result<RangeInclusive<u16>> {
    let last = first
        .checked_add(ranks.saturating_sub(1))
        .with_context(|| {
            format!("events port {first} + {ranks} data-parallel ranks is past port 65535")
        })?;
    Ok(first..=last)
}

/// A listener on each of `ports` (see [`events_ports`]).
pub async fn bind_events_ports(
    ip: std::net::IpAddr,
    ports: RangeInclusive<u16>,
) -> anyhow::Result<Vec<TcpListener>> {
    let mut listeners = Vec::with_capacity(ports.len());
    for port in ports {
        listeners.push(bind(SocketAddr::new(ip, port)).await?);
    }
    Ok(listeners)
}

async fn metrics(State(epp): State<Epp>) -> impl IntoResponse {
    let hash = epp.policy().loaded_hash();
    epp.picker.metrics.set_ready(epp.ready());
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        epp.picker.metrics.render(epp.registry(), hash.as_deref()),
    )
}

async fn readyz(State(epp): State<Epp>) -> impl IntoResponse {
    if epp.ready() {
        (StatusCode::OK, "ready".to_string())
    } else {
        let waiting = match (epp.policy().current().is_some(), epp.registry().synced()) {
            (false, _) => Some("no policy loaded".to_string()),
            (true, false) => Some("endpoint discovery has not synced".to_string()),
            _ => None,
        };
        // And any background task down (see `Epp::readiness`).
        let why: Vec<String> = waiting
            .into_iter()
            .chain(epp.readiness.not_ready_reason())
            .collect();
        (StatusCode::SERVICE_UNAVAILABLE, why.join("; "))
    }
}

#[derive(serde::Deserialize)]
struct ExplainQuery {
    #[serde(default = "default_limit")]
    limit: usize,
}

fn default_limit() -> usize {
    10
}

async fn explain(State(epp): State<Epp>, Query(q): Query<ExplainQuery>) -> impl IntoResponse {
    axum::Json(epp.picker.recent.explain(q.limit.min(64)))
}

async fn policy(State(epp): State<Epp>) -> impl IntoResponse {
    let state = epp.policy().state();
    axum::Json(serde_json::json!({
        "loadedHash": epp.policy().loaded_hash(),
        "state": format!("{state:?}"),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn events_ports_stay_below_65536() {
        let err = events_ports(65535, 2).unwrap_err();
        assert!(err.to_string().contains("past port 65535"), "{err}");
        assert_eq!(events_ports(65534, 2).unwrap(), 65534..=65535);
    }
}
