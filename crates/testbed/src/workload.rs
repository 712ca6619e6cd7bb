//! OpenAI chat request bodies for the load benchmarks, deterministic so that
//! every contender of a run gets the same bytes:
//!
//! - [`short_chat`]: ~1 KB chats, one of 8 system prompts and a unique user
//!   turn (the common case);
//! - [`large_prompts`]: one user turn of a given size each, all distinct
//!   (the 220 KB prompts of upstream issue #2928);
//! - [`shared_prefix`]: many users over a few long system prompts, one
//!   group optionally far more popular than the rest (prefix-aware routing).

use serde_json::json;

const WORDS: &[&str] = &[
    "the", "model", "server", "request", "latency", "token", "cache", "prefix", "gateway",
    "endpoint", "policy", "route", "queue", "answer", "summary", "report", "table", "value",
    "system", "context", "window", "prompt", "document", "review", "change", "result", "metric",
    "cluster", "please", "explain", "why", "how", "and", "with", "from", "about",
];

/// `count` words drawn by a xorshift generator seeded with `seed`.
pub fn words(seed: u64, count: usize) -> String {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::with_capacity(count * 8);
    for i in 0..count {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[(state % WORDS.len() as u64) as usize]);
    }
    out
}

/// Words from `seed` until the text holds at least `bytes` bytes.
fn text_of_size(seed: u64, bytes: usize) -> String {
    // Words average ~6 bytes with their space: draw a little more than needed.
    let mut text = words(seed, bytes / 5 + 1);
    text.truncate(bytes);
    text
}

/// A chat completion body (non-streamed unless `stream`).
pub fn chat_body(model: &str, system: &str, user: &str, max_tokens: u32, stream: bool) -> Vec<u8> {
    let mut messages = Vec::with_capacity(2);
    if !system.is_empty() {
        messages.push(json!({ "role": "system", "content": system }));
    }
    messages.push(json!({ "role": "user", "content": user }));
    let mut body = json!({
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": stream,
    });
    if stream {
        // So that a streamed answer ends with its usage, cached tokens
        // included, as a non-streamed one does.
        body["stream_options"] = json!({ "include_usage": true });
    }
    serde_json::to_vec(&body).expect("a JSON value serialises")
}

/// `count` ~1 KB chats: one of 8 system prompts, a unique user turn, 8
/// output tokens.
pub fn short_chat(model: &str, count: usize) -> Vec<Vec<u8>> {
    (0..count)
        .map(|i| {
            let group = (i % 8) as u64;
            let system = format!(
                "You are assistant {group} of the benchmark. {}.",
                words(1000 + group, 60)
            );
            let user = format!("Request {i}: {}", words(i as u64, 80));
            chat_body(model, &system, &user, 8, false)
        })
        .collect()
}

/// `count` distinct prompts of `bytes` bytes each (one user turn), 8 output
/// tokens.
pub fn large_prompts(model: &str, count: usize, bytes: usize) -> Vec<Vec<u8>> {
    (0..count)
        .map(|i| {
            let user = format!("Document {i}: {}", text_of_size(50_000 + i as u64, bytes));
            chat_body(model, "", &user, 8, false)
        })
        .collect()
}

/// The shape of a shared-prefix workload, as inference-perf's
/// `shared_prefix` data generator describes one.
#[derive(Clone, Copy, Debug)]
pub struct SharedPrefix {
    /// Distinct system prompts.
    pub groups: usize,
    /// Distinct questions per group.
    pub prompts_per_group: usize,
    /// Bytes of each system prompt.
    pub system_bytes: usize,
    /// Bytes of each question.
    pub question_bytes: usize,
    pub output_tokens: u32,
    /// Share (0..1) of requests that go to group 0: the hot-node case. At 0
    /// every group is equally likely.
    pub hot_share: f64,
}

/// One request of a shared-prefix workload.
#[derive(Clone, Debug)]
pub struct GroupRequest {
    /// Which system prompt it starts with.
    pub group: usize,
    pub body: Vec<u8>,
}

