//! The whole chain against a real API server: the operator compiles an
//! InferencePolicy into its ConfigMap; an EPP (run in-process, as its
//! Deployment would run it) loads that ConfigMap, discovers the pool's Pods,
//! scrapes simulated model servers at the Pods' IPs and routes an ext_proc
//! request to one; it reports the loaded hash in the EPP status ConfigMap and
//! the policy turns Ready. The EPP runs as its own ServiceAccount with only
//! the Role the operator generated. Then the API server restarts and both
//! keep working.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kinference_api::InferencePolicy;
use kinference_e2e::cluster::TestCluster;
use kinference_e2e::kubelet::{create_namespace, create_pod, set_status};
use kinference_epp::k8s;
use kinference_epp::server::{Epp, Settings};
use kinference_operator::{Config, Requeue};
use kinference_simulator::{SimConfig, SimHandle};
use kinference_testbed::extproc_client::{EppClient, HttpRequest};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

const NS: &str = "e2e";
const WAIT: Duration = Duration::from_secs(60);

async fn eventually<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    mut f: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A simulator listening on `ip:port`, as if it ran in a Pod with that IP.
async fn sim_at(ip: &str, port: u16, name: &str) -> SimHandle {
    let mut config = SimConfig::new(name, ["qwen"]);
    config.time_scale = 0.05;
    kinference_simulator::spawn(config, format!("{ip}:{port}").parse().unwrap())
        .await
        .unwrap()
}

