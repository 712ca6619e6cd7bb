//! `kinference lint` as a user runs it: warnings with their line and fix,
//! exit 0 unless `--deny-warnings`.

use std::process::Command;

fn kinference() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kinference"))
}

const SHADOWED: &str = "pool: { selector: { app: vllm }, targetPorts: [{ number: 8000 }] }
rules:
  - name: all-alice
    matches: [{ tenant: [alice, bob] }]
    route: { select: [{ minimize: RunningRequests }] }
  - name: alice-long
    matches: [{ tenant: alice }]
    route: { select: [{ minimize: RunningRequests }] }
  - name: rest
    route: { select: [{ minimize: RunningRequests }] }
";

#[test]
fn warnings_name_the_line_and_a_fix_and_fail_only_when_denied() {
    let dir = std::env::temp_dir().join(format!("kinference-lint-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("policy.yaml");
    std::fs::write(&file, SHADOWED).unwrap();

    let out = kinference().arg("lint").arg(&file).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "{}:7: rules[1].matches: warning: rule \"alice-long\" can never match: every request it matches is taken by the earlier rule \"all-alice\" (fix: move it before \"all-alice\"",
            file.display()
        )),
        "{stdout}"
    );

    let denied = kinference()
        .args(["lint", "--deny-warnings"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(!denied.status.success());

    // Fixed: clean either way.
    std::fs::write(
        &file,
        SHADOWED.replace("tenant: alice }", "tenant: carol }"),
    )
    .unwrap();
    let fixed = kinference()
        .args(["lint", "--deny-warnings"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        fixed.status.success(),
        "{}",
        String::from_utf8_lossy(&fixed.stdout)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
