//! Prometheus text exposition with vLLM metric names.
//!
//! Pod-wide series (queue, running, KV usage, cache config, LoRA info) carry
//! the primary model's name in `model_name`, as a vLLM pod serving one base
//! model does; counters and the TTFT histogram have one series per base model.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::SimConfig;
use crate::engine::Snapshot;
use crate::histogram::TTFT_BUCKETS;

/// How `GET /metrics` answers, so tests can simulate stale or missing metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetricsMode {
    /// Current values (the default).
    #[default]
    Live,
    /// `503 Service Unavailable`.
    Unavailable,
    /// The request never gets an answer until the mode changes or the server stops.
    Hang,
    /// The exposition captured when this mode was set, served unchanged.
    Frozen,
}

/// Escapes a label value for the text exposition format.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Renders the whole exposition. `kv_usage` is the 0..=1 KV-cache usage.
pub(crate) fn render(cfg: &SimConfig, snap: &Snapshot, kv_usage: f64) -> String {
    let mut out = String::with_capacity(4096);
    let primary = format!("model_name=\"{}\"", escape(cfg.primary_model()));

    let gauges = [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            snap.running as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            snap.waiting as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            kv_usage,
        ),
        (
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage (pre-v1 name). 1 means 100 percent usage.",
            kv_usage,
        ),
    ];
    for (name, help, value) in gauges {
        header(&mut out, name, "gauge", help);
        let _ = writeln!(out, "{name}{{{primary}}} {value}");
    }

    let block_tokens = cfg.block_tokens();
    header(
        &mut out,
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig.",
    );
    let _ = writeln!(
        out,
        "vllm:cache_config_info{{block_size=\"{block_tokens}\",cache_dtype=\"auto\",\
         enable_prefix_caching=\"{}\",num_gpu_blocks=\"{}\",num_cpu_blocks=\"0\",{primary}}} 1",
        if cfg.prefix_cache_blocks > 0 {
            "True"
        } else {
            "False"
        },
        cfg.kv_capacity_tokens / block_tokens,
    );

    header(
        &mut out,
        "vllm:lora_requests_info",
        "gauge",
        "Running stats on LoRA requests; the value is the update timestamp.",
    );
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let _ = writeln!(
        out,
        "vllm:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\",\
         waiting_lora_adapters=\"{}\",{primary}}} {now}",
        cfg.max_lora,
        escape(&snap.running_loras.join(",")),
        escape(&snap.waiting_loras.join(",")),
    );

    type Field = fn(&crate::engine::ModelCounters) -> u64;
    let counters: [(&str, &str, Field); 5] = [
        (
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            |c| c.prompt_tokens,
        ),
        (
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            |c| c.generation_tokens,
        ),
        (
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            |c| c.prompt_tokens,
        ),
        (
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            |c| c.cached_tokens,
        ),
        (
            "vllm:request_success_total",
            "Count of successfully processed requests.",
            |c| c.completed,
        ),
    ];
    for (name, help, field) in counters {
        header(&mut out, name, "counter", help);
        for (model, c) in &snap.per_model {
            let _ = writeln!(
                out,
                "{name}{{model_name=\"{}\"}} {}",
                escape(model),
                field(c)
            );
        }
    }

    let name = "vllm:time_to_first_token_seconds";
    header(
        &mut out,
        name,
        "histogram",
        "Histogram of time to first token in seconds.",
    );
    for (model, c) in &snap.per_model {
        let model = escape(model);
        let mut cumulative = 0;
        for (le, n) in TTFT_BUCKETS.iter().zip(c.ttft.buckets) {
            cumulative += n;
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{le:?}\",model_name=\"{model}\"}} {cumulative}"
            );
        }
        let h = &c.ttft;
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\",model_name=\"{model}\"}} {}",
            h.count
        );
        let _ = writeln!(out, "{name}_sum{{model_name=\"{model}\"}} {}", h.sum);
        let _ = writeln!(out, "{name}_count{{model_name=\"{model}\"}} {}", h.count);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::ModelCounters;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut c = ModelCounters::default();
        c.ttft.observe(0.003);
        c.ttft.observe(0.3);
        c.ttft.observe(9999.0);
        let mut snap = Snapshot::default();
        snap.per_model.insert("m".into(), c);
        let cfg = SimConfig::new("s", ["m"]);
        let text = render(&cfg, &snap, 0.5);
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{le=\"0.001\",model_name=\"m\"} 0\n"
        ));
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{le=\"0.005\",model_name=\"m\"} 1\n"
        ));
        assert!(
            text.contains(
                "vllm:time_to_first_token_seconds_bucket{le=\"0.5\",model_name=\"m\"} 2\n"
            )
        );
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{le=\"2560.0\",model_name=\"m\"} 2\n"
        ));
        assert!(
            text.contains(
                "vllm:time_to_first_token_seconds_bucket{le=\"+Inf\",model_name=\"m\"} 3\n"
            )
        );
        assert!(text.contains("vllm:time_to_first_token_seconds_count{model_name=\"m\"} 3\n"));
        assert!(text.contains("vllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n"));
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn every_sample_line_is_well_formed() {
        let cfg = SimConfig {
            lora_adapters: vec!["x".into(), "y".into()],
            ..SimConfig::new("s", ["m1", "m2"])
        };
        let snap = Snapshot {
            per_model: cfg
                .models
                .iter()
                .map(|m| (m.clone(), ModelCounters::default()))
                .collect(),
            running_loras: vec!["x".into(), "y".into()],
            ..Snapshot::default()
        };
        let text = render(&cfg, &snap, 0.0);
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ').unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
            assert!(series.starts_with("vllm:"), "{line}");
            assert!(series.contains("model_name=\""), "{line}");
        }
        assert!(text.contains("running_lora_adapters=\"x,y\""));
        assert!(text.contains("vllm:prompt_tokens_total{model_name=\"m2\"} 0\n"));
    }
}
