//! One reconcile of one `InferencePolicy`: compile, apply what an accepted
//! policy generates, delete what it no longer generates, observe, write the
//! status if it changed, and publish Events for state changes.

mod apply;
mod memory;
mod observe;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gateway_api::apis::standard::backendtlspolicies::BackendTlsPolicy;
use gateway_api::apis::standard::httproutes::HttpRoute;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::jiff::Timestamp;
use kinference_api::{
    CONDITION_READY, InferencePolicy, InferencePolicySpec, InferencePolicyStatus,
};
use kinference_policy::CompiledPolicy;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource, ResourceExt};

use crate::attachment::{self, PoolState};
use crate::cache::Caches;
use crate::error::{Error, Verb};
use crate::metrics::Metrics;
use crate::resources::{self, EppSettings, FIELD_MANAGER, InferencePool, Names};
use crate::status::{self, Acceptance, Observation};

pub use apply::{Applier, prune};
pub use memory::Memory;

/// Timing of periodic reconciles. Everything else is driven by the watches.
#[derive(Clone, Debug)]
pub struct Requeue {
    /// A fallback for missed watch events. Cheap: a reconcile that finds
    /// nothing changed sends no request.
    pub resync: Duration,
    /// While a parent Gateway outside the watched namespace is missing (a
    /// namespace-scoped operator cannot watch it): how often to look again.
    pub pending: Duration,
    /// After a failed reconcile; doubled for every failure in a row, up to
    /// `resync`.
    pub error: Duration,
}

impl Default for Requeue {
    fn default() -> Self {
        Self {
            resync: Duration::from_secs(300),
            pending: Duration::from_secs(30),
            error: Duration::from_secs(5),
        }
    }
}

/// Shared by every reconcile.
pub struct Context {
    pub client: Client,
    pub epp: EppSettings,
    pub requeue: Requeue,
    pub metrics: Metrics,
    pub recorder: Recorder,
    pub caches: Caches,
    pub memory: Memory,
}

/// The controller's reconcile function.
pub async fn reconcile(policy: Arc<InferencePolicy>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&policy, &ctx).await;
    ctx.metrics.reconciled(
        started.elapsed(),
        result.as_ref().err().map(Error::metric_label),
    );
    if result.is_ok()
        && let Some(uid) = policy.uid()
    {
        ctx.memory.succeeded(&uid);
    }
    result
}

/// The controller's error policy: log, tell the user through an Event, retry
/// with a backoff that grows with every failure in a row.
pub fn error_policy(policy: Arc<InferencePolicy>, error: &Error, ctx: Arc<Context>) -> Action {
    let retry = ctx.memory.failed(
        &policy.uid().unwrap_or_default(),
        ctx.requeue.error,
        ctx.requeue.resync,
    );
    tracing::warn!(
        policy = %policy.name_any(),
        namespace = policy.namespace().unwrap_or_default(),
        %error,
        retry_in = ?retry,
        "reconcile failed"
    );
    let note = error.to_string();
    let reference = policy.object_ref(&());
    let recorder = ctx.recorder.clone();
    // error_policy is synchronous; the Event is best effort.
    tokio::spawn(async move {
        let event = Event {
            type_: EventType::Warning,
            reason: "ReconcileError".into(),
            note: Some(truncate_note(note)),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&event, &reference).await {
            tracing::debug!(error = %e, "could not publish event");
        }
    });
    Action::requeue(retry)
}

