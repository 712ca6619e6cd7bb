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

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use xxhash_rust::xxh3::xxh3_128_with_seed;

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value, context};
use serde::Deserialize;

use super::tokenize::PromptText;

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
        })
    }

    /// The token ids vLLM computes for `prompt`.
    pub fn tokens(&self, prompt: &PromptText) -> Result<Vec<u32>, TokenizeError> {
        if prompt.messages.is_empty() {
            // The parser ends the prompt with a line break of its own.
            let text = prompt.text.strip_suffix('\n').unwrap_or(&prompt.text);
            // With special tokens (a BOS, for some models): encoded whole.
            return self.encode(text, true);
        }
        let chat = self.render_chat(prompt)?;
        match &self.pieces {
            Some(pieces) => pieces.encode(&chat, |text| self.encode(text, false)),
            None => self.encode(&chat, false),
        }
    }

    fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizeError> {
        let encoding = self
            .tokenizer
            .encode_fast(text, special)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Pieces encoded, and found already encoded (tests and benchmarks).
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
    /// `encode` or found kept.
    fn encode(
        &self,
        chat: &str,
        encode: impl Fn(&str) -> Result<Vec<u32>, TokenizeError>,
    ) -> Result<Vec<u32>, TokenizeError> {
        let mut out = Vec::with_capacity(chat.len() / 3);
        let mut at = 0;
        for m in self.added.find_iter(chat) {
            self.piece(&chat[at..m.start()], &encode, &mut out)?;
            out.push(self.ids[m.pattern().as_usize()]);
            at = m.end();
        }
        self.piece(&chat[at..], &encode, &mut out)?;
        Ok(out)
    }

    fn piece(
        &self,
        text: &str,
        encode: &impl Fn(&str) -> Result<Vec<u32>, TokenizeError>,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        if text.is_empty() {
            return Ok(());
        }
        if text.len() < MIN_KEPT_BYTES {
            out.extend(encode(text)?);
            return Ok(());
        }
        let key = xxh3_128_with_seed(text.as_bytes(), super::index::chain_seed());
        let kept = self.lock().get(key);
        let ids = match kept {
            Some(ids) => ids,
            None => {
                // Encoded outside the lock: other prompts go on meanwhile.
                let ids: Arc<[u32]> = encode(text)?.into();
                self.lock().keep(key, Arc::clone(&ids));
                ids
            }
        };
        out.extend_from_slice(&ids);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SegmentCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Encoded pieces by a keyed 128-bit hash of their text (a per-process
/// seed: prompts cannot be crafted to collide), the oldest forgotten past
/// [`KEPT_IDS`].
#[derive(Default)]
struct SegmentCache {
    by_text: HashMap<u128, Arc<[u32]>>,
    order: VecDeque<u128>,
    ids: usize,
    hits: u64,
    misses: u64,
}

impl SegmentCache {
    fn get(&mut self, key: u128) -> Option<Arc<[u32]>> {
        let found = self.by_text.get(&key).cloned();
        match found {
            Some(_) => self.hits += 1,
            None => self.misses += 1,
        }
        found
    }

    fn keep(&mut self, key: u128, ids: Arc<[u32]>) {
        if ids.len() > KEPT_IDS {
            return;
        }
        self.ids += ids.len();
        match self.by_text.insert(key, ids) {
            // Two prompts encoded the same piece at once.
            Some(same) => self.ids -= same.len(),
            None => self.order.push_back(key),
        }
        while self.ids > KEPT_IDS {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if let Some(gone) = self.by_text.remove(&oldest) {
                self.ids -= gone.len();
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_pieces_stay_within_their_bound_oldest_out_first() {
        let mut cache = SegmentCache::default();
        let piece = |n: usize| -> Arc<[u32]> { vec![0; n].into() };
        cache.keep(1, piece(KEPT_IDS / 2));
        cache.keep(1, piece(KEPT_IDS / 2)); // the same piece, twice
        assert_eq!(cache.ids, KEPT_IDS / 2);
        cache.keep(2, piece(KEPT_IDS / 2));
        cache.keep(3, piece(10));
        assert!(cache.ids <= KEPT_IDS);
        assert!(cache.get(1).is_none(), "the oldest went first");
        assert!(cache.get(2).is_some() && cache.get(3).is_some());
        cache.keep(4, piece(KEPT_IDS + 1));
        assert!(
            cache.get(4).is_none(),
            "larger than the whole bound: not kept"
        );
        assert_eq!((cache.misses, cache.hits), (2, 2));
    }
}
