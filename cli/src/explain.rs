use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, bail};
use kinference_policy::CompiledPolicy;
use kinference_policy::duration::format_seconds;
use kinference_policy::eval::{
    Candidate, Decision, Request, Trace, evaluate_with, parse_candidates,
};
use kinference_policy::source::{compile_text, parse_documents};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::Value as Json;

pub fn run(
    policy: &Path,
    request: &Path,
    candidates: &Path,
    json: bool,
    seed: u64,
) -> anyhow::Result<bool> {
    let compiled = compile_file(policy)?;
    let (request, tags) = read_request(request)?;
    check_tags(&compiled, &tags)?;
    let candidates = parse_candidates(read_value(candidates)?)
        .map_err(|e| anyhow::anyhow!("{}: {e}", candidates.display()))?;
    let explanation = explain(&compiled, &request, &tags, &candidates, seed);
    if json {
        println!("{}", serde_json::to_string_pretty(&explanation.to_json())?);
    } else {
        print!("{}", explanation.render());
    }
    Ok(true)
}

/// Tags to assume must be ones the policy's classifiers can emit: a typo
/// would otherwise read as "the classifier emitted nothing".
pub fn check_tags(policy: &CompiledPolicy, tags: &[String]) -> anyhow::Result<()> {
    let known = |t: &String| policy.classifiers.iter().any(|c| c.tags.contains(t));
    if let Some(unknown) = tags.iter().find(|t| !known(t)) {
        let all: Vec<&str> = policy
            .classifiers
            .iter()
            .flat_map(|c| c.tags.iter().map(String::as_str))
            .collect();
        bail!(
            "no classifier of the policy emits tag {unknown:?} (they emit: {})",
            all.join(", ")
        );
    }
    Ok(())
}

pub struct Explanation<'a> {
    pub trace: Trace,
    pub decision: Decision,
    pub policy: &'a CompiledPolicy,
    pub candidates: &'a [Candidate],
    pub tags: Vec<String>,
}

/// Evaluates with tracing. Classifiers emit those of `tags` they own, as if
/// they had run on the prompt; the others emit nothing (like a timeout).
pub fn explain<'a>(
    policy: &'a CompiledPolicy,
    request: &Request,
    tags: &[String],
    candidates: &'a [Candidate],
    seed: u64,
) -> Explanation<'a> {
    let mut trace = Trace::default();
    let mut rng = StdRng::seed_from_u64(seed);
    let (decision, emitted) =
        evaluate_with(policy, request, candidates, &mut rng, &mut trace, |c| {
            let owned = &policy.classifiers[c].tags;
            tags.iter().filter(|t| owned.contains(t)).cloned().collect()
        });
    Explanation {
        trace,
        decision,
        policy,
        candidates,
        tags: emitted.tags,
    }
}

