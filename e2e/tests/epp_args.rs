//! The EPP Deployment the operator generates must start: its arguments have
//! to be flags `kinference-epp` accepts, and its ports the ones it serves.

use clap::Parser;
use kinference_api::InferencePolicy;
use kinference_epp::cli::Args;
use kinference_operator::resources::{
    CLIENT_CA_DIR, CLIENT_CA_FILE, EPP_GRPC_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT, EppSettings,
    Names, PROVIDER_SECRETS_DIR, TOKENIZER_DIR, deployment,
};
use serde_json::json;

/// The arguments of the EPP container the operator generates for `spec`,
/// parsed as `kinference-epp` parses them.
fn generated_args(spec: serde_json::Value) -> (Args, Vec<String>) {
    let policy: InferencePolicy = serde_json::from_value(json!({
        "apiVersion": "kinference.io/v1alpha1",
        "kind": "InferencePolicy",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1"},
        "spec": spec
    }))
    .unwrap();
    let settings = EppSettings {
        image: "epp:test".into(),
        replicas: Some(1),
    };
    let compiled = kinference_policy::compile(&policy.spec.policy).unwrap();
    let d = deployment(&policy, &Names::of(&policy), &settings, &compiled);
    let container = &d.spec.unwrap().template.spec.unwrap().containers[0];
    // The kubelet expands $(VAR) from the container's env; any value will do here.
    let args: Vec<String> = container
        .args
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|a| {
            a.replace("$(POD_NAME)", "chat-epp-abc")
                .replace("$(POD_NAMESPACE)", "team-a")
        })
        .collect();
    let parsed =
        Args::try_parse_from(std::iter::once("kinference-epp".to_string()).chain(args.clone()))
            .unwrap_or_else(|e| panic!("the EPP rejects the operator's arguments {args:?}: {e}"));
    (parsed, args)
}

fn minimal_spec() -> serde_json::Value {
    json!({
        "pool": {"selector": {"app": "vllm"}, "targetPorts": [{"number": 8000}]},
        "rules": [{"name": "r", "route": {"select": [{"minimize": "QueueDepth"}]}}]
    })
}

#[test]
fn operator_generated_epp_arguments_parse() {
    let (parsed, args) = generated_args(minimal_spec());
    assert_eq!(parsed.policy_configmap.as_deref(), Some("chat-policy"));
    // Reports go to the status ConfigMap, under the Pod's name.
    assert_eq!(parsed.status_configmap.as_deref(), Some("chat-epp-status"));
    // Provider keys from the mounted Secrets, never through the API.
    assert_eq!(
        parsed.provider_secrets_dir.as_deref(),
        Some(std::path::Path::new(PROVIDER_SECRETS_DIR))
    );
    assert_eq!(parsed.client_ca_file, None);
    assert!(parsed.secure_serving);
    assert_eq!(parsed.namespace, "team-a");
    assert_eq!(parsed.pod_name.as_deref(), Some("chat-epp-abc"));
    // JSON logs, the default of both binaries' shared `--log-format`; not
    // through the deprecated `--text-logs`.
    assert_eq!(parsed.log_format(), Default::default());
    assert!(!parsed.text_logs, "{args:?}");
    assert_eq!(
        (
            parsed.grpc_port,
            parsed.grpc_health_port,
            parsed.metrics_port
        ),
        (
            EPP_GRPC_PORT as u16,
            EPP_HEALTH_PORT as u16,
            EPP_METRICS_PORT as u16
        )
    );
}

#[test]
fn a_client_ca_turns_on_client_certificates_over_tls() {
    let mut spec = minimal_spec();
    spec["endpointPicker"] = json!({"clientCA": {"secretName": "gateway-ca", "key": "ca.pem"}});
    let (parsed, _) = generated_args(spec);
    assert_eq!(
        parsed.client_ca_file,
        Some(std::path::Path::new(CLIENT_CA_DIR).join(CLIENT_CA_FILE))
    );
    // mTLS needs the TLS the EPP serves by default.
    assert!(parsed.secure_serving);
}

#[test]
fn precise_prefix_turns_on_the_events_port_with_the_mounted_tokenizer() {
    use kinference_epp::cli::KvEventsTokenizer;
    let mut spec = minimal_spec();
    spec["endpointPicker"] = json!({"precisePrefix": {
        "tokenizer": {"image": "reg.example/tok:1"},
        "tokenizeBudget": "12ms",
        "replayPort": 5558
    }});
    let (parsed, _) = generated_args(spec);
    assert_eq!(parsed.kv_events_port, Some(5557));
    assert_eq!(parsed.kv_events_replay_port, Some(5558));
    assert_eq!(
        parsed.kv_events_tokenizer,
        Some(KvEventsTokenizer::Directory(TOKENIZER_DIR.into()))
    );
    assert_eq!(
        parsed.kv_events_tokenize_budget,
        std::time::Duration::from_millis(12)
    );
    let (parsed, _) = generated_args(minimal_spec());
    assert_eq!(
        (parsed.kv_events_port, parsed.kv_events_tokenizer),
        (None, None)
    );
}
