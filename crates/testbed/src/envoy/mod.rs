//! A real Envoy in front of the EPP: find or install the pinned binary, render
//! a bootstrap from the templates, run it on loopback, read its admin API.

mod binary;
mod bootstrap;
mod process;

pub use binary::{ENVOY_VERSION, ensure_envoy, locate_envoy};
pub use bootstrap::{ACCESS_LOG_FORMAT, Bootstrap, ClientCert, ServedReport, Template};
pub use process::{AccessRecord, Envoy};
