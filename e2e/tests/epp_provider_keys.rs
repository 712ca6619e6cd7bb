//! EPP provider keys against a real kube-apiserver (`kinference_e2e::cluster`):
//! one reader per referenced Secret, under a Role that grants only `get` on
//! those Secrets by name: the EPP's API mode, for EPPs run without the
//! operator (the operator's EPP reads its keys from projected Secret files,
//! `--provider-secrets-dir`, and its Role grants no Secrets). Keys are there as
//! soon as the policy is, a Secret created or updated later arrives within a
//! few seconds, a deleted one takes its key with it, and a policy naming
//! other Secrets moves the readers.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kinference_api::{EppPodStatus, SecretKeyStatus};
use kinference_e2e::cluster::TestCluster;
use kinference_e2e::kubelet::create_namespace;
use kinference_epp::k8s::{StatusReport, report_status, watch_provider_secrets};
use kinference_epp::server::{Epp, Settings};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde_json::json;

const NS: &str = "epp-provider-keys";
/// How quickly a Secret change must reach the EPP.
const PROMPT: Duration = Duration::from_secs(8);
const EPP_USER: &str = "system:serviceaccount:epp-provider-keys:epp";

fn policy(openai_secret: &str) -> String {
    format!(
        "pool: {{ selector: {{ app: x }}, targetPorts: [{{ number: 8000 }}] }}
providers:
  - name: openai
    baseURL: https://api.openai.test/v1
    secretRef: {{ name: {openai_secret} }}
    models: [{{ name: qwen }}]
  - name: databricks
    baseURL: https://dbx.test/v1
    secretRef: {{ name: dbx, key: token }}
    models: [{{ name: qwen }}]
rules:
  - name: out
    route:
      consider: [{{ backends: {{ type: Provider }} }}]
      select: [{{ order: [openai, databricks] }}]
"
    )
}

fn keys(epp: &Epp) -> BTreeMap<String, String> {
    (**epp.picker.provider_keys().load()).clone()
}

fn map(list: &[(&str, &str)]) -> BTreeMap<String, String> {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

async fn wait_for(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Creates or replaces Secret `name` with `data` (server-side apply of `data`;
/// `stringData` does not merge well under apply).
async fn put_secret(api: &Api<Secret>, name: &str, data: &[(&str, &str)]) -> anyhow::Result<()> {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..ObjectMeta::default()
        },
        data: Some(
            data.iter()
                .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        ),
        ..Secret::default()
    };
    api.patch(
        name,
        &PatchParams::apply("kinference-e2e").force(),
        &Patch::Apply(&secret),
    )
    .await?;
    Ok(())
}

/// A client acting as the EPP's ServiceAccount, allowed `get` on the named
/// Secrets only.
async fn epp_client(
    cluster: &TestCluster,
    admin: &Client,
    secrets: &[&str],
) -> anyhow::Result<Client> {
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "epp"},
        "rules": [{
            "apiGroups": [""],
            "resources": ["secrets"],
            "verbs": ["get"],
            "resourceNames": secrets,
        }]
    }))?;
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "epp"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "epp"},
        "subjects": [{"kind": "ServiceAccount", "name": "epp", "namespace": NS}]
    }))?;
    Api::<Role>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &role)
        .await?;
    Api::<RoleBinding>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &binding)
        .await?;
    let kubeconfig = Kubeconfig::read_from(cluster.kubeconfig_path())?;
    let mut config =
        Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    config.auth_info.impersonate = Some(EPP_USER.to_string());
    Ok(Client::try_from(config)?)
}

#[tokio::test]
async fn provider_keys_follow_their_secrets_under_a_narrow_role() -> anyhow::Result<()> {
    let cluster = TestCluster::start_without_crds().await?;
    let admin = cluster.client();
    create_namespace(&admin, NS).await?;
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), NS);
    put_secret(&secrets, "openai-key", &[("apiKey", "sk-one\n")]).await?;
    // Not referenced by the policy: never read (the Role does not even allow it).
    put_secret(&secrets, "unrelated", &[("apiKey", "sk-unrelated")]).await?;
    let client = epp_client(&cluster, &admin, &["openai-key", "dbx", "other-key"]).await?;

    // The readers start before the policy is loaded, as in the EPP.
    let epp = Epp::new(Settings::default());
    let task = tokio::spawn(watch_provider_secrets(epp.clone(), client, NS.to_string()));
    epp.policy().load_text(&policy("openai-key")).unwrap();
    wait_for("the existing Secret's key at start", PROMPT, || {
        keys(&epp) == map(&[("openai", "sk-one")])
    })
    .await;

    // Created later: picked up on the next read.
    put_secret(&secrets, "dbx", &[("token", "dapi-1")]).await?;
    wait_for("a Secret created later", PROMPT, || {
        keys(&epp) == map(&[("databricks", "dapi-1"), ("openai", "sk-one")])
    })
    .await;

    // Updated.
    put_secret(&secrets, "openai-key", &[("apiKey", "sk-two")]).await?;
    wait_for("an updated Secret", PROMPT, || {
        keys(&epp).get("openai").map(String::as_str) == Some("sk-two")
    })
    .await;

    // Deleted: the key goes.
    secrets.delete("dbx", &DeleteParams::default()).await?;
    wait_for("a deleted Secret's key removed", PROMPT, || {
        keys(&epp) == map(&[("openai", "sk-two")])
    })
    .await;

    // The policy now names another Secret for openai: its reader moves.
    put_secret(&secrets, "other-key", &[("apiKey", "sk-other")]).await?;
    epp.policy().load_text(&policy("other-key")).unwrap();
    wait_for("the new Secret's key", PROMPT, || {
        keys(&epp) == map(&[("openai", "sk-other")])
    })
    .await;
    // And the old Secret no longer matters.
    put_secret(&secrets, "openai-key", &[("apiKey", "sk-three")]).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(keys(&epp), map(&[("openai", "sk-other")]));

    assert!(!task.is_finished(), "the readers keep running");
    task.abort();
    Ok(())
}

