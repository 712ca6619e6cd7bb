//! What a run is: its arguments, and the names, sizes and ports every
//! part of the bench shares.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

pub(crate) const NS: &str = "peers";
pub(crate) const POOL: &str = "pool";
pub(crate) const APP: &str = "peers-sim";
pub(crate) const MODEL: &str = "sim-model";
/// Thread-name prefixes of this process's runtimes.
pub(crate) const LOAD_THREADS: &str = "load";
pub(crate) const SIM_THREADS: &str = "sim";
pub(crate) const GROUPS: usize = 2;
pub(crate) const THREADS: [&str; GROUPS] = [LOAD_THREADS, SIM_THREADS];
pub(crate) const LOAD: usize = 0;
pub(crate) const SIM: usize = 1;
/// How long an EPP gets from its start to its first routed request.
pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(120);
/// Idle window in which an EPP's background CPU (scraping, watches) is read.
pub(crate) const IDLE_WINDOW: Duration = Duration::from_secs(3);

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Mode {
    /// A few requests per contender and workload: the script cannot rot.
    Smoke,
    /// The figures.
    Full,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Simulator {
    Ours,
    /// llm-d-inference-sim, one process per Pod.
    Llmd,
}

#[derive(Debug, Parser)]
pub(crate) struct Args {
    #[arg(long, value_enum, default_value_t = Mode::Full)]
    pub(crate) mode: Mode,
    /// Our EPP's binary (default: target/release/kinference-epp).
    #[arg(long, env = "KINFERENCE_EPP_BIN")]
    pub(crate) epp_bin: Option<PathBuf>,
    /// The directory `bench/peers/install.sh` printed (links `gie-epp`,
    /// `llmd-epp`); peers missing from it are skipped with a note.
    #[arg(long, env = "KINFERENCE_PEERS_DIR")]
    pub(crate) peers_dir: Option<PathBuf>,
    /// The llm-d scheduler's config (default: `llmd-epp-config.yaml` in
    /// `--peers-dir`, the `epp-config.yaml` its module ships).
    #[arg(long, env = "KINFERENCE_LLMD_CONFIG")]
    pub(crate) llmd_config: Option<PathBuf>,
    /// Only these contenders (comma-separated names); all by default.
    #[arg(long, value_delimiter = ',')]
    pub(crate) only: Vec<String>,
    /// Only these workloads (`chat`, `large`, `prefix`, `small`, `decode`,
    /// `hot`, `lora`, `inference-perf`, `priorities`); all by default
    /// (`inference-perf` when installed, `lora` with `--simulator llmd`).
    #[arg(long, value_delimiter = ',')]
    pub(crate) workloads: Vec<String>,
    /// Simulated Pods in the pool.
    #[arg(long, default_value_t = 4)]
    pub(crate) pods: usize,
    /// Envoy worker threads (every contender's Envoy alike).
    #[arg(long, default_value_t = 2)]
    pub(crate) envoy_workers: usize,
    /// The simulator behind the pool in the open-loop workloads (c), (d) and
    /// (e): ours, or llm-d-inference-sim (`bench/peers/install.sh llmd-sim`),
    /// configured alike, to check that ours does not flatter anyone.
    #[arg(long, value_enum, default_value_t = Simulator::Ours)]
    pub(crate) simulator: Simulator,
    /// llm-d-inference-sim's `--max-model-len`: room for the 220 KB prompts
    /// (about 33,000 of its tokens), and no more. v0.10.2 allocates a
    /// response channel of that many slots for every request (8 MB at a
    /// million), whose zeroing and GC scans load the busiest simulator most.
    #[arg(long, default_value_t = 65_536)]
    pub(crate) llmd_max_model_len: u32,
    /// The Poisson rates of workload (c), requests per second (default:
    /// 8,16,24 in full mode).
    #[arg(long, value_delimiter = ',')]
    pub(crate) prefix_rates: Vec<f64>,
    /// The Poisson rates of workload (g), the hot group (default: 16 in
    /// full mode).
    #[arg(long, value_delimiter = ',')]
    pub(crate) hot_rates: Vec<f64>,
    /// Runs every contender this many times, in turn (rep-major, each rep in
    /// its own random order, so that a drift of the machine hits all
    /// alike); the open-loop tables give medians over reps and each rep's
    /// ratio to the reference.
    #[arg(long, default_value_t = 1)]
    pub(crate) reps: usize,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    pub(crate) bench: bool,
}

impl Args {
    pub(crate) fn wants_workload(&self, name: &str) -> bool {
        self.workloads.is_empty() || self.workloads.iter().any(|w| w == name)
    }
}

// ---------------------------------------------------------------------------
// Contenders.
// ---------------------------------------------------------------------------
