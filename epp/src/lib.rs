//! The Kinference endpoint picker: an Envoy ext_proc server that routes each
//! LLM request by the policy (see `kinference_policy`) over discovered model
//! servers and configured providers.
#![forbid(unsafe_code)]

pub mod classify;
pub mod cli;
pub mod endpoints;
pub mod extproc;
pub mod flow;
pub mod k8s;
pub mod kv_cache;
pub mod kv_events;
mod lists;
pub mod metrics;
pub mod objectives;
pub mod picker;
pub mod policy_file;
pub mod policy_store;
mod pool_metrics;
pub mod predict;
pub mod provider_keys;
pub mod server;
