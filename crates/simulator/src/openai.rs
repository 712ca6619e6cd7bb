//! OpenAI request and response shapes (the subset the simulator needs), the
//! error body, and the deterministic filler text.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::engine::Prompt;

// ---------------------------------------------------------------- requests

/// `stream_options` of chat and completions requests.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Message content: a string or a list of typed parts (only text parts count).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub(crate) struct ContentPart {
    #[serde(default)]
    pub text: Option<String>,
}

impl Content {
    fn append_to(&self, out: &mut String) {
        match self {
            Content::Text(text) => out.push_str(text),
            Content::Parts(parts) => {
                for text in parts.iter().filter_map(|p| p.text.as_deref()) {
                    out.push_str(text);
                }
            }
        }
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct Message {
    #[serde(default)]
    pub role: Option<String>,
    #[serde(default)]
    pub content: Option<Content>,
}

/// Appends `<|role|>\ncontent\n` for each message.
fn append_messages(messages: &[Message], out: &mut String) {
    for m in messages {
        out.push_str("<|");
        out.push_str(m.role.as_deref().unwrap_or("user"));
        out.push_str("|>\n");
        if let Some(content) = &m.content {
            content.append_to(out);
        }
        out.push('\n');
    }
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatRequest {
    pub model: String,
    #[serde(default)]
    pub messages: Vec<Message>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
}

impl ChatRequest {
    pub(crate) fn prompt(&self) -> Prompt {
        let mut text = String::new();
        append_messages(&self.messages, &mut text);
        text.push_str("<|assistant|>\n");
        Prompt::from_text(text)
    }
}

/// A completions prompt or an embeddings input.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Input {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u64>),
    TokenLists(Vec<Vec<u64>>),
}

impl Input {
    /// One content hash per separate input (one embedding is returned per
    /// input; equal inputs get equal embeddings).
    pub(crate) fn item_hashes(&self) -> Vec<u64> {
        fn ids(ids: &[u64]) -> u64 {
            ids.iter()
                .fold(0, |h, id| xxh3_64_with_seed(&id.to_le_bytes(), h))
        }
        match self {
            Input::Text(text) => vec![xxh3_64(text.as_bytes())],
            Input::Texts(texts) => texts.iter().map(|t| xxh3_64(t.as_bytes())).collect(),
            Input::Tokens(tokens) => vec![ids(tokens)],
            Input::TokenLists(lists) => lists.iter().map(|l| ids(l)).collect(),
        }
    }

    /// All inputs as one prompt. Token ids count one token each and are
    /// rendered as text so prefix hashing still sees them.
    pub(crate) fn prompt(&self) -> Prompt {
        fn ids(ids: &[u64], out: &mut String) {
            for id in ids {
                out.push_str(&id.to_string());
                out.push(' ');
            }
        }
        match self {
            Input::Text(text) => Prompt::from_text(text.clone()),
            Input::Texts(texts) => Prompt::from_text(texts.join("\n")),
            Input::Tokens(tokens) => {
                let mut text = String::new();
                ids(tokens, &mut text);
                Prompt {
                    text,
                    tokens: tokens.len() as u64,
                }
            }
            Input::TokenLists(lists) => {
                let mut text = String::new();
                for list in lists {
                    ids(list, &mut text);
                    text.push('\n');
                }
                Prompt {
                    text,
                    tokens: lists.iter().map(|l| l.len() as u64).sum(),
                }
            }
        }
    }
}

/// `POST /v1/completions` body.
#[derive(Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    pub model: String,
    pub prompt: Input,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
}

/// `POST /v1/embeddings` body.
#[derive(Debug, Deserialize)]
pub(crate) struct EmbeddingRequest {
    pub model: String,
    pub input: Input,
    #[serde(default)]
    pub encoding_format: Option<String>,
    #[serde(default)]
    pub dimensions: Option<usize>,
}

/// `input` of a responses request: a string or a list of message items.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum ResponsesInput {
    Text(String),
    Items(Vec<Message>),
}

/// `POST /v1/responses` body.
#[derive(Debug, Deserialize)]
pub(crate) struct ResponsesRequest {
    pub model: String,
    #[serde(default)]
    pub input: Option<ResponsesInput>,
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    #[serde(default)]
    pub stream: Option<bool>,
}

impl ResponsesRequest {
    pub(crate) fn prompt(&self) -> Prompt {
        let mut text = String::new();
        if let Some(instructions) = &self.instructions {
            text.push_str("<|system|>\n");
            text.push_str(instructions);
            text.push('\n');
        }
        match &self.input {
            Some(ResponsesInput::Text(input)) => {
                text.push_str("<|user|>\n");
                text.push_str(input);
                text.push('\n');
            }
            Some(ResponsesInput::Items(items)) => append_messages(items, &mut text),
            None => {}
        }
        text.push_str("<|assistant|>\n");
        Prompt::from_text(text)
    }
}

