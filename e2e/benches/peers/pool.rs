//! The simulated pool: the InferencePool and its Pods in the API server,
//! and the simulators (ours or llm-d-inference-sim) behind them.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use kinference_e2e::kubelet::{create_namespace, create_pod, set_status};
use kinference_simulator::{SimConfig, SimHandle};
use kinference_testbed::admission_front::AdmissionFront;
use kinference_testbed::free_port;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::json;
use tokio::process::{Child, Command};

use super::priorities;
use super::settings::{APP, MODEL, NS, POOL, START_TIMEOUT};
use super::workloads::LORA_SLOTS;

/// Pod `i`'s IP: its own loopback address, so that every Pod listens on the
/// pool's one target port.
pub(crate) fn pod_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, 10 + i as u8)
}

/// A port free on every Pod's address.
pub(crate) fn pool_port(pods: usize) -> Result<u16> {
    for _ in 0..20 {
        let probe = std::net::TcpListener::bind((pod_ip(0), 0))?;
        let port = probe.local_addr()?.port();
        drop(probe);
        if (0..pods).all(|i| std::net::TcpListener::bind((pod_ip(i), port)).is_ok()) {
            return Ok(port);
        }
    }
    bail!("no port free on all of 127.0.0.10..{}", 10 + pods)
}

pub(crate) async fn create_inference_pool(client: &Client, port: u16) -> Result<()> {
    let gvk = GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool");
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NS,
        &ApiResource::from_gvk_with_plural(&gvk, "inferencepools"),
    );
    let pool: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": { "name": POOL, "namespace": NS },
        "spec": {
            "selector": { "matchLabels": { "app": APP } },
            "targetPorts": [{ "number": port }],
            "endpointPickerRef": { "name": "epp", "port": { "number": 9002 } },
        },
    }))?;
    api.create(&PostParams::default(), &pool).await?;
    Ok(())
}

/// Creates the namespace, the InferencePool and `pods` Ready Pods.
pub(crate) async fn create_pool_objects(client: &Client, pods: usize, port: u16) -> Result<()> {
    create_namespace(client, NS).await?;
    create_inference_pool(client, port).await?;
    priorities::create_objectives(client).await?;
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    for i in 0..pods {
        let name = format!("sim-{i}");
        create_pod(
            &api,
            &name,
            // llm-d's shipped profile keeps decode Pods only.
            json!({ "app": APP, "kinference.io/models": MODEL, "llm-d.ai/role": "decode" }),
        )
        .await?;
        set_status(&api, &name, &pod_ip(i).to_string(), true).await?;
    }
    Ok(())
}

/// How the simulators behave.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum SimShape {
    /// Answer at once: what is measured is the path, not the model.
    Instant,
    /// Every answer held about a second, never queued: 150 requests stay in
    /// flight (the shape of upstream issue #2928).
    Held,
    /// Timed prefill with a prefix cache and queueing (routing quality).
    Timed,
    /// [`SimShape::Timed`] with slow decode, so that a few requests a
    /// second fill every slot ((i), priorities under overload).
    Queued,
}

/// A 220 KB prompt is ~55,000 tokens: the default KV capacity (131,072) would
/// queue all but two per Pod, where these shapes want no queue at all.
pub(crate) const UNBOUNDED_KV: u64 = 1 << 40;

pub(crate) fn sim_config(i: usize, shape: SimShape) -> SimConfig {
    let base = SimConfig::new(format!("sim-{i}"), [MODEL]);
    match shape {
        SimShape::Instant => SimConfig {
            time_scale: 0.0,
            max_concurrency: 512,
            kv_capacity_tokens: UNBOUNDED_KV,
            ..base
        },
        SimShape::Held => SimConfig {
            time_scale: 1.0,
            max_concurrency: 512,
            kv_capacity_tokens: UNBOUNDED_KV,
            base_latency_ms: 1_000.0,
            prefill_tokens_per_sec: 1e9,
            decode_tokens_per_sec: 1e6,
            prefix_cache_blocks: 0,
            ..base
        },
        // A small GPU: 4 running slots, 4,000 prompt tokens/s of prefill
        // (a cached block skips it), 200 tokens/s of decode per request.
        SimShape::Timed => SimConfig {
            time_scale: 1.0,
            max_concurrency: 4,
            prefill_tokens_per_sec: 4_000.0,
            decode_tokens_per_sec: 200.0,
            base_latency_ms: 5.0,
            prefix_cache_blocks: 1_024,
            ..base
        },
        SimShape::Queued => SimConfig {
            time_scale: 1.0,
            max_concurrency: priorities::SLOTS,
            prefill_tokens_per_sec: 4_000.0,
            decode_tokens_per_sec: priorities::DECODE_TOKENS_PER_SEC,
            base_latency_ms: priorities::BASE_LATENCY_MS,
            prefix_cache_blocks: 1_024,
            ..base
        },
    }
}

