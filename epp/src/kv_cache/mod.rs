//! What each engine's KV cache holds, as its KV-cache events say
//! (vLLM's `--kv-events-config`, llm-d-inference-sim's `--zmq-endpoint`),
//! and a prompt's blocks to look up in it. Data and indexes only: the
//! events arrive through `kv_events`.
//!
//! - [`wire`]: the events and both msgpack encodings engines publish.
//! - [`index`]: [`PodKvIndex`], one Pod's engines' blocks re-hashed into our
//!   own token chain, with sequence tracking and bounded memory.
//! - [`pool`]: which engines of the pool hold each block, for matching a
//!   prompt against every Pod in one walk.
//! - [`prompt`]: a tokenized prompt's chain per block size and adapter.

pub mod index;
pub mod pool;
pub mod prompt;
pub mod wire;

pub use index::PodKvIndex;
pub use index::{Applied, Freshness, IndexUse};
pub use prompt::PromptTokens;

/// Most blocks hashed per prompt, by either index. 4096 × 64 B = 256 KiB
/// covers the 220 KB prompts of the large-prompt workload. The cap bounds
/// the per-request work (hashing, recording, lookups) and the index entries
/// a single request can create, so one multi-megabyte prompt cannot flush
/// an endpoint's whole index or stall the request path; a longer shared
/// prefix simply saturates at the cap, which under-estimates the cached
/// tokens (the conservative direction).
pub(crate) const MAX_BLOCKS: usize = 4096;
