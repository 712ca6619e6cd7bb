//! Command-line flags of `kinference-epp`. In the library so the operator's
//! generated Deployment can be checked against them.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use kinference_policy::duration::parse_duration;
use kinference_runtime::{LogArgs, LogFormat};

/// Tokenizers of precise prefix mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEventsTokenizer {
    /// The model's: a directory holding `tokenizer.json` and the chat
    /// template (`chat_template.jinja` or `tokenizer_config.json`).
    Directory(PathBuf),
    /// llm-d-inference-sim's `--force-dummy-tokenizer` (tests only).
    SimulatorDummy,
}

impl std::str::FromStr for KvEventsTokenizer {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "simulator-dummy" => KvEventsTokenizer::SimulatorDummy,
            dir => KvEventsTokenizer::Directory(dir.into()),
        })
    }
}

#[derive(Parser, Debug)]
#[command(
    name = "kinference-epp",
    version,
    about = "Kinference endpoint picker (Envoy ext_proc)"
)]
pub struct Args {
    /// Address all three ports listen on (`::` for every IPv6 and IPv4 address).
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::UNSPECIFIED))]
    pub bind_address: IpAddr,
    /// ext_proc gRPC port.
    #[arg(long, default_value_t = 9002)]
    pub grpc_port: u16,
    /// gRPC health port.
    #[arg(long, default_value_t = 9003)]
    pub grpc_health_port: u16,
    /// HTTP port for /metrics, /healthz, /readyz.
    #[arg(long, default_value_t = 9090)]
    pub metrics_port: u16,
    /// Serve /debug/explain (recent decisions, client values digested) and
    /// /debug/policy on 127.0.0.1 at this port only, for `kubectl
    /// port-forward`. Off unless set.
    #[arg(long, value_name = "PORT")]
    pub debug_port: Option<u16>,
    /// Precise prefix mode: listen for the model servers' KV-cache events
    /// on this port (vLLM `--kv-events-config` publisher `tcp://<epp>:PORT`,
    /// topic `kv@$(POD_IP)@<model>`). Off unless set.
    #[arg(long, value_name = "PORT", requires = "kv_events_tokenizer")]
    pub kv_events_port: Option<u16>,
    /// The engines' data-parallel size: vLLM's rank `r` publishes to the
    /// events port + `r` (and replays on the replay port + `r`), so the EPP
    /// listens on `--kv-events-port` … `--kv-events-port` + size − 1.
    #[arg(long, value_name = "N", default_value_t = 1, requires = "kv_events_port",
          value_parser = clap::value_parser!(u16).range(1..=i64::from(kinference_api::MAX_DATA_PARALLEL_SIZE)))]
    pub kv_events_data_parallel_size: u16,
    /// Dial mode: the engines bind their publishers (vLLM `endpoint:
    /// tcp://*:PORT`) and the EPP connects to every Pod of the pool on
    /// `--kv-events-port` (+ r for rank r) instead of listening, so every
    /// EPP replica receives every Pod's events.
    #[arg(long, requires = "kv_events_port")]
    pub kv_events_dial: bool,
    /// The engines' replay endpoint port (vLLM `--kv-events-config`
    /// `replay_endpoint: tcp://*:PORT`; data-parallel rank r on PORT + r):
    /// after a sequence gap the lost batches are asked for there. Without
    /// it a gap leaves the Pod estimated until its cache is cleared.
    #[arg(long, value_name = "PORT", requires = "kv_events_port")]
    pub kv_events_replay_port: Option<u16>,
    /// How precise mode tokenizes prompts: the directory of the model's
    /// `tokenizer.json` and chat template (`chat_template.jinja` or
    /// `tokenizer_config.json`), as in its Hugging Face repository; or
    /// `simulator-dummy`, llm-d-inference-sim's dummy tokenizer, for tests
    /// against it only.
    #[arg(long, value_name = "DIR", requires = "kv_events_port")]
    pub kv_events_tokenizer: Option<KvEventsTokenizer>,
    /// A prompt not tokenized within this time is matched by the
    /// approximate prefix index instead.
    #[arg(long, default_value = "5ms", value_parser = parse_duration)]
    pub kv_events_tokenize_budget: Duration,
    /// ConfigMap holding the compiled policy (watched through the API).
    #[arg(long, conflicts_with = "policy_file")]
    pub policy_configmap: Option<String>,
    /// A policy file instead (YAML/JSON, bare or InferencePolicy); reloaded on change.
    #[arg(long)]
    pub policy_file: Option<PathBuf>,
    /// Namespace of the pool, its ConfigMap and Secrets.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// This Pod's name: the key it reports its loaded policy hash under in
    /// `--status-configmap`.
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// ConfigMap to report the loaded policy hash (and, with
    /// `--provider-secrets-dir`, which provider keys were found) in, under
    /// this Pod's name; the operator's Ready condition reads it.
    #[arg(long, value_name = "NAME")]
    pub status_configmap: Option<String>,
    /// Provider API keys from files laid out as mounted Secrets are,
    /// `DIR/<secret-name>/<key>`, instead of watching the Secrets through the
    /// API. Re-read when the policy changes and every few seconds.
    #[arg(long, value_name = "DIR")]
    pub provider_secrets_dir: Option<PathBuf>,
    /// Standalone mode: endpoints from this file instead of Pod discovery.
    #[arg(long, conflicts_with = "pool_name")]
    pub endpoints_file: Option<PathBuf>,
    /// Serve this existing InferencePool, as the reference EPP's flag of the
    /// same name: its Pods are those of its selector and target ports,
    /// followed when they change. Without `--policy-file` or
    /// `--policy-configmap` the built-in default policy routes
    /// (`epp/policies/default.yaml`); a given policy's own `pool` is unused.
    #[arg(long, value_name = "NAME")]
    pub pool_name: Option<String>,
    /// The `name` label of the Inference Extension's pool-level series
    /// (`inference_pool_average_kv_cache_utilization`, ...), which an
    /// existing dashboard reads; default: `--pool-name`. Without either,
    /// those series are not exported.
    #[arg(long, value_name = "NAME")]
    pub metrics_pool_name: Option<String>,
    /// The InferencePool's namespace; default: `--namespace`.
    #[arg(long, value_name = "NAMESPACE", requires = "pool_name")]
    pub pool_namespace: Option<String>,
    /// The InferencePool's API group, as the reference EPP takes it: only
    /// `inference.networking.k8s.io` (v1) is served.
    #[arg(long, default_value = POOL_GROUP, value_parser = parse_pool_group, requires = "pool_name")]
    pub pool_group: String,
    /// After SIGTERM the EPP reports not Ready and keeps serving new streams
    /// this long, while gateways and the Service's endpoints move to the
    /// other replicas; then it serves no new stream and finishes the open
    /// ones within `--drain-timeout`. Both fit the Pod's default 30 s grace.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub shutdown_delay: Duration,
    /// How long open ext_proc streams get to finish after the shutdown delay.
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// Larger request bodies are refused with 413.
    #[arg(long, default_value_t = 16 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Request-body bytes buffered across all streams at once; a body that
    /// would take more is answered 503 straight away. Keep it well under the
    /// container's memory limit.
    #[arg(long, default_value_t = 256 * 1024 * 1024)]
    pub max_buffered_body_bytes: usize,
    /// A stream that sends nothing for this long before its request is
    /// decided is answered 408 and closed (e.g. `30s`, `2m`). Waiting for the
    /// model server's response is not limited.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub stream_idle_timeout: Duration,
    /// Honour the Gateway API Inference Extension conformance suite's test
    /// header and echo the served endpoint. Never enable in production.
    #[arg(long, default_value_t = false)]
    pub enable_conformance_hooks: bool,
    #[arg(long, default_value_t = 50)]
    pub scrape_interval_ms: u64,
    /// Fallback endpoints listed after the selected one in the `envoy.lb`
    /// metadata, for gateways that retry along the list (Envoy's override-host
    /// policy). The header always names the selected endpoint alone. 0 keeps
    /// the metadata equal to the header.
    #[arg(long, default_value_t = 3)]
    pub fallback_endpoints: usize,
    /// Serve ext_proc over TLS with a self-signed certificate (the reference
    /// EPP's default); `--secure-serving=false` for plaintext.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub secure_serving: bool,
    /// Require a client certificate on the ext_proc port, signed by a CA in
    /// this PEM file (mTLS): a client without one is refused during the TLS
    /// handshake. Needs `--secure-serving` (the default). Read at start.
    #[arg(long, value_name = "PATH")]
    pub client_ca_file: Option<PathBuf>,
    /// Debug: tell the gateway why each request went where it went (the
    /// rule, the tier, the winner's and the runner-up's objective values,
    /// and a reason per candidate left behind): the response header
    /// `x-kinference-decision-detail` on rejects and, where the gateway sends
    /// response headers to the EPP, on routed requests; and `envoy.lb`
    /// metadata of that name (for the gateway's access log). Costs a traced
    /// evaluation per request and shows endpoint names to clients: debug only.
    #[arg(long, default_value_t = false)]
    pub decision_detail: bool,
    /// Write a decision log: one JSON line per sampled decision (the
    /// request attributes the policy reads, client values digested as in
    /// /debug/explain, the tags, the candidates and the outcome; never
    /// prompt text), for `kinference replay` and `kinference diff`. A file
    /// path (appended to), or `-` for standard output. Off by default.
    #[arg(long, value_name = "PATH")]
    pub decision_log: Option<String>,
    /// The share of decisions written to the decision log, 0 to 1.
    #[arg(long, default_value_t = 1.0, value_parser = parse_share)]
    pub decision_log_sample: f64,
    /// Keep a file decision log under this many bytes on disk: at half of
    /// it the file is renamed `<path>.1` (replacing the previous one) and a
    /// new one starts. Unset: unbounded.
    #[arg(long, value_name = "BYTES")]
    pub decision_log_max_bytes: Option<u64>,
    // `--log-format json|text`, the same flag as the operator's.
    #[command(flatten)]
    pub logs: LogArgs,
    /// Deprecated alias of `--log-format=text`.
    #[arg(long, hide = true, default_value_t = false)]
    pub text_logs: bool,
}

