//! The workloads: their shapes and request bodies.

use std::sync::Arc;

use kinference_testbed::load::PhaseSpec;
use kinference_testbed::workload;
use kinference_testbed::workload::SharedPrefix;

use super::settings::MODEL;

/// The shared-prefix shape of (c): 8 system prompts of ~6,000 tokens, short
/// questions, a hot prefix taking 40% of the traffic, short outputs.
pub(crate) const PREFIX_SHAPE: SharedPrefix = SharedPrefix {
    groups: 8,
    prompts_per_group: 64,
    system_bytes: 24_000,
    question_bytes: 200,
    output_tokens: 16,
    hot_share: 0.4,
};

/// (d): small inputs (about 150 prompt tokens, 8 system prompts so that a
/// little prefix still repeats), short outputs.
pub(crate) const SMALL_SHAPE: SharedPrefix = SharedPrefix {
    groups: 8,
    prompts_per_group: 64,
    system_bytes: 400,
    question_bytes: 200,
    output_tokens: 16,
    hot_share: 0.0,
};

/// (e): decode-heavy: a ~2 KB prompt and 512 output tokens, so a request
/// holds its running slot about 2.6 s and queues, not prefill, set TTFT.
pub(crate) const DECODE_SHAPE: SharedPrefix = SharedPrefix {
    groups: 8,
    prompts_per_group: 64,
    system_bytes: 2_000,
    question_bytes: 200,
    output_tokens: 512,
    hot_share: 0.0,
};

/// (g): the hot-group case: (c) with one system prompt taking 60% of the
/// traffic, at one rate.
pub(crate) const HOT_SHAPE: SharedPrefix = SharedPrefix {
    hot_share: 0.6,
    ..PREFIX_SHAPE
};

/// An open-loop workload against the timed simulators.
#[derive(Clone, Copy)]
pub(crate) struct OpenWorkload {
    /// Its label in the report; each phase is `<label> <rate>/s`.
    pub(crate) label: &'static str,
    /// Its name for `--workloads`.
    pub(crate) name: &'static str,
    pub(crate) shape: SharedPrefix,
    /// LoRA adapters of the base model, one per system prompt in turn
    /// (`lora-<group % adapters>`); 0: every request is for the base model.
    pub(crate) adapters: usize,
}

impl OpenWorkload {
    pub(crate) fn model_of(&self, group: usize) -> String {
        if self.adapters == 0 {
            MODEL.to_string()
        } else {
            format!("lora-{}", group % self.adapters)
        }
    }
}

/// How many open-loop workloads there are.
pub(crate) const OPEN: usize = 5;

/// (c), (d), (e), (g): routing quality, small inputs, decode-heavy outputs,
/// one hot group.
pub(crate) const OPEN_WORKLOADS: [OpenWorkload; OPEN] = [
    OpenWorkload {
        label: "(c) shared prefix",
        name: "prefix",
        shape: PREFIX_SHAPE,
        adapters: 0,
    },
    OpenWorkload {
        label: "(d) small inputs",
        name: "small",
        shape: SMALL_SHAPE,
        adapters: 0,
    },
    OpenWorkload {
        label: "(e) decode-heavy",
        name: "decode",
        shape: DECODE_SHAPE,
        adapters: 0,
    },
    OpenWorkload {
        label: "(g) hot group",
        name: "hot",
        shape: HOT_SHAPE,
        adapters: 0,
    },
    OpenWorkload {
        label: "(h) LoRA adapters",
        name: "lora",
        shape: LORA_SHAPE,
        adapters: LORA_ADAPTERS,
    },
];

/// (h): 8 LoRA adapters over 4 Pods that each hold 2 (`--max-loras 2`;
/// llm-d-inference-sim only), short prompts. 64 system prompts of 600
/// bytes, each asked of adapter `group % 8`: a group's prefix says little
/// about where its adapter is, so a picker blind to adapters spreads every
/// adapter over every Pod. A request whose adapter a Pod cannot load (both
/// slots in use by others) waits there, and an adapter unloaded loses its
/// cached blocks.
pub(crate) const LORA_SHAPE: SharedPrefix = SharedPrefix {
    groups: 64,
    prompts_per_group: 16,
    system_bytes: 600,
    question_bytes: 200,
    output_tokens: 16,
    hot_share: 0.0,
};
pub(crate) const LORA_ADAPTERS: usize = 8;
/// Adapters a simulated Pod holds at once.
pub(crate) const LORA_SLOTS: usize = 2;

/// (f): inference-perf's `shared_prefix` at (c)'s rates.
pub(crate) const IP_WORKLOAD: &str = "inference-perf";
pub(crate) const IP_LABEL: &str = "(f) inference-perf shared_prefix";

pub(crate) fn is_open_phase(phase: &str) -> bool {
    OPEN_WORKLOADS.iter().any(|w| phase.starts_with(w.label))
}

/// Request bodies, shared by the clients and sent in turn.
pub(crate) type BodySet = Arc<Vec<Arc<Vec<u8>>>>;

/// Shared-prefix requests and their groups, sent in turn.
pub(crate) type GroupRequests = Arc<Vec<(usize, Arc<Vec<u8>>)>>;

/// A closed-loop phase: its name in the report, its size, its bodies.
pub(crate) type ClosedPhase<'a> = (String, PhaseSpec, &'a BodySet);

pub(crate) struct Bodies {
    pub(crate) chat: BodySet,
    pub(crate) large: BodySet,
    /// In the order of [`OPEN_WORKLOADS`].
    pub(crate) open: [GroupRequests; OPEN],
}

pub(crate) fn shared(bodies: Vec<Vec<u8>>) -> BodySet {
    Arc::new(bodies.into_iter().map(Arc::new).collect())
}

impl Bodies {
    pub(crate) fn new() -> Bodies {
        Bodies {
            chat: shared(workload::short_chat(MODEL, 1_024)),
            large: shared(workload::large_prompts(MODEL, 64, 220_000)),
            open: OPEN_WORKLOADS.map(|w| {
                let requests = workload::shared_prefix_models(|g| w.model_of(g), &w.shape, 4_096);
                Arc::new(
                    requests
                        .into_iter()
                        .map(|r| (r.group, Arc::new(r.body)))
                        .collect(),
                )
            }),
        }
    }
}
