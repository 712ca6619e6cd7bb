//! The contenders: each EPP (ours with its policies, the references with
//! their configurations) or baseline, and the binaries they run.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, ensure};
use kinference_testbed::inference_perf::InferencePerf;
use kinference_testbed::priorities::{POSITIVE_PRIORITY, waiting_rule};

use super::priorities;
use super::settings::{APP, Args, Simulator};
use super::workloads::IP_WORKLOAD;

pub(crate) const QUEUE_POLICY: &str = "pool:
  selector: { app: peers-sim }
  targetPorts: [{ number: ${PORT} }]
rules:
  - name: least-queued
    route:
      select: [{ type: Local, minimize: QueueDepth }]
      # As the reference's max-score picker does among equal scores (and as
      # our linter asks: without it a burst lands on the first Pod).
      tieBreak: Random
";
pub(crate) const TTFT_POLICY: &str = "pool:
  selector: { app: peers-sim }
  targetPorts: [{ number: ${PORT} }]
rules:
  - name: fastest-first-token
    route: { select: [{ type: Local, minimize: PredictedTTFT }] }
";
/// The policy `kinference-epp --pool-name` serves when given none (LoRA
/// adapters first where loaded, never evicting one in use), over the pool.
pub(crate) const DEFAULT_POLICY: &str = concat!(
    "pool:\n  selector: { app: peers-sim }\n  targetPorts: [{ number: ${PORT} }]\n",
    include_str!("../../../epp/policies/default.yaml")
);
/// An `EndpointPickerConfig` for the reference EPP: these feature gates, and
/// one profile of these scorers (with their weights, or the loader's
/// default). The loader fills in the picker, the profile handler and the
/// metrics data layer.
pub(crate) fn gie_config(feature_gates: &[&str], scorers: &[(&str, Option<u32>)]) -> String {
    let mut out = String::from(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n",
    );
    if !feature_gates.is_empty() {
        out.push_str("featureGates:\n");
        for gate in feature_gates {
            out.push_str(&format!("- {gate}\n"));
        }
    }
    out.push_str("plugins:\n");
    for (scorer, _) in scorers {
        out.push_str(&format!("- type: {scorer}\n"));
    }
    out.push_str("schedulingProfiles:\n- name: default\n  plugins:\n");
    for (scorer, weight) in scorers {
        out.push_str(&format!("  - pluginRef: {scorer}\n"));
        if let Some(w) = weight {
            out.push_str(&format!("    weight: {w}\n"));
        }
    }
    out
}

/// The reference EPP's default profile (v1.5.0's `loadDefaultConfig`).
pub(crate) const GIE_DEFAULT_SCORERS: &[(&str, Option<u32>)] = &[
    ("queue-scorer", Some(2)),
    ("kv-cache-utilization-scorer", Some(2)),
    ("prefix-cache-scorer", Some(3)),
];

/// The reference EPP with its queue scorer alone.
pub(crate) fn gie_queue_config() -> String {
    gie_config(&[], &[("queue-scorer", None)])
}

/// The reference EPP's default profile with its LoRA affinity scorer added
/// (v1.5.0 ships it, outside the default profile), weighted as the queue.
pub(crate) fn gie_lora_config() -> String {
    let mut scorers = GIE_DEFAULT_SCORERS.to_vec();
    scorers.push(("lora-affinity-scorer", Some(2)));
    gie_config(&[], &scorers)
}

// ---------------------------------------------------------------------------
// Command line.
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Peer {
    Kinference,
    Gie,
    Llmd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// Clients call the simulators, round-robin.
    Direct,
    /// Envoy round-robin, no ext_proc.
    EnvoyRoundRobin,
    /// Envoy with ext_proc to this EPP.
    Epp(Peer),
}

#[derive(Clone, Debug)]
pub(crate) struct Contender {
    pub(crate) name: &'static str,
    pub(crate) route: Route,
    /// Policy (ours) or EndpointPickerConfig (peers) text; `None`: its default.
    pub(crate) config: Option<String>,
    /// Our EPP in precise prefix mode.
    pub(crate) kv_events: Option<KvEvents>,
    /// EPP processes behind the one Envoy, which spreads the ext_proc
    /// streams over them round robin (an EPP Service with several Pods).
    pub(crate) replicas: usize,
    pub(crate) what: &'static str,
}

