//! The hand-written Prometheus parser (`endpoints::prom`) and the scraper's
//! extraction (`endpoints::scrape`) against:
//!
//! * a parity corpus of real metric pages (tests/fixtures/metrics, each file
//!   names its source on its first line): hand-written expected values per
//!   page, and parity with the `prometheus-parse` crate, line by line and on
//!   the extracted values;
//! * property tests: random valid expositions parse to exactly the samples
//!   they were built from; mutated and random lines are judged exactly like a
//!   straightforward reference parser judges them; garbage never panics and
//!   never hangs.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kinference_epp::endpoints::prom::{self, Sample};
use kinference_epp::endpoints::scrape::{
    ENGINES, EngineMetrics, KvCacheSource, Series, metrics_from_exposition,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

// ---------------------------------------------------------------------------
// The corpus
// ---------------------------------------------------------------------------

const FIXTURES: &[(&str, &str)] = &[
    (
        "vllm_v1_dp2",
        include_str!("fixtures/metrics/vllm_v1_dp2.prom"),
    ),
    (
        "vllm_v1_lora",
        include_str!("fixtures/metrics/vllm_v1_lora.prom"),
    ),
    (
        "vllm_v0_aibrix",
        include_str!("fixtures/metrics/vllm_v0_aibrix.prom"),
    ),
    (
        "sglang_docs",
        include_str!("fixtures/metrics/sglang_docs.prom"),
    ),
    (
        "sglang_v0_5",
        include_str!("fixtures/metrics/sglang_v0_5.prom"),
    ),
    (
        "trtllm_triton",
        include_str!("fixtures/metrics/trtllm_triton.prom"),
    ),
    (
        "trtllm_triton_legacy",
        include_str!("fixtures/metrics/trtllm_triton_legacy.prom"),
    ),
    (
        "triton_no_llm",
        include_str!("fixtures/metrics/triton_no_llm.prom"),
    ),
    (
        "exposition_edge_cases",
        include_str!("fixtures/metrics/exposition_edge_cases.prom"),
    ),
];

/// What the scraper must extract from a page, written by hand per fixture.
#[derive(Debug, Clone, PartialEq)]
struct Expected {
    waiting: f64,
    running: f64,
    kv_cache_usage: f64,
    running_loras: Vec<String>,
    waiting_loras: Vec<String>,
    max_lora: Option<u32>,
    block_size: Option<u32>,
    num_gpu_blocks: Option<u64>,
}

fn counts(waiting: f64, running: f64, kv_cache_usage: f64) -> Expected {
    Expected {
        waiting,
        running,
        kv_cache_usage,
        running_loras: vec![],
        waiting_loras: vec![],
        max_lora: None,
        block_size: None,
        num_gpu_blocks: None,
    }
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn expected(fixture: &str) -> Option<Expected> {
    Some(match fixture {
        // Two data-parallel engines: counts summed, KV usage the larger.
        "vllm_v1_dp2" => Expected {
            block_size: Some(16),
            num_gpu_blocks: Some(27648),
            ..counts(3.0 + 5.0, 14.0 + 11.0, 0.6145833333333334)
        },
        // The newest of four LoRA info series (1.7563303452070847e+09).
        "vllm_v1_lora" => Expected {
            running_loras: strings(&["sql-lora", "tweet-lora"]),
            waiting_loras: strings(&["sql-lora"]),
            max_lora: Some(4),
            block_size: Some(16),
            num_gpu_blocks: Some(11560),
            ..counts(4.0, 6.0, 0.9321)
        },
        // An idle v0 server: KV usage from the deprecated gpu_cache name.
        "vllm_v0_aibrix" => Expected {
            max_lora: Some(0),
            block_size: Some(16),
            num_gpu_blocks: Some(81767),
            ..counts(0.0, 0.0, 0.0)
        },
        "sglang_docs" => counts(2826.0, 162.0, 0.28),
        "sglang_v0_5" => counts(9.0, 37.0, 0.71),
        "trtllm_triton" => counts(1.0, 1.0, 0.4875),
        // No `waiting` series; KV usage from used/max.
        "trtllm_triton_legacy" => counts(0.0, 1.0, 1.0 / 6239.0),
        "triton_no_llm" => return None,
        // Engine 1's NaN queue is ignored; labels unescaped.
        "exposition_edge_cases" => Expected {
            running_loras: strings(&[r"C:\loras\a", r#"say "hi""#, "spaced"]),
            waiting_loras: strings(&["line\nbreak"]),
            max_lora: Some(3),
            ..counts(2.0, 1.0, 0.25)
        },
        other => panic!("no expectation for fixture {other}"),
    })
}

fn extracted(text: &str) -> Option<Expected> {
    metrics_from_exposition(text, Instant::now()).map(|m| Expected {
        waiting: m.waiting,
        running: m.running,
        kv_cache_usage: m.kv_cache_usage,
        running_loras: m.running_loras,
        waiting_loras: m.waiting_loras,
        max_lora: m.max_lora,
        block_size: m.block_size,
        num_gpu_blocks: m.num_gpu_blocks,
    })
}

#[test]
fn every_fixture_names_its_source() {
    for (name, text) in FIXTURES {
        assert!(text.starts_with("# source: "), "{name}");
    }
}

#[test]
fn every_line_of_every_fixture_parses() {
    for (name, text) in FIXTURES {
        let mut samples = 0;
        for (i, line) in text.lines().enumerate() {
            match prom::parse_line(line) {
                Ok(Some(s)) => {
                    samples += 1;
                    assert_eq!(prom::metric_name(line), Some(s.name), "{name}:{}", i + 1);
                }
                Ok(None) => assert!(
                    line.trim().is_empty() || line.trim_start().starts_with('#'),
                    "{name}:{}: {line:?} skipped",
                    i + 1
                ),
                Err(e) => panic!("{name}:{}: {e}: {line:?}", i + 1),
            }
        }
        assert_eq!(prom::samples(text).count(), samples, "{name}");
        assert!(samples > 0, "{name}");
    }
}

#[test]
fn fixtures_yield_the_expected_load_metrics() {
    for (name, text) in FIXTURES {
        assert_eq!(extracted(text), expected(name), "{name}");
    }
}

// ---------------------------------------------------------------------------
// Parity with the `prometheus-parse` crate
// ---------------------------------------------------------------------------

fn go_float(s: &str) -> Option<f64> {
    if s.eq_ignore_ascii_case("nan") {
        return Some(f64::NAN);
    }
    s.parse().ok()
}

/// Label values the crate cannot represent: it splits a label set on every
/// `,` and `=` and keeps escapes as they are.
fn crate_can_represent(value: &str) -> bool {
    !value.contains([',', '=', '"', '\\', '\n', '}'])
}

/// The crate's label splitting (its `Labels::parse` is private): pairs of
/// `key=value` between commas, quotes trimmed.
fn crate_labels(raw: Option<&str>) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = raw
        .unwrap_or("")
        .split(',')
        .filter_map(|kv| {
            let parts: Vec<&str> = kv.split('=').collect();
            (parts.len() == 2 && !parts[0].is_empty())
                .then(|| (parts[0].to_string(), parts[1].trim_matches('"').to_string()))
        })
        .collect();
    out.sort();
    out
}

/// Line by line, on every fixture: where the crate reads a sample, ours reads
/// the same name, value, timestamp and (where the crate can represent them)
/// labels; where it does not, ours reads a comment, a blank, or a metric
/// whose name has a `:` (the crate's name pattern is `\w+`, so it drops every
/// vLLM and SGLang series).
#[test]
fn line_parity_with_prometheus_parse() {
    use prometheus_parse::LineInfo;
    for (name, text) in FIXTURES {
        let (mut agreed, mut colon_names) = (0, 0);
        for (i, line) in text.lines().enumerate() {
            let at = format!("{name}:{}: {line:?}", i + 1);
            let ours = prom::parse_line(line).unwrap();
            let theirs = LineInfo::parse(line);
            let LineInfo::Sample {
                metric_name,
                labels,
                value,
                timestamp,
            } = theirs
            else {
                match ours {
                    None => {}
                    Some(s) if s.name.contains(':') => colon_names += 1,
                    Some(_) => panic!("{at}: only we read a sample"),
                }
                continue;
            };
            let s = ours.unwrap_or_else(|| panic!("{at}: only the crate reads a sample"));
            assert_eq!(s.name, metric_name, "{at}");
            assert!(same_f64(s.value, go_float(value).unwrap()), "{at}");
            assert_eq!(s.timestamp, timestamp.map(|t| t.parse().unwrap()), "{at}");
            let mut our_labels: Vec<(String, String)> = s
                .labels()
                .map(|(k, v)| (k.to_string(), v.into_owned()))
                .collect();
            if our_labels.iter().all(|(_, v)| crate_can_represent(v)) {
                our_labels.sort();
                assert_eq!(our_labels, crate_labels(labels), "{at}");
            }
            agreed += 1;
        }
        let engine_page = text
            .lines()
            .any(|l| l.starts_with("vllm:") || l.starts_with("sglang:"));
        assert_eq!(colon_names > 0, engine_page, "{name}");
        assert!(agreed > 0 || engine_page, "{name}");
    }
}

/// One sample as the crate's `Scrape::parse` returns it, names mapped back.
struct CrateSample {
    name: String,
    labels: HashMap<String, String>,
    value: f64,
}

impl CrateSample {
    fn is(&self, s: &Series) -> bool {
        self.name == s.name
            && s.label
                .is_none_or(|(k, v)| self.labels.get(k).map(String::as_str) == Some(v))
    }
}

/// A second, independent extraction: the crate's `Scrape::parse` on the page
/// with `vllm:`/`sglang:` renamed to `_` (names it can read; mapped back
/// afterwards), then the engine tables applied to its samples.
fn crate_extract(text: &str) -> Option<Expected> {
    use prometheus_parse::{Scrape, Value};
    let renamed = text.replace("vllm:", "vllm_").replace("sglang:", "sglang_");
    let scrape = Scrape::parse(renamed.lines().map(|l| Ok(l.to_string()))).unwrap();
    let samples: Vec<CrateSample> = scrape
        .samples
        .into_iter()
        .filter_map(|s| {
            let value = match s.value {
                Value::Gauge(v) | Value::Counter(v) | Value::Untyped(v) => v,
                Value::Histogram(_) | Value::Summary(_) => return None,
            };
            let name = if let Some(rest) = s.metric.strip_prefix("vllm_") {
                format!("vllm:{rest}")
            } else if let Some(rest) = s.metric.strip_prefix("sglang_") {
                format!("sglang:{rest}")
            } else {
                s.metric.clone()
            };
            let labels = s
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            (!value.is_nan()).then_some(CrateSample {
                name,
                labels,
                value,
            })
        })
        .collect();
    ENGINES
        .iter()
        .find_map(|t| crate_extract_engine(t, &samples))
}

fn crate_extract_engine(t: &EngineMetrics, samples: &[CrateSample]) -> Option<Expected> {
    let of = |s: Series| samples.iter().filter(move |x| x.is(&s)).map(|x| x.value);
    let total = |s: &Series| of(*s).reduce(|a, b| a + b);
    let (waiting, running) = (total(&t.waiting), total(&t.running));
    let kv = t.kv_cache_usage.iter().find_map(|source| match source {
        KvCacheSource::Fraction(f) => of(*f).reduce(f64::max),
        KvCacheSource::Ratio { used, total: all } => match (total(used), total(all)) {
            (Some(u), Some(a)) if a > 0.0 => Some(u / a),
            _ => None,
        },
    });
    if waiting.is_none() && running.is_none() && kv.is_none() {
        return None;
    }
    let adapters = |s: Option<&String>| -> Vec<String> {
        s.map(|s| {
            s.split(',')
                .map(str::trim)
                .filter(|a| !a.is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
    };
    let mut e = counts(
        waiting.unwrap_or(0.0).max(0.0),
        running.unwrap_or(0.0).max(0.0),
        kv.unwrap_or(0.0).clamp(0.0, 1.0),
    );
    if let Some(l) = &t.lora_info {
        // The newest series; the first of equals.
        let newest =
            samples
                .iter()
                .filter(|x| x.name == l.metric)
                .fold(None::<&CrateSample>, |best, x| match best {
                    Some(b) if x.value <= b.value => Some(b),
                    _ => Some(x),
                });
        if let Some(x) = newest {
            e.running_loras = adapters(x.labels.get(l.running_label));
            e.waiting_loras = adapters(x.labels.get(l.waiting_label));
            e.max_lora = x.labels.get(l.max_label).and_then(|m| m.parse().ok());
        }
    }
    if let Some(c) = &t.cache_config {
        for x in samples.iter().filter(|x| x.name == c.metric) {
            let int = |k: &str| x.labels.get(k).and_then(|v| v.parse::<f64>().ok());
            if let Some(b) = int(c.block_size_label) {
                e.block_size = Some(b as u32);
            }
            if let Some(n) = int(c.num_gpu_blocks_label) {
                e.num_gpu_blocks = Some(n as u64);
            }
        }
    }
    Some(e)
}

/// The extracted values agree with the crate-based extraction on every
/// fixture. LoRA adapter lists are compared only where no adapter label holds
/// a comma or an escape: the crate splits a label set on every comma.
#[test]
fn extraction_parity_with_prometheus_parse() {
    for (name, text) in FIXTURES {
        let (ours, theirs) = (extracted(text), crate_extract(text));
        let (Some(mut ours), Some(mut theirs)) = (ours.clone(), theirs.clone()) else {
            assert_eq!(ours.is_none(), theirs.is_none(), "{name}");
            continue;
        };
        let lora_lines_representable = text
            .lines()
            .filter(|l| l.starts_with("vllm:lora_requests_info"))
            .filter_map(|l| prom::parse_line(l).ok().flatten())
            .all(|s| s.labels().all(|(_, v)| crate_can_represent(&v)));
        if !lora_lines_representable {
            for e in [&mut ours, &mut theirs] {
                e.running_loras.clear();
                e.waiting_loras.clear();
            }
        }
        assert_eq!(ours, theirs, "{name}");
    }
}

// ---------------------------------------------------------------------------
// A straightforward reference parser
// ---------------------------------------------------------------------------

use kinference_testbed::prom_reference::{
    OwnedSample as Owned, Rejected, parse_line as reference, same_f64,
};

fn owned(s: &Sample<'_>) -> Owned {
    Owned {
        name: s.name.to_string(),
        labels: s
            .labels()
            .map(|(k, v)| (k.to_string(), v.into_owned()))
            .collect(),
        value: s.value,
        timestamp: s.timestamp,
    }
}

fn ours(line: &str) -> Result<Option<Owned>, Rejected> {
    prom::parse_line(line)
        .map(|s| s.as_ref().map(owned))
        .map_err(|_| Rejected)
}

#[test]
fn the_reference_agrees_on_the_corpus() {
    for (name, text) in FIXTURES {
        for line in text.lines() {
            assert_eq!(ours(line), reference(line), "{name}: {line:?}");
        }
    }
}

// ---------------------------------------------------------------------------
// Property tests
// ---------------------------------------------------------------------------

/// A sample line to render, with the samples it must parse to.
#[derive(Debug, Clone)]
struct Model {
    name: String,
    /// Prometheus 3 `{"name", ...}` form.
    quoted_name: bool,
    /// (key, quote the key, value)
    labels: Vec<(String, bool, String)>,
    trailing_comma: bool,
    value: (String, f64),
    timestamp: Option<(String, f64)>,
    exemplar: bool,
    /// Blanks around the pieces: [before the line, name..brace, inside
    /// labels, before the value, before the timestamp, at the end].
    blanks: [String; 6],
    crlf: bool,
}

fn escape(v: &str) -> String {
    v.replace('\\', r"\\")
        .replace('"', r#"\""#)
        .replace('\n', r"\n")
}

impl Model {
    fn render(&self) -> String {
        let [lead, pre_brace, inner, pre_value, pre_ts, end] = &self.blanks;
        let mut s = lead.clone();
        let labels: Vec<String> = self
            .labels
            .iter()
            .map(|(k, q, v)| {
                let k = if *q { format!("\"{k}\"") } else { k.clone() };
                format!("{inner}{k}{inner}={inner}\"{}\"{inner}", escape(v))
            })
            .collect();
        if self.quoted_name {
            s.push_str(&format!("{{{inner}\"{}\"{inner}", self.name));
            for l in &labels {
                s.push(',');
                s.push_str(l);
            }
            if self.trailing_comma {
                s.push(',');
            }
            s.push('}');
        } else {
            s.push_str(&self.name);
            if !self.labels.is_empty() || self.trailing_comma {
                s.push_str(pre_brace);
                s.push('{');
                s.push_str(&labels.join(","));
                if self.trailing_comma && !labels.is_empty() {
                    s.push(',');
                }
                s.push('}');
            }
        }
        s.push_str(pre_value);
        s.push_str(&self.value.0);
        if let Some((t, _)) = &self.timestamp {
            s.push_str(pre_ts);
            s.push_str(t);
        }
        if self.exemplar {
            s.push_str(" # {trace_id=\"KOO5S4vxi0o\"} 0.67");
        }
        s.push_str(end);
        if self.crlf {
            s.push('\r');
        }
        s
    }

    fn expected(&self) -> Owned {
        Owned {
            name: self.name.clone(),
            labels: self
                .labels
                .iter()
                .map(|(k, _, v)| (k.clone(), v.clone()))
                .collect(),
            value: self.value.1,
            timestamp: self.timestamp.as_ref().map(|t| t.1),
        }
    }
}

fn blanks(min: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(prop_oneof![Just(' '), Just('\t')], min..min + 3)
        .prop_map(String::from_iter)
}

/// Values as exposition writers print them: Go, Python and Rust float
/// formatting, exponents, signs, specials.
fn value() -> impl Strategy<Value = (String, f64)> {
    let finite = prop_oneof![
        any::<f64>().prop_filter("finite", |v| v.is_finite()),
        (-1_000_000i64..1_000_000).prop_map(|i| i as f64),
        (-1000i64..1000, -5i32..5).prop_map(|(m, e)| m as f64 * 10f64.powi(e)),
    ];
    let written = (finite, 0..5u8).prop_map(|(v, style)| {
        let text = match style {
            0 => format!("{v}"),
            1 => format!("{v:e}"),
            2 => format!("{v:E}"),
            3 if v.is_sign_positive() => format!("+{v}"),
            _ => format!("{v:?}"),
        };
        let parsed = text.parse::<f64>().unwrap();
        (text, parsed)
    });
    prop_oneof![
        8 => written,
        1 => prop_oneof![
            Just(("NaN".to_string(), f64::NAN)),
            Just(("+Inf".to_string(), f64::INFINITY)),
            Just(("-Inf".to_string(), f64::NEG_INFINITY)),
            Just(("Inf".to_string(), f64::INFINITY)),
            Just(("nan".to_string(), f64::NAN)),
        ],
    ]
}

fn label_value() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            4 => any::<char>().prop_filter("no CR", |c| *c != '\r'),
            1 => prop_oneof![
                Just('"'), Just('\\'), Just('\n'), Just(','), Just('='),
                Just('{'), Just('}'), Just(' '), Just('#'), Just('n'),
            ],
        ],
        0..16,
    )
    .prop_map(String::from_iter)
}

fn model() -> impl Strategy<Value = Model> {
    let legacy_name = "[a-zA-Z_:][a-zA-Z0-9_:]{0,24}";
    let quoted_name = "[a-zA-Z0-9_.:/ -]{1,16}";
    let label_key = prop_oneof![
        4 => ("[a-zA-Z_][a-zA-Z0-9_]{0,12}", Just(false)),
        1 => ("[a-zA-Z0-9_.:/ -]{1,10}", Just(true)),
    ];
    let labels = proptest::collection::vec((label_key, label_value()), 0..5).prop_map(
        |v: Vec<((String, bool), String)>| -> Vec<(String, bool, String)> {
            v.into_iter().map(|((k, q), v)| (k, q, v)).collect()
        },
    );
    let timestamp = prop_oneof![
        Just(None),
        (-(1i64 << 53)..(1i64 << 53)).prop_map(|t| Some((t.to_string(), t as f64))),
    ];
    let blank_set = (
        blanks(0),
        blanks(0),
        blanks(0),
        blanks(1),
        blanks(1),
        blanks(0),
    )
        .prop_map(|(a, b, c, d, e, f)| [a, b, c, d, e, f]);
    (
        prop_oneof![
            5 => legacy_name.prop_map(|n| (n, false)),
            1 => quoted_name.prop_map(|n| (n, true)),
        ],
        labels,
        any::<bool>(),
        value(),
        timestamp,
        any::<bool>(),
        blank_set,
        any::<bool>(),
    )
        .prop_map(
            |(
                (name, quoted_name),
                labels,
                trailing_comma,
                value,
                timestamp,
                exemplar,
                blanks,
                crlf,
            )| {
                Model {
                    name,
                    quoted_name,
                    labels,
                    trailing_comma,
                    value,
                    timestamp,
                    exemplar,
                    blanks,
                    crlf,
                }
            },
        )
}

/// Lines that are not samples, interleaved in generated pages.
fn filler() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("   ".to_string()),
        "# (HELP|TYPE) [a-z_:]{1,12} [ -~]{0,30}",
        "#[ -~]{0,30}",
        Just("# EOF".to_string()),
    ]
}

fn cases(n: u32) -> Config {
    Config {
        cases: n,
        // Failures are printed with their minimal input; no regression files.
        failure_persistence: None,
        ..Config::default()
    }
}

/// Runs `f` on another thread and fails if it takes longer than `limit`:
/// the parser must never loop.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("did not finish within {limit:?}"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("panicked"),
    }
}

