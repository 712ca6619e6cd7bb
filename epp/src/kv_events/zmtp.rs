//! The subscribing end of ZeroMQ's wire protocol (ZMTP 3.0, NULL
//! security), as far as the engines' KV-event publishers need it: the EPP
//! binds, each engine's PUB socket connects, and every multipart message
//! it publishes arrives here.
//!
//! Why not the `zeromq` crate: its frame decoder reserves whatever length a
//! peer declares (up to 2^64 bytes) before reading it, so one bad packet on
//! the events port aborts the process; and its queues are unbounded. Here a
//! frame over [`Limits::max_frame_bytes`] is skipped without being held (the
//! message it belongs to is dropped and counted), a message has at most
//! [`Limits::max_frames`] frames, and messages go out through a bounded
//! channel, so a slow index pushes back on the TCP connection and the
//! engine's own high-water mark drops events (which the index then sees as
//! a sequence gap) rather than our memory growing.
//!
//! We greet as ZMTP 3.0, so peers speaking 3.1 (libzmq, go-zeromq) fall
//! back to 3.0's subscription messages (`0x01` + topic prefix) and send no
//! heartbeats.
//!
//! The other way round, [`replay`] connects as a DEALER to vLLM's replay
//! endpoint (a ROUTER) and asks for the batches a sequence gap lost.

use std::io;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// Bounds on what one connection may send.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_frame_bytes: u64,
    pub max_frames: usize,
    /// Time allowed for the greeting and handshake.
    pub handshake_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            // A 220 KB prompt's prefill publishes about 200 KB of events.
            max_frame_bytes: 8 << 20,
            max_frames: 3,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    #[error("not a ZMTP peer (bad greeting signature)")]
    Signature,
    #[error("ZMTP version {0}.{1} is not supported (3.0 or later)")]
    Version(u8, u8),
    #[error("security mechanism {0:?} is not supported (NULL only)")]
    Mechanism(String),
    #[error("the peer is a {0:?} socket, not {1}")]
    SocketType(String, &'static str),
    #[error("malformed {0}")]
    Malformed(&'static str),
    #[error("handshake timed out")]
    Timeout,
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// What a connection delivered besides messages, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dropped {
    /// Messages with a frame over the size limit.
    pub oversized: u64,
    /// Messages with more frames than the limit.
    pub too_many_frames: u64,
}

const SIGNATURE_FIRST: u8 = 0xFF;
const SIGNATURE_LAST: u8 = 0x7F;
const FLAG_MORE: u8 = 0b001;
const FLAG_LONG: u8 = 0b010;
const FLAG_COMMAND: u8 = 0b100;

fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = SIGNATURE_FIRST;
    g[9] = SIGNATURE_LAST;
    g[10] = 3; // major
    g[11] = 0; // minor
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A command frame: name size, name, body.
fn command(name: &str, body: &[u8]) -> Vec<u8> {
    let mut payload = Vec::with_capacity(1 + name.len() + body.len());
    payload.push(name.len() as u8);
    payload.extend_from_slice(name.as_bytes());
    payload.extend_from_slice(body);
    frame(FLAG_COMMAND, &payload)
}

fn frame(flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 9);
    if payload.len() > 255 {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(payload.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(payload.len() as u8);
    }
    out.extend_from_slice(payload);
    out
}

/// The READY command of a socket of type `socket_type`.
fn ready(socket_type: &str) -> Vec<u8> {
    let mut props = Vec::new();
    props.push(b"Socket-Type".len() as u8);
    props.extend_from_slice(b"Socket-Type");
    props.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    props.extend_from_slice(socket_type.as_bytes());
    command("READY", &props)
}

/// The value of `name` in a READY command's properties.
fn property<'a>(mut props: &'a [u8], name: &str) -> Result<Option<&'a [u8]>, ZmtpError> {
    while !props.is_empty() {
        let n = props[0] as usize;
        let key = props.get(1..1 + n).ok_or(ZmtpError::Malformed("READY"))?;
        let len_at = 1 + n;
        let len = props
            .get(len_at..len_at + 4)
            .ok_or(ZmtpError::Malformed("READY"))?;
        let len = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
        let value = props
            .get(len_at + 4..len_at + 4 + len)
            .ok_or(ZmtpError::Malformed("READY"))?;
        if key.eq_ignore_ascii_case(name.as_bytes()) {
            return Ok(Some(value));
        }
        props = &props[len_at + 4 + len..];
    }
    Ok(None)
}

/// A frame's header.
struct Header {
    flags: u8,
    len: u64,
}

