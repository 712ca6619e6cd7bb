//! Side by side with the reference EPPs: the same Envoy, the same
//! simulated pool, one run.
//!
//! A real kube-apiserver (`TestCluster`) holds an InferencePool and its Pods
//! (no kubelet: the bench writes each Pod's status, with a distinct loopback
//! IP `127.0.0.1x`, where one of our simulators listens on the pool's target
//! port). Then each contender runs ONE AT A TIME, as its own process, behind
//! its own Envoy started from the same template (`Template::Streamed`, the
//! Inference Extension chart's `FULL_DUPLEX_STREAMED`, plaintext to every
//! EPP):
//!
//! - `direct`: the clients call the simulators themselves, round-robin — the
//!   zero-overhead baseline every latency is measured against;
//! - `envoy-rr`: Envoy's own round-robin over the Pods, no ext_proc;
//! - `kinference-default`: our EPP with its built-in default policy;
//!   `gie-lora`: the reference's default profile plus its LoRA affinity
//!   scorer;
//! - `kinference-queue` / `kinference-ttft`: our EPP with a one-rule policy
//!   `minimize: QueueDepth, tieBreak: Random` (the reference's queue
//!   scorer's objective, ties broken at random as its picker does) and
//!   `minimize: PredictedTTFT` (our recommended default);
//! - `gie-queue` / `gie-default`: the Inference Extension's EPP with only its
//!   queue scorer, and with its default profile (queue + KV + prefix);
//! - `llmd`: the llm-d scheduler with the `epp-config.yaml` it ships;
//! - `kinference-precise`: `kinference-ttft` in precise prefix mode, with
//!   `--simulator llmd` only: the simulators publish their KV-cache events
//!   to it, and it tokenizes as their dummy tokenizer does;
//! - `kinference-precise-qwen3`: `kinference-ttft` in precise prefix mode
//!   with Qwen3's own tokenizer (`KINFERENCE_QWEN3_TOKENIZER`), in the
//!   closed-loop phases only: what tokenizing adds to the request path
//!   (under its time budget; no simulator's events match it).
//!
//! Workloads: (a) ~1 KB chats at c16 and c64, (b) 220 KB prompts at c150, both
//! closed loop against simulators that answer at once (saturation: what is
//! measured is the path); (b2) the same 220 KB prompts at c150 against
//! simulators that hold every answer ~1 s (upstream #2928's shape: 150 in
//! flight, the gateway far from saturation); (c) routing quality:
//! a shared-prefix workload (few long system prompts, many users; one hot
//! prefix) at Poisson rates stepping up, against simulators with timed
//! prefill, a prefix cache and queueing, restarted empty for each contender;
//! the same way, (d) small inputs (~150 prompt tokens, 16 output tokens) and
//! (e) decode-heavy requests (~550 prompt tokens, 512 output tokens), the
//! cases the peers' critics asked for; (g) the hot-group case, (c) with one
//! system prompt taking 60% of the traffic. `--simulator llmd` runs (c), (d),
//! (e) and (g) on llm-d-inference-sim instead of ours, which also reports
//! each answer's cached prompt tokens (the tables' cache-hit share), and
//! adds (h): short prompts for 8 LoRA adapters over Pods that hold 2 each
//! (`kinference-default` and `gie-lora`
//! are the contenders that know adapters). (i): priorities under overload,
//! three InferenceObjectives at 0.25× to 2× the pool's capacity
//! (`peers/priorities.rs`; `kinference-flow` and `gie-flow` act on them).
//! `--reps N` runs every contender N times in turn; the open-loop tables
//! give medians over reps and each rep's ratio to the reference. (f): the field's own load
//! generator, `inference-perf`, with its `shared_prefix` generator and
//! Poisson rate stages, through each contender's Envoy to the same timed
//! simulators (when `bench/peers/install.sh inference-perf` installed it).
//!
//! The EPP's CPU is the `schedstat` time of its process's threads over the
//! measured window, its memory `VmRSS`/`VmHWM` from `/proc/<pid>/status`.
//! Everything shares the machine (2 cores here), so compare rows of one run.
//!
//! `bench/peers/run.sh [smoke|full]` builds everything and runs this; by hand:
//!
//! ```sh
//! cargo build --release -p kinference-epp --locked
//! KINFERENCE_K8S_BIN_DIR=... cargo bench -p kinference-e2e --bench peers -- \
//!     --mode smoke --epp-bin target/release/kinference-epp --peers-dir "$(bench/peers/install.sh)"
//! ```

