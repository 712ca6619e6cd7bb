//! Smoke tests of the real-apiserver harness (`kinference_e2e::cluster`).
//!
//! These start etcd + kube-apiserver (built and cached on first use by
//! `e2e/tools/install-k8s.sh`; see `e2e/README.md`).

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kinference_e2e::cluster::{self, TestCluster};
use kube::Client;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::json;

async fn create_namespace(client: &Client, name: &str) -> anyhow::Result<()> {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    Ok(())
}

fn is_established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Established" && c.status == "True")
}

#[tokio::test]
async fn cluster_serves_pods_crds_and_survives_restart() -> anyhow::Result<()> {
    // Installs the upstream fixture CRDs and the project's own `crds/*.yaml`:
    // fails if the real apiserver rejects any of them.
    let mut cluster = TestCluster::start().await?;
    let client = cluster.client();

    // The server is the pinned release, with a real version stamp.
    let version = client.apiserver_version().await?;
    assert_eq!(version.git_version, cluster::K8S_VERSION);
    assert_eq!(version.git_tree_state, "clean");
    let pinned_in_script = std::fs::read_to_string(cluster::install_script_path())?;
    assert!(
        pinned_in_script.contains(&format!(
            "KINFERENCE_K8S_VERSION:-{}}}",
            cluster::K8S_VERSION
        )) && pinned_in_script.contains(&format!(
            "KINFERENCE_ETCD_VERSION:-{}}}",
            cluster::ETCD_VERSION
        )),
        "cluster::K8S_VERSION/ETCD_VERSION must match the pins in install-k8s.sh"
    );

    // Upstream CRDs are installed and established.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in [
        "inferencepools.inference.networking.k8s.io",
        "httproutes.gateway.networking.k8s.io",
        "gateways.gateway.networking.k8s.io",
    ] {
        let crd = crds.get(name).await?;
        assert!(
            is_established(&crd),
            "{name} not established: {:?}",
            crd.status
        );
    }

    // The kubeconfig file works for other consumers too.
    let kc = kube::config::Kubeconfig::read_from(cluster.kubeconfig_path())?;
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    let other = Client::try_from(config)?;
    assert_eq!(
        other.apiserver_version().await?.git_version,
        cluster::K8S_VERSION
    );

    // Pods are accepted (no ServiceAccount admission) and stay Pending: no
    // scheduler, no kubelet. Tests play kubelet by writing the status.
    create_namespace(&client, "smoke").await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "smoke");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "model-server-0", "labels": {"app": "model-server"}},
        "spec": {"containers": [{"name": "vllm", "image": "example.invalid/vllm:latest"}]}
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    let created = pods.get("model-server-0").await?;
    assert_eq!(
        created.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Pending")
    );

    pods.patch_status(
        "model-server-0",
        &PatchParams::default(),
        &Patch::Merge(json!({
            "status": {
                "phase": "Running",
                "podIP": "10.0.0.5",
                "podIPs": [{"ip": "10.0.0.5"}],
                "conditions": [{"type": "Ready", "status": "True"}]
            }
        })),
    )
    .await?;
    let running = pods.get("model-server-0").await?;
    let status = running.status.expect("pod status");
    assert_eq!(status.phase.as_deref(), Some("Running"));
    assert_eq!(status.pod_ip.as_deref(), Some("10.0.0.5"));
    assert_eq!(
        status
            .pod_ips
            .unwrap_or_default()
            .first()
            .map(|ip| ip.ip.clone()),
        Some("10.0.0.5".to_owned())
    );
    assert!(
        status
            .conditions
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    );

    // Restart kube-apiserver on the same port; the same client reconnects.
    cluster.restart_apiserver().await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let after = loop {
        match pods.get("model-server-0").await {
            Ok(pod) => break pod,
            Err(e) if Instant::now() < deadline => {
                eprintln!("retrying after restart: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    assert_eq!(
        after.status.and_then(|s| s.phase).as_deref(),
        Some("Running")
    );

    // Stop / start explicitly as well.
    cluster.stop_apiserver().await?;
    assert!(!cluster.apiserver_running());
    assert!(pods.get("model-server-0").await.is_err());
    cluster.start_apiserver().await?;
    assert!(cluster.apiserver_running());
    pods.get("model-server-0").await?;
    Ok(())
}

#[tokio::test]
async fn upstream_schemas_accept_httproute_and_inferencepool() -> anyhow::Result<()> {
    // Only the upstream fixtures: this test is about their schemas.
    let cluster = TestCluster::start_without_crds().await?;
    let installed = cluster
        .install_crds_from_dir(&cluster::fixture_crds_dir())
        .await?;
    assert!(installed.contains(&"inferencepools.inference.networking.k8s.io".to_owned()));
    let client = cluster.client();
    create_namespace(&client, "schemas").await?;

    let pool_res = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool"),
        "inferencepools",
    );
    let pools: Api<DynamicObject> = Api::namespaced_with(client.clone(), "schemas", &pool_res);
    let pool: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "llama"},
        "spec": {
            "selector": {"matchLabels": {"app": "model-server"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "llama-epp", "port": {"number": 9002}}
        }
    }))?;
    pools.create(&PostParams::default(), &pool).await?;
    let stored = pools.get("llama").await?;
    assert_eq!(stored.data["spec"]["targetPorts"][0]["number"], 8000);

    // The real schema is enforced: a missing required field is rejected by
    // the OpenAPI schema, duplicate target ports by the CRD's CEL rule.
    let missing_selector = json!({
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "llama-epp", "port": {"number": 9002}}
    });
    let duplicate_ports = json!({
        "selector": {"matchLabels": {"app": "model-server"}},
        "targetPorts": [{"number": 8000}, {"number": 8000}],
        "endpointPickerRef": {"name": "llama-epp", "port": {"number": 9002}}
    });
    for (spec, expected) in [
        (missing_selector, "spec.selector: Required value"),
        (duplicate_ports, "port number must be unique"),
    ] {
        let invalid: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "invalid"},
            "spec": spec
        }))?;
        match pools.create(&PostParams::default(), &invalid).await {
            Err(kube::Error::Api(status)) => {
                assert_eq!(status.code, 422, "{status:?}");
                assert!(status.message.contains(expected), "{}", status.message);
            }
            other => panic!("invalid InferencePool was not rejected: {other:?}"),
        }
    }

    let route_res = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("gateway.networking.k8s.io", "v1", "HTTPRoute"),
        "httproutes",
    );
    let routes: Api<DynamicObject> = Api::namespaced_with(client.clone(), "schemas", &route_res);
    let route: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "llm-route"},
        "spec": {
            "parentRefs": [{"name": "inference-gateway"}],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                "backendRefs": [{
                    "group": "inference.networking.k8s.io",
                    "kind": "InferencePool",
                    "name": "llama"
                }]
            }]
        }
    }))?;
    routes.create(&PostParams::default(), &route).await?;
    let stored = routes.get("llm-route").await?;
    // Defaults from the upstream schema were applied by the server.
    assert_eq!(stored.data["spec"]["parentRefs"][0]["kind"], "Gateway");
    assert_eq!(
        stored.data["spec"]["rules"][0]["backendRefs"][0]["weight"],
        1
    );
    Ok(())
}