async fn reconcile_inner(policy: &InferencePolicy, ctx: &Context) -> Result<Action, Error> {
    let name = policy.name_any();
    let ns = policy
        .namespace()
        .ok_or_else(|| Error::Incomplete(name.clone()))?;
    let uid = policy
        .uid()
        .ok_or_else(|| Error::Incomplete(name.clone()))?;
    if policy.metadata.deletion_timestamp.is_some() {
        // Owned objects go with it (ownerReferences); nothing to finalize.
        ctx.memory.forget(&uid);
        return Ok(Action::await_change());
    }
    ctx.caches.wait_listed().await;
    let names = Names::of(policy);
    let spec = &policy.spec.policy;
    // The status this process last wrote is newer than the cached one until
    // the watch delivers it; comparing against the cached one would write
    // (and announce) the same change twice.
    let prev = ctx.memory.status(&uid).or_else(|| policy.status.clone());

    let compiled = compile(&name, &policy.spec);
    let pool = names
        .attached_pool
        .as_deref()
        .and_then(|p| ctx.caches.inference_pool(&ns, p));
    let attached = attachment::observe(
        policy,
        pool.as_deref(),
        &ctx.caches.policies_in(&ns),
        &names.epp(),
    );
    // A failed apply still gets a status (Ready=False, ApplyFailed, naming
    // the object and the API server's message) before it is returned as the
    // reconcile's error, which retries it with backoff.
    let mut applied = Ok(());
    let acceptance = match &compiled {
        Ok(c) => {
            applied = match attached.as_ref().map(|a| &a.state) {
                // Another policy holds the pool: nothing of this one runs.
                // Retried with the error backoff, so it takes over soon
                // after the other lets go.
                Some(PoolState::Conflict { message }) => Err(Error::PoolTaken(message.clone())),
                _ => apply_all(ctx, policy, prev.as_ref(), &ns, &uid, c, pool.as_deref()).await,
            };
            Acceptance::Accepted {
                hash: c.hash.clone(),
                rules: c.rules.len(),
                providers: c.providers.len(),
                pool: names.pool(),
                warnings: kinference_policy::lint::warnings(c)
                    .iter()
                    .map(|w| format!("spec.{w}"))
                    .chain(attachment::open_ext_proc_warning(&policy.spec, c))
                    .collect(),
            }
        }
        // An invalid policy changes nothing in the cluster: above all not
        // the ConfigMap, so the EPP keeps serving the last good policy.
        Err(errors) => Acceptance::Rejected {
            errors: errors.clone(),
        },
    };

    let epp = observe::epp(&ctx.client, &ctx.caches, &ns, &names).await?;
    let mut refs = observe::refs(&ctx.client, &ctx.caches, &ns, spec, &epp.secret_keys).await?;
    refs.missing_pool = attached
        .as_ref()
        .filter(|a| a.state == PoolState::Missing)
        .map(|a| a.pool.clone());
    let configured_hash = match acceptance {
        Acceptance::Rejected { .. } => observe::configured_hash(&ctx.client, &ns, &names).await?,
        Acceptance::Accepted { .. } => None,
    };
    let waits_outside_scope = refs
        .missing_gateways
        .iter()
        .any(|g| !ctx.caches.covers(g.split('/').next().unwrap_or_default()));
    let observation = Observation {
        generation: policy.metadata.generation,
        acceptance,
        refs,
        epp,
        configured_hash,
        apply_failure: applied.as_ref().err().map(|e| {
            let reason = match e {
                Error::Conflict(_) | Error::PoolTaken(_) => status::REASON_CONFLICT,
                _ => status::REASON_APPLY_FAILED,
            };
            (reason, e.to_string())
        }),
        attachment: attached,
    };
    let next = status::compute(prev.as_ref(), &observation, Timestamp::now());
    if prev.as_ref() != Some(&next) {
        let api: Api<InferencePolicy> = Api::namespaced(ctx.client.clone(), &ns);
        write_status(&api, &name, &ns, &next).await?;
        ctx.memory.wrote_status(&uid, &next);
        publish_events(ctx, policy, prev.as_ref(), &next).await;
    }

    applied?;
    Ok(Action::requeue(if waits_outside_scope {
        ctx.requeue.pending
    } else {
        ctx.requeue.resync
    }))
}

/// Compiles the policy and checks the names it will generate and the EPP
/// settings; every error as `path: message` with paths under `spec` (or
/// `metadata`).
fn compile(name: &str, spec: &InferencePolicySpec) -> Result<CompiledPolicy, Vec<String>> {
    let mut other_errors: Vec<String> = resources::validate_names(name, &spec.policy)
        .iter()
        .map(ToString::to_string)
        .collect();
    other_errors.extend(attachment::errors(spec));
    if let Some(interval) = spec
        .endpoint_picker()
        .and_then(|e| e.scrape_interval.as_deref())
        && resources::scrape_interval_ms(interval).is_none()
    {
        other_errors.push(format!(
            "spec.endpointPicker.scrapeInterval: {interval:?} is not a duration from 10ms to 60s"
        ));
    }
    if let Some(log) = spec.endpoint_picker().and_then(|e| e.decision_log.as_ref()) {
        other_errors.extend(resources::decision_log_errors(log));
    }
    if let Some(replicas) = spec.epp_replicas()
        && !(1..=kinference_api::MAX_EPP_REPLICAS).contains(&replicas)
    {
        other_errors.push(format!(
            "spec.endpointPicker.replicas: {replicas} is not within 1..{}",
            kinference_api::MAX_EPP_REPLICAS
        ));
    }
    if let Some(precise) = spec.precise_prefix() {
        let engine_ports: Vec<i32> = spec
            .policy
            .pool
            .iter()
            .flat_map(|pool| &pool.target_ports)
            .map(|p| i32::from(p.number))
            .collect();
        other_errors.extend(precise.errors(&resources::EPP_PORTS, &engine_ports));
    }
    match kinference_policy::compile(&spec.policy) {
        Ok(compiled) if other_errors.is_empty() => Ok(compiled),
        Ok(_) => Err(other_errors),
        Err(errors) => Err(errors
            .prefixed("spec")
            .iter()
            .map(ToString::to_string)
            .chain(other_errors)
            .collect()),
    }
}