#[test]
fn valid_expositions_parse_to_the_samples_they_were_built_from() {
    let page =
        proptest::collection::vec((model(), proptest::collection::vec(filler(), 0..3)), 1..12);
    TestRunner::new(cases(512))
        .run(&page, |page| {
            let mut text = String::new();
            let mut want = Vec::new();
            for (m, fill) in &page {
                for f in fill {
                    text.push_str(f);
                    text.push('\n');
                }
                let line = m.render();
                let got = ours(&line).map_err(|_| TestCaseError::fail(format!("{line:?}")))?;
                prop_assert_eq!(got.as_ref(), Some(&m.expected()), "{:?}", line);
                prop_assert_eq!(reference(&line), Ok(Some(m.expected())), "{:?}", line);
                text.push_str(&line);
                text.push('\n');
                want.push(m.expected());
            }
            let got: Vec<Owned> = prom::samples(&text).map(|s| owned(&s)).collect();
            prop_assert_eq!(got, want);
            // The name filter sees the same names.
            let names: Vec<&str> = prom::samples_where(&text, |_| true)
                .map(|s| s.name)
                .collect();
            prop_assert_eq!(names.len(), page.len());
            Ok(())
        })
        .unwrap();
}

/// Characters that matter to the grammar, for mutating lines.
fn significant() -> impl Strategy<Value = char> {
    prop_oneof![
        Just(' '),
        Just('\t'),
        Just('"'),
        Just('\\'),
        Just('{'),
        Just('}'),
        Just(','),
        Just('='),
        Just('#'),
        Just('a'),
        Just('_'),
        Just(':'),
        Just('1'),
        Just('.'),
        Just('e'),
        Just('+'),
        Just('-'),
        Just('\r'),
        Just('\n'),
        Just('é'),
        Just('🦀'),
        Just('\u{b}'),
        Just('\u{c}'),
    ]
}

