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
/// Each observation's weight in the running mean.
const WEIGHT: f64 = 0.1;
/// The ratios believed: 32 bytes a token to half a byte a token. Beyond
/// them a count is not a tokenizer's.
const RANGE: (f64, f64) = (0.125, 8.0);

/// Engine tokens per estimated token; 1 until an answer says otherwise.
#[derive(Debug)]
pub struct TokenRatio {
    bits: AtomicU64,
}

impl Default for TokenRatio {
    fn default() -> Self {
        TokenRatio {
            bits: AtomicU64::new(1f64.to_bits()),
        }
    }
}

impl TokenRatio {
    pub fn get(&self) -> f64 {
        f64::from_bits(self.bits.load(Ordering::Relaxed))
    }

    /// The engine counted `engine` tokens in a prompt the estimate counted
    /// `estimated` tokens in.
    pub fn observe(&self, estimated: u64, engine: u64) {
        if estimated < MIN_ESTIMATED || engine == 0 {
            return;
        }
        let seen = (engine as f64 / estimated as f64).clamp(RANGE.0, RANGE.1);
        // Concurrent answers each move the mean by their own step.
        let _ = self
            .bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let mean = f64::from_bits(bits);
                Some((mean + WEIGHT * (seen - mean)).to_bits())
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
        assert!((ratio.get() - 0.62).abs() < 1e-3, "{}", ratio.get());
    }

    #[test]
    fn short_prompts_and_absurd_counts_teach_little() {
        let ratio = TokenRatio::default();
        // Mostly chat template.
        ratio.observe(20, 60);
        ratio.observe(6_000, 0);
        assert_eq!(ratio.get(), 1.0);
        // A hundred tokens a byte is read as the largest ratio believed.
        for _ in 0..200 {
            ratio.observe(1_000, 400_000);
        }
        assert!((ratio.get() - 8.0).abs() < 1e-3, "{}", ratio.get());
    }
}
