//! One reconcile of one `InferencePolicy`: compile, apply what an accepted
//! policy generates, delete what it no longer generates, observe, write the
//! status if it changed, and publish Events for state changes.

mod apply;
mod observe;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gateway_api::apis::standard::backendtlspolicies::BackendTlsPolicy;
use gateway_api::apis::standard::httproutes::HttpRoute;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::jiff::Timestamp;
use kinference_api::{
    CONDITION_READY, CONDITION_RESOLVED_REFS, InferencePolicy, InferencePolicyStatus,
};
use kinference_policy::CompiledPolicy;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource, ResourceExt};

use crate::error::{Error, Verb};
use crate::metrics::Metrics;
use crate::resources::{self, EppSettings, FIELD_MANAGER, Names};
use crate::status::{self, Acceptance, Observation};

pub use apply::{apply, foreign, prune};

/// Timing of periodic reconciles.
#[derive(Clone, Debug)]
pub struct Requeue {
    /// When everything is Ready: a fallback for missed watch events and for
    /// drift in objects the operator does not watch (Gateways).
    pub resync: Duration,
    /// While an accepted policy is not Ready or has unresolved references:
    /// Gateways are not watched, so this is how their creation is noticed.
    /// (Provider keys need no polling: the EPP Pods report them in the
    /// watched EPP status ConfigMap.)
    pub pending: Duration,
    /// After a failed reconcile.
    pub error: Duration,
}

