//! `kinference explain` as a user runs it: the trace names the tie set of a
//! `within` tier and the tieBreak that chose the winner.

use std::process::Command;

const POLICY: &str = "pool: { selector: { app: vllm }, targetPorts: [{ number: 8000 }] }
rules:
  - name: fastest
    route:
      select: [{ minimize: PredictedTTFT, within: 50ms }]
      tieBreak: Random
";

const REQUEST: &str = "model: m\n";

const CANDIDATES: &str = "
- { type: Local, endpoint: a, address: \"10.0.0.1:8000\", model: m, PredictedTTFT: 100ms }
- { type: Local, endpoint: b, address: \"10.0.0.2:8000\", model: m, PredictedTTFT: 140ms }
- { type: Local, endpoint: c, address: \"10.0.0.3:8000\", model: m, PredictedTTFT: 300ms }
";

#[test]
fn the_trace_names_the_tie_set_and_the_tie_break() {
    let dir = std::env::temp_dir().join(format!("kinference-explain-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let out = Command::new(env!("CARGO_BIN_EXE_kinference"))
        .arg("explain")
        .arg("--policy")
        .arg(file("policy.yaml", POLICY))
        .arg("--request")
        .arg(file("request.yaml", REQUEST))
        .arg("--candidates")
        .arg(file("candidates.yaml", CANDIDATES))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("    tied: a:m, b:m (tieBreak Random)\n"),
        "{stdout}"
    );
    let winner = stdout
        .lines()
        .find_map(|l| l.strip_prefix("    winner: "))
        .unwrap_or_else(|| panic!("no winner in {stdout}"));
    assert!(
        ["a:m", "b:m"].contains(&winner),
        "{winner} is not in the tie"
    );
    std::fs::remove_dir_all(&dir).ok();
}
