//! How quiet the operator is at scale: its release binary against
//! a real kube-apiserver with an audit log, `--policies` InferencePolicies
//! over `--namespaces` namespaces, in two runs on fresh clusters:
//!
//! - ready: the bench plays every EPP (Pod, available replica, report of the
//!   loaded policy) as the operator creates them; measured are the time from
//!   the first create until every policy is Ready for its generation, the
//!   operator's requests, CPU and peak RSS until then, and its request rate
//!   over an idle window afterwards;
//! - unready: no EPP ever becomes available; measured the same until every
//!   policy is Accepted and not Ready, then the idle request rate.
//!
//! Requests are the operator's own (it runs as its ServiceAccount, under the
//! shipped RBAC, and the audit log names it), watches counted apart. Targets
//! are printed next to the figures, not asserted. Prints a markdown report.
//!
//! ```sh
//! cargo build --release -p kinference-operator --locked
//! KINFERENCE_K8S_BIN_DIR=... cargo bench -p kinference-e2e --bench operator_scale \
//!     -- --policies 100 --namespaces 10 --idle-seconds 20
//! ```

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, Result, ensure};
use clap::{Parser, ValueEnum};
use k8s_openapi::jiff::Timestamp;
use kinference_api::InferencePolicy;
use kinference_e2e::cluster::{K8S_VERSION, StartOptions, TestCluster};
use kinference_e2e::scale::{
    self, Layout, OPERATOR_USER, OperatorProcess, RequestCounts, Usage, read_audit_log,
};

/// After convergence, before the idle window: the Events and last status
/// writes of the final reconciles belong to neither.
const SETTLE: Duration = Duration::from_secs(5);

#[derive(Debug, Parser)]
struct Args {
    /// InferencePolicies to create.
    #[arg(long, env = "KINFERENCE_SCALE_POLICIES", default_value_t = 1000)]
    policies: usize,
    /// Namespaces to spread them over (round-robin).
    #[arg(long, env = "KINFERENCE_SCALE_NAMESPACES", default_value_t = 50)]
    namespaces: usize,
    /// Length of each idle window.
    #[arg(long, env = "KINFERENCE_SCALE_IDLE_SECONDS", default_value_t = 60)]
    idle_seconds: u64,
    /// Give up on convergence after this long.
    #[arg(long, env = "KINFERENCE_SCALE_TIMEOUT_SECONDS", default_value_t = 1800)]
    timeout_seconds: u64,
    /// Which runs to make.
    #[arg(long, value_enum, default_value_t = Runs::Both)]
    runs: Runs,
    /// The operator binary (default: target/release/kinference-operator).
    #[arg(long, env = "KINFERENCE_OPERATOR_BIN")]
    operator_bin: Option<PathBuf>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Runs {
    Ready,
    Unready,
    Both,
}

/// Whether the bench makes the EPPs serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Epps {
    Ready,
    Unready,
}

/// What one run measured.
struct Run {
    epps: Epps,
    /// First create until every policy is done (Ready, or Accepted and not Ready).
    convergence: Duration,
    first: RequestCounts,
    first_usage: Usage,
    first_reconciles: u64,
    idle: RequestCounts,
    idle_window: Duration,
    idle_cpu_seconds: f64,
    idle_reconciles: u64,
    peak_rss_bytes: u64,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.policies > 0 && args.namespaces > 0,
        "--policies and --namespaces must be positive"
    );
    let binary = operator_binary(args.operator_bin.clone())?;
    warn_if_stale(&binary);
    // Now: others may commit while the bench runs.
    let revision = git_revision();
    let layout = Layout {
        policies: args.policies,
        namespaces: args.namespaces,
    };
    let mut runs = Vec::new();
    for epps in [Epps::Ready, Epps::Unready] {
        let wanted = match epps {
            Epps::Ready => args.runs != Runs::Unready,
            Epps::Unready => args.runs != Runs::Ready,
        };
        if wanted {
            eprintln!("run with EPPs {epps:?}: {layout:?}");
            runs.push(run(&args, &layout, &binary, epps).await?);
        }
    }
    print_report(&layout, &binary, &revision, &runs);
    Ok(())
}

