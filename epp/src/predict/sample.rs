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
//! count if one came and with the guess otherwise (an engine that reports
//! none, a client that went away). A stream that will not report (one that
//! did not ask, `stream_options.include_usage`, to an engine that reports
//! only when asked) is learnt at its first byte: waiting for its end, often
//! many seconds later, would only keep the model behind.

use std::sync::Arc;

use super::{DestinationState, TtftFeatures, TtftPredictor};

pub struct TtftSample {
    model: Arc<TtftPredictor>,
    state: Arc<DestinationState>,
    features: TtftFeatures,
    /// Observed TTFT, seconds.
    ttft: f64,
}

impl TtftSample {
    pub fn new(
        model: Arc<TtftPredictor>,
        state: Arc<DestinationState>,
        features: TtftFeatures,
        ttft: f64,
    ) -> Self {
        Self {
            model,
            state,
            features,
            ttft,
        }
    }

    /// The engine served `engine_cached` of its `engine_prompt` tokens from
    /// its cache. The features count in the decision's unit (`prompt` long:
    /// estimated tokens, or the tokenizer's in precise mode), so the engine's
    /// count enters as a share of the prompt.
    pub fn engine_reported(&mut self, prompt: f64, engine_prompt: u64, engine_cached: u64) {
        if engine_prompt == 0 || !(prompt.is_finite() && prompt >= 0.0) {
            return;
        }
        let cached_share = engine_cached.min(engine_prompt) as f64 / engine_prompt as f64;
        self.features.uncached_tokens = prompt * (1.0 - cached_share);
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::predict::DestinationConfig;

    fn sample(model: &Arc<TtftPredictor>, state: &Arc<DestinationState>) -> TtftSample {
        // Guessed fully cached: 2,000 tokens, all of them in the index.
        let features = TtftFeatures::new(0.0, 0.0, 2000.0, 2000.0, 0.0);
        TtftSample::new(Arc::clone(model), Arc::clone(state), features, 0.8)
    }

    #[test]
    fn the_engines_count_replaces_the_guess() {
        let model = Arc::new(TtftPredictor::new(Default::default()));
        let state = DestinationState::new(&DestinationConfig::default());
        let mut s = sample(&model, &state);
        // The engine had a quarter of its 1,000 tokens: three quarters of
        // the decision's 2,000 were prefilled.
        s.engine_reported(2000.0, 1000, 250);
        assert_eq!(s.features().uncached_tokens, 1500.0);
        // More cached than prompt is read as all of it.
        s.engine_reported(2000.0, 1000, 4000);
        assert_eq!(s.features().uncached_tokens, 0.0);
        // No prompt count: the guess stays.
        let mut guessed = sample(&model, &state);
        guessed.engine_reported(2000.0, 0, 0);
        assert_eq!(guessed.features().uncached_tokens, 0.0);
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
