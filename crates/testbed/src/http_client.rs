//! An HTTP client for OpenAI-style load: POST a JSON body, read the whole
//! answer, and report which simulator served it and when its first body byte
//! came (for a streamed answer, the first token).

use std::time::{Duration, Instant};

use anyhow::bail;

/// A keep-alive HTTP/1.1 client with `TCP_NODELAY`; clone it freely.
#[derive(Clone, Debug)]
pub struct HttpClient {
    inner: reqwest::Client,
}

/// What one request came back with.
#[derive(Clone, Debug)]
pub struct Answer {
    /// The `x-sim-server` response header (`-` when absent).
    pub server: String,
    /// Send → first body byte.
    pub first_byte: Duration,
}

impl HttpClient {
    /// Up to `max_idle` idle connections per host; a request taking longer
    /// than `timeout` fails.
    pub fn new(max_idle: usize, timeout: Duration) -> anyhow::Result<HttpClient> {
        Ok(HttpClient {
            inner: reqwest::Client::builder()
                .pool_max_idle_per_host(max_idle)
                .tcp_nodelay(true)
                .timeout(timeout)
                .build()?,
        })
    }

    /// GETs `url`'s body as text (e.g. a `/metrics` page).
    pub async fn get_text(&self, url: &str) -> anyhow::Result<String> {
        let response = self.inner.get(url).send().await?;
        let status = response.status();
        let text = response.text().await?;
        if !status.is_success() {
            bail!("{url}: {status}");
        }
        Ok(text)
    }

    /// POSTs `body` as JSON to `url`; an answer that is not 2xx is an error
    /// carrying the start of its body.
    pub async fn post_json(&self, url: &str, body: Vec<u8>) -> anyhow::Result<Answer> {
        let started = Instant::now();
        let mut response = self
            .inner
            .post(url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await?;
        let status = response.status();
        let server = response
            .headers()
            .get("x-sim-server")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_string();
        let mut first_byte = None;
        let mut head = Vec::new();
        while let Some(chunk) = response.chunk().await? {
            first_byte.get_or_insert_with(|| started.elapsed());
            let room = 300usize.saturating_sub(head.len());
            head.extend_from_slice(&chunk[..chunk.len().min(room)]);
        }
        if !status.is_success() {
            bail!("{status}: {}", String::from_utf8_lossy(&head));
        }
        Ok(Answer {
            server,
            first_byte: first_byte.unwrap_or_else(|| started.elapsed()),
        })
    }
}