/// Whether the policy's objects may never have been applied: no Ready
/// condition yet, or one that says nothing was (a conflict, or a policy that
/// was invalid from the start). Ready's other reasons all follow an apply.
fn never_applied(status: Option<&InferencePolicyStatus>) -> bool {
    let ready = status.and_then(|s| {
        s.conditions
            .iter()
            .find(|c| c.type_ == CONDITION_READY)
            .map(|c| c.reason.as_str())
    });
    match ready {
        None => true,
        Some(reason) => [status::REASON_CONFLICT, status::REASON_INVALID_POLICY].contains(&reason),
    }
}

async fn apply_all(
    ctx: &Context,
    policy: &InferencePolicy,
    prev: Option<&InferencePolicyStatus>,
    ns: &str,
    uid: &str,
    compiled: &CompiledPolicy,
    attached: Option<&InferencePool>,
) -> Result<(), Error> {
    let desired = resources::desired_for(policy, compiled, &ctx.epp, attached);
    // Before anything is applied: an oversized policy changes nothing.
    resources::check_config_map_size(&desired.config_map)?;
    let (d, c) = (&desired, &ctx.caches);
    let a = Applier {
        client: &ctx.client,
        memory: &ctx.memory,
        uid,
        // Until the policy's objects have been applied once, none of the
        // generated names should exist; one that does is someone else's.
        create_only: never_applied(prev),
    };
    // Identity and permissions before the Deployment that uses them; the
    // ConfigMap before the EPP that reads it; backends before the route.
    a.apply(&c.service_accounts, &d.service_account, false)
        .await?;
    a.apply(&c.roles, &d.role, false).await?;
    a.apply(&c.role_bindings, &d.role_binding, false).await?;
    a.apply(&c.config_maps, &d.config_map, false).await?;
    a.apply_shared(&c.epp_reports, &d.epp_status_config_map)
        .await?;
    // The NetworkPolicy before the Pods it protects exist.
    if let Some(np) = &d.network_policy {
        a.apply(&c.network_policies, np, false).await?;
    }
    a.apply(&c.services, &d.epp_service, false).await?;
    a.apply(&c.deployments, &d.deployment, false).await?;
    if let Some(pdb) = &d.pod_disruption_budget {
        a.apply(&c.pod_disruption_budgets, pdb, false).await?;
    }
    for service in &d.provider_services {
        a.apply(&c.services, service, false).await?;
    }
    for tls in &d.backend_tls_policies {
        a.apply(&c.backend_tls_policies, tls, true).await?;
    }
    if let Some(pool) = &d.inference_pool {
        a.apply(&c.inference_pools, pool, false).await?;
    }
    if let Some(route) = &d.http_route {
        a.apply(&c.http_routes, route, false).await?;
    }

    // Route first, so it never points at a Service already deleted.
    let name = policy.name_any();
    let keep = |names: Vec<String>| names.into_iter().collect::<BTreeSet<String>>();
    let routes = keep(d.http_route.iter().map(|r| r.name_any()).collect());
    prune::<HttpRoute>(&a, &c.http_routes, ns, &name, &routes).await?;
    let tls = keep(
        d.backend_tls_policies
            .iter()
            .map(|t| t.name_any())
            .collect(),
    );
    prune::<BackendTlsPolicy>(&a, &c.backend_tls_policies, ns, &name, &tls).await?;
    // Declared before, attached now: the pool it made goes, unless it is
    // the one it attaches to.
    let pools = keep(
        d.inference_pool
            .iter()
            .map(|p| p.name_any())
            .chain(policy.spec.attached_pool().map(str::to_string))
            .collect(),
    );
    prune::<InferencePool>(&a, &c.inference_pools, ns, &name, &pools).await?;
    let services = keep(d.service_names());
    prune::<Service>(&a, &c.services, ns, &name, &services).await?;
    // Disabled, or no gateway known any more.
    let nps = keep(d.network_policy.iter().map(|n| n.name_any()).collect());
    prune::<NetworkPolicy>(&a, &c.network_policies, ns, &name, &nps).await?;
    // Down to one replica: no budget.
    let pdbs = keep(
        d.pod_disruption_budget
            .iter()
            .map(|p| p.name_any())
            .collect(),
    );
    prune::<PodDisruptionBudget>(&a, &c.pod_disruption_budgets, ns, &name, &pdbs).await?;
    Ok(())
}

