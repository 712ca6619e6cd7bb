//! One served request's TTFT, held until its answer says what the engine
//! really had cached.
//!
//! The TTFT model learns from the features a prediction was made from and
//! the TTFT that followed. Of those features the one that matters most, how
//! much of the prompt the Pod already holds, is the prefix index's guess,
//! and the guess is wrong whenever the index is: the approximate index does
//! not see evictions, and both indexes trail prompts still in flight. A
//! mislabelled sample teaches the model that a 6,000-token prefill costs a
//! cached prompt's TTFT, or the reverse; at saturation enough of them pushed
//! the prefill cost to its floor, an idle Pod without a group's prefix then
//! looked as fast as the busy one holding it, and groups were scattered.
//!
//! The engine reports the truth (`usage.prompt_tokens_details.cached_tokens`)
//! at the end of its answer, after the first byte. So the sample waits: it
//! is learnt once, when the count comes or when dropped, with the engine's
//! count if one came and was further from the guess than the two blocks'
//! tails explain (see [`TtftSample::engine_reported`]), and with the guess
//! otherwise (an engine that reports none, a client that went away). A
//! stream that will not report (one that did not ask,
//! `stream_options.include_usage`, to an engine that reports only when
//! asked) is learnt at its first byte: waiting for its end, often many
//! seconds later, would only keep the model behind.
//!
//! Each sample learnt is also a debug line under its own target,
//! [`SAMPLE_LOG_TARGET`]: the endpoint, the TTFT predicted at the decision,
//! the TTFT observed, the inputs learnt with and the uncached count the
//! decision guessed, numbers only. It is how one judges what the model's
//! inputs can explain on a given machine: the side-by-side benchmark fits
//! them in hindsight (`crates/testbed/src/ttft_fit.rs`).

use std::sync::Arc;

use super::{DestinationState, TtftFeatures, TtftPredictor};

/// The target of the per-sample debug line:
/// `RUST_LOG=info,kinference_epp::ttft_samples=debug` turns it on.
pub(crate) const SAMPLE_LOG_TARGET: &str = "kinference_epp::ttft_samples";

pub(crate) struct TtftSample {
    model: Arc<TtftPredictor>,
    state: Arc<DestinationState>,
    features: TtftFeatures,
    /// Observed TTFT, seconds.
    ttft: f64,
    decided: Decided,
    /// The uncached tokens the decision guessed, before the engine's count
    /// replaced them.
    guessed_uncached: f64,
}

/// The decision a sample comes from, for its debug line.
#[derive(Debug, Default)]
pub struct Decided {
    /// The endpoint's `ip:port`.
    pub endpoint: Option<String>,
    /// The TTFT predicted for it, seconds.
    pub predicted: Option<f64>,
}

impl TtftSample {
    pub fn new(
        model: Arc<TtftPredictor>,
        state: Arc<DestinationState>,
        features: TtftFeatures,
        ttft: f64,
        decided: Decided,
    ) -> Self {
        Self {
            model,
            state,
            guessed_uncached: features.uncached_tokens,
            features,
            ttft,
            decided,
        }
    }

    /// The engine served `engine_cached` of its `engine_prompt` tokens from
    /// its cache, in blocks of `engine_block` tokens if known. The features
    /// count in the decision's unit (`prompt` long: estimated tokens, or the
    /// tokenizer's in precise mode), so the engine's count enters as a share
    /// of the prompt. `index_block` is a block of the index that guessed, in
    /// that unit.
    ///
    /// A count within one engine block and one index block of the guess
    /// keeps the guess. They then differ only in where each one's last whole
    /// block ends: the engine prefills the 1 to `engine_block` tokens past
    /// its own, which the estimate, cutting the prompt's bytes into blocks
    /// of its own, cannot know. Learnt with the engine's tail and predicted
    /// with the estimate's, the model put three quarters of the benchmark's
    /// predictions too low; learnt with the guess, its base carries the
    /// tail's mean.
    pub(crate) fn engine_reported(
        &mut self,
        prompt: f64,
        engine_prompt: u64,
        engine_cached: u64,
        engine_block: Option<u32>,
        index_block: f64,
    ) {
        if engine_prompt == 0 || !(prompt.is_finite() && prompt >= 0.0) {
            return;
        }
        let per_engine_token = prompt / engine_prompt as f64;
        let uncached = engine_prompt.saturating_sub(engine_cached) as f64 * per_engine_token;
        let within_the_tails = engine_block.is_some_and(|b| {
            let tails = f64::from(b) * per_engine_token + index_block.max(0.0);
            (uncached - self.features.uncached_tokens).abs() <= tails
        });
        if !within_the_tails {
            self.features.uncached_tokens = uncached;
        }
    }

