//! Every example policy compiles; every invalid one fails with the errors
//! recorded in its snapshot (reviewed by hand: paths, lines, wording).

use std::path::{Path, PathBuf};

use kinference_policy::source::lint_text;

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

#[test]
fn valid_examples_compile() {
    let files = yaml_files(&examples_dir());
    assert!(
        files.len() >= 5,
        "expected the example policies, found {files:?}"
    );
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let report = lint_text(&file.display().to_string(), &text);
        assert!(report.errors.is_empty(), "{}", report.errors.join("\n"));
        assert_eq!(report.accepted.len(), 1, "{}", file.display());
    }
}

#[test]
fn invalid_examples_report_every_error_with_path_and_line() {
    let dir = examples_dir().join("invalid");
    let files = yaml_files(&dir);
    assert!(files.len() >= 10);
    for file in files {
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        let text = std::fs::read_to_string(&file).unwrap();
        let report = lint_text(&format!("examples/invalid/{name}"), &text);
        assert!(report.accepted.is_empty(), "{name} should not compile");
        assert!(!report.errors.is_empty(), "{name} should report errors");
        insta::assert_snapshot!(
            name.trim_end_matches(".yaml").to_string(),
            report.errors.join("\n")
        );
    }
}
