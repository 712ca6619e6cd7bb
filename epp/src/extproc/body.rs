//! The OpenAI-style request body: parsed once, borrowing from the buffer so a
//! 220 KB prompt is not copied field by field.

use std::borrow::Cow;

use kinference_tokenizer::PromptText;
use serde::Deserialize;
use serde_json::value::RawValue;

/// Which OpenAI API a path belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
    Embeddings,
    Responses,
}

impl Api {
    pub(crate) fn from_path(path: &str) -> Option<Self> {
        Some(match path_only(path).trim_end_matches('/') {
            "/v1/chat/completions" => Api::Chat,
            "/v1/completions" => Api::Completions,
            "/v1/embeddings" => Api::Embeddings,
            "/v1/responses" => Api::Responses,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Completions => "completions",
            Api::Embeddings => "embeddings",
            Api::Responses => "responses",
        }
    }
}

pub use kinference_policy::eval::path_only;

/// What routing needs from a body.
#[derive(Debug)]
pub struct ParsedBody {
    pub model: Option<String>,
    /// The prompt text, messages joined in order (for classifiers and prefix hashing).
    pub prompt: String,
    /// Chat requests: each message's role and content as byte ranges of
    /// `prompt`, for tokenizers that render the chat themselves.
    pub messages: Vec<(std::ops::Range<usize>, std::ops::Range<usize>)>,
    pub max_tokens: Option<u64>,
    pub stream: bool,
    /// The client asked, or may have asked, a stream to end with the token
    /// counts: any `stream_options` but an `include_usage` of false or null.
    /// (A missing `include_usage` means true in some vLLM releases, false
    /// in others.)
    pub stream_usage: bool,
}

#[derive(Deserialize)]
struct Wire<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<Cow<'a, str>>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    /// Read leniently: only the usage it may ask for matters here, and an
    /// odd shape is the engine's to refuse.
    #[serde(default)]
    stream_options: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Parts(#[serde(borrow)] Vec<Part<'a>>),
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BodyError {
    #[error("the request body is not valid JSON: {0}")]
    NotJson(String),
    #[error("the request body must be a JSON object")]
    NotObject,
}

impl ParsedBody {
    /// The prompt as a tokenizer reads it (a copy: tokenizing runs on
    /// another thread). The parser lays a chat out as
    /// `kinference_tokenizer::PromptText::chat` does.
    pub fn prompt_text(&self) -> PromptText {
        PromptText {
            text: self.prompt.clone(),
            messages: self.messages.clone(),
        }
    }
}

pub fn parse(bytes: &[u8]) -> Result<ParsedBody, BodyError> {
    // serde_json does not check the UTF-8 of members it skips, so without
    // this a body could parse and then fail the model rewrite, which must
    // keep every member (found by fuzzing).
    let text = std::str::from_utf8(bytes)
        .map_err(|e| BodyError::NotJson(format!("invalid UTF-8: {e}")))?;
    let bytes = text.as_bytes();
    let trimmed = bytes.trim_ascii_start();
    if !trimmed.starts_with(b"{") {
        return match serde_json::from_slice::<&RawValue>(bytes) {
            Ok(_) => Err(BodyError::NotObject),
            Err(e) => Err(BodyError::NotJson(e.to_string())),
        };
    }
    let wire: Wire<'_> =
        serde_json::from_slice(bytes).map_err(|e| BodyError::NotJson(e.to_string()))?;
    let mut prompt = String::new();
    let mut messages = Vec::new();
    if let Some(instructions) = &wire.instructions {
        push_line(&mut prompt, instructions);
    }
    for message in wire.messages.iter().flatten() {
        let mut role = prompt.len()..prompt.len();
        if let Some(r) = &message.role {
            prompt.push_str(r);
            role.end = prompt.len();
            prompt.push_str(": ");
        }
        let content_start = prompt.len();
        match &message.content {
            Some(Content::Text(t)) => push_line(&mut prompt, t),
            Some(Content::Parts(parts)) => {
                for t in parts.iter().filter_map(|p| p.text.as_deref()) {
                    push_line(&mut prompt, t);
                }
            }
            None => prompt.push('\n'),
        }
        // Without the line end each message's text is given. A message
        // with no text at all (no role, parts without text) added nothing:
        // an empty range (found by fuzzing).
        let content_end = prompt.len().saturating_sub(1).max(content_start);
        messages.push((role, content_start..content_end));
    }
    // `prompt` / `input`: a string, a list of strings, or token ids and
    // message objects, whose JSON text still identifies the prefix and sizes
    // the prompt.
    for field in [wire.prompt, wire.input].into_iter().flatten() {
        let items: Vec<&RawValue> = if field.get().starts_with('[') {
            serde_json::from_str(field.get()).map_err(|e| BodyError::NotJson(e.to_string()))?
        } else {
            vec![field]
        };
        for raw in items {
            match serde_json::from_str::<Cow<'_, str>>(raw.get()) {
                Ok(t) => push_line(&mut prompt, &t),
                Err(_) => push_line(&mut prompt, raw.get()),
            }
        }
    }
    Ok(ParsedBody {
        model: wire.model.map(Cow::into_owned).filter(|m| !m.is_empty()),
        prompt,
        messages,
        max_tokens: wire
            .max_tokens
            .or(wire.max_completion_tokens)
            .or(wire.max_output_tokens),
        stream: wire.stream.unwrap_or(false),
        stream_usage: may_ask_usage(wire.stream_options.as_ref()),
    })
}

fn may_ask_usage(stream_options: Option<&serde_json::Value>) -> bool {
    use serde_json::Value;
    match stream_options {
        None | Some(Value::Null) => false,
        Some(o) => !matches!(
            o.get("include_usage"),
            Some(Value::Bool(false) | Value::Null)
        ),
    }
}

fn push_line(out: &mut String, text: &str) {
    out.push_str(text);
    out.push('\n');
}

/// Estimated tokens: about four bytes of English text per token.
pub fn estimate_tokens(prompt: &str) -> u64 {
    (prompt.len() as u64).div_ceil(4)
}

/// The body with `model` replaced; other fields are copied as raw JSON, not
/// re-parsed, so large prompts stay cheap.
pub fn rewrite_model(bytes: &[u8], model: &str) -> Result<Vec<u8>, BodyError> {
    let ordered::Members(raw) =
        serde_json::from_slice(bytes).map_err(|e| BodyError::NotJson(e.to_string()))?;
    let mut out = Vec::with_capacity(bytes.len() + model.len());
    out.push(b'{');
    let mut wrote_model = false;
    for (i, (key, value)) in raw.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, key).expect("writing to a Vec cannot fail");
        out.push(b':');
        if key == "model" {
            serde_json::to_writer(&mut out, model).expect("writing to a Vec cannot fail");
            wrote_model = true;
        } else {
            out.extend_from_slice(value.get().as_bytes());
        }
    }
    if !wrote_model {
        if !raw.is_empty() {
            out.push(b',');
        }
        out.extend_from_slice(b"\"model\":");
        serde_json::to_writer(&mut out, model).expect("writing to a Vec cannot fail");
    }
    out.push(b'}');
    Ok(out)
}

