use std::path::PathBuf;

use anyhow::Context;
use kinference_policy::source::lint_text;

/// Lints every file; `Ok(false)` when any has errors (or warnings, when
/// they are denied).
pub fn run(files: &[PathBuf], deny_warnings: bool) -> anyhow::Result<bool> {
    let mut clean = true;
    for file in files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let report = lint_text(&file.display().to_string(), &text);
        for line in report.errors.iter().chain(&report.warnings) {
            println!("{line}");
        }
        for (name, rules) in &report.accepted {
            println!("{}: {name}: ok ({rules} rules)", file.display());
        }
        let warned = deny_warnings && !report.warnings.is_empty();
        clean &= report.errors.is_empty() && !warned;
    }
    Ok(clean)
}
