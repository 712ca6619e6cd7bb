//! The events port: engines connect and publish (or, in dial mode, bind
//! and the EPP connects to each Pod: `super::dial`); each message is decoded
//! and applied to the index of the Pod its topic names
//! (`kv@<pod-ip>@<model>`, the topic vLLM's docs and llm-d use).
//!
//! Connections feed one bounded channel read by one task, so the indexes
//! see each engine's batches in order and a flood is held back at the
//! sockets, not in memory.
//!
//! With a replay port, a batch that follows a sequence gap waits while the
//! task asks the engine's replay endpoint for the lost batches and applies
//! them first, at most [`Replay::timeout`]; a gap it cannot fill marks the
//! Pod stale, as without replay. The first batch heard of an engine that
//! published before (this EPP started after it) is such a gap from the
//! engine's first batch: replayed, the index is whole; otherwise it is
//! partial (see [`crate::kv_cache::Freshness::Partial`]).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc};

pub use super::stats::EventStats;
use super::stats::forward;
use super::zmtp::{self, Limits, ReplayBound};
use crate::endpoints::EndpointRegistry;
use crate::kv_cache::wire::{self, Message};
use crate::predict::DestinationState;

/// Publishers connected at once, at most.
const MAX_CONNECTIONS: usize = 1024;
/// Messages decoded ahead of the index.
const QUEUE: usize = 256;
/// What one replay may return: vLLM buffers 10,000 batches
/// (`buffer_steps`); a frame may be 8 MiB, so bytes are bounded too.
const REPLAY_BOUND: ReplayBound = ReplayBound {
    batches: 10_000,
    bytes: 64 << 20,
};

/// Where the engines' replay endpoints are.
#[derive(Debug, Clone, Copy)]
pub struct Replay {
    /// vLLM's `replay_endpoint` port on each Pod; data-parallel rank `r`
    /// binds `port + r`.
    pub port: u16,
    /// How long one replay may hold the index, connecting included.
    pub timeout: Duration,
}

impl Replay {
    pub fn on_port(port: u16) -> Self {
        Replay {
            port,
            timeout: Duration::from_secs(1),
        }
    }
}

/// The Pod IP a topic names: `kv@<ip>@<model>`.
pub(crate) fn topic_pod_ip(topic: &str) -> Option<IpAddr> {
    let rest = topic.strip_prefix("kv@")?;
    let (ip, _model) = rest.split_once('@')?;
    ip.parse().ok()
}

/// Where the engines' events come in.
pub enum Source {
    /// The engines connect (vLLM `endpoint: tcp://<epp-service>:PORT`):
    /// one listener per data-parallel rank (rank `r` connects to the port +
    /// `r`). Each engine reaches one EPP replica.
    Listen(Vec<TcpListener>),
    /// The engines bind (vLLM `endpoint: tcp://*:PORT`) and the EPP connects
    /// to every Pod of the pool on each of these ports, one per rank: every
    /// EPP replica receives every Pod's events.
    Dial(std::ops::RangeInclusive<u16>),
}

/// Indexes what the engines publish through `source`, until a listener
/// fails (dial mode runs until it is dropped).
pub async fn serve(
    source: Source,
    registry: Arc<EndpointRegistry>,
    stats: Arc<EventStats>,
    limits: Limits,
    replay: Option<Replay>,
) -> std::io::Result<()> {
    let (tx, rx) = mpsc::channel(QUEUE);
    let indexer = Indexer {
        registry: Arc::clone(&registry),
        stats: Arc::clone(&stats),
        limits,
        replay,
    };
    tokio::spawn(indexer.run(rx));
    match source {
        Source::Listen(listeners) => listen(listeners, tx, stats, limits).await,
        Source::Dial(ports) => {
            super::dial::dial(registry, ports, tx, stats, limits).await;
            Ok(())
        }
    }
}

/// Accepts publishers on every listener until one fails.
async fn listen(
    listeners: Vec<TcpListener>,
    tx: mpsc::Sender<Vec<Vec<u8>>>,
    stats: Arc<EventStats>,
    limits: Limits,
) -> std::io::Result<()> {
    // One budget of connections over every port.
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut accepting = tokio::task::JoinSet::new();
    for listener in listeners {
        let (tx, stats, slots) = (tx.clone(), Arc::clone(&stats), Arc::clone(&slots));
        accepting.spawn(accept(listener, tx, stats, slots, limits));
    }
    match accepting.join_next().await {
        Some(Ok(result)) => result,
        Some(Err(e)) => Err(std::io::Error::other(e)),
        None => Ok(()),
    }
}

