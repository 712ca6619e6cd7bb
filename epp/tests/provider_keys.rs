//! Provider API keys from a directory laid out as mounted Secrets
//! (`DIR/<secret>/<key>`): what the policy references, trimming, missing
//! files, reloads, and that no key value is ever logged.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kinference_epp::provider_keys::{
    DEFAULT_SECRET_KEY, KeyRef, key_refs, load_from_dir, secret_names, watch_secrets_dir,
};
use kinference_epp::server::{Epp, Settings};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "kinference-provider-keys-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }

    fn write(&self, secret: &str, key: &str, value: &str) {
        let dir = self.0.join(secret);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(key), value).unwrap();
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Providers `openai` (Secret `openai-key`, default key), `databricks`
/// (Secret `dbx`, key `token`) and `free` (no Secret).
const POLICY: &str = "pool: { selector: { app: x }, targetPorts: [{ number: 8000 }] }
providers:
  - name: openai
    baseURL: https://api.openai.test/v1
    secretRef: { name: openai-key }
    models: [{ name: qwen, targetModel: gpt-4o-mini }]
  - name: databricks
    baseURL: https://dbx.test/v1
    secretRef: { name: dbx, key: token }
    models: [{ name: qwen }]
  - name: free
    baseURL: https://free.test/v1
    models: [{ name: qwen }]
rules:
  - name: out
    route:
      consider: [{ backends: { type: Provider } }]
      select: [{ order: [openai, databricks, free] }]
";

fn epp_with(policy: &str) -> Epp {
    let epp = Epp::new(Settings::default());
    epp.policy().load_text(policy).unwrap();
    epp
}

