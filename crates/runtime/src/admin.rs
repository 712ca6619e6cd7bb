//! The admin HTTP server both binaries run: `/metrics`, `/healthz`,
//! `/readyz` (and whatever else a binary adds to its router).
//!
//! What is shared is how it is bound and served; each binary keeps its own
//! router, since their state and routes differ (the EPP's `/readyz` explains
//! itself and it also serves `/debug/*`).

use std::future::Future;
use std::net::SocketAddr;

use axum::Router;
use tokio::net::TcpListener;

/// Binds `addr`, naming it in the error.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|e| {
        std::io::Error::new(e.kind(), format!("binding the admin server on {addr}: {e}"))
    })
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets
/// in-flight requests finish.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving the admin HTTP server");
    }
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn serves_until_shutdown() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route(
                "/readyz",
                get(|| async { (StatusCode::SERVICE_UNAVAILABLE, "discovery down") }),
            );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, router, async {
            let _ = stopped.await;
        }));
        let get = |path: &'static str| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(
                format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await
            .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        assert!(get("/healthz").await.starts_with("HTTP/1.1 200"));
        let ready = get("/readyz").await;
        assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
        assert!(ready.ends_with("discovery down"), "{ready}");
        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn bind_errors_name_the_address() {
        let taken = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = taken.local_addr().unwrap();
        let error = bind(addr).await.unwrap_err();
        assert!(error.to_string().contains(&addr.to_string()), "{error}");
    }
}
