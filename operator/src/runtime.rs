//! Running the operator: the controller's watches, leader election, and
//! stopping cleanly. [`run`] is what the binary calls and what tests call
//! in-process.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::shutdown::{Shutdown, ShutdownTrigger, shutdown_channel};
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use gateway_api::apis::standard::backendtlspolicies::BackendTlsPolicy;
use gateway_api::apis::standard::gateways::Gateway;
use gateway_api::apis::standard::httproutes::HttpRoute;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kinference_api::{InferencePolicy, POLICY_LABEL};
use kinference_runtime::watch::{log_outages, watch_backoff};
use kube::api::PartialObjectMeta;
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::task::JoinHandle;
use tokio_util::task::AbortOnDropHandle;

use crate::cache::{Caches, strip_managed_fields};
use crate::error::Error;
use crate::leader::{LeaderElectionConfig, LeaseLock};
use crate::metrics::{Health, Metrics};
use crate::reconcile::{self, Context, Memory, Requeue};
use crate::resources::{
    COMPONENT_LABEL, EPP_STATUS_COMPONENT, EppSettings, FIELD_MANAGER, InferencePool,
};

pub const DEFAULT_EPP_IMAGE: &str = "ghcr.io/kinference/epp:0.1.0";

/// Operator settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// Image of the EPP Deployments.
    pub epp_image: String,
    /// Replicas of each EPP Deployment whose policy names none; None: left
    /// to an HPA (the Deployment's own default is 1).
    pub epp_replicas: Option<i32>,
    /// Watch only this namespace; None: every namespace.
    pub namespace: Option<String>,
    pub requeue: Requeue,
    /// None: this process always reconciles (single replica, tests).
    pub leader_election: Option<LeaderElectionConfig>,
    /// Reporting instance of published Events (the Pod name in a cluster).
    pub instance: Option<String>,
    /// Counters; share a clone to read them (tests) or serve them (binary).
    pub metrics: Metrics,
    pub health: Health,
    /// Concurrent reconciles (of different policies); 0 = unbounded.
    pub concurrency: u16,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            epp_image: DEFAULT_EPP_IMAGE.into(),
            epp_replicas: None,
            namespace: None,
            requeue: Requeue::default(),
            leader_election: None,
            instance: None,
            metrics: Metrics::new(),
            health: Health::default(),
            concurrency: 4,
        }
    }
}

/// Why [`run`] returned with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Another candidate holds the Lease now, or it could not be renewed in
    /// time. The controller has stopped; the process should exit so it can
    /// come back as a standby with fresh state.
    #[error("lost the leader Lease {0}")]
    LeadershipLost(String),
    #[error(transparent)]
    Lease(#[from] Error),
    #[error("operator task failed: {0}")]
    Task(String),
}

/// Runs the operator until `shutdown`: with leader election, first waits
/// for the Lease, reconciles only while holding it, and releases it on the
/// way out. In-flight reconciles finish before this returns.
pub async fn run(client: Client, config: Config, shutdown: Shutdown) -> Result<(), RunError> {
    config.health.set_ready(true);
    let result = run_inner(client, &config, shutdown).await;
    config.health.set_ready(false);
    result
}

