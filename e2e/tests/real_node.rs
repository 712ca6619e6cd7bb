//! Smoke test of the real-node tier (`kinference_e2e::node`): a one-node
//! cluster whose Deployment goes through the real controller-manager,
//! scheduler, kubelet, containerd, runc and CNI bridge, reached over HTTP at
//! its Pod IP, its hostPort and a Service's ClusterIP (kube-proxy); a Pod
//! that calls kube-apiserver with its ServiceAccount token through the
//! `kubernetes` Service; garbage collection for real, and a teardown that
//! leaves nothing on the host. Needs root (skipped otherwise).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kinference_e2e::cluster::{K8S_VERSION, KEEP_DIR_ENV};
use kinference_e2e::node::{
    self, BRIDGE, ImageConfig, LayerFile, NODE_NAME, RealCluster, binary_with_libraries,
};
use kube::api::{Api, DeleteParams, ListParams, LogParams, PostParams};
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const NAMESPACE: &str = "default";
const HELLO_IMAGE: &str = "kinference.local/hello:v1";
const SELF_IMAGE: &str = "kinference.local/e2e-self:v1";
const POD_TIMEOUT: Duration = Duration::from_secs(120);
const GC_TIMEOUT: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployment_runs_on_a_real_node_and_teardown_leaves_nothing() -> Result<()> {
    if !node::running_as_root() {
        eprintln!(
            "SKIPPED deployment_runs_on_a_real_node_and_teardown_leaves_nothing: \
             the real-node tier needs root (containerd, runc, iptables, mounts, cgroups)"
        );
        return Ok(());
    }
    let host_before = HostSnapshot::take();
    let start = Instant::now();
    let cluster = RealCluster::start().await?;
    eprintln!("real node Ready in {:?} ({:?})", start.elapsed(), cluster);
    let dir = cluster.dir().to_owned();

    let result = exercise(&cluster).await;
    if result.is_err() {
        for component in [
            "kubelet",
            "containerd",
            "kube-controller-manager",
            "kube-scheduler",
        ] {
            eprintln!(
                "--- {component} log tail:\n{}",
                cluster.log_tail(component, 30)
            );
        }
        eprintln!("--- disk:\n{}", cluster.disk_free());
    }
    let teardown_start = Instant::now();
    let teardown = cluster.shutdown();
    eprintln!("teardown in {:?}", teardown_start.elapsed());
    result?;
    teardown?;

    assert_host_clean(&dir, &host_before)
}

