//! Provider API keys: which Secret keys the loaded policy names, resolving
//! them into [`Picker::provider_keys`](crate::picker::Picker), and the
//! standalone source — a directory laid out as mounted Secrets are
//! (`DIR/<secret-name>/<key>`). The Kubernetes source (a watch per Secret)
//! is [`crate::k8s::watch_provider_secrets`].
//!
//! Key values are never logged: only provider, Secret and key names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::ByteString;
use kinference_policy::CompiledPolicy;
pub use kinference_policy::spec::DEFAULT_SECRET_KEY;

use crate::server::Epp;
use kinference_runtime::sync::lock;

/// One provider's reference to its API key: key `key` of Secret `secret`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct KeyRef {
    pub provider: String,
    pub secret: String,
    pub key: String,
}

/// The key references of `policy`'s providers (those naming a Secret), with
/// the default key filled in.
pub fn key_refs(policy: &CompiledPolicy) -> Vec<KeyRef> {
    policy
        .providers
        .iter()
        .filter_map(|p| {
            let secret = p.secret.as_ref().filter(|s| !s.name.is_empty())?;
            Some(KeyRef {
                provider: p.name.clone(),
                secret: secret.name.clone(),
                key: secret
                    .key
                    .clone()
                    .unwrap_or_else(|| DEFAULT_SECRET_KEY.to_string()),
            })
        })
        .collect()
}

/// The key references of the policy `epp` serves now; none before one is loaded.
pub(crate) fn current_key_refs(epp: &Epp) -> Vec<KeyRef> {
    epp.policy()
        .current()
        .map(|p| key_refs(&p.compiled))
        .unwrap_or_default()
}

/// The distinct Secret names `refs` read from.
pub fn secret_names(refs: &[KeyRef]) -> BTreeSet<String> {
    refs.iter().map(|r| r.secret.clone()).collect()
}

/// What a source knows about one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyLookup {
    /// The raw value (trimmed by [`resolve`]).
    Value(String),
    /// Definitely absent, and why (names only, never a value).
    Missing(String),
    /// Not known yet (e.g. the Secret's first list is under way): no key,
    /// and nothing to warn about.
    Unknown,
}

/// A provider without its key, and why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct MissingKey {
    pub key_ref: KeyRef,
    pub why: String,
}

/// Keys by provider name, and the references that have none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resolved {
    pub keys: BTreeMap<String, String>,
    pub missing: BTreeSet<MissingKey>,
}

/// Looks every reference up; values are trimmed, and an empty value is no key.
pub fn resolve(refs: &[KeyRef], mut lookup: impl FnMut(&KeyRef) -> KeyLookup) -> Resolved {
    let mut out = Resolved::default();
    for r in refs {
        let why = match lookup(r) {
            KeyLookup::Value(v) if !v.trim().is_empty() => {
                out.keys.insert(r.provider.clone(), v.trim().to_string());
                continue;
            }
            KeyLookup::Value(_) => "the value is empty".to_string(),
            KeyLookup::Missing(why) => why,
            KeyLookup::Unknown => continue,
        };
        out.missing.insert(MissingKey {
            key_ref: r.clone(),
            why,
        });
    }
    out
}

/// Publishes resolved keys to the picker, logging (names only) what changed
/// since the last call: providers gaining or losing a key, and each newly
/// missing key once.
#[derive(Debug, Default)]
pub(crate) struct KeyPublisher {
    missing: BTreeSet<MissingKey>,
}

impl KeyPublisher {
    pub fn publish(&mut self, epp: &Epp, resolved: Resolved) {
        for m in resolved.missing.difference(&self.missing) {
            tracing::warn!(
                provider = %m.key_ref.provider,
                secret = %m.key_ref.secret,
                key = %m.key_ref.key,
                why = %m.why,
                "no API key for provider; its requests fail until one appears"
            );
        }
        self.missing = resolved.missing;
        let current = epp.picker.provider_keys.load();
        if **current != resolved.keys {
            let providers: Vec<&String> = resolved.keys.keys().collect();
            tracing::info!(?providers, "provider API keys updated");
            epp.picker.provider_keys.store(Arc::new(resolved.keys));
        }
    }
}

/// Reads each reference's key from `dir/<secret>/<key>` (a mounted Secret's
/// layout; its symlinks are followed).
pub fn load_from_dir(dir: &Path, refs: &[KeyRef]) -> Resolved {
    resolve(refs, |r| {
        // Secret names and keys never contain a separator or are `.`/`..`;
        // refuse anything that would leave the directory.
        let unsafe_part =
            |s: &str| s.is_empty() || s == "." || s == ".." || s.contains(['/', '\\']);
        if unsafe_part(&r.secret) || unsafe_part(&r.key) {
            return KeyLookup::Missing("not a valid Secret or key name".to_string());
        }
        let path = dir.join(&r.secret).join(&r.key);
        match std::fs::read(&path) {
            Ok(bytes) => KeyLookup::Value(String::from_utf8_lossy(&bytes).into_owned()),
            Err(e) => KeyLookup::Missing(format!("cannot read {}: {}", path.display(), e.kind())),
        }
    })
}

/// Keeps provider keys loaded from `dir` (see [`load_from_dir`]): at once,
/// whenever the policy changes and every `every` (files change under a
/// mounted Secret without notice).
pub fn watch_secrets_dir(epp: Epp, dir: PathBuf, every: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut changes = epp.policy().subscribe();
        let mut publisher = KeyPublisher::default();
        loop {
            // Before a policy is loaded there is nothing to read (nor to clear).
            if epp.policy().current().is_some() {
                let refs = current_key_refs(&epp);
                let dir = dir.clone();
                match tokio::task::spawn_blocking(move || load_from_dir(&dir, &refs)).await {
                    Ok(resolved) => publisher.publish(&epp, resolved),
                    Err(error) => tracing::warn!(%error, "reading provider keys failed"),
                }
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(every) => {}
            }
        }
    })
}

/// What the Kubernetes Secret watches (see
/// [`crate::k8s::watch_provider_secrets`]) know: each watched Secret's data
/// once its first list is done (`None`: it does not exist); a Secret not yet
/// listed is absent. Keys are published while the lock is held, so
/// publications cannot overtake one another.
#[derive(Default)]
pub(crate) struct SecretCache {
    pub(crate) secrets: BTreeMap<String, Option<BTreeMap<String, ByteString>>>,
    publisher: KeyPublisher,
}

pub(crate) type SharedSecretCache = Arc<Mutex<SecretCache>>;

impl SecretCache {
    pub(crate) fn lock(cache: &SharedSecretCache) -> MutexGuard<'_, SecretCache> {
        lock(cache)
    }

    /// Resolves the current policy's keys from the cache into the picker.
    pub(crate) fn publish(&mut self, epp: &Epp) {
        if epp.policy().current().is_none() {
            return;
        }
        let resolved = resolve(&current_key_refs(epp), |r| {
            match self.secrets.get(&r.secret) {
                None => KeyLookup::Unknown,
                Some(None) => KeyLookup::Missing("the Secret does not exist".to_string()),
                Some(Some(data)) => match data.get(&r.key) {
                    Some(v) => KeyLookup::Value(String::from_utf8_lossy(&v.0).into_owned()),
                    None => KeyLookup::Missing("the Secret has no such key".to_string()),
                },
            }
        });
        self.publisher.publish(epp, resolved);
    }
}
