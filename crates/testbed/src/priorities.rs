//! What the flow-control benches share: open-loop arrivals in priority
//! classes, and the policy rule that makes requests wait for room.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One arrival: when it is sent (from the start), and its class (an index
/// into the shares it was drawn by).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Arrival {
    pub at: Duration,
    pub class: usize,
}

/// `seconds` of Poisson arrivals at `rate` a second, each in a class drawn
/// by `shares` (the last takes what the others leave), the same for every
/// `seed`.
pub fn arrivals(rate: f64, seconds: f64, shares: &[f64], seed: u64) -> Vec<Arrival> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut at = 0.0;
    let mut out = Vec::new();
    loop {
        at += -(1.0 - rng.random::<f64>()).ln() / rate;
        if at > seconds {
            return out;
        }
        let draw = rng.random::<f64>();
        let mut acc = 0.0;
        let class = shares
            .iter()
            .position(|share| {
                acc += share;
                draw < acc
            })
            .unwrap_or(shares.len().saturating_sub(1));
        out.push(Arrival {
            at: Duration::from_secs_f64(at),
            class,
        });
    }
}

/// A policy rule (YAML, in a `rules:` list) that counts a Pod full at
/// `full_at` requests in flight and lets the requests that find every Pod
/// full wait in the EPP up to 10 s. `matches`: the rule's `matches:` line,
/// indented, or empty for every request.
pub fn waiting_rule(name: &str, matches: &str, full_at: usize) -> String {
    format!(
        "  - name: {name}
{matches}    route:
      exclude:
        - drop: {{ InFlight: {{ greaterThanOrEqual: {full_at} }} }}
      select: [{{ minimize: InFlight }}]
      tieBreak: Random
      onEmpty: Wait
      maxWait: 10s
"
    )
}

/// The `matches:` line of a rule for positive priorities only.
pub const POSITIVE_PRIORITY: &str = "    matches: [{ priority: { greaterThan: 0 } }]\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_follow_the_rate_and_the_shares() {
        let shares = [0.2, 0.2, 0.6];
        let a = arrivals(100.0, 50.0, &shares, 42);
        assert_eq!(a, arrivals(100.0, 50.0, &shares, 42), "reproducible");
        assert!((4_700..5_300).contains(&a.len()), "{}", a.len());
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
        for (class, share) in shares.iter().enumerate() {
            let n = a.iter().filter(|x| x.class == class).count() as f64;
            let seen = n / a.len() as f64;
            assert!((seen - share).abs() < 0.03, "class {class}: {seen}");
        }
    }
}
