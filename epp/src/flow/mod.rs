//! Flow control: a request whose rule found no candidate with room
//! (`onEmpty: Wait`) waits here, in its priority's band and its flow, until
//! the rule finds one, its `maxWait` passes, or a higher priority needs its
//! place. One dispatcher offers room in [`queue::Queue`]'s order: a waiting
//! request is evaluated again only when given a turn, so a higher band is
//! always asked first and a finished request frees room for exactly the
//! next in line, not for every waiter at once.

mod queue;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use tokio::sync::{Notify, mpsc, oneshot};

pub use queue::Shed;
pub use queue::{Bounds, Place};
use queue::{Id, Queue};

use crate::metrics::Metrics;
use kinference_runtime::sync::lock;

/// Room can come without a request finishing here: a scrape shows a
/// shorter queue, a Pod joins, the policy changes. Waiters are asked again
/// this often, which costs one evaluation per flow at the head of a band.
const RECHECK: Duration = Duration::from_millis(20);
/// A turn is one evaluation of a prepared request (classifiers already
/// ran); one that takes longer has gone astray and the next is asked.
const TURN_LIMIT: Duration = Duration::from_secs(1);
/// Turns offered per pass. Beyond this many flows waiting at once, the
/// lower bands' flows wait for a later pass: a client can name any number
/// of fairness ids, and each turn is an evaluation.
const TURNS_PER_PASS: usize = 64;

type Labels = Vec<(String, String)>;

enum Signal {
    /// Evaluate again; answer whether the request left the queue.
    Turn(oneshot::Sender<bool>),
    /// The place was given to a higher priority.
    Shed(Shed),
}

struct Slot {
    signals: mpsc::UnboundedSender<Signal>,
}

/// What a waiting request learns next.
pub enum Next {
    Turn(Turn),
    Shed(Shed),
    /// Its `maxWait` passed.
    Expired,
}

/// A turn to evaluate again. Answer it, or drop it (the same as "still
/// waiting").
pub struct Turn(oneshot::Sender<bool>);

impl Turn {
    /// `left`: the request was dispatched or answered, and counts as such
    /// (in flight on its destination) from now on.
    pub(crate) fn answer(self, left: bool) {
        let _ = self.0.send(left);
    }
}

/// How a wait ended, as `/metrics` labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Dispatched,
    Expired,
    Shed,
    /// Evaluated again, the policy answered otherwise (a reload).
    Rejected,
    /// The client or the gateway went away first.
    Cancelled,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Dispatched => "dispatched",
            Outcome::Expired => "expired",
            Outcome::Shed => "shed",
            Outcome::Rejected => "rejected",
            Outcome::Cancelled => "cancelled",
        }
    }
}

pub struct FlowControl {
    queue: Mutex<Queue<Slot>>,
    wake: Notify,
    dispatching: AtomicBool,
    metrics: FlowMetrics,
}

impl FlowControl {
    pub fn new(metrics: &Metrics) -> Arc<Self> {
        Arc::new(FlowControl {
            queue: Mutex::new(Queue::default()),
            wake: Notify::new(),
            dispatching: AtomicBool::new(false),
            metrics: FlowMetrics::register(metrics),
        })
    }

