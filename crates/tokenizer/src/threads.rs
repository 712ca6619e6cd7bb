//! The threads prompts are tokenized on.
//!
//! A tokenization that outlives its budget runs on, since its ids are kept
//! for the prompt's next sighting, but no request waits for it any more, so
//! its thread is lowered ([`OVERTIME_NICE_STEPS`]) until it ends: the EPP's
//! request path comes first (and, where they share the EPP's CPU cgroup,
//! other processes; a Pod has one of its own). Without privileges a thread
//! cannot be raised back (and a thread it started would start as low), so
//! a lowered thread ends with its job, and a new one, started by the caller
//! that lowered it, takes its place. A lowered job keeps its tokenizer slot
//! until it ends: on a busy machine, longer than it would have.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// How much nicer work past its budget runs than the EPP (up to nice 19):
/// about a tenth of a thread's share of a contended core (CFS weights fall
/// about 1.25× a step).
pub const OVERTIME_NICE_STEPS: i32 = 10;

type Job = Box<dyn FnOnce() + Send>;

type Queue = Arc<Mutex<Receiver<(Job, Arc<Running>)>>>;

/// A fixed number of threads taking jobs in turn.
pub struct TokenizePool {
    jobs: Sender<(Job, Arc<Running>)>,
    queue: Queue,
    /// Its threads' name.
    name: &'static str,
}

impl TokenizePool {
    pub fn new(name: &'static str, threads: usize) -> TokenizePool {
        let (jobs, queue) = channel();
        let queue: Queue = Arc::new(Mutex::new(queue));
        for _ in 0..threads {
            spawn_worker(name, &queue);
        }
        TokenizePool { jobs, queue, name }
    }

    /// Queues `job`; the handle lowers it once nobody waits for it.
    pub fn run(&self, job: impl FnOnce() + Send + 'static) -> Arc<Running> {
        let running = Arc::new(Running::default());
        // Cannot fail: the pool holds the queue. Were every thread gone
        // (none could be started, each logged), the job would wait there,
        // its caller would time out, and its slot would stay taken.
        let _ = self.jobs.send((Box::new(job), Arc::clone(&running)));
        running
    }

    /// Nobody waits for `job` any more: it runs on [`OVERTIME_NICE_STEPS`]
    /// nicer (from its start, if it has not started; not at all, if it has
    /// ended), and a thread starts here to take its thread's place.
    pub fn lower(&self, job: &Running) {
        if job.lower() {
            spawn_worker(self.name, &self.queue);
        }
    }
}

/// One queued job, as its caller sees it.
#[derive(Default)]
pub struct Running(Mutex<RunState>);

#[derive(Default)]
struct RunState {
    /// The thread running it, while it runs (Linux: a thread id).
    thread: Option<i32>,
    lowered: bool,
    ended: bool,
}

impl Running {
    /// Lowers the job; whether this took its thread (which then ends with
    /// it).
    fn lower(&self) -> bool {
        let mut state = lock(&self.0);
        if state.ended || state.lowered {
            return false;
        }
        state.lowered = true;
        if let Some(thread) = state.thread {
            lower(thread);
        }
        true
    }

    fn start(&self) {
        let mut state = lock(&self.0);
        state.thread = this_thread();
        if let (Some(thread), true) = (state.thread, state.lowered) {
            lower(thread);
        }
    }

    /// The job has ended; whether it was lowered. Its thread is no longer
    /// the job's to lower.
    fn end(&self) -> bool {
        let mut state = lock(&self.0);
        state.thread = None;
        state.ended = true;
        state.lowered
    }
}

/// This thread's id, where one thread's priority can be set (Linux).
#[cfg(target_os = "linux")]
fn this_thread() -> Option<i32> {
    Some(rustix::thread::gettid().as_raw_nonzero().get())
}

#[cfg(not(target_os = "linux"))]
fn this_thread() -> Option<i32> {
    None
}

fn lower(thread: i32) {
    use rustix::process::{Pid, getpriority_process, setpriority_process};
    let Some(thread) = Pid::from_raw(thread) else {
        return;
    };
    let lowered = getpriority_process(Some(thread))
        .and_then(|nice| setpriority_process(Some(thread), (nice + OVERTIME_NICE_STEPS).min(19)));
    if let Err(error) = lowered {
        tracing::debug!(%error, "could not lower a tokenization past its budget");
    }
}

