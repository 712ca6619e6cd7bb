//! Live per-destination statistics, for local endpoints and providers alike:
//! `ObservedTTFT`, `ErrorRate`, `RunningRequests` (in flight from this EPP) and a
//! circuit breaker.
//!
//! Time is injected: every time-dependent method takes `now: Instant`, so tests
//! drive a fake timeline (`t0 + Duration`) and the EPP passes `Instant::now()`.
//!
//! Decayed means. Both TTFT and error rate are means in which a sample of age
//! `a` weighs `2^(-a / half_life)`. Kept as a decayed sum and a decayed weight,
//! updated in O(1) per sample. Unlike a per-sample EWMA this forgets by *time*:
//! - an endpoint that went idle does not keep its old TTFT forever — once the
//!   remaining weight falls below `min_weight` (one sample: ~4.3 half-lives,
//!   43 s at the default 10 s) `ObservedTTFT` is absent again, and the first
//!   sample after a long pause dominates the mean;
//! - a destination that was dropped for its error rate gets no traffic, so
//!   its error rate must decay without new samples, or it would stay excluded
//!   forever.
//!
//! Error rate = decayed failures / (decayed requests + `error_prior_weight`):
//! the prior is one pseudo-success, so a single failure after an idle period
//! reads 0.5 (not > 0.5) rather than 1.0, while a burst of failures quickly
//! approaches 1. Zero with no recent data.
//!
//! Circuit breaker. After `breaker_failures` consecutive failures the breaker
//! opens for `breaker_cooldown`; then it is half-open: the next request begun
//! (via [`DestStats::begin`]) is the probe and, while it is in flight,
//! the breaker reads as open again; its success closes the breaker, its
//! failure re-opens it for another cooldown, and a probe dropped without an
//! outcome (client abort) frees the slot for another probe. Two requests may
//! slip through as probes if they are routed in the same instant; that is
//! harmless. While open, [`DestSnapshot::error_rate`] reports 1.0, so a policy
//! `exclude: drop: {ErrorRate: {greaterThan: 0.5}}` drops the destination as
//! users expect, and policies that ignore ErrorRate still see the breaker via
//! [`DestSnapshot::breaker_open`].

use kinference_runtime::sync::lock;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Tuning of [`DestStats`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StatsConfig {
    /// Half-life of a TTFT sample's weight.
    pub ttft_half_life: Duration,
    /// Half-life of a request outcome's weight in the error rate.
    pub error_half_life: Duration,
    /// Pseudo-successes added to the error-rate denominator.
    pub error_prior_weight: f64,
    /// `ObservedTTFT` is absent once the decayed sample weight is below this.
    pub min_weight: f64,
    /// Consecutive failures that open the breaker (0 disables the breaker).
    pub breaker_failures: u32,
    /// How long the breaker stays open before a probe is allowed.
    pub breaker_cooldown: Duration,
    /// Half-life of a route in the count of recent routes.
    pub routes_half_life: Duration,
}

impl Default for StatsConfig {
    fn default() -> Self {
        Self {
            ttft_half_life: Duration::from_secs(10),
            error_half_life: Duration::from_secs(30),
            error_prior_weight: 1.0,
            min_weight: 0.05,
            breaker_failures: 5,
            breaker_cooldown: Duration::from_secs(30),
            // Steady traffic weighs about 2.9 s of it (2 s ÷ ln 2), about
            // as long as a route is remembered for its prompt
            // (`predict::routed::WINDOW`).
            routes_half_life: Duration::from_secs(2),
        }
    }
}

/// How a request to a destination ended. What counts as a failure is the
/// caller's call (connect error, timeout, 5xx; usually not 4xx).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failure,
}

/// Everything the EPP needs for one candidate, read under one lock.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DestSnapshot {
    /// Decayed mean TTFT; `None` when no recent samples.
    pub observed_ttft: Option<Duration>,
    /// Recent failure fraction 0..1; 1.0 while the breaker is open.
    pub error_rate: f64,
    /// Requests in flight from this EPP.
    pub running: u64,
    /// Of those, the ones no scrape can have shown yet.
    pub unscraped: u64,
    /// Requests this EPP routed here lately, each weighing less with age
    /// (half-life `routes_half_life`): a Pod's share of the traffic, which
    /// its instantaneous load does not tell (a hot group's cache hits end
    /// fast).
    pub recent_routes: f64,
    pub breaker_open: bool,
}