/// A contender in precise prefix mode: its tokenizer, and how the
/// simulators' events reach it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KvEvents {
    pub(crate) tokenizer: EventsTokenizer,
    pub(crate) publishers: Publishers,
}

/// How the simulators publish their KV events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Publishers {
    /// Each connects to the EPP's events port (`publisherMode: Connect`,
    /// the default): one replica hears them.
    ToEpp,
    /// Each simulator's events are published by vLLM's own publisher bound
    /// at its Pod's address, with its replay socket
    /// (`epp/tests/fixtures/kv_events/relay.py`), and every EPP replica
    /// connects to every Pod (`publisherMode: Bind`).
    VllmBound,
}

impl KvEvents {
    const fn new(tokenizer: EventsTokenizer, publishers: Publishers) -> Option<KvEvents> {
        Some(KvEvents {
            tokenizer,
            publishers,
        })
    }

    pub(crate) fn tokenizer_is(kv: Option<KvEvents>, tokenizer: EventsTokenizer) -> bool {
        kv.is_some_and(|k| k.tokenizer == tokenizer)
    }
}

/// The tokenizer of a contender in precise prefix mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EventsTokenizer {
    /// llm-d-inference-sim's dummy tokenizer: the simulators publish their
    /// KV events to the EPP, and they match (llm-d-inference-sim only).
    SimulatorDummy,
    /// Qwen3's own (`KINFERENCE_QWEN3_TOKENIZER`, from `bench/peers/install.sh
    /// qwen3-tokenizer`), the one a real pool runs: what precise mode adds to
    /// the request path. The closed-loop phases only: no simulator's events
    /// would match it.
    Qwen3,
}

impl EventsTokenizer {
    /// `--kv-events-tokenizer`'s value.
    pub(crate) fn arg(self) -> Result<std::ffi::OsString> {
        match self {
            EventsTokenizer::SimulatorDummy => Ok("simulator-dummy".into()),
            EventsTokenizer::Qwen3 => std::env::var_os("KINFERENCE_QWEN3_TOKENIZER").context(
                "KINFERENCE_QWEN3_TOKENIZER unset (bench/peers/install.sh qwen3-tokenizer prints it)",
            ),
        }
    }
}

