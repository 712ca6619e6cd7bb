//! Prompts as a model server tokenizes them, so that a router can match
//! them against the blocks the server's KV-cache events say it holds.
//!
//! - [`Tokenizer`]: a model's own Hugging Face tokenizer and chat template
//!   as vLLM applies them ([`hf`]), or llm-d-inference-sim's test
//!   tokenizer;
//! - [`PromptText`]: what a tokenizer reads of a request;
//! - [`threads`]: the threads tokenizing runs on, lowered once a job runs
//!   past its budget.
//!
//! No I/O but loading a tokenizer's files.
#![forbid(unsafe_code)]

pub mod hf;
pub mod threads;

use std::ops::Range;
use std::time::Duration;

use regex::Regex;

pub use hf::{HfTokenizer, LoadError, TokenizeError};

/// What a tokenizer reads of a request: the prompt's text, and for a chat
/// each message's role and content in it.
///
/// A chat's text is its messages in order, each `role: content` on a line
/// of its own; a completion's is its prompt followed by a line end. A
/// request parser writes the same layout ([`PromptText::chat`],
/// [`PromptText::completion`] build it from parts).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptText {
    pub text: String,
    /// Per message, the byte ranges of its role and content in `text`.
    pub messages: Vec<(Range<usize>, Range<usize>)>,
}

impl PromptText {
    /// A chat of `(role, content)` messages.
    pub fn chat<'a>(messages: impl IntoIterator<Item = (&'a str, &'a str)>) -> PromptText {
        let mut prompt = PromptText::default();
        for (role, content) in messages {
            let role_start = prompt.text.len();
            prompt.text.push_str(role);
            let role = role_start..prompt.text.len();
            prompt.text.push_str(": ");
            let content_start = prompt.text.len();
            prompt.text.push_str(content);
            prompt
                .messages
                .push((role, content_start..prompt.text.len()));
            prompt.text.push('\n');
        }
        prompt
    }

    /// A completion's prompt.
    pub fn completion(prompt: &str) -> PromptText {
        PromptText {
            text: format!("{prompt}\n"),
            messages: Vec::new(),
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
    /// and serve nothing after it (see [`hf`]).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_is_laid_out_one_message_a_line_with_its_parts_marked() {
        let p = PromptText::chat([("system", "be brief"), ("user", "hi")]);
        assert_eq!(p.text, "system: be brief\nuser: hi\n");
        let parts: Vec<_> = p
            .messages
            .iter()
            .map(|(role, content)| (&p.text[role.clone()], &p.text[content.clone()]))
            .collect();
        assert_eq!(parts, [("system", "be brief"), ("user", "hi")]);
        assert_eq!(PromptText::completion("Once").text, "Once\n");
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
        let p = PromptText::chat([("system", "be brief"), ("user", "hello")]);
        let Tokenizer::SimulatorDummy(re) = &t else {
            unreachable!()
        };
        let expected: Vec<u32> = re
            .find_iter("### system: be brief\n### user: hello\n")
            .map(|m| fnv1a_32(m.as_str()))
            .collect();
        assert_eq!(t.tokens(&p).unwrap(), expected);
        // A completion is its prompt, without the line end.
        let completion = t.tokens(&PromptText::completion("hello")).unwrap();
        assert_eq!(completion, [fnv1a_32("hello")]);
    }
}
