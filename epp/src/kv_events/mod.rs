//! Precise prefix-cache routing: what each engine really holds, from the
//! KV-cache events it publishes (vLLM's `--kv-events-config`,
//! llm-d-inference-sim's `--zmq-endpoint`).
//!
//! - [`wire`]: the ZMQ messages and both msgpack encodings of the events.
//! - [`index`]: [`PodKvIndex`], one Pod's engines' blocks re-hashed into our
//!   own token chain, with sequence tracking and bounded memory.

pub mod index;
pub mod wire;

pub use index::{Applied, Freshness, PodKvIndex, chain_root, token_chain};
