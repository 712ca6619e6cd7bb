//! `kinference`: lint, test, explain, replay and diff policies, print the
//! CRDs, run the demo.
#![forbid(unsafe_code)]

#[cfg(feature = "demo")]
mod demo;
mod explain;
mod lint;
mod policy_tests;
mod replay;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "kinference",
    version,
    about = "Policy-driven routing for LLM inference"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compile policies offline and report every error with its path and
    /// line, then warnings about rules that can never match, tiers that can
    /// never have a survivor, tag rules that fail open and the like.
    Lint {
        /// Policy files: a bare policy or InferencePolicy manifests.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Exit non-zero on warnings too (for CI).
        #[arg(long)]
        deny_warnings: bool,
    },
    /// Show how a policy decides one request over a set of candidates.
    Explain {
        #[arg(long)]
        policy: PathBuf,
        /// Request attributes (YAML/JSON); may hold `tags: [...]`.
        #[arg(long)]
        request: PathBuf,
        /// A YAML/JSON list of candidates.
        #[arg(long)]
        candidates: PathBuf,
        #[arg(long, value_enum, default_value_t = Output::Text)]
        output: Output,
        /// Seed for `tieBreak: Random`.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Run a policy's test cases (requests, assumed tags, candidate
    /// snapshots, expected outcomes) and report rule and tier coverage.
    Test {
        policy: PathBuf,
        tests: PathBuf,
        /// Seed for `tieBreak: Random`.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Decide every record of an EPP decision log again under a policy and
    /// report which decisions change, grouped, with examples and cost.
    Replay {
        #[arg(long)]
        policy: PathBuf,
        /// JSON lines written by the EPP's `--decision-log`.
        #[arg(long)]
        log: PathBuf,
    },
    /// Replay a decision log under two policies and report what changes
    /// between them: decisions by (rule, destination kind), examples, the
    /// local and provider shares and the expected cost.
    Diff {
        old: PathBuf,
        new: PathBuf,
        #[arg(long)]
        log: PathBuf,
    },
    /// Print what a cluster admin installs once (equal to the committed
    /// crds/): the CustomResourceDefinition and the ValidatingAdmissionPolicy
    /// that bounds its predicates.
    Crds {
        /// Write the two files of crds/ into this directory instead.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Run the whole request path on loopback (simulated model servers and a
    /// provider, the EPP, a real Envoy), send sample traffic and print
    /// per-rule decisions and latencies. No cluster needed.
    #[cfg(feature = "demo")]
    Demo {
        /// Requests to send [default: 300; 40 with --quick].
        #[arg(long)]
        requests: Option<usize>,
        /// Requests in flight at most [default: 24; 8 with --quick].
        #[arg(long)]
        concurrency: Option<usize>,
        /// A policy file to run instead of the embedded default.
        #[arg(long)]
        policy: Option<PathBuf>,
        /// A tiny, fast run (for tests and a first look).
        #[arg(long)]
        quick: bool,
        /// Multiplier of every simulated delay [default: 1; 0.2 with --quick].
        #[arg(long)]
        time_scale: Option<f64>,
        /// Seed of the sample workload.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Write the EPP's decision log here (JSON lines, as the EPP's
        /// `--decision-log` does), for `kinference replay` and `diff`.
        #[arg(long, value_name = "PATH")]
        decision_log: Option<PathBuf>,
        /// Print the embedded default policy and exit.
        #[arg(long)]
        print_policy: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Text,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Lint {
            files,
            deny_warnings,
        } => lint::run(&files, deny_warnings),
        Command::Test {
            policy,
            tests,
            seed,
        } => policy_tests::run(&policy, &tests, seed),
        Command::Explain {
            policy,
            request,
            candidates,
            output,
            seed,
        } => explain::run(
            &policy,
            &request,
            &candidates,
            matches!(output, Output::Json),
            seed,
        ),
        Command::Replay { policy, log } => replay::run_replay(&policy, &log),
        Command::Diff { old, new, log } => replay::run_diff(&old, &new, &log),
        Command::Crds { dir } => write_crds(dir.as_deref()),
        #[cfg(feature = "demo")]
        Command::Demo {
            print_policy: true, ..
        } => {
            print!("{}", demo::DEFAULT_POLICY);
            Ok(true)
        }
        #[cfg(feature = "demo")]
        Command::Demo {
            requests,
            concurrency,
            policy,
            quick,
            time_scale,
            seed,
            decision_log,
            print_policy: false,
        } => demo::run(demo::Options {
            requests,
            concurrency,
            policy,
            quick,
            time_scale,
            seed,
            decision_log,
        }),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// The CRD and its admission policy: printed, or written as crds/ holds them.
fn write_crds(dir: Option<&std::path::Path>) -> anyhow::Result<bool> {
    let files = [
        (
            "inferencepolicies.kinference.io.yaml",
            kinference_api::crd_yaml(),
        ),
        (
            "inferencepolicies.kinference.io-admission.yaml",
            kinference_api::admission_yaml(),
        ),
    ];
    match dir {
        None => files.iter().for_each(|(_, text)| print!("{text}")),
        Some(dir) => {
            for (name, text) in &files {
                let path = dir.join(name);
                std::fs::write(&path, text)
                    .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
            }
        }
    }
    Ok(true)
}