#[derive(Debug, Clone)]
enum Edit {
    Delete(usize),
    Insert(usize, char),
    Replace(usize, char),
}

fn apply(line: &str, edits: &[Edit]) -> String {
    let mut c: Vec<char> = line.chars().collect();
    for e in edits {
        match *e {
            Edit::Delete(i) if !c.is_empty() => {
                c.remove(i % c.len());
            }
            Edit::Insert(i, ch) => c.insert(i % (c.len() + 1), ch),
            Edit::Replace(i, ch) if !c.is_empty() => {
                let n = c.len();
                c[i % n] = ch;
            }
            _ => {}
        }
    }
    c.into_iter().collect()
}

/// Mutated valid lines (mostly invalid now) are accepted or rejected exactly
/// as the reference parser does, with the same sample when accepted.
#[test]
fn mutated_lines_are_judged_like_the_reference() {
    let edit = prop_oneof![
        any::<usize>().prop_map(Edit::Delete),
        (any::<usize>(), significant()).prop_map(|(i, c)| Edit::Insert(i, c)),
        (any::<usize>(), significant()).prop_map(|(i, c)| Edit::Replace(i, c)),
    ];
    let case = (model(), proptest::collection::vec(edit, 1..4));
    TestRunner::new(cases(2048))
        .run(&case, |(m, edits)| {
            let line = apply(&m.render(), &edits);
            prop_assert_eq!(ours(&line), reference(&line), "{:?}", line);
            // The cheap name peek agrees with the full parse.
            if let Ok(Some(s)) = prom::parse_line(&line) {
                prop_assert_eq!(prom::metric_name(&line), Some(s.name));
            }
            Ok(())
        })
        .unwrap();
}

