//! Precise prefix-cache routing's moving parts: the engines' KV-cache
//! events coming in, and prompts tokenized as the engines tokenize them.
//! What the events say is kept in `kv_cache`.
//!
//! - [`zmtp`]: the subscribing end of ZeroMQ's wire protocol, bounded.
//! - [`subscriber`]: the events port: connections, decoding, the Pod a
//!   topic names; `dial`: subscribing to each Pod's publisher; `stats`:
//!   the port's counters.
//! - [`tokenize`]: prompts as the engine tokenizes them
//!   (`kinference_tokenizer`), off the runtime and within a budget.
//! - [`mismatch`]: each answer's reported token counts against ours;
//!   [`precise`]: the tokenizer and that check, as the picker holds them.

mod dial;
pub mod mismatch;
pub mod precise;
mod stats;
pub mod subscriber;
pub mod tokenize;
pub mod zmtp;