/// One fresh cluster: create the policies, wait for convergence, then idle.
async fn run(args: &Args, layout: &Layout, binary: &Path, epps: Epps) -> Result<Run> {
    let cluster = TestCluster::start_with(StartOptions {
        audit_log: true,
        ..StartOptions::default()
    })
    .await?;
    let admin = cluster.client();
    scale::install_operator_rbac(&admin).await?;
    scale::create_namespaces(&admin, layout).await?;
    let kubeconfig = scale::impersonating_kubeconfig(&cluster, OPERATOR_USER)?;
    let log = cluster.dir().join("logs/operator.log");
    let operator = OperatorProcess::start(binary, &kubeconfig, &log).await?;
    let spec = scale::policy_spec();
    let hash = scale::policy_hash(&spec)?;
    let _player = (epps == Epps::Ready).then(|| scale::play_epps(admin.clone(), hash));

    let (start, started) = (Timestamp::now(), Instant::now());
    scale::create_policies(&admin, layout, &spec).await?;
    let done: fn(&InferencePolicy) -> bool = match epps {
        Epps::Ready => scale::is_ready,
        Epps::Unready => scale::is_accepted_not_ready,
    };
    let timeout = Duration::from_secs(args.timeout_seconds);
    scale::wait_all(&admin, layout.policies, timeout, done)
        .await
        .with_context(|| format!("operator log: {}", log.display()))?;
    let (converged, convergence) = (Timestamp::now(), started.elapsed());
    let first_usage = operator.usage()?;
    let first_reconciles = operator.reconciles().await?;
    eprintln!("  converged in {convergence:.1?}; idling");

    tokio::time::sleep(SETTLE).await;
    let (idle_start, idle_started) = (Timestamp::now(), Instant::now());
    let (idle_usage, idle_reconciles) = (operator.usage()?, operator.reconciles().await?);
    tokio::time::sleep(Duration::from_secs(args.idle_seconds)).await;
    let (idle_end, idle_window) = (Timestamp::now(), idle_started.elapsed());
    let end_usage = operator.usage()?;
    let end_reconciles = operator.reconciles().await?;

    let events = read_audit_log(&cluster.audit_log_path())?;
    Ok(Run {
        epps,
        convergence,
        first: RequestCounts::of(&events, OPERATOR_USER, start, converged),
        first_usage,
        first_reconciles,
        idle: RequestCounts::of(&events, OPERATOR_USER, idle_start, idle_end),
        idle_window,
        idle_cpu_seconds: end_usage.cpu_seconds - idle_usage.cpu_seconds,
        idle_reconciles: end_reconciles - idle_reconciles,
        peak_rss_bytes: end_usage.peak_rss_bytes,
    })
}

/// `--operator-bin`, else the release binary in the workspace's target dir.
fn operator_binary(explicit: Option<PathBuf>) -> Result<PathBuf> {
    let binary = explicit.unwrap_or_else(|| {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| workspace_root().join("target"));
        target.join("release/kinference-operator")
    });
    ensure!(
        binary.is_file(),
        "no operator binary at {}: run `cargo build --release -p kinference-operator --locked` \
         first (cargo bench cannot build it: it holds the build lock)",
        binary.display()
    );
    Ok(binary)
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_owned)
}

/// A binary older than the operator's sources measures old code: say so.
fn warn_if_stale(binary: &Path) {
    let built = modified(binary);
    let newest = newest_file(&workspace_root().join("operator/src"));
    if let (Some(built), Some((newest, path))) = (built, newest)
        && newest > built
    {
        eprintln!(
            "WARNING: {} is older than {}; rebuild it to measure the current operator",
            binary.display(),
            path.display()
        );
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    path.metadata().and_then(|m| m.modified()).ok()
}

fn newest_file(dir: &Path) -> Option<(SystemTime, PathBuf)> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let path = entry.path();
            if path.is_dir() {
                newest_file(&path)
            } else {
                Some((modified(&path)?, path))
            }
        })
        .max()
}

// ---------------------------------------------------------------- report

