//! The release workflow (`.github/workflows/`) checked statically by
//! actionlint (built from the Go module proxy): expressions, contexts,
//! job needs, action inputs. It runs only on a tag push, so this is what CI
//! can know of it before a release.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, Result, ensure};

fn actionlint() -> Result<PathBuf> {
    kinference_e2e::tools::installed("actionlint", "KINFERENCE_ACTIONLINT")
}

/// actionlint's findings on `files` (empty when it passes them).
fn lint(files: &[PathBuf]) -> Result<String> {
    let out = Command::new(actionlint()?)
        .arg("-no-color")
        .args(files)
        .output()
        .context("running actionlint")?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success() == text.trim().is_empty(),
        "actionlint exited {} with: {text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(text)
}

#[test]
fn the_workflows_pass_actionlint() -> Result<()> {
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.github/workflows"));
    let files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yml" || e == "yaml"))
        .collect();
    ensure!(
        files.iter().any(|f| f.ends_with("release.yml")),
        "no release workflow in {}",
        dir.display()
    );
    let findings = lint(&files)?;
    ensure!(findings.is_empty(), "{findings}");
    Ok(())
}

/// The check has teeth: a job that needs one that does not exist, and an
/// unknown context, are found.
#[test]
fn a_broken_workflow_is_caught() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("kinference-actionlint-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("broken.yml");
    std::fs::write(
        &file,
        "on: push\njobs:\n  a:\n    needs: missing\n    runs-on: ubuntu-24.04\n    steps:\n      - run: echo ${{ githubb.sha }}\n",
    )?;
    let findings = lint(std::slice::from_ref(&file))?;
    let _ = std::fs::remove_dir_all(&dir);
    ensure!(findings.contains("missing"), "{findings}");
    ensure!(findings.contains("githubb"), "{findings}");
    Ok(())
}
