//! Process plumbing shared by `kinference-operator` and `kinference-epp`, so
//! both set up logs, signals, the admin HTTP server and background tasks the
//! same way:
//!
//! - [`logs`]: `--log-format json|text` and the `RUST_LOG` filter;
//! - [`signal`]: SIGTERM / Ctrl-C, never panicking on a failed handler;
//! - [`admin`]: serving `/metrics`, `/healthz`, `/readyz` until shutdown;
//! - [`supervisor`]: background tasks restarted with backoff, readiness off
//!   while one is down;
//! - [`sync`]: locks that recover from poisoning;
//! - [`watch`]: Kubernetes watches that recover within seconds of an
//!   API-server outage and log it once.
#![forbid(unsafe_code)]

pub mod admin;
pub mod logs;
pub mod signal;
pub mod supervisor;
pub mod sync;
pub mod watch;

pub use logs::{LogArgs, LogFormat};
pub use signal::shutdown_signal;
pub use supervisor::{AbortOnDrop, Readiness, RestartPolicy, Supervisor, TaskExit};
