//! Sequence gaps and silence against vLLM's own publisher: `ZmqEventPublisher` from the
//! vLLM wheel (`bench/peers/install.sh vllm-publisher`), driven by
//! `fixtures/kv_events/publisher.py`, publishes to the EPP's events port
//! through a link the test can cut, as a network blip would. While the
//! link is down the publisher queues what it publishes up to its
//! high-water mark (vLLM's `hwm`, 2 here) and drops the rest, as it does
//! in production once 100,000 batches are queued; the next batch that
//! arrives follows a gap. With a replay port the EPP asks vLLM's replay socket (a ROUTER)
//! for them and its index is whole again; without one, or when the replay
//! endpoint is not there, the Pod's index is marked stale. When the
//! publisher's process stops, the Pod is estimated once it has been silent
//! for 10 s since it was sent a request, and used again when a new process
//! publishes.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kinference_epp::endpoints::{EndpointRegistry, EndpointSpec, endpoints_from_specs};
use kinference_epp::kv_cache::index::SILENCE;
use kinference_epp::kv_cache::{Freshness, IndexUse};
use kinference_epp::kv_events::subscriber::{self, EventStats, Replay, Source};
use kinference_epp::kv_events::zmtp::Limits;
use kinference_epp::metrics::Metrics;
use kinference_epp::predict::DestinationState;
use kinference_testbed::peers::vllm_publisher;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::TcpListener;
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::task::JoinHandle;

const BLOCK_SIZE: usize = 4;
const WAIT: Duration = Duration::from_secs(20);
const TOPIC: &str = "kv@127.0.0.1@m";

fn free_port() -> u16 {
    kinference_testbed::free_port().expect("a free port")
}

