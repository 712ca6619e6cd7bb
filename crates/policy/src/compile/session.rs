//! `sessionAffinity`: the request's session key, and how long a session is
//! remembered.

use std::time::Duration;

use super::errors::Errors;
use crate::duration::parse_duration;
use crate::model::{SessionAffinity, SessionKey};
use crate::spec::SessionAffinitySpec;

/// A session not seen for this long is forgotten, unless the policy says.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(600);
/// The longest a session may be remembered.
pub const MAX_SESSION_TTL: Duration = Duration::from_secs(24 * 3600);

fn nonempty(name: &Option<String>) -> Option<&str> {
    name.as_deref().map(str::trim).filter(|n| !n.is_empty())
}

pub(super) fn compile_session_affinity(
    errors: &mut Errors,
    spec: &SessionAffinitySpec,
) -> Option<SessionAffinity> {
    const PATH: &str = "sessionAffinity";
    let key = match (nonempty(&spec.header), nonempty(&spec.cookie)) {
        (Some(header), None) => Some(SessionKey::Header(header.to_ascii_lowercase())),
        (None, Some(cookie)) => Some(SessionKey::Cookie(cookie.to_string())),
        (Some(_), Some(_)) => {
            errors.add(PATH, "name either a header or a cookie, not both");
            None
        }
        (None, None) => {
            errors.add(
                PATH,
                "name the header or the cookie that carries the session key, e.g. { header: x-session-id }",
            );
            None
        }
    };
    let ttl = match spec.ttl.as_deref().map(parse_duration) {
        None => Some(DEFAULT_SESSION_TTL),
        Some(Ok(d)) if !d.is_zero() && d <= MAX_SESSION_TTL => Some(d),
        Some(Ok(_)) => {
            errors.add(format!("{PATH}.ttl"), "must be more than 0 and at most 24h");
            None
        }
        Some(Err(e)) => {
            errors.add(format!("{PATH}.ttl"), format!("invalid duration: {e}"));
            None
        }
    };
    Some(SessionAffinity {
        key: key?,
        ttl: ttl?,
    })
}
