//! The bookkeeping of one closed-loop phase, shared by its client tasks.
//!
//! Each client takes its requests from [`Phase::next`] until there are none
//! left. The first `warmup` requests are not measured; the clocks are read
//! when the first measured request is handed out, and again by
//! [`Phase::join`] once every client has stopped. Throughput counts only the
//! steady state: from the end of the warm-up until the first client found no
//! request left, so neither the ramp-up nor the ramp-down (fewer clients than
//! the concurrency) counts.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

use super::cpu::{Clocks, Cpu, Mark};
use super::stats::{PhaseSpec, Tally};

/// One phase in progress; share it between the clients (`Arc`).
#[derive(Debug)]
pub struct Phase<const N: usize> {
    next: AtomicU64,
    completed: AtomicU64,
    warmup: u64,
    total: u64,
    deadline: Instant,
    truncated: AtomicBool,
    clocks: Clocks<N>,
    measured_from: Mutex<Option<Mark<N>>>,
    first_exit: Mutex<Option<(Instant, u64)>>,
}

/// A request handed to a client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Turn {
    pub id: u64,
    /// Past the warm-up: report its end with [`Phase::completed`] and keep
    /// its outcome.
    pub measured: bool,
}

/// What each client task of a phase returns, merged by [`Phase::join`].
pub trait Outcome: Default {
    fn tally(&mut self) -> &mut Tally;
    /// Adds another client's outcome.
    fn merge(&mut self, other: Self);
}

impl<const N: usize> Phase<N> {
    /// A phase of `spec` (its time cap starts now) whose CPU is read from
    /// `clocks`.
    pub fn new(spec: &PhaseSpec, clocks: Clocks<N>) -> Self {
        Phase {
            next: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            warmup: spec.warmup,
            total: spec.warmup + spec.requests,
            deadline: Instant::now() + spec.max_time,
            truncated: AtomicBool::new(false),
            clocks,
            measured_from: Mutex::new(None),
            first_exit: Mutex::new(None),
        }
    }

    /// The calling client's next request; `None` when every request has been
    /// handed out or the time cap passed (the phase is then truncated).
    pub fn next(&self) -> Option<Turn> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        if id >= self.total {
            self.first_exit
                .lock()
                .unwrap()
                .get_or_insert_with(|| (Instant::now(), self.completed.load(Ordering::Relaxed)));
            return None;
        }
        if Instant::now() > self.deadline {
            self.truncated.store(true, Ordering::Relaxed);
            return None;
        }
        if id == self.warmup {
            *self.measured_from.lock().unwrap() = Some(self.clocks.mark());
        }
        Some(Turn {
            id,
            measured: id >= self.warmup,
        })
    }

    /// A measured request has ended (answered or failed).
    pub fn completed(&self) {
        self.completed.fetch_add(1, Ordering::Relaxed);
    }

    /// Waits for the client tasks and merges their outcomes (a task that
    /// failed counts as an error) with the latencies sorted; then reads the
    /// clocks for the measured window.
    pub async fn join<R: Outcome>(&self, tasks: Vec<JoinHandle<R>>) -> (R, Window<N>) {
        let mut result = R::default();
        for t in tasks {
            match t.await {
                Ok(r) => result.merge(r),
                Err(e) => result.tally().error(e),
            }
        }
        result.tally().sort();
        (result, self.finish())
    }

    /// Reads the clocks at the end of the phase, after every client stopped:
    /// the measured window (zero when the warm-up never ended).
    pub fn finish(&self) -> Window<N> {
        let end = self.clocks.mark();
        let truncated = self.truncated.load(Ordering::Relaxed);
        let Some(start) = *self.measured_from.lock().unwrap() else {
            return Window {
                truncated,
                ..Window::default()
            };
        };
        Window {
            elapsed: end.at - start.at,
            cpu: Cpu::between(&start, &end),
            steady: self
                .first_exit
                .lock()
                .unwrap()
                .map(|(at, n)| (n, at.saturating_duration_since(start.at))),
            truncated,
        }
    }
}

/// The measured part of a phase, from the end of the warm-up to the end.
#[derive(Clone, Copy, Debug)]
pub struct Window<const N: usize> {
    pub elapsed: Duration,
    pub cpu: Cpu<N>,
    /// Completions and time from the end of the warm-up until the first
    /// client found no request left.
    pub steady: Option<(u64, Duration)>,
    /// The time cap cut the phase short.
    pub truncated: bool,
}

