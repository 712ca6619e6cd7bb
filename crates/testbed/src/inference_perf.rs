//! The field's own load generator, `inference-perf` (PyPI,
//! the tool the Inference Extension and llm-d publish their scheduler
//! results with), driving its `shared_prefix` data generator with Poisson
//! rate stages, as their prefix-cache benchmarks do: workload (f) of the
//! side-by-side bench (`e2e/benches/peers.rs`). `bench/peers/install.sh inference-perf` installs it (a
//! Python >= 3.12 venv) and the Qwen3 tokenizer it counts tokens with.
//!
//! It has no hot-group option, so the hot-node case stays with our own
//! generator in (c); what this adds is the field's own prompts, arrivals
//! and measurement of TTFT on the same pool.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::Value;
use tokio::process::Command;

/// The shape: 8 system prompts of 2,700 Qwen3 tokens (about 24 KB of text,
/// the size of (c)'s, so about 6,000 of our simulator's tokens and 1.5 s of
/// uncached prefill), 64 questions of 50 tokens each, 16 output tokens.
pub const GROUPS: u32 = 8;
pub const PROMPTS_PER_GROUP: u32 = 64;
pub const SYSTEM_PROMPT_TOKENS: u32 = 2_700;
pub const QUESTION_TOKENS: u32 = 50;
pub const OUTPUT_TOKENS: u32 = 16;

/// Where `install.sh` put it.
pub struct InferencePerf {
    bin: PathBuf,
    tokenizer: PathBuf,
}

/// What inference-perf reported for one rate stage.
pub struct Stage {
    pub rate: f64,
    pub achieved_rate: f64,
    pub successes: u64,
    pub failures: u64,
    /// Time to first token, p50 / p90 / p99, in ms.
    pub ttft_ms: [f64; 3],
    pub requests_per_sec: f64,
    /// Prompt tokens the servers reported as cached ÷ all prompt tokens.
    pub cached_share: f64,
}

impl InferencePerf {
    /// The `inference-perf` link and its tokenizer in `peers_dir`, if
    /// installed.
    pub fn locate(peers_dir: &Path) -> Option<InferencePerf> {
        let bin = peers_dir.join("inference-perf");
        let tokenizer = peers_dir.join("inference-perf-tokenizer");
        (bin.is_file() && tokenizer.join("tokenizer.json").is_file())
            .then_some(InferencePerf { bin, tokenizer })
    }

    /// Runs the rate ladder against `base_url` and returns each stage's
    /// figures; its config, log and reports stay in `dir`.
    pub async fn run(
        &self,
        base_url: &str,
        model: &str,
        rates: &[f64],
        stage: Duration,
        dir: &Path,
    ) -> Result<Vec<Stage>> {
        let out = dir.join("reports");
        let config = dir.join("inference-perf.yaml");
        std::fs::write(&config, self.config(base_url, model, rates, stage, &out))?;
        let log = std::fs::File::create(dir.join("inference-perf.log"))?;
        let status = Command::new(&self.bin)
            .arg("-c")
            .arg(&config)
            .args(["--log-level", "WARNING"])
            // The tokenizer is local; never reach for a model hub.
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .stdout(log.try_clone()?)
            .stderr(log)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .status()
            .await
            .with_context(|| format!("running {}", self.bin.display()))?;
        ensure!(
            status.success(),
            "inference-perf exited with {status}; see {}",
            dir.join("inference-perf.log").display()
        );
        (0..rates.len())
            .map(|i| read_stage(&out.join(format!("stage_{i}_lifecycle_metrics.json"))))
            .collect()
    }

    fn config(
        &self,
        base_url: &str,
        model: &str,
        rates: &[f64],
        stage: Duration,
        out: &Path,
    ) -> String {
        let stages: String = rates
            .iter()
            .map(|r| format!("    - {{ rate: {r}, duration: {} }}\n", stage.as_secs()))
            .collect();
        format!(
            "api:
  type: chat
  streaming: true
server:
  type: vllm
  model_name: {model}
  base_url: {base_url}
  ignore_eos: true
tokenizer:
  pretrained_model_name_or_path: {tokenizer}
data:
  type: shared_prefix
  shared_prefix:
    num_groups: {GROUPS}
    num_prompts_per_group: {PROMPTS_PER_GROUP}
    system_prompt_len: {SYSTEM_PROMPT_TOKENS}
    question_len: {QUESTION_TOKENS}
    output_len: {OUTPUT_TOKENS}
    seed: 11
load:
  type: poisson
  interval: 2
  # One worker process: the machine has 2 cores, shared with everything else.
  num_workers: 1
  base_seed: 11
  stage_teardown_grace_seconds: 30
  stages:
{stages}report:
  request_lifecycle:
    summary: false
    per_stage: true
    percentiles: [50, 90, 99]
  prometheus: null
storage:
  local_storage:
    path: {out}
",
            tokenizer = self.tokenizer.display(),
            out = out.display(),
        )
    }
}

fn read_stage(path: &Path) -> Result<Stage> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("{}", path.display()))?;
    stage_from_report(&v).with_context(|| format!("{}", path.display()))
}

/// The figures of one `stage_<i>_lifecycle_metrics.json`.
fn stage_from_report(v: &Value) -> Result<Stage> {
    let num = |pointer: &str| {
        v.pointer(pointer)
            .and_then(Value::as_f64)
            .with_context(|| format!("no number at {pointer}"))
    };
    let successes = num("/successes/count")? as u64;
    let failures = num("/failures/count")? as u64;
    if successes == 0 {
        bail!("no request succeeded ({failures} failed)");
    }
    let ttft = |q: &str| num(&format!("/successes/latency/time_to_first_token/{q}"));
    let total = num("/successes/prompt_tokens/total")?;
    Ok(Stage {
        rate: num("/load_summary/requested_rate")?,
        achieved_rate: num("/load_summary/achieved_rate")?,
        successes,
        failures,
        ttft_ms: [
            ttft("median")? * 1e3,
            ttft("p90")? * 1e3,
            ttft("p99")? * 1e3,
        ],
        requests_per_sec: num("/successes/throughput/requests_per_sec")?,
        cached_share: num("/successes/prompt_tokens/cached")? / total.max(1.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_stage_report_gives_ttft_in_ms_and_the_cached_share() {
        let report = json!({
            "load_summary": { "requested_rate": 16.0, "achieved_rate": 15.2 },
            "successes": {
                "count": 190,
                "latency": { "time_to_first_token": { "median": 0.031, "p90": 0.2, "p99": 1.5 } },
                "throughput": { "requests_per_sec": 15.0 },
                "prompt_tokens": { "total": 1000.0, "cached": 750.0 }
            },
            "failures": { "count": 2 }
        });
        let s = stage_from_report(&report).unwrap();
        assert_eq!((s.rate, s.successes, s.failures), (16.0, 190, 2));
        assert_eq!(s.ttft_ms, [31.0, 200.0, 1500.0]);
        assert_eq!(s.cached_share, 0.75);
    }

    #[test]
    fn a_stage_where_nothing_succeeded_is_an_error() {
        let report = json!({
            "load_summary": { "requested_rate": 16.0, "achieved_rate": 15.2 },
            "successes": { "count": 0, "latency": { "time_to_first_token": null } },
            "failures": { "count": 40 }
        });
        let err = stage_from_report(&report).err().unwrap().to_string();
        assert_eq!(err, "no request succeeded (40 failed)");
    }
}