async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A TCP link from `listen` to `to` that can be cut (every connection
/// closed, nothing accepted) and restored on the same port.
struct Link {
    listen: SocketAddr,
    to: SocketAddr,
    task: Option<JoinHandle<()>>,
}

impl Link {
    async fn up(listen: SocketAddr, to: SocketAddr) -> Link {
        let mut link = Link {
            listen,
            to,
            task: None,
        };
        link.restore().await;
        link
    }

    async fn restore(&mut self) {
        let listener = TcpListener::bind(self.listen).await.unwrap();
        let to = self.to;
        self.task = Some(tokio::spawn(async move {
            // Owned here, so that aborting this task closes them all.
            let mut open = tokio::task::JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                open.spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        }));
    }

    async fn cut(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

/// vLLM's publisher in a Python process.
struct Publisher {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Publisher {
    async fn start(endpoint: SocketAddr, replay_port: u16, topic: &str, hwm: u32) -> Publisher {
        let replay = format!("tcp://*:{replay_port}");
        let args = ["--replay", &replay, "--hwm", &hwm.to_string()];
        Publisher::spawn(&format!("tcp://{endpoint}"), topic, &args).await
    }

    /// Rank `rank` of a data-parallel engine, without a replay socket;
    /// `endpoint` as vLLM's config has it (`tcp://*:PORT` binds).
    async fn rank(endpoint: &str, topic: &str, rank: u32) -> Publisher {
        let rank = rank.to_string();
        Publisher::spawn(endpoint, topic, &["--data-parallel-rank", &rank]).await
    }

    async fn spawn(endpoint: &str, topic: &str, args: &[&str]) -> Publisher {
        let python = tokio::task::spawn_blocking(vllm_publisher)
            .await
            .unwrap()
            .expect("vLLM's publisher (bench/peers/install.sh vllm-publisher)");
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kv_events/publisher.py");
        let mut child = Command::new(python)
            .arg(script)
            .args(["--endpoint", endpoint])
            .args(["--topic", topic])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python runs");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut publisher = Publisher {
            child,
            stdin,
            stdout,
        };
        assert_eq!(publisher.line().await, "ready");
        publisher
    }

    async fn line(&mut self) -> String {
        let line = tokio::time::timeout(WAIT, self.stdout.next_line())
            .await
            .expect("the publisher answers")
            .unwrap();
        line.expect("the publisher is running")
    }

    /// Publishes one batch; returns its sequence number once sent.
    async fn publish(&mut self, batch: serde_json::Value) -> u64 {
        let mut line = batch.to_string();
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).await.unwrap();
        let answer = self.line().await;
        let seq = answer.strip_prefix("published ").expect("published <seq>");
        seq.parse().unwrap()
    }

    /// Stores blocks `first..first + n`, chained after `first - 1` (none for
    /// block 1), over tokens that follow from the block numbers.
    async fn store(&mut self, first: u64, n: u64) -> u64 {
        let hashes: Vec<u64> = (first..first + n).collect();
        let tokens: Vec<u64> = (0..n * BLOCK_SIZE as u64)
            .map(|i| (first - 1) * BLOCK_SIZE as u64 + i)
            .collect();
        let parent = (first > 1).then(|| first - 1);
        self.publish(json!({"stored": {
            "hashes": hashes, "parent": parent, "tokens": tokens, "block_size": BLOCK_SIZE
        }}))
        .await
    }

    /// Ends the process, as an engine that stops.
    async fn stop(&mut self) {
        let _ = self.child.kill().await;
    }
}

/// The EPP's events port with one Pod on 127.0.0.1, and vLLM's publisher
/// behind a link to it.
struct Setup {
    state: Arc<DestinationState>,
    stats: Arc<EventStats>,
    link: Link,
    publisher: Publisher,
    registry: Arc<EndpointRegistry>,
    /// Where a publisher connects (the link) and binds its replay socket.
    link_addr: SocketAddr,
    replay_port: u16,
}

impl Setup {
    /// With the publisher's high-water mark at 2, so that a cut link loses
    /// batches at once.
    async fn start(replay: impl FnOnce(u16) -> Option<Replay>) -> Setup {
        Setup::with_hwm(replay, 2).await
    }

    async fn with_hwm(replay: impl FnOnce(u16) -> Option<Replay>, hwm: u32) -> Setup {
        let (registry, state) = one_pod();
        let stats = Arc::new(EventStats::default());
        let events = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let events_addr = events.local_addr().unwrap();
        let replay_port = free_port();
        tokio::spawn(subscriber::serve(
            Source::Listen(vec![events]),
            Arc::clone(&registry),
            Arc::clone(&stats),
            Limits::default(),
            replay(replay_port),
        ));
        let link_addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let link = Link::up(link_addr, events_addr).await;
        let publisher = Publisher::start(link_addr, replay_port, TOPIC, hwm).await;
        let mut setup = Setup {
            state,
            stats,
            link,
            publisher,
            registry,
            link_addr,
            replay_port,
        };
        setup.wait_connected().await;
        setup
    }

    /// Connects a publisher whose engine holds nothing yet.
    async fn wait_connected(&mut self) {
        connect(&mut self.publisher, &self.stats).await;
    }

    /// Stores blocks 1..=2, then cuts the link, fills the publisher's
    /// queue, stores 3..=5 (dropped at the high-water mark), and restores
    /// the link: the next batch that arrives follows a gap.
    async fn lose_batches(&mut self) {
        self.publisher.store(1, 2).await;
        eventually("blocks 1 and 2", || self.state.kv.len() == 2).await;
        assert_eq!(self.state.kv.freshness(), Freshness::Live);
        self.link.cut().await;
        for _ in 0..4 {
            self.publisher.publish(json!({})).await;
        }
        self.publisher.store(3, 2).await;
        self.publisher.store(5, 1).await;
        self.link.restore().await;
        // The queued batches arrive; the next one shows the gap.
        reach(&mut self.publisher, &self.stats).await;
        let before = self.stats.messages.get();
        self.publisher.publish(json!({})).await;
        eventually("the batch after the gap", || {
            self.stats.messages.get() > before
        })
        .await;
    }
}

#[tokio::test]
async fn batches_lost_in_a_gap_are_replayed_from_vllms_replay_socket() {
    // Generous: CI runs many test binaries at once on two cores.
    let replay = |port| Replay {
        port,
        timeout: Duration::from_secs(10),
    };
    let mut s = Setup::start(|port| Some(replay(port))).await;
    s.lose_batches().await;
    eventually("the replayed blocks", || s.state.kv.len() == 5).await;
    assert_eq!(s.state.kv.freshness(), Freshness::Live);
    assert!(s.stats.replayed.get() >= 2, "{}", s.stats.replayed.get());
    assert_eq!(s.stats.gaps.get(), 0);
    assert_eq!(s.stats.replay_failures.get(), 0);
    // And it goes on from there: a removal of a replayed block applies.
    s.publisher.publish(json!({"removed": [5]})).await;
    eventually("block 5 removed", || s.state.kv.len() == 4).await;
    assert_eq!(s.state.kv.freshness(), Freshness::Live);
    s.publisher.stop().await;
}

#[tokio::test]
async fn without_a_replay_endpoint_a_gap_marks_the_pod_stale() {
    for replay in [None, Some(free_port())] {
        // The second time a replay port where nothing listens.
        let mut s = Setup::start(|_| replay.map(Replay::on_port)).await;
        s.lose_batches().await;
        eventually("the gap", || s.state.kv.freshness() == Freshness::Stale).await;
        assert_eq!(s.state.kv.len(), 2, "{replay:?}");
        assert_eq!(s.stats.gaps.get(), 1);
        assert_eq!(s.stats.replayed.get(), 0);
        let failures = u64::from(replay.is_some());
        assert_eq!(s.stats.replay_failures.get(), failures, "{replay:?}");
        // A cleared cache holds nothing that was missed.
        s.publisher.publish(json!({"cleared": true})).await;
        eventually("live again", || s.state.kv.freshness() == Freshness::Live).await;
        s.publisher.stop().await;
    }
}

#[tokio::test]
async fn a_flood_from_vllms_publisher_stays_within_the_pods_cache_size() {
    // vLLM's own high-water mark: nothing is dropped on its side.
    let mut s = Setup::with_hwm(|_| None, 100_000).await;
    s.state.kv.set_capacity(1_000);
    let before = s.stats.messages.get();
    let flood = json!({"flood": {"batches": 5_000, "blocks": 10}});
    s.publisher.publish(flood).await;
    eventually("the flood", || s.stats.messages.get() >= before + 5_000).await;
    // 50,000 blocks stored, the oldest forgotten past the capacity.
    assert_eq!(s.state.kv.len(), 1_000);
    assert_eq!(s.state.kv.freshness(), Freshness::Live);
    assert_eq!(s.stats.gaps.get(), 0);
    s.publisher.stop().await;
}

/// A batch the EPP cannot decode, sent by vLLM's publisher thread in its
/// own framing (topic, next sequence number) with a payload that is not
/// msgpack (0xc1 is never used): it is counted, the connection stays up,
/// and since what the batch held is unknown the next batch shows a gap and
/// the Pod is estimated until its cache is cleared.
#[tokio::test]
async fn an_undecodable_batch_from_vllms_publisher_leaves_the_pod_estimated() {
    let mut s = Setup::start(|_| None).await;
    s.publisher.store(1, 2).await;
    eventually("blocks 1 and 2", || s.state.kv.len() == 2).await;
    let malformed = s.stats.malformed.get();
    s.publisher.publish(json!({"undecodable": "c1c1c1"})).await;
    eventually("the batch counted", || {
        s.stats.malformed.get() == malformed + 1
    })
    .await;
    assert_eq!(s.state.kv.freshness(), Freshness::Live);
    s.publisher.store(3, 1).await;
    eventually("the gap it left", || {
        s.state.kv.freshness() == Freshness::Stale
    })
    .await;
    assert_eq!(s.stats.gaps.get(), 1);
    assert_eq!(
        s.stats.refused_connections.get(),
        0,
        "the connection is kept"
    );
    s.publisher.publish(json!({"cleared": true})).await;
    eventually("live again", || s.state.kv.freshness() == Freshness::Live).await;
    assert_eq!(s.state.kv.len(), 0);
    s.publisher.stop().await;
}

/// A data-parallel engine: vLLM's rank r publishes to the events port + r
/// (its `offset_endpoint_port`), each rank numbering its batches from 0. The
/// EPP listens on one port per rank and keeps one sequence per rank, so
/// both ranks' blocks are indexed and neither's numbering resets the other.
#[tokio::test]
async fn each_data_parallel_rank_of_vllm_publishes_to_a_port_of_its_own() {
    let (registry, state) = one_pod();
    let stats = Arc::new(EventStats::default());
    let (first, listeners) = consecutive_events_ports(2).await;
    tokio::spawn(subscriber::serve(
        Source::Listen(listeners),
        Arc::clone(&registry),
        Arc::clone(&stats),
        Limits::default(),
        None,
    ));
    // Both are given the same endpoint, as every rank of an engine is.
    let endpoint = format!("tcp://127.0.0.1:{first}");
    let mut ranks = Vec::new();
    for rank in 0..2 {
        let mut publisher = Publisher::rank(&endpoint, TOPIC, rank).await;
        connect(&mut publisher, &stats).await;
        ranks.push(publisher);
    }
    ranks[0].store(1, 2).await;
    eventually("rank 0's blocks", || state.kv.len() == 2).await;
    // Rank 1's numbering is behind rank 0's: it must not read as a restart.
    ranks[1].store(1, 3).await;
    eventually("rank 1's blocks beside rank 0's", || state.kv.len() == 5).await;
    ranks[0].store(3, 1).await;
    eventually("rank 0 going on", || state.kv.len() == 6).await;
    assert_eq!(state.kv.freshness(), Freshness::Live);
    assert_eq!(stats.gaps.get(), 0);
    for mut publisher in ranks {
        publisher.stop().await;
    }
}

/// Dial mode: the engine's ranks bind (vLLM `endpoint: tcp://*:PORT`, rank
/// r on PORT + r) and each EPP replica connects to every Pod on each rank's
/// port, so two replicas both index both ranks' blocks. The replicas start
/// first, as an EPP usually does, and keep retrying until the engines are
/// up. A Pod that leaves the registry is no longer subscribed to.
#[tokio::test]
async fn in_dial_mode_every_epp_replica_subscribes_to_every_rank_of_vllm() {
    let (first, listeners) = consecutive_events_ports(2).await;
    drop(listeners); // the publishers bind them
    let replicas = [Replica::dialing(first, 2), Replica::dialing(first, 2)];
    let endpoint = format!("tcp://*:{first}");
    let mut ranks = Vec::new();
    for rank in 0..2 {
        ranks.push(Publisher::rank(&endpoint, TOPIC, rank).await);
    }
    for replica in &replicas {
        eventually("both ranks subscribed to", || {
            replica.stats.subscriptions.get() == 2
        })
        .await;
        for publisher in &mut ranks {
            connect(publisher, &replica.stats).await;
        }
    }
    assert!(
        replicas.iter().all(|r| r.stats.dial_failures.get() > 0),
        "no retry"
    );
    ranks[0].store(1, 2).await;
    ranks[1].store(1, 3).await;
    for (i, replica) in replicas.iter().enumerate() {
        let what = format!("replica {i} holding both ranks' blocks");
        eventually(&what, || replica.state.kv.len() == 5).await;
        assert_eq!(replica.state.kv.freshness(), Freshness::Live);
        assert_eq!(replica.stats.gaps.get(), 0);
    }

    // The Pod leaves replica 0: its subscriptions close, replica 1's stay.
    replicas[0].registry.replace_all(Vec::new());
    eventually("replica 0 unsubscribed", || {
        replicas[0].stats.subscriptions.get() == 0
    })
    .await;
    let before = replicas[0].stats.messages.get();
    ranks[0].store(3, 1).await;
    eventually("replica 1 going on", || replicas[1].state.kv.len() == 6).await;
    assert_eq!(replicas[0].stats.messages.get(), before, "still subscribed");
    assert_eq!(replicas[1].stats.subscriptions.get(), 2);
    for mut publisher in ranks {
        publisher.stop().await;
    }
}

/// One EPP replica's registry (one Pod on 127.0.0.1) and events, dialling.
struct Replica {
    registry: Arc<EndpointRegistry>,
    state: Arc<DestinationState>,
    stats: Arc<EventStats>,
}

impl Replica {
    fn dialing(port: u16, ranks: u16) -> Replica {
        Replica::dialing_with(port, ranks, None)
    }

    fn dialing_with(port: u16, ranks: u16, replay: Option<Replay>) -> Replica {
        let (registry, state) = one_pod();
        let stats = Arc::new(EventStats::default());
        tokio::spawn(subscriber::serve(
            Source::Dial(port..=port + ranks - 1),
            Arc::clone(&registry),
            Arc::clone(&stats),
            Limits::default(),
            replay,
        ));
        Replica {
            registry,
            state,
            stats,
        }
    }
}

/// A registry of one Pod on 127.0.0.1 (the topic's IP), and its state.
fn one_pod() -> (Arc<EndpointRegistry>, Arc<DestinationState>) {
    let registry = EndpointRegistry::new(Duration::from_secs(60));
    let pod = format!("127.0.0.1:{}", free_port());
    let spec = EndpointSpec::new(pod.clone(), &["m"]);
    registry.replace_all(endpoints_from_specs([spec]).unwrap());
    let state = registry.state_at(&pod).unwrap();
    (registry, state)
}

/// `n` listeners on consecutive loopback ports, as the EPP binds them.
async fn consecutive_events_ports(n: u16) -> (u16, Vec<TcpListener>) {
    let ip = std::net::IpAddr::from([127, 0, 0, 1]);
    for _ in 0..50 {
        let first = free_port();
        let Ok(ports) = kinference_epp::server::events_ports(first, n) else {
            continue;
        };
        if let Ok(listeners) = kinference_epp::server::bind_events_ports(ip, ports).await {
            return (first, listeners);
        }
    }
    panic!("no {n} consecutive free ports");
}

/// Connects a publisher whose engine holds nothing yet. Its first batches
/// may be lost while the connection comes up, so the first to arrive reads
/// as an engine that published before the EPP subscribed; it then says its
/// cache is clear, which is true here.
async fn connect(publisher: &mut Publisher, stats: &EventStats) {
    reach(publisher, stats).await;
    let before = stats.messages.get();
    publisher.publish(json!({"cleared": true})).await;
    eventually("the cleared cache", || stats.messages.get() > before).await;
}

/// Publishes empty batches until one arrives (a PUB socket drops what it
/// publishes before its connection is up).
async fn reach(publisher: &mut Publisher, stats: &EventStats) {
    let before = stats.messages.get();
    let deadline = Instant::now() + WAIT;
    while stats.messages.get() == before {
        assert!(Instant::now() < deadline, "no batch reached the EPP");
        publisher.publish(json!({})).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `state` label of the Pod's `kinference_epp_kv_events_index` gauge.
fn exported_state(metrics: &Metrics, registry: &EndpointRegistry) -> String {
    let text = metrics.render(registry, None);
    let line = text
        .lines()
        .find(|l| l.starts_with("kinference_epp_kv_events_index{"))
        .unwrap_or_else(|| panic!("no kv_events_index gauge:\n{text}"));
    let state = line.split("state=\"").nth(1).expect("a state label");
    state[..state.find('"').unwrap()].to_owned()
}

#[tokio::test]
async fn a_pod_whose_publisher_stopped_is_estimated_until_a_new_one_publishes() {
    // vLLM's own high-water mark: nothing published here is dropped.
    let mut s = Setup::with_hwm(|_| None, 100_000).await;
    let metrics = Metrics::default();
    metrics.export_kv_index_states();
    s.publisher.store(1, 2).await;
    eventually("blocks 1 and 2", || s.state.kv.len() == 2).await;
    // Well ahead of what a new process could lose while it connects, so
    // that its first batch to arrive reads as a restart, never as a gap.
    let before = s.stats.messages.get();
    for _ in 0..50 {
        s.publisher.publish(json!({})).await;
    }
    eventually("the empty batches", || {
        s.stats.messages.get() >= before + 50
    })
    .await;
    assert_eq!(exported_state(&metrics, &s.registry), "live");

    // vLLM's publisher process ends; the Pod is then sent a request.
    s.publisher.stop().await;
    let routed = Instant::now();
    s.state.kv.note_routed(routed);
    assert_eq!(s.state.kv.usage(Instant::now()), IndexUse::Live);
    assert!(s.state.kv.pool_slots(Instant::now()).is_some());
    tokio::time::sleep_until((routed + SILENCE).into()).await;
    eventually("silence", || {
        s.state.kv.usage(Instant::now()) == IndexUse::Silent
    })
    .await;
    assert!(
        s.state.kv.pool_slots(Instant::now()).is_none(),
        "a silent Pod's index is not matched"
    );
    assert_eq!(exported_state(&metrics, &s.registry), "silent");
    assert_eq!(s.state.kv.len(), 2, "what it held is kept");

    // A new process (its batches numbered from 0 again) publishes.
    s.publisher = Publisher::start(s.link_addr, s.replay_port, TOPIC, 100_000).await;
    s.wait_connected().await;
    s.publisher.store(1, 1).await;
    eventually("live again", || {
        s.state.kv.usage(Instant::now()) == IndexUse::Live
    })
    .await;
    // Taken for a restart: the old process's blocks are gone.
    eventually("only the new block", || s.state.kv.len() == 1).await;
    assert!(s.state.kv.pool_slots(Instant::now()).is_some());
    assert_eq!(exported_state(&metrics, &s.registry), "live");
    s.publisher.stop().await;
}

/// A replica that starts while vLLM has been publishing for a while (a
/// new replica, or one restarted by a rollout): its first batch reads as a
/// gap from the engine's first one. With vLLM's replay socket it is
/// filled, and the new replica's index is the others' at once; without
/// one the index is partial (exported as such) and matches only what was
/// stored since, so the picker takes the longer of it and the estimate.
#[tokio::test]
async fn a_replica_that_joins_late_replays_what_vllm_published_before() {
    let (port, listeners) = consecutive_events_ports(1).await;
    drop(listeners); // the publisher binds it
    let replay_port = free_port();
    let replay = format!("tcp://*:{replay_port}");
    let endpoint = format!("tcp://*:{port}");
    let mut publisher = Publisher::spawn(&endpoint, TOPIC, &["--replay", &replay]).await;
    let first = Replica::dialing(port, 1);
    eventually("subscribed", || first.stats.subscriptions.get() == 1).await;
    connect(&mut publisher, &first.stats).await;
    for block in 1..=40 {
        publisher.store(block, 1).await;
    }
    eventually("40 blocks", || first.state.kv.len() == 40).await;
    assert_eq!(first.state.kv.freshness(), Freshness::Live);

    let metrics = Metrics::default();
    metrics.export_kv_index_states();
    let started = Instant::now();
    let timeout = Duration::from_secs(10);
    let late = Replica::dialing_with(
        port,
        1,
        Some(Replay {
            port: replay_port,
            timeout,
        }),
    );
    let unreplayed = Replica::dialing(port, 1);
    for replica in [&late, &unreplayed] {
        eventually("subscribed", || replica.stats.subscriptions.get() == 1).await;
        reach(&mut publisher, &replica.stats).await;
    }
    eventually("the late replica caught up", || late.state.kv.len() == 40).await;
    let caught_up = started.elapsed();
    assert_eq!(late.state.kv.freshness(), Freshness::Live);
    assert!(
        late.stats.replayed.get() >= 40,
        "{}",
        late.stats.replayed.get()
    );
    assert_eq!(late.stats.gaps.get(), 0);
    assert_eq!(exported_state(&metrics, &late.registry), "live");
    eprintln!("a late replica's index was whole {caught_up:?} after it started (vLLM's replay)");

    assert_eq!(unreplayed.state.kv.freshness(), Freshness::Partial);
    assert_eq!(
        unreplayed.state.kv.len(),
        0,
        "nothing stored since it joined"
    );
    assert_eq!(exported_state(&metrics, &unreplayed.registry), "partial");
    // A block stored now extends a chain it never heard the start of.
    publisher.store(41, 1).await;
    eventually("block 41 everywhere", || {
        [&first, &late, &unreplayed]
            .iter()
            .all(|r| !r.state.kv.is_empty())
            && first.state.kv.len() == 41
            && late.state.kv.len() == 41
    })
    .await;
    assert_eq!(unreplayed.state.kv.len(), 1);
    let slots = unreplayed.state.kv.pool_slots(Instant::now());
    assert!(
        slots.is_some_and(|s| s.partial),
        "matched, as a lower bound"
    );
    assert_eq!(unreplayed.stats.gaps.get(), 0, "partial is not a gap");
    assert_eq!(unreplayed.state.kv.freshness(), Freshness::Partial);
    // A cleared cache holds nothing stored before it joined.
    publisher.publish(json!({"cleared": true})).await;
    eventually("live once cleared", || {
        unreplayed.state.kv.freshness() == Freshness::Live
    })
    .await;
    publisher.stop().await;
}