pub(crate) fn contenders(args: &Args) -> Vec<Contender> {
    let llmd_config = args
        .llmd_config
        .clone()
        .or_else(|| Some(args.peers_dir.as_ref()?.join("llmd-epp-config.yaml")))
        .and_then(|p| std::fs::read_to_string(p).ok());
    let all = vec![
        Contender {
            name: "direct",
            route: Route::Direct,
            config: None,
            kv_events: None,
            replicas: 1,
            what: "clients → simulators, round-robin (baseline)",
        },
        Contender {
            name: "envoy-rr",
            route: Route::EnvoyRoundRobin,
            config: None,
            kv_events: None,
            replicas: 1,
            what: "Envoy round-robin, no ext_proc",
        },
        Contender {
            name: "kinference-queue",
            route: Route::Epp(Peer::Kinference),
            config: Some(QUEUE_POLICY.into()),
            kv_events: None,
            replicas: 1,
            what: "our EPP, one rule `minimize: QueueDepth`, `tieBreak: Random`",
        },
        Contender {
            name: "gie-queue",
            route: Route::Epp(Peer::Gie),
            config: Some(gie_queue_config()),
            kv_events: None,
            replicas: 1,
            what: "reference EPP, queue scorer only",
        },
        Contender {
            name: "kinference-ttft",
            route: Route::Epp(Peer::Kinference),
            config: Some(TTFT_POLICY.into()),
            kv_events: None,
            replicas: 1,
            what: "our EPP, one rule `minimize: PredictedTTFT` (recommended)",
        },
        Contender {
            name: "kinference-ttft-x2",
            route: Route::Epp(Peer::Kinference),
            config: Some(TTFT_POLICY.into()),
            kv_events: None,
            replicas: 2,
            what: "our EPP, `minimize: PredictedTTFT`, 2 replicas behind one Envoy (each knows the routes it made)",
        },
        Contender {
            name: "kinference-ttft-x3",
            route: Route::Epp(Peer::Kinference),
            config: Some(TTFT_POLICY.into()),
            kv_events: None,
            replicas: 3,
            what: "our EPP, `minimize: PredictedTTFT`, 3 replicas behind one Envoy (each knows the routes it made)",
        },
        Contender {
            name: "kinference-precise",
            route: Route::Epp(Peer::Kinference),
            config: Some(TTFT_POLICY.into()),
            kv_events: KvEvents::new(EventsTokenizer::SimulatorDummy, Publishers::ToEpp),
            replicas: 1,
            what: "our EPP, `minimize: PredictedTTFT`, precise prefix mode (the simulators' KV events, their dummy tokenizer)",
        },
        Contender {
            name: "kinference-precise-bind",
            route: Route::Epp(Peer::Kinference),
            config: Some(TTFT_POLICY.into()),
            kv_events: KvEvents::new(EventsTokenizer::SimulatorDummy, Publishers::VllmBound),
            replicas: 1,
            what: "`kinference-precise` with `publisherMode: Bind`: the simulators' events published by vLLM's own publisher at each Pod, with its replay socket",
        },
        Contender {
            name: "kinference-precise-bind-x2",
            route: Route::Epp(Peer::Kinference),
            config: Some(TTFT_POLICY.into()),
            kv_events: KvEvents::new(EventsTokenizer::SimulatorDummy, Publishers::VllmBound),
            replicas: 2,
            what: "`kinference-precise-bind`, 2 replicas behind one Envoy (each subscribed to every Pod)",
        },
        Contender {
            name: "kinference-precise-bind-x3",
            route: Route::Epp(Peer::Kinference),
            config: Some(TTFT_POLICY.into()),
            kv_events: KvEvents::new(EventsTokenizer::SimulatorDummy, Publishers::VllmBound),
            replicas: 3,
            what: "`kinference-precise-bind`, 3 replicas behind one Envoy (each subscribed to every Pod)",
        },
        Contender {
            name: "kinference-precise-qwen3",
            route: Route::Epp(Peer::Kinference),
            config: Some(TTFT_POLICY.into()),
            kv_events: KvEvents::new(EventsTokenizer::Qwen3, Publishers::ToEpp),
            replicas: 1,
            what: "our EPP, `minimize: PredictedTTFT`, precise prefix mode with Qwen3's tokenizer (closed-loop phases only: what tokenizing adds to the request path; no events match)",
        },
        Contender {
            name: "gie-default",
            route: Route::Epp(Peer::Gie),
            config: None,
            kv_events: None,
            replicas: 1,
            what: "reference EPP, default profile (queue 2 + KV 2 + prefix 3)",
        },
        Contender {
            name: "kinference-default",
            route: Route::Epp(Peer::Kinference),
            config: Some(DEFAULT_POLICY.into()),
            kv_events: None,
            replicas: 1,
            what: "our EPP, the built-in default policy (`epp/policies/default.yaml`: a LoRA adapter's Pods with it loaded first)",
        },
        Contender {
            name: "gie-lora",
            route: Route::Epp(Peer::Gie),
            config: Some(gie_lora_config()),
            kv_events: None,
            replicas: 1,
            what: "reference EPP, default profile plus its LoRA affinity scorer (weight 2)",
        },
        Contender {
            name: "kinference-flow",
            route: Route::Epp(Peer::Kinference),
            config: Some(flow_policy()),
            kv_events: None,
            replicas: 1,
            what: "our EPP, flow control by InferenceObjective priority: Pods full at their slots in flight (one fewer for priority 0 and below), the rest wait in the EPP (`onEmpty: Wait`)",
        },
        Contender {
            name: "gie-flow",
            route: Route::Epp(Peer::Gie),
            config: Some(gie_flow_config()),
            kv_events: None,
            replicas: 1,
            what: "reference EPP, default profile with its `flowControl` feature gate",
        },
        Contender {
            name: "gie-default-x2",
            route: Route::Epp(Peer::Gie),
            config: None,
            kv_events: None,
            replicas: 2,
            what: "reference EPP, default profile, 2 replicas behind one Envoy (each on its own)",
        },
        Contender {
            name: "llmd",
            route: Route::Epp(Peer::Llmd),
            config: llmd_config,
            kv_events: None,
            replicas: 1,
            what: "llm-d scheduler, its shipped epp-config.yaml",
        },
    ];
    all.into_iter()
        .filter(|c| args.only.is_empty() || args.only.iter().any(|o| o == c.name))
        // Our simulator publishes no KV events.
        .filter(|c| {
            !KvEvents::tokenizer_is(c.kv_events, EventsTokenizer::SimulatorDummy)
                || args.simulator == Simulator::Llmd
        })
        .collect()
}