#[path = "peers/contenders.rs"]
mod contenders;
#[path = "peers/load.rs"]
mod load;
#[path = "peers/pool.rs"]
mod pool;
#[path = "peers/priorities.rs"]
mod priorities;
#[path = "peers/processes.rs"]
mod processes;
#[path = "peers/report.rs"]
mod report;
#[path = "peers/settings.rs"]
mod settings;
#[path = "peers/workloads.rs"]
mod workloads;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use clap::Parser;
use kinference_e2e::cluster::TestCluster;
use kinference_testbed::envoy::{Bootstrap, Template};
use kinference_testbed::http_client::HttpClient;
use kinference_testbed::load::{cpu, runtime};
use kinference_testbed::ttft_fit;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use contenders::*;
use load::*;
use pool::*;
use processes::*;
use report::*;
use settings::*;
use workloads::*;

struct Bench {
    args: Args,
    plan: Plan,
    binaries: Binaries,
    kubeconfig: PathBuf,
    port: u16,
    /// Where our EPP in precise mode takes the simulators' KV events.
    events: EventsPorts,
    bodies: Bodies,
    http: HttpClient,
    load_rt: tokio::runtime::Runtime,
    sim_rt: tokio::runtime::Runtime,
}

/// A contender's lane, set up: its EPP and Envoy (none for `direct`).
struct Lane {
    target: Target,
    /// The first replica: its CPU, log and predictions are the lane's.
    epp: Option<EppProcess>,
    /// The other replicas, when the contender runs several.
    more: Vec<EppProcess>,
    gateway: Option<Gateway>,
}

impl Lane {
    fn pids(&self) -> Pids {
        Pids {
            epp: self.epp.as_ref().map(|e| e.pid),
            envoy: self.gateway.as_ref().and_then(|g| g.pid),
        }
    }

    async fn stop(self) {
        if let Some(g) = self.gateway {
            g.envoy.stop().await;
        }
        for e in self.epp.into_iter().chain(self.more) {
            e.stop().await;
        }
    }
}

impl Bench {
    /// Our EPP's precise-mode arguments.
    fn kv_events_args(&self, kv: Option<KvEvents>) -> Result<Vec<std::ffi::OsString>> {
        let Some(kv) = kv else {
            return Ok(Vec::new());
        };
        let mut args: Vec<std::ffi::OsString> =
            vec!["--kv-events-tokenizer".into(), kv.tokenizer.arg()?];
        match kv.publishers {
            Publishers::ToEpp => {
                args.extend([
                    "--kv-events-port".into(),
                    self.events.listen.to_string().into(),
                ]);
            }
            Publishers::VllmBound => args.extend(
                [
                    "--kv-events-port",
                    &self.events.bound.to_string(),
                    "--kv-events-dial",
                    "--kv-events-replay-port",
                    &self.events.replay.to_string(),
                ]
                .map(Into::into),
            ),
        }
        Ok(args)
    }

    fn bootstrap(&self, template: Template, epp: SocketAddr, pool: Vec<SocketAddr>) -> Bootstrap {
        Bootstrap {
            pool,
            epp_tls: false,
            concurrency: self.args.envoy_workers,
            ..Bootstrap::new(template, epp)
        }
    }

