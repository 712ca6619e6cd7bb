//! The OpenAI-style request body: `extproc::body::parse` and
//! `extproc::body::rewrite_model` on arbitrary bytes (the input is the body).
//!
//! Checks, beyond "never panics":
//! - a valid JSON object `rewrite_model` rewrites stays valid JSON: an
//!   object whose `model` is the new name, every other member kept;
//! - a body `parse` accepts is one `rewrite_model` accepts, and re-parsing
//!   the rewritten body gives the same prompt, max tokens and stream flag,
//!   with the new model.
#![no_main]

use kinference_epp::extproc::body::{self, ParsedBody};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

/// Model names to rewrite to: plain, empty, needing escapes, non-ASCII.
const MODELS: &[&str] = &[
    "gpt-4o-mini",
    "",
    "a\"b\\c\n\u{0}\u{1f}",
    "modèle-ü-\u{10ffff}",
];

fuzz_target!(|data: &[u8]| {
    let parsed = body::parse(data);
    if let Ok(p) = &parsed {
        // Derived values are cheap and must not panic either.
        let _ = body::estimate_tokens(&p.prompt);
    }
    for model in MODELS {
        let rewritten = body::rewrite_model(data, model);
        let out = match (&parsed, rewritten) {
            (_, Ok(out)) => out,
            (Ok(_), Err(e)) => panic!("parse accepted a body rewrite_model refused: {e}"),
            (Err(_), Err(_)) => continue,
        };
        check_rewritten(data, &out, model);
        if let Ok(before) = &parsed {
            let after = body::parse(&out).unwrap_or_else(|e| {
                panic!(
                    "a rewritten body no longer parses: {e}\n{}",
                    String::from_utf8_lossy(&out)
                )
            });
            check_same_request(before, &after, model);
        }
    }
});

/// `out` is `data` with `model` set: an object with the same members.
/// Valid JSON when `data` was: `rewrite_model`, like `parse`, copies the
/// members it does not read as they are, and serde_json does not check
/// escapes inside what it skips (a lone `\udc00` passes), so such garbage
/// comes out as it went in.
fn check_rewritten(data: &[u8], out: &[u8], model: &str) {
    let Ok(Value::Object(in_map)) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let out_value: Value = serde_json::from_slice(out).unwrap_or_else(|e| {
        panic!(
            "rewrite_model turned valid JSON into invalid JSON: {e}\n{}",
            String::from_utf8_lossy(out)
        )
    });
    let Value::Object(out_map) = &out_value else {
        panic!("rewrite_model produced a non-object: {out_value}");
    };
    assert_eq!(
        out_map.get("model").and_then(Value::as_str),
        Some(model),
        "the rewritten body does not carry the new model"
    );
    // serde_json's Map keeps the last of duplicate keys, in both.
    for (key, value) in &in_map {
        if key != "model" {
            assert_eq!(out_map.get(key), Some(value), "member {key:?} changed");
        }
    }
    let expected = in_map.len() + usize::from(!in_map.contains_key("model"));
    assert_eq!(out_map.len(), expected, "members added or lost");
}

fn check_same_request(before: &ParsedBody, after: &ParsedBody, model: &str) {
    assert_eq!(before.prompt, after.prompt, "the prompt changed");
    assert_eq!(before.max_tokens, after.max_tokens, "max tokens changed");
    assert_eq!(before.stream, after.stream, "the stream flag changed");
    let expected = (!model.is_empty()).then_some(model);
    assert_eq!(after.model.as_deref(), expected, "the model did not change");
}