fn print_report(layout: &Layout, binary: &Path, revision: &str, runs: &[Run]) {
    let per_100 = |rate: f64| rate * 100.0 / layout.policies as f64;
    println!(
        "## Operator at scale: {} InferencePolicies in {} namespaces\n",
        layout.policies, layout.namespaces
    );
    println!(
        "Measured {} at {}, binary built {}; kube-apiserver {K8S_VERSION}, {} CPUs. \
         Requests are the operator's own (audit log, user `{OPERATOR_USER}`, shipped RBAC), \
         watches counted apart; idle windows start {} s after convergence.\n",
        Timestamp::now().strftime("%Y-%m-%d %H:%M UTC"),
        revision,
        modified(binary)
            .and_then(|t| Timestamp::try_from(t).ok())
            .map_or_else(
                || "?".into(),
                |t| t.strftime("%Y-%m-%d %H:%M UTC").to_string()
            ),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        SETTLE.as_secs(),
    );
    println!("| EPPs | measured | value | target |");
    println!("|---|---|---:|---|");
    for r in runs {
        let (label, done, first_target, idle_target) = match r.epps {
            Epps::Ready => ("all Ready", "all Ready", "≤ 15 per policy", "≈ 0 req/s"),
            Epps::Unready => (
                "none Ready",
                "all Accepted, not Ready",
                "",
                "< 1 req/s per 100 policies",
            ),
        };
        let per_policy = |n: u64| n as f64 / layout.policies as f64;
        let idle_rate = r.idle.total() as f64 / r.idle_window.as_secs_f64();
        let rows = [
            (
                format!("time from first create to {done}"),
                format!("{:.1} s", r.convergence.as_secs_f64()),
                "",
            ),
            (
                "requests until then".into(),
                format!(
                    "{} ({:.1} per policy; {} failed)",
                    r.first.total(),
                    per_policy(r.first.total()),
                    r.first.failed
                ),
                first_target,
            ),
            (
                "reconciles until then".into(),
                format!(
                    "{} ({:.1} per policy)",
                    r.first_reconciles,
                    per_policy(r.first_reconciles)
                ),
                "",
            ),
            (
                "watches opened until then".into(),
                r.first.watches.to_string(),
                "",
            ),
            (
                "operator CPU until then".into(),
                format!("{:.1} s", r.first_usage.cpu_seconds),
                "",
            ),
            (
                format!(
                    "idle requests ({:.0} s window)",
                    r.idle_window.as_secs_f64()
                ),
                format!(
                    "{idle_rate:.2} req/s ({:.2} per 100 policies; {} failed)",
                    per_100(idle_rate),
                    r.idle.failed
                ),
                idle_target,
            ),
            (
                "idle reconciles".into(),
                format!(
                    "{:.2} /s",
                    r.idle_reconciles as f64 / r.idle_window.as_secs_f64()
                ),
                "",
            ),
            ("idle watches opened".into(), r.idle.watches.to_string(), ""),
            (
                "idle operator CPU".into(),
                format!(
                    "{:.2} s ({:.1} % of a core)",
                    r.idle_cpu_seconds,
                    100.0 * r.idle_cpu_seconds / r.idle_window.as_secs_f64()
                ),
                "",
            ),
            (
                "operator peak RSS".into(),
                format!("{:.0} MiB", r.peak_rss_bytes as f64 / (1 << 20) as f64),
                "",
            ),
        ];
        for (what, value, target) in rows {
            println!("| {label} | {what} | {value} | {target} |");
        }
    }
    print_breakdown(layout, runs);
}

/// Requests by verb and resource: per policy until convergence, per second
/// while idle; one column pair per run.
fn print_breakdown(layout: &Layout, runs: &[Run]) {
    let mut kinds: Vec<&String> = runs
        .iter()
        .flat_map(|r| r.first.by_kind.keys().chain(r.idle.by_kind.keys()))
        .collect();
    kinds.sort();
    kinds.dedup();
    println!("\nRequests by verb and resource (watches excluded):\n");
    let mut header = "| request |".to_owned();
    let mut rule = "|---|".to_owned();
    for r in runs {
        let label = match r.epps {
            Epps::Ready => "all Ready",
            Epps::Unready => "none Ready",
        };
        header += &format!(" {label}: per policy to converge | {label}: idle req/s |");
        rule += "---:|---:|";
    }
    println!("{header}\n{rule}");
    for kind in kinds {
        let mut row = format!("| {kind} |");
        for r in runs {
            let first = r.first.by_kind.get(kind).copied().unwrap_or(0);
            let idle = r.idle.by_kind.get(kind).copied().unwrap_or(0);
            row += &format!(
                " {:.2} | {:.2} |",
                first as f64 / layout.policies as f64,
                idle as f64 / r.idle_window.as_secs_f64()
            );
        }
        println!("{row}");
    }
}

/// `git describe`-like: the commit, `+dirty` if the operator's sources differ.
fn git_revision() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(workspace_root())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "?".into());
    let dirty =
        git(&["status", "--porcelain", "--", "operator", "crates"]).is_some_and(|s| !s.is_empty());
    format!(
        "commit {commit}{}",
        if dirty {
            " (+ uncommitted operator changes)"
        } else {
            ""
        }
    )
}