/// The operator's EPP: keys from projected Secret files, and its report in
/// the EPP status ConfigMap, written as its ServiceAccount allowed to patch
/// that one ConfigMap and nothing else. The reporter starts before the
/// ConfigMap exists (retried with backoff until it does), says which keys
/// it found, and follows a key that appears later.
#[tokio::test]
async fn the_epp_reports_which_mounted_keys_it_found() -> anyhow::Result<()> {
    const STATUS: &str = "chat-epp-status";
    let cluster = TestCluster::start_without_crds().await?;
    let admin = cluster.client();
    create_namespace(&admin, NS).await?;
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "epp"},
        "rules": [{
            "apiGroups": [""],
            "resources": ["configmaps"],
            "verbs": ["patch"],
            "resourceNames": [STATUS],
        }]
    }))?;
    Api::<Role>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &role)
        .await?;
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "epp"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "epp"},
        "subjects": [{"kind": "ServiceAccount", "name": "epp", "namespace": NS}]
    }))?;
    Api::<RoleBinding>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &binding)
        .await?;
    let client = cluster.client_as(EPP_USER).await?;

    // The projected volume's layout: <secret>/<key>; dbx/token is missing.
    let dir = std::env::temp_dir().join(format!("kinference-e2e-keys-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("openai-key"))?;
    std::fs::write(dir.join("openai-key/apiKey"), "sk-one\n")?;
    let epp = Epp::new(Settings::default());
    epp.policy().load_text(&policy("openai-key")).unwrap();
    let hash = epp.policy().loaded_hash().unwrap();
    let task = tokio::spawn(report_status(
        epp.clone(),
        client,
        NS.to_string(),
        StatusReport {
            configmap: STATUS.into(),
            pod: "chat-epp-0".into(),
            secrets_dir: Some(dir.clone()),
        },
    ));
    // Not there yet: the first writes fail (404) and are retried.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let configmaps: Api<ConfigMap> = Api::namespaced(admin.clone(), NS);
    // Applied with labels and without data, as the operator applies it
    // (the API server tracks the managers of plain updates only once an
    // apply owns some field).
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": STATUS, "labels": {"kinference.io/policy": "chat"}}
    }))?;
    configmaps
        .patch(
            STATUS,
            &PatchParams::apply("kinference-operator").force(),
            &Patch::Apply(&cm),
        )
        .await?;

    let reported = async || -> Option<EppPodStatus> {
        let data = configmaps.get(STATUS).await.ok()?.data?;
        EppPodStatus::from_json(data.get("chat-epp-0")?).ok()
    };
    let key = |secret: &str, key: &str, found: bool| SecretKeyStatus {
        secret: secret.into(),
        key: key.into(),
        found,
    };
    let deadline = Instant::now() + PROMPT;
    let first = loop {
        if let Some(r) = reported().await {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "no report after the ConfigMap appeared"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        first,
        EppPodStatus {
            loaded_hash: hash.clone(),
            secret_keys: Some(vec![
                key("dbx", "token", false),
                key("openai-key", "apiKey", true)
            ]),
        }
    );

    // The kubelet projects the missing key: reported within a recheck.
    std::fs::create_dir_all(dir.join("dbx"))?;
    std::fs::write(dir.join("dbx/token"), "dapi-1")?;
    let deadline = Instant::now() + PROMPT;
    loop {
        let now = reported().await.and_then(|r| r.secret_keys);
        if now
            == Some(vec![
                key("dbx", "token", true),
                key("openai-key", "apiKey", true),
            ])
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the new key was not reported: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Its own field manager owns its key.
    let cm = configmaps.get(STATUS).await?;
    let managers: Vec<String> = cm
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter(|m| {
            serde_json::to_string(&m.fields_v1)
                .unwrap_or_default()
                .contains("f:chat-epp-0")
        })
        .filter_map(|m| m.manager)
        .collect();
    assert_eq!(managers, ["kinference-epp/chat-epp-0"]);
    task.abort();
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