fn free_port(ip: &str) -> u16 {
    std::net::TcpListener::bind(format!("{ip}:0"))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn chat() -> Vec<u8> {
    serde_json::to_vec(
        &json!({"model": "qwen", "messages": [{"role": "user", "content": "hello"}]}),
    )
    .unwrap()
}

fn configmaps_as(client: &kube::Client) -> Api<ConfigMap> {
    Api::namespaced(client.clone(), NS)
}

async fn condition(
    policies: &Api<InferencePolicy>,
    name: &str,
    kind: &str,
) -> Option<(String, String)> {
    let p = policies.get(name).await.ok()?;
    let c = p.status?.conditions.into_iter().find(|c| c.type_ == kind)?;
    Some((c.status, c.message))
}

/// The API server's own printing of InferencePolicies (the Table kubectl
/// asks for), rendered as kubectl lays it out.
async fn printed_table(client: &kube::Client) -> anyhow::Result<String> {
    let request = http::Request::get(format!(
        "/apis/kinference.io/v1alpha1/namespaces/{NS}/inferencepolicies"
    ))
    .header("accept", "application/json;as=Table;g=meta.k8s.io;v=v1")
    .body(Vec::new())?;
    let table: serde_json::Value = serde_json::from_str(&client.request_text(request).await?)?;
    let mut rows: Vec<Vec<String>> = vec![
        table["columnDefinitions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap().to_uppercase())
            .collect(),
    ];
    for row in table["rows"].as_array().unwrap() {
        rows.push(
            row["cells"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| match c {
                    serde_json::Value::String(s) => s.clone(),
                    serde_json::Value::Null => "<none>".into(),
                    other => other.to_string(),
                })
                .collect(),
        );
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|i| {
            rows.iter()
                .map(|r| r.get(i).map_or(0, String::len))
                .max()
                .unwrap_or(0)
        })
        .collect();
    Ok(rows
        .iter()
        .map(|r| {
            r.iter()
                .enumerate()
                .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
                .collect::<Vec<_>>()
                .join("  ")
                .trim_end()
                .to_string()
        })
        .collect::<Vec<_>>()
        .join("\n"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_and_epp_route_a_request_to_a_discovered_pod() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start().await?;
    let client = cluster.client();
    create_namespace(&client, NS).await?;
    let operator = kinference_operator::spawn(
        client.clone(),
        Config {
            requeue: Requeue {
                pending: Duration::from_millis(500),
                error: Duration::from_millis(500),
                ..Requeue::default()
            },
            ..Config::default()
        },
    );

    // Model servers on distinct loopback IPs sharing one port, like Pods.
    let port = free_port("127.0.0.2");
    let _sims = [
        sim_at("127.0.0.2", port, "sim-a").await,
        sim_at("127.0.0.3", port, "sim-b").await,
    ];
    let policy: InferencePolicy = serde_json::from_value(json!({
        "apiVersion": "kinference.io/v1alpha1",
        "kind": "InferencePolicy",
        "metadata": {"name": "chat", "namespace": NS},
        "spec": {
            "pool": {"selector": {"app": "sim"}, "targetPorts": [{"number": port}]},
            "rules": [{"name": "least-queue", "route": {"select": [{"minimize": "QueueDepth"}]}}]
        }
    }))?;
    let policies: Api<InferencePolicy> = Api::namespaced(client.clone(), NS);
    policies.create(&PostParams::default(), &policy).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    for (name, ip) in [("sim-a", "127.0.0.2"), ("sim-b", "127.0.0.3")] {
        create_pod(
            &pods,
            name,
            json!({"app": "sim", "kinference.io/models": "qwen"}),
        )
        .await?;
        set_status(&pods, name, ip, true).await?;
    }

    // The operator writes the ConfigMap and the EPP Deployment.
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    let hash = eventually("the policy ConfigMap", || async {
        configmaps
            .get("chat-policy")
            .await
            .ok()?
            .data?
            .get(kinference_api::POLICY_HASH_KEY)
            .cloned()
    })
    .await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let deployment = eventually("the EPP Deployment", || async {
        deployments.get("chat-epp").await.ok()
    })
    .await;

    // The EPP's own Pod (no kubelet: the test creates it with the
    // Deployment's labels), then the EPP process itself, in-process.
    let labels = deployment.spec.unwrap().selector.match_labels.unwrap();
    create_pod(&pods, "chat-epp-0", serde_json::to_value(&labels)?).await?;
    set_status(&pods, "chat-epp-0", "127.0.0.9", true).await?;
    let epp = Epp::new(Settings {
        scrape_interval: Duration::from_millis(20),
        ..Settings::default()
    });
    // The EPP as its Deployment runs it: its ServiceAccount, authorized by
    // nothing but the operator's Role for it (no Secrets, no Pod writes).
    let epp_client = cluster
        .client_as(&format!("system:serviceaccount:{NS}:chat-epp"))
        .await?;
    let client_for_epp = epp_client.clone();
    let tasks = vec![
        tokio::spawn(k8s::watch_policy_configmap(
            epp.clone(),
            client_for_epp.clone(),
            NS.into(),
            "chat-policy".into(),
        )),
        tokio::spawn(k8s::run_discovery(
            epp.clone(),
            client_for_epp.clone(),
            NS.into(),
        )),
        tokio::spawn(k8s::report_status(
            epp.clone(),
            client_for_epp.clone(),
            NS.into(),
            k8s::StatusReport {
                configmap: "chat-epp-status".into(),
                pod: "chat-epp-0".into(),
                secrets_dir: None,
            },
        )),
        epp.spawn_scraper(),
    ];
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr: SocketAddr = listener.local_addr()?;
    let server = epp.clone();
    tokio::spawn(async move {
        server
            .serve_ext_proc(listener, std::future::pending())
            .await
    });

    eventually("the EPP to load the operator's policy", || async {
        (epp.policy().loaded_hash().as_deref() == Some(hash.as_str())).then_some(())
    })
    .await;
    eventually("discovery and metrics of both Pods", || async {
        let snapshot = epp.registry().snapshot();
        (snapshot.len() == 2 && snapshot.iter().all(|v| v.metrics.is_some())).then_some(())
    })
    .await;
    let ext_proc = EppClient::connect(addr).await?;
    let (outcome, _) = ext_proc
        .decide(&HttpRequest::post("/v1/chat/completions", chat()))
        .await?;
    let dest = outcome.destination().expect("routed to a Pod").to_string();
    let first = dest.split(',').next().unwrap();
    assert!(
        [format!("127.0.0.2:{port}"), format!("127.0.0.3:{port}")].contains(&first.to_string()),
        "{dest}"
    );
    assert_eq!(outcome.set_headers["x-kinference-rule"], "least-queue");

    // Ready: the Deployment is available (no controller-manager here, so the
    // test writes its status) and the EPP Pod reports this policy's hash.
    // The EPP wrote its own key, as itself, and may patch nothing else.
    eventually("the EPP's report", || async {
        let cm = configmaps.get("chat-epp-status").await.ok()?;
        let report = cm.data?.get("chat-epp-0")?.clone();
        let report = kinference_api::EppPodStatus::from_json(&report).ok()?;
        (report.loaded_hash == hash).then_some(())
    })
    .await;
    let denied = Api::<Pod>::namespaced(epp_client.clone(), NS)
        .patch(
            "chat-epp-0",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
        )
        .await;
    assert!(
        matches!(&denied, Err(kube::Error::Api(s)) if s.code == 403),
        "the EPP may patch its Pod: {denied:?}"
    );
    let denied = configmaps_as(&epp_client)
        .patch(
            "chat-policy",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"x": "y"}})),
        )
        .await;
    assert!(
        matches!(&denied, Err(kube::Error::Api(s)) if s.code == 403),
        "the EPP may patch its policy ConfigMap: {denied:?}"
    );
    deployments
        .patch_status(
            "chat-epp",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}}),
            ),
        )
        .await?;
    eventually("Ready=True", || async {
        let (status, _) = condition(&policies, "chat", "Ready").await?;
        (status == "True").then_some(())
    })
    .await;

    // What `kubectl get inferencepolicy` prints: the server-side table.
    let table = printed_table(&client).await?;
    println!("{table}");
    assert!(
        table.starts_with("NAME  ACCEPTED  READY  POOL  RULES  AGE"),
        "{table}"
    );
    assert!(table.contains("chat  True      True   chat  1"), "{table}");

    // The API server goes away and comes back: the EPP keeps routing from
    // what it knows, then picks up a new Pod and a policy edit.
    cluster.restart_apiserver().await?;
    let (outcome, _) = ext_proc
        .decide(&HttpRequest::post("/v1/chat/completions", chat()))
        .await?;
    assert!(
        outcome.destination().is_some(),
        "routing continues across the restart"
    );
    let _sim_c = sim_at("127.0.0.4", port, "sim-c").await;
    create_pod(
        &pods,
        "sim-c",
        json!({"app": "sim", "kinference.io/models": "qwen"}),
    )
    .await?;
    set_status(&pods, "sim-c", "127.0.0.4", true).await?;
    eventually("the new Pod after the restart", || async {
        (epp.registry().snapshot().len() == 3).then_some(())
    })
    .await;
    policies
        .patch(
            "chat",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"rules": [{"name": "least-running", "route": {"select": [{"minimize": "RunningRequests"}]}}]}})),
        )
        .await?;
    eventually("the edited policy in the EPP", || async {
        let p = epp.policy().current()?;
        (p.compiled.rules[0].name == "least-running").then_some(())
    })
    .await;
    let (outcome, _) = ext_proc
        .decide(&HttpRequest::post("/v1/chat/completions", chat()))
        .await?;
    assert_eq!(outcome.set_headers["x-kinference-rule"], "least-running");

    for t in tasks {
        t.abort();
    }
    operator.stop().await?;
    Ok(())
}
