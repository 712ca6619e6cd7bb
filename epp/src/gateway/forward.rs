//! Applying the EPP's outcome: choosing the upstream, sending the request
//! (with fallback over the EPP's list), streaming the response back and
//! reporting status, served endpoint and TTFT on the ext_proc stream.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use super::{Destination, Inner, RequestRecord, SERVED_BY_HEADER, error_response};
use crate::client::{Outcome, Stream};
use crate::extproc::{DESTINATION_ENDPOINT, MODEL_HEADER, RULE_HEADER};

/// A routed request on its way upstream.
pub(super) struct Job {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub outcome: Outcome,
    pub stream: Stream,
    pub arrived: Instant,
    pub record: RequestRecord,
}

/// Hop-by-hop headers and those the gateway recomputes.
pub(super) fn skip_request_header(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

fn skip_response_header(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "content-length"
    )
}

/// The client's headers with the EPP's mutation applied.
pub(super) fn upstream_headers(client: &HeaderMap, outcome: &Outcome) -> HeaderMap {
    let mut out = HeaderMap::new();
    for (name, value) in client {
        if !skip_request_header(name.as_str()) {
            out.append(name.clone(), value.clone());
        }
    }
    for name in &outcome.removed_headers {
        if let Ok(name) = HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()) {
            out.remove(name);
        }
    }
    for (name, value) in &outcome.set_headers {
        if name.starts_with(':') || skip_request_header(name) {
            continue;
        }
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()),
            HeaderValue::from_str(value),
        ) {
            out.insert(n, v);
        }
    }
    out
}

/// Where the EPP sent the request.
#[derive(Debug, PartialEq)]
enum Target {
    Provider {
        name: String,
        url: String,
    },
    /// `ip:port` list: the choice, then the fallbacks.
    Local(Vec<String>),
}