/// The Inference Extension's API group, whose v1 InferencePool is served.
pub(crate) const POOL_GROUP: &str = "inference.networking.k8s.io";

fn parse_pool_group(s: &str) -> Result<String, String> {
    if s == POOL_GROUP {
        Ok(s.to_string())
    } else {
        Err(format!(
            "{s:?}: only InferencePools of {POOL_GROUP} are served (the v1alpha2 group x-k8s.io is not)"
        ))
    }
}

fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a share between 0 and 1")),
    }
}

impl Args {
    /// The `--pool-name` InferencePool's namespace and name.
    pub fn inference_pool(&self) -> Option<(String, String)> {
        let name = self.pool_name.clone()?;
        let namespace = self.pool_namespace.as_ref().unwrap_or(&self.namespace);
        Some((namespace.clone(), name))
    }

    /// The log format: `--log-format`, or text with the deprecated
    /// `--text-logs`.
    pub fn log_format(&self) -> LogFormat {
        if self.text_logs {
            LogFormat::Text
        } else {
            self.logs.log_format
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::Args;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("kinference-epp").chain(args.iter().copied()))
    }

    #[test]
    fn command_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn bind_address_defaults_to_every_ipv4_address() {
        let args = parse(&[]).unwrap();
        assert_eq!(args.bind_address.to_string(), "0.0.0.0");
        assert_eq!(
            (args.grpc_port, args.grpc_health_port, args.metrics_port),
            (9002, 9003, 9090)
        );
    }

