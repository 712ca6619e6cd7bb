//! CPU accounting from Linux `/proc`: the scheduler's CPU time of groups of
//! this process's threads (by thread-name prefix, from `schedstat`, kernel
//! time included) and of a child process's threads, and how busy the whole
//! machine was (`/proc/stat`), so that a report can tell the CPU of the
//! benchmark's own parts from other processes'. Elsewhere every reading is
//! zero.
//!
//! The parsers take the files' text, so they are tested on fixed samples.

use std::ops::Index;
use std::path::Path;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------
// Parsers.
// ---------------------------------------------------------------------------

/// Time on a CPU from the text of a `schedstat` file: its first field, in
/// nanoseconds.
pub fn parse_schedstat(text: &str) -> Option<Duration> {
    let ns = text.split_whitespace().next()?.parse::<u64>().ok()?;
    Some(Duration::from_nanos(ns))
}

/// The fields of a `/proc/<pid>/stat` text that follow the command name
/// (field 3, the state, first). The name is in parentheses and may itself
/// hold spaces and parentheses, so it ends at the last `)`.
fn stat_fields_after_comm(text: &str) -> Vec<&str> {
    text.rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect()
}

/// utime + stime (fields 14 and 15) of a `/proc/<pid>/stat` text, in clock
/// ticks; a missing or malformed field counts as zero.
pub fn parse_stat_ticks(text: &str) -> u64 {
    let f = stat_fields_after_comm(text);
    let get = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    get(11) + get(12)
}

/// The command name (field 2) and parent pid (field 4) of a
/// `/proc/<pid>/stat` text.
pub fn parse_stat_comm_ppid(text: &str) -> Option<(&str, u32)> {
    let (head, rest) = text.rsplit_once(')')?;
    let comm = head.split_once('(').map_or("", |(_, c)| c);
    let ppid = rest.split_whitespace().nth(1)?.parse().ok()?;
    Some((comm, ppid))
}

/// Busy and total ticks of all CPUs from the text of `/proc/stat`: its first
/// (`cpu`) line, user through steal; idle and iowait are not busy.
pub fn parse_machine_ticks(text: &str) -> (u64, u64) {
    let v: Vec<u64> = text
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total.saturating_sub(idle), total)
}

/// The share of the machine's CPU (0..1) that other processes used, from
/// the machine's busy and total ticks and ours over the same span.
pub fn others_share(busy: u64, total: u64, ours: u64) -> f64 {
    ((busy as f64 - ours as f64) / total.max(1) as f64).max(0.0)
}

// ---------------------------------------------------------------------------
// Readers.
// ---------------------------------------------------------------------------

/// Sum of the `schedstat` CPU time of the tasks (threads) in `dir` whose
/// name starts with `prefix` (all of them when `prefix` is empty).
pub fn tasks_cpu(dir: impl AsRef<Path>, prefix: &str) -> Duration {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Duration::ZERO;
    };
    let mut total = Duration::ZERO;
    for entry in entries.flatten() {
        let path = entry.path();
        if !prefix.is_empty()
            && !std::fs::read_to_string(path.join("comm")).is_ok_and(|c| c.starts_with(prefix))
        {
            continue;
        }
        if let Some(cpu) = std::fs::read_to_string(path.join("schedstat"))
            .ok()
            .as_deref()
            .and_then(parse_schedstat)
        {
            total += cpu;
        }
    }
    total
}

/// CPU time of this process's threads whose name starts with `prefix` (a
/// runtime's threads, see [`super::runtime`]).
pub fn threads_cpu(prefix: &str) -> Duration {
    tasks_cpu("/proc/self/task", prefix)
}

/// Linux's `USER_HZ`, the unit of `/proc/<pid>/stat`'s times: 100 on
/// every architecture it runs on.
const TICK: Duration = Duration::from_millis(10);

/// CPU time of process `pid`, its exited threads included: the process's
/// utime + stime, in ticks of 10 ms. Summing its live threads' `schedstat`
/// instead would drop a thread that exited inside the window (a precise-mode
/// EPP's lowered tokenizations run on threads of their own).
pub fn process_cpu(pid: u32) -> Duration {
    let ticks = process_ticks(Some(pid));
    TICK * u32::try_from(ticks).unwrap_or(u32::MAX)
}

