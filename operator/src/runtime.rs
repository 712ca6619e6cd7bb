//! Running the operator: the controller's watches, leader election, and
//! stopping cleanly. [`run`] is what the binary calls and what tests call
//! in-process.

use std::sync::Arc;
use std::time::Instant;

use futures::{FutureExt, StreamExt};
use gateway_api::apis::standard::backendtlspolicies::BackendTlsPolicy;
use gateway_api::apis::standard::httproutes::HttpRoute;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kinference_api::{InferencePolicy, POLICY_LABEL};
use kinference_runtime::watch::{log_outages, watch_backoff};
use kube::api::PartialObjectMeta;
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::error::Error;
use crate::leader::{LeaderElectionConfig, LeaseLock};
use crate::metrics::{Health, Metrics};
use crate::reconcile::{self, Context, Requeue};
use crate::resources::{EppSettings, FIELD_MANAGER, InferencePool};

pub const DEFAULT_EPP_IMAGE: &str = "ghcr.io/kinference/epp:0.1.0";

/// Operator settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// Image of the EPP Deployments.
    pub epp_image: String,
    /// Replicas of each EPP Deployment.
    pub epp_replicas: i32,
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
            epp_replicas: 1,
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

/// Receiving end of a stop signal; cheap to clone.
#[derive(Clone, Debug)]
pub struct Shutdown {
    rx: watch::Receiver<bool>,
}

/// Sending end: [`ShutdownTrigger::trigger`] (or dropping it) stops every
/// holder of the paired [`Shutdown`].
#[derive(Debug)]
pub struct ShutdownTrigger {
    tx: watch::Sender<bool>,
}

/// A new stop signal.
pub fn shutdown_channel() -> (ShutdownTrigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (ShutdownTrigger { tx }, Shutdown { rx })
}

impl ShutdownTrigger {
    pub fn trigger(&self) {
        self.tx.send_replace(true);
    }
}

impl Shutdown {
    /// Resolves once triggered (or once the trigger is dropped: an owner
    /// that went away cannot stop us any more, so we stop).
    pub async fn wait(&self) {
        let mut rx = self.rx.clone();
        let _ = rx.wait_for(|stop| *stop).await;
    }

    pub fn is_triggered(&self) -> bool {
        *self.rx.borrow() || self.rx.has_changed().is_err()
    }
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
    let controller = tokio::spawn(run_controller(client, config.clone(), controller_stop));
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
    // Only objects carrying the policy label: the operator's own, and the
    // EPP Pods (their template carries it). Never all ConfigMaps or Pods.
    let ours = watcher::Config::default().labels(POLICY_LABEL);
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
    });

    // graceful_shutdown_on wants a Sync future; a oneshot receiver is.
    let (tx, rx) = futures::channel::oneshot::channel::<()>();
    let stop_task = tokio::spawn(async move {
        stop.wait().await;
        let _ = tx.send(());
    });

    // Every watch gets its own backoff, and its errors are logged here and
    // not passed on. With `Controller::new`/`owns`, all watches share one
    // backoff on the merged trigger stream, which grows with every error
    // from any watch and is reset only by an object event: after an API
    // server restart, each watch's dead connection then costs one ever
    // longer pause (minutes in total, measured) during which no event at all
    // is delivered. Hence the stream variants (kube's `unstable-runtime`
    // feature); see the e2e test `keeps_reconciling_after_an_apiserver_restart`.
    let (store, writer) = reflector::store();
    let policies = watcher(
        scoped::<InferencePolicy>(&client, ns),
        watcher::Config::default(),
    )
    .backoff(watch_backoff())
    .reflect(writer)
    .applied_objects();
    let controller = Controller::for_stream(log_outages("InferencePolicy", policies), store)
        .with_config(controller::Config::default().concurrency(config.concurrency));
    let controller = owns::<ServiceAccount>(controller, &client, ns, &ours);
    let controller = owns::<Role>(controller, &client, ns, &ours);
    let controller = owns::<RoleBinding>(controller, &client, ns, &ours);
    // The policy ConfigMap, and the EPP status ConfigMap the EPP Pods write:
    // a Pod reporting a loaded hash or a provider key triggers a reconcile.
    let controller = owns::<ConfigMap>(controller, &client, ns, &ours);
    let controller = owns::<NetworkPolicy>(controller, &client, ns, &ours);
    let controller = owns::<Service>(controller, &client, ns, &ours);
    let controller = owns::<Deployment>(controller, &client, ns, &ours);
    let controller = owns::<InferencePool>(controller, &client, ns, &ours);
    let controller = owns::<HttpRoute>(controller, &client, ns, &ours);
    let controller = owns::<BackendTlsPolicy>(controller, &client, ns, &ours);
    // EPP Pods: one coming or going changes which reports count (and a gone
    // Pod's report is pruned). Metadata is all that is needed.
    let pods = watcher(scoped::<PartialObjectMeta<Pod>>(&client, ns), ours.clone())
        .backoff(watch_backoff())
        .touched_objects();
    tracing::info!(namespace = ns.unwrap_or("<all>"), "controller starting");
    controller
        .watches_stream(log_outages("Pod", pods), |pod: PartialObjectMeta<Pod>| {
            let policy = pod.labels().get(POLICY_LABEL)?.clone();
            let ns = pod.namespace()?;
            Some(ObjectRef::<InferencePolicy>::new(&policy).within(&ns))
        })
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
    stop_task.abort();
    tracing::info!("controller stopped");
}

fn owns<K>(
    controller: Controller<InferencePolicy>,
    client: &Client,
    ns: Option<&str>,
    wc: &watcher::Config,
) -> Controller<InferencePolicy>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
{
    // Metadata only: owner references are all a trigger needs.
    let stream = watcher(scoped::<PartialObjectMeta<K>>(client, ns), wc.clone())
        .backoff(watch_backoff())
        .touched_objects();
    controller.owns_stream(log_outages(K::kind(&()).into_owned(), stream))
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