impl Explanation<'_> {
    pub fn render(&self) -> String {
        let mut out = String::new();
        if !self.tags.is_empty() {
            let _ = writeln!(out, "tags: {}", self.tags.join(", "));
        }
        for rule in &self.trace.rules {
            if !rule.matched {
                let _ = writeln!(out, "rule {}: no match", rule.rule);
                for why in &rule.not_matched_because {
                    let _ = writeln!(out, "  {why}");
                }
                continue;
            }
            let _ = writeln!(out, "rule {}: matched", rule.rule);
            let _ = writeln!(out, "  consider: {}", list(&rule.considered));
            for item in &rule.excludes_not_applied {
                let _ = writeln!(out, "  exclude[{item}]: if did not hold, nothing dropped");
            }
            for d in &rule.dropped {
                let _ = writeln!(
                    out,
                    "  exclude[{}].drop[{}] dropped {}",
                    d.exclude, d.entry, d.candidate
                );
            }
            for tier in &rule.tiers {
                let ranking: Vec<_> = tier
                    .ranking
                    .iter()
                    .map(|(c, v)| {
                        if v.is_empty() {
                            c.clone()
                        } else {
                            format!("{c}={v}")
                        }
                    })
                    .collect();
                let _ = writeln!(
                    out,
                    "  select[{}] ({}): {}",
                    tier.tier,
                    tier.objective,
                    list(&ranking)
                );
                if !tier.left_out.is_empty() {
                    let _ = writeln!(out, "    not in this tier: {}", tier.left_out.join(", "));
                }
                if let Some(tie_break) = &tier.tie_break {
                    let _ = writeln!(
                        out,
                        "    tied: {} (tieBreak {tie_break})",
                        tier.tied.join(", ")
                    );
                }
                if let Some(w) = &tier.winner {
                    let _ = writeln!(out, "    winner: {w}");
                }
            }
            if rule.fell_through {
                let _ = writeln!(out, "  no tier had a survivor: onEmpty FallThrough");
            }
        }
        let _ = writeln!(out, "decision: {}", self.describe_decision());
        out
    }

    fn describe_decision(&self) -> String {
        match &self.decision {
            Decision::Route(r) => {
                let c = &self.candidates[r.winner];
                let fallback: Vec<_> = r.ranked[1..]
                    .iter()
                    .map(|&i| self.candidates[i].label())
                    .collect();
                let mut s = format!(
                    "route to {} by rule {}",
                    c.label(),
                    self.policy.rules[r.rule].name
                );
                if let Some(addr) = &c.address {
                    let _ = write!(s, " at {addr}");
                }
                if !fallback.is_empty() {
                    let _ = write!(s, "; fallback {}", fallback.join(", "));
                }
                s
            }
            Decision::Reject(r) => {
                let wait = r.wait.map_or(String::new(), |w| {
                    format!(
                        "wait up to {} for room, then ",
                        format_seconds(w.as_secs_f64())
                    )
                });
                match r.rule {
                    Some(i) => format!(
                        "{wait}reject {} {:?} by rule {}",
                        r.status, r.message, self.policy.rules[i].name
                    ),
                    None => format!("{wait}reject {} {:?}", r.status, r.message),
                }
            }
        }
    }

    pub fn to_json(&self) -> Json {
        let decision = match &self.decision {
            Decision::Route(r) => serde_json::json!({
                "action": "route",
                "rule": self.policy.rules[r.rule].name,
                "candidate": self.candidates[r.winner].label(),
                "address": self.candidates[r.winner].address,
                "ranked": r.ranked.iter().map(|&i| self.candidates[i].label()).collect::<Vec<_>>(),
            }),
            Decision::Reject(r) => serde_json::json!({
                "action": if r.wait.is_some() { "wait" } else { "reject" },
                "rule": r.rule.map(|i| self.policy.rules[i].name.clone()),
                "status": r.status,
                "message": r.message,
                "maxWaitSeconds": r.wait.map(|w| w.as_secs_f64()),
            }),
        };
        serde_json::json!({ "tags": self.tags, "trace": self.trace, "decision": decision })
    }
}

fn list(items: &[String]) -> String {
    if items.is_empty() {
        "(none)".into()
    } else {
        items.join(", ")
    }
}

/// The policy in `path`, or every compile error with the file's name.
pub fn compile_file(path: &Path) -> anyhow::Result<CompiledPolicy> {
    compile_text(&read(path)?).map_err(|errors| {
        let lines: Vec<_> = errors
            .iter()
            .map(|e| format!("{}: {e}", path.display()))
            .collect();
        anyhow::anyhow!("the policy does not compile:\n{}", lines.join("\n"))
    })
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn read_value(path: &Path) -> anyhow::Result<Json> {
    let docs =
        parse_documents(&read(path)?).map_err(|d| anyhow::anyhow!("{}: {d}", path.display()))?;
    match docs.into_iter().next() {
        Some(doc) => Ok(doc.value),
        None => bail!("{} is empty", path.display()),
    }
}

/// A request file is the request's attributes plus optional `tags`.
fn read_request(path: &Path) -> anyhow::Result<(Request, Vec<String>)> {
    let mut value = read_value(path)?;
    let tags = match value.as_object_mut().and_then(|m| m.remove("tags")) {
        None => Vec::new(),
        Some(t) => serde_json::from_value(t).context("tags must be a list of strings")?,
    };
    let request = serde_json::from_value(value)
        .with_context(|| format!("reading the request from {}", path.display()))?;
    Ok((request, tags))
}
