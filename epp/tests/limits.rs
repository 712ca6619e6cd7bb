//! The attack from the hardening review, against the real binary: many
//! streams each send megabytes of body and never finish it. Memory must stay
//! bounded by the shared body budget, the streams over it must be answered at
//! once, and the ones under it must be closed by the idle timeout.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Msg;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Reply;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

const MIB: usize = 1024 * 1024;
const BUDGET: usize = 48 * MIB;
const STREAMS: usize = 100;
const CHUNKS: usize = 15;

const POLICY: &str = "pool: { selector: { app: x }, targetPorts: [{ number: 8000 }] }
rules:
  - name: all
    route: { select: [{ minimize: QueueDepth }] }
";

struct Epp {
    child: Child,
    grpc: SocketAddr,
    metrics: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Epp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    kinference_testbed::free_port().expect("a free port")
}

/// `endpoint`: the one model server (`ip:port`) serving model `m`.
fn start_epp(endpoint: SocketAddr) -> Epp {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let endpoints = dir.path().join("endpoints.yaml");
    std::fs::write(
        &endpoints,
        format!("- address: {endpoint}\n  models: [m]\n"),
    )
    .unwrap();
    let (grpc, health, metrics) = (free_port(), free_port(), free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_kinference-epp"))
        .args(["--bind-address", "127.0.0.1", "--secure-serving=false"])
        .args(["--grpc-port", &grpc.to_string()])
        .args(["--grpc-health-port", &health.to_string()])
        .args(["--metrics-port", &metrics.to_string()])
        .arg("--policy-file")
        .arg(&policy)
        .arg("--endpoints-file")
        .arg(&endpoints)
        .args(["--max-buffered-body-bytes", &BUDGET.to_string()])
        .args(["--stream-idle-timeout", "3s"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the EPP binary starts");
    Epp {
        child,
        grpc: ([127, 0, 0, 1], grpc).into(),
        metrics: ([127, 0, 0, 1], metrics).into(),
        _dir: dir,
    }
}

fn rss_bytes(pid: u32) -> usize {
    status_bytes(pid, "VmRSS:")
}

/// The peak resident set since the process started.
fn peak_rss_bytes(pid: u32) -> usize {
    status_bytes(pid, "VmHWM:")
}

fn status_bytes(pid: u32, field: &str) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: usize = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/<pid>/status"));
    kib * 1024
}

async fn scrape(addr: SocketAddr) -> String {
    reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

fn gauge(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in\n{text}"))
}

async fn wait_ready(epp: &Epp) -> Channel {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ready = reqwest::get(format!("http://{}/readyz", epp.metrics))
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready
            && let Ok(c) = Channel::from_shared(format!("http://{}", epp.grpc))
                .unwrap()
                .connect()
                .await
        {
            return c;
        }
        assert!(Instant::now() < deadline, "the EPP did not become ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn request(msg: Msg) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(msg),
        ..ProcessingRequest::default()
    }
}

fn headers() -> ProcessingRequest {
    let header = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..HeaderValue::default()
    };
    request(Msg::RequestHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![
                header(":method", "POST"),
                header(":path", "/v1/completions"),
                header("content-type", "application/json"),
            ],
        }),
        end_of_stream: false,
        ..HttpHeaders::default()
    }))
}

/// What one attacking stream saw.
struct Attack {
    /// The immediate response's status, if one came.
    status: Option<i32>,
    /// Keeps the stream open.
    _tx: mpsc::Sender<ProcessingRequest>,
    replies: tonic::Streaming<envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse>,
}

