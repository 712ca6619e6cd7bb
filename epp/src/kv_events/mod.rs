//! Precise prefix-cache routing: what each engine really holds, from the
//! KV-cache events it publishes (vLLM's `--kv-events-config`,
//! llm-d-inference-sim's `--zmq-endpoint`).
//!
//! - [`wire`]: the ZMQ messages and both msgpack encodings of the events.
//! - [`zmtp`]: the subscribing end of ZeroMQ's wire protocol, bounded.
//! - [`subscriber`]: the events port: connections, decoding, the Pod a
//!   topic names, counters.
//! - [`tokenize`]: prompts as the engine tokenizes them, off the runtime
//!   and within a budget; [`hf`]: the model's own tokenizer and template.
//! - [`mismatch`]: each answer's reported token counts against ours;
//!   [`precise`]: the tokenizer and that check, as the picker holds them.
//! - [`pool`]: which engines of the pool hold each block, for matching a
//!   prompt against every Pod in one walk.
//! - [`index`]: [`PodKvIndex`], one Pod's engines' blocks re-hashed into our
//!   own token chain, with sequence tracking and bounded memory.

mod dial;
pub mod hf;
pub mod index;
pub mod mismatch;
pub mod pool;
pub mod precise;
pub mod subscriber;
pub mod tokenize;
mod tokenize_pool;
pub mod wire;
pub mod zmtp;

pub use index::{Applied, Freshness, IndexUse, PodKvIndex, chain_root, token_chain};
