//! Per-request estimators of the endpoint picker. All are synchronous, cost
//! microseconds on the request path, are bounded in memory and are shared
//! between request tasks (`&self` methods, internal locking).
//!
//! - [`prefix`]: chained block hashes of the prompt ([`block_hashes`]) and a
//!   destination's [`PrefixCache`] of the prefixes it recently received, giving
//!   the `CachedPrefixTokens` estimate (cached blocks × tokens per block).
//! - [`ttft`]: [`TtftPredictor`], a linear TTFT model over queue, running
//!   requests, uncached prompt tokens and KV utilization, global and per
//!   endpoint ([`EndpointTtft`]), calibrated online from observed TTFTs
//!   (`PredictedTTFT`).
//! - [`stats`]: [`DestStats`], time-decayed `ObservedTTFT` and `ErrorRate`,
//!   in-flight `RunningRequests` guards, load reserved between scrapes and a
//!   circuit breaker, for local endpoints and providers alike.
//! - [`routed`]: [`RoutedPrefixes`], the prompts a destination was sent in
//!   the last seconds, which its KV events have not reported yet.
//! - [`reuse`]: how many recent requests share the prefix a candidate
//!   lacks, and its prefill divided among them (`PredictedTTFT` of a group's
//!   next replica).
//! - [`sample`]: [`TtftSample`], one served request's TTFT, learnt by the
//!   model once the engine has said how much of the prompt it had cached.
//! - [`token_ratio`]: [`TokenRatio`], the engine's tokens per estimated
//!   token, which sizes the prefix cache like the engine's KV cache.
//! - [`destination`]: [`DestinationState`], all of the above for one
//!   destination, owned by the destination itself.

pub mod destination;
pub mod prefix;
pub mod reuse;
pub mod routed;
pub mod sample;
pub mod stats;
pub mod token_ratio;
pub mod ttft;

pub use destination::{DestinationConfig, DestinationState};
pub(crate) use prefix::MAX_BLOCKS;
pub use prefix::{DEFAULT_BLOCK_CHARS, DEFAULT_BLOCKS_PER_ENDPOINT, PrefixCache, block_hashes};
pub use routed::RoutedPrefixes;
pub use sample::Decided;
pub(crate) use sample::TtftSample;
pub use stats::DestStats;
pub use stats::InflightGuard;
pub use stats::StatsConfig;
pub use stats::{DestSnapshot, Outcome};
pub use token_ratio::TokenRatio;
pub use ttft::{EndpointTtft, TtftCoefficients, TtftConfig};
pub use ttft::{TtftFeatures, TtftPredictor};