    /// Starts what `contender` needs and waits until a request goes through.
    async fn set_up(&self, contender: &Contender, sims: &[SocketAddr]) -> Result<Lane> {
        let unused = SocketAddr::from(([127, 0, 0, 1], 9));
        let (epp, more, gateway) = match contender.route {
            Route::Direct => {
                let urls: Vec<String> = sims
                    .iter()
                    .map(|a| format!("http://{a}/v1/chat/completions"))
                    .collect();
                let target = Target::RoundRobin(urls.into());
                return Ok(Lane {
                    target,
                    epp: None,
                    more: Vec::new(),
                    gateway: None,
                });
            }
            Route::EnvoyRoundRobin => {
                let b = self.bootstrap(Template::Static, unused, sims.to_vec());
                (None, Vec::new(), start_gateway(b).await?)
            }
            Route::Epp(peer) => {
                let binary = self.binaries.of(peer).context("not built")?;
                let mut replicas = Vec::with_capacity(contender.replicas);
                for _ in 0..contender.replicas.max(1) {
                    let epp = EppProcess::start(
                        peer,
                        binary,
                        contender.config.as_deref(),
                        self.port,
                        &self.kubeconfig,
                        self.kv_events_args(contender.kv_events)?,
                    )
                    .await?;
                    replicas.push(epp);
                }
                let first = replicas.remove(0);
                let mut b = self.bootstrap(Template::Streamed, first.grpc, sims.to_vec());
                b.epp_replicas = replicas.iter().map(|e| e.grpc).collect();
                (Some(first), replicas, start_gateway(b).await?)
            }
        };
        let target = Target::Url(gateway.envoy.url("/v1/chat/completions").into());
        let path = Lane {
            target,
            epp,
            more,
            gateway: Some(gateway),
        };
        self.wait_until_routed(&path).await?;
        Ok(path)
    }

