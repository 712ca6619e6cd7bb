//! Supervised background tasks: a task that ends (returns, fails or panics)
//! turns readiness off, is logged once at WARN with its name, and is started
//! again after a jittered exponential backoff; readiness comes back once the
//! new run has lasted [`RestartPolicy::ready_after`].
//!
//! Tasks are given as factories (`Fn() -> Future`), since each run needs its
//! own future built from owned values:
//!
//! ```no_run
//! # async fn watch(_: String) {}
//! # let readiness = kinference_runtime::Readiness::default();
//! let mut tasks = kinference_runtime::Supervisor::new(readiness);
//! let namespace = "default".to_string();
//! tasks.spawn("discovery", move || watch(namespace.clone()));
//! ```

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt::Display;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use backon::{BackoffBuilder as _, ExponentialBackoff, ExponentialBuilder};
use tokio::time::Instant;

use crate::sync::lock;

/// What keeps a process from being ready besides its own conditions: named
/// reasons, set while a supervised task is down. Cheap to clone; clones
/// share the reasons.
#[derive(Clone, Debug, Default)]
pub struct Readiness {
    down: Arc<Mutex<BTreeMap<String, String>>>,
}

impl Readiness {
    /// Not ready until [`Readiness::set_up`] with the same `name`.
    pub fn set_down(&self, name: &str, reason: impl Into<String>) {
        self.lock().insert(name.to_string(), reason.into());
    }

    pub fn set_up(&self, name: &str) {
        self.lock().remove(name);
    }

    pub fn is_down(&self, name: &str) -> bool {
        self.lock().contains_key(name)
    }

    /// Ready: nothing is down.
    pub fn is_ready(&self) -> bool {
        self.lock().is_empty()
    }

    /// Why not ready (every reason, by name, `; `-separated), or `None`.
    pub fn not_ready_reason(&self) -> Option<String> {
        let down = self.lock();
        (!down.is_empty()).then(|| down.values().cloned().collect::<Vec<_>>().join("; "))
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, String>> {
        lock(&self.down)
    }
}

/// When a stopped task is started again, and when it counts as running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Delay before the first restart; each further one doubles it (plus a
    /// random jitter of up to the delay itself).
    pub min_delay: Duration,
    /// The delay stops doubling here.
    pub max_delay: Duration,
    /// A run that lasted this long was healthy: the next delay starts over
    /// from `min_delay`.
    pub reset_after: Duration,
    /// A restarted task counts as running again, and readiness comes back,
    /// once it has run this long.
    pub ready_after: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            min_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(30),
            reset_after: Duration::from_secs(60),
            ready_after: Duration::from_secs(1),
        }
    }
}

impl RestartPolicy {
    fn backoff(&self) -> ExponentialBackoff {
        ExponentialBuilder::new()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay.max(self.min_delay))
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .build()
    }
}

/// A task's result, as the supervisor reports it: `None` for a plain
/// return, else the error.
pub trait TaskExit {
    fn into_error(self) -> Option<String>;
}

impl TaskExit for () {
    fn into_error(self) -> Option<String> {
        None
    }
}

/// Also covers a `JoinHandle`'s (and an [`AbortOnDrop`]'s) result, for
/// factories that spawn their task themselves.
impl<T, E: Display> TaskExit for Result<T, E> {
    fn into_error(self) -> Option<String> {
        self.err().map(|e| format!("{e:#}"))
    }
}

/// A `JoinHandle` that aborts its task when dropped, so a task spawned by
/// a factory stops with its supervisor. Resolves to the task's result.
pub use tokio_util::task::AbortOnDropHandle as AbortOnDrop;

/// Runs named background tasks, restarting each one that stops (see the
/// module docs). Dropping it stops them all.
#[derive(Debug)]
pub struct Supervisor {
    readiness: Readiness,
    policy: RestartPolicy,
    tasks: Vec<(String, AbortOnDrop<()>)>,
}

impl Supervisor {
    /// Supervises tasks with the default [`RestartPolicy`], reporting into
    /// `readiness`.
    pub fn new(readiness: Readiness) -> Self {
        Supervisor {
            readiness,
            policy: RestartPolicy::default(),
            tasks: Vec::new(),
        }
    }

    /// For tasks spawned from now on.
    pub fn with_policy(mut self, policy: RestartPolicy) -> Self {
        self.policy = policy;
        self
    }

    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// Names of the supervised tasks, in the order spawned.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tasks.iter().map(|(name, _)| name.as_str())
    }

    /// Starts `factory()` now and again after each time it stops. `name`
    /// appears in logs and in the readiness reason; it should be unique.
    pub fn spawn<F, Fut>(&mut self, name: &str, factory: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future + Send + 'static,
        Fut::Output: TaskExit + Send + 'static,
    {
        debug_assert!(
            self.names().all(|n| n != name),
            "two supervised tasks named {name}"
        );
        let driver = supervise(
            name.to_string(),
            Arc::new(factory),
            self.readiness.clone(),
            self.policy,
        );
        self.tasks
            .push((name.to_string(), AbortOnDrop::new(tokio::spawn(driver))));
    }

    /// Stops every task (as dropping does).
    pub fn shutdown(self) {}
}

