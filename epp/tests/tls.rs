//! The ext_proc port over TLS (the reference EPP's default): a self-signed
//! certificate, ALPN h2. Checked with the openssl client, as a gateway would
//! connect.

use std::process::Command;
use std::time::Duration;

use kinference_epp::server::{Epp, Settings};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secure_serving_negotiates_h2_over_tls() {
    let epp = Epp::new(Settings {
        secure_serving: true,
        ..Settings::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = epp.clone();
    tokio::spawn(async move {
        server
            .serve_ext_proc(listener, std::future::pending())
            .await
            .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let output = tokio::task::spawn_blocking(move || {
        Command::new("openssl")
            .args([
                "s_client",
                "-alpn",
                "h2",
                "-connect",
                &addr.to_string(),
                "-servername",
                "kinference-epp",
            ])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("the openssl command line is installed")
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("ALPN protocol: h2"), "{text}");
    assert!(
        text.contains("CN=rcgen self signed cert") || text.contains("subject="),
        "{text}"
    );

    // A plaintext gRPC client cannot talk to it.
    let plain = kinference_testbed::extproc_client::EppClient::connect(addr).await;
    if let Ok(client) = plain {
        let result = client
            .decide(&kinference_testbed::extproc_client::HttpRequest::post(
                "/v1/completions",
                br#"{"model":"m","prompt":"x"}"#.to_vec(),
            ))
            .await;
        assert!(
            result.is_err(),
            "plaintext must not work against the TLS port"
        );
    }
}