fn keys(epp: &Epp) -> Vec<(String, String)> {
    epp.picker
        .provider_keys()
        .load()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[test]
fn references_fill_in_the_default_key() {
    let epp = epp_with(POLICY);
    let refs = key_refs(&epp.policy().current().unwrap().compiled);
    let r = |provider: &str, secret: &str, key: &str| KeyRef {
        provider: provider.into(),
        secret: secret.into(),
        key: key.into(),
    };
    assert_eq!(DEFAULT_SECRET_KEY, "apiKey");
    assert_eq!(
        refs,
        [
            r("openai", "openai-key", "apiKey"),
            r("databricks", "dbx", "token")
        ]
    );
    assert_eq!(
        secret_names(&refs).into_iter().collect::<Vec<_>>(),
        ["dbx", "openai-key"]
    );
}

#[test]
fn loads_trimmed_keys_and_reports_missing_ones_without_values() {
    let dir = TempDir::new();
    let epp = epp_with(POLICY);
    let refs = key_refs(&epp.policy().current().unwrap().compiled);

    // Nothing there yet: no keys, both missing.
    let resolved = load_from_dir(dir.path(), &refs);
    assert!(resolved.keys.is_empty());
    let missing: Vec<&str> = resolved
        .missing
        .iter()
        .map(|m| m.key_ref.provider.as_str())
        .collect();
    assert_eq!(missing, ["databricks", "openai"]);

    // A key with a trailing newline (as `kubectl create secret --from-file`
    // often leaves) and surrounding spaces; the other Secret lacks its key.
    dir.write("openai-key", "apiKey", "  sk-openai-123\n");
    dir.write("dbx", "apiKey", "wrong-key-name");
    let resolved = load_from_dir(dir.path(), &refs);
    assert_eq!(
        resolved
            .keys
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<Vec<_>>(),
        pairs(&[("openai", "sk-openai-123")])
    );
    assert_eq!(resolved.missing.len(), 1);
    let m = resolved.missing.first().unwrap();
    assert_eq!(
        (m.key_ref.provider.as_str(), m.key_ref.key.as_str()),
        ("databricks", "token")
    );
    assert!(m.why.contains("dbx"), "{}", m.why);
    assert!(!m.why.contains("wrong-key-name"), "{}", m.why);

    // An empty (whitespace-only) file is no key.
    dir.write("dbx", "token", " \n");
    let resolved = load_from_dir(dir.path(), &refs);
    assert!(!resolved.keys.contains_key("databricks"));
    assert!(resolved.missing.iter().any(|m| m.why.contains("empty")));

    dir.write("dbx", "token", "dapi-456");
    let resolved = load_from_dir(dir.path(), &refs);
    assert_eq!(resolved.keys.get("databricks").unwrap(), "dapi-456");
    assert!(resolved.missing.is_empty());
}

#[test]
fn names_cannot_leave_the_directory() {
    let dir = TempDir::new();
    let inside = dir.path().join("inside");
    std::fs::create_dir_all(&inside).unwrap();
    dir.write("secret", "apiKey", "outside-the-dir");
    let refs = [
        KeyRef {
            provider: "a".into(),
            secret: "..".into(),
            key: "secret".into(),
        },
        KeyRef {
            provider: "b".into(),
            secret: "../secret".into(),
            key: "apiKey".into(),
        },
    ];
    let resolved = load_from_dir(&inside, &refs);
    assert!(resolved.keys.is_empty(), "{:?}", resolved.keys.keys());
    assert_eq!(resolved.missing.len(), 2);
}

/// The layout the kubelet gives a mounted Secret: `..data` points at a
/// timestamped directory and each key is a symlink through it; an update
/// swaps `..data`.
#[cfg(unix)]
#[test]
fn follows_a_mounted_secrets_symlinks() {
    use std::os::unix::fs::symlink;
    let dir = TempDir::new();
    let secret = dir.path().join("openai-key");
    std::fs::create_dir_all(secret.join("..2025_01_01_v1")).unwrap();
    std::fs::write(secret.join("..2025_01_01_v1/apiKey"), "sk-v1\n").unwrap();
    symlink("..2025_01_01_v1", secret.join("..data")).unwrap();
    symlink("..data/apiKey", secret.join("apiKey")).unwrap();
    let epp = epp_with(POLICY);
    let refs = key_refs(&epp.policy().current().unwrap().compiled);
    assert_eq!(
        load_from_dir(dir.path(), &refs).keys.get("openai").unwrap(),
        "sk-v1"
    );

    std::fs::create_dir_all(secret.join("..2025_01_02_v2")).unwrap();
    std::fs::write(secret.join("..2025_01_02_v2/apiKey"), "sk-v2").unwrap();
    symlink("..2025_01_02_v2", secret.join("..data_tmp")).unwrap();
    std::fs::rename(secret.join("..data_tmp"), secret.join("..data")).unwrap();
    assert_eq!(
        load_from_dir(dir.path(), &refs).keys.get("openai").unwrap(),
        "sk-v2"
    );
}

#[tokio::test]
async fn watcher_picks_up_files_that_appear_change_and_vanish() {
    let dir = TempDir::new();
    let epp = epp_with(POLICY);
    let task = watch_secrets_dir(
        epp.clone(),
        dir.path().to_path_buf(),
        Duration::from_millis(50),
    );
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(keys(&epp).is_empty(), "no files, no keys");

    dir.write("openai-key", "apiKey", "sk-one\n");
    wait_for("the key once its file appears", || {
        keys(&epp) == pairs(&[("openai", "sk-one")])
    })
    .await;

    dir.write("openai-key", "apiKey", "sk-two");
    dir.write("dbx", "token", "dapi");
    wait_for("the changed and the new key", || {
        keys(&epp) == pairs(&[("databricks", "dapi"), ("openai", "sk-two")])
    })
    .await;

    std::fs::remove_file(dir.path().join("openai-key/apiKey")).unwrap();
    wait_for("the removed key gone", || {
        keys(&epp) == pairs(&[("databricks", "dapi")])
    })
    .await;
    task.abort();
}

#[tokio::test]
async fn watcher_reloads_at_once_when_the_policy_changes() {
    let dir = TempDir::new();
    dir.write("openai-key", "apiKey", "sk-one");
    dir.write("other", "apiKey", "sk-other");
    // Before any policy: nothing to read.
    let epp = Epp::new(Settings::default());
    // A period far longer than the test: only policy changes reload.
    let task = watch_secrets_dir(
        epp.clone(),
        dir.path().to_path_buf(),
        Duration::from_secs(3600),
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(keys(&epp).is_empty());

    epp.policy().load_text(POLICY).unwrap();
    wait_for("keys of the first policy", || {
        keys(&epp) == pairs(&[("openai", "sk-one")])
    })
    .await;

    epp.policy()
        .load_text(&POLICY.replace("{ name: openai-key }", "{ name: other }"))
        .unwrap();
    wait_for("keys of the new policy", || {
        keys(&epp) == pairs(&[("openai", "sk-other")])
    })
    .await;
    task.abort();
}

/// Captured log output.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

// Current-thread runtime: the watcher task logs on this thread, under the
// subscriber set here.
#[tokio::test(flavor = "current_thread")]
async fn a_missing_key_is_warned_about_once_and_no_value_is_ever_logged() {
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let dir = TempDir::new();
    dir.write("openai-key", "apiKey", "sk-very-secret-value");
    let epp = epp_with(POLICY);
    let task = watch_secrets_dir(
        epp.clone(),
        dir.path().to_path_buf(),
        Duration::from_millis(20),
    );
    wait_for("the key", || keys(&epp).len() == 1).await;
    // Many reloads with the same state: one warning for databricks.
    tokio::time::sleep(Duration::from_millis(200)).await;
    dir.write("dbx", "token", "dapi-also-secret");
    wait_for("both keys", || keys(&epp).len() == 2).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    task.abort();

    let text = logs.text();
    assert_eq!(
        text.matches("no API key for provider").count(),
        1,
        "one warning, not one per reload:\n{text}"
    );
    assert!(
        text.contains("databricks") && text.contains("token"),
        "{text}"
    );
    assert!(text.contains("provider API keys updated"), "{text}");
    for secret in [
        "sk-very-secret-value",
        "dapi-also-secret",
        "sk-very",
        "dapi-",
    ] {
        assert!(!text.contains(secret), "a key value was logged:\n{text}");
    }
}