/// The running simulators, one per Pod.
pub(crate) struct Sims {
    pub(crate) handles: Vec<SimHandle>,
    /// llm-d-inference-sim processes, each behind an [`AdmissionFront`] on
    /// its Pod's address (it listens on all addresses, so each needs a port
    /// of its own): a streamed answer's headers come at admission, as from
    /// vLLM's server, and not with the first token, as from the simulator.
    pub(crate) peers: Vec<(Child, AdmissionFront)>,
    /// vLLM's publisher in front of each llm-d-inference-sim's events
    /// (`Publishers::VllmBound`).
    pub(crate) relays: Vec<Child>,
    pub(crate) addrs: Vec<SocketAddr>,
    pub(crate) port: u16,
}

/// What each llm-d-inference-sim is started with beyond [`SimShape::Timed`]'s
/// likeness.
pub(crate) struct LlmdShape {
    pub(crate) max_model_len: u32,
    /// LoRA adapters `lora-0` … of the base model (0: none), [`LORA_SLOTS`]
    /// loaded at once.
    pub(crate) adapters: usize,
}

impl LlmdShape {
    pub(crate) fn lora_args(&self) -> Vec<String> {
        if self.adapters == 0 {
            return Vec::new();
        }
        let mut args = vec!["--lora-modules".to_string()];
        args.extend((0..self.adapters).map(|i| {
            json!({"name": format!("lora-{i}"), "path": format!("/adapters/lora-{i}"), "base_model_name": MODEL})
                .to_string()
        }));
        args.extend(["--max-loras".to_string(), LORA_SLOTS.to_string()]);
        args.extend(["--max-cpu-loras".to_string(), self.adapters.to_string()]);
        args
    }
}

/// Where each llm-d-inference-sim sends its KV events.
pub(crate) enum SimEvents<'a> {
    Nowhere,
    /// All to one address: our EPP's events port.
    To(SocketAddr),
    /// Each to vLLM's publisher, bound at its Pod's address on these ports
    /// and run by this Python (`bench/peers/install.sh vllm-publisher`).
    VllmBound {
        python: &'a Path,
        ports: &'a EventsPorts,
    },
}

impl SimEvents<'_> {
    /// Sim `i`'s `--zmq-endpoint` (empty: none), and the relay it needs.
    pub(crate) async fn endpoint(&self, i: usize) -> Result<(String, Option<Child>)> {
        match self {
            SimEvents::Nowhere => Ok((String::new(), None)),
            SimEvents::To(addr) => Ok((format!("tcp://{addr}"), None)),
            SimEvents::VllmBound { python, ports } => {
                let listen = SocketAddr::from(([127, 0, 0, 1], free_port()?));
                let relay = start_relay(python, listen, pod_ip(i), ports).await?;
                Ok((format!("tcp://{listen}"), Some(relay)))
            }
        }
    }
}

/// vLLM's publisher, bound at `ip`, publishing what a simulator sends to
/// `listen` (`epp/tests/fixtures/kv_events/relay.py`); once it is ready.
pub(crate) async fn start_relay(
    python: &Path,
    listen: SocketAddr,
    ip: Ipv4Addr,
    ports: &EventsPorts,
) -> Result<Child> {
    use tokio::io::AsyncBufReadExt as _;
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../epp/tests/fixtures/kv_events/relay.py");
    let mut child = Command::new(python)
        .arg(script)
        .args(["--listen", &format!("tcp://{listen}")])
        .args(["--endpoint", &format!("tcp://{ip}:{}", ports.bound)])
        .args(["--replay", &format!("tcp://{ip}:{}", ports.replay)])
        .args(["--topic", &format!("kv@{ip}@{MODEL}")])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", python.display()))?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(START_TIMEOUT, lines.next_line()).await;
    ensure!(
        matches!(&ready, Ok(Ok(Some(l))) if l == "ready"),
        "vLLM's publisher for {ip} did not start: {ready:?}"
    );
    Ok(child)
}

impl Sims {
    pub(crate) async fn start(pods: usize, port: u16, shape: SimShape) -> Result<Sims> {
        let mut handles = Vec::with_capacity(pods);
        for i in 0..pods {
            let addr = SocketAddr::new(IpAddr::V4(pod_ip(i)), port);
            let sim = kinference_simulator::spawn(sim_config(i, shape), addr)
                .await
                .with_context(|| format!("simulator on {addr}"))?;
            handles.push(sim);
        }
        let addrs = handles.iter().map(SimHandle::addr).collect();
        Ok(Sims {
            handles,
            peers: Vec::new(),
            relays: Vec::new(),
            addrs,
            port,
        })
    }

