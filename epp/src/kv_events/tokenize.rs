//! Prompts as the engine tokenizes them, for matching against what its KV
//! events say it holds.
//!
//! Tokenizing runs off the async runtime, on at most half the cores at
//! once ([`slots`]), and within a time budget: a request whose prompt is
//! not tokenized in time (or finds every tokenizer busy) is matched by the
//! approximate index instead, and the metrics say so. Work that runs on
//! past its budget runs at a lower priority (`kinference_tokenizer::threads`).

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::Semaphore;

use kinference_tokenizer::threads::TokenizePool;
use kinference_tokenizer::{PromptText, TokenizeError, Tokenizer};

use crate::kv_cache::PromptTokens;

/// Tokenizations running at once, at most: half the cores, 1 to 4. A
/// tokenization over its budget runs on when its ids will be kept for the
/// prompt's next sighting, so every slot is a core's worth of CPU taken
/// from the proxy and the EPP itself: with 4 slots on 2 cores, 220 KB
/// prompts at 150 concurrent requests took 2.3× the time to serve.
pub fn slots() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / 2).clamp(1, 4)
}

/// The tokenizer threads' name.
const THREAD_NAME: &str = "kv-tokenize";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    outcome: &'static str,
}

/// The tokenizer, its budget and its bound.
pub struct PromptTokenizer {
    tokenizer: Arc<Tokenizer>,
    budget: Duration,
    slots: Arc<Semaphore>,
    threads: TokenizePool,
    outcomes: Family<Outcome, Counter>,
}

impl PromptTokenizer {
    pub fn new(tokenizer: Tokenizer, budget: Duration) -> PromptTokenizer {
        // A thread for each slot: a job with a slot never waits for one.
        let slots = slots();
        PromptTokenizer {
            tokenizer: Arc::new(tokenizer),
            budget,
            slots: Arc::new(Semaphore::new(slots)),
            threads: TokenizePool::new(THREAD_NAME, slots),
            outcomes: Family::default(),
        }
    }

    /// Serves `kinference_epp_prompt_tokenizations_total{outcome}`: `ok`,
    /// `over_budget`, `not_worth_encoding`, `busy`, `error` (all but `ok`
    /// fall back to the approximate index).
    pub fn register(&self, metrics: &crate::metrics::Metrics) {
        metrics.register_metric(
            "prompt_tokenizations",
            "Prompts tokenized for precise prefix matching, by outcome (ok; over_budget: ran past the budget; not_worth_encoding: predicted past it, and its ids would not be kept, so not started; busy and error fall back to the approximate index)",
            self.outcomes.clone(),
        );
    }

    fn count(&self, outcome: &'static str) {
        self.outcomes.get_or_create(&Outcome { outcome }).inc();
    }

    /// Tokenizes `prompt` on the tokenizer threads within the budget;
    /// `None` when over budget or every slot is taken.
    pub(crate) async fn tokenize(&self, prompt: PromptText) -> Option<PromptTokens> {
        let Ok(permit) = Arc::clone(&self.slots).try_acquire_owned() else {
            self.count("busy");
            return None;
        };
        let tokenizer = Arc::clone(&self.tokenizer);
        let budget = self.budget;
        let (answer, answered) = tokio::sync::oneshot::channel();
        // The permit goes with the work: a tokenization that outlives its
        // budget still holds its slot until it ends.
        let running = self.threads.run(move || {
            let tokens = tokenizer.tokens_within(&prompt, Some(budget));
            drop(permit);
            let _ = answer.send(tokens);
        });
        match tokio::time::timeout(self.budget, answered).await {
            Ok(Ok(done)) => {
                self.count(outcome_of(&done));
                done.ok().map(PromptTokens::new)
            }
            // The tokenizer panicked.
            Ok(Err(_)) => {
                self.count("error");
                None
            }
            Err(_) => {
                self.threads.lower(&running);
                self.count("over_budget");
                None
            }
        }
    }
}

/// The outcome label of a tokenization that ended within the budget.
fn outcome_of(done: &Result<Vec<u32>, TokenizeError>) -> &'static str {
    match done {
        Ok(_) => "ok",
        Err(TokenizeError::NotWorthEncoding { .. }) => "not_worth_encoding",
        Err(error) => {
            // A template's own refusal (e.g. roles that do not alternate):
            // the engine refuses the request too.
            tracing::debug!(%error, "prompt not tokenized");
            "error"
        }
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_os = "linux")]
    use kinference_tokenizer::threads::OVERTIME_NICE_STEPS;

    use super::*;

    #[test]
    fn a_prompt_not_worth_encoding_is_told_apart_from_one_over_budget() {
        let refused = Err(TokenizeError::NotWorthEncoding { bytes: 220_000 });
        assert_eq!(outcome_of(&refused), "not_worth_encoding");
        let template = Err(TokenizeError::Encode("no".into()));
        assert_eq!(outcome_of(&template), "error");
        assert_eq!(outcome_of(&Ok(vec![1])), "ok");
    }

    /// The nice values of this process's tokenizer threads.
    #[cfg(target_os = "linux")]
    fn tokenizer_threads() -> Vec<i32> {
        let tasks = std::fs::read_dir("/proc/self/task").unwrap();
        tasks
            .flatten()
            .filter(|task| {
                std::fs::read_to_string(task.path().join("comm"))
                    .is_ok_and(|name| name.trim() == THREAD_NAME)
            })
            .filter_map(|task| task.file_name().to_str()?.parse().ok())
            .filter_map(|tid| {
                let thread = rustix::process::Pid::from_raw(tid)?;
                rustix::process::getpriority_process(Some(thread)).ok()
            })
            .collect()
    }

    #[tokio::test]
    async fn over_budget_or_busy_falls_back_and_is_counted() {
        let t = PromptTokenizer::new(Tokenizer::simulator_dummy(), Duration::ZERO);
        let big = PromptText {
            text: "word ".repeat(400_000),
            messages: Vec::new(),
        };
        assert!(t.tokenize(big).await.is_none());
        // It runs on, lowered (`kinference_tokenizer::threads`): seen while
        // it runs.
        #[cfg(target_os = "linux")]
        {
            let me = rustix::process::getpriority_process(None).unwrap();
            assert!(me < 19, "the tests run at nice 19: nothing can be lowered");
            let lowered = (me + OVERTIME_NICE_STEPS).min(19);
            let mut seen = false;
            for _ in 0..200 {
                seen = tokenizer_threads().contains(&lowered);
                if seen {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(seen, "no tokenizer thread at nice {lowered}");
        }
        let over = Outcome {
            outcome: "over_budget",
        };
        assert_eq!(t.outcomes.get_or_create(&over).get(), 1);
        let t = PromptTokenizer::new(Tokenizer::simulator_dummy(), Duration::from_secs(5));
        let _held: Vec<_> = (0..slots())
            .map(|_| Arc::clone(&t.slots).try_acquire_owned().unwrap())
            .collect();
        assert!(
            t.tokenize(PromptText::chat([("user", "hi")]))
                .await
                .is_none()
        );
        let ok = Outcome { outcome: "busy" };
        assert_eq!(t.outcomes.get_or_create(&ok).get(), 1);
    }
}