/// Keeps object members in document order (serde_json's Map sorts them).
mod ordered {
    use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
    use serde_json::value::RawValue;

    pub(crate) struct Members(pub Vec<(String, Box<RawValue>)>);

    impl<'de> Deserialize<'de> for Members {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Members;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
                    let mut out = Vec::new();
                    while let Some((k, v)) = map.next_entry::<String, Box<RawValue>>()? {
                        out.push((k, v));
                    }
                    Ok(Members(out))
                }
            }
            d.deserialize_map(V)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_reaches_the_tokenizer_laid_out_as_it_expects() {
        let chat = parse(br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#).unwrap();
        let expected = PromptText::chat([("system", "be brief"), ("user", "hi")]);
        assert_eq!(chat.prompt_text(), expected);
        let completion = parse(br#"{"model":"m","prompt":"Once upon"}"#).unwrap();
        assert_eq!(
            completion.prompt_text(),
            PromptText::completion("Once upon")
        );
    }

    #[test]
    fn invalid_utf8_anywhere_is_refused_even_in_members_not_read() {
        // fuzz/regressions/request_body/invalid-utf8-in-skipped-member
        let body = b"{\"\":[{\"\xff\":\"\"}]}";
        assert!(matches!(parse(body), Err(BodyError::NotJson(m)) if m.contains("UTF-8")));
        let fine = "{\"model\":\"m\",\"prompt\":\"h\u{e9}llo\",\"x\":{\"\u{fc}\":1}}";
        assert_eq!(parse(fine.as_bytes()).unwrap().model.as_deref(), Some("m"));
        assert!(rewrite_model(fine.as_bytes(), "n").is_ok());
    }

    #[test]
    fn a_message_without_role_or_text_is_an_empty_span() {
        // fuzz/regressions/request_body/message-without-role-or-text
        let body = br#"{"model":"qwen","messages":[{"le":"user","content":[{"type":"text","tuxt":"hi"}]}]}"#;
        let parsed = parse(body).unwrap();
        assert_eq!(parsed.prompt, "");
        assert_eq!(parsed.messages, [(0..0, 0..0)]);
    }

    #[test]
    fn a_stream_may_ask_for_usage_unless_it_says_no() {
        let with = |options: &str| {
            let body = format!(r#"{{"model":"m","prompt":"p","stream":true{options}}}"#);
            parse(body.as_bytes()).unwrap().stream_usage
        };
        assert!(with(r#","stream_options":{"include_usage":true}"#));
        // vLLM releases differ on a missing include_usage; an odd value or
        // shape is the engine's to judge.
        assert!(with(r#","stream_options":{}"#));
        assert!(with(r#","stream_options":{"continuous_usage_stats":true}"#));
        assert!(with(r#","stream_options":{"include_usage":"true"}"#));
        assert!(with(r#","stream_options":"usage""#));
        assert!(!with(""));
        assert!(!with(r#","stream_options":null"#));
        assert!(!with(r#","stream_options":{"include_usage":false}"#));
        assert!(!with(r#","stream_options":{"include_usage":null}"#));
    }

    #[test]
    fn parses_chat_completions_responses_and_embeddings() {
        let chat = parse(br#"{"model":"qwen","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":7,"stream":true}"#).unwrap();
        assert_eq!(chat.model.as_deref(), Some("qwen"));
        assert_eq!(chat.prompt, "system: be brief\nuser: hi\n");
        let spans: Vec<(&str, &str)> = chat
            .messages
            .iter()
            .map(|(r, c)| (&chat.prompt[r.clone()], &chat.prompt[c.clone()]))
            .collect();
        assert_eq!(spans, [("system", "be brief"), ("user", "hi")]);
        assert_eq!((chat.max_tokens, chat.stream), (Some(7), true));
        let completion = parse(br#"{"model":"m","prompt":["a","b"],"max_tokens":3}"#).unwrap();
        assert_eq!(completion.prompt, "a\nb\n");
        let tokens = parse(br#"{"model":"m","prompt":[[1,2,3]]}"#).unwrap();
        assert_eq!(tokens.prompt, "[1,2,3]\n");
        let responses =
            parse(br#"{"model":"m","instructions":"sys","input":"q","max_output_tokens":9}"#)
                .unwrap();
        assert_eq!(
            (responses.prompt.as_str(), responses.max_tokens),
            ("sys\nq\n", Some(9))
        );
        let embeddings = parse(br#"{"model":"e","input":["x"]}"#).unwrap();
        assert_eq!(embeddings.prompt, "x\n");
    }

    #[test]
    fn rejects_what_is_not_a_json_object() {
        assert!(matches!(parse(b"model=qwen"), Err(BodyError::NotJson(_))));
        assert_eq!(parse(b"[1,2]").unwrap_err(), BodyError::NotObject);
        assert!(matches!(
            parse(br#"{"model": "#),
            Err(BodyError::NotJson(_))
        ));
        assert!(parse(br#"{"messages":[]}"#).unwrap().model.is_none());
    }

    #[test]
    fn rewrites_only_the_model_and_keeps_order() {
        let body = br#"{"model":"qwen","messages":[{"role":"user","content":"x \"quoted\""}],"stream":false}"#;
        let out = rewrite_model(body, "gpt-4o-mini").unwrap();
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"x \"quoted\""}],"stream":false}"#
        );
        let added = rewrite_model(br#"{"prompt":"p"}"#, "m").unwrap();
        assert_eq!(
            std::str::from_utf8(&added).unwrap(),
            r#"{"prompt":"p","model":"m"}"#
        );
    }

    #[test]
    fn maps_paths_to_apis() {
        assert_eq!(Api::from_path("/v1/chat/completions?x=1"), Some(Api::Chat));
        assert_eq!(Api::from_path("/v1/completions"), Some(Api::Completions));
        assert_eq!(Api::from_path("/v1/models"), None);
    }
}