impl Default for Requeue {
    fn default() -> Self {
        Self {
            resync: Duration::from_secs(300),
            pending: Duration::from_secs(10),
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
}

/// The controller's reconcile function.
pub async fn reconcile(policy: Arc<InferencePolicy>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&policy, &ctx).await;
    ctx.metrics.reconciled(
        started.elapsed(),
        result.as_ref().err().map(Error::metric_label),
    );
    result
}

/// The controller's error policy: log, tell the user through an Event, retry.
pub fn error_policy(policy: Arc<InferencePolicy>, error: &Error, ctx: Arc<Context>) -> Action {
    tracing::warn!(
        policy = %policy.name_any(),
        namespace = policy.namespace().unwrap_or_default(),
        %error,
        "reconcile failed; retrying"
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
    Action::requeue(ctx.requeue.error)
}

async fn reconcile_inner(cached: &InferencePolicy, ctx: &Context) -> Result<Action, Error> {
    let name = cached.name_any();
    let ns = cached
        .namespace()
        .ok_or_else(|| Error::Incomplete(name.clone()))?;
    let api: Api<InferencePolicy> = Api::namespaced(ctx.client.clone(), &ns);
    // Read it fresh: the cache may not have seen our last status write yet,
    // and comparing against a stale status would write (and announce) the
    // same change twice.
    let Some(policy) = api
        .get_opt(&name)
        .await
        .map_err(|e| Error::kube(Verb::Get, "InferencePolicy", format!("{ns}/{name}"), e))?
    else {
        return Ok(Action::await_change());
    };
    if policy.metadata.deletion_timestamp.is_some() {
        // Owned objects go with it (ownerReferences); nothing to finalize.
        return Ok(Action::await_change());
    }
    let uid = policy
        .uid()
        .ok_or_else(|| Error::Incomplete(name.clone()))?;
    let names = Names::of(&policy);
    let spec = &policy.spec.policy;

    let compiled = compile(&name, spec);
    // A failed apply still gets a status (Ready=False, ApplyFailed, naming
    // the object and the API server's message) before it is returned as the
    // reconcile's error, which retries it with backoff.
    let mut applied = Ok(());
    let acceptance = match &compiled {
        Ok(c) => {
            applied = apply_all(ctx, &policy, &ns, &uid, c).await;
            Acceptance::Accepted {
                hash: c.hash.clone(),
                rules: c.rules.len(),
                providers: c.providers.len(),
                pool: names.pool(),
            }
        }
        // An invalid policy changes nothing in the cluster: above all not
        // the ConfigMap, so the EPP keeps serving the last good policy.
        Err(errors) => Acceptance::Rejected {
            errors: errors.clone(),
        },
    };

    let epp = observe::epp(&ctx.client, &ns, &names).await?;
    let refs = observe::refs(&ctx.client, &ns, spec, &epp.secret_keys).await?;
    let configured_hash = match acceptance {
        Acceptance::Rejected { .. } => observe::configured_hash(&ctx.client, &ns, &names).await?,
        Acceptance::Accepted { .. } => None,
    };
    let observation = Observation {
        generation: policy.metadata.generation,
        acceptance,
        refs,
        epp,
        configured_hash,
        apply_failure: applied.as_ref().err().map(|e| {
            let reason = match e {
                Error::Conflict(_) => status::REASON_CONFLICT,
                _ => status::REASON_APPLY_FAILED,
            };
            (reason, e.to_string())
        }),
    };
    let prev = policy.status.as_ref();
    let next = status::compute(prev, &observation, Timestamp::now());
    if prev != Some(&next) {
        write_status(&api, &name, &ns, &next).await?;
        publish_events(ctx, &policy, prev, &next).await;
    }

    applied?;
    let settled = status::is_true(Some(&next), CONDITION_READY)
        && status::is_true(Some(&next), CONDITION_RESOLVED_REFS);
    let rejected = matches!(observation.acceptance, Acceptance::Rejected { .. });
    Ok(Action::requeue(if settled || rejected {
        ctx.requeue.resync
    } else {
        ctx.requeue.pending
    }))
}

/// Compiles the policy and checks the names it will generate; every error
/// as `path: message` with paths under `spec` (or `metadata`).
fn compile(
    name: &str,
    spec: &kinference_policy::PolicySpec,
) -> Result<CompiledPolicy, Vec<String>> {
    let name_errors = resources::validate_names(name, spec);
    match kinference_policy::compile(spec) {
        Ok(compiled) if name_errors.is_empty() => Ok(compiled),
        Ok(_) => Err(name_errors.iter().map(ToString::to_string).collect()),
        Err(errors) => Err(errors
            .prefixed("spec")
            .iter()
            .chain(&name_errors)
            .map(ToString::to_string)
            .collect()),
    }
}

/// Whether the policy's objects may never have been applied: no Ready
/// condition yet, or one that says nothing was (a conflict, or a policy that
/// was invalid from the start). Ready's other reasons all follow an apply.
fn never_applied(policy: &InferencePolicy) -> bool {
    let ready = policy.status.as_ref().and_then(|s| {
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

/// The first generated object whose name is taken by an object this
/// policy does not control.
async fn first_foreign(
    client: &Client,
    desired: &resources::Desired,
    uid: &str,
) -> Result<Option<String>, Error> {
    let d = desired;
    let checks = [
        foreign(client, &d.service_account, uid).await?,
        foreign(client, &d.role, uid).await?,
        foreign(client, &d.role_binding, uid).await?,
        foreign(client, &d.config_map, uid).await?,
        foreign(client, &d.epp_status_config_map, uid).await?,
        foreign(client, &d.epp_service, uid).await?,
        foreign(client, &d.deployment, uid).await?,
        foreign(client, &d.inference_pool, uid).await?,
    ];
    if let Some(found) = checks.into_iter().flatten().next() {
        return Ok(Some(found));
    }
    for service in &d.provider_services {
        if let Some(found) = foreign(client, service, uid).await? {
            return Ok(Some(found));
        }
    }
    if let Some(route) = &d.http_route {
        return foreign(client, route, uid).await;
    }
    Ok(None)
}

async fn apply_all(
    ctx: &Context,
    policy: &InferencePolicy,
    ns: &str,
    uid: &str,
    compiled: &CompiledPolicy,
) -> Result<(), Error> {
    let client = &ctx.client;
    let desired = resources::desired(policy, compiled, &ctx.epp);
    // Before anything is applied: an oversized policy changes nothing.
    resources::check_config_map_size(&desired.config_map)?;
    // Until the policy's objects have been applied once, none of the
    // generated names should exist; one that does is someone else's.
    // Checked until then (a few metadata GETs), not on every reconcile.
    if never_applied(policy)
        && let Some(object) = first_foreign(client, &desired, uid).await?
    {
        return Err(Error::Conflict(object));
    }
    // Identity and permissions before the Deployment that uses them; the
    // ConfigMap before the EPP that reads it; backends before the route.
    apply(client, &desired.service_account, false).await?;
    apply(client, &desired.role, false).await?;
    apply(client, &desired.role_binding, false).await?;
    apply(client, &desired.config_map, false).await?;
    apply(client, &desired.epp_status_config_map, false).await?;
    // The NetworkPolicy before the Pods it protects exist.
    if let Some(np) = &desired.network_policy {
        apply(client, np, false).await?;
    }
    apply(client, &desired.epp_service, false).await?;
    apply(client, &desired.deployment, false).await?;
    for service in &desired.provider_services {
        apply(client, service, false).await?;
    }
    for tls in &desired.backend_tls_policies {
        apply(client, tls, true).await?;
    }
    apply(client, &desired.inference_pool, false).await?;
    if let Some(route) = &desired.http_route {
        apply(client, route, false).await?;
    }

    // Route first, so it never points at a Service already deleted.
    let name = policy.name_any();
    let route_keep: BTreeSet<String> = desired.http_route.iter().map(|r| r.name_any()).collect();
    prune::<HttpRoute>(client, ns, &name, uid, &route_keep, false).await?;
    let tls_keep: BTreeSet<String> = desired
        .backend_tls_policies
        .iter()
        .map(|t| t.name_any())
        .collect();
    prune::<BackendTlsPolicy>(client, ns, &name, uid, &tls_keep, true).await?;
    let service_keep: BTreeSet<String> = desired.service_names().into_iter().collect();
    prune::<Service>(client, ns, &name, uid, &service_keep, false).await?;
    // Disabled, or no gateway known any more.
    let np_keep: BTreeSet<String> = desired
        .network_policy
        .iter()
        .map(|n| n.name_any())
        .collect();
    prune::<NetworkPolicy>(client, ns, &name, uid, &np_keep, false).await?;
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

    #[test]
    fn compile_prefixes_paths_and_adds_name_errors() {
        assert!(compile("chat", &example_spec()).is_ok());
        let mut spec = example_spec();
        spec.pool.selector.clear();
        spec.providers[0].name = "OpenAI".into();
        let errors = compile("chat", &spec).unwrap_err();
        assert!(errors[0].starts_with("spec.pool.selector: "), "{errors:?}");
        assert!(
            errors
                .iter()
                .any(|e| e.starts_with("spec.providers[0].name: ")),
            "{errors:?}"
        );
        // Name problems alone also reject the policy.
        let errors = compile("Chat", &example_spec()).unwrap_err();
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(errors[0].starts_with("metadata.name: "));
    }

    #[test]
    fn notes_are_capped() {
        assert_eq!(truncate_note("x".repeat(2000)).len(), 1000);
        assert_eq!(truncate_note("short".into()), "short");
    }
}
