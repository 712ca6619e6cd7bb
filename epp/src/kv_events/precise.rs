//! Precise mode as the picker holds it: the tokenizer, and the check of
//! every answer against what the EPP computed for it.

use std::sync::Mutex;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::mismatch::{Check, MismatchWatch, advice};
use super::tokenize::PromptTokenizer;
use kinference_runtime::sync::lock;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Result {
    result: &'static str,
}

pub(crate) struct PreciseMode {
    pub tokenizer: PromptTokenizer,
    watch: Mutex<MismatchWatch>,
    checks: Family<Result, Counter>,
}

impl PreciseMode {
    pub fn new(tokenizer: PromptTokenizer) -> PreciseMode {
        PreciseMode {
            tokenizer,
            watch: Mutex::default(),
            checks: Family::default(),
        }
    }

    /// Serves the tokenizer's counters and
    /// `kinference_epp_kv_events_checks_total{result}`.
    pub fn register(&self, metrics: &crate::metrics::Metrics) {
        self.tokenizer.register(metrics);
        metrics.register_metric(
            "kv_events_checks",
            "Answers whose reported prompt and cached token counts were compared with precise mode's, by result (agree, token_count: another tokenizer or chat template, block_size, cached_tokens: the index and the engine disagreed, unindexed: the tokens agreed and the Pod was estimated, so no cached count was compared)",
            self.checks.clone(),
        );
    }

    /// Judges one answer; warns when a disagreement is systematic.
    pub fn check(&self, check: Check) {
        let Some(finding) = check.judge() else { return };
        self.checks
            .get_or_create(&Result {
                result: finding.as_str(),
            })
            .inc();
        let systematic = lock(&self.watch).observe(finding, Instant::now());
        if let Some(finding) = systematic {
            tracing::warn!(
                finding = finding.as_str(),
                ours = check.ours,
                engine_prompt_tokens = check.engine_prompt,
                engine_cached_tokens = check.engine_cached,
                predicted_cached_tokens = check.predicted.map(|p| p.0),
                "precise prefix mode disagrees with the engine: {}",
                advice(finding)
            );
        }
    }
}
