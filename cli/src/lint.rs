use std::path::PathBuf;

use anyhow::Context;
use kinference_policy::source::lint_text;

/// Lints every file; `Ok(false)` when any has errors.
pub fn run(files: &[PathBuf]) -> anyhow::Result<bool> {
    let mut clean = true;
    for file in files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let report = lint_text(&file.display().to_string(), &text);
        for line in &report.errors {
            println!("{line}");
        }
        for (name, rules) in &report.accepted {
            println!("{}: {name}: ok ({rules} rules)", file.display());
        }
        clean &= report.errors.is_empty();
    }
    Ok(clean)
}
