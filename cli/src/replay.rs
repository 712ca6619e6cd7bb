//! `kinference replay` and `kinference diff`: decide the records of an EPP's
//! decision log again, under one policy or two, and say what would change.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::io::BufRead;
use std::path::Path;

use anyhow::Context as _;
use kinference_policy::CompiledPolicy;
use kinference_policy::eval::{
    DecisionRecord, DiffSummary, Outcome, Totals, for_recorded_requests, replay,
    undecidable_predicates, unrecorded_headers,
};

use crate::explain::compile_file;

/// Each logged decision against `policy`'s.
pub fn run_replay(policy: &Path, log: &Path) -> anyhow::Result<bool> {
    let new = for_recorded_requests(&compile_file(policy)?);
    let seen = compare(log, &[&new], |record| {
        (record.decision.clone(), replay(&new, record))
    })?;
    print!("{}", report(&seen, "logged", "replayed", &[("", &new)]));
    Ok(true)
}

/// `old`'s decisions against `new`'s, each with the decision's own seed.
pub fn run_diff(old: &Path, new: &Path, log: &Path) -> anyhow::Result<bool> {
    let old = for_recorded_requests(&compile_file(old)?);
    let new = for_recorded_requests(&compile_file(new)?);
    let seen = compare(log, &[&old, &new], |record| {
        (replay(&old, record), replay(&new, record))
    })?;
    print!(
        "{}",
        report(&seen, "old", "new", &[("old ", &old), ("new ", &new)])
    );
    Ok(true)
}

/// What reading a log found.
struct Seen {
    summary: DiffSummary,
    /// A line describing each example record, by index.
    examples: BTreeMap<usize, String>,
    /// Lines that are not decision records (the EPP's own logs, when the
    /// decision log went to its stdout).
    other_lines: usize,
    /// Headers the replayed policies read that the records do not hold.
    unrecorded_headers: BTreeSet<String>,
}

/// Reads the log one line at a time (bounded memory whatever its length),
/// keeping a description of the records that are examples of a group.
fn compare(
    log: &Path,
    policies: &[&CompiledPolicy],
    mut decide: impl FnMut(&DecisionRecord) -> (Outcome, Outcome),
) -> anyhow::Result<Seen> {
    let file = std::fs::File::open(log).with_context(|| format!("opening {}", log.display()))?;
    let mut seen = Seen {
        summary: DiffSummary::default(),
        examples: BTreeMap::new(),
        other_lines: 0,
        unrecorded_headers: BTreeSet::new(),
    };
    let mut index = 0;
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", log.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        if !is_record(&line) {
            seen.other_lines += 1;
            continue;
        }
        let record = DecisionRecord::parse(&line)
            .map_err(|e| anyhow::anyhow!("{}:{}: {e}", log.display(), n + 1))?;
        for policy in policies {
            let missing = unrecorded_headers(policy, &record);
            seen.unrecorded_headers
                .extend(missing.into_iter().map(str::to_owned));
        }
        let (before, after) = decide(&record);
        if seen.summary.add(index, &before, &after) {
            seen.examples
                .insert(index, describe(&record, &before, &after));
        }
        index += 1;
    }
    Ok(seen)
}

/// A decision record has a `decision`; the EPP's log lines do not.
fn is_record(line: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(line).map_or(true, |v| {
        v.get("decision").is_some() || v.get("level").is_none()
    })
}

/// One changed record in a line: what the request was and where it went.
fn describe(record: &DecisionRecord, before: &Outcome, after: &Outcome) -> String {
    let r = &record.request;
    let tenant = r.tenant.as_deref().unwrap_or("none");
    format!(
        "{} model {}, tenant {tenant}, {} prompt tokens, tags [{}]: {} → {}",
        record.time,
        r.model,
        r.prompt_tokens,
        record.tags.join(", "),
        destination(before),
        destination(after)
    )
}

fn destination(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Route { candidate, .. } => candidate.clone(),
        Outcome::Reject { status, .. } => format!("reject {status}"),
    }
}

fn report(seen: &Seen, before: &str, after: &str, policies: &[(&str, &CompiledPolicy)]) -> String {
    let summary = &seen.summary;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} records, {} decisions change ({:.1}%)",
        summary.records,
        summary.changed,
        percent(summary.changed, summary.records)
    );
    for ((rules, kinds), group) in &summary.groups {
        let _ = writeln!(out, "  {:>6}  rule {rules}  ({kinds})", group.count);
        for i in &group.examples {
            let _ = writeln!(out, "          e.g. record {}, {}", i + 1, seen.examples[i]);
        }
    }
    let _ = writeln!(out, "{}", totals(before, &summary.old, summary.records));
    let _ = writeln!(out, "{}", totals(after, &summary.new, summary.records));
    let _ = writeln!(
        out,
        "expected cost: {:.6} → {:.6} ({:+.6})",
        summary.old.cost,
        summary.new.cost,
        summary.new.cost - summary.old.cost
    );
    if seen.other_lines > 0 {
        let _ = writeln!(
            out,
            "note: {} lines were not decision records (EPP logs) and were skipped",
            seen.other_lines
        );
    }
    if !seen.unrecorded_headers.is_empty() {
        let names: Vec<_> = seen.unrecorded_headers.iter().map(String::as_str).collect();
        let _ = writeln!(
            out,
            "note: the log's policy did not read header(s) {}, so the records do not hold them: \
             a replay sees them absent",
            names.join(", ")
        );
    }
    for (label, policy) in policies {
        let n = undecidable_predicates(policy);
        if n > 0 {
            let _ = writeln!(
                out,
                "note: the {label}policy has {n} prefix or regex test(s) on tenant, LoRA or header values, \
                 which records hold digested: they never match in a replay"
            );
        }
    }
    out
}

fn totals(side: &str, t: &Totals, records: usize) -> String {
    format!(
        "{side:>8}: local {} ({:.1}%), provider {} ({:.1}%), reject {} ({:.1}%)",
        t.local,
        percent(t.local, records),
        t.provider,
        percent(t.provider, records),
        t.reject,
        percent(t.reject, records)
    )
}

fn percent(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}