/// utime + stime of process `pid` (this process when `None`), in clock
/// ticks.
pub fn process_ticks(pid: Option<u32>) -> u64 {
    let path = pid.map_or_else(
        || "/proc/self/stat".to_string(),
        |p| format!("/proc/{p}/stat"),
    );
    parse_stat_ticks(&std::fs::read_to_string(path).unwrap_or_default())
}

/// Busy and total ticks of all CPUs since boot.
pub fn machine_ticks() -> (u64, u64) {
    parse_machine_ticks(&std::fs::read_to_string("/proc/stat").unwrap_or_default())
}

/// How many of this process's threads have a name starting with `prefix`.
pub fn thread_count(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |dir| {
        dir.flatten()
            .filter(|e| {
                std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.starts_with(prefix))
            })
            .count()
    })
}

/// This process's children whose command name starts with `prefix`.
pub fn children_named(prefix: &str) -> Vec<u32> {
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            parse_stat_comm_ppid(&stat)
                .is_some_and(|(comm, ppid)| ppid == me && comm.starts_with(prefix))
        })
        .collect()
}

/// `/proc/loadavg` as the kernel writes it (1, 5 and 15 minute load, running
/// and total tasks, last pid); empty elsewhere.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

// ---------------------------------------------------------------------------
// Snapshots.
// ---------------------------------------------------------------------------

/// What a [`Mark`] reads: the CPU time of `N` groups of this process's
/// threads (by name prefix, in this order) and of one child process.
#[derive(Clone, Copy, Debug)]
pub struct Clocks<const N: usize> {
    pub threads: [&'static str; N],
    /// A child process (Envoy, say) whose CPU is read apart and which does
    /// not count as another process.
    pub child: Option<u32>,
}

impl<const N: usize> Clocks<N> {
    pub const fn new(threads: [&'static str; N]) -> Self {
        Clocks {
            threads,
            child: None,
        }
    }

    pub const fn with_child(self, child: Option<u32>) -> Self {
        Clocks { child, ..self }
    }

    /// Reads every clock now.
    pub fn mark(&self) -> Mark<N> {
        let (machine_busy, machine_total) = machine_ticks();
        Mark {
            at: Instant::now(),
            threads: self.threads.map(threads_cpu),
            child: self.child.map_or(Duration::ZERO, process_cpu),
            machine_busy,
            machine_total,
            ours: process_ticks(None) + self.child.map_or(0, |p| process_ticks(Some(p))),
        }
    }
}

/// Clocks at one instant (see [`Clocks::mark`]).
#[derive(Clone, Copy, Debug)]
pub struct Mark<const N: usize> {
    pub at: Instant,
    /// CPU time of each thread group so far.
    pub threads: [Duration; N],
    /// CPU time of the child so far.
    pub child: Duration,
    machine_busy: u64,
    machine_total: u64,
    /// This process's and the child's ticks.
    ours: u64,
}

/// CPU used between two marks. Indexing gives a thread group's CPU time.
#[derive(Clone, Copy, Debug)]
pub struct Cpu<const N: usize> {
    pub threads: [Duration; N],
    pub child: Duration,
    /// Share of the machine used by other processes (0..1).
    pub others: f64,
}

impl<const N: usize> Default for Cpu<N> {
    fn default() -> Self {
        Cpu {
            threads: [Duration::ZERO; N],
            child: Duration::ZERO,
            others: 0.0,
        }
    }
}

impl<const N: usize> Cpu<N> {
    pub fn between(a: &Mark<N>, b: &Mark<N>) -> Self {
        Cpu {
            threads: std::array::from_fn(|i| b.threads[i].saturating_sub(a.threads[i])),
            child: b.child.saturating_sub(a.child),
            others: others_share(
                b.machine_busy.saturating_sub(a.machine_busy),
                b.machine_total.saturating_sub(a.machine_total),
                b.ours.saturating_sub(a.ours),
            ),
        }
    }

    /// Cores used by other processes: their share of the machine times its
    /// cores.
    pub fn others_cores(&self) -> f64 {
        self.others * super::cores() as f64
    }
}

impl<const N: usize> Index<usize> for Cpu<N> {
    type Output = Duration;

