//! The demo's records of its requests, the progress display and the final
//! tables.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kinference_policy::CompiledPolicy;
use kinference_testbed::envoy::AccessRecord;

use super::workload::{DemoRequest, Kind};
use super::{Server, lock};

/// Where a request went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// A local model server, by name.
    Local(String),
    /// A provider, by name.
    Provider(String),
    /// The EPP answered itself (a reject or a refusal): Envoy sent its
    /// immediate response.
    Immediate,
    /// No answer from the EPP or any server (Envoy's own error, or the
    /// connection failed).
    None,
}

/// One finished request: what the demo's client saw, completed with Envoy's
/// access record of it. Holds no prompt or answer text.
#[derive(Debug, Clone)]
pub struct Record {
    /// The `x-request-id` the client sent.
    pub request_id: String,
    /// The rule that decided: the `x-kinference-rule` response header of an
    /// immediate response, else the request header as Envoy logged it.
    pub rule: Option<String>,
    /// The model served (that of the local server).
    pub model: Option<String>,
    pub destination: Destination,
    /// Status returned to the client; 0 when none came back.
    pub status: u16,
    /// For immediate responses: the JSON error's `message`.
    pub message: Option<String>,
    /// Request sent → first response body byte, as the client measured it.
    pub ttft: Option<Duration>,
    /// The upstream `ip:port` that answered, from Envoy's access record.
    pub upstream: Option<String>,
    /// The connection failed or the response broke off.
    pub broken: bool,
}

/// What the client read from one response.
#[derive(Debug, Default)]
pub struct Reply<'a> {
    pub status: u16,
    /// The simulator's `x-sim-server` header, naming the server that answered.
    pub served_by: Option<&'a str>,
    /// `x-kinference-rule` of the response (immediate responses only).
    pub rule: Option<&'a str>,
    /// `error.message` of a JSON error body.
    pub message: Option<String>,
    pub ttft: Option<Duration>,
    pub broken: bool,
}

impl Record {
    /// A request as its response showed it.
    pub fn new(request_id: String, reply: Reply<'_>, servers: &[Server]) -> Record {
        let mut record = Record {
            request_id,
            rule: reply.rule.map(str::to_string),
            model: None,
            destination: Destination::None,
            status: reply.status,
            message: reply.message,
            ttft: reply.ttft,
            upstream: None,
            broken: reply.broken,
        };
        if let Some(server) = reply
            .served_by
            .and_then(|name| servers.iter().find(|s| s.label == name))
        {
            record.served_by(server);
        } else if reply.status != 0 && record.message.is_some() {
            record.destination = Destination::Immediate;
        }
        record
    }

    /// A request that never got a response.
    pub fn failed(request_id: String) -> Record {
        Record::new(request_id, Reply::default(), &[])
    }

    fn served_by(&mut self, server: &Server) {
        if server.provider {
            self.destination = Destination::Provider(server.label.clone());
            self.model = None;
        } else {
            self.destination = Destination::Local(server.label.clone());
            self.model = Some(server.model.clone());
        }
    }

    /// Adds what Envoy logged: the rule the EPP named and the upstream that
    /// answered (which names the server when the response did not).
    pub fn complete(&mut self, access: &AccessRecord, servers: &[Server]) {
        if self.rule.is_none() {
            self.rule.clone_from(&access.rule);
        }
        self.upstream.clone_from(&access.upstream);
        if let Some(server) = access
            .upstream
            .as_deref()
            .and_then(|up| servers.iter().find(|s| s.handle.addr().to_string() == up))
        {
            self.served_by(server);
        }
    }
}

/// Shows progress on stderr until aborted: one updating line on a terminal,
/// a line every few seconds otherwise.
pub async fn progress(
    records: Arc<Mutex<Vec<Record>>>,
    total: usize,
    started: Instant,
    quick: bool,
) {
    let tty = std::io::stderr().is_terminal();
    let every = if tty {
        Duration::from_millis(200)
    } else if quick {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(5)
    };
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tick.tick().await;
        let line = progress_line(&lock(&records), total, started.elapsed());
        let mut err = std::io::stderr().lock();
        if tty {
            let _ = write!(err, "\r\x1b[2K{line}");
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
    }
}