fn resolve(
    providers: &std::collections::BTreeMap<String, String>,
    outcome: &Outcome,
    path: &str,
) -> Result<Target, (u16, String)> {
    if let Some(dest) = outcome.set_headers.get(kinference_api::DESTINATION_HEADER) {
        let name = dest.strip_prefix("provider/").unwrap_or(dest).to_string();
        return match providers.get(&name) {
            Some(base) => Ok(Target::Provider {
                url: provider_url(base, path),
                name,
            }),
            None => Err((
                502,
                format!("the gateway has no route to provider {name:?}"),
            )),
        };
    }
    let list = outcome
        .set_headers
        .get(DESTINATION_ENDPOINT)
        .or_else(|| outcome.lb_metadata.get(DESTINATION_ENDPOINT));
    let addrs: Vec<String> = list
        .map(|l| {
            l.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    if addrs.is_empty() {
        return Err((503, "the endpoint picker chose no destination".to_string()));
    }
    Ok(Target::Local(addrs))
}

/// `base` + `path`; a base ending in `/v1` absorbs the path's `/v1`.
pub(super) fn provider_url(base: &str, path: &str) -> String {
    let base = base.trim_end_matches('/');
    match path.strip_prefix("/v1") {
        Some(rest)
            if base.ends_with("/v1") && (rest.is_empty() || rest.starts_with(['/', '?'])) =>
        {
            format!("{base}{rest}")
        }
        _ => format!("{base}{path}"),
    }
}

/// What the response path reports: status, the endpoint that served, the
/// TTFT in ms.
type ResponseReport = (u16, Option<String>, Option<f64>);

/// Sends the ext_proc response-path messages off the data path: the client's
/// bytes never wait for the EPP.
struct Reporter {
    headers: Option<oneshot::Sender<ResponseReport>>,
    end: Option<oneshot::Sender<bool>>,
}

impl Reporter {
    fn spawn(mut stream: Stream) -> Self {
        let (headers_tx, headers_rx) = oneshot::channel::<ResponseReport>();
        let (end_tx, end_rx) = oneshot::channel::<bool>();
        tokio::spawn(async move {
            let Ok((status, served, ttft_ms)) = headers_rx.await else {
                return;
            };
            if let Err(e) = stream
                .response_headers(status, served.as_deref(), ttft_ms)
                .await
            {
                tracing::debug!(error = %e, "reporting response headers to the EPP failed");
                return;
            }
            // A completed response ends the stream as Envoy does (last body
            // chunk); a broken one just closes it.
            if let Ok(true) = end_rx.await {
                let _ = stream.finish().await;
            }
        });
        Reporter {
            headers: Some(headers_tx),
            end: Some(end_tx),
        }
    }

    fn headers(&mut self, status: u16, served: Option<String>, ttft: Option<Duration>) {
        if let Some(tx) = self.headers.take() {
            let _ = tx.send((status, served, ttft.map(|d| d.as_secs_f64() * 1000.0)));
        }
    }

    fn end(mut self, completed: bool) {
        if let Some(tx) = self.end.take() {
            let _ = tx.send(completed);
        }
    }
}

pub(super) async fn forward(inner: Arc<Inner>, job: Job) -> Response {
    let Job {
        path,
        headers,
        body,
        outcome,
        stream,
        arrived,
        mut record,
    } = job;
    let mut reporter = Reporter::spawn(stream);
    let target = match resolve(&inner.config.providers, &outcome, &path) {
        Ok(t) => t,
        Err((status, message)) => {
            reporter.headers(status, None, None);
            reporter.end(false);
            record.error = Some(message.clone());
            return finish_early(
                &inner,
                record,
                error_response(status, "api_error", &message),
                arrived,
            );
        }
    };
    let attempts: Vec<(String, String)> = match &target {
        Target::Provider { name, url } => vec![(format!("provider/{name}"), url.clone())],
        Target::Local(addrs) => addrs
            .iter()
            .map(|a| (a.clone(), format!("http://{a}{path}")))
            .collect(),
    };
    let mut last_error = String::new();
    let mut answered = None;
    for (i, (served, url)) in attempts.iter().enumerate() {
        let sent = Instant::now();
        let result = inner
            .http
            .post(url)
            .headers(headers.clone())
            .body(body.clone())
            .send()
            .await;
        match result {
            Ok(resp) => {
                answered = Some((resp, served.clone(), i > 0, sent));
                break;
            }
            // Not connected: nothing was sent, the next endpoint may take it.
            Err(e) if e.is_connect() && matches!(target, Target::Local(_)) => {
                tracing::debug!(endpoint = %served, error = %e, "upstream refused; trying the next");
                last_error = format!("{served}: {e}");
            }
            Err(e) => {
                last_error = format!("{served}: {e}");
                break;
            }
        }
    }
    let Some((resp, served, fallback, sent)) = answered else {
        reporter.headers(502, None, None);
        reporter.end(false);
        record.error = Some(last_error);
        let resp = error_response(502, "api_error", "the upstream is unreachable");
        return finish_early(&inner, record, resp, arrived);
    };
    record.destination = match &target {
        Target::Provider { name, .. } => Destination::Provider(name.clone()),
        Target::Local(_) => Destination::Local {
            endpoint: served.clone(),
            fallback,
        },
    };
    let status = resp.status();
    record.status = status.as_u16();
    let mut builder = Response::builder().status(status);
    if let Some(h) = builder.headers_mut() {
        for (name, value) in resp.headers() {
            if !skip_response_header(name.as_str()) {
                h.append(name.clone(), value.clone());
            }
        }
        let mut set = |name: &'static str, value: Option<&String>| {
            if let Some(v) = value.and_then(|v| HeaderValue::from_str(v).ok()) {
                h.insert(name, v);
            }
        };
        set(SERVED_BY_HEADER, Some(&served));
        set(RULE_HEADER, record.rule.as_ref());
        set(MODEL_HEADER, record.model.as_ref());
    }
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    let pump = Pump {
        inner: inner.clone(),
        resp,
        tx,
        reporter,
        record,
        served: (!served.starts_with("provider/")).then_some(served),
        arrived,
        sent,
    };
    tokio::spawn(pump.run());
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    builder
        .body(body)
        .unwrap_or_else(|_| error_response(502, "api_error", "bad upstream response"))
}

fn finish_early(
    inner: &Inner,
    mut record: RequestRecord,
    resp: Response,
    arrived: Instant,
) -> Response {
    record.status = resp.status().as_u16();
    record.total = arrived.elapsed();
    inner.emit(record);
    resp
}

/// Copies the upstream body to the client, timing the first byte.
struct Pump {
    inner: Arc<Inner>,
    resp: reqwest::Response,
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
    reporter: Reporter,
    record: RequestRecord,
    /// The local endpoint that served (`None` for providers: the metadata key
    /// names endpoints of the pool).
    served: Option<String>,
    arrived: Instant,
    sent: Instant,
}

impl Pump {
    async fn run(mut self) {
        let status = self.resp.status();
        let ok = status.is_success();
        let mut first = true;
        let mut completed = true;
        loop {
            match self.resp.chunk().await {
                Ok(Some(chunk)) => {
                    if chunk.is_empty() {
                        continue;
                    }
                    if first {
                        first = false;
                        self.first_byte(status, ok);
                    }
                    if self.tx.send(Ok(chunk)).await.is_err() {
                        self.record.error = Some("the client went away".into());
                        completed = false;
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    self.record.error = Some(format!("upstream body: {e}"));
                    completed = false;
                    let _ = self
                        .tx
                        .send(Err(std::io::Error::other(e.to_string())))
                        .await;
                    break;
                }
            }
        }
        if first {
            // An empty body: the first byte is the end.
            self.first_byte(status, ok);
        }
        self.reporter.end(completed);
        self.record.total = self.arrived.elapsed();
        self.inner.emit(self.record);
    }

    fn first_byte(&mut self, status: StatusCode, ok: bool) {
        let upstream = self.sent.elapsed();
        self.record.ttft = Some(self.arrived.elapsed());
        self.record.upstream_ttft = Some(upstream);
        // Only a successful response says anything about the endpoint's TTFT.
        self.reporter
            .headers(status.as_u16(), self.served.clone(), ok.then_some(upstream));
    }
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn provider_urls() {
        assert_eq!(
            provider_url("http://127.0.0.1:9/v1", "/v1/chat/completions"),
            "http://127.0.0.1:9/v1/chat/completions"
        );
        assert_eq!(
            provider_url("http://127.0.0.1:9/v1/", "/v1/chat/completions"),
            "http://127.0.0.1:9/v1/chat/completions"
        );
        assert_eq!(
            provider_url("http://127.0.0.1:9", "/v1/chat/completions"),
            "http://127.0.0.1:9/v1/chat/completions"
        );
        assert_eq!(
            provider_url("http://h/serving-endpoints", "/v1/chat/completions"),
            "http://h/serving-endpoints/v1/chat/completions"
        );
        assert_eq!(provider_url("http://h/v1", "/v1x"), "http://h/v1/v1x");
    }

    #[test]
    fn targets() {
        let mut o = Outcome::default();
        let providers = [("cloud".to_string(), "http://p/v1".to_string())].into();
        assert_eq!(
            resolve(&providers, &o, "/v1/completions").unwrap_err().0,
            503
        );
        o.lb_metadata
            .insert(DESTINATION_ENDPOINT.into(), "1.2.3.4:1, 1.2.3.4:2".into());
        assert_eq!(
            resolve(&providers, &o, "/v1/completions").unwrap(),
            Target::Local(vec!["1.2.3.4:1".into(), "1.2.3.4:2".into()])
        );
        o.set_headers.insert(
            kinference_api::DESTINATION_HEADER.into(),
            "provider/cloud".into(),
        );
        assert_eq!(
            resolve(&providers, &o, "/v1/completions").unwrap(),
            Target::Provider {
                name: "cloud".into(),
                url: "http://p/v1/completions".into()
            }
        );
        o.set_headers.insert(
            kinference_api::DESTINATION_HEADER.into(),
            "provider/other".into(),
        );
        assert_eq!(
            resolve(&providers, &o, "/v1/completions").unwrap_err().0,
            502
        );
    }

    #[test]
    fn mutation_applies_to_upstream_headers() {
        let mut client = HeaderMap::new();
        client.insert("authorization", HeaderValue::from_static("Bearer client"));
        client.insert(
            "x-kinference-destination",
            HeaderValue::from_static("provider/x"),
        );
        client.insert("content-length", HeaderValue::from_static("12"));
        client.insert("x-tenant", HeaderValue::from_static("a"));
        let mut o = Outcome::default();
        o.set_headers
            .insert("authorization".into(), "Bearer sk".into());
        o.set_headers.insert("content-length".into(), "99".into());
        o.removed_headers.push("x-kinference-destination".into());
        let h = upstream_headers(&client, &o);
        assert_eq!(h["authorization"], "Bearer sk");
        assert_eq!(h["x-tenant"], "a");
        assert!(h.get("content-length").is_none());
        assert!(h.get("x-kinference-destination").is_none());
    }
}