async fn accept(
    listener: TcpListener,
    tx: mpsc::Sender<Vec<Vec<u8>>>,
    stats: Arc<EventStats>,
    slots: Arc<Semaphore>,
    limits: Limits,
) -> std::io::Result<()> {
    loop {
        let (stream, peer) = listener.accept().await?;
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            stats.refused_connections.inc_by(1);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (tx, stats) = (tx.clone(), Arc::clone(&stats));
        tokio::spawn(async move {
            if let Err(e) = forward(stream, limits, tx, &stats).await {
                stats.refused_connections.inc_by(1);
                tracing::warn!(%peer, error = %e, "KV-events connection ended");
            }
            drop(permit);
        });
    }
}

/// The one task that applies messages to the indexes.
struct Indexer {
    registry: Arc<EndpointRegistry>,
    stats: Arc<EventStats>,
    limits: Limits,
    replay: Option<Replay>,
}

impl Indexer {
    async fn run(self, mut rx: mpsc::Receiver<Vec<Vec<u8>>>) {
        while let Some(frames) = rx.recv().await {
            self.stats.messages.inc_by(1);
            match wire::decode_message(&frames) {
                Ok(message) => self.index(&message).await,
                Err(e) => {
                    self.stats.malformed.inc_by(1);
                    tracing::debug!(error = %e, "undecodable KV-events message");
                }
            }
        }
    }

    /// Applies `message` to every endpoint of the Pod its topic names,
    /// after the batches a gap before it lost, when they can be replayed.
    async fn index(&self, message: &Message) {
        let Some(ip) = topic_pod_ip(&message.topic) else {
            self.stats.unknown_pod.inc_by(1);
            return;
        };
        let states = self.registry.states_on_ip(ip);
        if states.is_empty() {
            self.stats.unknown_pod.inc_by(1);
            return;
        }
        if let Some(replay) = self.replay {
            self.fill_gap(message, ip, &states, replay).await;
        }
        apply(message, &states, &self.stats);
    }

    /// If `message` follows a gap in its engine's sequence, asks the
    /// engine's replay endpoint (on `ip`) for the lost batches and applies
    /// them to `states`.
    async fn fill_gap(
        &self,
        message: &Message,
        ip: IpAddr,
        states: &[Arc<DestinationState>],
        replay: Replay,
    ) {
        let rank = message.batch.data_parallel_rank;
        let Some(from) = states
            .iter()
            .filter_map(|s| s.kv.missed_from(rank, message.seq))
            .min()
        else {
            return;
        };
        let port = u32::from(replay.port) + rank.unwrap_or(0);
        let Ok(port) = u16::try_from(port) else {
            return;
        };
        let addr = SocketAddr::new(ip, port);
        let fetched = tokio::time::timeout(replay.timeout, fetch(addr, from, self.limits)).await;
        let batches = match fetched {
            Ok(Ok(batches)) => batches,
            Ok(Err(e)) => return self.replay_failed(addr, &e.to_string()),
            Err(_) => return self.replay_failed(addr, "timed out"),
        };
        let mut replayed = 0;
        for frames in batches {
            let Ok(lost) = wire::decode_message(&frames) else {
                self.stats.malformed.inc_by(1);
                continue;
            };
            if lost.topic == message.topic
                && lost.batch.data_parallel_rank == rank
                && (from..message.seq).contains(&lost.seq)
            {
                apply(&lost, states, &self.stats);
                replayed += 1;
            }
        }
        self.stats.replayed.inc_by(replayed);
        tracing::info!(topic = %message.topic, from, to = message.seq, replayed, "KV-event batches lost in a sequence gap were replayed");
    }

    fn replay_failed(&self, addr: SocketAddr, error: &str) {
        self.stats.replay_failures.inc_by(1);
        tracing::warn!(%addr, error, "KV-event replay failed");
    }
}

/// The batches from `from` on that the replay endpoint at `addr` keeps.
async fn fetch(
    addr: SocketAddr,
    from: u64,
    limits: Limits,
) -> Result<Vec<Vec<Vec<u8>>>, zmtp::ZmtpError> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let _ = stream.set_nodelay(true);
    zmtp::replay(stream, from, limits, REPLAY_BOUND).await
}

/// Applies one message to `states`, the endpoints of the Pod its topic
/// names.
fn apply(message: &Message, states: &[Arc<DestinationState>], stats: &EventStats) {
    for state in states {
        let applied = state.kv.apply(message.seq, &message.batch);
        if applied.joined_late {
            tracing::info!(topic = %message.topic, seq = message.seq, "KV events joined after the engine's first batch, without a replay: the Pod's cached prefixes are the longer of the index's and the estimate's until its cache is cleared");
        }
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