/// Where each EPP's binary is; `None` for a peer that was not built.
pub(crate) struct Binaries {
    pub(crate) kinference: PathBuf,
    pub(crate) gie: Option<PathBuf>,
    pub(crate) llmd: Option<PathBuf>,
    pub(crate) llmd_sim: Option<PathBuf>,
    /// The Python that runs vLLM's publisher (`Publishers::VllmBound`).
    pub(crate) vllm_publisher: Option<PathBuf>,
    pub(crate) inference_perf: Option<InferencePerf>,
}

impl Binaries {
    pub(crate) fn locate(args: &Args) -> Result<Binaries> {
        let kinference = args.epp_bin.clone().unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/kinference-epp")
        });
        ensure!(
            kinference.is_file(),
            "no EPP binary at {} (cargo build --release -p kinference-epp --locked)",
            kinference.display()
        );
        let peer = |name: &str| {
            args.peers_dir
                .as_ref()
                .map(|d| d.join(name))
                .filter(|p| p.is_file())
        };
        let llmd_sim = peer("llmd-sim");
        ensure!(
            args.simulator != Simulator::Llmd || llmd_sim.is_some(),
            "--simulator llmd needs llmd-sim in --peers-dir (bench/peers/install.sh llmd-sim)"
        );
        let inference_perf = args.peers_dir.as_deref().and_then(InferencePerf::locate);
        ensure!(
            inference_perf.is_some() || !args.workloads.iter().any(|w| w == IP_WORKLOAD),
            "--workloads {IP_WORKLOAD} needs it in --peers-dir (bench/peers/install.sh inference-perf)"
        );
        Ok(Binaries {
            kinference,
            gie: peer("gie-epp"),
            llmd: peer("llmd-epp"),
            llmd_sim,
            vllm_publisher: peer("vllm-publisher"),
            inference_perf,
        })
    }

    pub(crate) fn of(&self, peer: Peer) -> Option<&Path> {
        match peer {
            Peer::Kinference => Some(&self.kinference),
            Peer::Gie => self.gie.as_deref(),
            Peer::Llmd => self.llmd.as_deref(),
        }
    }
}

// ---------------------------------------------------------------------------
// The pool: Pods in the API server, simulators on loopback.
// ---------------------------------------------------------------------------

/// Our policy: room by requests in flight, one slot per Pod kept for
/// positive priorities, the rest waiting in the EPP by priority.
pub(crate) fn flow_policy() -> String {
    let priority = waiting_rule("priority", POSITIVE_PRIORITY, priorities::SLOTS);
    let rest = waiting_rule("rest", "", priorities::SLOTS - 1);
    format!(
        "pool:\n  selector: {{ app: {APP} }}\n  targetPorts: [{{ number: ${{PORT}} }}]\nflowControl: {{ maxRequests: 96 }}\nrules:\n{priority}{rest}"
    )
}

/// The reference EPP's default profile with its flow control layer on
/// (v1.5.0: the `flowControl` feature gate; its default saturation
/// detector, no global bounds, requests waiting up to the client's
/// deadline).
pub(crate) fn gie_flow_config() -> String {
    gie_config(&["flowControl"], GIE_DEFAULT_SCORERS)
}
