//! Request-path cost of the EPP's estimators with 220 KB prompts and 200
//! endpoints. `cargo bench -p kinference-epp --bench prefix`

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use kinference_epp::predict::{
    DEFAULT_BLOCK_CHARS, DestinationConfig, DestinationState, TtftFeatures, TtftPredictor,
    block_hashes,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const PROMPT_BYTES: usize = 220 * 1024;
const ENDPOINTS: usize = 200;

fn random_text(rng: &mut StdRng, len: usize) -> String {
    (0..len)
        .map(|_| rng.random_range(b' '..=b'~') as char)
        .collect()
}

fn hashes(s: &str) -> Vec<u64> {
    let mut v = Vec::new();
    block_hashes(s, DEFAULT_BLOCK_CHARS, &mut v);
    v
}

fn benches(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(1);
    // A 100 KB shared system prompt; each endpoint has served it with its own
    // 120 KB tail (3,520 blocks per prompt).
    let system = random_text(&mut rng, 100 * 1024);
    let prompt = format!(
        "{system}{}",
        random_text(&mut rng, PROMPT_BYTES - system.len())
    );

    let mut out = Vec::new();
    c.bench_function("block_hashes/220KB", |b| {
        b.iter(|| {
            block_hashes(black_box(&prompt), DEFAULT_BLOCK_CHARS, &mut out);
            black_box(out.len())
        })
    });

    // Each endpoint's state, as its registry slot owns it.
    let keys: Vec<std::sync::Arc<DestinationState>> = (0..ENDPOINTS)
        .map(|_| DestinationState::new(&DestinationConfig::default()))
        .collect();
    for (i, k) in keys.iter().enumerate() {
        // Endpoints hold 0..=100% of the system prompt, then their own tails.
        let cut = system.len() * i / keys.len();
        let p = format!(
            "{}{}",
            &system[..cut],
            random_text(&mut rng, PROMPT_BYTES - cut)
        );
        k.prefix.record(&hashes(&p));
        // A few unrelated prompts each, so the tables are not trivially small.
        for _ in 0..2 {
            k.prefix.record(&hashes(&random_text(&mut rng, 64 * 1024)));
        }
    }
    let q = hashes(&prompt);
    let cached_all = |h: &[u64]| {
        keys.iter()
            .map(|k| k.prefix.cached_blocks(h))
            .sum::<usize>()
    };
    c.bench_function("cached_blocks/200x3520", |b| {
        b.iter(|| black_box(cached_all(black_box(&q))))
    });
    c.bench_function("hash+cached_blocks/220KB,200", |b| {
        let mut h = Vec::new();
        b.iter(|| {
            block_hashes(black_box(&prompt), DEFAULT_BLOCK_CHARS, &mut h);
            black_box(cached_all(&h))
        })
    });
    // Re-recording an already known chain (LRU refresh) and a new one.
    c.bench_function("record/3520 known", |b| {
        b.iter(|| keys[7].prefix.record(black_box(&q)))
    });
    let fresh: Vec<Vec<u64>> = (0..16)
        .map(|_| hashes(&random_text(&mut rng, PROMPT_BYTES)))
        .collect();
    let mut i = 0;
    c.bench_function("record/3520 new (with eviction)", |b| {
        b.iter(|| {
            i += 1;
            keys[8].prefix.record(black_box(&fresh[i % fresh.len()]))
        })
    });

    let ttft = TtftPredictor::default();
    for (n, k) in keys.iter().enumerate() {
        for j in 0..30 {
            let f = TtftFeatures::new((j % 5) as f64, 10.0, 1000.0 * j as f64, 0.0, 0.3);
            ttft.observe(
                &k.ttft,
                &f,
                0.02 + 0.1 * (j % 5) as f64 + j as f64 * 0.0002 * (1.0 + n as f64 / 200.0),
            );
        }
    }
    let feats: Vec<TtftFeatures> = (0..ENDPOINTS)
        .map(|i| TtftFeatures::new((i % 7) as f64, 20.0, 55_000.0, (i * 250) as f64, 0.5))
        .collect();
    c.bench_function("ttft_predict/200", |b| {
        b.iter(|| {
            let mut s = 0.0;
            for (k, f) in keys.iter().zip(&feats) {
                s += ttft.predict(&k.ttft, f);
            }
            black_box(s)
        })
    });
    c.bench_function("ttft_observe/1", |b| {
        b.iter(|| ttft.observe(&keys[3].ttft, black_box(&feats[3]), 0.8))
    });

    let now = Instant::now();
    for k in &keys {
        k.stats.record_ttft(Duration::from_millis(120), now);
    }
    c.bench_function("stats_snapshot/200", |b| {
        b.iter(|| {
            let mut n = 0;
            for k in &keys {
                n += k.stats.snapshot(now).running;
            }
            black_box(n)
        })
    });
    c.bench_function("stats_begin+finish/1", |b| {
        b.iter(|| {
            keys[5]
                .stats
                .begin(now)
                .finish(kinference_epp::predict::Outcome::Success, now)
        })
    });
}

criterion_group! {
    name = prefix;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = benches
}
criterion_main!(prefix);
