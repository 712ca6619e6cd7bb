//! A model's own tokenizer, as vLLM applies it: the chat template rendered
//! by a Jinja engine with the settings `transformers` uses, then the
//! `tokenizer.json` encoding without added special tokens (the template
//! writes them); a completion prompt is encoded with them.
//!
//! Loaded from a directory laid out as a Hugging Face model repository:
//! `tokenizer.json`, and the chat template in `chat_template.jinja` or in
//! `tokenizer_config.json`'s `chat_template`.

use std::path::{Path, PathBuf};

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
            tokenizer,
            templates,
            bos_token: config.bos_token.map(SpecialToken::text).unwrap_or_default(),
            eos_token: config.eos_token.map(SpecialToken::text).unwrap_or_default(),
            dir: dir.into(),
        })
    }

    /// The token ids vLLM computes for `prompt`.
    pub fn tokens(&self, prompt: &PromptText) -> Result<Vec<u32>, TokenizeError> {
        let (text, special) = if prompt.messages.is_empty() {
            // The parser ends the prompt with a line break of its own.
            let text = prompt.text.strip_suffix('\n').unwrap_or(&prompt.text);
            (std::borrow::Cow::Borrowed(text), true)
        } else {
            (std::borrow::Cow::Owned(self.render_chat(prompt)?), false)
        };
        let encoding = self
            .tokenizer
            .encode_fast(text.as_ref(), special)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
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
