//! Which generated names are already taken in a namespace, and by whom:
//! before a policy's objects are applied for the first time, an object with
//! one of its names that the policy does not control is someone else's, and
//! is left alone (`Conflict`).
//!
//! One metadata list per kind and namespace answers for every policy
//! created there before the list was taken, so a burst of new policies in a
//! namespace costs a few lists, not one per generated object.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::core::NamespaceResourceScope;
use kube::{Client, Resource, ResourceExt};

use crate::error::{Error, Verb};

/// A list answers for policies created at least this long before it was
/// taken: creation timestamps have whole seconds, and the API server's
/// clock may differ a little from ours.
const MARGIN: SignedDuration = SignedDuration::from_secs(2);
/// Lists older than this are dropped.
const KEEP: Duration = Duration::from_secs(60);

/// Name -> uids of the objects' controllers.
type Owners = Arc<HashMap<String, Vec<String>>>;

#[derive(Default)]
pub struct TakenNames {
    lists: Mutex<HashMap<(String, String), (Timestamp, Owners)>>,
}

impl TakenNames {
    /// `Kind namespace/name` if an object named like `obj` exists and is not
    /// controlled by the policy `uid`, created at `created`.
    pub async fn foreign<K>(
        &self,
        client: &Client,
        obj: &K,
        uid: &str,
        created: Timestamp,
    ) -> Result<Option<String>, Error>
    where
        K: Resource<DynamicType = (), Scope = NamespaceResourceScope>,
    {
        let name = obj.meta().name.clone().unwrap_or_default();
        let ns = obj.meta().namespace.clone().unwrap_or_default();
        let owners = self.owners::<K>(client, &ns, created).await?;
        let ours = |controllers: &Vec<String>| controllers.iter().any(|c| c == uid);
        Ok(owners
            .get(&name)
            .filter(|c| !ours(c))
            .map(|_| format!("{} {ns}/{name}", K::kind(&()))))
    }

    async fn owners<K>(
        &self,
        client: &Client,
        ns: &str,
        created: Timestamp,
    ) -> Result<Owners, Error>
    where
        K: Resource<DynamicType = (), Scope = NamespaceResourceScope>,
    {
        let key = (ns.to_string(), K::kind(&()).into_owned());
        if let Some(owners) = self.recent(&key, created) {
            return Ok(owners);
        }
        // Taken before the request: the list shows at least what existed then.
        let taken = Timestamp::now();
        let owners = Arc::new(list::<K>(client, ns).await?);
        let mut lists = self.lists.lock().unwrap_or_else(|e| e.into_inner());
        let now = Timestamp::now();
        lists.retain(|_, (at, _)| now.duration_since(*at).unsigned_abs() < KEEP);
        lists.insert(key, (taken, owners.clone()));
        Ok(owners)
    }

    /// A kept list taken late enough after `created` to show everything that
    /// existed before the policy.
    fn recent(&self, key: &(String, String), created: Timestamp) -> Option<Owners> {
        let lists = self.lists.lock().unwrap_or_else(|e| e.into_inner());
        let (at, owners) = lists.get(key)?;
        let late_enough = at.duration_since(created) >= MARGIN;
        let fresh = Timestamp::now().duration_since(*at).unsigned_abs() < KEEP;
        (late_enough && fresh).then(|| owners.clone())
    }
}

async fn list<K>(client: &Client, ns: &str) -> Result<HashMap<String, Vec<String>>, Error>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>,
{
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &ApiResource::erase::<K>(&()));
    let objects = match api.list_metadata(&ListParams::default()).await {
        Ok(list) => list.items,
        // An optional kind the cluster does not serve: nothing to take over.
        Err(e) if super::apply::is_missing_kind(&e) => Vec::new(),
        Err(e) => {
            return Err(Error::kube(
                Verb::List,
                K::kind(&()).into_owned(),
                ns.to_string(),
                e,
            ));
        }
    };
    Ok(objects
        .iter()
        .map(|o| {
            let controllers = o
                .owner_references()
                .iter()
                .filter(|r| r.controller == Some(true))
                .map(|r| r.uid.clone())
                .collect();
            (o.name_any(), controllers)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(at: Timestamp) -> TakenNames {
        let taken = TakenNames::default();
        let owners = Arc::new(HashMap::from([("chat-policy".to_string(), vec![])]));
        taken
            .lists
            .lock()
            .unwrap()
            .insert(("ns".into(), "ConfigMap".into()), (at, owners));
        taken
    }

    fn key() -> (String, String) {
        ("ns".into(), "ConfigMap".into())
    }

    #[test]
    fn a_list_answers_only_for_policies_created_well_before_it() {
        let now = Timestamp::now();
        let taken = kept(now);
        let before = now - SignedDuration::from_secs(5);
        assert!(taken.recent(&key(), before).is_some());
        // Created in the same second (or on a clock a little ahead): the
        // list may predate a user's object that predates the policy.
        let just_before = now - SignedDuration::from_secs(1);
        assert!(taken.recent(&key(), just_before).is_none());
        assert!(
            taken
                .recent(&key(), now + SignedDuration::from_secs(3))
                .is_none()
        );
        assert!(
            taken
                .recent(&("other".into(), "ConfigMap".into()), before)
                .is_none()
        );
    }

    #[test]
    fn old_lists_are_not_used() {
        let at = Timestamp::now() - SignedDuration::from_secs(61);
        let taken = kept(at);
        assert!(
            taken
                .recent(&key(), at - SignedDuration::from_secs(10))
                .is_none()
        );
    }
}
