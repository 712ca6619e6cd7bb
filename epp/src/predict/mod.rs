//! Per-request estimators of the endpoint picker. All are synchronous, cost
//! microseconds on the request path, are bounded in memory and are shared
//! between request tasks (`&self` methods, internal locking).
//!
//! - [`prefix`]: chained block hashes of the prompt ([`block_hashes`]) and a
//!   [`PrefixIndex`] of which endpoint recently received which prefix, giving
//!   the `CachedPrefixTokens` estimate (cached blocks × tokens per block).
//! - [`ttft`]: [`TtftPredictor`], a per-endpoint linear TTFT model over queue,
//!   running requests, uncached prompt tokens and KV utilization, calibrated
//!   online from observed TTFTs (`PredictedTTFT`).
//! - [`stats`]: [`DestinationStats`], time-decayed `ObservedTTFT` and
//!   `ErrorRate`, in-flight `RunningRequests` guards and a circuit breaker, for
//!   local endpoints and providers alike.
//!
//! Destinations are identified by [`EndpointKey`], a hash of the endpoint's
//! `ip:port` or of a provider name ([`EndpointKey::from_addr`]).

pub mod prefix;
pub mod stats;
mod sync;
pub mod ttft;

pub use prefix::{
    DEFAULT_BLOCK_CHARS, DEFAULT_BLOCKS_PER_ENDPOINT, DEFAULT_MAX_ENDPOINTS, EndpointKey,
    MAX_BLOCKS, PrefixIndex, block_hashes, block_hashes_bytes,
};
pub use stats::{DestSnapshot, DestinationStats, InflightGuard, Outcome, StatsConfig};
pub use ttft::{TtftCoefficients, TtftConfig, TtftFeatures, TtftPredictor};