    fn index(&self, group: usize) -> &Duration {
        &self.threads[group]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/proc/<pid>/stat` of a thread whose name holds `) (`, as a kernel
    /// writes it (utime 1234, stime 56, ppid 4242).
    const STAT: &str = "4321 (tokio ) (x) S 4242 4321 4321 0 -1 4194560 1500 0 0 0 1234 56 0 0 20 0 12 0 789 1000000 500 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0\n";

    #[test]
    fn schedstat_is_nanoseconds_on_cpu() {
        assert_eq!(
            parse_schedstat("123456789 2000 42\n"),
            Some(Duration::from_nanos(123_456_789))
        );
        assert_eq!(parse_schedstat(""), None);
        assert_eq!(parse_schedstat("n/a 1 2"), None);
    }

    #[test]
    fn stat_ticks_survive_a_name_with_parentheses() {
        assert_eq!(parse_stat_ticks(STAT), 1234 + 56);
        assert_eq!(parse_stat_ticks(""), 0);
        assert_eq!(parse_stat_ticks("1 (short) S 0"), 0);
        assert_eq!(parse_stat_comm_ppid(STAT), Some(("tokio ) (x", 4242)));
        assert_eq!(
            parse_stat_comm_ppid("77 (envoy) S 1 77 77"),
            Some(("envoy", 1))
        );
        assert_eq!(parse_stat_comm_ppid("no parentheses"), None);
    }

    #[test]
    fn machine_ticks_leave_out_idle_and_iowait() {
        // user nice system idle iowait irq softirq steal guest guest_nice
        let stat = "cpu  100 5 40 800 20 3 2 1 9 9\ncpu0 50 2 20 400 10 1 1 0 0 0\nintr 1 2\n";
        assert_eq!(parse_machine_ticks(stat), (151, 971));
        assert_eq!(parse_machine_ticks(""), (0, 0));
    }

    #[test]
    fn others_are_the_busy_ticks_that_are_not_ours() {
        assert_eq!(others_share(150, 200, 50), 0.5);
        // Our ticks and the machine's are read at slightly different times.
        assert_eq!(others_share(50, 200, 60), 0.0);
        assert_eq!(others_share(0, 0, 0), 0.0);
    }

    #[test]
    fn cpu_between_two_marks() {
        let at = Instant::now();
        let mark = |threads_ms: [u64; 2], child_ms, machine_busy, machine_total, ours| Mark {
            at,
            threads: threads_ms.map(Duration::from_millis),
            child: Duration::from_millis(child_ms),
            machine_busy,
            machine_total,
            ours,
        };
        let a = mark([10, 5], 1, 1_000, 4_000, 300);
        let b = mark([30, 5], 4, 1_100, 4_200, 340);
        let cpu = Cpu::between(&a, &b);
        assert_eq!(cpu[0], Duration::from_millis(20));
        assert_eq!(cpu[1], Duration::ZERO);
        assert_eq!(cpu.child, Duration::from_millis(3));
        assert_eq!(cpu.others, 0.3);
        // A clock that went backwards counts as nothing.
        assert_eq!(Cpu::between(&b, &a)[0], Duration::ZERO);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_process_keeps_the_cpu_of_its_exited_threads() {
        let pid = std::process::id();
        let before = process_cpu(pid);
        // Burns 300 ms of its own CPU time (not wall time, which a busy
        // machine stretches), then exits.
        std::thread::Builder::new()
            .name("burner".into())
            .spawn(|| {
                let mine = || {
                    std::fs::read_to_string("/proc/thread-self/schedstat")
                        .ok()
                        .as_deref()
                        .and_then(parse_schedstat)
                        .unwrap_or(Duration::MAX)
                };
                let mut x = 0u64;
                while mine() < Duration::from_millis(300) {
                    for i in 0..10_000 {
                        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
                    }
                }
            })
            .unwrap()
            .join()
            .unwrap();
        let used = process_cpu(pid) - before;
        // One tick of rounding at each end.
        assert!(used >= Duration::from_millis(280), "{used:?}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_is_on_record() {
        let mark = Clocks::new([""]).mark();
        assert!(mark.threads[0] > Duration::ZERO);
        assert!(thread_count("") >= 1);
        let (busy, total) = machine_ticks();
        assert!(total >= busy && total > 0);
        assert!(loadavg().split_whitespace().count() >= 3);
        assert!(children_named("surely-no-such-child").is_empty());
    }
}
