//! `kinference test policy.yaml tests.yaml`: cases a team keeps next to its
//! policy, each a request, the classifier tags to assume, a candidate
//! snapshot and the expected outcome, run with the real compiler and
//! evaluator; then which rules and tiers no case reaches.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, anyhow, bail};
use kinference_policy::CompiledPolicy;
use kinference_policy::attr::CandidateType;
use kinference_policy::duration::parse_duration;
use kinference_policy::eval::{Candidate, Decision, Request, parse_candidates};
use kinference_policy::source::{compile_text, parse_documents};
use serde::Deserialize;
use serde_json::Value as Json;

use crate::explain::{Explanation, check_tags, explain};

/// The test file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TestFile {
    /// Named candidate snapshots that cases refer to by name.
    #[serde(default)]
    candidates: BTreeMap<String, Json>,
    cases: Vec<Case>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    request: Request,
    /// Tags the classifiers emit. A classifier none of whose tags is listed
    /// emits nothing, as when it times out or is skipped.
    #[serde(default)]
    tags: Vec<String>,
    candidates: Snapshot,
    expect: Expect,
}

/// A fixture's name, or the candidates themselves.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Snapshot {
    Named(String),
    Inline(Json),
}

/// What must hold; every field given is checked.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Expect {
    /// The rule that decided (routed or rejected).
    rule: Option<String>,
    /// The winner, as `endpoint:model` (`provider/name:model` for providers).
    candidate: Option<String>,
    /// `Local` or `Provider`.
    #[serde(rename = "type")]
    kind: Option<CandidateType>,
    /// The model the request is sent with.
    model: Option<String>,
    /// The request is rejected with this status.
    reject: Option<u16>,
    /// No candidate has room and the rule says wait (`onEmpty: Wait`): the
    /// request waits at most this long (`10s`), then gets `reject`.
    wait: Option<String>,
    /// Rules that matched but had no survivor, in order.
    fell_through: Option<Vec<String>>,
}

/// Runs every case; `Ok(false)` when any fails.
pub fn run(policy: &Path, tests: &Path, seed: u64) -> anyhow::Result<bool> {
    let compiled = compile_text(&read(policy)?).map_err(|errors| {
        let lines: Vec<_> = errors
            .iter()
            .map(|e| format!("{}: {e}", policy.display()))
            .collect();
        anyhow!("the policy does not compile:\n{}", lines.join("\n"))
    })?;
    let file = read_tests(tests)?;
    let mut coverage = Coverage::of(&compiled);
    let mut failed = 0;
    for case in &file.cases {
        let candidates = resolve(&file, &case.candidates)
            .and_then(|c| check_tags(&compiled, &case.tags).map(|()| c))
            .with_context(|| format!("{}: case {:?}", tests.display(), case.name))?;
        let explained = explain(&compiled, &case.request, &case.tags, &candidates, seed);
        coverage.record(&explained);
        let problems = check(&case.expect, &explained);
        if problems.is_empty() {
            println!("ok    {}", case.name);
        } else {
            failed += 1;
            println!("FAIL  {}", case.name);
            for p in &problems {
                println!("        {p}");
            }
            print!("{}", indent(&explained.render(), "        | "));
        }
    }
    println!(
        "\n{} cases, {} passed, {failed} failed",
        file.cases.len(),
        file.cases.len() - failed
    );
    print!("{}", coverage.report());
    Ok(failed == 0)
}

fn resolve(file: &TestFile, snapshot: &Snapshot) -> anyhow::Result<Vec<Candidate>> {
    let json = match snapshot {
        Snapshot::Inline(c) => c,
        Snapshot::Named(name) => file
            .candidates
            .get(name)
            .ok_or_else(|| anyhow!("no candidate fixture named {name:?}"))?,
    };
    parse_candidates(json.clone()).map_err(|e| anyhow!(e))
}

