//! A small, allocation-free parser for the Prometheus text exposition format
//! (and the sample lines of OpenMetrics).
//!
//! Model servers expose thousands of histogram lines we do not care about, and
//! the EPP scrapes every endpoint many times a second, so the parser borrows
//! from the scraped text, lets the caller skip a line after looking only at
//! its metric name, and unescapes a label value only when asked for it (and
//! only allocates when the value really contains an escape). No regex.
//!
//! Accepted line shapes:
//!
//! ```text
//! # HELP / # TYPE / # EOF / any comment    (skipped)
//! name value
//! name{label="v",other="w"} value [timestamp]
//! name{label="v",} value                    (trailing comma)
//! {"utf8.name",label="v"} value             (Prometheus 3 quoted names)
//! name{...} value timestamp # {trace_id="x"} 1.0   (OpenMetrics exemplar, ignored)
//! ```
//!
//! Why not a crate: `prometheus-parse` matches metric names with `\w+`, so it
//! reads none of vLLM's or SGLang's `vllm:`/`sglang:` series, splits label
//! sets on every comma (LoRA adapter lists) and keeps escapes; on pages it can
//! read it is about 10x slower (`cargo bench -p kinference-epp --bench prom`).
//! `tests/prom_corpus.rs` holds this parser to a corpus of real engine pages,
//! to that crate where it can read them, and to a plain reference parser on
//! random and mutated input.

use std::borrow::Cow;
use std::fmt;

/// One sample line, borrowing from the exposition text.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    /// Metric name as written (quotes removed for quoted names; such names
    /// are returned raw, without unescaping, as no model server escapes
    /// inside names).
    pub name: &'a str,
    /// The inside of the `{...}`, already validated; empty without labels.
    labels_raw: &'a str,
    /// The sample value (`NaN`, `+Inf`, `-Inf` included).
    pub value: f64,
    /// The optional timestamp, as written (milliseconds in the Prometheus
    /// text format, seconds in OpenMetrics).
    pub timestamp: Option<f64>,
}

impl<'a> Sample<'a> {
    /// Iterates over `(label name, label value)` pairs, values unescaped.
    pub fn labels(&self) -> Labels<'a> {
        Labels {
            rest: self.labels_raw,
        }
    }

    /// The value of one label, unescaped; borrowed unless it had escapes.
    pub fn label(&self, key: &str) -> Option<Cow<'a, str>> {
        self.labels().find(|(k, _)| *k == key).map(|(_, v)| v)
    }
}

/// Why a line could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// What was wrong.
    pub message: &'static str,
    /// Byte offset within the line.
    pub offset: usize,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at byte {}", self.message, self.offset)
    }
}

impl std::error::Error for ParseError {}

/// Iterates over all well-formed samples in `text`; comments, blank lines and
/// malformed lines are skipped (one odd line from a server must not hide the
/// rest of its metrics).
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    samples_where(text, |_| true)
}

/// Like [`samples`], but a line whose metric name fails `wanted` is skipped
/// before its labels and value are looked at.
pub fn samples_where<'a>(
    text: &'a str,
    mut wanted: impl FnMut(&str) -> bool,
) -> impl Iterator<Item = Sample<'a>> {
    text.split('\n').filter_map(move |line| {
        let name = metric_name(line)?;
        if !wanted(name) {
            return None;
        }
        parse_line(line).ok().flatten()
    })
}

/// The metric name of a sample line, cheaply; `None` for comments, blank
/// lines and lines that do not start like a sample.
pub fn metric_name(line: &str) -> Option<&str> {
    let line = line.trim_start_matches([' ', '\t']);
    let b = line.as_bytes();
    match b.first()? {
        b'#' => None,
        b'{' => {
            let rest = line[1..].trim_start_matches([' ', '\t']);
            let (name, _) = quoted(rest, 0).ok()?;
            Some(name)
        }
        _ => {
            let end = name_end(b);
            (end > 0).then(|| &line[..end])
        }
    }
}

