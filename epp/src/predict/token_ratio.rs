//! How many tokens a Pod's engine counts for each token the estimate counts
//! (4 prompt bytes), learnt from the `usage.prompt_tokens` of its answers.
//!
//! The approximate prefix index remembers prompt bytes and is sized like the
//! engine's KV cache, which counts the engine's tokens. At 4 bytes a token
//! the two agree for English text under the usual tokenizers. A tokenizer
//! with longer tokens holds more text than that: the simulator's dummy one
//! makes 0.62 as many, so the index forgot prompts the engine still held,
//! and their requests were predicted a prefill they never paid (at 80
//! requests a second a third of them, most of the approximate mode's TTFT
//! prediction error). CJK text and code go the other way: more tokens a
//! byte, and an index that believes in prefixes the engine has evicted.

use std::sync::atomic::{AtomicU64, Ordering};

/// Prompts shorter than this (estimated tokens) teach nothing: the chat
/// template's own tokens are too large a share of them.
const MIN_ESTIMATED: u64 = 256;
/// How far one answer moves the ratio's logarithm, up or down: the ratio
/// tracks the median answer, not the mean. Tokens the estimate never sees
/// (an image, a tool schema) make some answers' ratios far too high, and a
/// mean followed them; a minority of them cannot move a median. At 1% a
/// step, 0.6 is reached from 1 in about 50 answers, and the ratio then
/// wobbles by 1%, well inside the sixteenth a resize waits for.
const STEP: f64 = 0.01;
/// The ratios believed: 32 bytes a token to half a byte a token.
const RANGE: (f64, f64) = (0.125, 8.0);

/// Engine tokens per estimated token; 1 until answers say otherwise.
#[derive(Debug, Default)]
pub struct TokenRatio {
    /// The ratio's natural logarithm, as `f64` bits (0.0: a ratio of 1).
    log_bits: AtomicU64,
}

impl TokenRatio {
    pub fn get(&self) -> f64 {
        f64::from_bits(self.log_bits.load(Ordering::Relaxed)).exp()
    }

    /// The engine counted `engine` tokens in a prompt the estimate counted
    /// `estimated` tokens in.
    pub fn observe(&self, estimated: u64, engine: u64) {
        if estimated < MIN_ESTIMATED || engine == 0 {
            return;
        }
        let seen = (engine as f64 / estimated as f64).ln();
        let (lo, hi) = (RANGE.0.ln(), RANGE.1.ln());
        // Concurrent answers each take their own step.
        let _ = self
            .log_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let now = f64::from_bits(bits);
                let step = (seen - now).clamp(-STEP, STEP);
                Some((now + step).clamp(lo, hi).to_bits())
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_follows_the_engines_counts() {
        let ratio = TokenRatio::default();
        assert_eq!(ratio.get(), 1.0);
        for _ in 0..100 {
            ratio.observe(6_000, 3_720);
        }
        assert!((ratio.get() - 0.62).abs() < 0.01, "{}", ratio.get());
    }

    #[test]
    fn a_minority_of_answers_with_unseen_tokens_does_not_move_it() {
        let ratio = TokenRatio::default();
        for i in 0..300 {
            // One answer in five also counts an image's 2,000 tokens.
            let image = if i % 5 == 0 { 2_000 } else { 0 };
            ratio.observe(1_000, 620 + image);
        }
        assert!((ratio.get() - 0.62).abs() < 0.02, "{}", ratio.get());
    }

    #[test]
    fn short_prompts_and_absurd_counts_teach_nothing_beyond_the_range() {
        let ratio = TokenRatio::default();
        // Mostly chat template.
        ratio.observe(20, 60);
        ratio.observe(6_000, 0);
        assert_eq!(ratio.get(), 1.0);
        // A hundred tokens a byte is read as the largest ratio believed.
        for _ in 0..400 {
            ratio.observe(1_000, 400_000);
        }
        assert!((ratio.get() - 8.0).abs() < 1e-6, "{}", ratio.get());
    }
}
