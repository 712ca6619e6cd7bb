//! Request-path cost of precise prefix mode against the estimate it falls
//! back to, on the same prompts: tokenizing and chaining a 7 KB and a
//! 220 KB chat (with the `simulator-dummy` tokenizer, and with Qwen3's own
//! tokenizer and chat template: `bench/peers/install.sh qwen3-tokenizer`),
//! and matching a chain against 200 Pods' KV-event indexes: one pool's
//! index (what the picker walks), and a pool per Pod walked one by one. The text is
//! random letters, so a real tokenizer's word cache rarely hits: an upper
//! bound for prose.
//! `cargo bench -p kinference-epp --bench kv_events`

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kinference_epp::extproc::body;
use kinference_epp::kv_cache::PromptTokens;
use kinference_epp::kv_cache::pool::PoolIndex;
use kinference_epp::kv_cache::wire::{BlockStored, EngineBlock, EventBatch, KvEvent};
use kinference_epp::predict::{
    DEFAULT_BLOCK_CHARS, DestinationConfig, DestinationState, block_hashes,
};
use kinference_tokenizer::{PromptText, Tokenizer};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BLOCK_SIZE: u32 = 16;
const PODS: usize = 200;

/// English-like text: words of 2 to 9 letters, some punctuation.
fn words(rng: &mut StdRng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    while s.len() < bytes {
        for _ in 0..rng.random_range(2..10) {
            s.push(rng.random_range(b'a'..=b'z') as char);
        }
        s.push_str(if rng.random_ratio(1, 12) { ". " } else { " " });
    }
    s
}

/// A chat of a system prompt and a short question, as the EPP parses it.
fn chat(system: &str, question: &str) -> PromptText {
    let body = serde_json::json!({
        "model": "m",
        "messages": [
            { "role": "system", "content": system },
            { "role": "user", "content": question }
        ]
    });
    body::parse(body.to_string().as_bytes())
        .unwrap()
        .prompt_text()
}

/// A Pod whose engine stored `tokens`' full blocks, shown in `pool`.
fn pod_holding(tokens: &PromptTokens, seq: u64, pool: &Arc<PoolIndex>) -> Arc<DestinationState> {
    let state = DestinationState::in_pool(&DestinationConfig::default(), pool);
    let chain = tokens.chain(BLOCK_SIZE, None);
    let ids = tokens.ids();
    let batch = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::Stored(BlockStored {
            block_hashes: (0..chain.len() as u64)
                .map(|i| EngineBlock(seq << 32 | i))
                .collect(),
            parent: None,
            token_ids: ids[..chain.len() * BLOCK_SIZE as usize].to_vec(),
            block_size: BLOCK_SIZE,
            lora_name: None,
            medium: None,
            has_extra_keys: false,
            group_idx: None,
        })],
        data_parallel_rank: None,
    };
    state.kv.apply(0, &batch);
    state
}

