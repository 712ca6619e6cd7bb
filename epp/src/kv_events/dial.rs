//! Dial mode: the engines bind their publishers (vLLM `endpoint:
//! tcp://*:PORT`) and the EPP connects to each Pod of the pool, one
//! connection per data-parallel rank (rank `r` binds the port + `r`). Every
//! EPP replica then receives every Pod's events, where engines connecting
//! through the EPP Service would each reach one replica.
//!
//! A subscription lives and dies with its Pod (its address and UID): opened
//! when the Pod joins the registry, retried with backoff while the engine
//! is not up yet or restarts, and closed when the Pod leaves or another Pod
//! takes its IP. TCP keepalives end a connection whose peer vanished
//! without a word (a lost node), so it is retried rather than kept.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use rand::Rng as _;
use socket2::{SockRef, TcpKeepalive};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinSet};

use super::stats::{EventStats, forward};
use super::zmtp::Limits;
use crate::endpoints::EndpointRegistry;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const FIRST_RETRY: Duration = Duration::from_millis(100);
const LAST_RETRY: Duration = Duration::from_secs(5);
/// A connection that lasted this long was a working one: retry soon.
const HEALTHY: Duration = Duration::from_secs(10);
/// How often the set of subscriptions is checked without a registry
/// change (a subscription task that ended is started again).
const RESYNC: Duration = Duration::from_secs(30);
/// A silent peer is probed after this long, then every interval
/// (Linux gives up after 9 probes: about a minute in all).
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);

/// One publisher: a rank's port on a Pod, and the Pod's UID (a Pod that
/// takes over a deleted one's IP is another publisher).
type Publisher = (SocketAddr, Option<String>);

/// Keeps one subscription open to every Pod's publisher(s) while the
/// registry lists the Pod; returns when the indexer is gone.
pub(super) async fn dial(
    registry: Arc<EndpointRegistry>,
    ports: RangeInclusive<u16>,
    tx: mpsc::Sender<Vec<Vec<u8>>>,
    stats: Arc<EventStats>,
    limits: Limits,
) {
    let mut changed = registry.changed();
    let mut tasks = JoinSet::new();
    let mut open: HashMap<Publisher, AbortHandle> = HashMap::new();
    loop {
        // Ended tasks (aborted, or a panic) leave the map, so a wanted
        // publisher whose task ended is subscribed to again below.
        while let Some(ended) = tasks.try_join_next_with_id() {
            let id = ended.map_or_else(|e| e.id(), |(id, ())| id);
            open.retain(|_, task| task.id() != id);
        }
        let want = publishers(&registry, &ports);
        open.retain(|publisher, task| {
            let keep = want.contains(publisher);
            if !keep {
                task.abort();
            }
            keep
        });
        for publisher in want {
            open.entry(publisher.clone()).or_insert_with(|| {
                let (tx, stats) = (tx.clone(), Arc::clone(&stats));
                tasks.spawn(subscribe(publisher.0, tx, stats, limits))
            });
        }
        tokio::select! {
            changed = changed.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(RESYNC) => {}
            () = tx.closed() => return,
        }
    }
}

/// Every publisher of the pool: each Pod once, on each rank's port.
fn publishers(registry: &EndpointRegistry, ports: &RangeInclusive<u16>) -> BTreeSet<Publisher> {
    let pods: BTreeSet<_> = registry
        .endpoints()
        .iter()
        .map(|e| (e.ip, e.uid.clone()))
        .collect();
    pods.into_iter()
        .flat_map(|(ip, uid)| {
            ports
                .clone()
                .map(move |p| (SocketAddr::new(ip, p), uid.clone()))
        })
        .collect()
}

/// One Pod's publisher, subscribed to for as long as the task runs.
async fn subscribe(
    addr: SocketAddr,
    tx: mpsc::Sender<Vec<Vec<u8>>>,
    stats: Arc<EventStats>,
    limits: Limits,
) {
    let mut retry = FIRST_RETRY;
    loop {
        let started = tokio::time::Instant::now();
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                let keepalive = TcpKeepalive::new()
                    .with_time(KEEPALIVE_IDLE)
                    .with_interval(KEEPALIVE_INTERVAL);
                let _ = SockRef::from(&stream).set_tcp_keepalive(&keepalive);
                let open = Open::count(&stats.subscriptions);
                let ended = forward(stream, limits, tx.clone(), &stats).await;
                drop(open);
                if let Err(e) = ended {
                    stats.refused_connections.inc_by(1);
                    tracing::warn!(%addr, error = %e, "KV-events subscription ended");
                }
            }
            // The engine is not up yet, or restarting: normal for a while.
            Ok(Err(e)) => {
                stats.dial_failures.inc_by(1);
                tracing::debug!(%addr, error = %e, "KV-events publisher not reachable");
            }
            Err(_) => {
                stats.dial_failures.inc_by(1);
                tracing::debug!(%addr, "KV-events publisher: connect timed out");
            }
        }
        if tx.is_closed() {
            return;
        }
        if started.elapsed() >= HEALTHY {
            retry = FIRST_RETRY;
        }
        // Jittered, so replicas do not retry every Pod in step.
        let jitter = rand::rng().random_range(0.5..1.5);
        tokio::time::sleep(retry.mul_f64(jitter)).await;
        retry = (retry * 2).min(LAST_RETRY);
    }
}

/// One open subscription in the gauge, for as long as it lives: a task
/// aborted mid-subscription (its Pod left) takes it out too.
struct Open<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl<'a> Open<'a> {
    fn count(gauge: &'a prometheus_client::metrics::gauge::Gauge) -> Self {
        gauge.inc();
        Open(gauge)
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::{EndpointSpec, endpoints_from_specs};

    #[test]
    fn a_pod_is_one_publisher_per_rank_and_another_uid_is_another_publisher() {
        let registry = EndpointRegistry::new(Duration::from_secs(60));
        let specs = ["10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000"]
            .map(|a| EndpointSpec::new(a.to_string(), &["m"]));
        let mut endpoints = endpoints_from_specs(specs).unwrap();
        for e in &mut endpoints {
            e.uid = Some(format!("uid-{}", e.ip));
        }
        registry.replace_all(endpoints.clone());
        let got: Vec<String> = publishers(&registry, &(5557..=5558))
            .iter()
            .map(|(addr, uid)| format!("{addr} {}", uid.as_deref().unwrap()))
            .collect();
        assert_eq!(
            got,
            [
                "10.0.0.1:5557 uid-10.0.0.1",
                "10.0.0.1:5558 uid-10.0.0.1",
                "10.0.0.2:5557 uid-10.0.0.2",
                "10.0.0.2:5558 uid-10.0.0.2",
            ]
        );
        let before = publishers(&registry, &(5557..=5557));
        endpoints[2].uid = Some("a-new-pod".into());
        registry.replace_all(endpoints);
        let after = publishers(&registry, &(5557..=5557));
        assert_eq!(before.len(), after.len());
        assert_ne!(before, after, "a new Pod on the IP is a new publisher");
    }
}