    fn queue(&self) -> MutexGuard<'_, Queue<Slot>> {
        lock(&self.queue)
    }

    /// Room may have come (a request finished).
    pub(crate) fn wake(&self) {
        self.wake.notify_one();
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.queue().len()
    }

    /// A request starts waiting, or is refused a place.
    pub fn enter(
        self: &Arc<Self>,
        place: Place,
        max_wait: Duration,
        bounds: Bounds,
    ) -> Result<Waiting, Shed> {
        self.start_dispatching();
        let (signals, rx) = mpsc::unbounded_channel();
        let admitted = {
            let mut queue = self.queue();
            let admitted = queue.admit(&place, Slot { signals }, bounds);
            self.metrics.set_depths(&queue);
            admitted
        };
        let admitted = match admitted {
            Ok(a) => a,
            Err((_, why)) => {
                self.metrics.shed(place.priority, why);
                self.metrics
                    .waited(place.priority, Outcome::Shed, Duration::ZERO);
                return Err(why);
            }
        };
        // Counted by each when it reads this: one mid-turn may leave with
        // room instead.
        for (slot, _, why) in admitted.shed {
            let _ = slot.signals.send(Signal::Shed(why));
        }
        // Room may be there already: a scrape, a Pod, a finish that came
        // before this request joined.
        self.wake();
        let now = Instant::now();
        Ok(Waiting {
            flow: Arc::clone(self),
            id: admitted.id,
            priority: place.priority,
            since: now,
            deadline: now + max_wait,
            signals: rx,
            outcome: Outcome::Cancelled,
        })
    }

    fn start_dispatching(self: &Arc<Self>) {
        if !self.dispatching.swap(true, Ordering::AcqRel) {
            tokio::spawn(Arc::clone(self).dispatch());
        }
    }

    /// Whether a request of `rule` at `priority` or above waits: a newcomer
    /// must not take the room it waits for.
    pub(crate) fn waiting_ahead(&self, rule: &str, priority: i32) -> bool {
        let queue = self.queue();
        !queue.is_empty() && queue.waiting_ahead(rule, priority)
    }

    /// Offers room in turn order whenever it may have come. It holds the
    /// control for good: the picker that owns it lives as long as the
    /// process.
    async fn dispatch(self: Arc<Self>) {
        // Should this task ever end (a panic), the next request starts one.
        let _restart = RestartOnDrop(Arc::clone(&self));
        loop {
            if self.queue().is_empty() {
                self.wake.notified().await;
            } else {
                tokio::select! {
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(RECHECK) => {}
                }
            }
            // A pass that dispatched may have left more room (a scrape can
            // show several free places at once): ask again until none.
            while self.pass().await > 0 {}
        }
    }

    /// Turns in queue order, highest band first: a flow's head that leaves
    /// makes room for its successor's turn before any lower band's; one
    /// that stays is not asked again in this pass. Returns how many left.
    async fn pass(&self) -> usize {
        let mut asked = std::collections::HashSet::new();
        // Rules whose request stayed: room that comes for one of them in
        // this pass is a higher request's, so their others wait for the
        // next pass (which that room's wake-up starts).
        let mut full: std::collections::HashSet<String> = std::collections::HashSet::new();
        let mut left = 0;
        for _ in 0..TURNS_PER_PASS {
            let next = {
                let queue = self.queue();
                queue
                    .heads()
                    .into_iter()
                    .filter(|id| !asked.contains(id))
                    .find(|id| queue.rule_of(*id).is_some_and(|r| !full.contains(r)))
                    .and_then(|id| {
                        let rule = queue.rule_of(id)?.to_string();
                        Some((id, rule, queue.payload(id)?.signals.clone()))
                    })
            };
            let Some((id, rule, signals)) = next else {
                break;
            };
            asked.insert(id);
            let (reply, answer) = oneshot::channel();
            if signals.send(Signal::Turn(reply)).is_err() {
                continue;
            }
            match tokio::time::timeout(TURN_LIMIT, answer).await {
                Ok(Ok(true)) => left += 1,
                // Stays: its flow lets the band's others go first next time.
                _ => {
                    self.queue().passed_over(id);
                    full.insert(rule);
                }
            }
        }
        left
    }

    fn leave(&self, id: Id, priority: i32, outcome: Outcome, waited: Duration) {
        {
            let mut queue = self.queue();
            queue.remove(id);
            self.metrics.set_depths(&queue);
        }
        self.metrics.waited(priority, outcome, waited);
    }
}

struct RestartOnDrop(Arc<FlowControl>);

impl Drop for RestartOnDrop {
    fn drop(&mut self) {
        self.0.dispatching.store(false, Ordering::Release);
    }
}

/// A request's place in the queue, given up when dropped.
pub struct Waiting {
    flow: Arc<FlowControl>,
    id: Id,
    priority: i32,
    since: Instant,
    deadline: Instant,
    signals: mpsc::UnboundedReceiver<Signal>,
    outcome: Outcome,
}

impl Waiting {
    pub async fn next(&mut self) -> Next {
        let deadline = tokio::time::Instant::from_std(self.deadline);
        tokio::select! {
            signal = self.signals.recv() => match signal {
                Some(Signal::Turn(reply)) => Next::Turn(Turn(reply)),
                Some(Signal::Shed(why)) => {
                    self.outcome = Outcome::Shed;
                    self.flow.metrics.shed(self.priority, why);
                    Next::Shed(why)
                }
                // The queue holds the sender until the place is given up.
                None => Next::Expired,
            },
            _ = tokio::time::sleep_until(deadline) => {
                self.outcome = Outcome::Expired;
                Next::Expired
            }
        }
    }

    /// How long it has waited.
    pub(crate) fn waited(&self) -> Duration {
        self.since.elapsed()
    }

    pub fn priority(&self) -> i32 {
        self.priority
    }