/// Parses one line: `Ok(None)` for comments and blank lines.
pub fn parse_line(line: &str) -> Result<Option<Sample<'_>>, ParseError> {
    let line = line.strip_suffix('\r').unwrap_or(line);
    let start = line.len() - line.trim_start_matches([' ', '\t']).len();
    let b = line.as_bytes();
    let mut i = start;
    let Some(&first) = b.get(i) else {
        return Ok(None);
    };
    if first == b'#' {
        return Ok(None);
    }
    // `i` ends just past the name, or past the closing `}` of the labels.
    let (name, labels_raw) = if first == b'{' {
        // Prometheus 3: `{"name", labels...}`; the name is the first quoted
        // string not followed by `=`.
        i = skip_ws(b, i + 1);
        let (name, after) = quoted(line, i)?;
        i = skip_ws(b, after);
        let labels_start = match b.get(i) {
            Some(b',') => i + 1,
            Some(b'}') => i,
            _ => return Err(err("expected ',' or '}' after quoted metric name", i)),
        };
        let close = scan_labels(line, labels_start)?;
        i = close + 1;
        (name, &line[labels_start..close])
    } else {
        let end = start + name_end(&b[start..]);
        if end == start {
            return Err(err("expected a metric name", i));
        }
        let name = &line[start..end];
        // Like the reference parser, allow blanks between name and `{`.
        let brace = skip_ws(b, end);
        i = end;
        if b.get(brace) == Some(&b'{') {
            i = brace;
            let close = scan_labels(line, i + 1)?;
            let raw = &line[i + 1..close];
            i = close + 1;
            (name, raw)
        } else {
            (name, "")
        }
    };
    if i < b.len() && !matches!(b[i], b' ' | b'\t') {
        return Err(err("expected whitespace before the value", i));
    }
    let mut fields = line[i..].split_ascii_whitespace();
    let value_str = fields.next().ok_or(err("missing value", i))?;
    let value = parse_float(value_str).ok_or(err("invalid value", i))?;
    let timestamp = match fields.next() {
        None => None,
        Some("#") => None, // exemplar follows directly
        Some(t) => Some(parse_float(t).ok_or(err("invalid timestamp", i))?),
    };
    Ok(Some(Sample {
        name,
        labels_raw,
        value,
        timestamp,
    }))
}

/// Iterator over the labels of a [`Sample`].
#[derive(Debug, Clone)]
pub struct Labels<'a> {
    rest: &'a str,
}

impl<'a> Iterator for Labels<'a> {
    type Item = (&'a str, Cow<'a, str>);

    fn next(&mut self) -> Option<Self::Item> {
        // `rest` was validated by `scan_labels`, so a failure here can only
        // mean the end; stop quietly rather than panic.
        let s = self.rest;
        let b = s.as_bytes();
        let mut i = skip_ws(b, 0);
        if i >= b.len() {
            return None;
        }
        let (key, after) = if b[i] == b'"' {
            quoted(s, i).ok()?
        } else {
            let end = i + label_name_end(&b[i..]);
            (&s[i..end], end)
        };
        i = skip_ws(b, after);
        if b.get(i) != Some(&b'=') {
            return None;
        }
        i = skip_ws(b, i + 1);
        let (raw, after) = quoted(s, i).ok()?;
        i = skip_ws(b, after);
        if b.get(i) == Some(&b',') {
            i += 1;
        }
        self.rest = &s[i..];
        Some((key, unescape(raw)))
    }
}

fn err(message: &'static str, offset: usize) -> ParseError {
    ParseError { message, offset }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t')) {
        i += 1;
    }
    i
}

/// End of a legacy metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`) at the start.
fn name_end(b: &[u8]) -> usize {
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        let ok = c.is_ascii_alphabetic() || c == b'_' || c == b':' || (i > 0 && c.is_ascii_digit());
        if !ok {
            break;
        }
        i += 1;
    }
    i
}

