//! What the operator's watches have seen. Reconciles read these stores
//! instead of asking the API server, so a reconcile that finds nothing to
//! change sends no request at all: with many policies, the idle operator is
//! quiet, and waiting for an EPP is driven by the Deployment, Pod and report
//! watches rather than by polling.

use std::sync::Arc;

use gateway_api::apis::standard::backendtlspolicies::BackendTlsPolicy;
use gateway_api::apis::standard::gateways::Gateway;
use gateway_api::apis::standard::httproutes::HttpRoute;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PartialObjectMeta;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};

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
    pub services: Store<PartialObjectMeta<Service>>,
    /// Whole: the status says whether the EPP is available.
    pub deployments: Store<Deployment>,
    pub pods: Store<PartialObjectMeta<Pod>>,
    pub inference_pools: Store<PartialObjectMeta<InferencePool>>,
    pub http_routes: Store<PartialObjectMeta<HttpRoute>>,
    pub backend_tls_policies: Store<PartialObjectMeta<BackendTlsPolicy>>,
    /// Every Gateway in scope (not only labelled ones): parentRefs name them.
    pub gateways: Store<PartialObjectMeta<Gateway>>,
    /// None: every namespace is watched.
    pub scope: Option<String>,
}

impl Caches {
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

    pub fn gateway_exists(&self, ns: &str, name: &str) -> bool {
        MetaStore::get(&self.gateways, ns, name).is_some()
    }
}

/// Managed fields are the largest part of most objects' metadata and no
/// reconcile reads them: dropped before they reach a store.
pub fn strip_managed_fields<K: Resource>(obj: &mut K) {
    obj.meta_mut().managed_fields = None;
}
