//! The EPP Deployment the operator generates must start: its arguments have
//! to be flags `kinference-epp` accepts, and its ports the ones it serves.

use clap::Parser;
use kinference_api::InferencePolicy;
use kinference_epp::cli::Args;
use kinference_operator::resources::{
    EPP_GRPC_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT, EppSettings, Names, deployment,
};
use serde_json::json;

#[test]
fn operator_generated_epp_arguments_parse() {
    let policy: InferencePolicy = serde_json::from_value(json!({
        "apiVersion": "kinference.io/v1alpha1",
        "kind": "InferencePolicy",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1"},
        "spec": {
            "pool": {"selector": {"app": "vllm"}, "targetPorts": [{"number": 8000}]},
            "rules": [{"name": "r", "route": {"select": [{"minimize": "QueueDepth"}]}}]
        }
    }))
    .unwrap();
    let settings = EppSettings {
        image: "epp:test".into(),
        replicas: 1,
    };
    let d = deployment(&policy, &Names::of(&policy), &settings);
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
    assert_eq!(parsed.policy_configmap.as_deref(), Some("chat-policy"));
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