/// End of a legacy label name (`[a-zA-Z_][a-zA-Z0-9_]*`) at the start.
fn label_name_end(b: &[u8]) -> usize {
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        let ok = c.is_ascii_alphabetic() || c == b'_' || (i > 0 && c.is_ascii_digit());
        if !ok {
            break;
        }
        i += 1;
    }
    i
}

/// A double-quoted string starting at `i`: its raw (still escaped) contents
/// and the index just after the closing quote.
fn quoted(s: &str, i: usize) -> Result<(&str, usize), ParseError> {
    let b = s.as_bytes();
    if b.get(i) != Some(&b'"') {
        return Err(err("expected '\"'", i));
    }
    let mut j = i + 1;
    while let Some(&c) = b.get(j) {
        match c {
            b'\\' => j += 2,
            b'"' => return Ok((&s[i + 1..j], j + 1)),
            _ => j += 1,
        }
    }
    Err(err("unterminated string", i))
}

/// Validates `label="value",...}` starting at `i`; returns the index of `}`.
fn scan_labels(s: &str, mut i: usize) -> Result<usize, ParseError> {
    let b = s.as_bytes();
    loop {
        i = skip_ws(b, i);
        match b.get(i) {
            None => return Err(err("unterminated label set", i)),
            Some(b'}') => return Ok(i),
            Some(b'"') => i = quoted(s, i)?.1,
            Some(_) => {
                let n = label_name_end(&b[i..]);
                if n == 0 {
                    return Err(err("expected a label name", i));
                }
                i += n;
            }
        }
        i = skip_ws(b, i);
        if b.get(i) != Some(&b'=') {
            return Err(err("expected '='", i));
        }
        i = skip_ws(b, i + 1);
        i = quoted(s, i)?.1;
        i = skip_ws(b, i);
        match b.get(i) {
            Some(b',') => i += 1,
            Some(b'}') => return Ok(i),
            _ => return Err(err("expected ',' or '}'", i)),
        }
    }
}

/// Resolves `\\`, `\"` and `\n`; any other escaped character stands for
/// itself (lenient, as Prometheus itself is).
fn unescape(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    Cow::Owned(out)
}

