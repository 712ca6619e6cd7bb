//! `sessionAffinity`: which Pod each session's last request went to.
//!
//! Keys are client-controlled, so the table holds a seeded hash of each key
//! (never the key: it may be a credential, and it is never logged), is
//! bounded, and forgets a session its policy's TTL after its last request.
//! A full table first drops the expired sessions (at most once a second, so
//! a flood of new keys costs no scan per request); still full, it does not
//! take the new session, which is then routed by the tiers alone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kinference_policy::model::{SessionAffinity, SessionKey};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use kinference_runtime::sync::lock;

/// Sessions remembered at once.
pub(crate) const MAX_SESSIONS: usize = 100_000;
/// Bytes of a session key that count: a longer key is told apart by these.
const MAX_KEY_BYTES: usize = 256;
/// The least time between two scans for expired sessions.
const PURGE_EVERY: Duration = Duration::from_secs(1);

pub struct Sessions {
    inner: Mutex<Table>,
    capacity: usize,
    seed: u64,
}

struct Table {
    by_key: HashMap<u64, Pinned>,
    last_purge: Option<Instant>,
}

struct Pinned {
    address: Arc<str>,
    seen: Instant,
}

impl Default for Sessions {
    fn default() -> Self {
        Sessions::with_capacity(MAX_SESSIONS)
    }
}

impl Sessions {
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Sessions {
            inner: Mutex::new(Table {
                by_key: HashMap::new(),
                last_purge: None,
            }),
            capacity,
            seed: rand::random(),
        }
    }

    /// The request's session, read as `affinity` names it: the hashed key.
    pub(crate) fn key_of(
        &self,
        affinity: &SessionAffinity,
        headers: &std::collections::BTreeMap<String, String>,
    ) -> Option<u64> {
        let value = match &affinity.key {
            SessionKey::Header(name) => headers.get(name).map(String::as_str),
            SessionKey::Cookie(name) => headers.get("cookie").and_then(|c| cookie(c, name)),
        }?;
        let value = value.trim();
        if value.is_empty() {
            return None;
        }
        let end = value.len().min(MAX_KEY_BYTES);
        Some(xxh3_64_with_seed(&value.as_bytes()[..end], self.seed))
    }

    /// The `ip:port` the session's last request went to, if it was within
    /// `ttl` of `now`.
    pub(crate) fn address_of(&self, key: u64, ttl: Duration, now: Instant) -> Option<Arc<str>> {
        let table = lock(&self.inner);
        let pinned = table.by_key.get(&key)?;
        (now.saturating_duration_since(pinned.seen) <= ttl).then(|| Arc::clone(&pinned.address))
    }

    /// The session's request went to `address` at `now`.
    pub(crate) fn remember(&self, key: u64, address: &str, ttl: Duration, now: Instant) {
        let mut table = lock(&self.inner);
        if let Some(pinned) = table.by_key.get_mut(&key) {
            if &*pinned.address != address {
                pinned.address = Arc::from(address);
            }
            pinned.seen = now;
            return;
        }
        if table.by_key.len() >= self.capacity {
            let due = table
                .last_purge
                .is_none_or(|at| now.saturating_duration_since(at) >= PURGE_EVERY);
            if !due {
                return;
            }
            table.last_purge = Some(now);
            table
                .by_key
                .retain(|_, p| now.saturating_duration_since(p.seen) <= ttl);
            if table.by_key.len() >= self.capacity {
                return;
            }
        }
        table.by_key.insert(
            key,
            Pinned {
                address: Arc::from(address),
                seen: now,
            },
        );
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.inner).by_key.len()
    }
}

/// The value of cookie `name` in a `cookie` header (`a=1; b=2`).
fn cookie<'a>(header: &'a str, name: &str) -> Option<&'a str> {
    header.split(';').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim() == name).then(|| v.trim().trim_matches('"'))
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn affinity(key: SessionKey) -> SessionAffinity {
        SessionAffinity {
            key,
            ttl: Duration::from_secs(60),
        }
    }

    #[test]
    fn the_key_comes_from_the_named_header_or_cookie() {
        let sessions = Sessions::default();
        let headers = BTreeMap::from([
            ("x-session-id".to_string(), "s1".to_string()),
            (
                "cookie".to_string(),
                "theme=dark; sid=\"s1\"; x=y".to_string(),
            ),
        ]);
        let by_header = sessions.key_of(
            &affinity(SessionKey::Header("x-session-id".into())),
            &headers,
        );
        let by_cookie = sessions.key_of(&affinity(SessionKey::Cookie("sid".into())), &headers);
        assert!(by_header.is_some());
        assert_eq!(
            by_header, by_cookie,
            "the same session value, however carried"
        );
        assert_eq!(
            sessions.key_of(&affinity(SessionKey::Cookie("other".into())), &headers),
            None
        );
        assert_eq!(
            sessions.key_of(&affinity(SessionKey::Header("x-none".into())), &headers),
            None
        );
        let empty = BTreeMap::from([("x-session-id".to_string(), "  ".to_string())]);
        assert_eq!(
            sessions.key_of(&affinity(SessionKey::Header("x-session-id".into())), &empty),
            None
        );
    }

    #[test]
    fn a_session_is_remembered_until_its_ttl_and_follows_its_last_pod() {
        let sessions = Sessions::default();
        let ttl = Duration::from_secs(60);
        let t0 = Instant::now();
        sessions.remember(1, "10.0.0.1:8000", ttl, t0);
        assert_eq!(
            sessions.address_of(1, ttl, t0 + ttl).as_deref(),
            Some("10.0.0.1:8000")
        );
        assert_eq!(
            sessions.address_of(1, ttl, t0 + ttl + Duration::from_millis(1)),
            None
        );
        // Moved, and seen again: the new Pod, its clock restarted.
        sessions.remember(1, "10.0.0.2:8000", ttl, t0 + ttl / 2);
        assert_eq!(
            sessions.address_of(1, ttl, t0 + ttl).as_deref(),
            Some("10.0.0.2:8000")
        );
        assert_eq!(sessions.address_of(2, ttl, t0), None);
    }

    #[test]
    fn a_full_table_takes_a_new_session_only_in_place_of_an_expired_one() {
        let sessions = Sessions::with_capacity(2);
        let ttl = Duration::from_secs(60);
        let t0 = Instant::now();
        sessions.remember(1, "a:1", ttl, t0);
        sessions.remember(2, "b:1", ttl, t0 + Duration::from_secs(30));
        // Full, nothing expired: the third is not taken.
        sessions.remember(3, "c:1", ttl, t0 + Duration::from_secs(31));
        assert_eq!(sessions.len(), 2);
        assert_eq!(
            sessions.address_of(3, ttl, t0 + Duration::from_secs(31)),
            None
        );
        // Within a second of that scan: no scan, even though 1 has expired.
        sessions.remember(4, "d:1", ttl, t0 + Duration::from_secs(61));
        assert_eq!(sessions.len(), 2);
        // A second later, session 1 has expired and makes room.
        sessions.remember(4, "d:1", ttl, t0 + Duration::from_secs(62));
        assert_eq!(sessions.len(), 2);
        assert_eq!(
            sessions
                .address_of(4, ttl, t0 + Duration::from_secs(62))
                .as_deref(),
            Some("d:1")
        );
        assert_eq!(
            sessions
                .address_of(2, ttl, t0 + Duration::from_secs(62))
                .as_deref(),
            Some("b:1")
        );
    }
}
