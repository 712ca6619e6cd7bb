//! `flowControl` and a rule's `onEmpty: Wait`: how long a request may wait
//! in the EPP for room, and how much may wait at once.

use std::time::Duration;

use super::errors::Errors;
use crate::duration::parse_duration;
use crate::model::FlowControl;
use crate::spec::FlowControlSpec;

/// A waiting request holds its body and an ext_proc stream: a thousand of
/// them is well inside one EPP's memory and the gateway's stream limits.
pub const DEFAULT_MAX_WAITING: usize = 1000;
/// The bodies of the waiting requests: the default body budget's share
/// that leaves room for the requests being decided.
pub const DEFAULT_MAX_WAITING_BYTES: u64 = 64 << 20;
/// Long enough to ride out a burst, short of a client's usual timeout.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(10);
/// A gateway's stream timeout is seldom longer.
pub const MAX_MAX_WAIT: Duration = Duration::from_secs(600);

pub(super) fn compile_flow_control(
    errors: &mut Errors,
    spec: Option<&FlowControlSpec>,
) -> FlowControl {
    let spec = spec.cloned().unwrap_or_default();
    if spec.max_requests == Some(0) {
        errors.add("flowControl.maxRequests", "must be at least 1");
    }
    if spec.max_bytes == Some(0) {
        errors.add("flowControl.maxBytes", "must be at least 1");
    }
    FlowControl {
        max_requests: spec
            .max_requests
            .map_or(DEFAULT_MAX_WAITING, |n| n as usize),
        max_bytes: spec.max_bytes.unwrap_or(DEFAULT_MAX_WAITING_BYTES),
    }
}

/// `maxWait` of a rule that waits; `None` after an error.
pub(super) fn compile_max_wait(
    errors: &mut Errors,
    path: &str,
    max_wait: Option<&str>,
) -> Option<Duration> {
    let Some(text) = max_wait else {
        return Some(DEFAULT_MAX_WAIT);
    };
    match parse_duration(text) {
        Ok(d) if !d.is_zero() && d <= MAX_MAX_WAIT => Some(d),
        Ok(_) => {
            errors.add(
                format!("{path}.maxWait"),
                "must be more than 0 and at most 10m",
            );
            None
        }
        Err(e) => {
            errors.add(format!("{path}.maxWait"), format!("invalid duration: {e}"));
            None
        }
    }
}
