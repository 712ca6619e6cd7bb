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
    /// Which simulator served it: our simulator's `x-sim-server` header, or
    /// llm-d-inference-sim's `x-inference-pod` (`-` when neither).
    pub server: String,
    /// Send → first body byte.
    pub first_byte: Duration,
    /// The answer's `usage`, when it has one (a streamed answer when asked
    /// with `stream_options.include_usage`).
    pub usage: Option<Usage>,
}

/// What a model server says it did with the prompt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens` (0 when absent).
    pub cached_tokens: u64,
}

/// The bytes kept from the end of an answer: its usage is in the last
/// event of a stream.
const TAIL: usize = 4096;

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
        self.post_json_with(url, body, &[]).await
    }

    /// [`HttpClient::post_json`] with these request headers too.
    pub async fn post_json_with(
        &self,
        url: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<Answer> {
        let started = Instant::now();
        let mut request = self
            .inner
            .post(url)
            .header("content-type", "application/json");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let mut response = request.body(body).send().await?;
        let status = response.status();
        let headers = response.headers();
        let server = ["x-sim-server", "x-inference-pod"]
            .iter()
            .find_map(|h| headers.get(*h)?.to_str().ok())
            .unwrap_or("-")
            .to_string();
        let mut first_byte = None;
        let mut head = Vec::new();
        let mut tail = Vec::new();
        while let Some(chunk) = response.chunk().await? {
            first_byte.get_or_insert_with(|| started.elapsed());
            let room = 300usize.saturating_sub(head.len());
            head.extend_from_slice(&chunk[..chunk.len().min(room)]);
            tail.extend_from_slice(&chunk);
            if tail.len() > 2 * TAIL {
                tail.drain(..tail.len() - TAIL);
            }
        }
        if !status.is_success() {
            bail!("{status}: {}", String::from_utf8_lossy(&head));
        }
        Ok(Answer {
            server,
            first_byte: first_byte.unwrap_or_else(|| started.elapsed()),
            usage: usage_in(&tail),
        })
    }
}

/// The `usage` of an answer from its last bytes: the whole JSON body, or
/// the last server-sent event that has one.
fn usage_in(tail: &[u8]) -> Option<Usage> {
    let text = String::from_utf8_lossy(tail);
    let whole = std::iter::once(text.trim());
    let events = text.lines().rev().filter_map(|l| l.strip_prefix("data:"));
    whole.chain(events).find_map(|json| {
        let value: serde_json::Value = serde_json::from_str(json.trim()).ok()?;
        let usage = value.get("usage")?;
        Some(Usage {
            prompt_tokens: usage.get("prompt_tokens")?.as_u64()?,
            cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_read_from_a_stream_or_a_whole_body() {
        let stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":640,\"completion_tokens\":16,\"prompt_tokens_details\":{\"cached_tokens\":624}}}\n\n\
data: [DONE]\n\n";
        let usage = Usage {
            prompt_tokens: 640,
            cached_tokens: 624,
        };
        assert_eq!(usage_in(stream), Some(usage));
        // The start of a long stream cut off: its last event still counts.
        assert_eq!(usage_in(&stream[10..]), Some(usage));
        let whole = br#"{"id":"x","usage":{"prompt_tokens":12,"completion_tokens":3}}"#;
        let usage = Usage {
            prompt_tokens: 12,
            cached_tokens: 0,
        };
        assert_eq!(usage_in(whole), Some(usage));
        assert_eq!(
            usage_in(b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n"),
            None
        );
    }
}