/// Sends headers and `CHUNKS` MiB of body without end_of_stream; returns
/// once the body is sent or the EPP answered with an immediate response.
async fn attack(channel: Channel) -> Attack {
    let mut client = ExternalProcessorClient::new(channel).max_encoding_message_size(64 * MIB);
    let (tx, rx) = mpsc::channel(2);
    tx.send(headers()).await.unwrap();
    let mut replies = client
        .process(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut status = None;
    for _ in 0..CHUNKS {
        let chunk = request(Msg::RequestBody(HttpBody {
            body: vec![b' '; MIB],
            end_of_stream: false,
            ..HttpBody::default()
        }));
        tokio::select! {
            sent = tx.send(chunk) => if sent.is_err() { break },
            reply = replies.message() => {
                if let Ok(Some(r)) = reply && let Some(Reply::ImmediateResponse(i)) = r.response {
                    status = i.status.map(|s| s.code);
                    break;
                }
            }
        }
    }
    Attack {
        status,
        _tx: tx,
        replies,
    }
}

/// Waits for the immediate response a held stream gets at its idle timeout.
async fn immediate_status(attack: &mut Attack) -> Option<i32> {
    if attack.status.is_some() {
        return attack.status;
    }
    while let Ok(Some(reply)) = attack.replies.message().await {
        if let Some(Reply::ImmediateResponse(i)) = reply.response {
            return i.status.map(|s| s.code);
        }
    }
    None
}

/// The EPP binary in front of one simulator, Ready, and a channel to it.
async fn serving_epp() -> (kinference_simulator::SimHandle, Epp, Channel) {
    let sim = kinference_simulator::spawn(
        kinference_simulator::SimConfig::default(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let epp = start_epp(sim.addr());
    let channel = wait_ready(&epp).await;
    (sim, epp, channel)
}

/// One message larger than a whole body is refused by its length prefix,
/// before its bytes are buffered: a stream cannot make the decoder hold
/// more than a body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_larger_than_a_body_is_refused_unread() {
    let (_sim, epp, channel) = serving_epp().await;
    let before = rss_bytes(epp.child.id());
    let mut client = ExternalProcessorClient::new(channel).max_encoding_message_size(64 * MIB);
    let (tx, rx) = mpsc::channel(2);
    tx.send(headers()).await.unwrap();
    tx.send(request(Msg::RequestBody(HttpBody {
        // The default body limit is 16 MiB.
        body: vec![b' '; 17 * MIB],
        end_of_stream: true,
        ..HttpBody::default()
    })))
    .await
    .unwrap();
    let mut replies = client
        .process(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut immediate = None;
    while let Ok(Some(reply)) = replies.message().await {
        if let Some(Reply::ImmediateResponse(i)) = reply.response {
            immediate = i.status.map(|s| s.code);
        }
    }
    assert_eq!(
        immediate,
        Some(413),
        "the gateway is told the body is too large"
    );
    let grew = peak_rss_bytes(epp.child.id()).saturating_sub(before);
    assert!(
        grew < 8 * MIB,
        "the refused message grew the peak RSS by {} MiB",
        grew / MIB
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_bodies_cannot_take_more_than_the_budget() {
    let (sim, epp, channel) = serving_epp().await;
    let before = rss_bytes(epp.child.id());

    let attacks: Vec<_> = (0..STREAMS)
        .map(|_| tokio::spawn(attack(channel.clone())))
        .collect();
    let mut attacks: Vec<Attack> = futures::future::join_all(attacks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    // Let the EPP take in what is in flight.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let during = rss_bytes(epp.child.id());
    let peak = peak_rss_bytes(epp.child.id());
    let text = scrape(epp.metrics).await;
    let buffered = gauge(&text, "kinference_epp_buffered_body_bytes");

    // 100 × 15 MiB = 1.5 GiB were offered; without the budget the EPP held
    // them all. With it, what the streams buffer and what the gRPC decoder
    // holds of the messages they are sending are charged alike, so the peak
    // is the budget and the allocator's slack, whatever the number of
    // streams (when the decoder's share went uncharged, each open stream
    // added a message: 1 MiB here).
    let grew = during.saturating_sub(before);
    let peaked = peak.saturating_sub(before);
    assert!(
        peaked < BUDGET + 48 * MIB,
        "the peak RSS grew by {} MiB (from {} MiB)",
        peaked / MIB,
        before / MIB
    );
    assert!(
        grew < BUDGET + 32 * MIB,
        "RSS grew by {} MiB (from {} MiB)",
        grew / MIB,
        before / MIB
    );
    assert!(buffered <= BUDGET as f64, "{buffered} bytes buffered");
    let refused = attacks.iter().filter(|a| a.status == Some(503)).count();
    // The streams still holding share the budget; every other one was
    // refused outright (not left waiting).
    assert!(
        refused >= STREAMS / 2,
        "only {refused} of {STREAMS} streams were refused"
    );
    eprintln!(
        "RSS {} → {} MiB (peak {} MiB); {buffered} bytes buffered; {refused} streams refused",
        before / MIB,
        during / MIB,
        peak / MIB
    );
    assert!(
        text.contains(r#"kinference_epp_stream_refusals_total{reason="body_budget"}"#),
        "{text}"
    );

    // The streams the budget admitted sit idle: each is answered 408 and
    // closed, and everything they held comes back.
    let mut statuses = Vec::new();
    for a in &mut attacks {
        statuses.push(
            tokio::time::timeout(Duration::from_secs(20), immediate_status(a))
                .await
                .expect("every stream is answered"),
        );
    }
    assert!(
        statuses.iter().all(|s| matches!(s, Some(503) | Some(408))),
        "{statuses:?}"
    );
    assert!(statuses.contains(&Some(408)), "{statuses:?}");
    drop(attacks);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = scrape(epp.metrics).await;
        if gauge(&text, "kinference_epp_buffered_body_bytes") == 0.0
            && gauge(&text, "kinference_epp_streams_open") == 0.0
        {
            break;
        }
        assert!(Instant::now() < deadline, "streams not released:\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // And a normal request is still served.
    let client = kinference_testbed::extproc_client::EppClient::connect(epp.grpc)
        .await
        .unwrap();
    let (outcome, _stream) = client
        .decide(&kinference_testbed::extproc_client::HttpRequest::post(
            "/v1/completions",
            br#"{"model":"m","prompt":"hello"}"#.to_vec(),
        ))
        .await
        .unwrap();
    let expected = sim.addr().to_string();
    assert_eq!(
        outcome.destination(),
        Some(expected.as_str()),
        "{outcome:?}"
    );
}
