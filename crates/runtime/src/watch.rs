//! Kubernetes watches that come back within seconds after an API-server
//! outage, and that say so once per change of state, not once per retry.
//!
//! kube's default watch backoff (client-go's: 0.8 s doubling to 30 s, reset
//! only after 120 s without an error) leaves every watch asleep for up to
//! 30 s when the API server returns after a long outage; an edit made then
//! went unnoticed for 27 s. A low cap costs a dead API server one cheap
//! refused connection per watch every 2 s.

use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::runtime::watcher;

/// Exponential backoff from 250 ms to 1 s, each delay plus up to as much
/// again of jitter (backon's), so at most 2 s; reset by every event the
/// watch delivers (see `WatchStreamExt::backoff`).
pub fn watch_backoff() -> watcher::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(250))
        .with_max_delay(Duration::from_secs(1))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .into()
}

/// Passes on a watch's events and drops its errors (its backoff paces the
/// retries), logging the first error of an outage at WARN and the recovery
/// at INFO; the retries in between only at DEBUG.
pub fn log_outages<T: Send + 'static>(
    kind: impl Into<String>,
    stream: impl Stream<Item = Result<T, watcher::Error>> + Send + 'static,
) -> impl Stream<Item = Result<T, watcher::Error>> + Send + 'static {
    let kind = kind.into();
    let mut failing = false;
    stream.filter_map(move |item| {
        let passed = match item {
            Ok(event) => {
                if std::mem::take(&mut failing) {
                    tracing::info!(kind = %kind, "watch recovered");
                }
                Some(Ok(event))
            }
            Err(error) if failing => {
                tracing::debug!(kind = %kind, %error, "watch still failing");
                None
            }
            Err(error) => {
                failing = true;
                tracing::warn!(kind = %kind, %error, "watch failed; retrying every 2 s at most until it recovers");
                None
            }
        };
        futures::future::ready(passed)
    })
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use kube::runtime::utils::Backoff;

    use super::*;

    #[test]
    fn the_backoff_stays_low_and_starts_over_on_reset() {
        let mut backoff = watch_backoff();
        let delays: Vec<Duration> = (0..50).map(|_| backoff.next().unwrap()).collect();
        assert!(
            delays.iter().all(|d| *d <= Duration::from_secs(2)),
            "{delays:?}"
        );
        assert!(delays[40] >= Duration::from_secs(1), "{delays:?}");
        backoff.reset();
        assert!(backoff.next().unwrap() <= Duration::from_millis(500));
    }

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn failure() -> watcher::Error {
        watcher::Error::NoResourceVersion
    }

    #[test]
    fn an_outage_is_logged_once_and_its_end_once() {
        let logs = Captured::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .finish();
        let passed: Vec<u32> = tracing::subscriber::with_default(subscriber, || {
            let items = vec![
                Err(failure()),
                Err(failure()),
                Err(failure()),
                Ok(1),
                Ok(2),
                Err(failure()),
                Ok(3),
            ];
            futures::executor::block_on(
                log_outages("Pod", futures::stream::iter(items))
                    .map(Result::unwrap)
                    .collect(),
            )
        });
        assert_eq!(passed, [1, 2, 3]);
        let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.matches("watch failed").count(), 2, "{text}");
        assert_eq!(text.matches("watch recovered").count(), 2, "{text}");
        assert!(!text.contains("still failing"), "{text}");
    }
}
