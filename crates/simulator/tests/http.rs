//! End-to-end tests of the simulator over real HTTP.

use std::time::{Duration, Instant};

use kinference_simulator::{MetricsMode, SimConfig, SimHandle, StreamHeaders, spawn};
use reqwest::{Client, Response, StatusCode};
use serde_json::{Value, json};

async fn start(cfg: SimConfig) -> SimHandle {
    spawn(cfg, "127.0.0.1:0".parse().unwrap()).await.unwrap()
}

/// A fast server: delays at 1% of nominal.
fn fast(name: &str) -> SimConfig {
    SimConfig {
        time_scale: 0.01,
        ..SimConfig::new(name, ["m1", "m2"])
    }
}

fn client() -> Client {
    Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

async fn post(sim: &SimHandle, path: &str, body: Value) -> Response {
    client()
        .post(format!("{}{path}", sim.base_url()))
        .json(&body)
        .send()
        .await
        .unwrap()
}

fn header<'a>(resp: &'a Response, name: &str) -> &'a str {
    resp.headers()
        .get(name)
        .unwrap_or_else(|| panic!("missing header {name}"))
        .to_str()
        .unwrap()
}

fn header_f64(resp: &Response, name: &str) -> f64 {
    header(resp, name).parse().unwrap()
}

async fn metrics_text(sim: &SimHandle) -> String {
    let resp = client()
        .get(format!("{}/metrics", sim.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    resp.text().await.unwrap()
}

/// Value of the first sample whose series starts with `series` (name plus
/// the opening of its labels, e.g. `vllm:num_requests_waiting{`).
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit_once(' '))
        .map(|(_, v)| v.parse().unwrap())
        .unwrap_or_else(|| panic!("no sample {series} in\n{text}"))
}

/// Data payloads of an SSE body, in order.
fn sse_payloads(body: &str) -> Vec<&str> {
    body.split("\n\n")
        .filter(|frame| !frame.is_empty())
        .map(|frame| {
            frame
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .unwrap_or_else(|| panic!("frame without data: {frame:?}"))
        })
        .collect()
}

async fn wait_until(what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn completions_shape() {
    let sim = start(fast("pod-a")).await;
    let resp = post(
        &sim,
        "/v1/completions",
        json!({"model": "m1", "prompt": "Say something nice about routers.", "max_tokens": 5}),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "x-sim-server"), "pod-a");
    assert!(header_f64(&resp, "x-sim-ttft-ms") > 0.0);
    assert_eq!(header(&resp, "x-sim-prompt-tokens"), "9"); // 33 chars
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "m1");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(
        choice["text"].as_str().unwrap().split_whitespace().count(),
        5
    );
    assert_eq!(v["usage"]["prompt_tokens"], 9);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["total_tokens"], 14);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let stats = sim.stats();
    assert_eq!(stats.requests_served, 1);
    assert_eq!(stats.requests_completed, 1);
    assert_eq!(stats.completion_tokens, 5);
    assert_eq!(stats.requests_by_model.get("m1"), Some(&1));
    assert_eq!(stats.requests_by_api.get("completions"), Some(&1));
}