fn floor_char_boundary(t: &str, i: usize) -> usize {
    let mut i = i.min(t.len());
    while !t.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Random text: no panic, no hang, and every line judged like the reference.
#[test]
fn garbage_never_panics_or_hangs() {
    within(Duration::from_secs(120), || {
        let text = prop_oneof![
            any::<String>(),
            proptest::collection::vec(significant(), 0..64).prop_map(String::from_iter),
            proptest::collection::vec(any::<u8>(), 0..256)
                .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
            // Pieces of real pages glued together at random.
            proptest::collection::vec((0..FIXTURES.len(), any::<usize>(), 0usize..80), 1..6)
                .prop_map(|cuts| {
                    cuts.into_iter()
                        .map(|(f, at, len)| {
                            let t = FIXTURES[f].1;
                            let start = floor_char_boundary(t, at % t.len());
                            let end = floor_char_boundary(t, start + len);
                            &t[start..end]
                        })
                        .collect::<String>()
                }),
        ];
        TestRunner::new(cases(2048))
            .run(&text, |text| {
                let mut n = 0;
                for s in prom::samples(&text) {
                    n += s.labels().count();
                    prop_assert!(n <= text.len());
                }
                for line in text.split('\n') {
                    prop_assert_eq!(ours(line), reference(line), "{:?}", line);
                    let _ = prom::metric_name(line);
                }
                let _ = metrics_from_exposition(&text, Instant::now());
                Ok(())
            })
            .unwrap();
    });
}

/// Unescaping borrows unless the value has an escape.
#[test]
fn label_values_borrow_unless_escaped() {
    let s = prom::parse_line(r#"m{a="plain",b="esc\"aped"} 1"#)
        .unwrap()
        .unwrap();
    assert!(matches!(s.label("a"), Some(Cow::Borrowed("plain"))));
    assert!(matches!(s.label("b"), Some(Cow::Owned(ref v)) if v == "esc\"aped"));
}
