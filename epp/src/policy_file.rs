//! `--policy-file`: reloads the policy when the file changes. A mounted
//! ConfigMap changes by swapping a `..data` symlink in the file's folder, so
//! the folder is watched (inotify, debounced), and content decides whether
//! anything changed. A slow metadata check covers filesystems without change
//! events. The file is read only when something changed, and each outcome is
//! logged once, not once per check.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use notify::RecursiveMode;
use notify_debouncer_mini::{DebounceEventResult, new_debouncer};
use tokio::sync::mpsc;

use crate::policy_store::PolicyStore;

/// Change events closer together than this make one reload.
const DEBOUNCE: Duration = Duration::from_millis(200);
/// How often the file's metadata is checked without an event.
const FALLBACK_CHECK: Duration = Duration::from_secs(30);

/// What a check saw, to tell a change from the same state seen again.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    /// A hash of the content: enough to tell a change, without keeping a
    /// large file in memory twice.
    Content(u64),
    Unreadable(String),
}

/// Metadata that changes whenever the file (or the symlink's target) does.
type Stamp = Option<(u64, Option<SystemTime>, u64)>;

fn stamp(path: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.len(), m.modified().ok(), m.ino()))
}

/// Watches `path` and loads each new content into `store` until dropped
/// (abort the task). Returns only if the watcher cannot be set up.
pub fn watch(store: Arc<PolicyStore>, path: PathBuf) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let (tx, mut events) = mpsc::unbounded_channel();
        let folder = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        let debouncer = new_debouncer(DEBOUNCE, move |result: DebounceEventResult| {
            let _ = tx.send(result.is_ok());
        })
        .and_then(|mut d| {
            d.watcher().watch(&folder, RecursiveMode::NonRecursive)?;
            Ok(d)
        });
        // Without events the metadata check still notices changes.
        let _debouncer = match debouncer {
            Ok(d) => Some(d),
            Err(error) => {
                tracing::warn!(%error, folder = %folder.display(), "cannot watch the policy file's folder; checking it every 30 s");
                None
            }
        };
        let mut last_seen = None;
        let mut last_stamp = None;
        // The first check, and one after every event, reads the file even if
        // its metadata looks the same (a same-size rewrite within the
        // clock's resolution, or a file that is still missing).
        let mut force = true;
        let mut tick = tokio::time::interval(FALLBACK_CHECK);
        loop {
            let now_stamp = stamp(&path);
            if force || now_stamp != last_stamp {
                last_stamp = now_stamp;
                check(&store, &path, &mut last_seen).await;
            }
            tokio::select! {
                Some(_) = events.recv() => force = true,
                _ = tick.tick() => force = false,
            }
        }
    })
}

fn content_hash(text: &str) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

/// Reads the file and, if what it shows differs from `last`, loads or
/// reports it.
async fn check(store: &PolicyStore, path: &Path, last: &mut Option<Seen>) {
    // Off the async workers: a policy file can be large.
    let read = tokio::fs::read_to_string(path).await;
    let seen = match &read {
        Ok(text) => Seen::Content(content_hash(text)),
        Err(error) => Seen::Unreadable(error.to_string()),
    };
    if last.as_ref() == Some(&seen) {
        return;
    }
    *last = Some(seen);
    match read {
        Ok(text) => {
            let result = if path.extension().is_some_and(|e| e == "json") {
                store.load_json(&text)
            } else {
                store.load_text(&text)
            };
            if let Ok(hash) = result {
                tracing::info!(%hash, path = %path.display(), "policy loaded");
            }
            // A refusal is logged (once) by the store.
        }
        Err(error) => store.refuse(format!("cannot read {}: {error}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy_store::LoadState;

    const GOOD: &str = "pool: { selector: { app: x }, targetPorts: [{ number: 8000 }] }\nrules:\n  - name: r\n    route: { select: [{ minimize: QueueDepth }] }\n";

    async fn eventually(what: &str, f: impl Fn() -> bool) {
        for _ in 0..100 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{what}");
    }

    fn serving(store: &PolicyStore) -> Option<String> {
        match store.state() {
            LoadState::Loaded { hash } => Some(hash),
            LoadState::Refused { serving, .. } => serving,
            LoadState::Empty => None,
        }
    }

    #[tokio::test]
    async fn reloads_on_change_and_reports_a_missing_file_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.yaml");
        std::fs::write(&path, GOOD).unwrap();
        let store = Arc::new(PolicyStore::default());
        let task = watch(Arc::clone(&store), path.clone());
        eventually("loaded", || {
            matches!(store.state(), LoadState::Loaded { .. })
        })
        .await;
        let first = store.loaded_hash().unwrap();

        // A change is picked up by its event, well before the 30 s check.
        std::fs::write(&path, GOOD.replace("name: r", "name: s")).unwrap();
        eventually("reloaded", || store.loaded_hash().as_ref() != Some(&first)).await;
        let second = store.loaded_hash().unwrap();

        // Garbage: refused once, the last good policy keeps serving.
        std::fs::write(&path, "rules: [").unwrap();
        eventually("refused", || {
            matches!(store.state(), LoadState::Refused { .. })
        })
        .await;
        assert_eq!(serving(&store), Some(second.clone()));
        assert_eq!(store.refusals().get(), 1);

        // Deleted: the state says so (not `Loaded`), still serving, one refusal.
        std::fs::remove_file(&path).unwrap();
        eventually("missing reported", || {
            matches!(store.state(), LoadState::Refused { error, .. } if error.contains("cannot read"))
        })
        .await;
        assert_eq!(serving(&store), Some(second.clone()));
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(
            store.refusals().get(),
            2,
            "one refusal per change, not per check"
        );

        // Back again: loaded.
        std::fs::write(&path, GOOD).unwrap();
        eventually("loaded again", || {
            matches!(store.state(), LoadState::Loaded { .. })
        })
        .await;
        assert_eq!(store.loaded_hash(), Some(first));
        task.abort();
    }

    #[tokio::test]
    async fn follows_a_configmap_style_symlink_swap() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // kubelet's layout: policy.yaml -> ..data/policy.yaml, ..data -> ..v1
        std::fs::create_dir(root.join("..v1")).unwrap();
        std::fs::write(root.join("..v1/policy.yaml"), GOOD).unwrap();
        symlink("..v1", root.join("..data")).unwrap();
        symlink("..data/policy.yaml", root.join("policy.yaml")).unwrap();
        let store = Arc::new(PolicyStore::default());
        let task = watch(Arc::clone(&store), root.join("policy.yaml"));
        eventually("loaded", || store.loaded_hash().is_some()).await;
        let first = store.loaded_hash().unwrap();

        std::fs::create_dir(root.join("..v2")).unwrap();
        std::fs::write(
            root.join("..v2/policy.yaml"),
            GOOD.replace("name: r", "name: v2"),
        )
        .unwrap();
        symlink("..v2", root.join("..data_tmp")).unwrap();
        std::fs::rename(root.join("..data_tmp"), root.join("..data")).unwrap();
        eventually("swapped", || store.loaded_hash().as_ref() != Some(&first)).await;
        task.abort();
    }
}
