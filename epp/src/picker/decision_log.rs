//! The decision log (`--decision-log`): one JSON line per sampled decision,
//! in the format `kinference replay` and `kinference diff` read. Off by
//! default.
//!
//! The request path only samples and hands the record over; a thread of its
//! own serializes and writes, so a slow disk never delays a decision. When
//! that thread falls behind by [`QUEUE`] records, new ones are dropped and
//! counted (`kinference_epp_decision_log_dropped_total`): memory stays
//! bounded whatever the traffic.

use std::io::Write;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use kinference_policy::eval::DecisionRecord;
use prometheus_client::metrics::counter::Counter;

/// Records waiting for the writer, at most.
pub const QUEUE: usize = 4096;

/// Where the log goes.
#[derive(Clone, Debug, PartialEq)]
pub enum LogTarget {
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
    tx: SyncSender<DecisionRecord>,
    /// Keep a decision with this probability (0 to 1).
    sample: f64,
    dropped: Counter,
}

impl DecisionLog {
    /// Opens `target` and starts the writer thread.
    pub fn start(target: &LogTarget, sample: f64, dropped: Counter) -> std::io::Result<Self> {
        let out: Box<dyn Write + Send> = match target {
            LogTarget::Stdout => Box::new(std::io::stdout()),
            LogTarget::File(path) => Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)?,
            ),
        };
        let (tx, rx) = sync_channel(QUEUE);
        std::thread::Builder::new()
            .name("decision-log".into())
            .spawn(move || write_records(&rx, out))?;
        Ok(DecisionLog {
            tx,
            sample: sample.clamp(0.0, 1.0),
            dropped,
        })
    }

    /// Logs the decision `record` builds, if sampled. `record` runs only then.
    pub fn offer(&self, record: impl FnOnce() -> DecisionRecord) {
        if self.sample < 1.0 && rand::random::<f64>() >= self.sample {
            return;
        }
        match self.tx.try_send(record()) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.inc();
            }
        }
    }
}

/// Writes until every sender is gone. Flushes whenever the queue is empty,
/// so a quiet log is on disk within a moment and a busy one is written in
/// large blocks.
fn write_records(rx: &Receiver<DecisionRecord>, out: Box<dyn Write + Send>) {
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, out);
    let mut failing = false;
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        while let Some(record) = next {
            let written = serde_json::to_writer(&mut out, &record)
                .map_err(std::io::Error::other)
                .and_then(|()| out.write_all(b"\n"));
            report(&mut failing, written);
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
