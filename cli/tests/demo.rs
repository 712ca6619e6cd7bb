//! `kinference demo --quick` end to end (simulators, the EPP and the pinned
//! Envoy, installed into the cache on first use), and the embedded default
//! policy.

use std::process::Command;

const DEFAULT_POLICY: &str = include_str!("../src/demo/default-policy.yaml");

fn kinference() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kinference"));
    // Loopback only: never route the demo's HTTP through a proxy.
    cmd.env("NO_PROXY", "127.0.0.1")
        .env_remove("HTTP_PROXY")
        .env_remove("http_proxy");
    cmd
}

#[test]
fn the_default_policy_compiles_and_lints() {
    let compiled = kinference_policy::source::compile_text(DEFAULT_POLICY)
        .expect("the default policy compiles");
    assert!(compiled.rules.len() >= 5);

    // `kinference lint` accepts the file as committed ...
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/src/demo/default-policy.yaml");
    let out = kinference().args(["lint", path]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ok ("), "{stdout}");

    // ... and the copy `demo --print-policy` prints is that same file.
    let out = kinference()
        .args(["demo", "--print-policy"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), DEFAULT_POLICY);
}

#[test]
fn quick_demo_runs_every_rule_and_exits_cleanly() {
    let compiled = kinference_policy::source::compile_text(DEFAULT_POLICY).unwrap();
    let out = kinference().args(["demo", "--quick"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        out.status.code()
    );

    // The decisions table: `  <rule>  <requests>  <local>  <provider>  <rejected>  ...`.
    let table: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("Decisions by rule"))
        .skip(2)
        .take_while(|l| !l.trim().is_empty())
        .collect();
    for rule in &compiled.rules {
        let row = table
            .iter()
            .find(|l| l.split_whitespace().next() == Some(rule.name.as_str()))
            .unwrap_or_else(|| panic!("no row for rule {} in\n{stdout}", rule.name));
        let requests: usize = row.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(
            requests > 0,
            "rule {} decided nothing:\n{stdout}",
            rule.name
        );
    }
    let total = table
        .iter()
        .find(|l| l.trim_start().starts_with("total"))
        .expect("a total row");
    assert_eq!(total.split_whitespace().nth(1), Some("40"), "{stdout}");
    // Envoy's access log named the rule of every routed request.
    assert!(!stdout.contains("(no rule"), "{stdout}");

    // The requests went through the pinned Envoy.
    let envoy = format!(
        "Envoy {} on 127.0.0.1:",
        kinference_testbed::envoy::ENVOY_VERSION.trim()
    );
    assert!(stdout.contains(&envoy), "{stdout}");

    assert!(stdout.contains("Rejects by status: 401"), "{stdout}");
    assert!(
        stdout.contains("Prompts with personal data sent to a provider: 0 of"),
        "{stdout}"
    );
    assert!(
        stdout.contains("every request got its answer or its reject"),
        "{stdout}"
    );

    // No prompt text anywhere in the output.
    for secret in [
        "4111 1111 1111 1111",
        "@example.com",
        "def mean(xs)",
        "Owner manual",
    ] {
        assert!(
            !stdout.contains(secret) && !stderr.contains(secret),
            "{secret:?} leaked"
        );
    }
}