#[tokio::test]
async fn chat_shape_and_default_max_tokens() {
    let sim = start(fast("pod-a")).await;
    let resp = post(
        &sim,
        "/v1/chat/completions",
        json!({"model": "m2", "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]}
        ]}),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "m2");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let message = &v["choices"][0]["message"];
    assert_eq!(message["role"], "assistant");
    let default = SimConfig::default().default_max_tokens as usize;
    assert_eq!(
        message["content"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .count(),
        default
    );
    assert_eq!(v["usage"]["completion_tokens"], default);
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());

    // max_completion_tokens wins over max_tokens.
    let v: Value = post(
        &sim,
        "/v1/chat/completions",
        json!({"model": "m2", "max_tokens": 9, "max_completion_tokens": 3,
               "messages": [{"role": "user", "content": "x"}]}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(sim.stats().requests_by_model.get("m2"), Some(&2));
}

/// A second of prefill in real time, then fast decoding.
fn one_second_prefill(stream_headers: StreamHeaders) -> SimConfig {
    SimConfig {
        time_scale: 1.0,
        base_latency_ms: 1_000.0,
        decode_tokens_per_sec: 1_000.0,
        stream_headers,
        ..fast("s")
    }
}

/// Like vLLM's server by default: a streamed answer's status and headers
/// come at admission and its first event (the chat role chunk) with its
/// first token, a second of prefill later. `FirstToken` sends both together,
/// with the `x-sim-*` timing headers.
#[tokio::test]
async fn a_streamed_answers_headers_come_at_admission_unless_told_otherwise() {
    for mode in [StreamHeaders::Admission, StreamHeaders::FirstToken] {
        let sim = start(one_second_prefill(mode)).await;
        let started = Instant::now();
        let mut resp = post(
            &sim,
            "/v1/chat/completions",
            json!({"model": "m1", "stream": true, "max_tokens": 2,
                   "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
        let headers_at = started.elapsed();
        assert_eq!(resp.status(), StatusCode::OK, "{mode:?}");
        let first = resp.chunk().await.unwrap().expect("a first event");
        let first_at = started.elapsed();
        let first = String::from_utf8_lossy(&first);
        assert!(first.contains(r#""role":"assistant""#), "{mode:?}: {first}");
        match mode {
            StreamHeaders::Admission => {
                assert!(resp.headers().get("x-sim-ttft-ms").is_none());
                assert!(
                    first_at - headers_at >= Duration::from_millis(900),
                    "the prefill lies between headers ({headers_at:?}) and first event ({first_at:?})"
                );
            }
            StreamHeaders::FirstToken => {
                assert!(header_f64(&resp, "x-sim-ttft-ms") >= 1_000.0);
                assert!(headers_at >= Duration::from_secs(1), "{headers_at:?}");
            }
        }
        resp.text().await.unwrap();
        sim.shutdown().await;
    }
}

/// A Responses stream's `response.created` goes out at admission, as
/// vLLM's does; its first token comes after the prefill.
#[tokio::test]
async fn a_responses_stream_is_created_at_admission() {
    let sim = start(one_second_prefill(StreamHeaders::Admission)).await;
    let started = Instant::now();
    let mut resp = post(
        &sim,
        "/v1/responses",
        json!({"model": "m1", "stream": true, "max_output_tokens": 2, "input": "hi"}),
    )
    .await;
    let created = resp.chunk().await.unwrap().expect("an event");
    let created_at = started.elapsed();
    assert!(String::from_utf8_lossy(&created).starts_with("event: response.created\n"));
    let delta = resp.chunk().await.unwrap().expect("an event");
    assert!(String::from_utf8_lossy(&delta).starts_with("event: response.output_text.delta\n"));
    assert!(started.elapsed() - created_at >= Duration::from_millis(900));
    resp.text().await.unwrap();
    sim.shutdown().await;
}

#[tokio::test]
async fn chat_stream_ends_with_done() {
    let sim = start(fast("s")).await;
    let resp = post(
        &sim,
        "/v1/chat/completions",
        json!({"model": "m1", "stream": true, "max_tokens": 4,
               "stream_options": {"include_usage": true},
               "messages": [{"role": "user", "content": "stream please"}]}),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(header(&resp, "content-type").starts_with("text/event-stream"));
    // Sent at admission, the headers cannot know the TTFT.
    assert!(resp.headers().get("x-sim-ttft-ms").is_none());
    let body = resp.text().await.unwrap();
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    let payloads = sse_payloads(&body);
    assert_eq!(payloads.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = payloads[..payloads.len() - 1]
        .iter()
        .map(|p| serde_json::from_str(p).unwrap())
        .collect();
    // role chunk, 4 tokens, finish chunk, usage chunk
    assert_eq!(chunks.len(), 7);
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks[1..5]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(text.split_whitespace().count(), 4);
    assert_eq!(chunks[5]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[6]["choices"], json!([]));
    assert_eq!(chunks[6]["usage"]["completion_tokens"], 4);
    assert!(chunks[6]["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());

    // Without include_usage there is no usage chunk.
    let body = post(
        &sim,
        "/v1/chat/completions",
        json!({"model": "m1", "stream": true, "max_tokens": 2,
               "messages": [{"role": "user", "content": "x"}]}),
    )
    .await
    .text()
    .await
    .unwrap();
    let payloads = sse_payloads(&body);
    assert_eq!(payloads.len(), 1 + 2 + 1 + 1);
    assert!(!body.contains("\"usage\""));
    assert_eq!(sim.stats().requests_completed, 2);
}

#[tokio::test]
async fn completions_stream() {
    let sim = start(fast("s")).await;
    let body = post(
        &sim,
        "/v1/completions",
        json!({"model": "m1", "stream": true, "max_tokens": 3, "prompt": "abc"}),
    )
    .await
    .text()
    .await
    .unwrap();
    let payloads = sse_payloads(&body);
    assert_eq!(payloads.len(), 3 + 1 + 1);
    assert_eq!(payloads[4], "[DONE]");
    for p in &payloads[..3] {
        let v: Value = serde_json::from_str(p).unwrap();
        assert_eq!(v["object"], "text_completion");
        assert!(!v["choices"][0]["text"].as_str().unwrap().is_empty());
    }
    let last: Value = serde_json::from_str(payloads[3]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn embeddings_shape() {
    let sim = start(fast("s")).await;
    let v: Value = post(
        &sim,
        "/v1/embeddings",
        json!({"model": "m1", "input": ["first text", "second text"]}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "m1");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data[1]["index"], 1);
    assert_eq!(data[0]["object"], "embedding");
    let dims = SimConfig::default().embedding_dims;
    assert_eq!(data[0]["embedding"].as_array().unwrap().len(), dims);
    assert_ne!(data[0]["embedding"], data[1]["embedding"]);
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0);

    let v: Value = post(
        &sim,
        "/v1/embeddings",
        json!({"model": "m1", "input": "x", "encoding_format": "base64", "dimensions": 3}),
    )
    .await
    .json()
    .await
    .unwrap();
    // 3 floats = 12 bytes = 16 base64 characters.
    assert_eq!(v["data"][0]["embedding"].as_str().unwrap().len(), 16);
    assert_eq!(sim.stats().requests_by_api.get("embeddings"), Some(&2));
}

#[tokio::test]
async fn responses_shape_and_stream() {
    let sim = start(fast("s")).await;
    let v: Value = post(
        &sim,
        "/v1/responses",
        json!({"model": "m1", "instructions": "be kind", "input": "hello", "max_output_tokens": 3}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert!(v["id"].as_str().unwrap().starts_with("resp-"));
    let content = &v["output"][0]["content"][0];
    assert_eq!(v["output"][0]["type"], "message");
    assert_eq!(v["output"][0]["role"], "assistant");
    assert_eq!(content["type"], "output_text");
    assert_eq!(
        content["text"].as_str().unwrap().split_whitespace().count(),
        3
    );
    assert_eq!(v["usage"]["output_tokens"], 3);
    assert!(v["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert!(v["usage"]["input_tokens_details"]["cached_tokens"].is_u64());

    let body = post(
        &sim,
        "/v1/responses",
        json!({"model": "m1", "stream": true, "max_output_tokens": 2,
               "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}),
    )
    .await
    .text()
    .await
    .unwrap();
    assert!(body.starts_with("event: response.created\n"));
    let payloads = sse_payloads(&body);
    assert_eq!(payloads.last(), Some(&"[DONE]"));
    let events: Vec<Value> = payloads[..payloads.len() - 1]
        .iter()
        .map(|p| serde_json::from_str(p).unwrap())
        .collect();
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        [
            "response.created",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.completed"
        ]
    );
    let done = &events[3]["response"];
    assert_eq!(done["status"], "completed");
    assert_eq!(done["usage"]["output_tokens"], 2);
    let deltas: String = events[1..3]
        .iter()
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(done["output"][0]["content"][0]["text"], deltas.as_str());
}

#[tokio::test]
async fn models_list() {
    let sim = start(SimConfig {
        lora_adapters: vec!["sql-lora".into()],
        ..fast("s")
    })
    .await;
    let resp = client()
        .get(format!("{}/v1/models", sim.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "list");
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["m1", "m2", "sql-lora"]);
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["owned_by"], "s");
    assert_eq!(v["data"][2]["parent"], "m1");
    assert_eq!(v["data"][0]["parent"], Value::Null);
}

#[tokio::test]
async fn errors_are_openai_shaped() {
    let sim = start(fast("s")).await;
    let resp = post(
        &sim,
        "/v1/chat/completions",
        json!({"model": "nope", "messages": []}),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    assert_eq!(header(&resp, "x-sim-server"), "s");
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["message"].as_str().unwrap().contains("nope"));

    let bad_json = client()
        .post(format!("{}/v1/completions", sim.base_url()))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(bad_json.status(), StatusCode::BAD_REQUEST);
    let v: Value = bad_json.json().await.unwrap();
    assert!(v["error"]["message"].is_string());

    let missing_model = post(&sim, "/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(missing_model.status(), StatusCode::BAD_REQUEST);

    let unknown_path = post(&sim, "/v1/nothing", json!({})).await;
    assert_eq!(unknown_path.status(), StatusCode::NOT_FOUND);
    let v: Value = unknown_path.json().await.unwrap();
    assert!(v["error"]["message"].is_string());

    assert_eq!(sim.stats().requests_rejected, 4);
    assert_eq!(sim.stats().requests_served, 0);
}

#[tokio::test]
async fn context_window_and_injected_errors() {
    let sim = start(SimConfig {
        max_model_len: Some(100),
        ..fast("s")
    })
    .await;
    let resp = post(
        &sim,
        "/v1/completions",
        json!({"model": "m1", "prompt": "x".repeat(400), "max_tokens": 1}),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded");

    sim.set_error_status(Some(500));
    let resp = post(
        &sim,
        "/v1/completions",
        json!({"model": "m1", "prompt": "x"}),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["type"], "server_error");
    sim.set_error_status(Some(429));
    let resp = post(
        &sim,
        "/v1/completions",
        json!({"model": "m1", "prompt": "x"}),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    sim.set_error_status(None);
    let resp = post(
        &sim,
        "/v1/completions",
        json!({"model": "m1", "prompt": "x"}),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
}

#[tokio::test]
async fn oversized_body_is_rejected() {
    let sim = start(SimConfig {
        max_body_bytes: 1_000,
        ..fast("s")
    })
    .await;
    let resp = post(
        &sim,
        "/v1/completions",
        json!({"model": "m1", "prompt": "x".repeat(2_000)}),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "request_too_large");
    assert_eq!(sim.stats().requests_rejected, 1);
}

#[tokio::test]
async fn api_key_is_enforced() {
    let sim = start(SimConfig {
        api_key: Some("sk-test".into()),
        ..fast("s")
    })
    .await;
    let url = format!("{}/v1/completions", sim.base_url());
    let body = json!({"model": "m1", "prompt": "hi", "max_tokens": 1});

    let missing = client().post(&url).json(&body).send().await.unwrap();
    assert_eq!(missing.status(), StatusCode::UNAUTHORIZED);
    let v: Value = missing.json().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_api_key");

    let wrong = client()
        .post(&url)
        .bearer_auth("sk-wrong")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);

    let models = client()
        .get(format!("{}/v1/models", sim.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), StatusCode::UNAUTHORIZED);

    let ok = client()
        .post(&url)
        .bearer_auth("sk-test")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), StatusCode::OK);

    // Operational endpoints stay open, as in vLLM.
    let health = client()
        .get(format!("{}/health", sim.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), StatusCode::OK);
    metrics_text(&sim).await;
}

#[tokio::test]
async fn prefix_cache_hit_skips_prefill() {
    let sim = start(fast("s")).await;
    // 20,000 characters of varied text: 5,000 tokens, 312 full 64-char blocks.
    let prompt: String = (0..1000)
        .map(|i| format!("Sentence number {i:05} of a long shared system prompt. "))
        .collect::<String>()
        .chars()
        .take(20_000)
        .collect();
    let send = |prompt: String| {
        let sim = &sim;
        async move {
            let resp = post(
                sim,
                "/v1/completions",
                json!({"model": "m1", "prompt": prompt, "max_tokens": 1}),
            )
            .await;
            assert_eq!(resp.status(), StatusCode::OK);
            let ttft = header_f64(&resp, "x-sim-ttft-ms");
            let prefill = header_f64(&resp, "x-sim-prefill-ms");
            let cached_header: u64 = header(&resp, "x-sim-cached-tokens").parse().unwrap();
            let v: Value = resp.json().await.unwrap();
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            assert_eq!(cached, cached_header);
            assert_eq!(v["usage"]["prompt_tokens"], 5000);
            (cached, ttft, prefill)
        }
    };

    let (cold_cached, cold_ttft, cold_prefill) = send(prompt.clone()).await;
    assert_eq!(cold_cached, 0);
    let (warm_cached, warm_ttft, warm_prefill) = send(prompt.clone()).await;
    assert_eq!(warm_cached, 312 * 16);
    // Nominal: 10 ms + 5000 tok / 10k tok/s = 510 ms cold, 10.8 ms warm; x0.01.
    assert!((cold_prefill - 5.1).abs() < 0.01, "{cold_prefill}");
    assert!((warm_prefill - 0.108).abs() < 0.01, "{warm_prefill}");
    assert!(
        warm_ttft < cold_ttft,
        "warm {warm_ttft} ms vs cold {cold_ttft} ms"
    );

    // A prompt sharing only the first half hits only the first half's blocks.
    let mut half = prompt[..10_000].to_owned();
    half.push_str(&"0123456789".repeat(1000));
    let (half_cached, _, _) = send(half).await;
    assert_eq!(half_cached, (10_000 / 64) * 16);

    // Another model does not share the cache.
    let resp = post(
        &sim,
        "/v1/completions",
        json!({"model": "m2", "prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(header(&resp, "x-sim-cached-tokens"), "0");

    let stats = sim.stats();
    assert_eq!(stats.cached_prompt_tokens, 312 * 16 + (10_000 / 64) * 16);
    assert!(stats.prefix_cache_blocks_used > 312);
    let text = metrics_text(&sim).await;
    assert_eq!(
        sample(&text, "vllm:prefix_cache_hits_total{model_name=\"m1\"}"),
        stats.cached_prompt_tokens as f64
    );
}

#[tokio::test]
async fn large_prompt_body() {
    let sim = start(SimConfig {
        time_scale: 0.0,
        ..fast("s")
    })
    .await;
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(5_000); // 225 KB
    for round in 0..3 {
        let resp = post(
            &sim,
            "/v1/chat/completions",
            json!({"model": "m1", "max_tokens": 2,
                   "messages": [{"role": "user", "content": prompt}]}),
        )
        .await;
        assert_eq!(resp.status(), StatusCode::OK);
        let v: Value = resp.json().await.unwrap();
        let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!((56_250..56_270).contains(&prompt_tokens), "{prompt_tokens}");
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        if round == 0 {
            assert_eq!(cached, 0);
        } else {
            assert!(cached > 56_000, "{cached}");
        }
    }
}

#[tokio::test]
async fn metrics_follow_the_queue() {
    let sim = start(SimConfig {
        max_concurrency: 1,
        decode_tokens_per_sec: 100.0,
        time_scale: 1.0,
        kv_capacity_tokens: 1_000,
        ..SimConfig::new("s", ["m1"])
    })
    .await;
    let text = metrics_text(&sim).await;
    for name in [
        "vllm:num_requests_waiting{model_name=\"m1\"}",
        "vllm:num_requests_running{model_name=\"m1\"}",
        "vllm:kv_cache_usage_perc{model_name=\"m1\"}",
        "vllm:cache_config_info{",
        "vllm:lora_requests_info{",
        "vllm:time_to_first_token_seconds_bucket{",
        "vllm:time_to_first_token_seconds_count{model_name=\"m1\"}",
        "vllm:prompt_tokens_total{model_name=\"m1\"}",
        "vllm:prefix_cache_hits_total{model_name=\"m1\"}",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
    assert!(text.contains("block_size=\"16\""));
    assert!(text.contains("num_gpu_blocks=\"62\""));
    assert_eq!(sample(&text, "vllm:num_requests_waiting{"), 0.0);

    // Each request decodes 30 tokens at 100 tok/s: ~0.3 s in its slot.
    let body = json!({"model": "m1", "prompt": "x".repeat(400), "max_tokens": 30});
    let requests: Vec<_> = (0..3)
        .map(|_| {
            let url = format!("{}/v1/completions", sim.base_url());
            let body = body.clone();
            tokio::spawn(async move { client().post(url).json(&body).send().await })
        })
        .collect();
    wait_until("a waiting request", async || {
        sample(&metrics_text(&sim).await, "vllm:num_requests_waiting{") >= 1.0
    })
    .await;
    let text = metrics_text(&sim).await;
    assert_eq!(sample(&text, "vllm:num_requests_running{"), 1.0);
    // 100 prompt + 30 output tokens of 1000.
    assert_eq!(sample(&text, "vllm:kv_cache_usage_perc{"), 0.13);
    assert!(sim.stats().waiting >= 1);

    let mut ttfts = Vec::new();
    for r in requests {
        let resp = r.await.unwrap().unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        ttfts.push(header_f64(&resp, "x-sim-queue-ms"));
    }
    // Someone queued behind a whole request.
    assert!(ttfts.iter().any(|&q| q > 250.0), "{ttfts:?}");

    let text = metrics_text(&sim).await;
    assert_eq!(sample(&text, "vllm:num_requests_waiting{"), 0.0);
    assert_eq!(sample(&text, "vllm:num_requests_running{"), 0.0);
    assert_eq!(sample(&text, "vllm:kv_cache_usage_perc{"), 0.0);
    assert_eq!(sample(&text, "vllm:prompt_tokens_total{"), 300.0);
    assert_eq!(sample(&text, "vllm:generation_tokens_total{"), 90.0);
    assert_eq!(sample(&text, "vllm:request_success_total{"), 3.0);
    assert_eq!(
        sample(&text, "vllm:time_to_first_token_seconds_count{"),
        3.0
    );
    assert!(sample(&text, "vllm:time_to_first_token_seconds_sum{") > 0.25);
}

#[tokio::test]
async fn lora_adapters_in_metrics() {
    let sim = start(SimConfig {
        lora_adapters: vec!["sql-lora".into()],
        max_lora: 2,
        decode_tokens_per_sec: 20.0,
        time_scale: 1.0,
        ..SimConfig::new("s", ["base"])
    })
    .await;
    let url = format!("{}/v1/completions", sim.base_url());
    let req = tokio::spawn(
        client()
            .post(url)
            .json(&json!({"model": "sql-lora", "prompt": "select", "max_tokens": 10}))
            .send(),
    );
    wait_until("the adapter to run", async || {
        metrics_text(&sim)
            .await
            .contains("running_lora_adapters=\"sql-lora\"")
    })
    .await;
    let text = metrics_text(&sim).await;
    assert!(text.contains("max_lora=\"2\""));
    assert!(sample(&text, "vllm:lora_requests_info{") > 1.6e9);
    assert_eq!(req.await.unwrap().unwrap().status(), StatusCode::OK);
    assert!(
        metrics_text(&sim)
            .await
            .contains("running_lora_adapters=\"\"")
    );
    let stats = sim.stats();
    assert_eq!(stats.requests_by_model.get("sql-lora"), Some(&1));
    // LoRA traffic counts under the base model's metrics.
    assert_eq!(
        sample(
            &metrics_text(&sim).await,
            "vllm:request_success_total{model_name=\"base\"}"
        ),
        1.0
    );
}

#[tokio::test]
async fn metrics_modes() {
    let sim = start(fast("s")).await;
    let url = format!("{}/metrics", sim.base_url());
    let get = || client().get(&url).send();

    sim.set_metrics_available(false);
    assert_eq!(sim.metrics_mode(), MetricsMode::Unavailable);
    assert_eq!(
        get().await.unwrap().status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    sim.set_metrics_available(true);
    assert_eq!(get().await.unwrap().status(), StatusCode::OK);

    // Frozen: values stop moving while traffic continues.
    sim.set_metrics_frozen(true);
    post(
        &sim,
        "/v1/completions",
        json!({"model": "m1", "prompt": "abcd"}),
    )
    .await;
    let frozen = metrics_text(&sim).await;
    assert_eq!(
        sample(&frozen, "vllm:prompt_tokens_total{model_name=\"m1\"}"),
        0.0
    );
    sim.set_metrics_frozen(false);
    let live = metrics_text(&sim).await;
    assert_eq!(
        sample(&live, "vllm:prompt_tokens_total{model_name=\"m1\"}"),
        1.0
    );

    // Hang: no answer until the mode changes.
    sim.set_metrics_mode(MetricsMode::Hang);
    let short = Client::builder()
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let err = short.get(&url).send().await.unwrap_err();
    assert!(err.is_timeout(), "{err}");
    let pending = tokio::spawn(client().get(&url).send());
    wait_until("the hanging scrape to arrive", async || {
        sim.stats().metrics_requests >= 6
    })
    .await;
    sim.set_metrics_mode(MetricsMode::Live);
    assert_eq!(pending.await.unwrap().unwrap().status(), StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_resets_connections() {
    let sim = start(SimConfig {
        decode_tokens_per_sec: 10.0,
        time_scale: 1.0,
        ..SimConfig::new("s", ["m1"])
    })
    .await;
    let base = sim.base_url();
    // Warm a pooled keep-alive connection.
    let c = client();
    assert!(c.get(format!("{base}/health")).send().await.is_ok());

    // A 5 s request in flight, and a streaming one.
    let slow = tokio::spawn(
        c.post(format!("{base}/v1/completions"))
            .json(&json!({"model": "m1", "prompt": "x", "max_tokens": 50}))
            .send(),
    );
    let streaming = c
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "m1", "prompt": "x", "max_tokens": 50, "stream": true}))
        .send()
        .await
        .unwrap();
    wait_until("both requests to run", async || sim.stats().running == 2).await;

    sim.kill();
    let started = tokio::time::Instant::now();
    assert!(slow.await.unwrap().is_err(), "in-flight request must fail");
    assert!(streaming.text().await.is_err(), "stream must be cut");
    assert!(started.elapsed() < Duration::from_secs(2));

    assert!(c.get(format!("{base}/health")).send().await.is_err());
    assert!(client().get(format!("{base}/health")).send().await.is_err());
    // Idempotent, and stats still work.
    sim.kill();
    assert_eq!(sim.stats().requests_completed, 0);
}

#[tokio::test]
async fn graceful_shutdown_finishes_in_flight() {
    let sim = start(SimConfig {
        decode_tokens_per_sec: 100.0,
        time_scale: 1.0,
        ..SimConfig::new("s", ["m1"])
    })
    .await;
    let base = sim.base_url();
    let in_flight = tokio::spawn(
        client()
            .post(format!("{base}/v1/completions"))
            .json(&json!({"model": "m1", "prompt": "x", "max_tokens": 20}))
            .send(),
    );
    wait_until("the request to run", async || sim.stats().running == 1).await;
    sim.shutdown().await;
    let resp = in_flight.await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(client().get(format!("{base}/health")).send().await.is_err());
    assert_eq!(sim.stats().requests_completed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnected_client_frees_its_slot() {
    let sim = start(SimConfig {
        max_concurrency: 1,
        decode_tokens_per_sec: 10.0,
        time_scale: 1.0,
        ..SimConfig::new("s", ["m1"])
    })
    .await;
    let base = sim.base_url();
    let mut stream = client()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "m1", "prompt": "x", "max_tokens": 100, "stream": true}))
        .send()
        .await
        .unwrap();
    assert!(stream.chunk().await.unwrap().is_some());
    drop(stream);
    wait_until("the slot to be released", async || sim.stats().running == 0).await;

    // A non-streamed request whose client gives up while queued or running.
    let impatient = Client::builder()
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let err = impatient
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "m1", "prompt": "x", "max_tokens": 100}))
        .send()
        .await
        .unwrap_err();
    assert!(err.is_timeout());
    wait_until("the slot to be released", async || {
        let s = sim.stats();
        s.running == 0 && s.waiting == 0
    })
    .await;
    assert_eq!(sim.stats().requests_completed, 0);
}

#[tokio::test]
async fn many_servers_in_one_process() {
    let mut sims = Vec::new();
    for i in 0..8 {
        sims.push(start(fast(&format!("pod-{i}"))).await);
    }
    let c = client();
    for sim in &sims {
        let resp = c
            .post(format!("{}/v1/completions", sim.base_url()))
            .json(&json!({"model": "m1", "prompt": "hi", "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(header(&resp, "x-sim-server"), sim.name());
    }
    for sim in &sims {
        sim.shutdown().await;
    }
}

#[tokio::test]
async fn invalid_config_is_rejected() {
    let err = spawn(
        SimConfig {
            models: vec![],
            ..SimConfig::default()
        },
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
}

#[test]
fn handle_is_send_and_sync() {
    fn check<T: Send + Sync + 'static>() {}
    check::<SimHandle>();
    check::<SimConfig>();
}