// ---------------------------------------------------------------- responses

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct PromptTokensDetails {
    pub cached_tokens: u64,
}

/// `usage` of chat and completions responses.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    pub prompt_tokens_details: PromptTokensDetails,
}

impl Usage {
    pub(crate) fn new(prompt_tokens: u64, completion_tokens: u64, cached_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct AssistantMessage {
    pub role: &'static str,
    pub content: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<()>,
    pub finish_reason: &'static str,
}

/// Non-streamed chat completion.
#[derive(Debug, Serialize)]
pub(crate) struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Default, Serialize)]
pub(crate) struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

#[derive(Debug, Serialize)]
pub(crate) struct ChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'static str>,
}

/// One streamed chat chunk.
#[derive(Debug, Serialize)]
pub(crate) struct ChatChunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Serialize)]
pub(crate) struct TextChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'static str>,
}

/// A completions response, or one streamed completions chunk.
#[derive(Debug, Serialize)]
pub(crate) struct TextCompletion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<TextChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// An embedding as floats, or base64 of little-endian `f32`s.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum EmbeddingValue {
    Floats(Vec<f32>),
    Base64(String),
}

#[derive(Debug, Serialize)]
pub(crate) struct Embedding {
    pub object: &'static str,
    pub index: usize,
    pub embedding: EmbeddingValue,
}

#[derive(Debug, Serialize)]
pub(crate) struct EmbeddingUsage {
    pub prompt_tokens: u64,
    pub total_tokens: u64,
}

/// `/v1/embeddings` response.
#[derive(Debug, Serialize)]
pub(crate) struct EmbeddingList {
    pub object: &'static str,
    pub data: Vec<Embedding>,
    pub model: String,
    pub usage: EmbeddingUsage,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct OutputText {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
    pub annotations: Vec<()>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct OutputMessage {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub id: String,
    pub status: &'static str,
    pub role: &'static str,
    pub content: Vec<OutputText>,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct InputTokensDetails {
    pub cached_tokens: u64,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct OutputTokensDetails {
    pub reasoning_tokens: u64,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct ResponseUsage {
    pub input_tokens: u64,
    pub input_tokens_details: InputTokensDetails,
    pub output_tokens: u64,
    pub output_tokens_details: OutputTokensDetails,
    pub total_tokens: u64,
}

impl From<Usage> for ResponseUsage {
    fn from(u: Usage) -> Self {
        Self {
            input_tokens: u.prompt_tokens,
            input_tokens_details: InputTokensDetails {
                cached_tokens: u.prompt_tokens_details.cached_tokens,
            },
            output_tokens: u.completion_tokens,
            output_tokens_details: OutputTokensDetails {
                reasoning_tokens: 0,
            },
            total_tokens: u.total_tokens,
        }
    }
}

/// `/v1/responses` response object.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ResponseObject {
    pub id: String,
    pub object: &'static str,
    pub created_at: u64,
    pub status: &'static str,
    pub model: String,
    pub output: Vec<OutputMessage>,
    pub usage: Option<ResponseUsage>,
}

/// `{"data":[...]}` entry of `GET /v1/models`.
#[derive(Debug, Serialize)]
pub(crate) struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: String,
    pub root: String,
    pub parent: Option<String>,
}

/// `GET /v1/models` response.
#[derive(Debug, Serialize)]
pub(crate) struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

// ---------------------------------------------------------------- errors

/// An OpenAI-shaped error: `{"error":{"message","type","param","code"}}`.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub code: &'static str,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<()>,
    code: &'a str,
}

impl ApiError {
    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            code: "invalid_request",
        }
    }

    /// The body could not be read (too large, broken connection, ...).
    pub(crate) fn body_rejected(status: StatusCode, message: String) -> Self {
        Self {
            status,
            message,
            kind: "invalid_request_error",
            code: if status == StatusCode::PAYLOAD_TOO_LARGE {
                "request_too_large"
            } else {
                "invalid_request"
            },
        }
    }

