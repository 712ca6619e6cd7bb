//! `kinference replay` and `kinference diff` as a user runs them, on a log
//! in the EPP's format.

use std::process::Command;

use kinference_policy::attr::CandidateType;
use kinference_policy::eval::{Candidate, DecisionRecord, NoTrace, Request, evaluate_with};
use kinference_policy::source::compile_text;
use rand::SeedableRng;
use rand::rngs::StdRng;

const OLD: &str = "pool: { selector: { app: vllm }, targetPorts: [{ number: 8000 }] }
providers:
  - name: cloud
    baseURL: https://api.example.com/v1
    models: [{ name: m }]
rules:
  - name: gold-local
    matches: [{ tenant: gold }]
    route:
      consider: [{ backends: { type: Local } }]
      select: [{ minimize: QueueDepth }]
  - name: rest
    route:
      consider: [{ backends: {} }]
      select: [{ type: Provider, order: [cloud] }]
";

fn candidates() -> Vec<Candidate> {
    let mut local = Candidate {
        kind: CandidateType::Local,
        model: "m".into(),
        endpoint: "pod-a".into(),
        ..Candidate::default()
    };
    local.metrics.queue_depth = Some(1.0);
    local.metrics.cost = Some(0.001);
    let mut cloud = Candidate {
        kind: CandidateType::Provider,
        model: "m".into(),
        endpoint: "cloud".into(),
        provider_name: Some("cloud".into()),
        ..Candidate::default()
    };
    cloud.metrics.cost = Some(0.01);
    vec![local, cloud]
}

/// The log the EPP would write for these tenants under `OLD`.
fn log(tenants: &[&str]) -> String {
    let policy = compile_text(OLD).unwrap();
    let mut out = String::new();
    for tenant in tenants {
        let request = Request {
            model: "m".into(),
            tenant: Some((*tenant).into()),
            ..Request::default()
        };
        let mut rng = StdRng::seed_from_u64(0);
        let (decision, tags) = evaluate_with(
            &policy,
            &request,
            &candidates(),
            &mut rng,
            &mut NoTrace,
            |_| vec![],
        );
        let record = DecisionRecord::new(
            "2026-12-03T12:00:00Z".into(),
            &policy,
            &request,
            &tags,
            candidates(),
            &decision,
            0,
        );
        out.push_str(&serde_json::to_string(&record).unwrap());
        out.push('\n');
    }
    out
}

fn run(args: &[&std::ffi::OsStr]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kinference"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn replay_and_diff_report_the_changed_decisions_their_shares_and_cost() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.into_os_string()
    };
    let log = file("decisions.jsonl", &log(&["gold", "free", "gold", "free"]));
    let old = file("old.yaml", OLD);
    let new = file(
        "new.yaml",
        &OLD.replace("tenant: gold", "tenant: [gold, free]"),
    );

    let (ok, same, err) = run(&[
        "replay".as_ref(),
        "--policy".as_ref(),
        &old,
        "--log".as_ref(),
        &log,
    ]);
    assert!(ok, "{err}");
    assert!(
        same.starts_with("4 records, 0 decisions change (0.0%)\n"),
        "{same}"
    );
    assert!(
        same.contains("  logged: local 2 (50.0%), provider 2 (50.0%), reject 0 (0.0%)\n"),
        "{same}"
    );

    let (ok, diff, err) = run(&["diff".as_ref(), &old, &new, "--log".as_ref(), &log]);
    assert!(ok, "{err}");
    assert!(
        diff.starts_with("4 records, 2 decisions change (50.0%)\n"),
        "{diff}"
    );
    assert!(
        diff.contains("       2  rule rest → gold-local  (Provider → Local)\n"),
        "{diff}"
    );
    assert!(diff.contains(": provider/cloud:m → pod-a:m\n"), "{diff}");
    assert!(
        diff.contains("     new: local 4 (100.0%), provider 0 (0.0%), reject 0 (0.0%)\n"),
        "{diff}"
    );
    assert!(
        diff.contains("expected cost: 0.022000 → 0.004000 (-0.018000)\n"),
        "{diff}"
    );
    assert!(diff.contains(", tenant sha256:"), "{diff}");
    assert!(
        !diff.contains("tenant free"),
        "tenants stay digested: {diff}"
    );

    // The EPP's own log lines (a decision log on its stdout) are skipped;
    // a header the logging policy never read is said to be missing.
    let mixed = file(
        "mixed.jsonl",
        &format!(
            "{{\"level\":\"INFO\",\"message\":\"serving\"}}\n{}",
            log_text(&log)
        ),
    );
    let by_team = file(
        "team.yaml",
        &OLD.replace(
            "matches: [{ tenant: gold }]",
            "matches: [{ tenant: gold }, { header.x-team: blue }]",
        ),
    );
    let (ok, noted, err) = run(&["diff".as_ref(), &old, &by_team, "--log".as_ref(), &mixed]);
    assert!(ok, "{err}");
    assert!(
        noted.starts_with("4 records, 0 decisions change"),
        "{noted}"
    );
    assert!(
        noted.contains("note: 1 lines were not decision records (EPP logs) and were skipped\n"),
        "{noted}"
    );
    assert!(
        noted.contains("note: the log's policy did not read header(s) x-team,"),
        "{noted}"
    );

    let broken = file(
        "broken.jsonl",
        &format!("{}{{\"time\": 1}}\n", log_text(&log)),
    );
    let (ok, _, err) = run(&[
        "replay".as_ref(),
        "--policy".as_ref(),
        &old,
        "--log".as_ref(),
        &broken,
    ]);
    assert!(!ok);
    assert!(err.contains("broken.jsonl:5: "), "{err}");
}

fn log_text(path: &std::ffi::OsStr) -> String {
    std::fs::read_to_string(path).unwrap()
}
