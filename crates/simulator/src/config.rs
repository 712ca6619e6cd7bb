//! Configuration of one simulated model server.

use std::io;
use std::time::Duration;

/// Everything that shapes how one simulated model server behaves.
///
/// All throughput and latency figures are in *simulated* time; every delay the
/// simulator actually waits is multiplied by [`SimConfig::time_scale`], and every
/// time it reports (headers, metrics, [`crate::SimStats`]) is the real, scaled
/// wall-clock time a client observes.
///
/// Build one with struct-update syntax:
///
/// ```
/// use kinference_simulator::SimConfig;
/// let cfg = SimConfig {
///     name: "pod-a".into(),
///     models: vec!["llama-8b".into()],
///     time_scale: 0.01,
///     ..SimConfig::default()
/// };
/// assert_eq!(cfg.max_concurrency, 8);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Server name, echoed in the `x-sim-server` response header.
    pub name: String,
    /// Base models served (`/v1/models`, request `model` field). Must not be empty.
    /// The first one is the "primary" model: pod-wide metrics carry its name.
    pub models: Vec<String>,
    /// LoRA adapters served on top of the primary model. A request naming one is
    /// accepted, listed in `vllm:lora_requests_info` and hashed separately in the
    /// prefix cache.
    pub lora_adapters: Vec<String>,
    /// Maximum number of distinct LoRA adapters in the running batch (vLLM
    /// `--max-loras`); a request for another adapter waits.
    pub max_lora: usize,
    /// Running slots (continuous-batching width). Further requests wait in a FIFO queue.
    pub max_concurrency: usize,
    /// Prefill speed for prompt tokens that are not in the prefix cache.
    pub prefill_tokens_per_sec: f64,
    /// Decode speed of one request (output tokens per second).
    pub decode_tokens_per_sec: f64,
    /// Fixed latency added to every prefill (scheduling, first forward pass), in ms.
    pub base_latency_ms: f64,
    /// Capacity of the LRU prefix cache, in blocks. `0` disables prefix caching.
    pub prefix_cache_blocks: usize,
    /// Size of one prefix block in characters of prompt text (64 chars ≈ 16 tokens).
    pub block_chars: usize,
    /// KV-cache capacity in tokens. A request reserves `prompt + max_tokens` tokens
    /// while running; a request that does not fit waits (unless nothing runs).
    pub kv_capacity_tokens: u64,
    /// Context window: `prompt_tokens + max_tokens` above this is a 400 error.
    /// `None` means unlimited.
    pub max_model_len: Option<u64>,
    /// Output tokens generated when the request sets no `max_tokens`.
    pub default_max_tokens: u32,
    /// Length of the vectors returned by `/v1/embeddings`.
    pub embedding_dims: usize,
    /// Largest accepted request body; larger ones get a 413 error.
    pub max_body_bytes: usize,
    /// When set, `/v1/*` requires `Authorization: Bearer <key>` (401 otherwise).
    pub api_key: Option<String>,
    /// Multiplier applied to every simulated delay (`0.01` makes the server 100x
    /// faster than its nominal figures; `0` removes all delays).
    pub time_scale: f64,
    /// When a streamed answer's status and headers go out.
    pub stream_headers: StreamHeaders,
}

/// When a streamed (`"stream": true`) answer's status line and headers are
/// sent. A whole answer's always go with its body, after the last token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StreamHeaders {
    /// At admission, before queueing and prefill, as vLLM's and SGLang's
    /// OpenAI servers do (a FastAPI `StreamingResponse` sends them when the
    /// handler returns its generator); the first event follows with the
    /// first token. A Responses stream's `response.created` event goes out
    /// with the headers, as vLLM's does.
    #[default]
    Admission,
    /// With the first token, along with `x-sim-*` timing headers: kinder
    /// than the engines, for tests of the simulator's own timing.
    FirstToken,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            name: "sim".to_owned(),
            models: vec!["sim-model".to_owned()],
            lora_adapters: Vec::new(),
            max_lora: 4,
            max_concurrency: 8,
            prefill_tokens_per_sec: 10_000.0,
            decode_tokens_per_sec: 50.0,
            base_latency_ms: 10.0,
            prefix_cache_blocks: 8192,
            block_chars: 64,
            kv_capacity_tokens: 131_072,
            max_model_len: None,
            default_max_tokens: 16,
            embedding_dims: 32,
            max_body_bytes: 64 << 20,
            api_key: None,
            time_scale: 1.0,
            stream_headers: StreamHeaders::Admission,
        }
    }
}