async fn exercise(cluster: &RealCluster) -> Result<()> {
    let client = cluster.client();
    let node = Api::<Node>::all(client.clone()).get(NODE_NAME).await?;
    let info = node.status.and_then(|s| s.node_info).context("nodeInfo")?;
    assert_eq!(info.kubelet_version, K8S_VERSION);
    // Image volumes (precise prefix mode's tokenizer) need containerd 2.1+.
    let runtime = info.container_runtime_version;
    let version = runtime
        .strip_prefix("containerd://")
        .and_then(|v| v.split_once('.'))
        .and_then(|(major, rest)| {
            Some((
                major.parse::<u32>().ok()?,
                rest.split('.').next()?.parse::<u32>().ok()?,
            ))
        });
    assert!(
        version.is_some_and(|v| v >= (2, 1)),
        "the node runs {runtime}, not containerd 2.1 or later"
    );

    build_images(cluster)?;
    let host_port = free_port()?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    deployments
        .create(&PostParams::default(), &hello_deployment(host_port)?)
        .await
        .context("creating the Deployment")?;

    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let (pod_name, pod_ip) = wait_pod_ready(&pods, "app=hello").await?;
    eprintln!("pod {pod_name} Ready at {pod_ip}");

    // Straight to the Pod over the CNI bridge…
    let body = http_get(&format!("{pod_ip}:8080")).await?;
    ensure!(
        body.contains(&format!("kinference-pause {pod_name}")),
        "unexpected reply from the Pod: {body:?}"
    );
    // …and through portmap's hostPort DNAT on the node's address.
    let body = http_get(&format!("{}:{host_port}", cluster.node_ip())).await?;
    ensure!(
        body.contains(&pod_name),
        "unexpected reply on the hostPort: {body:?}"
    );
    // …and through a Service's ClusterIP, which only kube-proxy routes
    // (until it does, the ClusterIP leaves by the default route, where this
    // machine's egress proxy may answer: wait for the Pod's own reply).
    let cluster_ip = create_service(&client).await?;
    let deadline = Instant::now() + POD_TIMEOUT;
    loop {
        let reply = http_get(&format!("{cluster_ip}:80")).await;
        match reply {
            Ok(body) if body.contains(&pod_name) => break,
            _ if Instant::now() > deadline => {
                bail!("the ClusterIP {cluster_ip} answered {reply:?}")
            }
            _ => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
    check_in_pod_api_client(&pods, &pod_name).await?;

    // The real garbage collector removes the ReplicaSet and its Pod.
    deployments
        .delete("hello", &DeleteParams::background())
        .await
        .context("deleting the Deployment")?;
    let replica_sets: Api<ReplicaSet> = Api::namespaced(client.clone(), NAMESPACE);
    let selector = ListParams::default().labels("app=hello");
    let deadline = Instant::now() + GC_TIMEOUT;
    loop {
        let rs = replica_sets.list(&selector).await?.items.len();
        let pods_left = pods.list(&selector).await?.items.len();
        if rs == 0 && pods_left == 0 {
            break;
        }
        if Instant::now() > deadline {
            bail!("after {GC_TIMEOUT:?}: {rs} ReplicaSets and {pods_left} Pods left");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // A Pod still running at shutdown: teardown must kill it and undo its
    // network namespace, veth and CNI iptables chains without CNI DEL.
    let bystander: Pod = serde_json::from_value(json!({
        "metadata": { "name": "bystander", "labels": { "app": "bystander" } },
        "spec": { "containers": [{
            "name": "hello",
            "image": HELLO_IMAGE,
            "imagePullPolicy": "Never",
        }] },
    }))?;
    pods.create(&PostParams::default(), &bystander).await?;
    wait_pod_ready(&pods, "app=bystander").await?;
    Ok(())
}

/// A ClusterIP Service `hello` (port 80 → the Pods' 8080); its ClusterIP.
async fn create_service(client: &kube::Client) -> Result<String> {
    let service: Service = serde_json::from_value(json!({
        "metadata": { "name": "hello" },
        "spec": {
            "selector": { "app": "hello" },
            "ports": [{ "port": 80, "targetPort": 8080 }],
        },
    }))?;
    let service = Api::<Service>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &service)
        .await?;
    service
        .spec
        .and_then(|s| s.cluster_ip)
        .context("the Service has no ClusterIP")
}

/// ServiceAccount admission gave the Pod a projected token, and its init
/// container (this test binary) used it to call kube-apiserver through the
/// `kubernetes` Service; its log, read through the kubelet, says so.
async fn check_in_pod_api_client(pods: &Api<Pod>, pod_name: &str) -> Result<()> {
    let pod = pods.get(pod_name).await?;
    let spec = pod.spec.context("Pod without spec")?;
    ensure!(
        spec.service_account_name.as_deref() == Some("default"),
        "no ServiceAccount was admitted: {:?}",
        spec.service_account_name
    );
    let token_volume = spec
        .volumes
        .unwrap_or_default()
        .iter()
        .any(|v| v.name.starts_with("kube-api-access-") && v.projected.is_some());
    ensure!(token_volume, "the Pod has no projected token volume");
    let params = LogParams {
        container: Some("glibc-binary".into()),
        ..LogParams::default()
    };
    let log = pods.logs(pod_name, &params).await?;
    ensure!(
        log.contains(&format!(
            "in-pod: {K8S_VERSION} as system:serviceaccount:{NAMESPACE}:default"
        )) && log.contains("1 passed"),
        "the init container did not reach the API server:\n{log}"
    );
    Ok(())
}

/// Run by the `e2e-self` image inside the Pod (ignored on the host): an
/// in-cluster client (KUBERNETES_SERVICE_HOST/PORT, the projected token and
/// CA) reads the server version and who it is authenticated as.
#[tokio::test]
#[ignore = "runs inside the real-node smoke test's Pod"]
async fn in_pod_the_service_account_reaches_the_api_server() -> Result<()> {
    let client = kube::Client::try_from(kube::Config::incluster()?)?;
    let version = client.apiserver_version().await?;
    let review: k8s_openapi::api::authentication::v1::SelfSubjectReview = client
        .request(
            http::Request::post("/apis/authentication.k8s.io/v1/selfsubjectreviews")
                .header("content-type", "application/json")
                .body(serde_json::to_vec(&json!({
                    "apiVersion": "authentication.k8s.io/v1",
                    "kind": "SelfSubjectReview",
                }))?)?,
        )
        .await?;
    let user = review
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.username)
        .unwrap_or_default();
    println!("in-pod: {} as {user}", version.git_version);
    Ok(())
}

/// `hello`: the pause binary serving HTTP (static). `e2e-self`: this test
/// binary with the host's glibc copied in (dynamic), run as an init
/// container, which proves such images run.
fn build_images(cluster: &RealCluster) -> Result<()> {
    let pause = cluster.binaries().path("kinference-pause");
    let hello = [LayerFile::host_file("/hello", &pause, 0o755)];
    cluster.build_image(
        HELLO_IMAGE,
        &hello,
        &ImageConfig {
            entrypoint: vec!["/hello".into()],
            cmd: vec!["-http".into(), ":8080".into()],
            user: Some("65532:65532".into()),
            exposed_ports: vec!["8080/tcp".into()],
            working_dir: Some("/".into()),
            env: vec!["GREETING=hello".into()],
            ..ImageConfig::default()
        },
    )?;
    let me = std::env::current_exe()?;
    let files = binary_with_libraries(&me, "/e2e-self")?;
    ensure!(
        files.len() > 1,
        "expected shared libraries for {}",
        me.display()
    );
    cluster.build_image(
        SELF_IMAGE,
        &files,
        &ImageConfig {
            entrypoint: vec!["/e2e-self".into()],
            ..ImageConfig::default()
        },
    )?;
    Ok(())
}

fn hello_deployment(host_port: u16) -> Result<Deployment> {
    Ok(serde_json::from_value(json!({
        "metadata": { "name": "hello" },
        "spec": {
            "replicas": 1,
            "selector": { "matchLabels": { "app": "hello" } },
            "template": {
                "metadata": { "labels": { "app": "hello" } },
                "spec": {
                    "terminationGracePeriodSeconds": 2,
                    "initContainers": [{
                        "name": "glibc-binary",
                        "image": SELF_IMAGE,
                        "imagePullPolicy": "Never",
                        // This binary's in-Pod test: a real API client.
                        "args": [
                            "--ignored", "--exact", "--nocapture",
                            "in_pod_the_service_account_reaches_the_api_server",
                        ],
                    }],
                    "containers": [{
                        "name": "hello",
                        "image": HELLO_IMAGE,
                        "imagePullPolicy": "Never",
                        "ports": [{ "containerPort": 8080, "hostPort": host_port }],
                        "readinessProbe": {
                            "httpGet": { "path": "/", "port": 8080 },
                            "periodSeconds": 1,
                        },
                        "resources": {
                            "requests": { "cpu": "50m", "memory": "32Mi" },
                            "limits": { "cpu": "200m", "memory": "64Mi" },
                        },
                        "securityContext": {
                            "runAsNonRoot": true,
                            "readOnlyRootFilesystem": true,
                            "allowPrivilegeEscalation": false,
                            "capabilities": { "drop": ["ALL"] },
                        },
                    }],
                },
            },
        },
    }))?)
}

/// Wait for a Pod matching `selector` to be Ready; returns its name and IP.
async fn wait_pod_ready(pods: &Api<Pod>, selector: &str) -> Result<(String, String)> {
    let deadline = Instant::now() + POD_TIMEOUT;
    loop {
        let list = pods.list(&ListParams::default().labels(selector)).await?;
        for pod in &list.items {
            let status = pod.status.as_ref();
            let ready = status
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            let ip = status.and_then(|s| s.pod_ip.clone());
            if let (true, Some(ip)) = (ready, ip) {
                return Ok((pod.metadata.name.clone().unwrap_or_default(), ip));
            }
        }
        if Instant::now() > deadline {
            let statuses: Vec<_> = list.items.iter().map(|p| &p.status).collect();
            bail!("no Ready Pod {selector} after {POD_TIMEOUT:?}: {statuses:#?}");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// `GET /` over HTTP/1.0; the body.
async fn http_get(addr: &str) -> Result<String> {
    let io = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream.write_all(b"GET / HTTP/1.0\r\n\r\n").await?;
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await?;
        anyhow::Ok(String::from_utf8_lossy(&buf).into_owned())
    };
    let response = tokio::time::timeout(Duration::from_secs(10), io)
        .await
        .with_context(|| format!("GET http://{addr}/ timed out"))?
        .with_context(|| format!("GET http://{addr}/"))?;
    ensure!(
        response.starts_with("HTTP/1.0 200"),
        "GET http://{addr}/: {response}"
    );
    Ok(response)
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind(("0.0.0.0", 0))?
        .local_addr()?
        .port())
}

/// libmount's state directory (see [`assert_host_clean`]).
const LIBMOUNT_STATE: &str = "/run/mount";

/// What the node could leave on the host, outside its directory.
#[derive(Debug, PartialEq)]
struct HostSnapshot {
    entries: BTreeSet<String>,
    chains: BTreeSet<String>,
    links: BTreeSet<String>,
}

impl HostSnapshot {
    fn take() -> Self {
        let mut entries = BTreeSet::new();
        for dir in [
            "/run",
            "/run/containerd",
            "/run/containerd/s",
            "/run/netns",
            "/var/run/netns",
            "/var/lib",
            "/var/lib/cni",
            "/var/lib/cni/results",
            "/var/lib/cni/networks",
            "/var/log/containers",
            "/var/log/pods",
            "/etc/cni",
            "/opt",
            "/opt/cni",
        ] {
            for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                entries.insert(format!("{dir}/{}", entry.file_name().to_string_lossy()));
            }
        }
        for hierarchy in std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
        {
            for entry in std::fs::read_dir(hierarchy.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    entries.insert(entry.path().display().to_string());
                }
            }
        }
        let mut chains = BTreeSet::new();
        for family in ["iptables", "ip6tables"] {
            for table in ["filter", "nat", "mangle", "raw"] {
                let out = Command::new(family)
                    .args(["-w", "-t", table, "-S"])
                    .output();
                let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
                for line in text.unwrap_or_default().lines() {
                    chains.insert(format!("{family} {table} {line}"));
                }
            }
        }
        let links = std::fs::read_dir("/sys/class/net")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        Self {
            entries,
            chains,
            links,
        }
    }
}

fn assert_host_clean(dir: &Path, before: &HostSnapshot) -> Result<()> {
    let mounts = node::mounts_under(dir);
    ensure!(
        mounts.is_empty(),
        "mounts left under {}: {mounts:?}",
        dir.display()
    );
    let kept = std::env::var_os(KEEP_DIR_ENV).is_some_and(|v| !v.is_empty() && v != "0");
    ensure!(kept || !dir.exists(), "{} still exists", dir.display());
    ensure!(
        !Path::new("/sys/class/net").join(BRIDGE).exists(),
        "bridge {BRIDGE} still exists"
    );
    let leftovers = node_processes(&dir.display().to_string());
    ensure!(leftovers.is_empty(), "processes left: {leftovers:?}");
    let after = HostSnapshot::take();
    // Only what appeared counts: start-up may have removed leftovers of an
    // earlier run that was killed.
    let diff = |before: &BTreeSet<String>, after: &BTreeSet<String>| -> Vec<String> {
        after.difference(before).cloned().collect()
    };
    // util-linux's `umount` creates its state directory /run/mount on its
    // first use on a host: host tooling, not something the node left (it
    // appeared on a fresh CI machine, never again on that machine).
    let entries: Vec<String> = diff(&before.entries, &after.entries)
        .into_iter()
        .filter(|e| e != LIBMOUNT_STATE)
        .collect();
    let chains = diff(&before.chains, &after.chains);
    let links = diff(&before.links, &after.links);
    ensure!(
        entries.is_empty() && chains.is_empty() && links.is_empty(),
        "the host changed: files/cgroups {entries:?}, iptables {chains:?}, links {links:?}"
    );
    Ok(())
}

/// `pid: cmdline` of node components (by program name; etcd and
/// kube-apiserver are left out: other tests run them) and of any process
/// whose command line names the node's directory.
fn node_processes(dir: &str) -> Vec<String> {
    const PROGRAMS: [&str; 5] = [
        "containerd",
        "containerd-shim-runc-v2",
        "kubelet",
        "kube-scheduler",
        "kube-controller-manager",
    ];
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let program = cmdline.split(' ').next().unwrap_or_default();
        let program = program.rsplit('/').next().unwrap_or_default();
        if PROGRAMS.contains(&program) || cmdline.contains(dir) {
            found.push(format!("{pid}: {cmdline}"));
        }
    }
    found
}