impl<const N: usize> Default for Window<N> {
    fn default() -> Self {
        Window {
            elapsed: Duration::ZERO,
            cpu: Cpu::default(),
            steady: None,
            truncated: false,
        }
    }
}

impl<const N: usize> Window<N> {
    /// Completions per second in the steady state; `measured` requests over
    /// the whole window when there was none (every client hit the time cap).
    pub fn rps(&self, measured: u64) -> f64 {
        match self.steady {
            Some((n, d)) if n > 0 => n as f64 / d.as_secs_f64().max(1e-9),
            _ => measured as f64 / self.elapsed.as_secs_f64().max(1e-9),
        }
    }

    /// Cores that `cpu` kept busy on average over the window.
    pub fn cores(&self, cpu: Duration) -> f64 {
        cpu.as_secs_f64() / self.elapsed.as_secs_f64().max(1e-9)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn spec(warmup: u64, requests: u64, max_time: Duration) -> PhaseSpec {
        PhaseSpec {
            concurrency: 1,
            warmup,
            requests,
            max_time,
        }
    }

    #[test]
    fn warm_up_then_measured_then_done() {
        let phase = Phase::new(&spec(2, 3, Duration::from_secs(60)), Clocks::new([]));
        let mut turns = Vec::new();
        while let Some(t) = phase.next() {
            turns.push(t);
            if t.measured {
                phase.completed();
            }
        }
        let turn = |id, measured| Turn { id, measured };
        assert_eq!(
            turns,
            [
                turn(0, false),
                turn(1, false),
                turn(2, true),
                turn(3, true),
                turn(4, true)
            ]
        );
        // A second client runs out too; the steady state ended at the first.
        assert_eq!(phase.next(), None);
        let window = phase.finish();
        let (n, steady) = window.steady.unwrap();
        assert_eq!(n, 3);
        assert!(steady <= window.elapsed);
        assert!(!window.truncated);
        assert!(window.rps(3) > 0.0);
    }

    #[test]
    fn the_time_cap_truncates() {
        let phase = Phase::new(&spec(0, 10, Duration::ZERO), Clocks::new([]));
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(phase.next(), None);
        // The warm-up never ended: nothing was measured.
        let window = phase.finish();
        assert!(window.truncated);
        assert_eq!(window.elapsed, Duration::ZERO);
        assert_eq!(window.steady, None);
        assert_eq!(window.rps(0), 0.0);
    }

    #[derive(Default)]
    struct Seen {
        tally: Tally,
        clients: u32,
    }

    impl Outcome for Seen {
        fn tally(&mut self) -> &mut Tally {
            &mut self.tally
        }

        fn merge(&mut self, other: Self) {
            self.tally.merge(other.tally);
            self.clients += other.clients;
        }
    }

    #[test]
    fn join_merges_the_clients() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let phase = Arc::new(Phase::new(
            &spec(1, 6, Duration::from_secs(60)),
            Clocks::new([]),
        ));
        let (seen, window) = rt.block_on(async {
            let mut tasks = Vec::new();
            for client in 0..3u64 {
                let phase = phase.clone();
                tasks.push(tokio::spawn(async move {
                    let mut out = Seen {
                        clients: 1,
                        ..Seen::default()
                    };
                    while let Some(t) = phase.next() {
                        tokio::task::yield_now().await;
                        if t.measured {
                            phase.completed();
                            out.tally
                                .latencies
                                .push(Duration::from_millis(10 * t.id + client));
                        }
                    }
                    out
                }));
            }
            tasks.push(tokio::spawn(async { panic!("a client failed") }));
            phase.join(tasks).await
        });
        assert_eq!(seen.clients, 3);
        assert_eq!(seen.tally.latencies.len(), 6);
        assert!(seen.tally.latencies.is_sorted());
        assert_eq!(seen.tally.errors, 1);
        assert!(seen.tally.first_error.unwrap().contains("panicked"));
        // Requests still in flight when the first client ran out end after
        // the steady state.
        assert!(window.steady.is_some_and(|(n, _)| (4..=6).contains(&n)));
    }

    #[test]
    fn throughput_prefers_the_steady_state() {
        let mut window = Window::<0> {
            elapsed: Duration::from_secs(4),
            ..Window::default()
        };
        assert_eq!(window.rps(100), 25.0);
        window.steady = Some((90, Duration::from_secs(2)));
        assert_eq!(window.rps(100), 45.0);
        window.steady = Some((0, Duration::ZERO));
        assert_eq!(window.rps(100), 25.0);
        assert_eq!(window.cores(Duration::from_secs(2)), 0.5);
    }
}
