//! A front that makes a model server answer a streamed request as vLLM's
//! and SGLang's OpenAI servers do: status and headers at once, when the
//! request is admitted, and the events as the server sends them (the first
//! with the first token). llm-d-inference-sim sends its headers with its
//! first token, which is kinder to a picker that times a TTFT at the
//! headers; behind this front every contender meets the engines' timing.
//!
//! A whole (not streamed) answer, and every other request (`/metrics`,
//! `/v1/models`), passes through as the server gives it. A streamed request
//! the server refuses after all is answered, as vLLM does once its stream
//! has begun, with an `error` event and `[DONE]`.

use std::net::SocketAddr;

use anyhow::Context as _;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Response, StatusCode, Uri, header};
use futures::{StreamExt, TryStreamExt};
use serde_json::json;

/// The front, serving until stopped or dropped.
pub struct AdmissionFront {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl AdmissionFront {
    /// Stops listening, closes its connections once their answers are
    /// done, and returns when the address is free again.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for AdmissionFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone)]
struct Upstream {
    base: String,
    http: reqwest::Client,
    /// Added to a streamed answer's early headers: what the server would
    /// have said of itself (e.g. llm-d-inference-sim's `x-inference-pod`).
    own_headers: HeaderMap,
}

impl AdmissionFront {
    /// Listens on `listen` and forwards to the server at `upstream`.
    pub async fn start(
        listen: SocketAddr,
        upstream: SocketAddr,
        own_headers: &[(&str, &str)],
    ) -> anyhow::Result<AdmissionFront> {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("admission front on {listen}"))?;
        let addr = listener.local_addr()?;
        let mut headers = HeaderMap::new();
        for (k, v) in own_headers {
            headers.insert(HeaderName::try_from(*k)?, HeaderValue::try_from(*v)?);
        }
        let state = Upstream {
            base: format!("http://{upstream}"),
            http: reqwest::Client::builder().no_proxy().build()?,
            own_headers: headers,
        };
        let app = axum::Router::new().fallback(forward).with_state(state);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(AdmissionFront {
            addr,
            stop: Some(stop),
            task,
        })
    }
}

async fn forward(
    axum::extract::State(up): axum::extract::State<Upstream>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response<Body> {
    let streamed = method == Method::POST && asks_for_a_stream(&body);
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut request = up.http.request(method, format!("{}{path}", up.base));
    for (name, value) in &headers {
        if name != header::HOST && name != header::CONTENT_LENGTH {
            request = request.header(name, value);
        }
    }
    let answer = request.body(body).send();
    if !streamed {
        return match answer.await {
            Ok(answer) => whole(answer).await,
            Err(e) => bad_gateway(&e),
        };
    }
    // Headers now; the events when the server sends them.
    let events = futures::stream::once(answer).flat_map(|answer| match answer {
        Ok(answer) if answer.status().is_success() => {
            answer.bytes_stream().map_err(std::io::Error::other).boxed()
        }
        Ok(answer) => {
            let status = answer.status().as_u16();
            futures::stream::once(async move {
                let text = answer.text().await.unwrap_or_default();
                Ok(error_event(status, &text))
            })
            .boxed()
        }
        Err(e) => {
            futures::stream::once(async move { Ok(error_event(502, &e.to_string())) }).boxed()
        }
    });
    let mut response = Response::new(Body::from_stream(events));
    let out = response.headers_mut();
    out.clone_from(&up.own_headers);
    out.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    out.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// A JSON body with `"stream": true`.
fn asks_for_a_stream(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body)
        .is_ok_and(|v| v.get("stream") == Some(&serde_json::Value::Bool(true)))
}

async fn whole(answer: reqwest::Response) -> Response<Body> {
    let status = answer.status();
    let headers = answer.headers().clone();
    // A body cut short is the server's failure, not an empty answer.
    let body = match answer.bytes().await {
        Ok(body) => body,
        Err(e) => return bad_gateway(&e),
    };
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    for (name, value) in &headers {
        if name != header::TRANSFER_ENCODING && name != header::CONTENT_LENGTH {
            response.headers_mut().append(name, value.clone());
        }
    }
    response
}

fn bad_gateway(e: &reqwest::Error) -> Response<Body> {
    let mut response = Response::new(Body::from(e.to_string()));
    *response.status_mut() = StatusCode::BAD_GATEWAY;
    response
}

/// vLLM's error event in a stream already begun, then the end.
fn error_event(status: u16, message: &str) -> Bytes {
    let error = json!({ "error": { "message": message, "type": "server_error", "code": status } });
    Bytes::from(format!("data: {error}\n\ndata: [DONE]\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A server that sends its headers only with its first event, 500 ms
    /// after the request: the front's client has headers long before.
    async fn slow_first_token_server() -> SocketAddr {
        async fn answer(body: Bytes) -> Response<Body> {
            if !asks_for_a_stream(&body) {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let mut r = Response::new(Body::from(r#"{"whole":true}"#));
                r.headers_mut()
                    .insert("x-inference-pod", HeaderValue::from_static("sim-0"));
                return r;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            let events = futures::stream::iter([
                Ok::<_, std::io::Error>(Bytes::from_static(b"data: {\"n\":1}\n\n")),
                Ok(Bytes::from_static(b"data: [DONE]\n\n")),
            ]);
            Response::new(Body::from_stream(events))
        }
        async fn refuse() -> (StatusCode, &'static str) {
            (StatusCode::BAD_REQUEST, "too long")
        }
        let app = axum::Router::new()
            .route("/v1/chat/completions", axum::routing::post(answer))
            .route("/v1/refused", axum::routing::post(refuse));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    #[tokio::test]
    async fn a_streamed_answers_headers_come_at_once_and_its_events_when_sent() {
        let server = slow_first_token_server().await;
        let front = AdmissionFront::start(
            "127.0.0.1:0".parse().unwrap(),
            server,
            &[("x-inference-pod", "sim-0")],
        )
        .await
        .unwrap();
        let http = reqwest::Client::new();
        let url = |path: &str| format!("http://{}{path}", front.addr);
        let started = Instant::now();
        let mut answer = http
            .post(url("/v1/chat/completions"))
            .body(r#"{"stream":true}"#)
            .send()
            .await
            .unwrap();
        let headers_at = started.elapsed();
        assert_eq!(answer.status(), 200);
        assert_eq!(
            answer.headers()["content-type"],
            "text/event-stream; charset=utf-8"
        );
        assert_eq!(answer.headers()["x-inference-pod"], "sim-0");
        let first = answer.chunk().await.unwrap().unwrap();
        assert_eq!(&first[..], b"data: {\"n\":1}\n\n");
        let first_at = started.elapsed();
        assert!(first_at >= Duration::from_millis(500));
        assert!(
            first_at - headers_at >= Duration::from_millis(400),
            "headers at {headers_at:?}, first event at {first_at:?}"
        );
        assert_eq!(answer.text().await.unwrap(), "data: [DONE]\n\n");

        // A whole answer keeps the server's timing and headers.
        let started = Instant::now();
        let whole = http
            .post(url("/v1/chat/completions"))
            .body(r#"{"stream":false}"#)
            .send()
            .await
            .unwrap();
        assert!(started.elapsed() >= Duration::from_millis(500));
        assert_eq!(whole.headers()["x-inference-pod"], "sim-0");
        assert_eq!(whole.text().await.unwrap(), r#"{"whole":true}"#);

        // A refusal after the stream began: an error event, then the end.
        let refused = http
            .post(url("/v1/refused"))
            .body(r#"{"stream":true}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(refused.status(), 200);
        let text = refused.text().await.unwrap();
        assert!(text.starts_with("data: {\"error\":"), "{text}");
        assert!(text.contains("too long") && text.contains("400"), "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    }
}
