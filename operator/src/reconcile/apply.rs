//! Server-side apply of generated objects, and deletion of the ones no
//! longer wanted.
//!
//! Every apply uses one field manager with `force`, so the operator owns
//! exactly the fields it sets and takes them back from anyone who edited
//! them. An object is applied only when its desired state changed or
//! someone wrote it since this process last applied it (see
//! [`Memory::unchanged`]): a reconcile that finds nothing to do sends
//! nothing.

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

/// Applies the objects of one policy.
pub struct Applier<'a> {
    pub client: &'a Client,
    pub memory: &'a Memory,
    /// The policy's uid.
    pub uid: &'a str,
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
        if self
            .memory
            .unchanged(self.uid, &key, digest, cached.get(&ns, &name).as_ref())
        {
            return Ok(());
        }
        match apply(self.client, obj, optional).await {
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

/// Applies `obj` and returns the metadata the API server answered with;
/// None when `optional` and the kind is not served.
pub async fn apply<K>(
    client: &Client,
    obj: &K,
    optional: bool,
) -> Result<Option<kube::api::ObjectMeta>, Error>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Serialize + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let ns = obj.meta().namespace.clone().unwrap_or_default();
    // Sent and read back as a DynamicObject: the response then never fails
    // to parse whatever status or defaults a third-party schema adds.
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &ApiResource::erase::<K>(&()));
    let params = PatchParams::apply(FIELD_MANAGER).force();
    match api.patch(&name, &params, &Patch::Apply(obj)).await {
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
        let controlled = obj
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.controller == Some(true) && o.uid == applier.uid);
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
