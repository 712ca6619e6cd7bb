//! A graceful stop (SIGTERM) over real gRPC: the EPP turns not Ready at once,
//! keeps deciding new streams through the shutdown delay, then serves no new
//! stream while the open ones finish.

use std::time::Duration;

use kinference_epp::endpoints::{EndpointSpec, endpoints_from_specs};
use kinference_epp::server::{Epp, Settings};
use kinference_testbed::extproc_client::{EppClient, HttpRequest};
use tokio::net::TcpListener;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// Ranks by backend name: needs no scraped metrics.
const POLICY: &str =
    "rules:\n  - name: only\n    route: { select: [{ type: Local, order: [sim] }] }\n";

fn chat() -> HttpRequest {
    HttpRequest::post(
        "/v1/chat/completions",
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
    )
}

/// The gRPC `readiness` status on `channel`: 1 SERVING, 2 NOT_SERVING.
async fn readiness(channel: tonic::transport::Channel) -> i32 {
    HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: "readiness".into(),
        })
        .await
        .map(|r| r.into_inner().status)
        .unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaving_epp_is_not_ready_serves_through_its_delay_then_finishes_open_streams() {
    let epp = Epp::new(Settings::default());
    epp.policy().load_text(POLICY).unwrap();
    let mut spec = EndpointSpec::new("127.0.0.1:9", &["m"]);
    spec.backend = Some("sim".into());
    epp.registry()
        .replace_all(endpoints_from_specs([spec]).unwrap());
    epp.registry().mark_synced();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn({
        let epp = epp.clone();
        async move {
            epp.serve_ext_proc(listener, async {
                let _ = stopped.await;
            })
            .await
        }
    });
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client = EppClient::connect(addr).await.unwrap();
    assert!(epp.ready());

    // A request decided before SIGTERM, its answer still streaming.
    let (before, open) = client.decide(&chat()).await.unwrap();
    assert_eq!(before.destination(), Some("127.0.0.1:9"));

    let leaving = tokio::spawn({
        let epp = epp.clone();
        async move { epp.leave(Duration::from_millis(800)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!epp.ready());
    // The health service turns NOT_SERVING within its 200 ms follow.
    let mut status = 0;
    for _ in 0..20 {
        status = readiness(channel.clone()).await;
        if status == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status, 2, "readiness NOT_SERVING while leaving");
    // Within the delay a new stream is still decided: a gateway that has
    // not yet moved away loses nothing.
    let (during, _) = client.decide(&chat()).await.unwrap();
    assert_eq!(during.destination(), Some("127.0.0.1:9"));

    leaving.await.unwrap();
    stop.send(()).unwrap();
    // The open stream finishes: its response path is still answered.
    let mut open = open;
    open.response_headers(200, Some("127.0.0.1:9"), None)
        .await
        .expect("the open stream is answered after the stop");
    open.finish().await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("the server stops once its streams are done")
        .unwrap()
        .unwrap();
    // Stopped: no new stream.
    assert!(client.decide(&chat()).await.is_err());
}
