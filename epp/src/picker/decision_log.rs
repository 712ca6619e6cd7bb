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

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use kinference_policy::eval::DecisionRecord;
use prometheus_client::metrics::counter::Counter;

/// Lines waiting for the writer, at most.
pub const QUEUE: usize = 4096;
/// Bytes waiting for the writer, at most.
pub const QUEUE_BYTES: usize = 16 << 20;

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
    /// Opens `target` and starts the writer thread.
    pub fn start(target: &LogTarget, sample: f64, dropped: Counter) -> std::io::Result<Self> {
        let out: Output = match target {
            LogTarget::Stdout => Output::Stdout,
            LogTarget::File(path) => Output::File(std::io::BufWriter::with_capacity(
                64 * 1024,
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)?,
            )),
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
    pub fn offer(&self, record: impl FnOnce() -> DecisionRecord) {
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
    File(std::io::BufWriter<std::fs::File>),
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
            Output::File(f) => f.write_all(line.as_bytes()),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Output::Stdout => Ok(()),
            Output::File(f) => f.flush(),
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
