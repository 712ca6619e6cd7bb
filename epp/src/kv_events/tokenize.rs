//! Prompts as the engine tokenizes them, for matching against what its KV
//! events say it holds.
//!
//! Tokenizing runs off the async runtime, on at most half the cores at
//! once ([`slots`]), and within a time budget: a request whose prompt is
//! not tokenized in time (or finds every tokenizer busy) is matched by the
//! approximate index instead, and the metrics say so. Work that runs on
//! past its budget runs at a lower priority ([`super::tokenize_pool`]).

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use regex::Regex;
use tokio::sync::Semaphore;

use super::hf::{HfTokenizer, LoadError, TokenizeError};
use super::index::{chain_root, token_chain};
use super::tokenize_pool::TokenizePool;
use crate::extproc::body::ParsedBody;
use crate::predict::MAX_BLOCKS;

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

/// What a tokenizer needs of a request: the prompt text as the EPP parsed
/// it, and for chat requests each message's role and content in it.
#[derive(Debug, Clone, Default)]
pub struct PromptText {
    pub text: String,
    pub messages: Vec<(Range<usize>, Range<usize>)>,
}

impl PromptText {
    /// The prompt of a parsed request body (a copy: tokenizing runs on
    /// another thread).
    pub fn of(body: &ParsedBody) -> PromptText {
        PromptText {
            text: body.prompt.clone(),
            messages: body.messages.clone(),
        }
    }
}

/// How prompts are turned into token ids.
#[derive(Debug)]
pub enum Tokenizer {
    /// The model's own: `tokenizer.json` and its chat template.
    HuggingFace(Box<HfTokenizer>),
    /// llm-d-inference-sim's `--force-dummy-tokenizer`: FOR TESTS AGAINST
    /// THAT SIMULATOR ONLY. A chat is rendered `"### <role>: <content>\n"`
    /// per message, tokens are the matches of a fixed pattern (a word or one
    /// punctuation character, with the whitespace after it) and each id is
    /// the FNV-1a 32-bit hash of its match.
    SimulatorDummy(Regex),
}

impl Tokenizer {
    pub fn simulator_dummy() -> Tokenizer {
        // Go's RE2 `\w` and `\s` are ASCII-only: spelled out here.
        let pattern = r#"(\{|\}|:|,|-|\.|\?|!|;|@|#|\$|%|\^|&|\*|\(|\)|\+|-|_|~|/|\\|>|<|\[|\]|=|"|'|[0-9A-Za-z_]+)([\t\n\x0C\r ]*)"#;
        Tokenizer::SimulatorDummy(Regex::new(pattern).expect("a valid pattern"))
    }

    /// Loads the Hugging Face tokenizer in `dir`.
    pub fn hugging_face(dir: &std::path::Path) -> Result<Tokenizer, LoadError> {
        Ok(Tokenizer::HuggingFace(Box::new(HfTokenizer::load(dir)?)))
    }

    /// The token ids of `prompt`.
    pub fn tokens(&self, prompt: &PromptText) -> Result<Vec<u32>, TokenizeError> {
        self.tokens_within(prompt, None)
    }

    /// [`tokens`](Self::tokens), refusing work that would run past `budget`
    /// and serve nothing after it (see `hf`).
    pub fn tokens_within(
        &self,
        prompt: &PromptText,
        budget: Option<Duration>,
    ) -> Result<Vec<u32>, TokenizeError> {
        match self {
            Tokenizer::HuggingFace(hf) => hf.tokens_within(prompt, budget),
            Tokenizer::SimulatorDummy(re) => {
                let rendered;
                let text = if prompt.messages.is_empty() {
                    prompt.text.strip_suffix('\n').unwrap_or(&prompt.text)
                } else {
                    rendered = render_simulator_chat(prompt);
                    &rendered
                };
                Ok(re.find_iter(text).map(|m| fnv1a_32(m.as_str())).collect())
            }
        }
    }
}

fn render_simulator_chat(prompt: &PromptText) -> String {
    let mut out = String::with_capacity(prompt.text.len() + 8 * prompt.messages.len());
    for (role, content) in &prompt.messages {
        out.push_str("### ");
        out.push_str(&prompt.text[role.clone()]);
        out.push_str(": ");
        out.push_str(&prompt.text[content.clone()]);
        out.push('\n');
    }
    out
}

