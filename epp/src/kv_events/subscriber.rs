//! The events port: engines connect and publish; each message is decoded
//! and applied to the index of the Pod its topic names
//! (`kv@<pod-ip>@<model>`, the topic vLLM's docs and llm-d use).
//!
//! Connections feed one bounded channel read by one task, so the indexes
//! see each engine's batches in order and a flood is held back at the
//! sockets, not in memory.

use std::net::IpAddr;
use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;

use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc};

use super::wire::{self, Message};
use super::zmtp::{self, Limits};
use crate::endpoints::EndpointRegistry;
use crate::metrics::Metrics;

/// Publishers connected at once, at most.
const MAX_CONNECTIONS: usize = 1024;
/// Messages decoded ahead of the index.
const QUEUE: usize = 256;

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
    /// Blocks stored under a parent the index did not know.
    pub orphaned_blocks: Counter,
    /// `BlockStored` events whose tokens are not whole blocks.
    pub malformed_events: Counter,
    /// Connections refused or ended by a protocol error.
    pub refused_connections: Counter,
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
        ];
        for (counter, name, help) in counters {
            metrics.register_counter(&format!("kv_events_{name}"), help, counter.clone());
        }
    }
}

/// The Pod IP a topic names: `kv@<ip>@<model>`.
pub fn topic_pod_ip(topic: &str) -> Option<IpAddr> {
    let rest = topic.strip_prefix("kv@")?;
    let (ip, _model) = rest.split_once('@')?;
    ip.parse().ok()
}

/// Accepts publishers on `listener` and indexes what they send, until the
/// listener fails.
pub async fn serve(
    listener: TcpListener,
    registry: Arc<EndpointRegistry>,
    stats: Arc<EventStats>,
    limits: Limits,
) -> std::io::Result<()> {
    let (tx, rx) = mpsc::channel(QUEUE);
    tokio::spawn(index_messages(rx, registry, Arc::clone(&stats)));
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = listener.accept().await?;
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            stats.refused_connections.inc_by(1);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (tx, stats) = (tx.clone(), Arc::clone(&stats));
        tokio::spawn(async move {
            match zmtp::serve_publisher(stream, limits, tx).await {
                Ok(d) => {
                    let n = d.oversized + d.too_many_frames;
                    stats.dropped.inc_by(n);
                }
                Err(e) => {
                    stats.refused_connections.inc_by(1);
                    tracing::warn!(%peer, error = %e, "KV-events connection ended");
                }
            }
            drop(permit);
        });
    }
}

async fn index_messages(
    mut rx: mpsc::Receiver<Vec<Vec<u8>>>,
    registry: Arc<EndpointRegistry>,
    stats: Arc<EventStats>,
) {
    while let Some(frames) = rx.recv().await {
        stats.messages.inc_by(1);
        match wire::decode_message(&frames) {
            Ok(message) => apply(&message, &registry, &stats),
            Err(e) => {
                stats.malformed.inc_by(1);
                tracing::debug!(error = %e, "undecodable KV-events message");
            }
        }
    }
}

/// Applies one message to every endpoint of the Pod its topic names.
pub fn apply(message: &Message, registry: &EndpointRegistry, stats: &EventStats) {
    let states = topic_pod_ip(&message.topic)
        .map(|ip| registry.states_on_ip(ip))
        .unwrap_or_default();
    if states.is_empty() {
        stats.unknown_pod.inc_by(1);
        return;
    }
    for state in states {
        let applied = state.kv.apply(message.seq, &message.batch);
        if applied.became_stale {
            stats.gaps.inc_by(1);
            tracing::warn!(topic = %message.topic, seq = message.seq, "KV events lost (sequence gap): the Pod's cached prefixes are estimated until its cache is cleared");
        }
        stats.orphaned_blocks.inc_by(applied.orphaned);
        stats.malformed_events.inc_by(applied.malformed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_topic_names_the_pod_ip() {
        assert_eq!(
            topic_pod_ip("kv@10.1.2.3@qwen"),
            Some("10.1.2.3".parse().unwrap())
        );
        assert_eq!(
            topic_pod_ip("kv@fd00::7@org/model@v1"),
            Some("fd00::7".parse().unwrap())
        );
        for bad in ["", "kv", "kv@10.1.2.3", "kv@pod-a@m", "xx@10.1.2.3@m"] {
            assert_eq!(topic_pod_ip(bad), None, "{bad}");
        }
    }
}
