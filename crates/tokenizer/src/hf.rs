//! A model's own tokenizer, as vLLM applies it: the chat template rendered
//! by a Jinja engine with the settings `transformers` uses, then the
//! `tokenizer.json` encoding without added special tokens (the template
//! writes them); a completion prompt is encoded with them.
//!
//! Loaded from a directory laid out as a Hugging Face model repository:
//! `tokenizer.json`, and the chat template in `chat_template.jinja` or in
//! `tokenizer_config.json`'s `chat_template`.
//!
//! Encoding is the costly part (about 0.4 µs a byte for Qwen3), and most
//! prompts share long system prompts. The tokenizer itself cuts its input
//! at its added tokens (`<|im_start|>`, ...) and encodes each piece
//! between on its own, so a chat is cut the same way and each long piece's
//! ids are kept ([`SegmentCache`]): a system prompt is encoded once, not
//! per request. Exact, not an approximation: the same pieces, encoded the
//! same way.
//!
//! Given a time budget, a new piece that would run past it is encoded only
//! if its ids would be kept: an encoding past the budget serves the next
//! sighting of the piece, not this request, and one that is not kept
//! serves nothing. Kept ids go to the pieces seen most often (a piece
//! evicts others only if seen more often than each, by more than one
//! sighting, and a piece found since it was kept is evicted last), so
//! prompts sent in turn that do not all fit keep those that do instead of
//! evicting each other before they come back.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use xxhash_rust::xxh3::xxh3_128_with_seed;

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value, context};
use serde::Deserialize;

use crate::PromptText;

/// Why a tokenizer directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error(
        "{path}: no chat template (neither chat_template.jinja nor tokenizer_config.json's chat_template)"
    )]
    NoTemplate { path: PathBuf },
    #[error("{path}: the chat template does not compile: {source:#}")]
    Template { path: PathBuf, source: JinjaError },
}

/// Why one prompt was not tokenized (it is then matched approximately).
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("chat template: {0:#}")]
    Template(#[from] JinjaError),
    #[error("encoding: {0}")]
    Encode(String),
    #[error(
        "a new piece of {bytes} bytes would take past the budget, and its ids would not be kept"
    )]
    NotWorthEncoding { bytes: usize },
}

/// `tokenizer_config.json`, the fields rendering needs.
#[derive(Deserialize, Default)]
struct TokenizerConfig {
    #[serde(default)]
    chat_template: Option<ChatTemplates>,
    #[serde(default)]
    bos_token: Option<SpecialToken>,
    #[serde(default)]
    eos_token: Option<SpecialToken>,
}