impl Default for DestSnapshot {
    fn default() -> Self {
        Self {
            observed_ttft: None,
            error_rate: 0.0,
            running: 0,
            unscraped: 0,
            recent_routes: 0.0,
            breaker_open: false,
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Decayed {
    sum: f64,
    weight: f64,
    at: Option<Instant>,
}

impl Decayed {
    fn factor(at: Option<Instant>, now: Instant, half_life: Duration) -> f64 {
        let Some(at) = at else { return 1.0 };
        // Out-of-order `now` (taken before another thread's update) counts as 0 s.
        let dt = now.saturating_duration_since(at).as_secs_f64();
        let hl = half_life.as_secs_f64();
        if hl <= 0.0 {
            if dt > 0.0 { 0.0 } else { 1.0 }
        } else {
            (-dt / hl).exp2()
        }
    }

    fn at_time(&self, now: Instant, half_life: Duration) -> (f64, f64) {
        let f = Self::factor(self.at, now, half_life);
        (self.sum * f, self.weight * f)
    }

    fn add(&mut self, x: f64, now: Instant, half_life: Duration) {
        let (s, w) = self.at_time(now, half_life);
        self.sum = s + x;
        self.weight = w + 1.0;
        self.at = Some(self.at.map_or(now, |a| a.max(now)));
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Breaker {
    Closed,
    Open { until: Instant },
    HalfOpen { probe_in_flight: bool },
}

#[derive(Debug)]
struct Inner {
    ttft: Decayed,
    errors: Decayed,
    /// Its weight counts the routes.
    routes: Decayed,
    consecutive_failures: u32,
    breaker: Breaker,
    last_activity: Option<Instant>,
    reserved: Reservations,
}

/// When each request in flight that no scrape can have shown yet was
/// picked, oldest first. Bounded by the requests in flight.
#[derive(Debug, Default)]
struct Reservations {
    picked: VecDeque<Instant>,
    /// Picks at or before this were shown by a scrape.
    shown_through: Option<Instant>,
}

impl Reservations {
    fn is_shown(&self, picked: Instant) -> bool {
        self.shown_through.is_some_and(|t| picked <= t)
    }

    fn reserve(&mut self, picked: Instant) {
        if self.is_shown(picked) {
            return;
        }
        // Callers take `now` on their own threads, so picks may arrive a
        // little out of order; keep them sorted.
        let at = self.picked.partition_point(|&p| p <= picked);
        self.picked.insert(at, picked);
    }

    fn release(&mut self, picked: Instant) {
        if self.is_shown(picked) {
            return;
        }
        let at = self.picked.partition_point(|&p| p < picked);
        if self.picked.get(at) == Some(&picked) {
            self.picked.remove(at);
        }
    }

    fn show_through(&mut self, t: Instant) {
        if self.shown_through.is_some_and(|s| s >= t) {
            return;
        }
        self.shown_through = Some(t);
        while self.picked.front().is_some_and(|&p| p <= t) {
            self.picked.pop_front();
        }
    }
}

/// Live statistics of one destination, owned by its registry slot (a
/// provider's: by the provider's state), so they are created and dropped with
/// it: a new Pod on a dead Pod's address starts clean.
pub struct DestStats {
    inflight: AtomicU64,
    inner: Mutex<Inner>,
    cfg: StatsConfig,
}

impl Inner {
    fn touch(&mut self, now: Instant) {
        self.last_activity = Some(self.last_activity.map_or(now, |a| a.max(now)));
    }

    fn breaker_open(&self, now: Instant) -> bool {
        match self.breaker {
            Breaker::Closed => false,
            Breaker::Open { until } => now < until,
            Breaker::HalfOpen { probe_in_flight } => probe_in_flight,
        }
    }

    fn snapshot(&self, cfg: &StatsConfig, running: u64, now: Instant) -> DestSnapshot {
        let (s, w) = self.ttft.at_time(now, cfg.ttft_half_life);
        let observed_ttft = (w >= cfg.min_weight && w > 0.0)
            .then(|| Duration::try_from_secs_f64(s / w).ok())
            .flatten();
        let breaker_open = self.breaker_open(now);
        let error_rate = if breaker_open {
            1.0
        } else {
            let (f, n) = self.errors.at_time(now, cfg.error_half_life);
            let d = n + cfg.error_prior_weight.max(0.0);
            if d > 0.0 {
                (f / d).clamp(0.0, 1.0)
            } else {
                0.0
            }
        };
        DestSnapshot {
            observed_ttft,
            error_rate,
            running,
            unscraped: self.reserved.picked.len() as u64,
            recent_routes: self.routes.at_time(now, cfg.routes_half_life).1,
            breaker_open,
        }
    }

    fn record_ttft(&mut self, cfg: &StatsConfig, ttft: Duration, now: Instant) {
        let secs = ttft.as_secs_f64();
        if secs.is_finite() {
            self.ttft.add(secs, now, cfg.ttft_half_life);
        }
        self.touch(now);
    }

    fn record_outcome(&mut self, cfg: &StatsConfig, outcome: Outcome, now: Instant) {
        self.touch(now);
        match outcome {
            Outcome::Success => {
                self.errors.add(0.0, now, cfg.error_half_life);
                self.consecutive_failures = 0;
                // Any success (the probe's or one begun before the breaker opened)
                // is evidence the destination works again.
                self.breaker = Breaker::Closed;
            }
            Outcome::Failure => {
                self.errors.add(1.0, now, cfg.error_half_life);
                self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                let open = Breaker::Open {
                    until: now + cfg.breaker_cooldown,
                };
                match self.breaker {
                    Breaker::HalfOpen { .. } => self.breaker = open,
                    Breaker::Closed
                        if cfg.breaker_failures > 0
                            && self.consecutive_failures >= cfg.breaker_failures =>
                    {
                        self.breaker = open;
                    }
                    // Already open: late failures of earlier requests do not
                    // extend the cooldown.
                    _ => {}
                }
            }
        }
    }

    /// Claims the probe slot if the breaker allows a probe now.
    fn begin(&mut self, now: Instant) -> bool {
        self.touch(now);
        match self.breaker {
            Breaker::Open { until } if now >= until => {
                self.breaker = Breaker::HalfOpen {
                    probe_in_flight: true,
                };
                true
            }
            Breaker::HalfOpen {
                probe_in_flight: false,
            } => {
                self.breaker = Breaker::HalfOpen {
                    probe_in_flight: true,
                };
                true
            }
            _ => false,
        }
    }
}

impl DestStats {
    pub fn new(cfg: StatsConfig) -> Self {
        DestStats {
            inflight: AtomicU64::new(0),
            inner: Mutex::new(Inner {
                ttft: Decayed::default(),
                errors: Decayed::default(),
                routes: Decayed::default(),
                consecutive_failures: 0,
                breaker: Breaker::Closed,
                last_activity: None,
                reserved: Reservations::default(),
            }),
            cfg,
        }
    }

    /// A request was routed here: counts it in flight until the guard is
    /// dropped (so an aborted stream cannot leak a count), reserves its place
    /// in the load estimates until a scrape shows it, and claims the
    /// breaker's probe slot if it is half-open.
    pub fn begin(self: &Arc<Self>, now: Instant) -> InflightGuard {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        let probe = {
            let mut inner = lock(&self.inner);
            inner.reserved.reserve(now);
            inner.routes.add(0.0, now, self.cfg.routes_half_life);
            inner.begin(now)
        };
        InflightGuard {
            dest: Arc::clone(self),
            picked: now,
            probe,
            finished: false,
        }
    }

    /// Fresh metrics arrived from a scrape sent at `sent`: they show the
    /// requests picked before it, whose reservations are released. A pick
    /// made while the scrape was under way stays reserved, or the next
    /// decision would see it nowhere. (A request picked just before the
    /// scrape was sent may reach the engine just after it; that window is
    /// the gateway's forwarding time, and waiting it out would count every
    /// other request twice until the next scrape.)
    pub(crate) fn note_scrape(&self, sent: Instant) {
        lock(&self.inner).reserved.show_through(sent);
    }

    /// Records a TTFT sample (time to first byte/token of the response).
    pub fn record_ttft(&self, ttft: Duration, now: Instant) {
        lock(&self.inner).record_ttft(&self.cfg, ttft, now);
    }

    /// Records how a request ended, for callers that do not hold the guard
    /// (a fallback endpoint that served instead of the one picked).
    pub(crate) fn record_outcome(&self, outcome: Outcome, now: Instant) {
        lock(&self.inner).record_outcome(&self.cfg, outcome, now);
    }

    /// All statistics at `now`.
    pub fn snapshot(&self, now: Instant) -> DestSnapshot {
        let running = self.inflight.load(Ordering::Relaxed);
        lock(&self.inner).snapshot(&self.cfg, running, now)
    }

    /// Decayed mean TTFT, `None` without recent samples.
    pub fn observed_ttft(&self, now: Instant) -> Option<Duration> {
        self.snapshot(now).observed_ttft
    }

    /// Recent failure fraction; 1.0 while the breaker is open.
    pub fn error_rate(&self, now: Instant) -> f64 {
        self.snapshot(now).error_rate
    }

    /// Requests in flight from this EPP.
    pub fn running(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Whether the breaker currently refuses traffic (open, or half-open with
    /// its probe in flight).
    #[cfg(test)]
    pub(crate) fn is_open(&self, now: Instant) -> bool {
        lock(&self.inner).breaker_open(now)
    }
}

impl Default for DestStats {
    fn default() -> Self {
        Self::new(StatsConfig::default())
    }
}

/// A request in flight to one destination. Dropping it (normally, on error, or
/// when the stream is aborted) decrements `RunningRequests`.
pub struct InflightGuard {
    dest: Arc<DestStats>,
    /// When the request was picked: its reservation's key.
    picked: Instant,
    probe: bool,
    finished: bool,
}

impl InflightGuard {
    /// The statistics this request counts in.
    pub fn stats(&self) -> &Arc<DestStats> {
        &self.dest
    }

    /// Whether this request is the half-open breaker's probe.
    #[cfg(test)]
    fn is_probe(&self) -> bool {
        self.probe
    }

    /// Records this request's TTFT (first response byte/token).
    pub fn record_ttft(&self, ttft: Duration, now: Instant) {
        lock(&self.dest.inner).record_ttft(&self.dest.cfg, ttft, now);
    }

    /// Records the outcome now; the request stays in flight until the guard
    /// is dropped (a streamed answer goes on after its first byte). Only the
    /// first outcome counts.
    pub fn record(&mut self, outcome: Outcome, now: Instant) {
        if !self.finished {
            self.finished = true;
            lock(&self.dest.inner).record_outcome(&self.dest.cfg, outcome, now);
        }
    }

    /// Records the outcome and ends the request. Dropping the guard without
    /// calling this records no outcome (a client abort says nothing about the
    /// destination) and frees the probe slot if this was the probe.
    pub fn finish(mut self, outcome: Outcome, now: Instant) {
        self.finished = true;
        lock(&self.dest.inner).record_outcome(&self.dest.cfg, outcome, now);
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.dest.inflight.fetch_sub(1, Ordering::Relaxed);
        let mut inner = lock(&self.dest.inner);
        inner.reserved.release(self.picked);
        if self.probe
            && !self.finished
            && inner.breaker
                == (Breaker::HalfOpen {
                    probe_in_flight: true,
                })
        {
            inner.breaker = Breaker::HalfOpen {
                probe_in_flight: false,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The snapshot's count of picks no scrape can have shown yet.
    fn unscraped(st: &DestStats) -> u64 {
        st.snapshot(Instant::now()).unscraped
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn observed_ttft_decays_by_time() {
        let st = Arc::new(DestStats::default());
        let t0 = Instant::now();
        assert_eq!(st.observed_ttft(t0), None);
        st.record_ttft(secs(1.0), t0);
        st.record_ttft(secs(3.0), t0);
        let m = st.observed_ttft(t0).unwrap().as_secs_f64();
        assert!((m - 2.0).abs() < 1e-9);
        // 10 s later the old samples weigh ½ each: (0.5 + 1.5 + 4) / (0.5 + 0.5 + 1).
        st.record_ttft(secs(4.0), t0 + secs(10.0));
        let m = st.observed_ttft(t0 + secs(10.0)).unwrap().as_secs_f64();
        assert!((m - 3.0).abs() < 1e-9, "{m}");
        // Idle: the value itself stays (a mean), but disappears once stale.
        assert!(st.observed_ttft(t0 + secs(40.0)).is_some());
        assert_eq!(st.observed_ttft(t0 + secs(200.0)), None);
        // After a long pause the first sample dominates.
        st.record_ttft(secs(0.5), t0 + secs(100.0));
        let m = st.observed_ttft(t0 + secs(100.0)).unwrap().as_secs_f64();
        assert!((m - 0.5).abs() < 0.05, "{m}");
        // A `now` earlier than the last update is treated as no elapsed time.
        assert!(st.observed_ttft(t0).is_some());
    }

    #[test]
    fn error_rate_and_prior() {
        let st = Arc::new(DestStats::default());
        let t0 = Instant::now();
        assert_eq!(st.error_rate(t0), 0.0);
        st.record_outcome(Outcome::Failure, t0);
        assert!(
            (st.error_rate(t0) - 0.5).abs() < 1e-9,
            "one failure is not > 0.5"
        );
        for _ in 0..3 {
            st.record_outcome(Outcome::Success, t0);
        }
        assert!((st.error_rate(t0) - 0.2).abs() < 1e-9);
        for _ in 0..4 {
            st.record_outcome(Outcome::Failure, t0);
        }
        assert!(!st.is_open(t0));
        assert!((st.error_rate(t0) - 5.0 / 9.0).abs() < 1e-9);
        // Decays with time even without new requests.
        assert!(st.error_rate(t0 + secs(300.0)) < 0.01);
    }

    #[test]
    fn recent_routes_count_each_route_halved_every_half_life() {
        let st = Arc::new(DestStats::default());
        let t0 = Instant::now();
        assert_eq!(st.snapshot(t0).recent_routes, 0.0);
        for _ in 0..4 {
            drop(st.begin(t0));
        }
        assert!((st.snapshot(t0).recent_routes - 4.0).abs() < 1e-9);
        let later = t0 + StatsConfig::default().routes_half_life;
        drop(st.begin(later));
        assert!((st.snapshot(later).recent_routes - 3.0).abs() < 1e-9);
    }

    #[test]
    fn running_requests_guard() {
        let st = Arc::new(DestStats::default());
        let t0 = Instant::now();
        let g1 = st.begin(t0);
        let g2 = st.begin(t0);
        assert_eq!(st.running(), 2);
        assert_eq!(st.snapshot(t0).running, 2);
        g1.finish(Outcome::Success, t0);
        assert_eq!(st.running(), 1);
        // An aborted stream: the guard is just dropped (e.g. on a panic/unwind).
        let h = std::thread::spawn(move || {
            let _g = g2;
            panic!("stream aborted");
        });
        assert!(h.join().is_err());
        assert_eq!(st.running(), 0);
    }

    #[test]
    fn breaker_opens_probes_and_closes() {
        let st = Arc::new(DestStats::default());
        let t0 = Instant::now();
        for i in 0..4 {
            st.begin(t0).finish(Outcome::Failure, t0);
            assert!(!st.is_open(t0), "after {} failures", i + 1);
        }
        // A success resets the streak.
        st.begin(t0).finish(Outcome::Success, t0);
        for _ in 0..5 {
            st.begin(t0).finish(Outcome::Failure, t0);
        }
        assert!(st.is_open(t0));
        let s = st.snapshot(t0 + secs(29.0));
        assert!(s.breaker_open && s.error_rate == 1.0);
        // Cooldown over: half-open, one probe.
        let t1 = t0 + secs(30.0);
        assert!(!st.is_open(t1));
        let probe = st.begin(t1);
        assert!(probe.is_probe());
        assert!(st.is_open(t1), "closed to others while the probe runs");
        // Probe fails: open again for a full cooldown.
        probe.finish(Outcome::Failure, t1);
        assert!(st.is_open(t1 + secs(29.0)));
        let t2 = t1 + secs(30.0);
        // Aborted probe frees the slot.
        let probe = st.begin(t2);
        assert!(probe.is_probe() && st.is_open(t2));
        drop(probe);
        assert!(!st.is_open(t2));
        // Successful probe closes the breaker.
        let probe = st.begin(t2);
        assert!(probe.is_probe());
        probe.finish(Outcome::Success, t2);
        assert!(!st.is_open(t2));
        assert!(st.error_rate(t2) < 1.0);
        assert!(!st.begin(t2).is_probe());
    }

    #[test]
    fn breaker_can_be_disabled() {
        let st = DestStats::new(StatsConfig {
            breaker_failures: 0,
            ..Default::default()
        });
        let t0 = Instant::now();
        for _ in 0..50 {
            st.record_outcome(Outcome::Failure, t0);
        }
        assert!(!st.is_open(t0));
    }

    #[test]
    fn picks_are_reserved_until_a_scrape_shows_them() {
        let st = Arc::new(DestStats::default());
        let ms = |n: u64| Duration::from_millis(n);
        let t0 = Instant::now();
        let g1 = st.begin(t0);
        let g2 = st.begin(t0 + ms(5));
        assert_eq!(unscraped(&st), 2, "two picks the metrics cannot show yet");
        drop(g1);
        assert_eq!(unscraped(&st), 1, "a finished request releases its place");
        st.note_scrape(t0 + ms(4));
        assert_eq!(
            unscraped(&st),
            1,
            "a scrape sent before g2 was picked, answered after, cannot show it"
        );
        st.note_scrape(t0 + ms(6));
        assert_eq!(unscraped(&st), 0, "a scrape sent after g2's pick shows it");
        let g3 = st.begin(t0 + ms(7));
        drop(g2);
        assert_eq!(unscraped(&st), 1, "g2 ending does not release g3's place");
        st.note_scrape(t0 + ms(5));
        assert_eq!(unscraped(&st), 1, "an older scrape shows nothing new");
        drop(g3);
        assert_eq!(unscraped(&st), 0);
        assert_eq!(st.running(), 0);
    }

    #[test]
    fn picks_out_of_order_are_released_by_their_own_guards() {
        let st = Arc::new(DestStats::default());
        let ms = |n: u64| Duration::from_millis(n);
        let t0 = Instant::now() + ms(100);
        let late = st.begin(t0 + ms(20));
        let early = st.begin(t0);
        let same = st.begin(t0);
        assert_eq!(unscraped(&st), 3);
        st.note_scrape(t0 + ms(10));
        assert_eq!(unscraped(&st), 1, "only the pick 20 ms in is unshown");
        drop(early);
        drop(same);
        assert_eq!(unscraped(&st), 1, "shown picks ending leave it reserved");
        let before_the_scrape = st.begin(t0 - ms(1));
        assert_eq!(unscraped(&st), 1, "a pick the last scrape covers is shown");
        drop(before_the_scrape);
        drop(late);
        assert_eq!(unscraped(&st), 0);
    }

    #[test]
    fn concurrent_guards() {
        let all: Arc<Vec<Arc<DestStats>>> =
            Arc::new((0..3).map(|_| Arc::new(DestStats::default())).collect());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let all = all.clone();
                std::thread::spawn(move || {
                    for i in 0..5000usize {
                        let g = all[i % 3].begin(Instant::now());
                        g.record_ttft(secs(0.01), Instant::now());
                        if i % 2 == 0 {
                            g.finish(Outcome::Success, Instant::now());
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        for st in all.iter() {
            assert_eq!(st.running(), 0);
            assert_eq!(unscraped(st), 0);
            assert!(st.observed_ttft(Instant::now()).is_some());
        }
    }
}
