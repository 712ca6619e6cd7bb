//! The committed `crds/` must be exactly what `kinference crds` prints.

#[test]
fn committed_crd_matches_the_generated_one() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../crds/inferencepolicies.kinference.io.yaml"
    );
    let committed = std::fs::read_to_string(path).expect("crds/ holds the CRD");
    assert!(
        committed == kinference_api::crd_yaml(),
        "crds/ is stale: run `cargo run -p kinference -- crds --dir crds`"
    );
}

#[test]
fn committed_admission_policy_matches_the_generated_one() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../crds/inferencepolicies.kinference.io-admission.yaml"
    );
    let committed = std::fs::read_to_string(path).expect("crds/ holds the admission policy");
    assert!(
        committed == kinference_api::admission_yaml(),
        "crds/ is stale: run `cargo run -p kinference -- crds --dir crds`"
    );
}
