//! What this process remembers between reconciles of a policy: what it
//! applied, the status it last wrote, and how often the policy has failed in
//! a row. Kept per policy uid, forgotten when the policy is gone.
//!
//! Nothing here is needed for correctness after a restart: a new process
//! remembers nothing, applies everything once (no-op applies), and reads the
//! status from the cache.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kinference_api::InferencePolicyStatus;
use kinference_runtime::sync::lock;
use serde::Serialize;

/// The version of an object that a write by anyone else would change: the
/// generation for kinds that have one (status writes, such as a Deployment's
/// rollout progress, do not move it), else the resourceVersion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Version {
    Generation(i64),
    Resource(String),
}

impl Version {
    pub fn of(meta: &ObjectMeta) -> Option<Self> {
        match (meta.generation, &meta.resource_version) {
            (Some(g), _) => Some(Self::Generation(g)),
            (None, Some(rv)) => Some(Self::Resource(rv.clone())),
            (None, None) => None,
        }
    }
}

/// What an apply left behind: the desired object's digest and the version
/// the API server answered with.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Applied {
    digest: u64,
    version: Version,
}

#[derive(Debug, Default)]
struct PolicyMemory {
    /// By `Kind/name`.
    applied: HashMap<String, Applied>,
    status: Option<InferencePolicyStatus>,
    failures: u32,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct Memory {
    policies: Mutex<HashMap<String, PolicyMemory>>,
}

/// A digest of what would be sent. Stable within a process, which is as
/// long as it is kept.
pub fn digest<T: Serialize>(obj: &T) -> u64 {
    let bytes = serde_json::to_vec(obj).expect("generated objects always serialize");
    let mut h = DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

impl Memory {
    fn with<R>(&self, uid: &str, f: impl FnOnce(&mut PolicyMemory) -> R) -> R {
        let mut policies = lock(&self.policies);
        f(policies.entry(uid.to_string()).or_default())
    }

    /// Whether `key` was applied with this digest and nobody has written it
    /// since: the cached object is still at the version the apply returned.
    pub fn unchanged(
        &self,
        uid: &str,
        key: &str,
        digest: u64,
        cached: Option<&ObjectMeta>,
    ) -> bool {
        let Some(version) = cached.and_then(Version::of) else {
            return false;
        };
        self.with(uid, |m| {
            m.applied.get(key) == Some(&Applied { digest, version })
        })
    }

    pub fn applied(&self, uid: &str, key: &str, digest: u64, answer: &ObjectMeta) {
        let Some(version) = Version::of(answer) else {
            return;
        };
        self.with(uid, |m| {
            m.applied
                .insert(key.to_string(), Applied { digest, version });
        });
    }

    /// The digest of what this process last applied as `key`.
    pub fn applied_digest(&self, uid: &str, key: &str) -> Option<u64> {
        self.with(uid, |m| m.applied.get(key).map(|a| a.digest))
    }

    /// Forgets an object deleted on purpose, or one whose apply failed.
    pub fn forget_object(&self, uid: &str, key: &str) {
        self.with(uid, |m| {
            m.applied.remove(key);
        });
    }

    /// The status this process last wrote, if any. Newer than the cache's
    /// copy until the watch catches up with the write.
    pub fn status(&self, uid: &str) -> Option<InferencePolicyStatus> {
        self.with(uid, |m| m.status.clone())
    }

    pub fn wrote_status(&self, uid: &str, status: &InferencePolicyStatus) {
        self.with(uid, |m| m.status = Some(status.clone()));
    }

    /// Counts a failure; returns how long to wait before the next attempt:
    /// `base`, doubled per failure in a row, at most `max`.
    pub fn failed(&self, uid: &str, base: Duration, max: Duration) -> Duration {
        let failures = self.with(uid, |m| {
            m.failures = m.failures.saturating_add(1);
            m.failures
        });
        let factor = 2u32.saturating_pow(failures.saturating_sub(1).min(16));
        base.saturating_mul(factor).min(max)
    }

    pub fn succeeded(&self, uid: &str) {
        self.with(uid, |m| m.failures = 0);
    }

    /// Keeps only the policies `live` says still exist.
    pub fn retain(&self, mut live: impl FnMut(&str) -> bool) {
        let mut policies = lock(&self.policies);
        policies.retain(|uid, _| live(uid));
    }

    pub fn forget(&self, uid: &str) {
        let mut policies = lock(&self.policies);
        policies.remove(uid);
    }

    #[cfg(test)]
    fn remembered(&self) -> usize {
        self.policies.lock().map(|p| p.len()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(generation: Option<i64>, rv: &str) -> ObjectMeta {
        ObjectMeta {
            generation,
            resource_version: Some(rv.into()),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn an_object_is_unchanged_until_its_digest_or_version_moves() {
        let m = Memory::default();
        let cm = meta(None, "10");
        assert!(
            !m.unchanged("u", "ConfigMap/a", 1, Some(&cm)),
            "never applied"
        );
        m.applied("u", "ConfigMap/a", 1, &cm);
        assert!(m.unchanged("u", "ConfigMap/a", 1, Some(&cm)));
        assert!(
            !m.unchanged("u", "ConfigMap/a", 2, Some(&cm)),
            "new desired state"
        );
        assert!(
            !m.unchanged("u", "ConfigMap/a", 1, Some(&meta(None, "11"))),
            "written by someone"
        );
        assert!(!m.unchanged("u", "ConfigMap/a", 1, None), "deleted");
        assert!(
            !m.unchanged("other", "ConfigMap/a", 1, Some(&cm)),
            "another policy"
        );
        m.forget_object("u", "ConfigMap/a");
        assert!(!m.unchanged("u", "ConfigMap/a", 1, Some(&cm)));
    }

    #[test]
    fn status_writes_do_not_count_for_kinds_with_a_generation() {
        let m = Memory::default();
        m.applied("u", "Deployment/epp", 7, &meta(Some(1), "10"));
        // The controller-manager wrote rollout progress: rv moved, generation not.
        assert!(m.unchanged("u", "Deployment/epp", 7, Some(&meta(Some(1), "12"))));
        // Someone edited the spec.
        assert!(!m.unchanged("u", "Deployment/epp", 7, Some(&meta(Some(2), "13"))));
    }

    #[test]
    fn failures_back_off_and_reset() {
        let m = Memory::default();
        let (base, max) = (Duration::from_secs(5), Duration::from_secs(300));
        let waits: Vec<u64> = (0..8).map(|_| m.failed("u", base, max).as_secs()).collect();
        assert_eq!(waits, [5, 10, 20, 40, 80, 160, 300, 300]);
        m.succeeded("u");
        assert_eq!(m.failed("u", base, max), base);
        // Hundreds of failures never overflow.
        for _ in 0..1000 {
            m.failed("u", base, max);
        }
        assert_eq!(m.failed("u", base, max), max);
    }

    #[test]
    fn gone_policies_are_forgotten() {
        let m = Memory::default();
        m.succeeded("a");
        m.succeeded("b");
        m.retain(|uid| uid == "b");
        assert_eq!(m.remembered(), 1);
        m.forget("b");
        assert_eq!(m.remembered(), 0);
    }
}
