//! What the operator's watches have seen. Reconciles read these stores
//! instead of asking the API server, so a reconcile that finds nothing to
//! change sends no request at all: with many policies, the idle operator is
//! quiet, and waiting for an EPP is driven by the Deployment, Pod and report
//! watches rather than by polling.

use std::sync::Arc;
use std::time::Duration;

use gateway_api::apis::standard::backendtlspolicies::BackendTlsPolicy;
use gateway_api::apis::standard::gateways::Gateway;
use gateway_api::apis::standard::httproutes::HttpRoute;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PartialObjectMeta;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};

use kinference_api::InferencePolicy;

use crate::resources::InferencePool;

/// Reads the metadata of cached objects of one kind.
pub trait MetaStore: Send + Sync {
    /// The object `ns/name`, if the watch has seen it.
    fn get(&self, ns: &str, name: &str) -> Option<ObjectMeta>;
    /// Every cached object in `ns`.
    fn in_namespace(&self, ns: &str) -> Vec<ObjectMeta>;
}

impl<K> MetaStore for Store<K>
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    fn get(&self, ns: &str, name: &str) -> Option<ObjectMeta> {
        Store::get(self, &ObjectRef::new(name).within(ns)).map(|o| o.meta().clone())
    }

    fn in_namespace(&self, ns: &str) -> Vec<ObjectMeta> {
        self.state()
            .iter()
            .filter(|o| o.namespace().as_deref() == Some(ns))
            .map(|o| o.meta().clone())
            .collect()
    }
}

/// The stores behind every watch, in the scope the operator watches. Every
/// store but `gateways` holds only objects that carry the policy label.
#[derive(Clone)]
pub struct Caches {
    pub service_accounts: Store<PartialObjectMeta<ServiceAccount>>,
    pub roles: Store<PartialObjectMeta<Role>>,
    pub role_bindings: Store<PartialObjectMeta<RoleBinding>>,
    /// Policy ConfigMaps, metadata only: their content can be large.
    pub config_maps: Store<PartialObjectMeta<ConfigMap>>,
    /// EPP status ConfigMaps, whole: their data is what the Pods report.
    pub epp_reports: Store<ConfigMap>,
    pub network_policies: Store<PartialObjectMeta<NetworkPolicy>>,
    pub pod_disruption_budgets: Store<PartialObjectMeta<PodDisruptionBudget>>,
    pub services: Store<PartialObjectMeta<Service>>,
    /// Whole: the status says whether the EPP is available.
    pub deployments: Store<Deployment>,
    pub pods: Store<PartialObjectMeta<Pod>>,
    /// Every InferencePool in scope, whole: attached policies read the
    /// selector and `endpointPickerRef` of pools they do not own.
    pub inference_pools: Store<InferencePool>,
    pub http_routes: Store<PartialObjectMeta<HttpRoute>>,
    pub backend_tls_policies: Store<PartialObjectMeta<BackendTlsPolicy>>,
    /// Every Gateway in scope (not only labelled ones): parentRefs name them.
    pub gateways: Store<PartialObjectMeta<Gateway>>,
    /// Every policy in scope (the controller's own store): who else is
    /// attached to a pool.
    pub policies: Store<InferencePolicy>,
    /// None: every namespace is watched.
    pub scope: Option<String>,
    /// Set once every store has been listed (or the wait for it ran out).
    pub listed: Arc<tokio::sync::OnceCell<()>>,
}

/// How long the first reconciles wait for the watches' first lists. A watch
/// that cannot list (a missing CRD, no permission) must not hold every
/// reconcile for ever; its store then reads empty, as before.
const FIRST_LIST_WAIT: Duration = Duration::from_secs(30);

impl Caches {
    /// Waits, once per process, until every watch has listed its objects.
    /// A reconcile that ran earlier would see a half-filled cache: an EPP
    /// Deployment or report not listed yet reads as missing, and a restarted
    /// operator would write a status it takes back a moment later.
    pub async fn wait_listed(&self) {
        self.listed
            .get_or_init(|| async {
                let all = async {
                    futures::try_join!(
                        self.service_accounts.wait_until_ready(),
                        self.roles.wait_until_ready(),
                        self.role_bindings.wait_until_ready(),
                        self.config_maps.wait_until_ready(),
                        self.epp_reports.wait_until_ready(),
                        self.network_policies.wait_until_ready(),
                        self.pod_disruption_budgets.wait_until_ready(),
                        self.services.wait_until_ready(),
                        self.deployments.wait_until_ready(),
                        self.pods.wait_until_ready(),
                        self.inference_pools.wait_until_ready(),
                        self.http_routes.wait_until_ready(),
                        self.backend_tls_policies.wait_until_ready(),
                        self.gateways.wait_until_ready(),
                        self.policies.wait_until_ready(),
                    )
                };
                match tokio::time::timeout(FIRST_LIST_WAIT, all).await {
                    Ok(Ok(_)) => tracing::debug!("every watch has listed"),
                    Ok(Err(e)) => tracing::warn!(error = %e, "a watch stopped before listing"),
                    Err(_) => tracing::warn!(
                        wait = ?FIRST_LIST_WAIT,
                        "not every watch has listed; reconciling with what has arrived"
                    ),
                }
            })
            .await;
    }

