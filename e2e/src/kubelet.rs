//! What a kubelet would do, for a cluster that has none: Namespaces and Pods
//! created and their status written by the test.

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

pub async fn create_namespace(client: &Client, name: &str) -> anyhow::Result<()> {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    Ok(())
}

pub async fn create_pod(
    pods: &Api<Pod>,
    name: &str,
    labels: serde_json::Value,
) -> anyhow::Result<()> {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "server", "image": "example.invalid/server:latest"}]}
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    Ok(())
}

/// Writes the Pod's status: Running with `ip`, Ready or not.
pub async fn set_status(pods: &Api<Pod>, name: &str, ip: &str, ready: bool) -> anyhow::Result<()> {
    pods.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({
            "status": {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]
            }
        })),
    )
    .await?;
    Ok(())
}