fn spawn_worker(name: &'static str, queue: &Queue) {
    let queue = Arc::clone(queue);
    let spawned = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || work(&queue));
    if let Err(error) = spawned {
        tracing::warn!(%error, "could not start a tokenizer thread: fewer prompts will be tokenized");
    }
}

fn work(queue: &Queue) {
    loop {
        let next = lock(queue).recv();
        // The pool is gone.
        let Ok((job, running)) = next else { return };
        running.start();
        // A panic is the job's caller's to see (its answer never comes);
        // the thread serves on.
        let _ = catch_unwind(AssertUnwindSafe(job));
        if running.end() {
            // Its replacement is running already.
            return;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::sync::mpsc::{RecvTimeoutError, sync_channel};
    use std::time::Duration;

    use rustix::process::{Pid, getpriority_process};

    use super::*;

    /// A pool of its own name: the tokenizer's tests look for theirs.
    fn pool() -> TokenizePool {
        TokenizePool::new("pool-test", 1)
    }

    /// A job that reports its thread and nice value, then waits to be let go.
    fn held(pool: &TokenizePool) -> (Arc<Running>, Receiver<(Pid, i32)>, Sender<()>) {
        let (report, reported) = sync_channel(1);
        let (release, released) = channel::<()>();
        let running = pool.run(move || {
            let me = rustix::thread::gettid();
            report.send((me, niceness(me))).unwrap();
            let _ = released.recv();
        });
        (running, reported, release)
    }

    /// What a job reported; a pool that lost its thread fails, not hangs.
    fn report<T>(reported: &Receiver<T>) -> T {
        match reported.recv_timeout(Duration::from_secs(10)) {
            Ok(report) => report,
            Err(RecvTimeoutError::Timeout) => panic!("no thread ran the job"),
            Err(RecvTimeoutError::Disconnected) => panic!("the job was dropped"),
        }
    }

    fn niceness(thread: Pid) -> i32 {
        getpriority_process(Some(thread)).unwrap()
    }

    /// The test's own nice value, which its threads start with.
    fn default_nice() -> i32 {
        niceness(rustix::thread::gettid())
    }

    fn overtime_nice() -> i32 {
        (default_nice() + OVERTIME_NICE_STEPS).min(19)
    }

    /// At nice 19 nothing can be lowered, nor seen to be.
    fn can_lower() -> bool {
        default_nice() < 19
    }

    #[test]
    fn a_job_past_its_budget_runs_lowered_on_a_thread_that_then_makes_way() {
        assert!(can_lower(), "the tests run at nice 19");
        let pool = pool();
        let (running, reported, release) = held(&pool);
        let (thread, nice) = report(&reported);
        assert_eq!(nice, default_nice(), "within its budget");
        pool.lower(&running);
        assert_eq!(niceness(thread), overtime_nice());
        drop(release);
        // The next job gets a fresh thread, at the default again.
        let (_, reported, _release) = held(&pool);
        let (next, nice) = report(&reported);
        assert_ne!(next, thread);
        assert_eq!(nice, default_nice());
    }

    #[test]
    fn a_job_that_has_ended_is_not_lowered_and_its_thread_serves_on() {
        let pool = pool();
        let (running, reported, release) = held(&pool);
        let (thread, _) = report(&reported);
        drop(release);
        let (_, reported, _release) = held(&pool);
        let (next, _) = report(&reported);
        // Too late: the thread runs another job now.
        pool.lower(&running);
        assert_eq!(next, thread);
        assert_eq!(niceness(thread), default_nice());
    }

    #[test]
    fn a_job_lowered_before_it_starts_starts_lowered() {
        assert!(can_lower(), "the tests run at nice 19");
        let pool = pool();
        let (_, first_started, release_first) = held(&pool);
        report(&first_started);
        let (queued, reported, _release) = held(&pool);
        pool.lower(&queued);
        drop(release_first);
        let (_, nice) = report(&reported);
        assert_eq!(nice, overtime_nice());
    }

    #[test]
    fn a_panicking_job_leaves_the_thread_serving() {
        let pool = pool();
        pool.run(|| panic!("a tokenizer bug"));
        let (done, answer) = sync_channel(1);
        pool.run(move || done.send(()).unwrap());
        report(&answer);
    }
}
