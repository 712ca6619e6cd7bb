//! Command-line flags of `kinference-epp`. In the library so the operator's
//! generated Deployment can be checked against them.

use std::path::PathBuf;

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "kinference-epp",
    version,
    about = "Kinference endpoint picker (Envoy ext_proc)"
)]
pub struct Args {
    /// ext_proc gRPC port.
    #[arg(long, default_value_t = 9002)]
    pub grpc_port: u16,
    /// gRPC health port.
    #[arg(long, default_value_t = 9003)]
    pub grpc_health_port: u16,
    /// HTTP port for /metrics, /healthz, /readyz, /debug/explain.
    #[arg(long, default_value_t = 9090)]
    pub metrics_port: u16,
    /// ConfigMap holding the compiled policy (watched through the API).
    #[arg(long, conflicts_with = "policy_file")]
    pub policy_configmap: Option<String>,
    /// A policy file instead (YAML/JSON, bare or InferencePolicy); reloaded on change.
    #[arg(long)]
    pub policy_file: Option<PathBuf>,
    /// Namespace of the pool, its ConfigMap and Secrets.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// This Pod's name, to report the loaded policy hash on it.
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// Standalone mode: endpoints from this file instead of Pod discovery.
    #[arg(long)]
    pub endpoints_file: Option<PathBuf>,
    /// Larger request bodies are refused with 413.
    #[arg(long, default_value_t = 16 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Honour the Gateway API Inference Extension conformance suite's test
    /// header and echo the served endpoint. Never enable in production.
    #[arg(long, default_value_t = false)]
    pub enable_conformance_hooks: bool,
    #[arg(long, default_value_t = 50)]
    pub scrape_interval_ms: u64,
    /// Serve ext_proc over TLS with a self-signed certificate (the reference
    /// EPP's default); `--secure-serving=false` for plaintext.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub secure_serving: bool,
    /// Log as JSON (default) or human-readable text.
    #[arg(long, default_value_t = false)]
    pub text_logs: bool,
}