/// Erases the progress line on a terminal.
pub fn clear_progress_line() {
    let mut err = std::io::stderr().lock();
    if err.is_terminal() {
        let _ = write!(err, "\r\x1b[2K");
        let _ = err.flush();
    }
}

fn progress_line(records: &[Record], total: usize, elapsed: Duration) -> String {
    let (mut local, mut provider, mut rejected) = (0, 0, 0);
    let mut ttfts = Vec::new();
    for r in records {
        match r.destination {
            Destination::Local(_) => local += 1,
            Destination::Provider(_) => provider += 1,
            Destination::Immediate => rejected += 1,
            Destination::None => {}
        }
        if let Some(t) = answered_ttft(r) {
            ttfts.push(t);
        }
    }
    ttfts.sort_by(f64::total_cmp);
    let secs = elapsed.as_secs_f64();
    format!(
        "[{done:>w$}/{total}] {secs:5.1} s  {rate:5.1} req/s   local {local} · provider {provider} · rejected {rejected}   TTFT p50 {p50}",
        done = records.len(),
        w = total.to_string().len(),
        rate = records.len() as f64 / secs.max(1e-3),
        p50 = fmt_ms(percentile(&ttfts, 0.5)),
    )
}

/// TTFT in ms of a request that an upstream answered successfully.
fn answered_ttft(r: &Record) -> Option<f64> {
    match r.destination {
        Destination::Local(_) | Destination::Provider(_)
            if (200..300).contains(&r.status) && !r.broken =>
        {
            r.ttft.map(|t| t.as_secs_f64() * 1000.0)
        }
        _ => None,
    }
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil().max(1.0) as usize;
    Some(sorted[rank.min(sorted.len()) - 1])
}

fn fmt_ms(v: Option<f64>) -> String {
    match v {
        None => "-".to_string(),
        Some(ms) if ms >= 10_000.0 => format!("{:.1} s", ms / 1000.0),
        Some(ms) if ms >= 100.0 => format!("{ms:.0} ms"),
        Some(ms) => format!("{ms:.1} ms"),
    }
}

pub struct Input<'a> {
    pub policy: &'a CompiledPolicy,
    pub requests: &'a [DemoRequest],
    pub records: &'a [Record],
    pub servers: &'a [Server],
    pub elapsed: Duration,
}

/// Requests that failed outside the policy: the EPP or every upstream was
/// unreachable, or an upstream broke.
pub fn failures(records: &[Record]) -> usize {
    records.iter().filter(|r| is_failure(r)).count()
}

fn is_failure(r: &Record) -> bool {
    r.broken
        || r.destination == Destination::None
        || (r.status >= 500 && r.destination != Destination::Immediate)
}

const NO_RULE: &str = "(no rule: EPP refusal)";

/// The rule a record belongs to. An immediate response without a rule header
/// is attributed to the rule whose reject status and message it carries,
/// when exactly one rule has them.
fn rule_of(policy: &CompiledPolicy, r: &Record) -> String {
    if let Some(rule) = &r.rule {
        return rule.clone();
    }
    if r.destination == Destination::Immediate {
        let mut owners = policy.rules.iter().filter(|rule| {
            rule.route.reject.status == r.status
                && Some(rule.route.reject.message.as_str()) == r.message.as_deref()
        });
        if let (Some(rule), None) = (owners.next(), owners.next()) {
            return rule.name.clone();
        }
    }
    NO_RULE.to_string()
}

#[derive(Default)]
struct Row {
    requests: usize,
    local: usize,
    provider: usize,
    rejected: usize,
    failed: usize,
    ttfts: Vec<f64>,
}