    /// The reference EPP's way to name its pool.
    #[test]
    fn an_existing_pool_is_named_as_the_reference_epp_names_it() {
        let args = parse(&["--pool-name", "vllm", "--namespace", "llm"]).unwrap();
        assert_eq!(args.inference_pool(), Some(("llm".into(), "vllm".into())));
        let args = parse(&[
            "--pool-name",
            "vllm",
            "--pool-namespace",
            "serving",
            "--pool-group",
            "inference.networking.k8s.io",
        ])
        .unwrap();
        assert_eq!(
            args.inference_pool(),
            Some(("serving".into(), "vllm".into()))
        );
        assert_eq!(parse(&[]).unwrap().inference_pool(), None);
        let old_group = parse(&[
            "--pool-name",
            "v",
            "--pool-group",
            "inference.networking.x-k8s.io",
        ]);
        assert!(
            old_group
                .unwrap_err()
                .to_string()
                .contains("only InferencePools of")
        );
        assert!(
            parse(&["--pool-namespace", "llm"]).is_err(),
            "needs --pool-name"
        );
        let both = parse(&["--pool-name", "v", "--endpoints-file", "e.yaml"]);
        assert!(both.is_err(), "a pool or a file, not both");
    }

    #[test]
    fn bind_address_takes_ipv4_and_ipv6() {
        for addr in ["127.0.0.1", "::", "::1", "10.1.2.3"] {
            let args = parse(&["--bind-address", addr]).unwrap();
            assert_eq!(args.bind_address, addr.parse::<std::net::IpAddr>().unwrap());
        }
        for bad in ["localhost", "0.0.0.0:9002", ""] {
            assert!(parse(&["--bind-address", bad]).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn data_parallel_ranks_need_the_events_port_and_a_bounded_size() {
        let events = [
            "--kv-events-port",
            "5557",
            "--kv-events-tokenizer",
            "simulator-dummy",
        ];
        assert_eq!(parse(&events).unwrap().kv_events_data_parallel_size, 1);
        let ranks = |n: &str| {
            let mut args = events.to_vec();
            args.extend(["--kv-events-data-parallel-size", n]);
            parse(&args).map(|a| a.kv_events_data_parallel_size)
        };
        assert_eq!(ranks("4").unwrap(), 4);
        assert_eq!(ranks("64").unwrap(), 64);
        assert!(ranks("0").is_err());
        assert!(ranks("65").is_err());
        assert!(parse(&["--kv-events-data-parallel-size", "2"]).is_err());
        let mut dial = events.to_vec();
        dial.push("--kv-events-dial");
        assert!(parse(&dial).unwrap().kv_events_dial);
        assert!(!parse(&events).unwrap().kv_events_dial);
        assert!(parse(&["--kv-events-dial"]).is_err());
    }

    #[test]
    fn log_format_is_json_by_default_and_text_on_request() {
        use kinference_runtime::LogFormat;
        // Assumes KINFERENCE_LOG_FORMAT is unset, as in CI.
        assert_eq!(parse(&[]).unwrap().log_format(), LogFormat::Json);
        for args in [
            &["--log-format", "text"][..],
            &["--log-format=text"],
            &["--text-logs"],
        ] {
            assert_eq!(
                parse(args).unwrap().log_format(),
                LogFormat::Text,
                "{args:?}"
            );
        }
        assert_eq!(
            parse(&["--log-format", "json"]).unwrap().log_format(),
            LogFormat::Json
        );
        assert!(parse(&["--log-format", "pretty"]).is_err());
    }

    #[test]
    fn text_logs_is_hidden() {
        let help = Args::command().render_long_help().to_string();
        assert!(help.contains("--log-format"), "{help}");
        assert!(!help.contains("--text-logs"), "{help}");
    }

    #[test]
    fn client_ca_file_and_status_configmap_parse() {
        let args = parse(&[]).unwrap();
        assert_eq!((args.client_ca_file, args.status_configmap), (None, None));
        let args = parse(&[
            "--client-ca-file",
            "/etc/kinference/client-ca/ca.crt",
            "--pod-name=chat-epp-0",
            "--status-configmap=chat-epp-status",
        ])
        .unwrap();
        assert_eq!(
            args.client_ca_file.as_deref(),
            Some(std::path::Path::new("/etc/kinference/client-ca/ca.crt"))
        );
        assert_eq!(args.status_configmap.as_deref(), Some("chat-epp-status"));
    }

    #[test]
    fn provider_secrets_dir_parses() {
        assert_eq!(parse(&[]).unwrap().provider_secrets_dir, None);
        let args = parse(&["--provider-secrets-dir", "/etc/kinference/secrets"]).unwrap();
        assert_eq!(
            args.provider_secrets_dir.as_deref(),
            Some(std::path::Path::new("/etc/kinference/secrets"))
        );
    }
}