async fn run_inner(client: Client, config: &Config, shutdown: Shutdown) -> Result<(), RunError> {
    let Some(le) = config.leader_election.clone() else {
        config.metrics.set_leader(true);
        run_controller(client, config.clone(), shutdown).await;
        config.metrics.set_leader(false);
        return Ok(());
    };

    let mut lock = LeaseLock::new(client.clone(), le.clone());
    tracing::info!(identity = %lock.identity(), lease = %le.lease_name, namespace = %le.namespace, "waiting for the leader Lease");
    loop {
        match lock.try_acquire_or_renew().await {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "leader election round failed"),
        }
        tokio::select! {
            () = tokio::time::sleep(le.retry_period) => {}
            () = shutdown.wait() => return Ok(()),
        }
    }
    tracing::info!(identity = %lock.identity(), "became leader");
    config.metrics.set_leader(true);

    let (stop_controller, controller_stop) = shutdown_channel();
    // Aborted if `run` is dropped: a controller outliving its Lease loop
    // would reconcile without holding the Lease.
    let controller = AbortOnDropHandle::new(tokio::spawn(run_controller(
        client,
        config.clone(),
        controller_stop,
    )));
    let mut renewed = Instant::now();
    let lost = loop {
        tokio::select! {
            () = shutdown.wait() => break false,
            () = tokio::time::sleep(le.retry_period) => {}
        }
        match lock.try_acquire_or_renew().await {
            Ok(true) => renewed = Instant::now(),
            Ok(false) => break true,
            Err(e) if renewed.elapsed() < le.renew_deadline => {
                tracing::warn!(error = %e, "could not renew the leader Lease; retrying");
            }
            Err(e) => {
                tracing::error!(error = %e, "could not renew the leader Lease before the deadline");
                break true;
            }
        }
    };
    stop_controller.trigger();
    let joined = controller.await;
    config.metrics.set_leader(false);
    if let Err(e) = joined {
        return Err(RunError::Task(e.to_string()));
    }
    if lost {
        tracing::error!(identity = %lock.identity(), "lost leadership; controller stopped");
        return Err(RunError::LeadershipLost(format!(
            "{}/{}",
            le.namespace, le.lease_name
        )));
    }
    lock.release().await?;
    Ok(())
}

/// A running in-process operator (see [`spawn`]).
pub struct OperatorHandle {
    trigger: ShutdownTrigger,
    task: JoinHandle<Result<(), RunError>>,
}

/// Starts [`run`] on the current runtime.
pub fn spawn(client: Client, config: Config) -> OperatorHandle {
    let (trigger, shutdown) = shutdown_channel();
    let task = tokio::spawn(run(client, config, shutdown));
    OperatorHandle { trigger, task }
}

impl OperatorHandle {
    /// Stops gracefully and waits for it.
    pub async fn stop(self) -> Result<(), RunError> {
        self.trigger.trigger();
        self.task.await.map_err(|e| RunError::Task(e.to_string()))?
    }

