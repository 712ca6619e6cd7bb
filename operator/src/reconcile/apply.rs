//! Server-side apply of generated objects, and deletion of the ones no
//! longer wanted.
//!
//! Every apply uses one field manager with `force`, so the operator owns
//! exactly the fields it sets and takes them back from anyone who edited
//! them. An object is applied only when its desired state changed or
//! someone wrote it since this process last applied it (see
//! [`Memory::unchanged`]): a reconcile that finds nothing to do sends
//! nothing.
//!
//! Until a policy's objects have been applied once, an apply may only
//! create: an object that already exists under a generated name is someone
//! else's (the user's ConfigMap that happens to be called `<policy>-policy`)
//! and a forced apply would silently take it over. The API server enforces
//! this atomically, with no list or get beforehand (see [`CREATE_ONLY`]).

use std::collections::BTreeSet;

use kinference_api::POLICY_LABEL;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, Preconditions};
use kube::core::NamespaceResourceScope;
use kube::{Client, Resource};
use serde::Serialize;

use super::memory::{Memory, digest};
use crate::cache::MetaStore;
use crate::error::{Error, Verb, api_code};
use crate::resources::FIELD_MANAGER;

/// A resourceVersion no stored object has (etcd revisions never reach it).
/// An apply that carries a resourceVersion is refused with 409 unless the
/// object has exactly that version, while an apply that creates the object
/// ignores it: sent with this one, an apply creates or is refused, never
/// changes an existing object. `e2e/tests/operator.rs` holds the API server
/// to this.
const CREATE_ONLY: &str = "18446744073709551615";

/// Applies the objects of one policy.
pub struct Applier<'a> {
    pub client: &'a Client,
    pub memory: &'a Memory,
    /// The policy's uid.
    pub uid: &'a str,
    /// Whether objects not yet known to be the policy's may only be created:
    /// until its objects have been applied once.
    pub create_only: bool,
}

impl Applier<'_> {
    /// Applies `obj` (which carries its own name and namespace) unless it is
    /// unchanged since this process last applied it. `cached` is the watch's
    /// store of its kind. When `optional`, a kind the API server does not
    /// serve (404 for the resource type) is skipped, so a missing optional
    /// kind (BackendTLSPolicy) does not stop the rest.
    pub async fn apply<K>(
        &self,
        cached: &dyn MetaStore,
        obj: &K,
        optional: bool,
    ) -> Result<(), Error>
    where
        K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Serialize + std::fmt::Debug,
    {
        let name = obj.meta().name.clone().unwrap_or_default();
        let ns = obj.meta().namespace.clone().unwrap_or_default();
        let key = format!("{}/{name}", K::kind(&()));
        let digest = digest(obj);
        let seen = cached.get(&ns, &name);
        if self.memory.unchanged(self.uid, &key, digest, seen.as_ref()) {
            return Ok(());
        }
        let result = if self.create_only && !seen.as_ref().is_some_and(|m| self.controls(m)) {
            self.create(obj, optional).await
        } else {
            apply(self.client, obj, None, optional).await
        };
        match result {
            Ok(Some(answer)) => {
                self.memory.applied(self.uid, &key, digest, &answer);
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e) => {
                self.memory.forget_object(self.uid, &key);
                Err(e)
            }
        }
    }
}

impl Applier<'_> {
    /// Creates `obj`, or applies it if it exists under this policy's control
    /// (created by an earlier reconcile that did not get to write the
    /// status); any other existing object is a [`Error::Conflict`].
    async fn create<K>(
        &self,
        obj: &K,
        optional: bool,
    ) -> Result<Option<kube::api::ObjectMeta>, Error>
    where
        K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Serialize,
    {
        match apply(self.client, obj, Some(CREATE_ONLY), optional).await {
            Err(Error::Kube { source, .. }) if api_code(&source) == Some(409) => {}
            other => return other,
        }
        let name = obj.meta().name.clone().unwrap_or_default();
        let ns = obj.meta().namespace.clone().unwrap_or_default();
        let existing = api_for(self.client, obj)
            .get_metadata_opt(&name)
            .await
            .map_err(|e| Error::kube(Verb::Get, kind_name::<K>(), format!("{ns}/{name}"), e))?;
        match existing {
            Some(o) if !self.controls(&o.metadata) => {
                Err(Error::Conflict(format!("{} {ns}/{name}", kind_name::<K>())))
            }
            // Ours, or deleted since: an ordinary apply.
            _ => apply(self.client, obj, None, optional).await,
        }
    }

    /// Whether this policy is `meta`'s controller.
    fn controls(&self, meta: &kube::api::ObjectMeta) -> bool {
        meta.owner_references
            .iter()
            .flatten()
            .any(|r| r.controller == Some(true) && r.uid == self.uid)
    }
}

