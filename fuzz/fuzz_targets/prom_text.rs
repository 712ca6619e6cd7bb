//! The Prometheus text parser (`endpoints::prom`) on arbitrary text: what a
//! model server's `/metrics` page may hold.
//!
//! Checks, beyond "never panics or hangs":
//! - every line is judged exactly as a plain reference parser of the same
//!   grammar judges it (`kinference_testbed::prom_reference`, which the
//!   EPP's parity tests use too):
//!   accepted or not, and the same name, labels, value and timestamp;
//! - a legacy metric name is a `[a-zA-Z_:][a-zA-Z0-9_:]*` identifier, a
//!   legacy label name a `[a-zA-Z_][a-zA-Z0-9_]*` one; a name borrows from
//!   its line;
//! - `metric_name` names the sample `parse_line` reads from the same line;
//! - `samples` yields exactly the samples of the lines `parse_line` accepts,
//!   in order, and `samples_where` the ones whose name passes its filter,
//!   asking the filter once per named line.
#![no_main]

use kinference_epp::endpoints::prom::{self, Sample};
use kinference_testbed::prom_reference::{OwnedSample as Owned, Rejected, parse_line as reference};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let text = text.as_ref();

    let mut accepted = Vec::new();
    for line in text.split('\n') {
        let ours = prom::parse_line(line);
        let expected = reference(line);
        let got = ours
            .as_ref()
            .map(|s| s.as_ref().map(owned))
            .map_err(|_| Rejected);
        assert_eq!(got, expected, "line {line:?}: parser and reference differ");
        let name = prom::metric_name(line);
        if let Ok(Some(sample)) = ours {
            check_sample(line, &sample);
            assert_eq!(name, Some(sample.name), "metric_name disagrees: {line:?}");
            accepted.push(owned(&sample));
        }
        if let Some(name) = name {
            assert!(is_substring(line, name), "the name is not from the line");
        }
    }

    let all: Vec<Owned> = prom::samples(text).map(|s| owned(&s)).collect();
    assert_eq!(all, accepted, "samples() differs from parse_line per line");

    // A filter that looks at the name, as the scraper's does.
    let wanted = |name: &str| name.len().is_multiple_of(2) || name.starts_with("vllm:");
    let mut asked = Vec::new();
    let filtered: Vec<Owned> = prom::samples_where(text, |name| {
        asked.push(name.to_string());
        wanted(name)
    })
    .map(|s| owned(&s))
    .collect();
    let expected: Vec<Owned> = accepted
        .iter()
        .filter(|s| wanted(&s.name))
        .cloned()
        .collect();
    assert_eq!(filtered, expected, "samples_where differs from its filter");
    // The filter is asked once per line that has a name, in order.
    let names: Vec<&str> = text.split('\n').filter_map(prom::metric_name).collect();
    assert_eq!(asked, names, "samples_where asked about other names");
});

fn check_sample(line: &str, s: &Sample<'_>) {
    assert!(is_substring(line, s.name), "the name is not from the line");
    let quoted_name = line.trim_start_matches([' ', '\t']).starts_with('{');
    if !quoted_name {
        assert!(is_identifier(s.name, true), "bad metric name {:?}", s.name);
    }
    for (i, (key, _value)) in s.labels().enumerate() {
        assert!(i < line.len(), "more labels than bytes: {line:?}");
        assert!(is_substring(line, key), "a label name is not from the line");
        let key_quoted = line
            .as_bytes()
            .get(key.as_ptr() as usize - line.as_ptr() as usize - 1)
            == Some(&b'"');
        if !key_quoted {
            assert!(is_identifier(key, false), "bad label name {key:?}");
        }
        assert!(s.label(key).is_some(), "label({key:?}) finds nothing");
    }
}

/// `[a-zA-Z_:][a-zA-Z0-9_:]*` (metric) or `[a-zA-Z_][a-zA-Z0-9_]*` (label).
fn is_identifier(name: &str, colons: bool) -> bool {
    let ok = |c: u8, first: bool| {
        c.is_ascii_alphabetic()
            || c == b'_'
            || (colons && c == b':')
            || (!first && c.is_ascii_digit())
    };
    let b = name.as_bytes();
    !b.is_empty() && ok(b[0], true) && b[1..].iter().all(|&c| ok(c, false))
}

/// `part` points into `whole`.
fn is_substring(whole: &str, part: &str) -> bool {
    let (w, p) = (whole.as_ptr() as usize, part.as_ptr() as usize);
    p >= w && p + part.len() <= w + whole.len()
}

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