    /// llm-d-inference-sim configured like [`SimShape::Timed`]: 4 running
    /// slots, 5 ms per output token (200/s), a KV cache of 1,024 blocks of 16
    /// tokens with prefix caching. Its dummy tokenizer (words and punctuation)
    /// makes 0.62 as many tokens of our prompts as our 4 characters per token,
    /// so 0.4 ms of prefill per uncached token gives an uncached prompt the
    /// same time as our 4,000 tokens/s (about 1.5 s for a 24 KB system
    /// prompt). Its cache then holds about 4 such prompts where ours holds 2.7:
    /// it also holds the running requests' blocks, and 4 running prompts need
    /// about 950 blocks.
    ///
    /// With `events`, each publishes its KV-cache events there (topic
    /// `kv@<Pod IP>@<model>`).
    pub(crate) async fn start_llmd(
        bin: &Path,
        pods: usize,
        port: u16,
        shape: LlmdShape,
        events: SimEvents<'_>,
    ) -> Result<Sims> {
        let mut peers = Vec::with_capacity(pods);
        let mut relays = Vec::new();
        let mut addrs = Vec::with_capacity(pods);
        for i in 0..pods {
            let own = free_port()?;
            let (events, relay) = events.endpoint(i).await?;
            relays.extend(relay);
            let child = Command::new(bin)
                .args(["--port", &own.to_string(), "--model", MODEL])
                .args(["--max-num-seqs", "4"])
                .args(["--max-model-len", &shape.max_model_len.to_string()])
                .args(shape.lora_args())
                .args([
                    "--prefill-overhead",
                    "5ms",
                    "--prefill-time-per-token",
                    "400us",
                ])
                .args(["--inter-token-latency", "5ms"])
                .args([
                    "--enable-kvcache",
                    "--kv-cache-size",
                    "1024",
                    "--block-size",
                    "16",
                ])
                .arg("--force-dummy-tokenizer")
                .args(["--zmq-endpoint", &events])
                .args(["--max-request-body-size-mb", "16", "--seed", &i.to_string()])
                .env("POD_IP", pod_ip(i).to_string())
                // Its `x-inference-pod` answer header: who served it.
                .env("POD_NAME", format!("sim-{i}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("starting {}", bin.display()))?;
            let addr = SocketAddr::new(IpAddr::V4(pod_ip(i)), port);
            let upstream = SocketAddr::from(([127, 0, 0, 1], own));
            let pod = format!("sim-{i}");
            let front = AdmissionFront::start(addr, upstream, &[("x-inference-pod", &pod)]).await?;
            peers.push((child, front));
            addrs.push(addr);
        }
        for addr in &addrs {
            wait_serving(*addr).await?;
        }
        Ok(Sims {
            handles: Vec::new(),
            peers,
            relays,
            addrs,
            port,
        })
    }

    pub(crate) async fn stop(self) {
        for s in &self.handles {
            s.shutdown().await;
        }
        for (mut child, front) in self.peers {
            let _ = child.kill().await;
            front.stop().await;
        }
        for mut relay in self.relays {
            let _ = relay.kill().await;
        }
    }

    pub(crate) fn addrs(&self) -> Vec<SocketAddr> {
        self.addrs.clone()
    }
}

/// Waits until a simulator answers its metrics page at `addr`.
pub(crate) async fn wait_serving(addr: SocketAddr) -> Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Ok(mut s) = tokio::net::TcpStream::connect(addr).await {
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            let req = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
            let mut head = [0u8; 12];
            if s.write_all(req.as_bytes()).await.is_ok()
                && s.read_exact(&mut head).await.is_ok()
                && head.ends_with(b"200")
            {
                return Ok(());
            }
        }
        ensure!(
            Instant::now() < deadline,
            "llm-d-inference-sim at {addr} did not start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------
// One EPP process and its Envoy.
// ---------------------------------------------------------------------------

/// The ports of the simulators' KV events.
pub(crate) struct EventsPorts {
    /// Our EPP's events port on 127.0.0.1 (`Publishers::ToEpp`).
    pub(crate) listen: u16,
    /// vLLM's publisher's and replay socket's ports on every Pod's address
    /// (`Publishers::VllmBound`).
    pub(crate) bound: u16,
    pub(crate) replay: u16,
}

impl EventsPorts {
    pub(crate) fn pick(pods: usize, pool: u16) -> Result<EventsPorts> {
        let listen = free_port()?;
        let bound = pool_port(pods)?;
        let replay = pool_port(pods)?;
        ensure!(
            bound != replay && ![bound, replay].contains(&pool),
            "the events ports {bound} and {replay} are taken; run again"
        );
        Ok(EventsPorts {
            listen,
            bound,
            replay,
        })
    }
}