impl Applier<'_> {
    /// Like [`Applier::apply`], for an object others write too (the EPP
    /// status ConfigMap, whose data the EPP Pods patch): their writes move
    /// its version without undoing anything of ours, so only a new desired
    /// state or the object's absence leads to an apply.
    pub async fn apply_shared<K>(&self, cached: &dyn MetaStore, obj: &K) -> Result<(), Error>
    where
        K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Serialize + std::fmt::Debug,
    {
        let name = obj.meta().name.clone().unwrap_or_default();
        let ns = obj.meta().namespace.clone().unwrap_or_default();
        let key = format!("{}/{name}", K::kind(&()));
        let exists = cached.get(&ns, &name).is_some();
        if exists && self.memory.applied_digest(self.uid, &key) == Some(digest(obj)) {
            return Ok(());
        }
        self.apply(cached, obj, false).await
    }
}

/// Applies `obj`, with `resource_version` as a precondition if given, and
/// returns the metadata the API server answered with; None when `optional`
/// and the kind is not served.
async fn apply<K>(
    client: &Client,
    obj: &K,
    resource_version: Option<&str>,
    optional: bool,
) -> Result<Option<kube::api::ObjectMeta>, Error>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Serialize,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let ns = obj.meta().namespace.clone().unwrap_or_default();
    let mut body = serde_json::to_value(obj).map_err(|e| {
        Error::kube(
            Verb::Apply,
            kind_name::<K>(),
            format!("{ns}/{name}"),
            kube::Error::SerdeError(e),
        )
    })?;
    if let Some(version) = resource_version {
        body["metadata"]["resourceVersion"] = version.into();
    }
    let params = PatchParams::apply(FIELD_MANAGER).force();
    match api_for(client, obj)
        .patch(&name, &params, &Patch::Apply(&body))
        .await
    {
        Ok(answer) => Ok(Some(answer.metadata)),
        Err(e) if optional && is_missing_kind(&e) => {
            tracing::warn!(kind = %K::kind(&()), %ns, %name, "kind not served by the API server; skipped");
            Ok(None)
        }
        Err(e) => Err(Error::kube(
            Verb::Apply,
            kind_name::<K>(),
            format!("{ns}/{name}"),
            e,
        )),
    }
}

/// Deletes objects of kind `K` in `ns` labelled for `policy` and controlled
/// by the policy's `uid` whose names are not in `keep`, as the watch's store
/// `cached` shows them. Objects someone else labelled but the policy does not
/// control are left alone. Returns the deleted names.
pub async fn prune<K>(
    applier: &Applier<'_>,
    cached: &dyn MetaStore,
    ns: &str,
    policy: &str,
    keep: &BTreeSet<String>,
) -> Result<Vec<String>, Error>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>,
{
    let api: Api<DynamicObject> =
        Api::namespaced_with(applier.client.clone(), ns, &ApiResource::erase::<K>(&()));
    let mut deleted = Vec::new();
    for obj in cached.in_namespace(ns) {
        let name = obj.name.clone().unwrap_or_default();
        let labelled = obj
            .labels
            .as_ref()
            .and_then(|l| l.get(POLICY_LABEL))
            .is_some_and(|p| p == policy);
        let controlled = applier.controls(&obj);
        if !labelled || !controlled || keep.contains(&name) || obj.deletion_timestamp.is_some() {
            continue;
        }
        // The uid precondition makes sure we delete the object we saw, not
        // a namesake created meanwhile.
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: obj.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        applier
            .memory
            .forget_object(applier.uid, &format!("{}/{name}", K::kind(&())));
        match api.delete(&name, &dp).await {
            Ok(_) => {
                tracing::info!(kind = %K::kind(&()), %ns, %name, "deleted object no longer wanted");
                deleted.push(name);
            }
            // Already gone, or replaced by a namesake: nothing to do.
            Err(e) if matches!(api_code(&e), Some(404 | 409)) => {}
            Err(e) => {
                return Err(Error::kube(
                    Verb::Delete,
                    kind_name::<K>(),
                    format!("{ns}/{name}"),
                    e,
                ));
            }
        }
    }
    Ok(deleted)
}

pub(super) fn is_missing_kind(e: &kube::Error) -> bool {
    // A 404 from a PATCH/LIST with no object named in the details means the
    // resource type itself is unknown (CRD not installed).
    matches!(e, kube::Error::Api(s) if s.code == 404 && s.details.as_ref().is_none_or(|d| d.kind.is_empty() || d.name.is_empty()))
}

fn kind_name<K: Resource<DynamicType = ()>>() -> String {
    K::kind(&()).into_owned()
}

/// The API for `obj`'s kind in its namespace, as DynamicObjects: a response
/// then never fails to parse whatever status or defaults a third-party
/// schema adds.
fn api_for<K>(client: &Client, obj: &K) -> Api<DynamicObject>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>,
{
    let ns = obj.meta().namespace.clone().unwrap_or_default();
    Api::namespaced_with(client.clone(), &ns, &ApiResource::erase::<K>(&()))
}
