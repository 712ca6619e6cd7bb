//! The Kinference operator: reconciles each `InferencePolicy` into an
//! InferencePool, an HTTPRoute, provider backends, the policy ConfigMap and
//! the EPP (Deployment, Service, ServiceAccount, Role, RoleBinding), all
//! server-side applied and owned by the policy, and reports `Accepted`,
//! `ResolvedRefs` and `Ready` in its status.
//!
//! Run it in-process with [`run`] (or [`spawn`]) and a [`Config`]; the
//! `kinference-operator` binary is a thin CLI around the same call.
#![forbid(unsafe_code)]

pub mod attachment;
pub mod cache;
pub mod error;
pub mod leader;
pub mod metrics;
pub mod reconcile;
pub mod resources;
pub mod runtime;
pub mod shutdown;
pub mod status;

pub use error::Error;
pub use leader::LeaderElectionConfig;
pub use metrics::{Health, Metrics};
pub use reconcile::Requeue;
pub use resources::FIELD_MANAGER;
pub use runtime::{Config, DEFAULT_EPP_IMAGE, OperatorHandle, RunError, run, spawn};
pub use shutdown::{Shutdown, ShutdownTrigger, shutdown_channel};
