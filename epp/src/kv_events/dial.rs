//! Dial mode: the engines bind their publishers (vLLM `endpoint:
//! tcp://*:PORT`) and the EPP connects to each Pod of the pool, one
//! connection per data-parallel rank (rank `r` binds the port + `r`). Every
//! EPP replica then receives every Pod's events, where engines connecting
//! through the EPP Service would each reach one replica.
//!
//! A connection lives and dies with its Pod: opened when the Pod joins the
//! registry, retried with backoff while the engine is not up yet or
//! restarts, and closed when the Pod leaves.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinSet};

use super::subscriber::{EventStats, forward};
use super::zmtp::Limits;
use crate::endpoints::EndpointRegistry;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const FIRST_RETRY: Duration = Duration::from_millis(100);
const LAST_RETRY: Duration = Duration::from_secs(5);
/// A connection that lasted this long was a working one: retry at once.
const HEALTHY: Duration = Duration::from_secs(10);

/// Keeps one subscription open to every Pod's publisher(s) while the
/// registry lists the Pod; returns when the indexer is gone.
pub(super) async fn dial(
    registry: Arc<EndpointRegistry>,
    port: u16,
    ranks: u16,
    tx: mpsc::Sender<Vec<Vec<u8>>>,
    stats: Arc<EventStats>,
    limits: Limits,
) {
    let mut changed = registry.changed();
    let mut tasks = JoinSet::new();
    let mut open: HashMap<SocketAddr, AbortHandle> = HashMap::new();
    loop {
        let want = publishers(&registry, port, ranks);
        open.retain(|addr, task| {
            let keep = want.contains(addr);
            if !keep {
                task.abort();
            }
            keep
        });
        for addr in want {
            open.entry(addr).or_insert_with(|| {
                let (tx, stats) = (tx.clone(), Arc::clone(&stats));
                tasks.spawn(subscribe(addr, tx, stats, limits))
            });
        }
        // Aborted tasks' results, so churn does not pile them up.
        while tasks.try_join_next().is_some() {}
        tokio::select! {
            changed = changed.changed() => if changed.is_err() { return },
            () = tx.closed() => return,
        }
    }
}

/// Every publisher address of the pool: each Pod IP, once, on each rank's
/// port.
fn publishers(registry: &EndpointRegistry, port: u16, ranks: u16) -> BTreeSet<SocketAddr> {
    let ips: BTreeSet<_> = registry.endpoints().iter().map(|e| e.ip).collect();
    ips.into_iter()
        .flat_map(|ip| {
            (0..ranks)
                .filter_map(move |r| port.checked_add(r))
                .map(move |p| SocketAddr::new(ip, p))
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
                if let Err(e) = forward(stream, limits, tx.clone(), &stats).await {
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
        retry = if started.elapsed() >= HEALTHY {
            FIRST_RETRY
        } else {
            (retry * 2).min(LAST_RETRY)
        };
        tokio::time::sleep(retry).await;
    }
}
