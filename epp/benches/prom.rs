//! Is the hand-written Prometheus parser (`endpoints::prom`) worth keeping?
//! It is compared with the `prometheus-parse` crate on the parity corpus
//! (tests/fixtures/metrics). `cargo bench -p kinference-epp --bench prom`
//!
//! * `extract/*`: what the scraper runs per scrape, [`metrics_from_exposition`]
//!   (skips most lines after their name).
//! * `parse_all/*`: every sample with its labels, for both parsers. The crate's
//!   metric-name regex is `\w+`, so it drops every `vllm:`/`sglang:` line; the
//!   `*_no_colons` pages rename those metrics (`:` to `_`) so that both parsers
//!   do the same work.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kinference_epp::endpoints::prom;
use kinference_epp::endpoints::scrape::metrics_from_exposition;

const VLLM: &str = include_str!("../tests/fixtures/metrics/vllm_v1_dp2.prom");
const SGLANG: &str = include_str!("../tests/fixtures/metrics/sglang_docs.prom");
const TRTLLM: &str = include_str!("../tests/fixtures/metrics/trtllm_triton.prom");

/// All samples and labels through our parser; returns a checksum so nothing
/// is optimised away.
fn ours_all(text: &str) -> usize {
    let mut n = 0;
    for s in prom::samples(text) {
        n += s.name.len() + s.value.is_finite() as usize;
        for (k, v) in s.labels() {
            n += k.len() + v.len();
        }
    }
    n
}

/// The crate's documented entry point: whole-page `Scrape::parse`, which also
/// parses labels and groups histogram buckets.
fn crate_scrape(text: &str) -> usize {
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("in-memory lines");
    scrape
        .samples
        .iter()
        .map(|s| s.metric.len() + s.labels.len())
        .sum()
}

/// The crate's cheapest path: one regex match per line, labels left as one
/// raw string and the value unparsed (a lower bound on its cost).
fn crate_lines(text: &str) -> usize {
    text.lines()
        .map(|l| match prometheus_parse::LineInfo::parse(l) {
            prometheus_parse::LineInfo::Sample {
                metric_name, value, ..
            } => metric_name.len() + value.len(),
            _ => 0,
        })
        .sum()
}

fn benches(c: &mut Criterion) {
    let no_colons = |s: &str| s.replace("vllm:", "vllm_").replace("sglang:", "sglang_");
    let vllm_no_colons = no_colons(VLLM);
    let sglang_no_colons = no_colons(SGLANG);

    let mut g = c.benchmark_group("extract");
    for (name, page) in [
        ("vllm_v1_dp2", VLLM),
        ("sglang_docs", SGLANG),
        ("trtllm_triton", TRTLLM),
    ] {
        g.throughput(Throughput::Bytes(page.len() as u64));
        g.bench_function(name, |b| {
            b.iter(|| metrics_from_exposition(black_box(page), Instant::now()))
        });
    }
    g.finish();

    let mut g = c.benchmark_group("parse_all");
    for (name, page) in [
        ("vllm_v1_dp2", VLLM),
        ("vllm_v1_dp2_no_colons", &vllm_no_colons),
        ("sglang_docs_no_colons", &sglang_no_colons),
        ("trtllm_triton", TRTLLM),
    ] {
        g.throughput(Throughput::Bytes(page.len() as u64));
        g.bench_function(format!("{name}/kinference"), |b| {
            b.iter(|| ours_all(black_box(page)))
        });
        g.bench_function(format!("{name}/prometheus_parse_scrape"), |b| {
            b.iter(|| crate_scrape(black_box(page)))
        });
        g.bench_function(format!("{name}/prometheus_parse_lines"), |b| {
            b.iter(|| crate_lines(black_box(page)))
        });
    }
    g.finish();
}

criterion_group! {
    name = prom_benches;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = benches
}
criterion_main!(prom_benches);
