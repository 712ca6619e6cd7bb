//! What `failureMode` means at a real gateway when the EPP dies: the EPP
//! binary behind Envoy (the override-host load balancing a gateway uses for
//! the endpoint picker protocol), a steady stream of streamed requests, and
//! the EPP SIGKILLed in the middle. With `failure_mode_allow` (what a
//! gateway configures for an InferencePool with `failureMode: FailOpen`)
//! and the request body buffered, every request is answered, those in
//! flight on the dead EPP's streams included, the rest by the gateway's own
//! round robin; with `FULL_DUPLEX_STREAMED` bodies Envoy fails them anyway;
//! without it (`FailClose`) requests fail from the kill on.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kinference_simulator::{SimConfig, SimHandle};
use kinference_testbed::envoy::{Bootstrap, Envoy, Template};

const POLICY: &str = "pool: { selector: { app: sim }, targetPorts: [{ number: 8000 }] }
rules:
  - name: least-queue
    route:
      select: [{ minimize: QueueDepth }]
      tieBreak: Random
";

struct EppProcess {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for EppProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    kinference_testbed::free_port().expect("a free port")
}

fn start_epp(sims: &[SimHandle]) -> (EppProcess, SocketAddr) {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let endpoints = dir.path().join("endpoints.yaml");
    let list: String = sims
        .iter()
        .map(|s| format!("- address: {}\n  models: [m]\n", s.addr()))
        .collect();
    std::fs::write(&endpoints, list).unwrap();
    let grpc = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_kinference-epp"))
        .args(["--bind-address", "127.0.0.1", "--secure-serving=false"])
        .args(["--grpc-port", &grpc.to_string()])
        .args(["--grpc-health-port", &free_port().to_string()])
        .args(["--metrics-port", &free_port().to_string()])
        .arg("--policy-file")
        .arg(&policy)
        .arg("--endpoints-file")
        .arg(&endpoints)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the EPP binary starts");
    let epp = EppProcess { child, _dir: dir };
    (epp, SocketAddr::from(([127, 0, 0, 1], grpc)))
}

/// One streamed request, read to its end: its status, or 0 when the
/// connection or the stream broke.
async fn ask(http: &reqwest::Client, url: &str) -> u16 {
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":20,"stream":true}"#;
    let Ok(mut answer) = http
        .post(url)
        .body(body)
        .header("content-type", "application/json")
        .send()
        .await
    else {
        return 0;
    };
    let status = answer.status().as_u16();
    loop {
        match answer.chunk().await {
            Ok(Some(_)) => {}
            Ok(None) => return status,
            Err(_) => return 0,
        }
    }
}

/// Statuses of a steady stream of requests (one every 30 ms), the EPP
/// killed after the tenth is sent; those sent before and after the kill.
/// `buffered`: the request body sent whole (`BUFFERED`), else both bodies
/// `FULL_DUPLEX_STREAMED`.
async fn kill_under_load(fail_open: bool, buffered: bool) -> (Vec<u16>, Vec<u16>) {
    let mut sims = Vec::new();
    for i in 0..2 {
        let config = SimConfig {
            // 20 tokens at 50 a second: each answer streams for 0.4 s.
            decode_tokens_per_sec: 50.0,
            ..SimConfig::new(format!("sim-{i}"), ["m"])
        };
        sims.push(
            kinference_simulator::spawn(config, "127.0.0.1:0".parse().unwrap())
                .await
                .unwrap(),
        );
    }
    let (mut epp, grpc) = start_epp(&sims);
    let bootstrap = Bootstrap {
        pool: sims.iter().map(SimHandle::addr).collect(),
        epp_tls: false,
        fail_open,
        buffered,
        ..Bootstrap::new(Template::Fallback, grpc)
    };
    let envoy = Envoy::start(&bootstrap).await.expect("Envoy starts");
    let url = envoy.url("/v1/chat/completions");
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    // Until the EPP decides (its rule named in Envoy's access log).
    let deadline = Instant::now() + Duration::from_secs(20);
    for probe in 0.. {
        let id = format!("probe-{probe}");
        let answer = http
            .post(&url)
            .header("x-request-id", &id)
            .header("content-type", "application/json")
            .body(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#)
            .send()
            .await;
        if answer.is_ok_and(|a| a.status() == 200) {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if envoy
                .access(&id)
                .is_some_and(|r| r.rule.as_deref() == Some("least-queue"))
            {
                break;
            }
        }
        assert!(Instant::now() < deadline, "the EPP never routed a request");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut before = Vec::new();
    let mut after = Vec::new();
    for i in 0..30 {
        if i == 10 {
            // SIGKILL, as the OOM killer sends it.
            epp.child.kill().unwrap();
            epp.child.wait().unwrap();
        }
        let (http, url) = (http.clone(), url.clone());
        let task = tokio::spawn(async move { ask(&http, &url).await });
        if i < 10 {
            before.push(task)
        } else {
            after.push(task)
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let mut statuses = (Vec::new(), Vec::new());
    for t in before {
        statuses.0.push(t.await.unwrap());
    }
    for t in after {
        statuses.1.push(t.await.unwrap());
    }
    envoy.stop().await;
    statuses
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_fail_open_and_a_buffered_body_the_gateway_answers_every_request_when_the_epp_is_killed()
 {
    let (before, after) = kill_under_load(true, true).await;
    println!("FailOpen, buffered: before the kill {before:?}, after {after:?}");
    assert!(
        before.iter().chain(&after).all(|&s| s == 200),
        "{before:?} {after:?}"
    );
}

/// Envoy 1.40 does not fail open a `FULL_DUPLEX_STREAMED` ext_proc stream:
/// with `failure_mode_allow` set, the requests still fail. A gateway that
/// must fail open sends the request body buffered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_fail_open_and_streamed_bodies_envoy_still_fails_the_requests() {
    let (_, after) = kill_under_load(true, false).await;
    println!("FailOpen, streamed: after the kill {after:?}");
    assert!(after.iter().all(|&s| s != 200), "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_fail_close_requests_fail_once_the_epp_is_killed() {
    let (_, after) = kill_under_load(false, true).await;
    println!("FailClose: after the kill {after:?}");
    assert!(after.iter().all(|&s| s != 200), "{after:?}");
}
