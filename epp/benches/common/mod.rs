//! What the load benches share: percentiles, `--name value` flags, and the
//! EPP as its binary runs with default flags, serving ext_proc on loopback
//! in front of simulators.

// Each bench uses its part of this module.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use kinference_epp::endpoints::{EndpointSpec, endpoints_from_specs};
use kinference_epp::server::{Epp, Settings};
use kinference_simulator::SimHandle;
use kinference_testbed::envoy::{Bootstrap, Envoy, Template};
use tokio::net::TcpListener;

pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// The EPP as the binary runs it with its default flags, serving ext_proc on
/// loopback until the returned sender fires.
pub struct RunningEpp {
    pub epp: Epp,
    pub stop: tokio::sync::oneshot::Sender<()>,
    pub server: tokio::task::JoinHandle<anyhow::Result<()>>,
    pub scraper: tokio::task::JoinHandle<()>,
}

pub async fn start_epp(
    policy: &str,
    model: &str,
    sims: &[SimHandle],
) -> anyhow::Result<(SocketAddr, RunningEpp)> {
    let epp = Epp::new(Settings {
        secure_serving: true,
        ..Settings::default()
    });
    epp.policy()
        .load_text(policy)
        .map_err(|e| anyhow::anyhow!(e))?;
    // Standalone endpoints, as `--endpoints-file` gives them.
    epp.registry()
        .replace_all(endpoints_from_specs(sims.iter().map(|s| {
            let mut spec = EndpointSpec::new(s.addr().to_string(), &[model]);
            spec.name = Some(s.name().to_string());
            spec
        }))?);
    epp.registry().mark_synced();
    let scraper = epp.spawn_scraper();
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn({
        let epp = epp.clone();
        async move {
            epp.serve_ext_proc(listener, async move {
                let _ = stopped.await;
            })
            .await
        }
    });
    if !epp
        .registry()
        .wait_until_scraped(Duration::from_secs(5))
        .await
    {
        anyhow::bail!("the EPP never scraped the simulators");
    }
    Ok((
        addr,
        RunningEpp {
            epp,
            stop,
            server,
            scraper,
        },
    ))
}

/// `--name value` flags; anything else (cargo passes `--bench`) is ignored.
pub fn flags() -> BTreeMap<String, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut out = BTreeMap::new();
    let mut i = 0;
    while i < args.len() {
        if let Some(name) = args[i].strip_prefix("--") {
            let value = args
                .get(i + 1)
                .filter(|v| !v.starts_with("--"))
                .cloned()
                .unwrap_or_default();
            if !value.is_empty() {
                i += 1;
            }
            out.insert(name.to_string(), value);
        }
        i += 1;
    }
    out
}

/// Envoy in front of `sims` (the template's ext_proc to `epp`), and a
/// client for the load: no proxy, no Nagle, connections kept.
pub async fn gateway(
    template: Template,
    epp: SocketAddr,
    sims: &[SimHandle],
) -> anyhow::Result<(Envoy, reqwest::Client)> {
    let bootstrap = Bootstrap {
        pool: sims.iter().map(SimHandle::addr).collect(),
        ..Bootstrap::new(template, epp)
    };
    let envoy = Envoy::start(&bootstrap).await?;
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(512)
        .tcp_nodelay(true)
        .build()?;
    Ok((envoy, client))
}
