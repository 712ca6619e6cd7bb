//! Which Pods carry a hot group.
//!
//! A hot group's Pod serves it from its cache: its engine shows few
//! requests running and none waiting, and its cache has room, so by load
//! and by room it looks the best place for another group, whose requests
//! would then queue behind the hot group's, and the hot group's behind
//! their prefills. Its share of this EPP's recent routes tells it apart.
//! The engines' load does not: at a pool's start the Pods prefilling new
//! groups run more requests than the hot group's Pod.

use super::{Local, per_model};

/// A Pod carries a hot group when it took more than this many times the
/// mean of the recent routes of the Pods serving the model ...
const HOT_SHARE: f64 = 2.0;
/// ... and at least this many of them (decayed): about 2.8 requests a
/// second held (8 × ln 2 ÷ the 2 s half-life), so that a pool's first
/// routes, and a Pod below that rate, flag nobody.
const HOT_MIN_ROUTES: f64 = 8.0;

/// Per candidate, whether its Pod carries a hot group: routed more than
/// [`HOT_SHARE`] times the mean of the recent routes of the Pods serving
/// the candidate's model, and at least [`HOT_MIN_ROUTES`] (so among two
/// Pods, never). Several cold groups on one Pod count too: what is read is
/// the Pod's share of the traffic, which a new group's would join. The
/// mean is over the Pods the request may go to (a subset hint of one or
/// two flags none). False for providers.
pub(super) fn carriers<P>(locals: &[Option<Local<'_, P>>]) -> Vec<bool> {
    let of_model = per_model(locals, |(pods, routes): &mut (f64, f64), l| {
        *pods += 1.0;
        *routes += l.recent_routes;
    });
    let hot = |routes: f64, (pods, total): (f64, f64)| {
        routes >= HOT_MIN_ROUTES && routes * pods > HOT_SHARE * total
    };
    locals
        .iter()
        .zip(of_model)
        .map(|(l, m)| matches!((l, m), (Some(l), Some(m)) if hot(l.recent_routes, m)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::testing::{FakePod, local};
    use super::*;

    /// Which of `(model, recent routes)`, followed by a provider, carry a
    /// hot group.
    fn hot_of(pods: &[(&'static str, f64)]) -> Vec<bool> {
        let mut locals: Vec<_> = pods
            .iter()
            .map(|&(model, routes)| {
                let mut l = local(model, 0.0, (0.0, 0.0), FakePod::default());
                l.recent_routes = routes;
                Some(l)
            })
            .collect();
        locals.push(None);
        carriers(&locals)
    }

    #[test]
    fn a_pod_carries_a_hot_group_above_twice_its_models_mean() {
        let four = hot_of(&[("a", 60.0), ("a", 10.0), ("a", 10.0), ("a", 10.0)]);
        assert_eq!(four, [true, false, false, false, false]);
        // Among two Pods, more than twice the mean is more than both.
        let two = hot_of(&[("a", 60.0), ("a", 0.0)]);
        assert_eq!(two, [false, false, false]);
        // Too few routes to tell a hot group from a pool's first requests.
        let few = hot_of(&[("a", 7.0), ("a", 0.0), ("a", 0.0)]);
        assert_eq!(few, [false, false, false, false]);
    }

    #[test]
    fn a_pod_is_compared_with_its_own_models_pods() {
        // Model a's two Pods take most of the traffic, b's four little:
        // over all six, a's would both count as hot.
        let set = hot_of(&[
            ("a", 40.0),
            ("a", 40.0),
            ("b", 5.0),
            ("b", 5.0),
            ("b", 5.0),
            ("b", 5.0),
        ]);
        assert_eq!(set, [false; 7]);
        let one_hot_b = hot_of(&[("a", 40.0), ("b", 30.0), ("b", 1.0), ("b", 1.0)]);
        assert_eq!(one_hot_b, [false, true, false, false, false]);
    }
}