async fn read_header<R: AsyncRead + Unpin>(r: &mut R) -> io::Result<Header> {
    let flags = r.read_u8().await?;
    let len = if flags & FLAG_LONG != 0 {
        r.read_u64().await?
    } else {
        u64::from(r.read_u8().await?)
    };
    Ok(Header { flags, len })
}

async fn read_exact_vec<R: AsyncRead + Unpin>(r: &mut R, len: u64) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    let read = (&mut *r).take(len).read_to_end(&mut buf).await?;
    if (read as u64) < len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(buf)
}

/// Reads and discards `len` bytes.
async fn skip<R: AsyncRead + Unpin>(r: &mut R, len: u64) -> io::Result<()> {
    let skipped = tokio::io::copy(&mut (&mut *r).take(len), &mut tokio::io::sink()).await?;
    if skipped < len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// The peer socket types a socket of ours talks to.
struct Pairing {
    ours: &'static str,
    theirs: &'static [&'static [u8]],
    /// What the peer should be, for the error.
    wanted: &'static str,
}

const SUB_OF_PUB: Pairing = Pairing {
    ours: "SUB",
    theirs: &[b"PUB", b"XPUB"],
    wanted: "a publisher",
};

const DEALER_OF_ROUTER: Pairing = Pairing {
    ours: "DEALER",
    theirs: &[b"ROUTER"],
    wanted: "a ROUTER (replay endpoint)",
};

/// Greets and exchanges READY as `pairing` says, within
/// `limits.handshake_timeout`.
async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    pairing: &Pairing,
    limits: Limits,
) -> Result<(), ZmtpError> {
    tokio::time::timeout(limits.handshake_timeout, greet(s, pairing))
        .await
        .map_err(|_| ZmtpError::Timeout)?
}

async fn greet<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    pairing: &Pairing,
) -> Result<(), ZmtpError> {
    s.write_all(&greeting()).await?;
    let mut peer = [0u8; 64];
    s.read_exact(&mut peer).await?;
    if peer[0] != SIGNATURE_FIRST || peer[9] != SIGNATURE_LAST {
        return Err(ZmtpError::Signature);
    }
    if peer[10] < 3 {
        return Err(ZmtpError::Version(peer[10], peer[11]));
    }
    let mechanism = &peer[12..32];
    let end = mechanism.iter().position(|&b| b == 0).unwrap_or(20);
    if &mechanism[..end] != b"NULL" {
        let name = String::from_utf8_lossy(&mechanism[..end]).into_owned();
        return Err(ZmtpError::Mechanism(name));
    }
    s.write_all(&ready(pairing.ours)).await?;
    let h = read_header(s).await?;
    if h.flags & FLAG_COMMAND == 0 || h.len > 4096 {
        return Err(ZmtpError::Malformed("READY"));
    }
    let body = read_exact_vec(s, h.len).await?;
    let name_len = *body.first().ok_or(ZmtpError::Malformed("READY"))? as usize;
    if body.get(1..1 + name_len) != Some(b"READY".as_slice()) {
        return Err(ZmtpError::Malformed("READY"));
    }
    let socket_type = property(&body[1 + name_len..], "Socket-Type")?.unwrap_or_default();
    if !pairing.theirs.contains(&socket_type) {
        let t = String::from_utf8_lossy(socket_type).into_owned();
        return Err(ZmtpError::SocketType(t, pairing.wanted));
    }
    Ok(())
}

/// Serves one publisher's connection: handshakes, then sends each complete
/// message (its frames) to `out` until the peer closes, `out` closes or the
/// stream breaks. Returns what was dropped on the way.
pub(crate) async fn serve_publisher<S>(
    mut stream: S,
    limits: Limits,
    out: mpsc::Sender<Vec<Vec<u8>>>,
) -> Result<Dropped, ZmtpError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    handshake(&mut stream, &SUB_OF_PUB, limits).await?;
    // Subscribe to everything: topics are checked per message.
    stream.write_all(&frame(0, &[0x01])).await?;
    stream.flush().await?;
    let mut dropped = Dropped::default();
    let mut frames: Vec<Vec<u8>> = Vec::new();
    // Set once a frame of this message broke a limit: the rest is skipped.
    let mut discarding: Option<fn(&mut Dropped)> = None;
    loop {
        let h = match read_header(&mut stream).await {
            Ok(h) => h,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(dropped),
            Err(e) => return Err(e.into()),
        };
        if h.flags & FLAG_COMMAND != 0 {
            // Commands after READY (heartbeats, errors): nothing to do.
            skip(&mut stream, h.len).await?;
            continue;
        }
        if discarding.is_none() && h.len > limits.max_frame_bytes {
            discarding = Some(|d| d.oversized += 1);
        }
        if discarding.is_none() && frames.len() == limits.max_frames {
            discarding = Some(|d| d.too_many_frames += 1);
        }
        if discarding.is_some() {
            skip(&mut stream, h.len).await?;
            frames.clear();
        } else {
            frames.push(read_exact_vec(&mut stream, h.len).await?);
        }
        if h.flags & FLAG_MORE == 0 {
            if let Some(count) = discarding.take() {
                count(&mut dropped);
            } else if out.send(std::mem::take(&mut frames)).await.is_err() {
                return Ok(dropped);
            }
        }
    }
}

