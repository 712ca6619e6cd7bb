//! Leader election on a `coordination.k8s.io/v1` Lease, kept deliberately
//! simple: read the Lease, and take or renew it with a `replace` guarded by
//! the `resourceVersion` just read, so two candidates can never both win the
//! same round (the loser gets 409 Conflict).
//!
//! Expiry is judged on the local monotonic clock, like client-go: a Lease is
//! free when its record (holder, renewTime) has not changed for
//! `leaseDurationSeconds` since this candidate first saw it. Comparing the
//! holder's `renewTime` with our wall clock would trust clock sync between
//! nodes.
//!
//! Why not the `kube-leader-election` crate (0.44, kube 4): it can express
//! neither property. Its acquire and renew are JSON merge patches that carry
//! no resourceVersion, so two candidates that read the same free (or
//! expired) Lease both get 200 and both believe they lead until their next
//! round; and it judges expiry by comparing the holder's `renewTime` with
//! the local wall clock. The e2e test `racing_candidates_never_both_win_a_round`
//! checks the first property here.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::{Client, ResourceExt};

use crate::error::{Error, Verb, api_code};

/// Leader election settings.
#[derive(Clone, Debug)]
pub struct LeaderElectionConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Lease name; `kinference-operator` by default.
    pub lease_name: String,
    /// This candidate's identity (its Pod name in a cluster); must be unique.
    pub identity: String,
    /// How long a Lease stays valid without renewal.
    pub lease_duration: Duration,
    /// How often the leader renews (and a standby retries).
    pub retry_period: Duration,
    /// The leader gives up (stops reconciling) when it could not renew for
    /// this long; must be shorter than `lease_duration`, so the old leader
    /// has stopped before anyone else may take over.
    pub renew_deadline: Duration,
}

impl LeaderElectionConfig {
    pub fn new(namespace: impl Into<String>, identity: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            lease_name: "kinference-operator".into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            retry_period: Duration::from_secs(2),
            renew_deadline: Duration::from_secs(10),
        }
    }
}

/// What this candidate last saw of the Lease record.
#[derive(Debug)]
struct Observed {
    holder: Option<String>,
    renew_time: Option<MicroTime>,
    since: Instant,
}

/// One candidate for the Lease.
pub struct LeaseLock {
    api: Api<Lease>,
    config: LeaderElectionConfig,
    observed: Option<Observed>,
}

impl LeaseLock {
    pub fn new(client: Client, config: LeaderElectionConfig) -> Self {
        Self {
            api: Api::namespaced(client, &config.namespace),
            config,
            observed: None,
        }
    }

    pub fn identity(&self) -> &str {
        &self.config.identity
    }

    pub fn config(&self) -> &LeaderElectionConfig {
        &self.config
    }

    fn object(&self) -> String {
        format!("{}/{}", self.config.namespace, self.config.lease_name)
    }

    /// One round: create, take over or renew the Lease. True when this
    /// candidate holds it afterwards.
    pub async fn try_acquire_or_renew(&mut self) -> Result<bool, Error> {
        let name = self.config.lease_name.clone();
        let now = MicroTime(Timestamp::now());
        let duration = i32::try_from(self.config.lease_duration.as_secs()).unwrap_or(i32::MAX);
        let existing = self
            .api
            .get_opt(&name)
            .await
            .map_err(|e| Error::kube(Verb::Get, "Lease", self.object(), e))?;
        let Some(mut lease) = existing else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.config.identity.clone()),
                    lease_duration_seconds: Some(duration),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                // Someone else created it first.
                Err(e) if api_code(&e) == Some(409) => Ok(false),
                Err(e) => Err(Error::kube(Verb::Apply, "Lease", self.object(), e)),
            };
        };

        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let ours = holder.as_deref() == Some(self.config.identity.as_str());
        let record_changed = self
            .observed
            .as_ref()
            .is_none_or(|o| o.holder != holder || o.renew_time != spec.renew_time);
        if record_changed {
            self.observed = Some(Observed {
                holder: holder.clone(),
                renew_time: spec.renew_time.clone(),
                since: Instant::now(),
            });
        }
        let held_for =
            Duration::from_secs(spec.lease_duration_seconds.unwrap_or(duration).max(1) as u64);
        let expired = self
            .observed
            .as_ref()
            .is_some_and(|o| o.since.elapsed() > held_for);
        if !ours && holder.is_some() && !expired {
            return Ok(false);
        }
        if !ours {
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.holder_identity = Some(self.config.identity.clone());
        spec.lease_duration_seconds = Some(duration);
        spec.renew_time = Some(now);
        // `replace` sends the resourceVersion we read: if anyone wrote the
        // Lease since, the server answers 409 and we lost this round.
        match self
            .api
            .replace(&name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if api_code(&e) == Some(409) => Ok(false),
            Err(e) => Err(Error::kube(Verb::Apply, "Lease", self.object(), e)),
        }
    }

    /// Gives the Lease up (on graceful shutdown) so a standby takes over at
    /// once instead of waiting for expiry. Only if we still hold it.
    pub async fn release(&mut self) -> Result<(), Error> {
        let name = self.config.lease_name.clone();
        let Some(mut lease) = self
            .api
            .get_opt(&name)
            .await
            .map_err(|e| Error::kube(Verb::Get, "Lease", self.object(), e))?
        else {
            return Ok(());
        };
        let Some(spec) = lease.spec.as_mut() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        spec.lease_duration_seconds = Some(1);
        match self
            .api
            .replace(&name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => {
                tracing::info!(lease = %lease.name_any(), "released leader Lease");
                Ok(())
            }
            Err(e) if api_code(&e) == Some(409) => Ok(()),
            Err(e) => Err(Error::kube(Verb::Apply, "Lease", self.object(), e)),
        }
    }
}
