//! The request and candidate files of `kinference explain` and `kinference
//! test` are held to the policy's own strictness.

use kinference_policy::eval::{CANDIDATE_FIELDS, Candidate, Request, parse_candidates};
use serde_json::json;

#[test]
fn a_misspelt_candidate_field_is_an_error_not_a_missing_value() {
    let err = parse_candidates(json!([
        {"type": "Local", "endpoint": "a", "model": "m", "QueueDepth": 1},
        {"type": "Local", "endpoint": "b", "model": "m", "KVCacheUtilisation": 0.9},
    ]))
    .unwrap_err();
    assert!(
        err.starts_with("candidates[1]: unknown field `KVCacheUtilisation` (known: type, model"),
        "{err}"
    );
}

#[test]
fn durations_need_a_unit_as_in_policies() {
    let err = parse_candidates(json!([
        {"type": "Local", "endpoint": "a", "model": "m", "PredictedTTFT": 300}
    ]))
    .unwrap_err();
    assert_eq!(
        err,
        "candidates[0].PredictedTTFT: write the duration 300 with its unit, as in policies: `300ms` or `300s`"
    );
    let ok = parse_candidates(json!([
        {"type": "Local", "endpoint": "a", "model": "m", "PredictedTTFT": "300ms"}
    ]))
    .unwrap();
    assert_eq!(ok[0].metrics.predicted_ttft, Some(0.3));
    let request: Result<Request, _> = serde_json::from_value(json!({"model": "m", "ttftSLO": 2}));
    assert!(request.unwrap_err().to_string().contains("with its unit"));
}

#[test]
fn what_is_written_out_reads_back_the_same() {
    let candidates = parse_candidates(json!([
        {"type": "Provider", "endpoint": "openai", "provider": "openai", "model": "m",
         "ObservedTTFT": "450ms", "Cost": 0.0004, "labels": {"tier": "gold"}}
    ]))
    .unwrap();
    let written = serde_json::to_value(&candidates).unwrap();
    assert_eq!(written[0]["ObservedTTFT"], "450ms");
    assert_eq!(parse_candidates(written).unwrap(), candidates);
}

#[test]
fn candidates_are_read_by_the_policy_attribute_names_and_the_old_ones() {
    let by_policy_names = parse_candidates(json!([
        {"type": "Local", "endpoint": "a", "model": "m", "backend.name": "vllm",
         "label.tier": "gold", "label.zone-class": "a"}
    ]))
    .unwrap();
    let by_old_names = parse_candidates(json!([
        {"type": "Local", "endpoint": "a", "model": "m", "backend": "vllm",
         "labels": {"tier": "gold", "zone-class": "a"}}
    ]))
    .unwrap();
    assert_eq!(by_policy_names, by_old_names);
    assert_eq!(by_policy_names[0].backend_name.as_deref(), Some("vllm"));
    assert_eq!(by_policy_names[0].labels["tier"], "gold");
    let both = parse_candidates(json!([
        {"type": "Local", "endpoint": "a", "model": "m", "backend.name": "x", "backend": "y"}
    ]));
    assert_eq!(
        both.unwrap_err(),
        "candidates[0]: both `backend.name` and `backend`: write only `backend.name`"
    );
}

#[test]
fn header_names_are_case_insensitive() {
    let request: Request =
        serde_json::from_value(json!({"model": "m", "headers": {"X-Team": "a"}})).unwrap();
    assert_eq!(request.headers["x-team"], "a");
}

#[test]
fn the_known_fields_are_exactly_what_a_full_candidate_writes() {
    let full = parse_candidates(json!([{
        "type": "Local", "model": "m", "endpoint": "e", "address": "1.2.3.4:8000",
        "backend.name": "b", "provider.name": "p", "zone": "z", "node": "n", "label.k": "v",
        "QueueDepth": 1, "RunningRequests": 1, "KVCacheUtilization": 0.5,
        "CachedPrefixTokens": 10, "PredictedTTFT": "1ms", "ObservedTTFT": "1ms",
        "ErrorRate": 0.1, "Cost": 0.1, "contextWindow": 8192, "loraLoaded": 1,
        "loraSlotsFree": 2, "InFlight": 3, "cachedPrefixSource": "events",
        "placement": { "room": "20ms", "replicaShare": "-300ms" }
    }]))
    .unwrap();
    let written = serde_json::to_value(&full[0]).unwrap();
    let mut keys: Vec<&str> = written
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    // What is written is what policies name; the old spellings are read.
    let mut known: Vec<&str> = CANDIDATE_FIELDS
        .iter()
        .copied()
        .filter(|f| !["backend", "provider", "labels"].contains(f))
        .map(|f| if f == "label.<key>" { "label.k" } else { f })
        .collect();
    keys.sort_unstable();
    known.sort_unstable();
    assert_eq!(keys, known);
    assert_eq!(
        written["placement"],
        json!({ "room": "20ms", "replicaShare": "-300ms" })
    );
    let _: &Candidate = &full[0];
}