impl Row {
    fn add(&mut self, r: &Record) {
        self.requests += 1;
        match r.destination {
            Destination::Local(_) => self.local += 1,
            Destination::Provider(_) => self.provider += 1,
            Destination::Immediate => self.rejected += 1,
            Destination::None => self.failed += 1,
        }
        if let Some(t) = answered_ttft(r) {
            self.ttfts.push(t);
        }
    }
}

/// Where a record went, in a few words: the model served, the provider, or
/// the reject status.
fn landing(r: &Record) -> String {
    match &r.destination {
        Destination::Local(_) => r.model.clone().unwrap_or_else(|| "local".into()),
        Destination::Provider(p) => format!("provider {p}"),
        Destination::Immediate => format!("{}", r.status),
        Destination::None if r.status == 0 => "no response".to_string(),
        Destination::None => format!("failed {}", r.status),
    }
}

pub fn render(input: &Input<'_>) -> String {
    let mut out = String::new();
    let policy = input.policy;
    let kind_of: BTreeMap<String, Kind> = input
        .requests
        .iter()
        .map(|r| (r.id.to_string(), r.kind))
        .collect();

    // Decisions by rule, in policy order.
    let mut rows: BTreeMap<String, Row> = BTreeMap::new();
    for r in input.records {
        rows.entry(rule_of(policy, r)).or_default().add(r);
    }
    let mut order: Vec<String> = policy.rules.iter().map(|r| r.name.clone()).collect();
    order.extend(
        rows.keys()
            .filter(|k| !order.contains(k))
            .cloned()
            .collect::<Vec<_>>(),
    );
    let width = order.iter().map(String::len).max().unwrap_or(4).max(5);
    let _ = writeln!(
        out,
        "Decisions by rule (TTFT: request sent to Envoy → first streamed byte, answered requests)"
    );
    let _ = writeln!(
        out,
        "  {:<width$}  {:>8}  {:>5}  {:>8}  {:>8}  {:>9}  {:>9}",
        "rule", "requests", "local", "provider", "rejected", "p50 TTFT", "p90 TTFT"
    );
    let mut total = Row::default();
    for name in &order {
        let row = rows.remove(name).unwrap_or_default();
        let mut ttfts = row.ttfts.clone();
        ttfts.sort_by(f64::total_cmp);
        let _ = writeln!(
            out,
            "  {:<width$}  {:>8}  {:>5}  {:>8}  {:>8}  {:>9}  {:>9}",
            name,
            row.requests,
            row.local,
            row.provider,
            row.rejected,
            fmt_ms(percentile(&ttfts, 0.5)),
            fmt_ms(percentile(&ttfts, 0.9)),
        );
        total.requests += row.requests;
        total.local += row.local;
        total.provider += row.provider;
        total.rejected += row.rejected;
        total.failed += row.failed;
        total.ttfts.extend(row.ttfts);
    }
    total.ttfts.sort_by(f64::total_cmp);
    let _ = writeln!(
        out,
        "  {:<width$}  {:>8}  {:>5}  {:>8}  {:>8}  {:>9}  {:>9}",
        "total",
        total.requests,
        total.local,
        total.provider,
        total.rejected,
        fmt_ms(percentile(&total.ttfts, 0.5)),
        fmt_ms(percentile(&total.ttfts, 0.9)),
    );

    // Rejects by status.
    let mut rejects: BTreeMap<u16, BTreeMap<String, usize>> = BTreeMap::new();
    for r in input
        .records
        .iter()
        .filter(|r| r.destination == Destination::Immediate)
    {
        *rejects
            .entry(r.status)
            .or_default()
            .entry(rule_of(policy, r))
            .or_default() += 1;
    }
    let _ = writeln!(out);
    if rejects.is_empty() {
        let _ = writeln!(out, "Rejects by status: none");
    } else {
        let parts: Vec<String> = rejects
            .iter()
            .map(|(status, by_rule)| {
                let n: usize = by_rule.values().sum();
                let rules: Vec<&str> = by_rule.keys().map(String::as_str).collect();
                format!("{status} ×{n} ({})", rules.join(", "))
            })
            .collect();
        let _ = writeln!(out, "Rejects by status: {}", parts.join(" · "));
    }

    // Workload kinds → rules → where they landed.
    let _ = writeln!(out);
    let _ = writeln!(out, "Workload → rule → destination");
    let mut by_kind: BTreeMap<Kind, BTreeMap<String, BTreeMap<String, usize>>> = BTreeMap::new();
    for r in input.records {
        let Some(kind) = kind_of.get(&r.request_id) else {
            continue;
        };
        *by_kind
            .entry(*kind)
            .or_default()
            .entry(rule_of(policy, r))
            .or_default()
            .entry(landing(r))
            .or_default() += 1;
    }
    for (kind, rules) in &by_kind {
        let n: usize = rules.values().flat_map(|d| d.values()).sum();
        let mut rules: Vec<(&String, &BTreeMap<String, usize>)> = rules.iter().collect();
        rules.sort_by_key(|(_, d)| std::cmp::Reverse(d.values().sum::<usize>()));
        let parts: Vec<String> = rules
            .iter()
            .map(|(rule, dest)| {
                let count: usize = dest.values().sum();
                let mut dest: Vec<(&String, &usize)> = dest.iter().collect();
                dest.sort_by_key(|(_, c)| std::cmp::Reverse(**c));
                let dest: Vec<String> = dest.iter().map(|(d, c)| format!("{d} {c}")).collect();
                format!("{rule} {count} → {}", dest.join(", "))
            })
            .collect();
        let _ = writeln!(out, "  {:<20} {:>4}  {}", kind.name(), n, parts.join("; "));
    }

    // Servers.
    let _ = writeln!(out);
    let _ = writeln!(out, "Servers (warm-up requests included)");
    let _ = writeln!(
        out,
        "  {:<18}  {:<16}  {:<12}  {:>6}  {:>20}",
        "name", "address", "model", "served", "prompt tokens cached"
    );
    for s in input.servers {
        let stats = s.handle.stats();
        let cached = if stats.prompt_tokens > 0 {
            format!(
                "{:.0}%",
                100.0 * stats.cached_prompt_tokens as f64 / stats.prompt_tokens as f64
            )
        } else {
            "-".to_string()
        };
        let name = if s.provider {
            format!("{} (provider)", s.label)
        } else {
            s.label.clone()
        };
        let _ = writeln!(
            out,
            "  {:<18}  {:<16}  {:<12}  {:>6}  {:>20}",
            name,
            s.handle.addr().to_string(),
            s.model,
            stats.requests_served,
            cached
        );
    }

    // Checks and summary.
    let _ = writeln!(out);
    let pii: Vec<&Record> = input
        .records
        .iter()
        .filter(|r| kind_of.get(&r.request_id) == Some(&Kind::Pii))
        .collect();
    let leaked = pii
        .iter()
        .filter(|r| matches!(r.destination, Destination::Provider(_)))
        .count();
    let _ = writeln!(
        out,
        "Prompts with personal data sent to a provider: {leaked} of {}",
        pii.len()
    );
    let n = input.records.len();
    let secs = input.elapsed.as_secs_f64();
    let failed = failures(input.records);
    let _ = writeln!(
        out,
        "{} requests in {secs:.1} s ({:.1} req/s); {}",
        n,
        n as f64 / secs.max(1e-3),
        if failed == 0 {
            "every request got its answer or its reject.".to_string()
        } else {
            format!("{failed} failed outside the policy (EPP or upstream unreachable).")
        }
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_formatting() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(5.0));
        assert_eq!(percentile(&v, 0.9), Some(9.0));
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(fmt_ms(Some(12.34)), "12.3 ms");
        assert_eq!(fmt_ms(Some(1234.0)), "1234 ms");
        assert_eq!(fmt_ms(None), "-");
    }
}