    /// Whether the watches cover objects in `ns`.
    pub fn covers(&self, ns: &str) -> bool {
        self.scope.as_deref().is_none_or(|s| s == ns)
    }

    pub fn deployment(&self, ns: &str, name: &str) -> Option<Arc<Deployment>> {
        self.deployments.get(&ObjectRef::new(name).within(ns))
    }

    pub fn epp_report(&self, ns: &str, name: &str) -> Option<Arc<ConfigMap>> {
        self.epp_reports.get(&ObjectRef::new(name).within(ns))
    }

    /// Cached EPP Pods in `ns` whose labels include all of `selector`.
    pub fn pods_matching(
        &self,
        ns: &str,
        selector: &std::collections::BTreeMap<String, String>,
    ) -> Vec<ObjectMeta> {
        MetaStore::in_namespace(&self.pods, ns)
            .into_iter()
            .filter(|p| {
                let labels = p.labels.as_ref();
                selector
                    .iter()
                    .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
            })
            .collect()
    }

    pub fn inference_pool(&self, ns: &str, name: &str) -> Option<Arc<InferencePool>> {
        self.inference_pools.get(&ObjectRef::new(name).within(ns))
    }

    /// Every cached policy in `ns`.
    pub fn policies_in(&self, ns: &str) -> Vec<Arc<InferencePolicy>> {
        self.policies
            .state()
            .into_iter()
            .filter(|p| p.namespace().as_deref() == Some(ns))
            .collect()
    }

    pub fn gateway_exists(&self, ns: &str, name: &str) -> bool {
        MetaStore::get(&self.gateways, ns, name).is_some()
    }
}

/// Managed fields are the largest part of most objects' metadata and no
/// reconcile reads them: dropped before they reach a store.
pub fn strip_managed_fields<K: Resource>(obj: &mut K) {
    obj.meta_mut().managed_fields = None;
}

#[cfg(test)]
mod tests {
    use kube::runtime::reflector::{self, store::Writer};
    use kube::runtime::watcher::Event;

    use super::*;

    /// A store whose watch has listed (InitDone seen), and its writer.
    fn listed<K>() -> (Store<K>, Writer<K>)
    where
        K: Resource<DynamicType = ()> + Clone + 'static,
    {
        let (store, mut writer) = reflector::store();
        writer.apply_watcher_event(&Event::InitDone);
        (store, writer)
    }

    #[tokio::test]
    async fn reconciles_wait_until_every_watch_has_listed() {
        let (deployments, mut deployments_writer) = reflector::store::<Deployment>();
        let sa = listed();
        let roles = listed();
        let bindings = listed();
        let cms = listed();
        let reports = listed();
        let netpols = listed();
        let services = listed();
        let pods = listed();
        let pools = listed();
        let routes = listed();
        let tls = listed();
        let gateways = listed();
        let caches = Caches {
            service_accounts: sa.0,
            roles: roles.0,
            role_bindings: bindings.0,
            config_maps: cms.0,
            epp_reports: reports.0,
            network_policies: netpols.0,
            pod_disruption_budgets: listed().0,
            services: services.0,
            deployments,
            pods: pods.0,
            inference_pools: pools.0,
            http_routes: routes.0,
            backend_tls_policies: tls.0,
            gateways: gateways.0,
            policies: listed().0,
            scope: None,
            listed: Arc::default(),
        };
        let waiting = tokio::spawn({
            let caches = caches.clone();
            async move { caches.wait_listed().await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !waiting.is_finished(),
            "a reconcile ran before the Deployments were listed"
        );
        deployments_writer.apply_watcher_event(&Event::InitDone);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("still waiting after every watch listed")
            .expect("wait task");
        // Once listed, later reconciles do not wait at all.
        tokio::time::timeout(Duration::from_millis(1), caches.wait_listed())
            .await
            .expect("a second wait");
    }
}