    /// Stops at once, as a killed process would: in-flight requests are
    /// dropped and the Lease is not released. For fault tests.
    pub async fn kill(self) {
        self.task.abort();
        let _ = self.task.await;
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

fn scoped<K>(client: &Client, ns: Option<&str>) -> Api<K>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>,
{
    match ns {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

async fn run_controller(client: Client, config: Config, stop: Shutdown) {
    let ns = config.namespace.as_deref();
    // graceful_shutdown_on wants a Sync future; a oneshot receiver is.
    let (tx, rx) = futures::channel::oneshot::channel::<()>();
    // Both helper tasks end with this function, however it ends.
    let _stop_relay = AbortOnDropHandle::new(tokio::spawn(async move {
        stop.wait().await;
        let _ = tx.send(());
    }));

    // Every watch gets its own backoff, and its errors are logged here and
    // not passed on. With `Controller::new`/`owns`, all watches share one
    // backoff on the merged trigger stream, which grows with every error
    // from any watch and is reset only by an object event: after an API
    // server restart, each watch's dead connection then costs one ever
    // longer pause (minutes in total, measured) during which no event at all
    // is delivered. Hence the stream variants (kube's `unstable-runtime`
    // feature); see the e2e test `keeps_reconciling_after_an_apiserver_restart`.
    let (policy_store, writer) = reflector::store();
    let policies = watcher(
        scoped::<InferencePolicy>(&client, ns),
        watcher::Config::default(),
    )
    .backoff(watch_backoff())
    .reflect(writer)
    .applied_objects();
    let mut watches = Watches::new(&client, ns);
    let caches = watches.caches(ns, policy_store.clone());
    let ctx = Arc::new(Context {
        client: client.clone(),
        epp: EppSettings {
            image: config.epp_image.clone(),
            replicas: config.epp_replicas,
        },
        requeue: config.requeue.clone(),
        metrics: config.metrics.clone(),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.into(),
                instance: config.instance.clone(),
            },
        ),
        caches,
        memory: Memory::default(),
    });
    let _sweeper = AbortOnDropHandle::new(tokio::spawn(forget_deleted_policies(
        ctx.clone(),
        policy_store.clone(),
    )));

    let controller = Controller::for_stream(
        log_outages("InferencePolicy", policies),
        policy_store.clone(),
    )
    .with_config(controller::Config::default().concurrency(config.concurrency));
    let controller = watches.attach(controller, policy_store);
    tracing::info!(namespace = ns.unwrap_or("<all>"), "controller starting");
    controller
        .graceful_shutdown_on(rx.map(|_| ()))
        .run(reconcile::reconcile, reconcile::error_policy, ctx)
        .for_each(|result| async move {
            match result {
                Ok((object, _)) => tracing::debug!(policy = %object, "reconciled"),
                // Already logged by error_policy.
                Err(controller::Error::ReconcilerFailed(_, _)) => {}
                // An owned object changed after its policy was deleted (the
                // garbage collector at work): nothing to reconcile.
                Err(controller::Error::ObjectNotFound(object)) => {
                    tracing::debug!(policy = %object, "policy gone");
                }
                Err(e) => tracing::warn!(error = %e, "controller error"),
            }
        })
        .await;
    tracing::info!("controller stopped");
}

/// Policies deleted without a reconcile seeing them go (no finalizer, or
/// while the watch was down) leave memory behind: swept once a minute.
async fn forget_deleted_policies(ctx: Arc<Context>, policies: Store<InferencePolicy>) {
    loop {
        tokio::time::sleep(Duration::from_secs(60)).await;
        let live: HashSet<String> = policies.state().iter().filter_map(|p| p.uid()).collect();
        ctx.memory.retain(|uid| live.contains(uid));
    }
}

type Triggers<K> = BoxStream<'static, Result<K, watcher::Error>>;

/// The watches behind the caches and the controller's triggers. Built in two
/// steps because the reconcile context needs the stores before the
/// controller takes the streams.
struct Watches {
    service_accounts: Watched<PartialObjectMeta<ServiceAccount>>,
    roles: Watched<PartialObjectMeta<Role>>,
    role_bindings: Watched<PartialObjectMeta<RoleBinding>>,
    config_maps: Watched<PartialObjectMeta<ConfigMap>>,
    epp_reports: Watched<ConfigMap>,
    network_policies: Watched<PartialObjectMeta<NetworkPolicy>>,
    pod_disruption_budgets: Watched<PartialObjectMeta<PodDisruptionBudget>>,
    services: Watched<PartialObjectMeta<Service>>,
    deployments: Watched<Deployment>,
    pods: Watched<PartialObjectMeta<Pod>>,
    inference_pools: Watched<InferencePool>,
    http_routes: Watched<PartialObjectMeta<HttpRoute>>,
    backend_tls_policies: Watched<PartialObjectMeta<BackendTlsPolicy>>,
    gateways: Watched<PartialObjectMeta<Gateway>>,
}

struct Watched<K: Resource<DynamicType = ()> + Clone + 'static> {
    store: Store<K>,
    triggers: Option<Triggers<K>>,
}

impl Watches {
    fn new(client: &Client, ns: Option<&str>) -> Self {
        // Only objects carrying the policy label: the operator's own, and the
        // EPP Pods (their template carries it). Never all ConfigMaps or Pods.
        let ours = watcher::Config::default().labels(POLICY_LABEL);
        let reports = format!("{POLICY_LABEL},{COMPONENT_LABEL}={EPP_STATUS_COMPONENT}");
        let policy_config_maps =
            format!("{POLICY_LABEL},{COMPONENT_LABEL}!={EPP_STATUS_COMPONENT}");
        Self {
            service_accounts: watched(client, ns, &ours),
            roles: watched(client, ns, &ours),
            role_bindings: watched(client, ns, &ours),
            config_maps: watched(client, ns, &ours.clone().labels(&policy_config_maps)),
            epp_reports: watched(client, ns, &ours.clone().labels(&reports)),
            network_policies: watched(client, ns, &ours),
            pod_disruption_budgets: watched(client, ns, &ours),
            services: watched(client, ns, &ours),
            deployments: watched(client, ns, &ours),
            pods: watched(client, ns, &ours),
            // All of them: an attached policy's pool is not its own.
            inference_pools: watched(client, ns, &watcher::Config::default()),
            http_routes: watched(client, ns, &ours),
            backend_tls_policies: watched(client, ns, &ours),
            gateways: watch_gateways(client, ns),
        }
    }

