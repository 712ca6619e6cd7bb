//! The decision log (`--decision-log`): one JSON line per sampled decision,
//! in the format `kinference replay` and `kinference diff` read. Off by
//! default.
//!
//! The request path samples, serializes the record (a sampled decision's
//! only extra cost) and hands the line over; a thread of its own writes, so
//! a slow disk never delays a decision. Lines waiting for that thread are
//! capped at [`QUEUE`] lines and [`QUEUE_BYTES`] bytes, whatever the pool's
//! size; past either, new records are dropped and counted
//! (`kinference_epp_decision_log_dropped_total`).
//!
//! A file log can be bounded (`--decision-log-max-bytes`): at half the bound
//! the file becomes `<path>.1` (replacing the previous one) and a new file
//! starts, so the two never hold more than the bound together.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use kinference_policy::eval::DecisionRecord;
use prometheus_client::metrics::counter::Counter;

/// Lines waiting for the writer, at most.
pub(crate) const QUEUE: usize = 4096;
/// Bytes waiting for the writer, at most.
pub(crate) const QUEUE_BYTES: usize = 16 << 20;

/// Where the log goes.
#[derive(Clone, Debug, PartialEq)]
pub enum LogTarget {
    /// Shared with the EPP's own logs: each record is written as one whole
    /// line, and `kinference replay` skips the log lines.
    Stdout,
    /// Appended to.
    File(PathBuf),
}

impl LogTarget {
    /// `-` is standard output; anything else a file path.
    pub fn parse(s: &str) -> Self {
        if s == "-" {
            LogTarget::Stdout
        } else {
            LogTarget::File(s.into())
        }
    }
}

pub struct DecisionLog {
    tx: SyncSender<String>,
    queued_bytes: Arc<AtomicUsize>,
    /// Keep a decision with this probability (0 to 1).
    sample: f64,
    dropped: Counter,
}

impl DecisionLog {
    /// Opens `target` and starts the writer thread. A file stays under
    /// `max_bytes` on disk with its one rotated predecessor, if given.
    pub fn start(
        target: &LogTarget,
        sample: f64,
        dropped: Counter,
        max_bytes: Option<u64>,
    ) -> std::io::Result<Self> {
        let out: Output = match target {
            LogTarget::Stdout => Output::Stdout,
            LogTarget::File(path) => Output::File(LogFile::open(path.clone(), max_bytes)?),
        };
        let (tx, rx) = sync_channel(QUEUE);
        let queued_bytes = Arc::new(AtomicUsize::new(0));
        let queued = Arc::clone(&queued_bytes);
        std::thread::Builder::new()
            .name("decision-log".into())
            .spawn(move || write_lines(&rx, out, &queued))?;
        Ok(DecisionLog {
            tx,
            queued_bytes,
            sample: sample.clamp(0.0, 1.0),
            dropped,
        })
    }

    /// Logs the decision `record` builds, if sampled. `record` runs only then.
    pub(crate) fn offer(&self, record: impl FnOnce() -> DecisionRecord) {
        if self.sample < 1.0 && rand::random::<f64>() >= self.sample {
            return;
        }
        let Ok(mut line) = serde_json::to_string(&record()) else {
            self.dropped.inc();
            return;
        };
        line.push('\n');
        let len = line.len();
        if self.queued_bytes.fetch_add(len, Ordering::Relaxed) + len > QUEUE_BYTES {
            self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
            self.dropped.inc();
            return;
        }
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.tx.try_send(line) {
            self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
            self.dropped.inc();
        }
    }
}

enum Output {
    Stdout,
    File(LogFile),
}

/// The log file, rotated at half its bound.
struct LogFile {
    writer: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
    /// Bytes in the current file.
    written: u64,
    /// The current file's size at which it is rotated.
    rotate_at: Option<u64>,
}

