//! EPP Pod discovery against a real kube-apiserver (`kinference_e2e::cluster`):
//! Pods become endpoints when Ready, leave when not, models come from the
//! label or from the Pod's `/v1/models`, an API-server restart does not
//! stop discovery, and a pool with several target ports yields one endpoint
//! per Pod and active port.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kinference_e2e::cluster::TestCluster;
use kinference_e2e::kubelet::{create_namespace, create_pod, set_status};
use kinference_epp::endpoints::{EndpointRegistry, run_pod_discovery};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const NS: &str = "epp-discovery";
const WAIT: Duration = Duration::from_secs(30);

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A minimal HTTP server answering `GET /v1/models` with `models`.
async fn models_server(models: &'static [&'static str]) -> anyhow::Result<u16> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let data: Vec<_> = models
        .iter()
        .map(|id| json!({"id": id, "object": "model"}))
        .collect();
    let body = json!({"object": "list", "data": data}).to_string();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let body = body.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let response = if buf.starts_with(b"GET /v1/models ") {
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    )
                } else {
                    "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                        .to_string()
                };
                let _ = sock.write_all(response.as_bytes()).await;
            });
        }
    });
    Ok(port)
}

#[tokio::test]
async fn pod_discovery_follows_readiness_and_survives_apiserver_restart() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start_without_crds().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    // The unlabelled Pod's "IP" is loopback, where a fake server answers
    // /v1/models on the pool's target port.
    let port = models_server(&["llama-3-8b", "sql-lora"]).await?;

    // One Pod exists and is Ready before discovery starts.
    create_pod(
        &pods,
        "ready-0",
        json!({"app": "model-server", "kinference.io/models": "llama-3-8b"}),
    )
    .await?;
    set_status(&pods, "ready-0", "10.0.0.10", true).await?;
    // Outside the selector: never an endpoint.
    create_pod(&pods, "other-0", json!({"app": "something-else"})).await?;
    set_status(&pods, "other-0", "10.0.0.99", true).await?;

    let registry = EndpointRegistry::new(Duration::from_secs(1));
    let selector = BTreeMap::from([("app".to_string(), "model-server".to_string())]);
    let discovery = tokio::spawn(run_pod_discovery(
        client.clone(),
        NS.to_string(),
        selector,
        vec![port],
        Arc::clone(&registry),
    ));

    wait_for("initial sync", || registry.synced()).await;
    let ep = registry.get("ready-0").expect("ready-0 listed at sync");
    assert_eq!(ep.address(), format!("10.0.0.10:{port}"));
    assert_eq!(ep.models, ["llama-3-8b"]);
    assert_eq!(ep.namespace, NS);
    assert_eq!(registry.len(), 1, "other-0 is outside the selector");

    // A new Pod is not an endpoint until Ready, with an IP.
    create_pod(&pods, "late-1", json!({"app": "model-server"})).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        registry.get("late-1").is_none(),
        "pending pod must not be an endpoint"
    );
    set_status(&pods, "late-1", "127.0.0.1", true).await?;
    wait_for("late-1 with models from /v1/models", || {
        registry
            .get("late-1")
            .is_some_and(|e| e.models == ["llama-3-8b", "sql-lora"])
    })
    .await;

    // Not Ready any more: removed on that very event.
    set_status(&pods, "ready-0", "10.0.0.10", false).await?;
    wait_for("ready-0 removed when not ready", || {
        registry.get("ready-0").is_none()
    })
    .await;
    set_status(&pods, "ready-0", "10.0.0.11", true).await?;
    wait_for("ready-0 back with its new IP", || {
        registry
            .get("ready-0")
            .is_some_and(|e| e.ip.to_string() == "10.0.0.11")
    })
    .await;

    // The API server goes away and comes back: discovery keeps working.
    cluster.restart_apiserver().await?;
    // Retry: right after the restart the server may still refuse writes.
    let deadline = Instant::now() + WAIT;
    while let Err(e) = pods
        .delete("late-1", &DeleteParams::default().grace_period(0))
        .await
    {
        assert!(
            Instant::now() < deadline,
            "delete after restart failed: {e}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    wait_for("late-1 removed after delete", || {
        registry.get("late-1").is_none()
    })
    .await;
    assert!(registry.get("ready-0").is_some());
    assert!(
        !discovery.is_finished(),
        "discovery must survive the restart"
    );
    discovery.abort();
    Ok(())
}

