//! The operator's stop signal: one trigger, any number of holders.

use tokio::sync::watch;

/// Receiving end of a stop signal; cheap to clone.
#[derive(Clone, Debug)]
pub struct Shutdown {
    rx: watch::Receiver<bool>,
}

/// Sending end: [`ShutdownTrigger::trigger`] (or dropping it) stops every
/// holder of the paired [`Shutdown`].
#[derive(Debug)]
pub struct ShutdownTrigger {
    tx: watch::Sender<bool>,
}

/// A new stop signal.
pub fn shutdown_channel() -> (ShutdownTrigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (ShutdownTrigger { tx }, Shutdown { rx })
}

impl ShutdownTrigger {
    pub fn trigger(&self) {
        self.tx.send_replace(true);
    }
}

impl Shutdown {
    /// Resolves once triggered (or once the trigger is dropped: an owner
    /// that went away cannot stop us any more, so we stop).
    pub async fn wait(&self) {
        let mut rx = self.rx.clone();
        let _ = rx.wait_for(|stop| *stop).await;
    }

    pub fn is_triggered(&self) -> bool {
        *self.rx.borrow() || self.rx.has_changed().is_err()
    }
}