/// How much one replay may return.
#[derive(Debug, Clone, Copy)]
pub struct ReplayBound {
    pub batches: usize,
    /// All frames together.
    pub bytes: usize,
}

/// vLLM's end-of-replay marker: a sequence number of -1.
const END_OF_REPLAY: [u8; 8] = [0xFF; 8];

/// Asks a replay endpoint (vLLM's ROUTER) on `stream` for every batch it
/// still buffers from sequence number `from` on, and returns each one's
/// frames (topic, sequence number, payload), oldest first.
///
/// The request is an empty delimiter and `from` (8 bytes, big-endian); each
/// batch comes back as `[delimiter, topic, seq, payload]`, and the end as
/// `[delimiter, "", -1, ""]`. Bounded as a publisher's connection is, and at
/// most `bound.batches` batches of `bound.bytes` bytes in all: a replay that
/// breaks a limit is an error, so a gap it cannot fill stays a gap.
pub async fn replay<S>(
    mut stream: S,
    from: u64,
    limits: Limits,
    bound: ReplayBound,
) -> Result<Vec<Vec<Vec<u8>>>, ZmtpError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    handshake(&mut stream, &DEALER_OF_ROUTER, limits).await?;
    stream.write_all(&frame(FLAG_MORE, b"")).await?;
    stream.write_all(&frame(0, &from.to_be_bytes())).await?;
    stream.flush().await?;
    let mut batches = Vec::new();
    let mut bytes = 0;
    loop {
        let message = read_message(&mut stream, limits).await?;
        bytes += message.iter().map(Vec::len).sum::<usize>();
        if bytes > bound.bytes {
            return Err(ZmtpError::Malformed("replay: too many bytes"));
        }
        match message.as_slice() {
            [delimiter, rest @ ..] if delimiter.is_empty() => match rest {
                [topic, seq, _] if topic.is_empty() && seq[..] == END_OF_REPLAY => {
                    return Ok(batches);
                }
                [_, _, _] if batches.len() < bound.batches => batches.push(rest.to_vec()),
                [_, _, _] => return Err(ZmtpError::Malformed("replay: too many batches")),
                _ => return Err(ZmtpError::Malformed("replay batch")),
            },
            _ => return Err(ZmtpError::Malformed("replay batch: no delimiter")),
        }
    }
}

/// One whole message: its frames, at most `limits.max_frames` + 1 (a
/// ROUTER's delimiter) of at most `limits.max_frame_bytes` each. Commands
/// between messages are skipped.
async fn read_message<S: AsyncRead + Unpin>(
    s: &mut S,
    limits: Limits,
) -> Result<Vec<Vec<u8>>, ZmtpError> {
    let mut frames = Vec::new();
    loop {
        let h = read_header(s).await?;
        if h.flags & FLAG_COMMAND != 0 {
            skip(s, h.len).await?;
            continue;
        }
        if h.len > limits.max_frame_bytes {
            return Err(ZmtpError::Malformed("oversized frame"));
        }
        if frames.len() > limits.max_frames {
            return Err(ZmtpError::Malformed("too many frames"));
        }
        frames.push(read_exact_vec(s, h.len).await?);
        if h.flags & FLAG_MORE == 0 {
            return Ok(frames);
        }
    }
}

#[cfg(test)]
mod tests {
    //! Protocol edges against a scripted peer; the real publishers
    //! (go-zeromq in llm-d-inference-sim, libzmq in vLLM) are exercised by
    //! the end-to-end tests.
    use super::*;
    use tokio::io::DuplexStream;

    fn peer_greeting(major: u8, mechanism: &[u8]) -> [u8; 64] {
        let mut g = [0u8; 64];
        g[0] = 0xFF;
        g[9] = 0x7F;
        g[10] = major;
        g[11] = 1;
        g[12..12 + mechanism.len()].copy_from_slice(mechanism);
        g
    }