#[tokio::test]
async fn pod_with_two_target_ports_yields_two_endpoints() -> anyhow::Result<()> {
    const NS: &str = "epp-discovery-ranks";
    let cluster = TestCluster::start_without_crds().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    create_pod(
        &pods,
        "dp-0",
        json!({"app": "model-server", "kinference.io/models": "llama-3-8b"}),
    )
    .await?;
    set_status(&pods, "dp-0", "10.0.0.20", true).await?;

    let registry = EndpointRegistry::new(Duration::from_secs(1));
    let selector = BTreeMap::from([("app".to_string(), "model-server".to_string())]);
    let discovery = tokio::spawn(run_pod_discovery(
        client.clone(),
        NS.to_string(),
        selector,
        vec![8000, 8001],
        Arc::clone(&registry),
    ));
    wait_for("initial sync", || registry.synced()).await;
    let addresses = |registry: &EndpointRegistry| {
        let mut a: Vec<_> = registry
            .endpoints()
            .iter()
            .map(|e| (e.name.clone(), e.address()))
            .collect();
        a.sort();
        a
    };
    assert_eq!(
        addresses(&registry),
        [
            ("dp-0-rank-0".to_string(), "10.0.0.20:8000".to_string()),
            ("dp-0-rank-1".to_string(), "10.0.0.20:8001".to_string()),
        ]
    );

    // The Pod narrows its active ports: rank 0 leaves on that update.
    pods.patch(
        "dp-0",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {
            "inference.networking.k8s.io/active-ports": "8001"
        }}})),
    )
    .await?;
    wait_for("rank 0 removed", || registry.get("dp-0-rank-0").is_none()).await;
    assert_eq!(registry.len(), 1);
    assert_eq!(
        registry.get("dp-0-rank-1").map(|e| e.address()).as_deref(),
        Some("10.0.0.20:8001")
    );

    pods.delete("dp-0", &DeleteParams::default().grace_period(0))
        .await?;
    wait_for("all ranks removed", || registry.is_empty()).await;
    discovery.abort();
    Ok(())
}

/// `kinference-epp --pool-name`: the Pods of an InferencePool the EPP did
/// not create (the upstream CRD, the object as a user or another chart
/// wrote it), followed when its selector or target ports change, and none
/// once it is deleted.
#[tokio::test]
async fn an_existing_inference_pool_is_served_and_followed() -> anyhow::Result<()> {
    use kinference_api::{
        EndpointPickerRef, InferencePool, InferencePoolSpec, PoolSelector, PortNumber,
    };
    use kinference_epp::server::{Epp, Settings};
    use kube::api::PostParams;

    const NS: &str = "epp-discovery-pool";
    let cluster = TestCluster::start().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    for (name, app, ip) in [("a-0", "a", "10.0.0.30"), ("b-0", "b", "10.0.0.31")] {
        create_pod(
            &pods,
            name,
            json!({"app": app, "kinference.io/models": "qwen"}),
        )
        .await?;
        set_status(&pods, name, ip, true).await?;
    }
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), NS);
    let pool = |app: &str, ports: &[i32]| {
        InferencePool::new(
            "vllm",
            InferencePoolSpec {
                selector: PoolSelector {
                    match_labels: BTreeMap::from([("app".to_string(), app.to_string())]),
                },
                target_ports: ports.iter().map(|&number| PortNumber { number }).collect(),
                endpoint_picker_ref: EndpointPickerRef {
                    name: "vllm-epp".into(),
                    port: Some(PortNumber { number: 9002 }),
                    ..EndpointPickerRef::default()
                },
            },
        )
    };
    pools
        .create(&PostParams::default(), &pool("a", &[8000]))
        .await?;

    let epp = Epp::new(Settings::default());
    let discovery = tokio::spawn(kinference_epp::k8s::run_inference_pool_discovery(
        epp.clone(),
        client.clone(),
        NS.into(),
        "vllm".into(),
    ));
    let addresses = |epp: &Epp| {
        let mut a: Vec<String> = epp
            .registry()
            .endpoints()
            .iter()
            .map(|e| e.address())
            .collect();
        a.sort();
        a
    };
    wait_for("the pool's Pod", || addresses(&epp) == ["10.0.0.30:8000"]).await;

    // Another selector: the other Pod.
    let patch = |spec: serde_json::Value| {
        let pools = pools.clone();
        async move {
            pools
                .patch(
                    "vllm",
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "spec": spec })),
                )
                .await
        }
    };
    patch(json!({"selector": {"matchLabels": {"app": "b"}}})).await?;
    wait_for("the new selector's Pod", || {
        addresses(&epp) == ["10.0.0.31:8000"]
    })
    .await;

    // Two target ports: a rank each.
    patch(json!({"targetPorts": [{"number": 8001}, {"number": 8002}]})).await?;
    wait_for("one endpoint per port", || {
        addresses(&epp) == ["10.0.0.31:8001", "10.0.0.31:8002"]
    })
    .await;

    // Deleted: nothing to route to; created again: served again.
    pools.delete("vllm", &DeleteParams::default()).await?;
    wait_for("no endpoints", || addresses(&epp).is_empty()).await;
    pools
        .create(&PostParams::default(), &pool("a", &[8000]))
        .await?;
    wait_for("the recreated pool's Pod", || {
        addresses(&epp) == ["10.0.0.30:8000"]
    })
    .await;
    discovery.abort();
    Ok(())
}