fn fnv1a_32(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5, |h: u32, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// A chain, keyed by its block size and its root.
type Chains = Vec<(u32, u64, Arc<[u64]>)>;

/// A request's prompt tokens, and its chain per block size (engines may
/// use different ones) and LoRA adapter.
#[derive(Debug)]
pub struct PromptTokens {
    tokens: Vec<u32>,
    /// (block size, chain root) → the chain.
    chains: std::sync::Mutex<Chains>,
}

impl PromptTokens {
    pub fn new(tokens: Vec<u32>) -> PromptTokens {
        PromptTokens {
            tokens,
            chains: Default::default(),
        }
    }

    /// The token ids.
    pub fn ids(&self) -> &[u32] {
        &self.tokens
    }

    /// The chain of full blocks of `block_size` tokens, rooted at the LoRA
    /// adapter the request names (`None`: the base model), as the engine
    /// roots the blocks it stores.
    pub fn chain(&self, block_size: u32, adapter: Option<&str>) -> Arc<[u64]> {
        let root = chain_root(adapter);
        let mut chains = crate::predict::sync::lock(&self.chains);
        if let Some((_, _, c)) = chains
            .iter()
            .find(|(bs, r, _)| *bs == block_size && *r == root)
        {
            return Arc::clone(c);
        }
        let mut out = Vec::new();
        token_chain(
            root,
            &self.tokens,
            block_size as usize,
            MAX_BLOCKS,
            &mut out,
        );
        let chain: Arc<[u64]> = out.into();
        chains.push((block_size, root, Arc::clone(&chain)));
        chain
    }
}

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
    pub async fn tokenize(&self, prompt: PromptText) -> Option<PromptTokens> {
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
    use super::super::tokenize_pool::OVERTIME_NICE_STEPS;
    use super::*;

    /// A chat request's prompt, as the EPP parses it.
    fn chat(messages: &[(&str, &str)]) -> PromptText {
        let messages: Vec<_> = messages
            .iter()
            .map(|(role, content)| serde_json::json!({ "role": role, "content": content }))
            .collect();
        let body = serde_json::json!({ "model": "m", "messages": messages });
        PromptText::of(&crate::extproc::body::parse(body.to_string().as_bytes()).unwrap())
    }

    #[test]
    fn fnv1a_32_matches_its_published_vectors() {
        assert_eq!(fnv1a_32(""), 0x811c_9dc5);
        assert_eq!(fnv1a_32("a"), 0xe40c_292c);
        assert_eq!(fnv1a_32("foobar"), 0xbf9c_f968);
    }

    #[test]
    fn the_simulator_dummy_splits_words_and_punctuation_with_their_whitespace() {
        let Tokenizer::SimulatorDummy(re) = Tokenizer::simulator_dummy() else {
            unreachable!()
        };
        let parts: Vec<&str> = re
            .find_iter("### user: Hi, _x_y  there!\n")
            .map(|m| m.as_str())
            .collect();
        assert_eq!(
            parts,
            [
                "#", "#", "# ", "user", ": ", "Hi", ", ", "_", "x_y  ", "there", "!\n"
            ]
        );
        // Non-ASCII letters are not word characters in Go's RE2.
        assert_eq!(re.find_iter("é").count(), 0);
    }

    #[test]
    fn a_chat_renders_as_the_simulator_renders_it() {
        let t = Tokenizer::simulator_dummy();
        let p = chat(&[("system", "be brief"), ("user", "hello")]);
        let direct = Tokenizer::simulator_dummy();
        let Tokenizer::SimulatorDummy(re) = &direct else {
            unreachable!()
        };
        let expected: Vec<u32> = re
            .find_iter("### system: be brief\n### user: hello\n")
            .map(|m| fnv1a_32(m.as_str()))
            .collect();
        assert_eq!(t.tokens(&p).unwrap(), expected);
    }

    #[test]
    fn chains_are_cached_per_block_size() {
        let p = PromptTokens::new((0..40).collect());
        assert_eq!(p.chain(16, None).len(), 2);
        assert_eq!(p.chain(8, None).len(), 5);
        assert!(Arc::ptr_eq(&p.chain(16, None), &p.chain(16, None)));
        // An adapter's chain is its own: no block in common with the base's.
        let lora = p.chain(16, Some("sql-lora"));
        assert_eq!(lora.len(), 2);
        assert!(lora.iter().all(|b| !p.chain(16, None).contains(b)));
    }

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
        // It runs on, lowered (tokenize_pool.rs): seen while it runs.
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
        assert!(t.tokenize(chat(&[("user", "hi")])).await.is_none());
        let ok = Outcome { outcome: "busy" };
        assert_eq!(t.outcomes.get_or_create(&ok).get(), 1);
    }
}