    fn ready(socket_type: &[u8]) -> Vec<u8> {
        let mut props = vec![11];
        props.extend_from_slice(b"Socket-Type");
        props.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
        props.extend_from_slice(socket_type);
        command("READY", &props)
    }

    /// Starts `serve_publisher` on one end; returns the publisher's end
    /// (greeted, READY sent and the SUB's handshake consumed) and the
    /// messages.
    async fn connected(
        limits: Limits,
    ) -> (
        DuplexStream,
        mpsc::Receiver<Vec<Vec<u8>>>,
        tokio::task::JoinHandle<Result<Dropped, ZmtpError>>,
    ) {
        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        let (tx, rx) = mpsc::channel(4);
        let task = tokio::spawn(serve_publisher(ours, limits, tx));
        theirs.write_all(&peer_greeting(3, b"NULL")).await.unwrap();
        theirs.write_all(&ready(b"PUB")).await.unwrap();
        let mut g = [0u8; 64];
        theirs.read_exact(&mut g).await.unwrap();
        assert_eq!(
            (g[0], g[9], g[10], &g[12..16]),
            (0xFF, 0x7F, 3, b"NULL".as_slice())
        );
        let h = read_header(&mut theirs).await.unwrap();
        let body = read_exact_vec(&mut theirs, h.len).await.unwrap();
        assert_eq!(h.flags, 0b100);
        assert_eq!(&body[..6], b"\x05READY");
        assert_eq!(
            property(&body[6..], "socket-type").unwrap(),
            Some(b"SUB".as_slice())
        );
        let h = read_header(&mut theirs).await.unwrap();
        assert_eq!(
            read_exact_vec(&mut theirs, h.len).await.unwrap(),
            [0x01],
            "subscribe all"
        );
        (theirs, rx, task)
    }

