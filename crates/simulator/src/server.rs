//! Starting a simulated server, and the handle that controls it.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::config::SimConfig;
use crate::engine::SimStats;
use crate::metrics::MetricsMode;
use crate::routes::{Shared, router};

/// How long [`SimHandle::shutdown`] lets in-flight requests finish before it
/// kills the server.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Starts a simulated model server on `addr` (use `127.0.0.1:0` for a free
/// port) and returns once it is accepting connections.
///
/// The server runs on the current tokio runtime until [`SimHandle::shutdown`]
/// or [`SimHandle::kill`] is called or the handle is dropped.
///
/// # Errors
///
/// `InvalidInput` if the configuration fails [`SimConfig::validate`], or the
/// error from binding `addr`.
pub async fn spawn(config: SimConfig, addr: SocketAddr) -> io::Result<SimHandle> {
    config.validate()?;
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let shared = Arc::new(Shared::new(Arc::new(config)));
    let conns = Arc::new(Connections::default());
    let listener = TrackedListener {
        inner: listener,
        conns: Arc::clone(&conns),
    };
    let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
    let serve =
        axum::serve(listener, router(Arc::clone(&shared))).with_graceful_shutdown(async move {
            let _ = shutdown_rx.await;
        });
    let task = tokio::spawn(async move {
        if let Err(e) = serve.await {
            tracing::warn!(error = %e, "simulator server stopped with an error");
        }
    });
    tracing::debug!(%addr, name = %shared.cfg.name, "simulator started");
    Ok(SimHandle {
        addr,
        shared,
        conns,
        shutdown_tx: Mutex::new(Some(shutdown_tx)),
        task: Mutex::new(Some(task)),
    })
}