async fn write_status(
    api: &Api<InferencePolicy>,
    name: &str,
    ns: &str,
    status: &InferencePolicyStatus,
) -> Result<(), Error> {
    // Server-side apply on the status subresource: fields the operator no
    // longer sets (e.g. a condition it dropped) are removed, which a merge
    // patch would leave behind.
    let patch = serde_json::json!({
        "apiVersion": InferencePolicy::api_version(&()),
        "kind": InferencePolicy::kind(&()),
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(|e| {
        Error::kube(
            Verb::PatchStatus,
            "InferencePolicy",
            format!("{ns}/{name}"),
            e,
        )
    })?;
    Ok(())
}

async fn publish_events(
    ctx: &Context,
    policy: &InferencePolicy,
    prev: Option<&InferencePolicyStatus>,
    next: &InferencePolicyStatus,
) {
    let reference = policy.object_ref(&());
    for ev in status::events(prev, next) {
        tracing::info!(
            policy = %policy.name_any(),
            namespace = policy.namespace().unwrap_or_default(),
            reason = %ev.reason,
            note = %ev.note,
            "status changed"
        );
        let event = Event {
            type_: if ev.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: ev.reason,
            note: Some(ev.note),
            action: "Reconcile".into(),
            secondary: None,
        };
        // Best effort: a missing events permission must not block status.
        if let Err(e) = ctx.recorder.publish(&event, &reference).await {
            tracing::warn!(error = %e, "could not publish event");
        }
    }
}

fn truncate_note(mut note: String) -> String {
    if note.len() > 1000 {
        let mut end = 997;
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
        note.push_str("...");
    }
    note
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::testing::example_spec;

    fn spec(policy: kinference_policy::PolicySpec) -> InferencePolicySpec {
        InferencePolicySpec::new(policy)
    }

    #[test]
    fn compile_prefixes_paths_and_adds_name_errors() {
        assert!(compile("chat", &spec(example_spec())).is_ok());
        let mut policy = example_spec();
        policy.pool.as_mut().unwrap().selector.clear();
        policy.providers[0].name = "OpenAI".into();
        let errors = compile("chat", &spec(policy)).unwrap_err();
        assert!(errors[0].starts_with("spec.pool.selector: "), "{errors:?}");
        assert!(
            errors
                .iter()
                .any(|e| e.starts_with("spec.providers[0].name: ")),
            "{errors:?}"
        );
        // Name problems alone also reject the policy.
        let errors = compile("Chat", &spec(example_spec())).unwrap_err();
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(errors[0].starts_with("metadata.name: "));
    }

    #[test]
    fn a_scrape_interval_out_of_range_is_refused_with_its_path() {
        for (interval, refused) in [
            ("5ms", true),
            ("10ms", false),
            ("60s", false),
            ("2m", true),
            ("often", true),
        ] {
            let errors = errors_with(kinference_api::EndpointPickerSpec {
                scrape_interval: Some(interval.into()),
                ..Default::default()
            });
            let expected = format!(
                "spec.endpointPicker.scrapeInterval: {interval:?} is not a duration from 10ms to 60s"
            );
            assert_eq!(errors, refused.then(|| vec![expected]), "{interval}");
        }
    }

    /// The example policy with these EPP settings: its errors, if refused.
    fn errors_with(picker: kinference_api::EndpointPickerSpec) -> Option<Vec<String>> {
        let mut s = spec(example_spec());
        s.endpoint_picker = Some(picker);
        compile("chat", &s).err()
    }

    #[test]
    fn a_decision_log_out_of_range_is_refused_with_its_path() {
        let log = |max: &str, sample: f64| {
            errors_with(kinference_api::EndpointPickerSpec {
                decision_log: Some(kinference_api::DecisionLogSpec {
                    max_size: Some(max.into()),
                    sample: Some(sample),
                }),
                ..Default::default()
            })
        };
        assert_eq!(log("64Mi", 0.5), None);
        assert_eq!(log("10Gi", 1.0), None);
        let refused = [
            log("512Ki", 1.0),
            log("20Gi", 1.0),
            log("lots", 1.0),
            log("64Mi", 1.5),
        ];
        insta::assert_yaml_snapshot!(refused);
    }

    #[test]
    fn epp_replicas_out_of_range_are_refused_with_their_path() {
        for (replicas, refused) in [(0, true), (1, false), (100, false), (101, true)] {
            let errors = errors_with(kinference_api::EndpointPickerSpec {
                replicas: Some(replicas),
                ..Default::default()
            });
            let expected = format!("spec.endpointPicker.replicas: {replicas} is not within 1..100");
            assert_eq!(errors, refused.then(|| vec![expected]), "{replicas}");
        }
    }

    /// The policy language takes a rules-only policy (its pool is the one
    /// it serves); the operator needs the pool declared or attached to.
    #[test]
    fn a_policy_without_its_pool_is_refused_unless_attached() {
        let mut policy = example_spec();
        policy.pool = None;
        assert!(kinference_policy::compile(&policy).is_ok());
        let errors = compile("chat", &spec(policy.clone())).unwrap_err();
        assert_eq!(
            errors,
            [
                "spec.pool: required unless spec.targetRefs names the existing InferencePool the policy serves"
            ]
        );
        policy.route = None;
        let mut attached = spec(policy);
        attached.target_refs = vec![kinference_api::PolicyTargetReference {
            group: "inference.networking.k8s.io".into(),
            kind: "InferencePool".into(),
            name: "shared".into(),
        }];
        assert!(compile("chat", &attached).is_ok());
    }

    #[test]
    fn precise_prefix_settings_are_validated_with_their_paths() {
        let precise = |value: serde_json::Value| {
            let mut s = spec(example_spec());
            s.endpoint_picker = Some(kinference_api::EndpointPickerSpec {
                precise_prefix: Some(serde_json::from_value(value).unwrap()),
                ..Default::default()
            });
            compile("chat", &s)
        };
        let image = |image: &str| serde_json::json!({ "image": image });
        assert!(precise(serde_json::json!({ "tokenizer": image("reg/tok:1") })).is_ok());
        let custom = serde_json::json!({
            "tokenizer": { "image": "reg/tok:1", "path": "models/qwen3" },
            "eventsPort": 6000,
            "tokenizeBudget": "20ms",
            "replayPort": 5558
        });
        assert!(precise(custom).is_ok());
        let errors = precise(serde_json::json!({
            "tokenizer": { "image": " ", "path": "../etc" },
            "eventsPort": 9002,
            "tokenizeBudget": "2s",
            "replayPort": 70000
        }))
        .unwrap_err();
        insta::assert_yaml_snapshot!(errors);
        // vLLM's rank r publishes to eventsPort + r: the range counts.
        let ranks = |events: i32, size: i32, replay: i32| {
            precise(serde_json::json!({
                "tokenizer": image("reg/tok:1"),
                "eventsPort": events,
                "dataParallelSize": size,
                "replayPort": replay
            }))
        };
        assert!(ranks(5557, 8, 5600).is_ok());
        // When the engines bind, the port is theirs, not the EPP's.
        let bind = serde_json::json!({
            "tokenizer": image("reg/tok:1"), "eventsPort": 9090, "publisherMode": "Bind"
        });
        assert!(precise(bind).is_ok());
        // ... but the engine's own ports are taken, by its server and by
        // each rank's replay socket.
        let clashes = |events: i32, size: i32, replay: i32| {
            precise(serde_json::json!({
                "tokenizer": image("reg/tok:1"), "publisherMode": "Bind",
                "eventsPort": events, "dataParallelSize": size, "replayPort": replay
            }))
        };
        assert!(clashes(5557, 2, 5559).is_ok());
        let errors = [clashes(5557, 2, 5558), clashes(7999, 2, 5558)].map(|r| r.unwrap_err());
        insta::assert_yaml_snapshot!("precise_prefix_bind_clashes", errors);
        let errors = [
            ranks(8995, 8, 5600),
            ranks(65530, 8, 5600),
            ranks(5557, 8, 65530),
            ranks(5557, 0, 5600),
            ranks(5557, 65, 5600),
        ]
        .map(|r| r.unwrap_err());
        insta::assert_yaml_snapshot!("precise_prefix_data_parallel_ports", errors);
    }

    #[test]
    fn notes_are_capped() {
        assert_eq!(truncate_note("x".repeat(2000)).len(), 1000);
        assert_eq!(truncate_note("short".into()), "short");
    }
}
