//! Waiting for the signal to shut down: SIGTERM (the kubelet) or Ctrl-C.

use std::future::Future;

/// Installs the SIGTERM and Ctrl-C (SIGINT) handlers now and returns a
/// future resolving to the name of the first of them received.
///
/// A handler that cannot be installed is logged and left out: the other one
/// still works. If neither can be, that is logged as an error and the future
/// never resolves (the process then stops only by SIGKILL), rather than
/// shutting down at once or panicking.
///
/// Must be called inside a Tokio runtime.
pub fn shutdown_signal() -> impl Future<Output = &'static str> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let install = |kind: SignalKind, name: &'static str| match signal(kind) {
            Ok(s) => Some(s),
            Err(error) => {
                tracing::warn!(%error, signal = name, "cannot listen for {name}; ignoring it");
                None
            }
        };
        let term = install(SignalKind::terminate(), "SIGTERM");
        let int = install(SignalKind::interrupt(), "SIGINT");
        async move {
            let recv = |s: Option<tokio::signal::unix::Signal>, name: &'static str| async move {
                let mut s = s?;
                s.recv().await.map(|()| name)
            };
            let name = tokio::select! {
                Some(name) = recv(term, "SIGTERM") => name,
                Some(name) = recv(int, "SIGINT") => name,
                else => return never().await,
            };
            tracing::info!(signal = name, "shutdown requested");
            name
        }
    }
    #[cfg(not(unix))]
    {
        async move {
            match tokio::signal::ctrl_c().await {
                Ok(()) => {
                    tracing::info!(signal = "Ctrl-C", "shutdown requested");
                    "Ctrl-C"
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot listen for Ctrl-C");
                    never().await
                }
            }
        }
    }
}

async fn never() -> &'static str {
    tracing::error!("no shutdown signal can be received; the process stops only when killed");
    std::future::pending().await
}
