//! Whether precise mode sees prompts as the engine does, judged from what
//! the engine reports in each answer (`usage.prompt_tokens` and
//! `prompt_tokens_details.cached_tokens`) against what the EPP computed
//! for that request. A wrong tokenizer or chat template makes every chain
//! hash differ from the engine's, so precise matching would silently find
//! nothing: this is where it shows.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What one answer says of the EPP's view of its prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Finding {
    /// The counts agree (within a block for the cached prefix).
    Agree,
    /// The engine counts a different number of prompt tokens: another
    /// tokenizer or chat template.
    TokenCount,
    /// The engine's cached count is not a whole number of the block size
    /// its events declare.
    BlockSize,
    /// Same tokens, but the engine had a different prefix cached than the
    /// index predicted.
    CachedTokens,
    /// Same tokens; the index made no prediction for this answer (its Pod
    /// was estimated: not live, or routed the prompt before its events
    /// said so), so there is no cached count to compare.
    Unindexed,
}

impl Finding {
    pub fn as_str(self) -> &'static str {
        match self {
            Finding::Agree => "agree",
            Finding::TokenCount => "token_count",
            Finding::BlockSize => "block_size",
            Finding::CachedTokens => "cached_tokens",
            Finding::Unindexed => "unindexed",
        }
    }
}

/// One request: the EPP's side and the engine's report.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Check {
    /// Prompt tokens as the EPP tokenized them.
    pub ours: u64,
    /// Leading tokens the Pod's index said its engine held, with the block
    /// size its events declare; `None` when the index was not used.
    pub predicted: Option<(u64, u32)>,
    pub engine_prompt: Option<u64>,
    pub engine_cached: Option<u64>,
}

impl Check {
    pub(crate) fn judge(&self) -> Option<Finding> {
        if let Some(engine) = self.engine_prompt
            && engine != self.ours
        {
            return Some(Finding::TokenCount);
        }
        let (Some((predicted, bs)), Some(cached)) = (self.predicted, self.engine_cached) else {
            return self.engine_prompt.map(|_| Finding::Unindexed);
        };
        let bs = u64::from(bs.max(1));
        let prompt = self.engine_prompt.unwrap_or(self.ours);
        // An engine recomputes at least the prompt's last token, so a prompt
        // cached whole reports one token less (vLLM).
        let whole = cached + 1 == prompt;
        if cached % bs != 0 && !whole {
            return Some(Finding::BlockSize);
        }
        let predicted = predicted.min(prompt.saturating_sub(1));
        if predicted.abs_diff(cached) >= bs {
            return Some(Finding::CachedTokens);
        }
        Some(Finding::Agree)
    }
}

/// Findings remembered to judge whether a mismatch is systematic.
pub(crate) const WINDOW: usize = 32;
/// Between two warnings of the same kind, at least.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(300);

/// The recent findings, and when each kind last warned.
#[derive(Debug, Default)]
pub(crate) struct MismatchWatch {
    recent: VecDeque<Finding>,
    warned: Vec<(Finding, Instant)>,
}

impl MismatchWatch {
    /// Records `finding`; returns it when it is now systematic (at least
    /// half of a full window) and has not warned for [`WARN_EVERY`].
    pub fn observe(&mut self, finding: Finding, now: Instant) -> Option<Finding> {
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(finding);
        let same = self.recent.iter().filter(|f| **f == finding).count();
        let disagrees = !matches!(finding, Finding::Agree | Finding::Unindexed);
        if !disagrees || self.recent.len() < WINDOW || 2 * same < WINDOW {
            return None;
        }
        match self.warned.iter_mut().find(|(f, _)| *f == finding) {
            Some((_, at)) if now.saturating_duration_since(*at) < WARN_EVERY => None,
            Some((_, at)) => {
                *at = now;
                Some(finding)
            }
            None => {
                self.warned.push((finding, now));
                Some(finding)
            }
        }
    }
}

/// What a systematic finding means, for the operator of the pool.
pub(crate) fn advice(finding: Finding) -> &'static str {
    match finding {
        Finding::Agree | Finding::Unindexed => "",
        Finding::TokenCount => {
            "the engine counts prompts in a different number of tokens than --kv-events-tokenizer: \
             its tokenizer.json or chat template is not the served model's, so precise prefix \
             matching finds nothing; give the model's own files"
        }
        Finding::BlockSize => {
            "the engine's cached token counts are not whole blocks of the block size its KV \
             events declare: check the engine's block (page) size"
        }
        Finding::CachedTokens => {
            "the engine had a different prefix cached than its KV events said: events may be \
             lost (check kinference_epp_kv_events_* counters), or the prompt's tokens differ \
             past the text (LoRA adapters, images, a cache salt)"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(ours: u64, predicted: u64, engine_prompt: u64, engine_cached: u64) -> Option<Finding> {
        Check {
            ours,
            predicted: Some((predicted, 16)),
            engine_prompt: Some(engine_prompt),
            engine_cached: Some(engine_cached),
        }
        .judge()
    }

    #[test]
    fn each_disagreement_is_told_apart() {
        assert_eq!(check(100, 64, 100, 64), Some(Finding::Agree));
        assert_eq!(
            check(100, 70, 100, 64),
            Some(Finding::Agree),
            "within a block"
        );
        assert_eq!(check(101, 64, 100, 64), Some(Finding::TokenCount));
        assert_eq!(check(100, 64, 100, 60), Some(Finding::BlockSize));
        assert_eq!(check(100, 0, 100, 64), Some(Finding::CachedTokens));
        assert_eq!(check(100, 96, 100, 32), Some(Finding::CachedTokens));
        // A prompt cached whole: the engine recomputes its last token.
        assert_eq!(check(97, 96, 97, 96), Some(Finding::Agree));
        assert_eq!(check(96, 96, 96, 95), Some(Finding::Agree));
        // Nothing reported: nothing to judge.
        let silent = Check {
            ours: 5,
            predicted: Some((0, 16)),
            engine_prompt: None,
            engine_cached: None,
        };
        assert_eq!(silent.judge(), None);
        // Without the index only the token count can be judged.
        let unindexed = |engine_prompt| Check {
            ours: 5,
            predicted: None,
            engine_prompt: Some(engine_prompt),
            engine_cached: Some(0),
        };
        assert_eq!(unindexed(5).judge(), Some(Finding::Unindexed));
        assert_eq!(unindexed(6).judge(), Some(Finding::TokenCount));
    }

    #[test]
    fn a_systematic_finding_warns_once_per_period_and_noise_never() {
        let t0 = Instant::now();
        let mut watch = MismatchWatch::default();
        // One in three: noise (races between concurrent requests).
        for i in 0..3 * WINDOW {
            let f = if i % 3 == 0 {
                Finding::CachedTokens
            } else {
                Finding::Agree
            };
            assert_eq!(watch.observe(f, t0), None);
        }
        let mut warned = Vec::new();
        for i in 0..WINDOW {
            let at = t0 + Duration::from_secs(i as u64);
            warned.extend(watch.observe(Finding::TokenCount, at));
        }
        assert_eq!(warned, [Finding::TokenCount]);
        let later = t0 + WARN_EVERY + Duration::from_secs(WINDOW as u64);
        assert_eq!(
            watch.observe(Finding::TokenCount, later),
            Some(Finding::TokenCount)
        );
    }
}