    /// Until a request comes back 200 through the path (the EPP has synced
    /// the pool and scraped the Pods), then a little longer for the others'
    /// metrics.
    async fn wait_until_routed(&self, path: &Lane) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        let body = self.bodies.chat[0].clone();
        // Envoy takes the replicas in turn: every one must have answered.
        let needed = 1 + 2 * path.more.len();
        let mut answered = 0;
        loop {
            match send(&self.http, path.target.url(0), &body).await {
                Ok(_) if answered + 1 >= needed => break,
                Ok(_) => answered += 1,
                Err(e) if Instant::now() > deadline => {
                    let epp = path
                        .epp
                        .as_ref()
                        .map_or(String::new(), EppProcess::log_tail);
                    let envoy = path
                        .gateway
                        .as_ref()
                        .map_or(String::new(), |g| g.envoy.log_tail());
                    bail!(
                        "nothing routed in {START_TIMEOUT:?}: {e:#}\nEPP log:\n{epp}\nEnvoy log:\n{envoy}"
                    );
                }
                Err(_) => {
                    answered = 0;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        Ok(())
    }

    fn run_contender(&self, contender: &Contender, rep: usize) -> Report {
        let mut report = Report {
            contender: contender.clone(),
            rep,
            idle_cpu_ms_per_s: None,
            rows: Vec::new(),
            inference_perf: None,
            priorities: Vec::new(),
            skipped: None,
        };
        if let Route::Epp(peer) = contender.route
            && self.binaries.of(peer).is_none()
        {
            report.skipped = Some(format!(
                "{peer:?} binary not found in --peers-dir (bench/peers/install.sh)"
            ));
            return report;
        }
        for shape in [SimShape::Instant, SimShape::Held] {
            let phases = self.closed_phases(shape);
            if phases.is_empty() {
                continue;
            }
            if let Err(e) = self.run_closed_workloads(contender, shape, phases, &mut report) {
                report.skipped = Some(format!("{e:#}"));
                return report;
            }
        }
        if let Err(e) = self.run_open_workloads(contender, &mut report) {
            report.skipped = Some(format!("{e:#}"));
            return report;
        }
        if self.wants_inference_perf(contender) {
            match self.run_inference_perf(contender) {
                Ok(run) => report.inference_perf = Some(run),
                Err(e) => report.skipped = Some(format!("{IP_LABEL}: {e:#}")),
            }
        }
        if self.wants_priorities(contender) {
            match self.run_priorities(contender) {
                Ok(rows) => report.priorities = rows,
                Err(e) => report.skipped = Some(format!("{}: {e:#}", priorities::LABEL)),
            }
        }
        report
    }

    /// (i) runs through a gateway (the objective is a request header the
    /// EPP reads), when not filtered out: for every contender when
    /// `--workloads` names it, else for those it compares
    /// ([`priorities::CONTENDERS`]).
    fn wants_priorities(&self, contender: &Contender) -> bool {
        let named = self
            .args
            .workloads
            .iter()
            .any(|w| w == priorities::WORKLOAD);
        self.args.wants_workload(priorities::WORKLOAD)
            && contender.route != Route::Direct
            && contender.kv_events.is_none()
            && (named || priorities::CONTENDERS.contains(&contender.name))
    }

    /// (i): every load in turn through one lane, against queued
    /// simulators started empty for this contender.
    fn run_priorities(&self, contender: &Contender) -> Result<Vec<priorities::Row>> {
        let full = self.args.mode == Mode::Full;
        let capacity = priorities::capacity(self.args.pods);
        let sims =
            self.sim_rt
                .block_on(Sims::start(self.args.pods, self.port, SimShape::Queued))?;
        let result = self.load_rt.block_on(async {
            let lane = self.set_up(contender, &sims.addrs()).await?;
            let url = lane.target.url(0).to_string();
            let mut rows = Vec::new();
            for &load in priorities::loads(full) {
                let started = Instant::now();
                let stage = priorities::stage(full).as_secs_f64();
                let row = priorities::run_load(&self.http, &url, load, capacity, stage).await;
                eprintln!(
                    "[peers] {} {}: {}",
                    contender.name,
                    priorities::LABEL,
                    priorities::brief(&row, started)
                );
                rows.push(row);
                // What waits in the engines' queues drains before the next load.
                tokio::time::sleep(priorities::stage(full) / 4).await;
            }
            lane.stop().await;
            anyhow::Ok(rows)
        });
        self.sim_rt.block_on(sims.stop());
        result
    }

    /// (f) runs through a gateway (inference-perf takes one base URL, so
    /// not `direct`), when installed and not filtered out.
    fn wants_inference_perf(&self, contender: &Contender) -> bool {
        self.binaries.inference_perf.is_some()
            && self.args.wants_workload(IP_WORKLOAD)
            && contender.route != Route::Direct
            && !KvEvents::tokenizer_is(contender.kv_events, EventsTokenizer::Qwen3)
    }

    /// Timed simulators, started empty for this contender, the same as (c)'s;
    /// the rate ladder of (c).
    /// `adapters`: LoRA adapters each simulator serves (0: none).
    async fn start_timed_sims(&self, contender: &Contender, adapters: usize) -> Result<Sims> {
        match &self.binaries.llmd_sim {
            Some(bin) if self.args.simulator == Simulator::Llmd => {
                let events = match contender.kv_events.map(|k| k.publishers) {
                    None => SimEvents::Nowhere,
                    Some(Publishers::ToEpp) => {
                        SimEvents::To(SocketAddr::from(([127, 0, 0, 1], self.events.listen)))
                    }
                    Some(Publishers::VllmBound) => SimEvents::VllmBound {
                        python: self
                            .binaries
                            .vllm_publisher
                            .as_deref()
                            .context("bench/peers/install.sh vllm-publisher")?,
                        ports: &self.events,
                    },
                };
                let max_model_len = self.args.llmd_max_model_len;
                let shape = LlmdShape {
                    max_model_len,
                    adapters,
                };
                Sims::start_llmd(bin, self.args.pods, self.port, shape, events).await
            }
            _ => {
                ensure!(
                    contender.kv_events.is_none(),
                    "precise prefix mode needs KV events: --simulator llmd"
                );
                ensure!(adapters == 0, "LoRA adapters need --simulator llmd");
                Sims::start(self.args.pods, self.port, SimShape::Timed).await
            }
        }
    }

    fn run_inference_perf(&self, contender: &Contender) -> Result<InferencePerfRun> {
        let tool = self
            .binaries
            .inference_perf
            .as_ref()
            .context("not installed")?;
        let sims = self.sim_rt.block_on(self.start_timed_sims(contender, 0))?;
        let dir = scratch_dir()?.join(format!("inference-perf-{}", contender.name));
        std::fs::create_dir_all(&dir)?;
        let result = self.load_rt.block_on(async {
            let lane = self.set_up(contender, &sims.addrs()).await?;
            let base_url = lane.gateway.as_ref().context("no gateway")?.envoy.url("");
            let rates = &self.plan.open_rates[0];
            let stages = tool
                .run(
                    &base_url,
                    MODEL,
                    rates,
                    self.plan.inference_perf_stage,
                    &dir,
                )
                .await;
            lane.stop().await;
            let stages = stages?;
            for s in &stages {
                eprintln!(
                    "[peers] {} {IP_LABEL} {:.0}/s: {} ok, {} failed, TTFT p90 {:.0} ms",
                    contender.name, s.rate, s.successes, s.failures, s.ttft_ms[1]
                );
            }
            anyhow::Ok(InferencePerfRun { stages })
        });
        self.sim_rt.block_on(sims.stop());
        result
    }

    /// The closed-loop phases run against simulators of `shape`: (a) and (b)
    /// answered at once, (b2) held about a second as a model would.
    fn closed_phases(&self, shape: SimShape) -> Vec<ClosedPhase<'_>> {
        let plan = &self.plan;
        let large = plan.closed(150, plan.large_warmup, plan.large_requests);
        let mut phases = Vec::new();
        match shape {
            SimShape::Instant => {
                if self.args.wants_workload("chat") {
                    for c in [16, 64] {
                        let spec = plan.closed(c, plan.chat_warmup, plan.chat_requests);
                        phases.push((format!("(a) chat c{c}"), spec, &self.bodies.chat));
                    }
                }
                if self.args.wants_workload("large") {
                    phases.push(("(b) 220 KB c150".to_string(), large, &self.bodies.large));
                }
            }
            SimShape::Held if self.args.wants_workload("large") => {
                let phase = "(b2) 220 KB c150, sims hold ~1 s".to_string();
                phases.push((phase, large, &self.bodies.large));
            }
            SimShape::Held | SimShape::Timed | SimShape::Queued => {}
        }
        phases
    }

    /// Closed-loop `phases` through the contender's lane, against fresh
    /// simulators of `shape`; the EPP's idle CPU is read first.
    fn run_closed_workloads(
        &self,
        contender: &Contender,
        shape: SimShape,
        phases: Vec<ClosedPhase<'_>>,
        report: &mut Report,
    ) -> Result<()> {
        let sims = self
            .sim_rt
            .block_on(Sims::start(self.args.pods, self.port, shape))?;
        let result = self.load_rt.block_on(async {
            let lane = self.set_up(contender, &sims.addrs()).await?;
            if report.idle_cpu_ms_per_s.is_none() {
                report.idle_cpu_ms_per_s = lane.epp.as_ref().map(|e| idle_cpu(e.pid));
            }
            for (phase, spec, bodies) in phases {
                let m = closed_loop(&self.http, &lane.target, bodies, spec, lane.pids()).await;
                eprintln!("[peers] {} {phase}: {}", contender.name, brief(&m));
                report.rows.push(Row {
                    contender: contender.name,
                    phase,
                    m,
                    predictions_within_25: None,
                    inputs_fit_within_25: None,
                    events_agree: None,
                });
            }
            lane.stop().await;
            anyhow::Ok(())
        });
        self.sim_rt.block_on(sims.stop());
        result
    }

    /// (c), (d), (e) as `--workloads` asks.
    fn run_open_workloads(&self, contender: &Contender, report: &mut Report) -> Result<()> {
        if KvEvents::tokenizer_is(contender.kv_events, EventsTokenizer::Qwen3) {
            return Ok(());
        }
        for (i, w) in OPEN_WORKLOADS.iter().enumerate() {
            // Only llm-d-inference-sim serves adapters.
            let servable = w.adapters == 0 || self.args.simulator == Simulator::Llmd;
            if self.args.wants_workload(w.name) && servable {
                self.run_open_workload(contender, i, report)
                    .with_context(|| w.label)?;
            }
        }
        Ok(())
    }

    /// Workload `OPEN_WORKLOADS[i]`, against timed simulators restarted
    /// empty for this contender.
    fn run_open_workload(
        &self,
        contender: &Contender,
        i: usize,
        report: &mut Report,
    ) -> Result<()> {
        let workload = OPEN_WORKLOADS[i];
        let sims = self
            .sim_rt
            .block_on(self.start_timed_sims(contender, workload.adapters))?;
        let result = self.load_rt.block_on(async {
            let path = self.set_up(contender, &sims.addrs()).await?;
            for &rate in &self.plan.open_rates[i] {
                let before = predictions(&self.http, path.epp.as_ref()).await;
                let log_from = path.epp.as_ref().map(EppProcess::log_len);
                let m = open_loop(
                    &self.http,
                    &path.target,
                    &self.bodies.open[i],
                    rate,
                    self.plan.open_stage,
                    path.pids(),
                )
                .await;
                let after = predictions(&self.http, path.epp.as_ref()).await;
                let samples = path
                    .epp
                    .as_ref()
                    .filter(|e| e.peer == Peer::Kinference)
                    .zip(log_from)
                    .map(|(epp, from)| epp.ttft_samples_since(from));
                if let Some(samples) = samples.as_ref().filter(|s| s.len() < ttft_fit::MIN_SAMPLES) {
                    eprintln!(
                        "[peers] {}: only {} TTFT sample lines in our EPP's log this phase: no hindsight fit",
                        contender.name,
                        samples.len()
                    );
                }
                let fitted = samples.and_then(|s| ttft_fit::score(&s, 0.25));
                let counted = before.zip(after);
                let (predictions_within_25, events_agree) =
                    counted.map_or((None, None), |(b, a)| Predictions::shares(b, a));
                let over = counted
                    .and_then(|(b, a)| Predictions::over_share(b, a))
                    .map_or(String::new(), |o| {
                        format!(", TTFT predictions too high {:.0}%", o * 100.0)
                    });
                let checks = counted
                    .and_then(|(b, a)| Predictions::checks(b, a))
                    .unwrap_or_default();
                let fit = fitted.map_or(String::new(), |f| {
                    format!(
                        ", {} TTFT samples, within 25%: logged predictions {}, a fit of their inputs in hindsight {:.0}%",
                        f.samples,
                        f.predicted_within
                            .map_or("-".to_string(), |p| format!("{:.0}%", p * 100.0)),
                        f.fitted_within * 100.0
                    )
                });
                let phase = format!("{} {rate:.0}/s", workload.label);
                eprintln!(
                    "[peers] {} {phase}: {}{over}{checks}{fit}",
                    contender.name,
                    brief(&m)
                );
                for (server, served) in &m.out.served {
                    eprintln!("[peers]   {server}: {}", served.summary());
                }
                report.rows.push(Row {
                    contender: contender.name,
                    phase,
                    m,
                    predictions_within_25,
                    inputs_fit_within_25: fitted.map(|f| f.fitted_within),
                    events_agree,
                });
            }
            path.stop().await;
            anyhow::Ok(())
        });
        debug_assert_eq!(sims.port, self.port);
        self.sim_rt.block_on(sims.stop());
        result
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let binaries = Binaries::locate(&args)?;
    let load_start = cpu::loadavg();
    let started = Instant::now();
    let load_rt = runtime(LOAD_THREADS, 2)?;
    let sim_rt = runtime(SIM_THREADS, 1)?;

    let port = pool_port(args.pods)?;
    let cluster = load_rt.block_on(async {
        let cluster = TestCluster::start().await?;
        create_pool_objects(&cluster.client(), args.pods, port).await?;
        anyhow::Ok(cluster)
    })?;
    let http = HttpClient::new(256, Duration::from_secs(120))?;
    let bench = Bench {
        plan: Plan::new(args.mode)
            .with_prefix_rates(&args.prefix_rates)
            .with_hot_rates(&args.hot_rates),
        binaries,
        kubeconfig: cluster.kubeconfig_path().to_path_buf(),
        port,
        events: EventsPorts::pick(args.pods, port)?,
        bodies: Bodies::new(),
        http,
        load_rt,
        sim_rt,
        args,
    };
    let contenders = contenders(&bench.args);
    let mut ran = Vec::new();
    for rep in 1..=bench.args.reps.max(1) {
        // A drift of the machine (a build beside it, the page cache) must
        // not favour whoever runs first or last: each rep takes the
        // contenders in its own random order, seeded by the rep.
        let mut order: Vec<usize> = (0..contenders.len()).collect();
        order.shuffle(&mut StdRng::seed_from_u64(rep as u64));
        let names: Vec<&str> = order.iter().map(|&i| contenders[i].name).collect();
        eprintln!("[peers] rep {rep} runs {}", names.join(", "));
        for i in order {
            let contender = &contenders[i];
            eprintln!("[peers] rep {rep}: {}: {}", contender.name, contender.what);
            ran.push((rep, i, bench.run_contender(contender, rep)));
        }
    }
    // The tables list the contenders in their declared order.
    ran.sort_by_key(|&(rep, i, _)| (rep, i));
    let reports: Vec<Report> = ran.into_iter().map(|(_, _, r)| r).collect();
    drop(cluster);
    // The closed-loop tables and the summary are of the first rep.
    let first_rep = &reports[..contenders.len()];

    println!(
        "### Side by side ({:?}): {} Pods, Envoy {} ({} workers, `Template::Streamed`, plaintext ext_proc), {} cores",
        bench.args.mode,
        bench.args.pods,
        kinference_testbed::envoy::ENVOY_VERSION.trim(),
        bench.args.envoy_workers,
        kinference_testbed::load::cores()
    );
    println!(
        "load average: start {load_start}, end {}; {:.0} s",
        cpu::loadavg(),
        started.elapsed().as_secs_f64()
    );
    print_closed_tables(first_rep);
    print_open_tables(&reports);
    print_inference_perf_table(first_rep, bench.plan.inference_perf_stage);
    let runs: Vec<(&str, &[priorities::Row])> = first_rep
        .iter()
        .map(|r| (r.contender.name, r.priorities.as_slice()))
        .collect();
    priorities::print_table(&runs, bench.args.pods);
    print_summary(first_rep, bench.args.pods);
    let failed: Vec<&str> = reports
        .iter()
        .filter(|r| r.skipped.is_some())
        .map(|r| r.contender.name)
        .collect();
    let errors: u64 = reports
        .iter()
        .flat_map(|r| &r.rows)
        .map(|r| r.m.out.tally.errors)
        .sum::<u64>()
        + reports
            .iter()
            .filter_map(|r| r.inference_perf.as_ref())
            .flat_map(|run| &run.stages)
            .map(|s| s.failures)
            .sum::<u64>();
    if bench.args.mode == Mode::Smoke {
        // In CI a contender that did not run or a failed request is a failure.
        ensure!(failed.is_empty(), "contenders that did not run: {failed:?}");
        ensure!(errors == 0, "{errors} requests failed");
    }
    Ok(())
}
