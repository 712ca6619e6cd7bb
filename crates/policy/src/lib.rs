//! The Kinference policy language: the YAML users write ([`spec`]), the
//! compiler that checks it ([`compile()`]), the typed result ([`model`]) and
//! the evaluator that routes one request ([`eval`]). Pure: no I/O, no
//! Kubernetes; the operator, the EPP and the CLI share this one implementation.
#![forbid(unsafe_code)]

pub mod attr;
pub mod compile;
pub mod duration;
pub mod eval;
pub mod lint;
pub mod model;
pub mod pattern;
pub mod source;
pub mod spec;
pub mod yaml;

pub use compile::{CompileError, CompileErrors, compile, policy_hash};
pub use model::{CompiledPolicy, Pool};
pub use spec::PolicySpec;