impl SimConfig {
    /// A default configuration with the given server name and served models.
    pub fn new<I, S>(name: impl Into<String>, models: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            name: name.into(),
            models: models.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }

    /// Checks the invariants [`crate::spawn`] relies on.
    pub fn validate(&self) -> io::Result<()> {
        let invalid = |msg: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, msg.to_owned()));
        if self.models.is_empty() {
            return invalid("SimConfig.models must not be empty");
        }
        if self.max_concurrency == 0 {
            return invalid("SimConfig.max_concurrency must be at least 1");
        }
        if self.block_chars == 0 {
            return invalid("SimConfig.block_chars must be at least 1");
        }
        if !self.lora_adapters.is_empty() && self.max_lora == 0 {
            return invalid("SimConfig.max_lora must be at least 1 when lora_adapters are set");
        }
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(self.prefill_tokens_per_sec) || !positive(self.decode_tokens_per_sec) {
            return invalid("SimConfig token rates must be finite and positive");
        }
        let non_negative = |v: f64| v.is_finite() && v >= 0.0;
        if !non_negative(self.time_scale) || !non_negative(self.base_latency_ms) {
            return invalid("SimConfig.time_scale and base_latency_ms must be finite and >= 0");
        }
        Ok(())
    }

    /// Converts a simulated duration in seconds into the real delay to wait.
    pub(crate) fn scaled(&self, simulated_secs: f64) -> Duration {
        // Clamp so absurd inputs cannot panic `Duration::from_secs_f64`.
        let secs = (simulated_secs * self.time_scale).clamp(0.0, 86_400.0);
        Duration::from_secs_f64(if secs.is_nan() { 0.0 } else { secs })
    }

    /// The model whose name labels pod-wide metrics.
    pub(crate) fn primary_model(&self) -> &str {
        &self.models[0]
    }

    /// Prefix block size in (estimated) tokens, as reported in `vllm:cache_config_info`.
    pub(crate) fn block_tokens(&self) -> u64 {
        (self.block_chars as u64).div_ceil(4).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        SimConfig::default().validate().unwrap();
    }

    #[test]
    fn rejects_bad_values() {
        let bad = [
            SimConfig {
                models: vec![],
                ..SimConfig::default()
            },
            SimConfig {
                max_concurrency: 0,
                ..SimConfig::default()
            },
            SimConfig {
                block_chars: 0,
                ..SimConfig::default()
            },
            SimConfig {
                prefill_tokens_per_sec: 0.0,
                ..SimConfig::default()
            },
            SimConfig {
                decode_tokens_per_sec: f64::NAN,
                ..SimConfig::default()
            },
            SimConfig {
                time_scale: -1.0,
                ..SimConfig::default()
            },
            SimConfig {
                lora_adapters: vec!["a".into()],
                max_lora: 0,
                ..SimConfig::default()
            },
        ];
        for cfg in bad {
            assert_eq!(
                cfg.validate().unwrap_err().kind(),
                io::ErrorKind::InvalidInput
            );
        }
    }

    #[test]
    fn scaling() {
        let cfg = SimConfig {
            time_scale: 0.5,
            ..SimConfig::default()
        };
        assert_eq!(cfg.scaled(2.0), Duration::from_secs(1));
        assert_eq!(cfg.scaled(-3.0), Duration::ZERO);
        assert_eq!(cfg.scaled(f64::INFINITY), Duration::from_secs(86_400));
    }
}