/// A template, or named templates of which `default` renders chats.
#[derive(Deserialize)]
#[serde(untagged)]
enum ChatTemplates {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

/// A special token, as a string or as an added-token object.
#[derive(Deserialize)]
#[serde(untagged)]
enum SpecialToken {
    Text(String),
    Added { content: String },
}

impl SpecialToken {
    fn text(self) -> String {
        match self {
            SpecialToken::Text(t) | SpecialToken::Added { content: t } => t,
        }
    }
}

/// The name the template is stored under in its environment.
const CHAT: &str = "chat";

pub struct HfTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// `None` when an added token strips whitespace, must be a whole word
    /// or is matched after normalization: cutting would then differ from
    /// the tokenizer's own, so every chat is encoded whole.
    pieces: Option<Pieces>,
    templates: Environment<'static>,
    bos_token: String,
    eos_token: String,
    dir: PathBuf,
    cost: EncodeCost,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl HfTokenizer {
    /// Loads the tokenizer in `dir`; every problem is reported with the
    /// file it is in.
    pub fn load(dir: &Path) -> Result<HfTokenizer, LoadError> {
        let json = dir.join("tokenizer.json");
        let tokenizer =
            tokenizers::Tokenizer::from_file(&json).map_err(|e| LoadError::Tokenizer {
                path: json.clone(),
                message: e.to_string(),
            })?;
        let config_path = dir.join("tokenizer_config.json");
        let config: TokenizerConfig = match std::fs::read(&config_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| LoadError::Config {
                path: config_path.clone(),
                message: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => TokenizerConfig::default(),
            Err(source) => {
                return Err(LoadError::Read {
                    path: config_path,
                    source,
                });
            }
        };
        let template_path = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&template_path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match config.chat_template {
                Some(ChatTemplates::One(t)) => t,
                Some(ChatTemplates::Named(named)) => named
                    .into_iter()
                    .find(|n| n.name == "default")
                    .map(|n| n.template)
                    .ok_or(LoadError::NoTemplate {
                        path: config_path.clone(),
                    })?,
                None => return Err(LoadError::NoTemplate { path: dir.into() }),
            },
            Err(source) => {
                return Err(LoadError::Read {
                    path: template_path,
                    source,
                });
            }
        };
        let templates = chat_environment(source).map_err(|source| LoadError::Template {
            path: dir.into(),
            source,
        })?;
        Ok(HfTokenizer {
            pieces: Pieces::of(&tokenizer),
            tokenizer,
            templates,
            bos_token: config.bos_token.map(SpecialToken::text).unwrap_or_default(),
            eos_token: config.eos_token.map(SpecialToken::text).unwrap_or_default(),
            dir: dir.into(),
            cost: EncodeCost::default(),
        })
    }

    /// The token ids vLLM computes for `prompt`.
    pub fn tokens(&self, prompt: &PromptText) -> Result<Vec<u32>, TokenizeError> {
        self.tokens_within(prompt, None)
    }

    /// [`tokens`](Self::tokens), refusing to encode what would run past
    /// `budget` for nothing (see the module doc).
    pub fn tokens_within(
        &self,
        prompt: &PromptText,
        budget: Option<Duration>,
    ) -> Result<Vec<u32>, TokenizeError> {
        let started = Instant::now();
        let too_long = |bytes: usize| {
            budget.is_some_and(|b| {
                self.cost
                    .refuses(bytes, b.saturating_sub(started.elapsed()))
            })
        };
        if prompt.messages.is_empty() {
            // The parser ends the prompt with a line break of its own.
            let text = prompt.text.strip_suffix('\n').unwrap_or(&prompt.text);
            // Nothing of it is kept: past the budget it serves nothing.
            if too_long(text.len()) {
                return Err(TokenizeError::NotWorthEncoding { bytes: text.len() });
            }
            // With special tokens (a BOS, for some models): encoded whole.
            return self.encode(text, true);
        }
        let chat = self.render_chat(prompt)?;
        match &self.pieces {
            Some(pieces) => pieces.encode(&chat, |text| self.encode(text, false), too_long),
            None if too_long(chat.len()) => {
                Err(TokenizeError::NotWorthEncoding { bytes: chat.len() })
            }
            None => self.encode(&chat, false),
        }
    }

    fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizeError> {
        let started = thread_cpu();
        let encoding = self
            .tokenizer
            .encode_fast(text, special)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        self.cost
            .learn(text.len(), thread_cpu().saturating_sub(started));
        Ok(encoding.get_ids().to_vec())
    }

    /// Pieces not found kept (encoded, or refused as not worth it), and
    /// found kept (tests and benchmarks).
    pub fn piece_counts(&self) -> (u64, u64) {
        self.pieces.as_ref().map_or((0, 0), |p| {
            let cache = p.lock();
            (cache.misses, cache.hits)
        })
    }

    /// The chat as the model's template renders it for a new reply.
    pub fn render_chat(&self, prompt: &PromptText) -> Result<String, JinjaError> {
        let messages: Vec<Value> = prompt
            .messages
            .iter()
            .map(|(role, content)| {
                context! {
                    role => &prompt.text[role.clone()],
                    content => &prompt.text[content.clone()],
                }
            })
            .collect();
        self.templates.get_template(CHAT)?.render(context! {
            messages,
            add_generation_prompt => true,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
    }
}

/// Pieces shorter than this are encoded every time: cheap, and mostly the
/// request's own question.
const MIN_KEPT_BYTES: usize = 256;
/// Token ids kept, all pieces together (8 MB).
const KEPT_IDS: usize = 2 << 20;
/// Pieces whose sightings are counted; past it every count is halved and
/// the pieces at zero forgotten, so old counts fade.
const COUNTED_PIECES: usize = 1 << 16;
/// Fewest sightings between two halvings of the counts.
const MIN_AGING_WINDOW: usize = 256;
/// Bytes a token takes, to guess a piece's ids before it is encoded (about
/// 4 for English with the usual vocabularies).
const BYTES_PER_ID: usize = 4;

/// The CPU time this thread has used. An encoding's cost is what it
/// computes: a busy machine, or the lower priority it runs on past its
/// budget (`tokenize_pool.rs`), makes it take longer, not cost more, and
/// would otherwise teach the cost to refuse what fits.
fn thread_cpu() -> Duration {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        u64::try_from(now.tv_sec).unwrap_or(0),
        u32::try_from(now.tv_nsec).unwrap_or(0),
    )
}

/// What encoding costs a byte, learnt from the encodings of at least
/// [`LEARNT_FROM_BYTES`] (shorter ones are mostly fixed cost).
struct EncodeCost {
    /// Nanoseconds a byte, × 1,024, as a moving average.
    scaled_ns_per_byte: AtomicU64,
    /// Encodings refused on the prediction.
    refused: AtomicU64,
}

/// One refusal in this many is encoded anyway, so that a cost learnt too
/// high (noisy samples) is still corrected.
const ENCODE_ANYWAY_EVERY: u64 = 64;

const LEARNT_FROM_BYTES: usize = 4096;

impl Default for EncodeCost {
    fn default() -> Self {
        // Qwen3's measured cost on prose (BENCHMARKS, "request-path cost").
        EncodeCost {
            scaled_ns_per_byte: AtomicU64::new(550 * 1024),
            refused: AtomicU64::new(0),
        }
    }
}

impl EncodeCost {
    /// The predicted time to encode `bytes`.
    fn of(&self, bytes: usize) -> Duration {
        let scaled = self.scaled_ns_per_byte.load(Ordering::Relaxed);
        Duration::from_nanos((bytes as u64).saturating_mul(scaled) / 1024)
    }

    /// Whether encoding `bytes` should not start with `left` of the budget:
    /// predicted past half as much again as what is left, bar one in
    /// [`ENCODE_ANYWAY_EVERY`].
    fn refuses(&self, bytes: usize, left: Duration) -> bool {
        self.of(bytes) > left.mul_f64(1.5)
            && self.refused.fetch_add(1, Ordering::Relaxed) % ENCODE_ANYWAY_EVERY
                != ENCODE_ANYWAY_EVERY - 1
    }

    /// An encoding of `bytes` took `took` of CPU. One sample moves the cost
    /// at most twofold up: one noisy sample is not the tokenizer.
    fn learn(&self, bytes: usize, took: Duration) {
        if bytes < LEARNT_FROM_BYTES {
            return;
        }
        // A lost update between two threads costs one sample: no lock.
        let old = self.scaled_ns_per_byte.load(Ordering::Relaxed);
        let sample = ((took.as_nanos() as u64).saturating_mul(1024) / bytes as u64)
            .min(old.saturating_mul(2));
        let new = (old.saturating_mul(7) + sample) / 8;
        self.scaled_ns_per_byte.store(new.max(1), Ordering::Relaxed);
    }
}

/// A chat cut where the tokenizer cuts it: at its added tokens, found as
/// it finds them (leftmost-longest).
struct Pieces {
    added: AhoCorasick,
    /// The id of each added token, by pattern index.
    ids: Vec<u32>,
    cache: Mutex<SegmentCache>,
}

impl Pieces {
    fn of(tokenizer: &tokenizers::Tokenizer) -> Option<Pieces> {
        let added = tokenizer.get_added_tokens_decoder();
        let plain = added
            .values()
            .all(|t| !t.single_word && !t.lstrip && !t.rstrip && !t.normalized);
        if !plain || added.is_empty() {
            return None;
        }
        let (ids, contents): (Vec<u32>, Vec<String>) =
            added.into_iter().map(|(id, t)| (id, t.content)).unzip();
        let added = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&contents)
            .ok()?;
        Some(Pieces {
            added,
            ids,
            cache: Mutex::default(),
        })
    }

    /// `chat`'s ids: each added token's, and each piece between encoded by
    /// `encode` or found kept. A new piece `too_long` to encode in time (by
    /// its bytes, counting the time already spent) is encoded only if its
    /// ids would be kept; then the chat is refused, after the pieces that
    /// will be kept have been encoded for the next sighting.
    fn encode(
        &self,
        chat: &str,
        encode: impl Fn(&str) -> Result<Vec<u32>, TokenizeError>,
        too_long: impl Fn(usize) -> bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let mut out = Some(Vec::with_capacity(chat.len() / 3));
        let mut refused = 0;
        let mut at = 0;
        let mut piece = |text: &str, out: &mut Option<Vec<u32>>| {
            match self.piece(text, &encode, &too_long, out.is_some())? {
                Piece::Kept(ids) => {
                    if let Some(out) = out {
                        out.extend_from_slice(&ids);
                    }
                }
                Piece::Short(ids) => {
                    if let Some(out) = out {
                        out.extend(ids);
                    }
                }
                Piece::NotWorthEncoding => {
                    refused = refused.max(text.len());
                    *out = None;
                }
            }
            Ok::<_, TokenizeError>(())
        };
        for m in self.added.find_iter(chat) {
            piece(&chat[at..m.start()], &mut out)?;
            if let Some(out) = &mut out {
                out.push(self.ids[m.pattern().as_usize()]);
            }
            at = m.end();
        }
        piece(&chat[at..], &mut out)?;
        out.ok_or(TokenizeError::NotWorthEncoding { bytes: refused })
    }

    /// One piece's ids. With `needed` false (the chat is already refused)
    /// only a piece that will be kept is encoded.
    fn piece(
        &self,
        text: &str,
        encode: &impl Fn(&str) -> Result<Vec<u32>, TokenizeError>,
        too_long: &impl Fn(usize) -> bool,
        needed: bool,
    ) -> Result<Piece, TokenizeError> {
        if text.is_empty() {
            return Ok(Piece::Short(Vec::new()));
        }
        if text.len() < MIN_KEPT_BYTES {
            return match needed {
                true => Ok(Piece::Short(encode(text)?)),
                false => Ok(Piece::NotWorthEncoding),
            };
        }
        let key = xxh3_128_with_seed(text.as_bytes(), segment_seed());
        let (kept, admitted) = {
            let mut cache = self.lock();
            cache.sight(key);
            let kept = cache.get(key);
            let admitted = kept.is_none() && cache.admits(key, text.len() / BYTES_PER_ID);
            (kept, admitted)
        };
        if let Some(ids) = kept {
            return Ok(Piece::Kept(ids));
        }
        if !admitted && (!needed || too_long(text.len())) {
            return Ok(Piece::NotWorthEncoding);
        }
        // Encoded outside the lock: other prompts go on meanwhile.
        let ids: Arc<[u32]> = encode(text)?.into();
        // Admitted on a guess of its size: kept at its real size, making
        // room, so that a piece encoded to be kept is kept.
        self.lock().keep(key, Arc::clone(&ids), admitted);
        Ok(Piece::Kept(ids))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SegmentCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A piece of a chat: its ids as kept, a short piece's ids (encoded each
/// time, never kept), or not encoded because it would take past the budget
/// and not be kept.
enum Piece {
    Kept(Arc<[u32]>),
    Short(Vec<u32>),
    NotWorthEncoding,
}

/// Encoded pieces by a keyed 128-bit hash of their text (a per-process
/// seed: prompts cannot be crafted to collide), the oldest forgotten past
/// [`KEPT_IDS`].
#[derive(Default)]
struct SegmentCache {
    by_text: HashMap<u128, Kept>,
    /// Oldest kept first.
    order: VecDeque<u128>,
    ids: usize,
    /// How often each recent piece was seen, kept or not.
    sightings: HashMap<u128, u32>,
    /// Sightings since the counts were last halved.
    since_halved: usize,
    hits: u64,
    misses: u64,
}

struct Kept {
    ids: Arc<[u32]>,
    /// Found since it was kept, or since the last eviction: spared then.
    hit: bool,
}

impl SegmentCache {
    fn get(&mut self, key: u128) -> Option<Arc<[u32]>> {
        match self.by_text.get_mut(&key) {
            Some(kept) => {
                kept.hit = true;
                self.hits += 1;
                Some(Arc::clone(&kept.ids))
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// A piece was seen in a prompt. Every count is halved after ten
    /// sightings per kept piece (at least [`MIN_AGING_WINDOW`]), or when a
    /// new piece finds [`COUNTED_PIECES`] counted: a piece that stops being
    /// sent fades, however often it was sent before.
    fn sight(&mut self, key: u128) {
        self.since_halved += 1;
        let window = (10 * self.order.len()).max(MIN_AGING_WINDOW);
        if self.since_halved >= window
            || self.sightings.len() >= COUNTED_PIECES && !self.sightings.contains_key(&key)
        {
            self.sightings.retain(|_, n| {
                *n /= 2;
                *n > 0
            });
            self.since_halved = 0;
        }
        let n = self.sightings.entry(key).or_default();
        *n = n.saturating_add(1);
    }

    fn seen(&self, key: u128) -> u32 {
        self.sightings.get(&key).copied().unwrap_or(0)
    }

    /// The kept pieces a new one of `ids` would evict: the oldest not
    /// found since they were kept first, then the oldest found (a second
    /// chance). `None` when it is larger than all kept ids together.
    fn victims(&self, ids: usize) -> Option<Vec<u128>> {
        if ids > KEPT_IDS {
            return None;
        }
        let mut need = (self.ids + ids).saturating_sub(KEPT_IDS);
        let mut out = Vec::new();
        for spared in [false, true] {
            for key in &self.order {
                if need == 0 {
                    return Some(out);
                }
                let kept = &self.by_text[key];
                if kept.hit == spared {
                    out.push(*key);
                    need = need.saturating_sub(kept.ids.len());
                }
            }
        }
        Some(out)
    }

    /// Whether a piece of about `ids` would be kept: when it fits, or when
    /// it was seen more often than each kept piece it would evict, by more
    /// than one sighting: prompts sent in turn are seen about as often, and
    /// counts halved a moment apart would otherwise swap them back and
    /// forth, each swap an encoding.
    fn admits(&self, key: u128, ids: usize) -> bool {
        self.victims(ids)
            .is_some_and(|victims| self.outranks(key, &victims))
    }

    fn outranks(&self, key: u128, victims: &[u128]) -> bool {
        let seen = self.seen(key);
        victims
            .iter()
            .all(|&v| seen > self.seen(v).saturating_add(1))
    }

    /// Keeps a piece's ids if [`admits`](Self::admits) would at their real
    /// size, or whatever it evicts if it was `admitted` on a guess of it.
    fn keep(&mut self, key: u128, ids: Arc<[u32]>, admitted: bool) {
        if self.by_text.contains_key(&key) {
            return;
        }
        let Some(victims) = self.victims(ids.len()) else {
            return;
        };
        if !admitted && !self.outranks(key, &victims) {
            return;
        }
        if !victims.is_empty() {
            for victim in &victims {
                if let Some(gone) = self.by_text.remove(victim) {
                    self.ids -= gone.ids.len();
                }
            }
            let by_text = &self.by_text;
            self.order.retain(|key| by_text.contains_key(key));
            // The second chance is spent: a survivor is spared again only
            // if found again.
            for kept in self.by_text.values_mut() {
                kept.hit = false;
            }
        }
        self.ids += ids.len();
        self.by_text.insert(key, Kept { ids, hit: false });
        self.order.push_back(key);
    }
}

/// An environment configured as `transformers` configures Jinja for chat
/// templates: blocks trimmed, `loopcontrols`, Python's string and dict
/// methods, and `raise_exception`.
fn chat_environment(source: String) -> Result<Environment<'static>, JinjaError> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |message: String| -> Result<Value, _> {
        Err(JinjaError::new(ErrorKind::InvalidOperation, message))
    });
    env.add_template_owned(CHAT, source)?;
    Ok(env)
}

/// The seed of the kept pieces' keys: random per process, so that text a
/// client chose cannot be made to collide with another's piece.
fn segment_seed() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(rand::random::<u64>)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(n: usize) -> Arc<[u32]> {
        vec![0; n].into()
    }

    /// Fills `cache` with four pieces, 0 to 3, of a quarter of the kept ids
    /// each, every one seen `sightings` times.
    fn fill_with_quarters(cache: &mut SegmentCache, sightings: usize) {
        for key in 0..4 {
            for _ in 0..sightings {
                cache.sight(key);
            }
            cache.keep(key, piece(KEPT_IDS / 4), false);
        }
    }

    #[test]
    fn kept_pieces_stay_within_their_bound_oldest_out_first() {
        let mut cache = SegmentCache::default();
        for key in [1, 2, 3, 3, 3] {
            cache.sight(key);
        }
        cache.keep(1, piece(KEPT_IDS / 2), false);
        cache.keep(1, piece(KEPT_IDS / 2), false); // the same piece, twice
        assert_eq!(cache.ids, KEPT_IDS / 2);
        cache.keep(2, piece(KEPT_IDS / 2), false);
        cache.keep(3, piece(10), false);
        assert!(cache.ids <= KEPT_IDS);
        assert!(cache.get(1).is_none(), "the oldest went first");
        assert!(cache.get(2).is_some() && cache.get(3).is_some());
        cache.keep(4, piece(KEPT_IDS + 1), true);
        assert!(
            cache.get(4).is_none(),
            "larger than the whole bound: not kept"
        );
        assert_eq!((cache.misses, cache.hits), (2, 2));
    }

    /// Pieces sent in turn that do not all fit: the first ones stay, and
    /// the rest are not kept, instead of each evicting the one that comes
    /// back next.
    #[test]
    fn pieces_sent_in_turn_that_do_not_fit_keep_those_that_do() {
        let mut cache = SegmentCache::default();
        let (size, n) = (KEPT_IDS / 4, 6);
        let mut hits = 0;
        for _round in 0..5 {
            for key in 0..n {
                cache.sight(key);
                match cache.get(key) {
                    Some(_) => hits += 1,
                    None => cache.keep(key, piece(size), false),
                }
            }
        }
        assert_eq!(hits, 4 * 4, "4 of the 6 kept from the second round on");
        assert!(cache.ids <= KEPT_IDS);
    }

    #[test]
    fn a_piece_seen_more_often_than_the_oldest_takes_its_place() {
        let mut cache = SegmentCache::default();
        fill_with_quarters(&mut cache, 1);
        cache.sight(9);
        cache.sight(9);
        assert!(
            !cache.admits(9, KEPT_IDS / 4),
            "seen once more than the oldest"
        );
        cache.sight(9);
        assert!(cache.admits(9, KEPT_IDS / 4));
        cache.keep(9, piece(KEPT_IDS / 4), false);
        assert!(cache.get(9).is_some() && cache.get(0).is_none());
    }

    #[test]
    fn sightings_stay_bounded_and_old_ones_fade() {
        let mut cache = SegmentCache::default();
        cache.sight(u128::MAX);
        cache.sight(u128::MAX);
        for key in 0..MIN_AGING_WINDOW as u128 {
            cache.sight(key);
        }
        assert_eq!(cache.seen(u128::MAX), 1, "halved once");
        for key in 0..COUNTED_PIECES as u128 + 10 {
            cache.sight(key);
            assert!(cache.sightings.len() <= COUNTED_PIECES);
        }
        assert_eq!(cache.seen(u128::MAX), 0, "forgotten");
    }

    /// A chat cut at `<|im_start|>` and `<|im_end|>`, each piece's ids its
    /// length (so that what was encoded shows).
    fn pieces() -> Pieces {
        Pieces {
            added: AhoCorasick::new(["<|im_start|>", "<|im_end|>"]).unwrap(),
            ids: vec![1, 2],
            cache: Mutex::default(),
        }
    }

    #[test]
    fn a_new_piece_past_the_budget_is_encoded_only_if_it_would_be_kept() {
        let p = pieces();
        let encoded = std::cell::Cell::new(0);
        let encode = |text: &str| {
            encoded.set(encoded.get() + 1);
            Ok(vec![7; text.len() / 4])
        };
        let past_budget = |_: usize| true;
        // The kept ids are full of pieces seen twice.
        fill_with_quarters(&mut p.lock(), 2);
        let long = "tea ".repeat(1_000);
        let chat = format!("<|im_start|>{long}<|im_end|>");
        let err = p.encode(&chat, encode, past_budget).unwrap_err();
        assert!(
            matches!(err, TokenizeError::NotWorthEncoding { bytes: 4_000 }),
            "{err}"
        );
        assert_eq!(encoded.get(), 0, "nothing encoded for nothing");
        // Within the budget it is encoded, and still not kept.
        for expected in [1, 2] {
            let ids = p.encode(&chat, encode, |_| false).unwrap();
            assert_eq!(ids.len(), 2 + 1_000);
            assert_eq!(encoded.get(), expected);
        }
        // Seen more often than the oldest kept piece (by more than one), it
        // is worth keeping.
        let ids = p.encode(&chat, encode, past_budget).unwrap();
        assert_eq!(ids.len(), 2 + 1_000);
        assert_eq!(encoded.get(), 3);
        assert_eq!(p.encode(&chat, encode, past_budget).unwrap().len(), 1_002);
        assert_eq!(encoded.get(), 3, "kept: not encoded again");
    }

    /// A prompt sent very often, then no more, gives way to the next one.
    #[test]
    fn a_piece_no_longer_sent_gives_way_to_the_one_sent_now() {
        let mut cache = SegmentCache::default();
        for _ in 0..1_000 {
            cache.sight(1);
        }
        cache.keep(1, piece(KEPT_IDS), false);
        let sightings = (1..=2_000).find(|_| {
            cache.sight(2);
            cache.admits(2, 10)
        });
        let sightings = sightings.expect("the new piece is admitted");
        assert!(sightings <= 3 * MIN_AGING_WINDOW, "{sightings}");
    }

    /// A piece found since it was kept is spared, and an older one that
    /// was not found goes first.
    #[test]
    fn a_piece_found_again_gets_a_second_chance() {
        let mut cache = SegmentCache::default();
        fill_with_quarters(&mut cache, 1);
        assert!(cache.get(0).is_some());
        assert_eq!(cache.victims(10), Some(vec![1]));
        for _ in 0..3 {
            cache.sight(9);
        }
        cache.keep(9, piece(10), false);
        assert!(cache.by_text.contains_key(&0) && !cache.by_text.contains_key(&1));
        // The chance is spent: the oldest goes first again.
        assert_eq!(cache.victims(KEPT_IDS / 4), Some(vec![0]));
    }

    /// Admitted on a guess of its size, a piece is kept at its real one.
    #[test]
    fn a_piece_encoded_to_be_kept_is_kept_however_many_ids_it_has() {
        let p = pieces();
        {
            let mut cache = p.lock();
            cache.sight(1);
            cache.keep(1, piece(KEPT_IDS - 2_000), false);
        }
        // 4,000 bytes, guessed at 1,000 ids (it fits), encoded as 3,000.
        let dense = |text: &str| Ok(vec![7; text.len() * 3 / 4]);
        let long = "tea ".repeat(1_000);
        let ids = p
            .encode(&format!("<|im_start|>{long}"), dense, |_| true)
            .unwrap();
        assert_eq!(ids.len(), 1 + 3_000);
        let mut cache = p.lock();
        assert_eq!(cache.hits + cache.misses, 1);
        let key = xxh3_128_with_seed(long.as_bytes(), segment_seed());
        assert!(cache.get(key).is_some(), "kept");
        assert!(cache.get(1).is_none(), "room was made");
    }

    #[test]
    fn one_refusal_in_a_while_is_encoded_so_that_the_cost_keeps_learning() {
        let cost = EncodeCost::default();
        let left = Duration::from_millis(5);
        assert!(!cost.refuses(1_000, left), "0.55 ms: within");
        // 5 ms predicted: within half as much again as what is left.
        assert!(!cost.refuses(9_000, left));
        let refused = (0..ENCODE_ANYWAY_EVERY)
            .filter(|_| cost.refuses(1_000_000, left))
            .count() as u64;
        assert_eq!(refused, ENCODE_ANYWAY_EVERY - 1);
    }

    #[test]
    fn a_slow_sample_moves_the_cost_at_most_twofold() {
        let cost = EncodeCost::default();
        let prior = cost.of(1_000_000);
        cost.learn(1_000_000, Duration::from_secs(60));
        let after = cost.of(1_000_000);
        // One eighth of the way to twice the prior.
        assert_eq!(after.as_micros(), (prior.as_micros() * 9) / 8);
    }

    #[test]
    fn the_encoding_cost_is_learnt_from_long_encodings_only() {
        let cost = EncodeCost::default();
        let prior = cost.of(1_000_000);
        cost.learn(100, Duration::from_secs(1));
        assert_eq!(
            cost.of(1_000_000),
            prior,
            "a short one is mostly fixed cost"
        );
        for _ in 0..100 {
            cost.learn(1_000_000, Duration::from_millis(100));
        }
        let learnt = cost.of(1_000_000).as_secs_f64();
        assert!((0.095..0.105).contains(&learnt), "{learnt}");
    }
}