    /// Learns it now, with the index's guess: the answer will not say.
    pub fn learn(self) {
        drop(self);
    }

    /// The features the model will learn from.
    #[cfg(test)]
    fn features(&self) -> &TtftFeatures {
        &self.features
    }
}

impl Drop for TtftSample {
    fn drop(&mut self) {
        self.model
            .observe(&self.state.ttft, &self.features, self.ttft);
        let (f, decided) = (&self.features, &self.decided);
        tracing::debug!(
            target: SAMPLE_LOG_TARGET,
            endpoint = decided.endpoint.as_deref(),
            predicted_ms = decided.predicted.map(|s| s * 1e3),
            observed_ms = self.ttft * 1e3,
            waiting = f.waiting,
            running = f.running,
            uncached_tokens = f.uncached_tokens,
            guessed_uncached_tokens = self.guessed_uncached,
            kv_utilization = f.kv_utilization,
            "TTFT sample learnt"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::predict::DestinationConfig;

    fn sample(model: &Arc<TtftPredictor>, state: &Arc<DestinationState>) -> TtftSample {
        // Guessed fully cached: 2,000 tokens, all of them in the index.
        let features = TtftFeatures::new(0.0, 0.0, 2000.0, 2000.0, 0.0);
        TtftSample::new(
            Arc::clone(model),
            Arc::clone(state),
            features,
            0.8,
            Decided::default(),
        )
    }

    #[test]
    fn the_engines_count_replaces_the_guess() {
        let model = Arc::new(TtftPredictor::new(Default::default()));
        let state = DestinationState::new(&DestinationConfig::default());
        let mut s = sample(&model, &state);
        // The engine had a quarter of its 1,000 tokens: three quarters of
        // the decision's 2,000 were prefilled.
        s.engine_reported(2000.0, 1000, 250, Some(16), 16.0);
        assert_eq!(s.features().uncached_tokens, 1500.0);
        // More cached than prompt is read as all of it.
        s.engine_reported(2000.0, 1000, 4000, None, 16.0);
        assert_eq!(s.features().uncached_tokens, 0.0);
        // No prompt count: the guess stays.
        let mut guessed = sample(&model, &state);
        guessed.engine_reported(2000.0, 0, 0, Some(16), 16.0);
        assert_eq!(guessed.features().uncached_tokens, 0.0);
    }

    #[test]
    fn a_count_within_the_blocks_tails_of_the_guess_keeps_the_guess() {
        let model = Arc::new(TtftPredictor::new(Default::default()));
        let state = DestinationState::new(&DestinationConfig::default());
        let reported = |engine_cached: u64, engine_block: Option<u32>, index_block: f64| {
            // Guessed fully cached: 2,000 tokens, all of them in the index.
            let mut s = sample(&model, &state);
            s.engine_reported(2000.0, 1000, engine_cached, engine_block, index_block);
            s.features().uncached_tokens
        };
        // The engine prefilled its last 16 tokens, a whole block of 16 (32
        // of the decision's), exactly as far as its tail may reach: kept.
        assert_eq!(reported(984, Some(16), 0.0), 0.0);
        // 17 tokens (34): more than its tail, unless the index's own block
        // (16 of the decision's) explains the rest.
        assert_eq!(reported(983, Some(16), 0.0), 34.0);
        assert_eq!(reported(983, Some(16), 16.0), 0.0);
        // An engine with two tokens per estimated one (CJK text): its block
        // of 16 is 8 of the decision's, and the index's 16 still count.
        let mut fine = sample(&model, &state);
        fine.engine_reported(1000.0, 2000, 1990, Some(16), 16.0);
        assert_eq!(fine.features().uncached_tokens, 0.0);
        // No block size known: the engine's count.
        assert_eq!(reported(990, None, 16.0), 20.0);
    }

    #[test]
    fn a_sample_is_learnt_once_when_dropped() {
        let model = Arc::new(TtftPredictor::new(Default::default()));
        let state = DestinationState::new(&DestinationConfig::default());
        let s = sample(&model, &state);
        assert_eq!(model.observations(&state.ttft), 0);
        drop(s);
        assert_eq!(model.observations(&state.ttft), 1);
    }
}