    /// The request leaves with a destination.
    pub fn dispatched(mut self) {
        self.outcome = Outcome::Dispatched;
    }

    /// Evaluated again, the policy answered without waiting (a reload).
    pub fn rejected(mut self) {
        self.outcome = Outcome::Rejected;
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let waited = self.since.elapsed();
        self.flow
            .leave(self.id, self.priority, self.outcome, waited);
        // Its place may have been the one a lower band was waiting behind.
        self.flow.wake();
    }
}

struct FlowMetrics {
    waiting: Family<Labels, Gauge>,
    waiting_bytes: Family<Labels, Gauge>,
    wait_seconds: Family<Labels, Histogram>,
    shed: Family<Labels, Counter>,
    /// Priorities with a series, so a band that empties reads 0.
    seen: Mutex<std::collections::BTreeSet<i32>>,
}

impl FlowMetrics {
    fn register(metrics: &Metrics) -> Self {
        let m = FlowMetrics {
            waiting: Family::default(),
            waiting_bytes: Family::default(),
            wait_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 16))
            }),
            shed: Family::default(),
            seen: Mutex::default(),
        };
        metrics.register_metric(
            "flow_waiting_requests",
            "Requests waiting in the EPP for a candidate with room (onEmpty: Wait), by priority",
            m.waiting.clone(),
        );
        metrics.register_metric(
            "flow_waiting_bytes",
            "Request body bytes waiting in the EPP, by priority",
            m.waiting_bytes.clone(),
        );
        metrics.register_metric(
            "flow_wait_seconds",
            "Time requests waited in the EPP, by priority and how the wait ended (dispatched, expired, shed, cancelled)",
            m.wait_seconds.clone(),
        );
        metrics.register_metric(
            "flow_shed",
            "Requests refused a place or shed from the queue for a higher priority, by priority and the bound reached (max_requests, max_bytes)",
            m.shed.clone(),
        );
        m
    }

    fn set_depths<T>(&self, queue: &Queue<T>) {
        let depths = queue.depth_by_priority();
        let mut seen = lock(&self.seen);
        seen.extend(depths.keys().copied());
        for &priority in seen.iter() {
            let (n, bytes) = depths.get(&priority).copied().unwrap_or_default();
            let l = priority_label(priority);
            self.waiting.get_or_create(&l).set(n as i64);
            self.waiting_bytes.get_or_create(&l).set(bytes as i64);
        }
    }

    fn waited(&self, priority: i32, outcome: Outcome, waited: Duration) {
        let mut l = priority_label(priority);
        l.push(("outcome".into(), outcome.as_str().into()));
        self.wait_seconds
            .get_or_create(&l)
            .observe(waited.as_secs_f64());
    }

    fn shed(&self, priority: i32, why: Shed) {
        let mut l = priority_label(priority);
        l.push(("reason".into(), why.reason().into()));
        self.shed.get_or_create(&l).inc();
    }
}

