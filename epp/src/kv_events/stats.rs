//! The events port's counters, and one publisher's connection counted
//! into them, from either end (`subscriber`'s listeners, `dial`).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::mpsc;

use super::zmtp::{self, Limits};
use crate::metrics::Metrics;

/// Counters of the events port.
#[derive(Debug, Default)]
pub struct EventStats {
    pub messages: Counter,
    /// Messages that could not be decoded.
    pub malformed: Counter,
    /// Messages whose topic names no Pod of the pool (or is not
    /// `kv@<ip>@<model>`).
    pub unknown_pod: Counter,
    /// Messages dropped by the ZMTP limits (oversized, too many frames).
    pub dropped: Counter,
    /// Sequence gaps seen (the Pod's index was marked stale).
    pub gaps: Counter,
    /// Batches a gap lost, replayed from the engine.
    pub replayed: Counter,
    /// Replays that failed (no endpoint, a timeout, a protocol error).
    pub replay_failures: Counter,
    /// Blocks stored under a parent the index did not know.
    pub orphaned_blocks: Counter,
    /// `BlockStored` events whose tokens are not whole blocks.
    pub malformed_events: Counter,
    /// Connections refused or ended by a protocol error.
    pub refused_connections: Counter,
    /// Dial mode: connections to a Pod's publisher that could not be made
    /// (retried with backoff).
    pub dial_failures: Counter,
    /// Dial mode: subscriptions open (one per Pod and data-parallel rank
    /// once every engine is up).
    pub subscriptions: Gauge,
}

impl EventStats {
    /// Serves the counters as `kinference_epp_kv_events_<name>_total`.
    pub fn register(&self, metrics: &Metrics) {
        let counters = [
            (&self.messages, "messages", "KV-event messages received"),
            (
                &self.malformed,
                "malformed",
                "KV-event messages that could not be decoded",
            ),
            (
                &self.unknown_pod,
                "unknown_pod",
                "KV-event messages whose topic names no Pod of the pool",
            ),
            (
                &self.dropped,
                "dropped",
                "KV-event messages dropped at the size limits",
            ),
            (
                &self.gaps,
                "gaps",
                "KV-event sequence gaps (the Pod's index is marked stale)",
            ),
            (
                &self.replayed,
                "replayed",
                "KV-event batches lost in a sequence gap and replayed from the engine",
            ),
            (
                &self.replay_failures,
                "replay_failures",
                "KV-event replays that failed (the gap stays; the Pod is marked stale)",
            ),
            (
                &self.orphaned_blocks,
                "orphaned_blocks",
                "Blocks stored under a parent the index did not know (never matched)",
            ),
            (
                &self.malformed_events,
                "malformed_events",
                "BlockStored events whose tokens are not whole blocks",
            ),
            (
                &self.refused_connections,
                "refused_connections",
                "KV-event connections refused or ended by a protocol error",
            ),
            (
                &self.dial_failures,
                "dial_failures",
                "Connections to a Pod's KV-event publisher that could not be made (dial mode; retried)",
            ),
        ];
        for (counter, name, help) in counters {
            metrics.register_counter(&format!("kv_events_{name}"), help, counter.clone());
        }
        metrics.register_metric(
            "kv_events_subscriptions",
            "Dial mode: subscriptions to the Pods' KV-event publishers open (one per Pod and data-parallel rank)",
            self.subscriptions.clone(),
        );
    }
}

/// Sends what one publisher's connection carries to the indexer until it
/// ends, counting the messages the limits dropped.
pub(super) async fn forward(
    stream: tokio::net::TcpStream,
    limits: Limits,
    tx: mpsc::Sender<Vec<Vec<u8>>>,
    stats: &EventStats,
) -> Result<(), zmtp::ZmtpError> {
    let dropped = zmtp::serve_publisher(stream, limits, tx).await?;
    stats
        .dropped
        .inc_by(dropped.oversized + dropped.too_many_frames);
    Ok(())
}