async fn supervise<F, Fut>(
    name: String,
    factory: Arc<F>,
    readiness: Readiness,
    policy: RestartPolicy,
) where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future + Send + 'static,
    Fut::Output: TaskExit + Send + 'static,
{
    let mut backoff = policy.backoff();
    let mut restarts = 0u64;
    loop {
        let started = Instant::now();
        // The factory runs inside the task too: a panic building the future
        // is a panicking run like any other.
        let mut run = AbortOnDrop::new(tokio::spawn({
            let factory = factory.clone();
            async move { factory().await.into_error() }
        }));
        let result = if readiness.is_down(&name) {
            tokio::select! {
                result = &mut run => result,
                () = tokio::time::sleep(policy.ready_after) => {
                    readiness.set_up(&name);
                    tracing::info!(task = %name, restarts, "background task running again");
                    run.await
                }
            }
        } else {
            run.await
        };
        let ran = started.elapsed();
        let why = match result {
            Ok(None) => "exited".to_string(),
            Ok(Some(error)) => format!("failed: {error}"),
            Err(e) if e.is_panic() => format!("panicked: {}", panic_message(&*e.into_panic())),
            Err(e) => format!("was cancelled: {e}"),
        };
        readiness.set_down(&name, format!("background task {name} {why} (restarting)"));
        if ran >= policy.reset_after {
            backoff = policy.backoff();
        }
        let delay = backoff.next().unwrap_or(policy.max_delay);
        restarts += 1;
        tracing::warn!(
            task = %name,
            reason = %why,
            ran_for = ?ran,
            restart_in = ?delay,
            "background task stopped; not ready until it runs again"
        );
        tokio::time::sleep(delay).await;
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(not a string)")
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::sync::Notify;

    use super::*;

    const POLICY: RestartPolicy = RestartPolicy {
        min_delay: Duration::from_millis(100),
        max_delay: Duration::from_secs(10),
        reset_after: Duration::from_secs(60),
        // Longer than the first delay's jitter, so tests can tell a
        // restarted task from one that is running again.
        ready_after: Duration::from_millis(500),
    };

    fn supervisor() -> Supervisor {
        Supervisor::new(Readiness::default()).with_policy(POLICY)
    }

    /// Lets every task that can run do so, without moving the paused clock.
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_that_exits_is_restarted_with_growing_delays() {
        let starts = Arc::new(Mutex::new(Vec::<Instant>::new()));
        let mut tasks = supervisor();
        tasks.spawn("quitter", {
            let starts = starts.clone();
            move || {
                starts.lock().unwrap().push(Instant::now());
                async {}
            }
        });
        while starts.lock().unwrap().len() < 7 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let starts = starts.lock().unwrap().clone();
        let gaps: Vec<Duration> = starts.windows(2).map(|w| w[1] - w[0]).collect();
        // Delay k is 100 ms * 2^k plus a jitter below that: each one is
        // longer than the one before, and within its bounds (the clock is
        // paused, so nothing else adds to it; sleeps round to the ms).
        for (k, gap) in gaps.iter().enumerate() {
            let base = POLICY.min_delay * 2u32.pow(k as u32);
            assert!(
                *gap >= base && *gap <= base * 2 + Duration::from_millis(1),
                "delay {k} is {gap:?}: {gaps:?}"
            );
        }
        assert!(gaps.windows(2).all(|w| w[1] > w[0]), "{gaps:?}");
        assert!(!tasks.readiness().is_ready());
    }

    #[tokio::test(start_paused = true)]
    async fn delays_stop_growing_at_the_maximum_and_start_over_after_a_healthy_run() {
        let policy = RestartPolicy {
            max_delay: Duration::from_millis(400),
            reset_after: Duration::from_secs(5),
            ..POLICY
        };
        let starts = Arc::new(Mutex::new(Vec::<Instant>::new()));
        let mut tasks = Supervisor::new(Readiness::default()).with_policy(policy);
        tasks.spawn("flaky", {
            let starts = starts.clone();
            move || {
                let run = {
                    let mut s = starts.lock().unwrap();
                    s.push(Instant::now());
                    s.len()
                };
                async move {
                    // The sixth run is healthy for a while before it stops.
                    if run == 6 {
                        tokio::time::sleep(Duration::from_secs(10)).await;
                    }
                }
            }
        });
        while starts.lock().unwrap().len() < 8 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let starts = starts.lock().unwrap().clone();
        let gaps: Vec<Duration> = starts.windows(2).map(|w| w[1] - w[0]).collect();
        let ms = Duration::from_millis;
        // 100, 200, 400, then capped at 400 (each plus a jitter below
        // that); the healthy 10 s run, then 100 and 200 again.
        for k in [2, 3, 4] {
            assert!(gaps[k] >= ms(400) && gaps[k] <= ms(801), "{gaps:?}");
        }
        let after_healthy = gaps[5] - Duration::from_secs(10);
        assert!(
            after_healthy >= ms(100) && after_healthy <= ms(201),
            "{gaps:?}"
        );
        assert!(gaps[6] >= ms(200) && gaps[6] <= ms(401), "{gaps:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn readiness_is_off_while_a_task_is_down_and_back_once_it_runs_again() {
        let stop = Arc::new(Notify::new());
        let runs = Arc::new(AtomicUsize::new(0));
        let mut tasks = supervisor();
        tasks.spawn("discovery", {
            let (stop, runs) = (stop.clone(), runs.clone());
            move || {
                runs.fetch_add(1, Ordering::SeqCst);
                let stop = stop.clone();
                async move { stop.notified().await }
            }
        });
        settle().await;
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        let readiness = tasks.readiness().clone();
        assert!(
            readiness.is_ready(),
            "a task starting does not block readiness"
        );

        stop.notify_one();
        settle().await;
        assert!(!readiness.is_ready());
        let why = readiness.not_ready_reason().unwrap();
        assert!(why.contains("discovery") && why.contains("exited"), "{why}");

        // Restarted after the first delay (100-200 ms), ...
        tokio::time::sleep(Duration::from_millis(201)).await;
        settle().await;
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        // ... but not ready until it has been running for `ready_after`.
        assert!(!readiness.is_ready());
        tokio::time::sleep(POLICY.ready_after).await;
        settle().await;
        assert!(readiness.is_ready(), "{:?}", readiness.not_ready_reason());
        assert_eq!(readiness.not_ready_reason(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicking_task_is_restarted_too() {
        let runs = Arc::new(AtomicUsize::new(0));
        let mut tasks = supervisor();
        tasks.spawn("scraper", {
            let runs = runs.clone();
            move || {
                let run = runs.fetch_add(1, Ordering::SeqCst);
                async move {
                    if run == 0 {
                        panic!("scraper blew up");
                    }
                    std::future::pending::<()>().await
                }
            }
        });
        settle().await;
        let readiness = tasks.readiness().clone();
        let why = readiness.not_ready_reason().expect("down after the panic");
        assert!(
            why.contains("scraper") && why.contains("panicked: scraper blew up"),
            "{why}"
        );
        tokio::time::sleep(Duration::from_millis(201) + POLICY.ready_after).await;
        settle().await;
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        assert!(readiness.is_ready(), "{:?}", readiness.not_ready_reason());
    }

    #[tokio::test(start_paused = true)]
    async fn a_factory_that_panics_or_a_task_that_fails_is_reported() {
        let runs = Arc::new(AtomicUsize::new(0));
        let readiness = Readiness::default();
        let mut tasks = Supervisor::new(readiness.clone()).with_policy(POLICY);
        tasks.spawn("builder", {
            let runs = runs.clone();
            move || {
                if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                    panic!("no client");
                }
                std::future::pending::<()>()
            }
        });
        tasks.spawn("watch", || async { Err::<(), _>("watch stream ended") });
        settle().await;
        let why = readiness.not_ready_reason().unwrap();
        assert!(why.contains("builder panicked: no client"), "{why}");
        assert!(why.contains("watch failed: watch stream ended"), "{why}");
        tokio::time::sleep(Duration::from_secs(1)).await;
        settle().await;
        let why = readiness.not_ready_reason().unwrap();
        assert!(!why.contains("builder"), "{why}");
        assert!(why.contains("watch"), "{why}");
    }

    #[tokio::test(start_paused = true)]
    async fn spawned_handles_report_and_everything_stops_with_the_supervisor() {
        struct Flag(Arc<AtomicUsize>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(AtomicUsize::new(0));
        let mut tasks = supervisor();
        // A factory spawning its own task, as the EPP's scraper does.
        tasks.spawn("spawned", {
            let dropped = dropped.clone();
            move || {
                let flag = Flag(dropped.clone());
                AbortOnDrop::new(tokio::spawn(async move {
                    let _flag = flag;
                    std::future::pending::<()>().await
                }))
            }
        });
        settle().await;
        assert_eq!(tasks.names().collect::<Vec<_>>(), ["spawned"]);
        assert_eq!(dropped.load(Ordering::SeqCst), 0);
        tasks.shutdown();
        settle().await;
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            1,
            "the inner task was aborted"
        );
    }
}