fn priority_label(priority: i32) -> Labels {
    vec![("priority".into(), priority.to_string())]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rendered(metrics: &Metrics) -> String {
        let endpoints = crate::endpoints::EndpointRegistry::new(Duration::from_secs(1));
        metrics.render(&endpoints, None)
    }

    const ROOMY: Bounds = Bounds {
        requests: 10,
        bytes: 1 << 20,
    };

    fn place(priority: i32, flow: &str) -> Place {
        Place {
            priority,
            flow: flow.into(),
            rule: "r".into(),
            bytes: 100,
        }
    }

    /// Waits for its turn and answers it: `left` says whether it leaves.
    async fn take_turn(w: &mut Waiting, left: bool) {
        match w.next().await {
            Next::Turn(t) => t.answer(left),
            _ => panic!("expected a turn"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_higher_priority_is_asked_first_and_the_lower_only_after_it_answers() {
        let metrics = Metrics::default();
        let flow = FlowControl::new(&metrics);
        let mut low = flow
            .enter(place(0, "a"), Duration::from_secs(5), ROOMY)
            .ok()
            .unwrap();
        let mut high = flow
            .enter(place(9, "a"), Duration::from_secs(5), ROOMY)
            .ok()
            .unwrap();
        let Next::Turn(turn) = high.next().await else {
            panic!("the high band is asked first");
        };
        // While the high request evaluates, the low one is not asked.
        let pending = tokio::time::timeout(Duration::from_millis(5), low.next()).await;
        assert!(
            pending.is_err(),
            "the low band waits for the high one's answer"
        );
        turn.answer(true);
        high.dispatched();
        take_turn(&mut low, false).await;
        assert_eq!(flow.waiting(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn once_a_rules_request_stays_its_lower_ones_wait_for_the_next_pass_and_other_rules_go_on()
     {
        let metrics = Metrics::default();
        let flow = FlowControl::new(&metrics);
        let five = Duration::from_secs(5);
        let mut high = flow.enter(place(9, "a"), five, ROOMY).ok().unwrap();
        let mut low = flow.enter(place(0, "a"), five, ROOMY).ok().unwrap();
        let other = Place {
            rule: "other".into(),
            ..place(0, "b")
        };
        let mut elsewhere = flow.enter(other, five, ROOMY).ok().unwrap();
        take_turn(&mut high, false).await;
        // The same rule's lower request is skipped in this pass; another
        // rule's is asked.
        take_turn(&mut elsewhere, false).await;
        let skipped = tokio::time::timeout(Duration::from_millis(5), low.next()).await;
        assert!(
            skipped.is_err(),
            "the low request of the full rule was asked"
        );
        // The next pass asks the high one first again.
        take_turn(&mut high, true).await;
        high.dispatched();
        take_turn(&mut low, false).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_at_its_deadline_and_gives_up_its_place() {
        let metrics = Metrics::default();
        let flow = FlowControl::new(&metrics);
        let mut w = flow
            .enter(place(0, "a"), Duration::from_millis(300), ROOMY)
            .ok()
            .unwrap();
        let start = tokio::time::Instant::now();
        loop {
            match w.next().await {
                Next::Turn(t) => t.answer(false),
                Next::Expired => break,
                Next::Shed(_) => panic!("nothing sheds here"),
            }
        }
        // Paused time: the deadline, to the timer's millisecond.
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(299) && waited <= Duration::from_millis(301),
            "{waited:?}"
        );
        drop(w);
        assert_eq!(flow.waiting(), 0);
        let text = rendered(&metrics);
        assert!(
            text.contains(
                r#"kinference_epp_flow_wait_seconds_count{priority="0",outcome="expired"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"kinference_epp_flow_waiting_requests{priority="0"} 0"#),
            "{text}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_sheds_its_lowest_priority_for_a_higher_one_with_the_reason() {
        let metrics = Metrics::default();
        let flow = FlowControl::new(&metrics);
        let two = Bounds {
            requests: 2,
            bytes: 1 << 20,
        };
        let mut low = flow
            .enter(place(0, "a"), Duration::from_secs(5), two)
            .ok()
            .unwrap();
        let _other = flow
            .enter(place(5, "a"), Duration::from_secs(5), two)
            .ok()
            .unwrap();
        let refused = flow.enter(place(0, "b"), Duration::from_secs(5), two).err();
        assert_eq!(refused, Some(Shed::Requests));
        let _high = flow
            .enter(place(9, "a"), Duration::from_secs(5), two)
            .ok()
            .unwrap();
        loop {
            match low.next().await {
                Next::Shed(why) => {
                    assert_eq!(why, Shed::Requests);
                    break;
                }
                Next::Turn(t) => t.answer(false),
                Next::Expired => panic!("shed before its deadline"),
            }
        }
        drop(low);
        let text = rendered(&metrics);
        assert!(
            text.contains(
                r#"kinference_epp_flow_shed_total{priority="0",reason="max_requests"} 2"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"kinference_epp_flow_waiting_requests{priority="9"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kinference_epp_flow_waiting_requests{priority="0"} 0"#),
            "{text}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_goes_away_mid_turn_does_not_stop_the_others() {
        let metrics = Metrics::default();
        let flow = FlowControl::new(&metrics);
        let mut gone = flow
            .enter(place(9, "a"), Duration::from_secs(5), ROOMY)
            .ok()
            .unwrap();
        let mut next = flow
            .enter(place(0, "a"), Duration::from_secs(5), ROOMY)
            .ok()
            .unwrap();
        let Next::Turn(turn) = gone.next().await else {
            panic!("a turn");
        };
        drop(turn);
        drop(gone);
        take_turn(&mut next, true).await;
        next.dispatched();
        assert_eq!(flow.waiting(), 0);
        let text = rendered(&metrics);
        assert!(
            text.contains(
                r#"kinference_epp_flow_wait_seconds_count{priority="9",outcome="cancelled"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"kinference_epp_flow_wait_seconds_count{priority="0",outcome="dispatched"} 1"#
            ),
            "{text}"
        );
    }
}
