//! The committed `crds/` must be exactly what `kinference crds` prints.

fn assert_committed(file: &str, generated: String) {
    let path = format!("{}/../../crds/{file}", env!("CARGO_MANIFEST_DIR"));
    let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(
        committed == generated,
        "crds/{file} is stale: run `cargo run -p kinference -- crds --dir crds`"
    );
}

#[test]
fn committed_crd_matches_the_generated_one() {
    assert_committed(
        "inferencepolicies.kinference.io.yaml",
        kinference_api::crd_yaml(),
    );
}

#[test]
fn committed_admission_policy_matches_the_generated_one() {
    assert_committed(
        "inferencepolicies.kinference.io-admission.yaml",
        kinference_api::admission_yaml(),
    );
}
