//! `kinference replay` and `kinference diff`: decide the records of an EPP's
//! decision log again, under one policy or two, and say what would change.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::BufRead;
use std::path::Path;

use anyhow::Context as _;
use kinference_policy::CompiledPolicy;
use kinference_policy::eval::{
    DecisionRecord, DiffSummary, Outcome, Totals, for_recorded_requests, replay,
    undecidable_predicates,
};

use crate::explain::compile_file;

/// Each logged decision against `policy`'s.
pub fn run_replay(policy: &Path, log: &Path) -> anyhow::Result<bool> {
    let new = for_recorded_requests(&compile_file(policy)?);
    let (summary, examples) = compare(log, |i, record| {
        (record.decision.clone(), replay(&new, record, i as u64))
    })?;
    print!(
        "{}",
        report(&summary, &examples, "logged", "replayed", &[("", &new)])
    );
    Ok(true)
}

/// `old`'s decisions against `new`'s, both replayed with the same seeds.
pub fn run_diff(old: &Path, new: &Path, log: &Path) -> anyhow::Result<bool> {
    let old = for_recorded_requests(&compile_file(old)?);
    let new = for_recorded_requests(&compile_file(new)?);
    let (summary, examples) = compare(log, |i, record| {
        let seed = i as u64;
        (replay(&old, record, seed), replay(&new, record, seed))
    })?;
    print!(
        "{}",
        report(
            &summary,
            &examples,
            "old",
            "new",
            &[("old ", &old), ("new ", &new)]
        )
    );
    Ok(true)
}

/// Reads the log one line at a time (bounded memory whatever its length),
/// keeping a description of the records that are examples of a group.
fn compare(
    log: &Path,
    mut decide: impl FnMut(usize, &DecisionRecord) -> (Outcome, Outcome),
) -> anyhow::Result<(DiffSummary, BTreeMap<usize, String>)> {
    let file = std::fs::File::open(log).with_context(|| format!("opening {}", log.display()))?;
    let mut summary = DiffSummary::default();
    let mut examples = BTreeMap::new();
    let mut index = 0;
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", log.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let record = DecisionRecord::parse(&line)
            .map_err(|e| anyhow::anyhow!("{}:{}: {e}", log.display(), n + 1))?;
        let (before, after) = decide(index, &record);
        if summary.add(index, &before, &after) {
            examples.insert(index, describe(&record, &before, &after));
        }
        index += 1;
    }
    Ok((summary, examples))
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

fn report(
    summary: &DiffSummary,
    examples: &BTreeMap<usize, String>,
    before: &str,
    after: &str,
    policies: &[(&str, &CompiledPolicy)],
) -> String {
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
            let _ = writeln!(out, "          e.g. record {}, {}", i + 1, examples[i]);
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
