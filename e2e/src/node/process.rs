//! Child processes of the node: started under `setpriv --pdeathsig KILL`
//! (they die with the test process even when it is killed without
//! unwinding), logging to a file, killed and reaped on drop.

use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

/// Lines of a component's log quoted in errors.
pub(crate) const LOG_TAIL_LINES: usize = 40;

pub(crate) struct NodeProcess {
    name: String,
    child: Child,
    log_path: PathBuf,
}

impl NodeProcess {
    pub(crate) fn spawn(name: &str, bin: &Path, args: &[String], log_path: &Path) -> Result<Self> {
        if let Some(parent) = log_path.parent() {
            fs::create_dir_all(parent)?;
        }
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)
            .with_context(|| format!("opening {}", log_path.display()))?;
        writeln!(log, "==== starting {} {}", bin.display(), args.join(" "))?;
        let child = Command::new("setpriv")
            .args(["--pdeathsig", "KILL", "--"])
            .arg(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawning {name} ({})", bin.display()))?;
        Ok(Self {
            name: name.to_owned(),
            child,
            log_path: log_path.to_owned(),
        })
    }

    pub(crate) fn log_path(&self) -> &Path {
        &self.log_path
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// An error with the log tail if the process has exited.
    pub(crate) fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.exited() {
            bail!(
                "{} exited with {status}; last log lines ({}):\n{}",
                self.name,
                self.log_path.display(),
                log_tail(&self.log_path, LOG_TAIL_LINES)
            );
        }
        Ok(())
    }

    /// SIGTERM, wait up to `grace`, then SIGKILL; always reaped.
    pub(crate) fn stop(&mut self, grace: Duration) {
        if self.exited().is_none() {
            signal(self.child.id(), "TERM");
            let deadline = Instant::now() + grace;
            while self.exited().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.kill();
    }

    pub(crate) fn kill(&mut self) {
        if self.exited().is_none() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `kill -<sig> <pid>`, ignoring failures (the process may be gone).
pub(crate) fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// The last `lines` lines of a log file, indented.
pub(crate) fn log_tail(path: &Path, lines: usize) -> String {
    let text = fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|l| format!("    {l}\n"))
        .collect()
}

/// Run a command to completion; an error carries its stderr.
pub(crate) fn run(program: &str, args: &[&str]) -> Result<String> {
    run_with_stdin(program, args, Stdio::null())
}

/// [`run`] with `stdin` as the command's standard input (a file).
pub(crate) fn run_with_stdin(
    program: &str,
    args: &[&str],
    stdin: impl Into<Stdio>,
) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .stdin(stdin)
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "`{program} {}` failed with {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