/// Every way the outcome differs from `expect`, as `expected ..., got ...`.
fn check(expect: &Expect, e: &Explanation<'_>) -> Vec<String> {
    let mut problems = Vec::new();
    let mut compare = |what: &str, want: Option<String>, got: Option<String>| {
        if let Some(want) = want
            && Some(&want) != got.as_ref()
        {
            let got = got.unwrap_or_else(|| "nothing".into());
            problems.push(format!("expected {what} {want}, got {got}"));
        }
    };
    let rules = &e.policy.rules;
    let (rule, winner, status, wait) = match &e.decision {
        Decision::Route(r) => (
            Some(rules[r.rule].name.clone()),
            Some(&e.candidates[r.winner]),
            None,
            None,
        ),
        Decision::Reject(r) => (
            r.rule.map(|i| rules[i].name.clone()),
            None,
            Some(r.status),
            r.wait,
        ),
    };
    compare("rule", expect.rule.clone(), rule);
    compare(
        "candidate",
        expect.candidate.clone(),
        winner.map(Candidate::label),
    );
    compare(
        "type",
        expect.kind.map(|k| format!("{k:?}")),
        winner.map(|w| format!("{:?}", w.kind)),
    );
    compare(
        "model",
        expect.model.clone(),
        winner.map(|w| w.model.clone()),
    );
    compare(
        "reject",
        expect.reject.map(|s| s.to_string()),
        status.map(|s| s.to_string()),
    );
    // Compared as durations: `10s` and `10000ms` are the same wait.
    let want_wait = expect.wait.as_deref().map(|w| match parse_duration(w) {
        Ok(d) => format!("{d:?}"),
        Err(err) => format!("{w} ({err})"),
    });
    compare("wait", want_wait, wait.map(|d| format!("{d:?}")));
    let fell: Vec<String> = e
        .trace
        .rules
        .iter()
        .filter(|r| r.fell_through)
        .map(|r| r.rule.clone())
        .collect();
    compare(
        "fall-through",
        expect.fell_through.as_ref().map(|f| f.join(" -> ")),
        Some(fell.join(" -> ")),
    );
    problems
}

/// Which rules matched a case, and which tiers picked a winner.
struct Coverage {
    rules: Vec<String>,
    tiers: Vec<(usize, usize)>,
    reached_rules: BTreeSet<String>,
    reached_tiers: BTreeSet<(usize, usize)>,
}

impl Coverage {
    fn of(policy: &CompiledPolicy) -> Self {
        let rules = policy.rules.iter().map(|r| r.name.clone()).collect();
        let tiers = policy
            .rules
            .iter()
            .enumerate()
            .flat_map(|(i, r)| (0..r.route.select.len()).map(move |t| (i, t)))
            .collect();
        Coverage {
            rules,
            tiers,
            reached_rules: BTreeSet::new(),
            reached_tiers: BTreeSet::new(),
        }
    }

    fn record(&mut self, e: &Explanation<'_>) {
        for rule in e.trace.rules.iter().filter(|r| r.matched) {
            self.reached_rules.insert(rule.rule.clone());
            let Some(index) = self.rules.iter().position(|n| *n == rule.rule) else {
                continue;
            };
            for tier in rule.tiers.iter().filter(|t| t.winner.is_some()) {
                self.reached_tiers.insert((index, tier.tier));
            }
        }
    }

    fn report(&self) -> String {
        let rules: Vec<&str> = self
            .rules
            .iter()
            .filter(|r| !self.reached_rules.contains(*r))
            .map(String::as_str)
            .collect();
        let tiers: Vec<String> = self
            .tiers
            .iter()
            .filter(|t| !self.reached_tiers.contains(t))
            .map(|(r, t)| format!("rules[{r}].route.select[{t}] ({})", self.rules[*r]))
            .collect();
        let mut out = format!(
            "coverage: {}/{} rules matched by a case, {}/{} tiers picked a winner\n",
            self.rules.len() - rules.len(),
            self.rules.len(),
            self.tiers.len() - tiers.len(),
            self.tiers.len()
        );
        if !rules.is_empty() {
            let _ = writeln!(out, "  rules no case reaches: {}", rules.join(", "));
        }
        if !tiers.is_empty() {
            let _ = writeln!(out, "  tiers no case picks from: {}", tiers.join(", "));
        }
        out
    }
}

fn indent(text: &str, prefix: &str) -> String {
    text.lines().map(|l| format!("{prefix}{l}\n")).collect()
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn read_tests(path: &Path) -> anyhow::Result<TestFile> {
    let docs = parse_documents(&read(path)?).map_err(|d| anyhow!("{}: {d}", path.display()))?;
    let Some(doc) = docs.into_iter().next() else {
        bail!("{} is empty", path.display());
    };
    serde_path_to_error::deserialize::<Json, TestFile>(doc.value).map_err(|e| {
        let line = doc_line(path, &e.path().to_string());
        anyhow!("{}{line}: {}: {}", path.display(), e.path(), e.inner())
    })
}

/// Best effort: the line of a path in the test file, as `:N`.
fn doc_line(path: &Path, json_path: &str) -> String {
    let Ok(text) = std::fs::read_to_string(path) else {
        return String::new();
    };
    let Ok(docs) = parse_documents(&text) else {
        return String::new();
    };
    docs.first()
        .and_then(|d| d.line_of(json_path))
        .map(|l| format!(":{l}"))
        .unwrap_or_default()
}