/// `count` requests of the shared-prefix workload `shape` (streamed, so a
/// client can time the first token), in a fixed pseudo-random order.
pub fn shared_prefix(model: &str, shape: &SharedPrefix, count: usize) -> Vec<GroupRequest> {
    shared_prefix_models(|_| model.to_string(), shape, count)
}

/// [`shared_prefix`] with each group's requests for model `model_of(group)`
/// (e.g. an adapter per system prompt).
pub fn shared_prefix_models(
    model_of: impl Fn(usize) -> String,
    shape: &SharedPrefix,
    count: usize,
) -> Vec<GroupRequest> {
    let systems: Vec<String> = (0..shape.groups.max(1))
        .map(|g| {
            format!(
                "System prompt {g}. {}",
                text_of_size(7_000 + g as u64, shape.system_bytes)
            )
        })
        .collect();
    let mut state: u64 = 0x2545_F491_4F6C_DD1D;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..count)
        .map(|_| {
            let roll = (next() % 10_000) as f64 / 10_000.0;
            let group = if roll < shape.hot_share {
                0
            } else {
                (next() % systems.len() as u64) as usize
            };
            let q = next() % shape.prompts_per_group.max(1) as u64;
            let question = format!(
                "Question {q} of group {group}: {}",
                text_of_size(90_000 + q * 31 + group as u64, shape.question_bytes)
            );
            GroupRequest {
                group,
                body: chat_body(
                    &model_of(group),
                    &systems[group],
                    &question,
                    shape.output_tokens,
                    true,
                ),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(body: &[u8]) -> serde_json::Value {
        serde_json::from_slice(body).unwrap()
    }

    #[test]
    fn each_group_can_ask_for_a_model_of_its_own() {
        let shape = SharedPrefix {
            groups: 4,
            prompts_per_group: 2,
            system_bytes: 100,
            question_bytes: 20,
            output_tokens: 4,
            hot_share: 0.0,
        };
        let requests = shared_prefix_models(|g| format!("lora-{g}"), &shape, 32);
        for r in &requests {
            assert_eq!(json(&r.body)["model"], format!("lora-{}", r.group));
        }
        let groups: std::collections::BTreeSet<usize> = requests.iter().map(|r| r.group).collect();
        assert_eq!(groups.len(), 4);
    }

    #[test]
    fn short_chats_are_about_a_kilobyte_and_distinct() {
        let bodies = short_chat("m", 16);
        assert!(bodies.iter().all(|b| (600..2_000).contains(&b.len())));
        assert_ne!(bodies[0], bodies[8]);
        assert_eq!(json(&bodies[3])["model"], "m");
    }

    #[test]
    fn large_prompts_have_the_requested_size() {
        let bodies = large_prompts("m", 2, 220_000);
        for b in &bodies {
            assert!((220_000..221_000).contains(&b.len()), "{}", b.len());
        }
        assert_ne!(bodies[0], bodies[1]);
    }

    #[test]
    fn a_hot_group_takes_its_share() {
        let shape = SharedPrefix {
            groups: 8,
            prompts_per_group: 10,
            system_bytes: 2_000,
            question_bytes: 100,
            output_tokens: 4,
            hot_share: 0.5,
        };
        let requests = shared_prefix("m", &shape, 1_000);
        for r in &requests {
            let system = json(&r.body)["messages"][0]["content"].clone();
            let prefix = format!("System prompt {}.", r.group);
            assert!(system.as_str().unwrap().starts_with(&prefix), "{system}");
        }
        let hot = requests.iter().filter(|r| r.group == 0).count();
        // Half by the hot share, plus its 1/8 of the rest.
        assert!((500..640).contains(&hot), "{hot}");
        let first = json(&requests[0].body);
        assert_eq!(first["stream"], true);
        assert_eq!(first["stream_options"]["include_usage"], true);
    }
}