fn benches(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(7);
    let tokenizer = Tokenizer::simulator_dummy();
    let qwen3 = kinference_testbed::peers::qwen3_tokenizer().expect("Qwen3's tokenizer files");
    let qwen3 = Tokenizer::hugging_face(&qwen3).expect("Qwen3's tokenizer loads");
    for (name, bytes) in [("7KB", 7 * 1024), ("220KB", 220 * 1024)] {
        let prompt = chat(&words(&mut rng, bytes), "why is that so?");
        let mut hashes = Vec::new();
        c.bench_function(&format!("estimate: block_hashes/{name}"), |b| {
            b.iter(|| {
                block_hashes(black_box(&prompt.text), DEFAULT_BLOCK_CHARS, &mut hashes);
                black_box(hashes.len())
            })
        });
        c.bench_function(&format!("precise: tokenize+chain/{name}"), |b| {
            b.iter(|| {
                let tokens = PromptTokens::new(tokenizer.tokens(black_box(&prompt)).unwrap());
                black_box(tokens.chain(BLOCK_SIZE, None).len())
            })
        });
        // A system prompt never seen: encoded whole.
        let mut fresh = StdRng::seed_from_u64(11);
        c.bench_function(&format!("precise: qwen3 tokenize+chain, new/{name}"), |b| {
            b.iter_batched(
                || chat(&words(&mut fresh, bytes), "why is that so?"),
                |prompt| {
                    let tokens = PromptTokens::new(qwen3.tokens(&prompt).unwrap());
                    black_box(tokens.chain(BLOCK_SIZE, None).len())
                },
                BatchSize::SmallInput,
            )
        });
        // The same system prompt again, a new question: its pieces are kept.
        let mut question = 0u64;
        c.bench_function(
            &format!("precise: qwen3 tokenize+chain, seen/{name}"),
            |b| {
                b.iter_batched(
                    || {
                        question += 1;
                        let mut p = prompt.clone();
                        p.text.push_str(&format!(" and {question}?"));
                        let last = p.messages.len() - 1;
                        p.messages[last].1.end = p.text.len();
                        p
                    },
                    |prompt| {
                        let tokens = PromptTokens::new(qwen3.tokens(&prompt).unwrap());
                        black_box(tokens.chain(BLOCK_SIZE, None).len())
                    },
                    BatchSize::SmallInput,
                )
            },
        );
    }

    // 200 Pods, each holding 0..100% of a 100 KB system prompt's blocks
    // (the estimate's bench, `prefix.rs`, has the same shape).
    let system = words(&mut rng, 100 * 1024);
    let prompt = chat(&system, "and then?");
    let tokens = PromptTokens::new(tokenizer.tokens(&prompt).unwrap());
    // The same Pods twice: all in one pool (what the picker walks), and
    // each in a pool of its own, walked one by one (what a per-Pod index
    // costs).
    let pool = Arc::new(PoolIndex::default());
    let mut pods = Vec::with_capacity(PODS);
    let mut alone = Vec::with_capacity(PODS);
    for i in 0..PODS {
        let cut = system.len() * i / PODS;
        let held = PromptTokens::new(tokenizer.tokens(&chat(&system[..cut], "")).unwrap());
        pods.push(pod_holding(&held, i as u64, &pool));
        let own = Arc::new(PoolIndex::default());
        alone.push((pod_holding(&held, i as u64, &own), own));
    }
    let chain = tokens.chain(BLOCK_SIZE, None);
    let now = std::time::Instant::now();
    let walk_each = |chain: &[u64]| -> Vec<usize> {
        alone
            .iter()
            .map(|(p, own)| {
                let slots = p.kv.pool_slots(now).unwrap().slots;
                own.leading_blocks(chain, &slots)
                    .iter()
                    .map(|(_, n)| *n)
                    .sum()
            })
            .collect()
    };
    c.bench_function("precise: a pool per Pod, walked one by one/200 pods", |b| {
        b.iter(|| black_box(walk_each(black_box(&chain)).iter().sum::<usize>()))
    });
    let mut by_pod = walk_each(&chain);
    let slots: Vec<u32> = pods
        .iter()
        .flat_map(|p| p.kv.pool_slots(now).unwrap().slots)
        .collect();
    let mut by_pool: Vec<usize> = pool
        .leading_blocks(&chain, &slots)
        .into_iter()
        .map(|(_, n)| n)
        .collect();
    by_pod.sort_unstable();
    by_pool.sort_unstable();
    assert_eq!(by_pod, by_pool, "both walks find the same runs");
    c.bench_function("precise: pool leading_blocks/200 pods", |b| {
        b.iter(|| {
            let slots: Vec<u32> = pods
                .iter()
                .filter_map(|p| p.kv.pool_slots(now))
                .flat_map(|p| p.slots)
                .collect();
            let total: usize = pool
                .leading_blocks(black_box(&chain), &slots)
                .iter()
                .map(|(_, n)| n)
                .sum();
            black_box(total)
        })
    });
}

criterion_group! {
    name = kv_events;
    config = Criterion::default().sample_size(20);
    targets = benches
}
criterion_main!(kv_events);