    async fn send(to: &mut DuplexStream, frames: &[&[u8]]) {
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { 0b001 } else { 0 };
            to.write_all(&frame(more, f)).await.unwrap();
        }
    }

    #[tokio::test]
    async fn multipart_messages_arrive_whole_short_and_long_frames_alike() {
        let (mut pubr, mut rx, task) = connected(Limits::default()).await;
        let long = vec![7u8; 300];
        send(
            &mut pubr,
            &[b"kv@10.0.0.1@m", &[0, 0, 0, 0, 0, 0, 0, 1], &long],
        )
        .await;
        pubr.write_all(&command("PING", b"\0\0")).await.unwrap();
        send(&mut pubr, &[b"t", b"s", b"p"]).await;
        assert_eq!(
            rx.recv().await.unwrap(),
            [
                b"kv@10.0.0.1@m".to_vec(),
                vec![0, 0, 0, 0, 0, 0, 0, 1],
                long
            ]
        );
        assert_eq!(
            rx.recv().await.unwrap(),
            [b"t".to_vec(), b"s".to_vec(), b"p".to_vec()]
        );
        drop(pubr);
        assert_eq!(task.await.unwrap().unwrap(), Dropped::default());
    }

    #[tokio::test]
    async fn an_oversized_frame_is_skipped_unheld_and_its_message_dropped() {
        let limits = Limits {
            max_frame_bytes: 1_000,
            ..Limits::default()
        };
        let (mut pubr, mut rx, task) = connected(limits).await;
        send(&mut pubr, &[b"topic", &[0; 8], &vec![1u8; 5_000]]).await;
        send(&mut pubr, &[b"a", b"b", b"c", b"d"]).await;
        send(&mut pubr, &[b"next", &[0; 8], b"ok"]).await;
        assert_eq!(rx.recv().await.unwrap()[0], b"next");
        drop(pubr);
        let dropped = task.await.unwrap().unwrap();
        assert_eq!(
            dropped,
            Dropped {
                oversized: 1,
                too_many_frames: 1
            }
        );
    }

    #[tokio::test]
    async fn a_declared_length_of_2_to_the_64_costs_no_memory() {
        let (mut pubr, _rx, task) = connected(Limits::default()).await;
        let mut header = vec![0b010];
        header.extend_from_slice(&u64::MAX.to_be_bytes());
        pubr.write_all(&header).await.unwrap();
        pubr.write_all(&[0u8; 100]).await.unwrap();
        drop(pubr);
        // The skip runs out of input: the connection ends with an error.
        assert!(task.await.unwrap().is_err());
    }

    #[tokio::test]
    async fn peers_that_are_not_null_zmtp_3_publishers_are_refused() {
        let cases: [(&[u8; 64], &[u8], &str); 4] = [
            (
                &[0u8; 64],
                b"PUB",
                "not a ZMTP peer (bad greeting signature)",
            ),
            (
                &peer_greeting(2, b"NULL"),
                b"PUB",
                "ZMTP version 2.1 is not supported (3.0 or later)",
            ),
            (
                &peer_greeting(3, b"CURVE"),
                b"PUB",
                "security mechanism \"CURVE\" is not supported (NULL only)",
            ),
            (
                &peer_greeting(3, b"NULL"),
                b"PUSH",
                "the peer is a \"PUSH\" socket, not a publisher",
            ),
        ];
        for (greeting, socket_type, message) in cases {
            let (ours, mut theirs) = tokio::io::duplex(1 << 16);
            let (tx, _rx) = mpsc::channel(1);
            let task = tokio::spawn(serve_publisher(ours, Limits::default(), tx));
            theirs.write_all(greeting).await.unwrap();
            theirs.write_all(&ready(socket_type)).await.unwrap();
            let err = task.await.unwrap().unwrap_err();
            assert_eq!(err.to_string(), message);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_never_greets_times_out() {
        let (ours, _theirs) = tokio::io::duplex(1 << 16);
        let (tx, _rx) = mpsc::channel(1);
        let err = serve_publisher(ours, Limits::default(), tx)
            .await
            .unwrap_err();
        assert_eq!(err.to_string(), "handshake timed out");
    }

    /// A ROUTER's end of `replay`: greeted, READY exchanged, the request
    /// read; returns its stream and the requested sequence number.
    async fn router(theirs: &mut DuplexStream) -> u64 {
        theirs.write_all(&peer_greeting(3, b"NULL")).await.unwrap();
        theirs.write_all(&ready(b"ROUTER")).await.unwrap();
        let mut g = [0u8; 64];
        theirs.read_exact(&mut g).await.unwrap();
        let h = read_header(theirs).await.unwrap();
        let body = read_exact_vec(theirs, h.len).await.unwrap();
        assert_eq!(
            property(&body[6..], "Socket-Type").unwrap(),
            Some(b"DEALER".as_slice())
        );
        let request = read_message(theirs, Limits::default()).await.unwrap();
        assert_eq!(request[0], b"", "the delimiter");
        u64::from_be_bytes(request[1].as_slice().try_into().unwrap())
    }

    #[tokio::test]
    async fn a_replay_returns_the_batches_up_to_the_end_marker() {
        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        let bound = ReplayBound {
            batches: 10,
            bytes: 1 << 20,
        };
        let task = tokio::spawn(replay(ours, 5, Limits::default(), bound));
        assert_eq!(router(&mut theirs).await, 5);
        for seq in [5u64, 6] {
            send(
                &mut theirs,
                &[b"", b"kv@10.0.0.1@m", &seq.to_be_bytes(), b"p"],
            )
            .await;
        }
        send(&mut theirs, &[b"", b"", &[0xFF; 8], b""]).await;
        let batches = task.await.unwrap().unwrap();
        assert_eq!(
            batches,
            [5u64, 6].map(|seq| vec![
                b"kv@10.0.0.1@m".to_vec(),
                seq.to_be_bytes().to_vec(),
                b"p".to_vec()
            ])
        );
    }

    #[tokio::test]
    async fn a_replay_past_its_bounds_or_from_a_non_router_is_refused() {
        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        let one = ReplayBound {
            batches: 1,
            bytes: 1 << 20,
        };
        let task = tokio::spawn(replay(ours, 0, Limits::default(), one));
        router(&mut theirs).await;
        for seq in [0u64, 1] {
            send(&mut theirs, &[b"", b"t", &seq.to_be_bytes(), b"p"]).await;
        }
        let err = task.await.unwrap().unwrap_err();
        assert_eq!(err.to_string(), "malformed replay: too many batches");

        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        let small = ReplayBound {
            batches: 10,
            bytes: 1_000,
        };
        let task = tokio::spawn(replay(ours, 0, Limits::default(), small));
        router(&mut theirs).await;
        for seq in [0u64, 1] {
            send(&mut theirs, &[b"", b"t", &seq.to_be_bytes(), &[7; 600]]).await;
        }
        let err = task.await.unwrap().unwrap_err();
        assert_eq!(err.to_string(), "malformed replay: too many bytes");

        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        let task = tokio::spawn(replay(ours, 0, Limits::default(), one));
        theirs.write_all(&peer_greeting(3, b"NULL")).await.unwrap();
        theirs.write_all(&ready(b"PUB")).await.unwrap();
        let err = task.await.unwrap().unwrap_err();
        assert_eq!(
            err.to_string(),
            "the peer is a \"PUB\" socket, not a ROUTER (replay endpoint)"
        );
    }
}
