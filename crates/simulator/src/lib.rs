#![forbid(unsafe_code)]
//! An OpenAI-compatible model-server simulator over real HTTP.
//!
//! It stands in for vLLM pods (and for a paid OpenAI-compatible provider) in
//! the EPP's integration tests, benchmarks and `kinference demo`, and behaves
//! like a real server so routing quality can be measured:
//!
//! - requests wait in a FIFO queue for one of `max_concurrency` running slots
//!   (and for room in the KV cache, and for a LoRA slot if they name an adapter);
//! - the prompt (≈ 4 characters per token) is split into blocks of
//!   `block_chars` characters hashed cumulatively; leading blocks found in the
//!   server's LRU prefix cache skip prefill;
//! - time to first token = queue wait + base latency + uncached tokens /
//!   prefill speed; output tokens then arrive at the decode speed;
//! - `/metrics` exposes vLLM metric names whose values follow the load.
//!
//! Endpoints: `POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
//! `/v1/responses` (`"stream": true` gives SSE `data: {...}` frames ending with
//! `data: [DONE]`), `GET /v1/models`, `GET /metrics`, `GET /health`.
//! Every response carries `x-sim-server: <name>`; inference responses also
//! carry `x-sim-ttft-ms`, `x-sim-queue-ms`, `x-sim-prefill-ms`,
//! `x-sim-prompt-tokens` and `x-sim-cached-tokens` (real, scaled times).
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use kinference_simulator::{SimConfig, spawn};
//! let sim = spawn(
//!     SimConfig { time_scale: 0.01, ..SimConfig::new("pod-a", ["llama-8b"]) },
//!     "127.0.0.1:0".parse().unwrap(),
//! )
//! .await?;
//! println!("serving on {}", sim.base_url());
//! sim.shutdown().await;
//! # Ok(()) }
//! ```

mod cache;
mod config;
mod engine;
mod histogram;
mod metrics;
mod openai;
mod routes;
mod server;

pub use config::{SimConfig, StreamHeaders};
pub use engine::SimStats;
pub use metrics::MetricsMode;
pub use server::{SimHandle, spawn};