/// Go-style float syntax: Rust's parser already takes `NaN`, `inf`, `+Inf`,
/// `-Inf` case-insensitively, exponents and a leading `+`.
fn parse_float(s: &str) -> Option<f64> {
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(line: &str) -> Sample<'_> {
        parse_line(line).unwrap().unwrap()
    }

    #[test]
    fn plain_and_labelled_samples() {
        let s = one("vllm:num_requests_running 3");
        assert_eq!(
            (s.name, s.value, s.timestamp),
            ("vllm:num_requests_running", 3.0, None)
        );
        assert_eq!(s.labels().count(), 0);

        let s = one(
            r#"vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 7.0"#,
        );
        assert_eq!(s.name, "vllm:num_requests_waiting");
        assert_eq!(s.value, 7.0);
        assert_eq!(
            s.label("model_name").as_deref(),
            Some("meta-llama/Llama-3.1-8B")
        );
        assert_eq!(s.label("engine").as_deref(), Some("0"));
        assert_eq!(s.label("nope"), None);

        let s = one("http_requests_total{method=\"post\",code=\"200\",} 1027 1395066363000");
        assert_eq!(s.value, 1027.0);
        assert_eq!(s.timestamp, Some(1395066363000.0));
        assert_eq!(s.labels().count(), 2);
    }

    #[test]
    fn special_values_and_exponents() {
        assert!(one("x NaN").value.is_nan());
        assert_eq!(one("x +Inf").value, f64::INFINITY);
        assert_eq!(one("x -Inf").value, f64::NEG_INFINITY);
        assert_eq!(one("x 1.5e-3").value, 0.0015);
        assert_eq!(one("x -2").value, -2.0);
        assert_eq!(
            one(r#"h_bucket{le="+Inf"} 12"#).label("le").as_deref(),
            Some("+Inf")
        );
    }

    #[test]
    fn escaped_label_values() {
        let s = one(r#"m{path="C:\\dir\\file",quote="say \"hi\"",nl="a\nb",brace="}{,="} 1"#);
        assert_eq!(s.label("path").as_deref(), Some(r"C:\dir\file"));
        assert_eq!(s.label("quote").as_deref(), Some(r#"say "hi""#));
        assert_eq!(s.label("nl").as_deref(), Some("a\nb"));
        assert_eq!(s.label("brace").as_deref(), Some("}{,="));
        assert!(matches!(s.label("brace"), Some(Cow::Borrowed(_))));
        assert!(matches!(s.label("nl"), Some(Cow::Owned(_))));
        assert_eq!(s.value, 1.0);
    }

    #[test]
    fn whitespace_comments_and_blank_lines() {
        assert_eq!(parse_line(""), Ok(None));
        assert_eq!(parse_line("   "), Ok(None));
        assert_eq!(parse_line("# HELP x help text"), Ok(None));
        assert_eq!(parse_line("# EOF"), Ok(None));
        let s = one("  m { a = \"1\" , b=\"2\" }   4   \r");
        assert_eq!(s.value, 4.0);
        assert_eq!(s.label("b").as_deref(), Some("2"));
        assert_eq!(s.labels().count(), 2);
    }

    #[test]
    fn openmetrics_exemplars_and_quoted_names() {
        let s = one(r#"foo_total{a="b"} 17.0 1520879607.789 # {trace_id="KOO5S4vxi0o"} 0.67"#);
        assert_eq!(s.value, 17.0);
        assert_eq!(s.timestamp, Some(1520879607.789));
        let s = one(r#"foo_total 17 # {trace_id="x"} 1"#);
        assert_eq!(s.timestamp, None);

        let s = one(r#"{"my.metric", zone="a"} 2"#);
        assert_eq!(s.name, "my.metric");
        assert_eq!(s.label("zone").as_deref(), Some("a"));
        let s = one(r#"{"only.name"} 3"#);
        assert_eq!((s.name, s.value), ("only.name", 3.0));
        assert_eq!(
            metric_name(r#"{"my.metric", zone="a"} 2"#),
            Some("my.metric")
        );
        let s = one(r#"m{"dotted.label"="x"} 1"#);
        assert_eq!(s.label("dotted.label").as_deref(), Some("x"));
    }

    #[test]
    fn malformed_lines_are_errors() {
        for bad in [
            "m",
            "m{",
            "m{a=\"1\"",
            "m{a=1} 2",
            "m{a} 2",
            "m{=\"x\"} 2",
            "m{a=\"1\" b=\"2\"} 2",
            "m notanumber",
            "m 1 notatimestamp",
            "m{a=\"1\"}2",
            "9abc 1",
            "{\"unterminated 1",
        ] {
            assert!(parse_line(bad).is_err(), "{bad:?} should fail");
        }
    }

    #[test]
    fn iterator_skips_junk_and_filters_by_name() {
        let text = "# HELP a x\n# TYPE a gauge\na 1\ngarbage{{{\nb{x=\"y\"} 2\n\nc 3\n";
        let all: Vec<_> = samples(text).map(|s| (s.name, s.value)).collect();
        assert_eq!(all, [("a", 1.0), ("b", 2.0), ("c", 3.0)]);
        let some: Vec<_> = samples_where(text, |n| n != "b").map(|s| s.name).collect();
        assert_eq!(some, ["a", "c"]);
    }

    #[test]
    fn metric_name_is_cheap_and_correct() {
        assert_eq!(metric_name("vllm:x{a=\"b\"} 1"), Some("vllm:x"));
        assert_eq!(metric_name("  y 1"), Some("y"));
        assert_eq!(metric_name("# TYPE y gauge"), None);
        assert_eq!(metric_name(""), None);
        assert_eq!(metric_name("1abc"), None);
    }
}
