//! `kinference`: lint and explain policies, print the CRDs, run the demo.
#![forbid(unsafe_code)]

mod explain;
mod lint;

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
    /// Compile policies offline and report every error with its path and line.
    Lint {
        /// Policy files: a bare policy or InferencePolicy manifests.
        #[arg(required = true)]
        files: Vec<PathBuf>,
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
    /// Print the CustomResourceDefinitions (equal to the committed crds/).
    Crds,
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Text,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Lint { files } => lint::run(&files),
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
        Command::Crds => {
            print!("{}", kinference_api::crd_yaml());
            Ok(true)
        }
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