    pub(crate) fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "Incorrect or missing API key.".to_owned(),
            kind: "invalid_request_error",
            code: "invalid_api_key",
        }
    }

    pub(crate) fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            kind: "invalid_request_error",
            code: "model_not_found",
        }
    }

    pub(crate) fn unknown_path(path: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("Unknown path `{path}`."),
            kind: "invalid_request_error",
            code: "unknown_url",
        }
    }

    pub(crate) fn context_length(limit: u64, requested: u64) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: format!(
                "This model's maximum context length is {limit} tokens. \
                 However, you requested {requested} tokens."
            ),
            kind: "invalid_request_error",
            code: "context_length_exceeded",
        }
    }

    /// An error forced through `SimHandle::set_error_status`.
    pub(crate) fn injected(status: StatusCode) -> Self {
        Self {
            status,
            message: format!("Simulated failure ({status})."),
            kind: if status.is_server_error() {
                "server_error"
            } else {
                "invalid_request_error"
            },
            code: "simulated_error",
        }
    }

    /// The server is going away (killed or shutting down).
    pub(crate) fn unavailable() -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "The server is shutting down.".to_owned(),
            kind: "server_error",
            code: "unavailable",
        }
    }

    pub(crate) fn body(&self) -> String {
        let body = ErrorBody {
            error: ErrorDetail {
                message: &self.message,
                kind: self.kind,
                param: None,
                code: self.code,
            },
        };
        serde_json::to_string(&body).unwrap_or_default()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body();
        (
            self.status,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response()
    }
}

// ---------------------------------------------------------------- generated content

const WORDS: [&str; 16] = [
    "the",
    "quick",
    "model",
    "simulates",
    "tokens",
    "for",
    "routing",
    "tests",
    "with",
    "steady",
    "latency",
    "and",
    "a",
    "warm",
    "prefix",
    "cache",
];

/// The `i`-th output token of a response seeded by `seed`: a filler word and a space.
pub(crate) fn filler_token(seed: u64, i: u32) -> String {
    let word = WORDS[((seed as usize).wrapping_add(i as usize)) % WORDS.len()];
    format!("{word} ")
}

/// `n` filler tokens concatenated.
pub(crate) fn filler_text(seed: u64, n: u32) -> String {
    (0..n).map(|i| filler_token(seed, i)).collect()
}

/// A deterministic unit-length embedding of `dims` values derived from `seed`.
pub(crate) fn embedding(seed: u64, dims: usize) -> Vec<f32> {
    let mut state = seed | 1;
    let mut v: Vec<f32> = (0..dims)
        .map(|_| {
            // xorshift64: cheap, deterministic, good enough for filler vectors.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

/// Standard base64 (with padding) of the little-endian bytes of `values`.
pub(crate) fn base64_f32(values: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> shift) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_prompt_flattens_parts() {
        let req: ChatRequest = serde_json::from_str(
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},
                {"role":"user","content":[{"type":"text","text":"hi "},{"type":"image_url","image_url":{}},{"type":"text","text":"there"}]}]}"#,
        )
        .unwrap();
        assert_eq!(
            req.prompt().text,
            "<|system|>\nbe brief\n<|user|>\nhi there\n<|assistant|>\n"
        );
    }

    #[test]
    fn completion_inputs() {
        let tokens: Input = serde_json::from_str("[1,2,3]").unwrap();
        assert_eq!(tokens.prompt().tokens, 3);
        let texts: Input = serde_json::from_str(r#"["abcd","efgh"]"#).unwrap();
        assert_eq!(texts.item_hashes().len(), 2);
        assert_eq!(texts.prompt().tokens, 3); // 9 chars
        let lists: Input = serde_json::from_str("[[1,2],[3]]").unwrap();
        assert_eq!((lists.item_hashes().len(), lists.prompt().tokens), (2, 3));
        let same: Input = serde_json::from_str(r#"["a","b","a"]"#).unwrap();
        let h = same.item_hashes();
        assert_ne!(h[0], h[1]);
        assert_eq!(h[0], h[2]);
    }

    #[test]
    fn responses_prompt() {
        let req: ResponsesRequest =
            serde_json::from_str(r#"{"model":"m","instructions":"sys","input":"q"}"#).unwrap();
        assert_eq!(
            req.prompt().text,
            "<|system|>\nsys\n<|user|>\nq\n<|assistant|>\n"
        );
        let req: ResponsesRequest = serde_json::from_str(
            r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"q"}]}]}"#,
        )
        .unwrap();
        assert_eq!(req.prompt().text, "<|user|>\nq\n<|assistant|>\n");
    }

    #[test]
    fn base64_matches_known_values() {
        // 1.0f32 = 00 00 80 3f
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, 1.0]), "AACAPwAAgD8=");
        assert_eq!(base64_f32(&[]), "");
    }

    #[test]
    fn embeddings_are_unit_length_and_deterministic() {
        let a = embedding(42, 8);
        assert_eq!(a, embedding(42, 8));
        let norm: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5);
    }

    #[test]
    fn error_body_shape() {
        let v: serde_json::Value =
            serde_json::from_str(&ApiError::model_not_found("x").body()).unwrap();
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["message"].as_str().unwrap().contains('x'));
    }
}