    fn caches(&self, ns: Option<&str>, policies: Store<InferencePolicy>) -> Caches {
        Caches {
            service_accounts: self.service_accounts.store.clone(),
            roles: self.roles.store.clone(),
            role_bindings: self.role_bindings.store.clone(),
            config_maps: self.config_maps.store.clone(),
            epp_reports: self.epp_reports.store.clone(),
            network_policies: self.network_policies.store.clone(),
            pod_disruption_budgets: self.pod_disruption_budgets.store.clone(),
            services: self.services.store.clone(),
            deployments: self.deployments.store.clone(),
            pods: self.pods.store.clone(),
            inference_pools: self.inference_pools.store.clone(),
            http_routes: self.http_routes.store.clone(),
            backend_tls_policies: self.backend_tls_policies.store.clone(),
            gateways: self.gateways.store.clone(),
            policies,
            scope: ns.map(str::to_string),
            listed: Arc::default(),
        }
    }

    /// Hands every trigger stream to the controller.
    fn attach(
        &mut self,
        c: Controller<InferencePolicy>,
        policies: Store<InferencePolicy>,
    ) -> Controller<InferencePolicy> {
        let c = c.owns_stream(take(&mut self.service_accounts));
        let c = c.owns_stream(take(&mut self.roles));
        let c = c.owns_stream(take(&mut self.role_bindings));
        let c = c.owns_stream(take(&mut self.config_maps));
        // A Pod reporting a loaded hash or a provider key.
        let c = c.owns_stream(take(&mut self.epp_reports));
        let c = c.owns_stream(take(&mut self.network_policies));
        let c = c.owns_stream(take(&mut self.pod_disruption_budgets));
        let c = c.owns_stream(take(&mut self.services));
        // Rollout progress: waiting for the EPP needs no polling.
        let c = c.owns_stream(take(&mut self.deployments));
        // A pool's owner, and every policy attached to it: one appearing,
        // going, or naming another EPP changes their status.
        let attached = policies.clone();
        let c = c.watches_stream(take(&mut self.inference_pools), move |pool| {
            policies_on_pool(&attached, &pool)
        });
        let c = c.owns_stream(take(&mut self.http_routes));
        let c = c.owns_stream(take(&mut self.backend_tls_policies));
        // EPP Pods: one coming or going changes which reports count (and a
        // gone Pod's report is pruned).
        let c = c.watches_stream(take(&mut self.pods), |pod| {
            let policy = pod.labels().get(POLICY_LABEL)?.clone();
            let ns = pod.namespace()?;
            Some(ObjectRef::<InferencePolicy>::new(&policy).within(&ns))
        });
        // A parent Gateway created or deleted: the policies that name it.
        c.watches_stream(take(&mut self.gateways), move |gateway| {
            policies_naming(&policies, &gateway)
        })
    }
}

fn take<K: Resource<DynamicType = ()> + Clone + Send + 'static>(w: &mut Watched<K>) -> Triggers<K> {
    w.triggers
        .take()
        .unwrap_or_else(|| futures::stream::empty().boxed())
}

/// A labelled watch of `K` in scope, feeding a store and a trigger stream.
/// `K` is a `PartialObjectMeta<_>` for a metadata-only watch (the API server
/// then sends no more): owner references, names and versions are all most
/// reconciles read.
fn watched<K>(client: &Client, ns: Option<&str>, wc: &watcher::Config) -> Watched<K>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let stream = watcher(scoped::<K>(client, ns), wc.clone())
        .backoff(watch_backoff())
        .modify(strip_managed_fields)
        .reflect(writer)
        .touched_objects();
    Watched {
        store,
        triggers: Some(log_outages(K::kind(&()).into_owned(), stream).boxed()),
    }
}

