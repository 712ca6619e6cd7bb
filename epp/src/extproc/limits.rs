//! What one client can make the EPP hold. A stream buffers its request body
//! until the body is whole (the decision needs the prompt), so without a
//! shared budget a few clients that never finish their bodies hold memory
//! until the EPP is OOM-killed, failing every request of the pool.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus_client::metrics::gauge::Gauge;

/// Request-body bytes buffered across all streams, bounded by `limit`.
///
/// The count lives in the gauge that `/metrics` renders, so what is served
/// and what is enforced cannot drift apart.
#[derive(Debug)]
pub struct BodyBudget {
    limit: i64,
    used: Gauge,
}

impl BodyBudget {
    pub fn new(limit: usize, used: Gauge) -> Arc<Self> {
        Arc::new(BodyBudget {
            limit: i64::try_from(limit).unwrap_or(i64::MAX),
            used,
        })
    }

    /// Bytes held by all streams now.
    #[cfg(test)]
    pub(crate) fn used(&self) -> usize {
        usize::try_from(self.used.get()).unwrap_or(0)
    }

    /// An empty hold on this budget, for one stream.
    pub(crate) fn hold(self: &Arc<Self>) -> BodyHold {
        BodyHold {
            budget: Arc::clone(self),
            bytes: 0,
        }
    }

    fn try_take(&self, n: i64) -> bool {
        self.used
            .inner()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|total| *total <= self.limit)
            })
            .is_ok()
    }
}

/// One stream's share of the [`BodyBudget`]; returned when dropped.
#[derive(Debug)]
pub struct BodyHold {
    budget: Arc<BodyBudget>,
    bytes: i64,
}

impl BodyHold {
    /// Takes `n` more bytes, or nothing if the budget cannot spare them.
    #[must_use]
    pub(crate) fn grow(&mut self, n: usize) -> bool {
        let Ok(n) = i64::try_from(n) else {
            return false;
        };
        if !self.budget.try_take(n) {
            return false;
        }
        self.bytes += n;
        true
    }

    /// Gives everything back (the body was consumed).
    pub fn release(&mut self) {
        self.budget.used.dec_by(std::mem::take(&mut self.bytes));
    }
}

impl Drop for BodyHold {
    fn drop(&mut self) {
        self.release();
    }
}

/// Counts a stream as open while held.
pub(crate) struct StreamGuard(Gauge);

impl StreamGuard {
    pub fn new(open: &Gauge) -> Self {
        open.inc();
        StreamGuard(open.clone())
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_share_one_limit_and_give_back_on_drop() {
        let gauge = Gauge::default();
        let budget = BodyBudget::new(100, gauge.clone());
        let mut a = budget.hold();
        let mut b = budget.hold();
        assert!(a.grow(60));
        assert!(!b.grow(41), "over the limit together");
        assert_eq!(budget.used(), 60, "a refused grow takes nothing");
        assert!(b.grow(40));
        assert_eq!(gauge.get(), 100);
        drop(a);
        assert_eq!(budget.used(), 40);
        b.release();
        assert_eq!(budget.used(), 0);
        assert!(b.grow(100), "a released hold can take again");
        drop(b);
        assert_eq!(gauge.get(), 0);
    }

    #[test]
    fn a_grow_that_overflows_is_refused() {
        let budget = BodyBudget::new(usize::MAX, Gauge::default());
        let mut a = budget.hold();
        assert!(a.grow(usize::MAX / 2));
        assert!(!a.grow(usize::MAX));
    }

    #[test]
    fn stream_guard_counts_open_streams() {
        let open = Gauge::default();
        let one = StreamGuard::new(&open);
        let two = StreamGuard::new(&open);
        assert_eq!(open.get(), 2);
        drop(one);
        drop(two);
        assert_eq!(open.get(), 0);
    }
}
