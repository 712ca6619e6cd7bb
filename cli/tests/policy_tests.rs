//! `kinference test` as a team runs it in CI: the shipped example tests pass
//! with full rule coverage, and a wrong expectation fails with a diff.

use std::path::Path;
use std::process::{Command, Output};

fn kinference_test(policy: &Path, tests: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kinference"))
        .arg("test")
        .arg(policy)
        .arg(tests)
        .output()
        .unwrap()
}

fn examples() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples"))
}

#[test]
fn every_example_policy_has_passing_tests_that_match_every_rule() {
    let mut tested = 0;
    for entry in std::fs::read_dir(examples()).unwrap() {
        let policy = entry.unwrap().path();
        if policy.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let stem = policy.file_stem().unwrap().to_string_lossy();
        let tests = examples().join(format!("tests/{stem}.tests.yaml"));
        assert!(tests.exists(), "{} has no tests", policy.display());
        let out = kinference_test(&policy, &tests);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!stdout.contains("rules no case reaches"), "{stdout}");
        tested += 1;
    }
    assert!(tested >= 5, "only {tested} example policies");
}

#[test]
fn a_wrong_expectation_fails_with_what_was_expected_and_the_trace() {
    let dir = std::env::temp_dir().join(format!("kinference-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tests = dir.join("tests.yaml");
    std::fs::write(
        &tests,
        "cases:
  - name: pii goes out
    request: { model: qwen-2.5, tenant: alice }
    tags: [pii-confirmed]
    candidates:
      - { type: Local, endpoint: vllm-a, backend: vllm, model: qwen-2.5, QueueDepth: 1, PredictedTTFT: 80ms }
      - { type: Provider, endpoint: openai, provider: openai, model: qwen-2.5, ObservedTTFT: 450ms }
    expect: { rule: overflow, type: Provider }
",
    )
    .unwrap();
    let out = kinference_test(&examples().join("pii-stays-local.yaml"), &tests);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(stdout.contains("FAIL  pii goes out"), "{stdout}");
    assert!(
        stdout.contains("expected rule overflow, got pii-stays-local"),
        "{stdout}"
    );
    assert!(
        stdout.contains("expected type Provider, got Local"),
        "{stdout}"
    );
    assert!(
        stdout.contains("| decision: route to vllm-a:qwen-2.5 by rule pii-stays-local"),
        "{stdout}"
    );
    assert!(stdout.contains("1 cases, 0 passed, 1 failed"), "{stdout}");
    // A typo in the test file is an error with its path, not a silent pass.
    std::fs::write(&tests, "cases:\n  - name: x\n    request: { model: m }\n    candidates: []\n    expect: { rul: x }\n").unwrap();
    let out = kinference_test(&examples().join("pii-stays-local.yaml"), &tests);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("cases[0].expect"), "{stderr}");
    assert!(stderr.contains("unknown field `rul`"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}