/// Controls one running simulated server. Dropping the handle kills the server.
pub struct SimHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    conns: Arc<Connections>,
    shutdown_tx: Mutex<Option<oneshot::Sender<()>>>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for SimHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimHandle")
            .field("name", &self.shared.cfg.name)
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl SimHandle {
    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`, without a trailing slash.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The server's name (`SimConfig::name`).
    pub fn name(&self) -> &str {
        &self.shared.cfg.name
    }

    /// The configuration the server runs with.
    pub fn config(&self) -> &SimConfig {
        &self.shared.cfg
    }

    /// Stops accepting connections, lets in-flight requests finish (at most
    /// 5 s, then the rest are killed) and waits for the server to stop.
    /// Idempotent.
    pub async fn shutdown(&self) {
        self.shared.stopping.send_replace(true);
        if let Some(tx) = lock(&self.shutdown_tx).take() {
            let _ = tx.send(());
        }
        let task = lock(&self.task).take();
        if let Some(mut task) = task
            && tokio::time::timeout(SHUTDOWN_GRACE, &mut task)
                .await
                .is_err()
        {
            task.abort();
            self.kill();
        }
    }

    /// Aborts the server immediately, like a dying pod: the listener closes
    /// (new connections are refused), open connections are torn down and
    /// in-flight requests fail. Idempotent; [`SimHandle::stats`] keeps working.
    pub fn kill(&self) {
        // Connections first: once they are marked dead no handler woken by the
        // engine's kill can still write a response.
        self.conns.kill_all();
        self.shared.stopping.send_replace(true);
        self.shared.engine.kill();
        lock(&self.shutdown_tx).take();
        if let Some(task) = lock(&self.task).take() {
            task.abort();
        }
    }

    /// Chooses how `GET /metrics` answers. Switching to
    /// [`MetricsMode::Frozen`] captures the current exposition, which is then
    /// served unchanged until the mode changes.
    pub fn set_metrics_mode(&self, mode: MetricsMode) {
        if mode == MetricsMode::Frozen {
            *lock(&self.shared.frozen_metrics) = self.shared.render_metrics();
        }
        self.shared.metrics_mode.send_replace(mode);
    }

    /// `false`: `GET /metrics` answers 503; `true`: live metrics again.
    pub fn set_metrics_available(&self, available: bool) {
        self.set_metrics_mode(if available {
            MetricsMode::Live
        } else {
            MetricsMode::Unavailable
        });
    }

    /// `true`: `GET /metrics` keeps returning the values of this moment
    /// (stale metrics); `false`: live metrics again.
    pub fn set_metrics_frozen(&self, frozen: bool) {
        self.set_metrics_mode(if frozen {
            MetricsMode::Frozen
        } else {
            MetricsMode::Live
        });
    }

    /// The current `GET /metrics` mode.
    pub fn metrics_mode(&self) -> MetricsMode {
        *self.shared.metrics_mode.borrow()
    }

    /// Makes every inference request (after authentication, parsing and the
    /// model check) fail with this HTTP status and an OpenAI error body;
    /// `None` restores normal service. Codes outside 100..=999 become 500.
    pub fn set_error_status(&self, status: Option<u16>) {
        let code = status.map_or(0, |s| StatusCode::from_u16(s).map_or(500, |s| s.as_u16()));
        self.shared.error_status.store(code, Ordering::Relaxed);
    }

    /// Credential headers (`authorization`, `x-api-key`, `api-key`,
    /// `proxy-authorization`, `cookie`) of the last 256 inference requests,
    /// as `name: value`, oldest first.
    pub fn credentials_seen(&self) -> Vec<String> {
        lock(&self.shared.credentials_seen)
            .iter()
            .cloned()
            .collect()
    }

    /// Counters of what the server has done so far, plus its current load.
    pub fn stats(&self) -> SimStats {
        self.shared.engine.stats()
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---------------------------------------------------------------- connection tracking

/// Open connections, so [`SimHandle::kill`] can tear them down. Each entry is
/// a duplicate of the socket's descriptor: shutting it down affects the
/// socket hyper owns and wakes its pending I/O.
#[derive(Default)]
struct Connections {
    killed: AtomicBool,
    next_id: AtomicU64,
    open: Mutex<HashMap<u64, std::net::TcpStream>>,
}

impl Connections {
    fn kill_all(&self) {
        self.killed.store(true, Ordering::SeqCst);
        for (_, socket) in lock(&self.open).drain() {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }

    fn is_killed(&self) -> bool {
        self.killed.load(Ordering::SeqCst)
    }

    /// Registers `stream`, returning its id, or `None` when it cannot be
    /// tracked (it is then closed) or the server is dead.
    fn register(&self, stream: TcpStream) -> Option<(u64, TcpStream)> {
        let std_stream = stream.into_std().ok()?;
        let clone = std_stream.try_clone().ok()?;
        let stream = TcpStream::from_std(std_stream).ok()?;
        let mut open = lock(&self.open);
        if self.is_killed() {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        open.insert(id, clone);
        Some((id, stream))
    }
}

struct TrackedListener {
    inner: TcpListener,
    conns: Arc<Connections>,
}

impl axum::serve::Listener for TrackedListener {
    type Io = TrackedStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    if let Some((id, inner)) = self.conns.register(stream) {
                        let conns = Arc::clone(&self.conns);
                        return (TrackedStream { inner, id, conns }, addr);
                    }
                }
                // Like axum's own listener: back off on errors such as EMFILE.
                Err(e) => {
                    tracing::debug!(error = %e, "simulator accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A connection that fails all I/O once the server is killed, and then
/// closes with a TCP reset.
struct TrackedStream {
    inner: TcpStream,
    id: u64,
    conns: Arc<Connections>,
}

impl TrackedStream {
    fn check(&mut self) -> io::Result<()> {
        if self.conns.is_killed() {
            // Close with RST rather than FIN when hyper drops the stream.
            let _ = self.inner.set_zero_linger();
            return Err(io::ErrorKind::ConnectionReset.into());
        }
        Ok(())
    }
}

impl Drop for TrackedStream {
    fn drop(&mut self) {
        lock(&self.conns.open).remove(&self.id);
    }
}

impl AsyncRead for TrackedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.check()?;
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for TrackedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.check()?;
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check()?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check()?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.check()?;
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