impl LogFile {
    fn open(path: PathBuf, max_bytes: Option<u64>) -> std::io::Result<LogFile> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        let written = file.metadata()?.len();
        Ok(LogFile {
            writer: std::io::BufWriter::with_capacity(64 * 1024, file),
            path,
            written,
            rotate_at: max_bytes.map(|m| (m / 2).max(1)),
        })
    }

    fn write_line(&mut self, line: &str) -> std::io::Result<()> {
        let len = line.len() as u64;
        if let Some(limit) = self.rotate_at {
            // A line longer than the limit alone is not kept.
            if len > limit {
                return Ok(());
            }
            if self.written + len > limit {
                self.rotate()?;
            }
        }
        self.writer.write_all(line.as_bytes())?;
        self.written += len;
        Ok(())
    }

    /// The current file becomes `<path>.1`; a new one starts.
    fn rotate(&mut self) -> std::io::Result<()> {
        self.writer.flush()?;
        let mut rotated = self.path.clone().into_os_string();
        rotated.push(".1");
        std::fs::rename(&self.path, &rotated)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        self.writer = std::io::BufWriter::with_capacity(64 * 1024, file);
        self.written = 0;
        Ok(())
    }
}

impl Output {
    /// One whole line: on stdout, in one write under its lock, so the EPP's
    /// own log lines never land inside a record.
    fn write_line(&mut self, line: &str) -> std::io::Result<()> {
        match self {
            Output::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(line.as_bytes())?;
                out.flush()
            }
            Output::File(f) => f.write_line(line),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Output::Stdout => Ok(()),
            Output::File(f) => f.writer.flush(),
        }
    }
}

/// Writes until every sender is gone. Flushes whenever the queue is empty,
/// so a quiet log is on disk within a moment and a busy one is written in
/// large blocks.
fn write_lines(rx: &Receiver<String>, mut out: Output, queued: &AtomicUsize) {
    let mut failing = false;
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        while let Some(line) = next {
            report(&mut failing, out.write_line(&line));
            queued.fetch_sub(line.len(), Ordering::Relaxed);
            next = rx.try_recv().ok();
        }
        report(&mut failing, out.flush());
    }
}

/// Logs the first failure of a run of failures, and the recovery.
fn report(failing: &mut bool, result: std::io::Result<()>) {
    match (result, *failing) {
        (Err(e), false) => {
            tracing::warn!(error = %e, "cannot write the decision log; records are lost until it recovers");
            *failing = true;
        }
        (Ok(()), true) => {
            tracing::info!("the decision log is written again");
            *failing = false;
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(n: usize) -> String {
        format!("{{\"n\":{n},\"pad\":\"{}\"}}\n", "x".repeat(80))
    }

    #[test]
    fn a_bounded_file_rotates_at_half_and_never_holds_more_than_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        let mut log = LogFile::open(path.clone(), Some(2_000)).unwrap();
        for n in 0..100 {
            log.write_line(&line(n)).unwrap();
        }
        log.writer.flush().unwrap();
        let current = std::fs::read_to_string(&path).unwrap();
        let previous = std::fs::read_to_string(dir.path().join("decisions.jsonl.1")).unwrap();
        assert!(current.len() <= 1_000, "{}", current.len());
        assert!(previous.len() <= 1_000, "{}", previous.len());
        // Whole lines, the newest last, the previous file just before them.
        let last: serde_json::Value =
            serde_json::from_str(current.lines().last().unwrap()).unwrap();
        assert_eq!(last["n"], 99);
        let first_now: serde_json::Value =
            serde_json::from_str(current.lines().next().unwrap()).unwrap();
        let last_before: serde_json::Value =
            serde_json::from_str(previous.lines().last().unwrap()).unwrap();
        assert_eq!(
            last_before["n"].as_u64().unwrap() + 1,
            first_now["n"].as_u64().unwrap()
        );
    }

    #[test]
    fn an_unbounded_file_keeps_everything_and_appends_to_what_was_there() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        std::fs::write(&path, line(0)).unwrap();
        let mut log = LogFile::open(path.clone(), None).unwrap();
        for n in 1..50 {
            log.write_line(&line(n)).unwrap();
        }
        log.writer.flush().unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 50);
        assert!(!dir.path().join("decisions.jsonl.1").exists());
    }
}