/// Every Gateway's metadata in scope. Only a Gateway appearing or going away
/// triggers anything: a Gateway's status changes often and means nothing to
/// a policy.
fn watch_gateways(client: &Client, ns: Option<&str>) -> Watched<PartialObjectMeta<Gateway>> {
    let (store, writer) = reflector::store();
    let reader = store.clone();
    let mut known = HashSet::new();
    let stream = watcher(
        scoped::<PartialObjectMeta<Gateway>>(client, ns),
        watcher::Config::default(),
    )
    .backoff(watch_backoff())
    .modify(strip_managed_fields)
    .reflect(writer)
    .flat_map(move |event| {
        let changed: Vec<Result<_, watcher::Error>> = match event {
            Ok(watcher::Event::Apply(g) | watcher::Event::InitApply(g)) => {
                let new = known.insert(ObjectRef::from_obj(&g));
                new.then_some(Ok(g)).into_iter().collect()
            }
            Ok(watcher::Event::Delete(g)) => {
                let was = known.remove(&ObjectRef::from_obj(&g));
                was.then_some(Ok(g)).into_iter().collect()
            }
            // After a relist: those deleted while the watch was down.
            Ok(watcher::Event::InitDone) => {
                let gone: Vec<_> = known
                    .iter()
                    .filter(|r| reader.get(r).is_none())
                    .cloned()
                    .collect();
                gone.into_iter()
                    .map(|r| {
                        known.remove(&r);
                        Ok(gateway_named(&r))
                    })
                    .collect()
            }
            Ok(watcher::Event::Init) => Vec::new(),
            Err(e) => vec![Err(e)],
        };
        futures::stream::iter(changed)
    });
    Watched {
        store,
        triggers: Some(log_outages("Gateway", stream).boxed()),
    }
}

fn gateway_named(r: &ObjectRef<PartialObjectMeta<Gateway>>) -> PartialObjectMeta<Gateway> {
    let mut meta = PartialObjectMeta::<Gateway>::default();
    meta.metadata.name = Some(r.name.clone());
    meta.metadata.namespace = r.namespace.clone();
    meta
}

fn policies_on_pool(
    policies: &Store<InferencePolicy>,
    pool: &InferencePool,
) -> Vec<ObjectRef<InferencePolicy>> {
    let Some(ns) = pool.namespace() else {
        return Vec::new();
    };
    let name = pool.name_any();
    let owner = pool
        .owner_references()
        .iter()
        .filter(|o| o.controller == Some(true) && o.kind == InferencePolicy::kind(&()))
        .map(|o| ObjectRef::new(&o.name).within(&ns));
    let attached = policies
        .state()
        .into_iter()
        .filter(|p| p.namespace().as_deref() == Some(ns.as_str()))
        .filter(|p| p.spec.attached_pool() == Some(name.as_str()))
        .map(|p| ObjectRef::from_obj(p.as_ref()));
    owner.chain(attached).collect()
}

fn policies_naming(
    policies: &Store<InferencePolicy>,
    gateway: &PartialObjectMeta<Gateway>,
) -> Vec<ObjectRef<InferencePolicy>> {
    let (Some(gw_ns), gw_name) = (gateway.namespace(), gateway.name_any()) else {
        return Vec::new();
    };
    policies
        .state()
        .iter()
        .filter(|p| {
            let ns = p.namespace().unwrap_or_default();
            p.spec
                .policy
                .route
                .iter()
                .flat_map(|r| &r.parent_refs)
                .any(|parent| {
                    parent.name == gw_name && parent.namespace.as_deref().unwrap_or(&ns) == gw_ns
                })
        })
        .map(|p| ObjectRef::from_obj(p.as_ref()))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn shutdown_signal() {
        let (trigger, shutdown) = shutdown_channel();
        assert!(!shutdown.is_triggered());
        let waiter = tokio::spawn({
            let s = shutdown.clone();
            async move { s.wait().await }
        });
        trigger.trigger();
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .unwrap()
            .unwrap();
        assert!(shutdown.is_triggered());

        let (trigger, shutdown) = shutdown_channel();
        drop(trigger);
        assert!(shutdown.is_triggered());
        tokio::time::timeout(Duration::from_secs(1), shutdown.wait())
            .await
            .unwrap();
    }
}
