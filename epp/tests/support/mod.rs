//! What the integration tests that run the EPP in-process share: the EPP
//! serving `specs` over ext_proc, behind real Envoy.

use std::net::SocketAddr;
use std::time::Duration;

use kinference_epp::endpoints::{EndpointSpec, endpoints_from_specs};
use kinference_epp::server::Epp;
use kinference_testbed::envoy::{Bootstrap, Envoy, Template};
use tokio::net::TcpListener;

/// Registers `specs` as the pool (synced), scrapes them, serves ext_proc on
/// a free port and starts Envoy in front of it routing to `pool`; returns
/// once every endpoint has been scraped.
pub async fn serve_behind_envoy(
    epp: &Epp,
    specs: Vec<EndpointSpec>,
    pool: Vec<SocketAddr>,
) -> Envoy {
    epp.registry()
        .replace_all(endpoints_from_specs(specs).unwrap());
    epp.registry().mark_synced();
    epp.spawn_scraper();
    let ext_proc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ext_proc_addr = ext_proc.local_addr().unwrap();
    tokio::spawn({
        let epp = epp.clone();
        async move { epp.serve_ext_proc(ext_proc, std::future::pending()).await }
    });
    let bootstrap = Bootstrap {
        pool,
        ..Bootstrap::new(Template::Streamed, ext_proc_addr)
    };
    let envoy = Envoy::start(&bootstrap).await.expect("Envoy starts");
    assert!(
        epp.registry()
            .wait_until_scraped(Duration::from_secs(10))
            .await
    );
    envoy
}