/// The pool's InferenceObjectives give requests their priority: followed
/// as they change, only those naming this pool, and an EPP started before
/// the CRD was installed picks them up once it is.
#[tokio::test]
async fn inference_objectives_of_the_pool_give_priorities_once_their_crd_exists()
-> anyhow::Result<()> {
    use kinference_api::InferenceObjective;
    use kinference_epp::objectives::{Objectives, watch_objectives};
    use kube::api::PostParams;

    const NS: &str = "epp-objectives";
    let cluster = TestCluster::start_without_crds().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let objectives = Arc::new(Objectives::default());
    let watch = tokio::spawn(watch_objectives(
        objectives.clone(),
        client.clone(),
        NS.into(),
        "vllm".into(),
    ));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(objectives.priority(Some("chat")), 0, "no CRD: priority 0");

    cluster
        .install_crds_from_dir(&kinference_e2e::cluster::fixture_crds_dir())
        .await?;
    let api: Api<InferenceObjective> = Api::namespaced(client.clone(), NS);
    let objective = |name: &str, pool: &str, priority: i32| -> InferenceObjective {
        serde_json::from_value(json!({
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": { "name": name },
            "spec": { "priority": priority, "poolRef": { "name": pool } },
        }))
        .unwrap()
    };
    api.create(&PostParams::default(), &objective("chat", "vllm", 7))
        .await?;
    api.create(&PostParams::default(), &objective("elsewhere", "other", 9))
        .await?;
    wait_for("chat's priority", || objectives.priority(Some("chat")) == 7).await;
    assert_eq!(objectives.priority(Some("elsewhere")), 0, "another pool's");

    let patch = |spec: serde_json::Value| Patch::Merge(json!({ "spec": spec }));
    api.patch(
        "chat",
        &PatchParams::default(),
        &patch(json!({"priority": 3})),
    )
    .await?;
    wait_for("the changed priority", || {
        objectives.priority(Some("chat")) == 3
    })
    .await;
    api.patch(
        "elsewhere",
        &PatchParams::default(),
        &patch(json!({"poolRef": {"name": "vllm"}})),
    )
    .await?;
    wait_for("an objective moved to this pool", || {
        objectives.priority(Some("elsewhere")) == 9
    })
    .await;
    api.delete("chat", &DeleteParams::default()).await?;
    wait_for("the deleted objective's priority", || {
        objectives.priority(Some("chat")) == 0
    })
    .await;
    watch.abort();
    Ok(())
}
