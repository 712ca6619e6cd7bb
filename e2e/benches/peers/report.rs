//! The report: per-contender rows, the tables, the ratios and targets.

use std::time::Duration;

use kinference_testbed::http_client::HttpClient;
use kinference_testbed::inference_perf;
use kinference_testbed::load::{
    best_single_prediction_share, cpu, ms, per_request_us, quantile, ratio,
};
use kinference_testbed::prom_reference::parse_line;

use super::contenders::{Contender, Peer, Route};
use super::load::{COLD_START, Measured};
use super::priorities;
use super::processes::EppProcess;
use super::settings::{IDLE_WINDOW, LOAD, SIM};
use super::workloads::{IP_LABEL, OPEN_WORKLOADS, OpenWorkload, is_open_phase};

/// One row of a report.
pub(crate) struct Row {
    pub(crate) contender: &'static str,
    pub(crate) phase: String,
    pub(crate) m: Measured,
    /// Our EPP in the open-loop phases: the share of its TTFT predictions
    /// within 25% of the observed TTFT, over the phase.
    pub(crate) predictions_within_25: Option<f64>,
    /// The same share for a fit of the model's inputs in hindsight
    /// (`ttft_fit`), from the samples its EPP logged over the phase.
    pub(crate) inputs_fit_within_25: Option<f64>,
    /// Our EPP in precise mode: the share of answers whose reported cached
    /// tokens agreed with its index.
    pub(crate) events_agree: Option<f64>,
}

/// Our EPP's counts so far from its `/metrics`.
#[derive(Clone, Copy, Default)]
pub(crate) struct Predictions {
    /// TTFT predictions within 25% of the observed TTFT, and all of them.
    pub(crate) ttft_within_25: f64,
    pub(crate) ttft: f64,
    /// TTFT predictions above the observed TTFT.
    pub(crate) ttft_over: f64,
    /// Precise mode: answers whose reported cached tokens agreed with the
    /// index, and all answers checked.
    pub(crate) events_agree: f64,
    pub(crate) events_checked: f64,
    /// Precise mode: answers the index made no prediction for (the route
    /// memory's estimate won), and answers whose engine had another prefix
    /// cached than the index said.
    pub(crate) events_unindexed: f64,
    pub(crate) events_cached_tokens: f64,
}

impl Predictions {
    /// The share of a phase's TTFT predictions that were too high.
    pub(crate) fn over_share(before: Predictions, after: Predictions) -> Option<f64> {
        share(after.ttft_over - before.ttft_over, after.ttft - before.ttft)
    }

    /// Precise mode's checks over a phase by finding, for the log.
    pub(crate) fn checks(before: Predictions, after: Predictions) -> Option<String> {
        let all = after.events_checked - before.events_checked;
        let pct = |a: f64, b: f64| share(a - b, all).map_or(0.0, |s| s * 100.0);
        (all > 0.0).then(|| {
            format!(
                ", index checks: agree {:.0}%, unindexed {:.0}%, other prefix {:.0}%",
                pct(after.events_agree, before.events_agree),
                pct(after.events_unindexed, before.events_unindexed),
                pct(after.events_cached_tokens, before.events_cached_tokens),
            )
        })
    }

    /// The shares over a phase, from the counts before and after it.
    pub(crate) fn shares(before: Predictions, after: Predictions) -> (Option<f64>, Option<f64>) {
        (
            share(
                after.ttft_within_25 - before.ttft_within_25,
                after.ttft - before.ttft,
            ),
            share(
                after.events_agree - before.events_agree,
                after.events_checked - before.events_checked,
            ),
        )
    }
}

/// `part` of `all`; `None` when there is nothing.
pub(crate) fn share(part: f64, all: f64) -> Option<f64> {
    (all > 0.0).then(|| part / all)
}

pub(crate) async fn predictions(
    http: &HttpClient,
    epp: Option<&EppProcess>,
) -> Option<Predictions> {
    let epp = epp.filter(|e| e.peer == Peer::Kinference)?;
    let text = http
        .get_text(&format!("http://{}/metrics", epp.metrics))
        .await
        .ok()?;
    let mut p = Predictions::default();
    let samples = text.lines().filter_map(|l| parse_line(l).ok().flatten());
    for s in samples {
        let label = |name: &str| {
            s.labels
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        match s.name.as_str() {
            "kinference_epp_ttft_prediction_relative_error_bucket"
                if label("le") == Some("0.25") =>
            {
                p.ttft_within_25 += s.value
            }
            "kinference_epp_ttft_prediction_relative_error_count" => {
                p.ttft += s.value;
                if label("direction") == Some("over") {
                    p.ttft_over += s.value;
                }
            }
            "kinference_epp_kv_events_checks_total" => {
                p.events_checked += s.value;
                match label("result") {
                    Some("agree") => p.events_agree += s.value,
                    Some("unindexed") => p.events_unindexed += s.value,
                    Some("cached_tokens") => p.events_cached_tokens += s.value,
                    _ => {}
                }
            }
            _ => {}
        }
    }
    Some(p)
}

/// Everything one contender measured.
pub(crate) struct Report {
    pub(crate) contender: Contender,
    /// Which rep (from 1) of `--reps`.
    pub(crate) rep: usize,
    pub(crate) idle_cpu_ms_per_s: Option<f64>,
    pub(crate) rows: Vec<Row>,
    /// (f), when it ran.
    pub(crate) inference_perf: Option<InferencePerfRun>,
    /// (i), one row per load, when it ran.
    pub(crate) priorities: Vec<priorities::Row>,
    pub(crate) skipped: Option<String>,
}

/// Workload (f): inference-perf's stages. (No EPP CPU per request: the
/// run's long start, loading the tokenizer and generating prompts, would be
/// mostly the EPP's idle scraping.)
pub(crate) struct InferencePerfRun {
    pub(crate) stages: Vec<inference_perf::Stage>,
}

// ---------------------------------------------------------------------------
// Running one contender.
// ---------------------------------------------------------------------------

/// The EPP's CPU at rest (scraping, watching), in ms per second.
pub(crate) fn idle_cpu(pid: u32) -> f64 {
    let before = cpu::process_cpu(pid);
    std::thread::sleep(IDLE_WINDOW);
    let used = cpu::process_cpu(pid).saturating_sub(before);
    used.as_secs_f64() * 1e3 / IDLE_WINDOW.as_secs_f64()
}

pub(crate) fn brief(m: &Measured) -> String {
    format!(
        "{} req, {:.0} req/s, p50 {:.2} ms, p99 {:.2} ms, {} errors{}",
        m.measured(),
        m.rps(),
        m.q(0.5),
        m.q(0.99),
        m.out.tally.errors,
        m.out
            .tally
            .first_error
            .as_ref()
            .map_or(String::new(), |e| format!(" (first: {e})"))
    )
}

// ---------------------------------------------------------------------------
// Report.
// ---------------------------------------------------------------------------

pub(crate) fn mb(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

pub(crate) fn served(m: &Measured) -> String {
    m.out
        .served
        .iter()
        .map(|(k, v)| format!("{}:{}", k.trim_start_matches("sim-"), v.first_bytes.len()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The direct row of `phase`: the baseline of the added latencies.
pub(crate) fn baseline<'a>(reports: &'a [Report], phase: &str) -> Option<&'a Measured> {
    reports
        .iter()
        .filter(|r| r.contender.route == Route::Direct)
        .flat_map(|r| &r.rows)
        .find(|row| row.phase == phase)
        .map(|row| &row.m)
}

pub(crate) fn phases_in_order(reports: &[Report]) -> Vec<String> {
    let mut phases: Vec<String> = Vec::new();
    for row in reports.iter().flat_map(|r| &r.rows) {
        if !phases.contains(&row.phase) {
            phases.push(row.phase.clone());
        }
    }
    phases
}

pub(crate) fn print_closed_tables(reports: &[Report]) {
    for phase in phases_in_order(reports)
        .iter()
        .filter(|p| !is_open_phase(p))
    {
        let base = baseline(reports, phase);
        println!("\n#### {phase}\n");
        println!(
            "| contender | requests | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | EPP CPU µs/req | Envoy CPU µs/req | EPP RSS MB (peak) | cores: load gen / sims / other procs | errors | served by sim |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|");
        for row in reports
            .iter()
            .flat_map(|r| &r.rows)
            .filter(|r| &r.phase == phase)
        {
            print_closed_row(row, base);
        }
    }
}

pub(crate) fn print_closed_row(row: &Row, base: Option<&Measured>) {
    let m = &row.m;
    let added = |q: f64| base.map_or("-".into(), |b| format!("{:+.2}", m.q(q) - b.q(q)));
    let per_req = |d: Duration| per_request_us(d, m.measured());
    let epp = m
        .epp_rss
        .map_or("-".to_string(), |_| format!("{:.0}", per_req(m.epp_cpu)));
    let rss = m.epp_rss.map_or("-".to_string(), |(now, peak)| {
        format!("{:.0} ({:.0})", mb(now), mb(peak))
    });
    let cores = |d: Duration| m.window.cores(d);
    println!(
        "| {} | {} | {:.0} | {:.2} | {:.2} | {} | {} | {epp} | {} | {rss} | {:.2} / {:.2} / {:.2} | {}{} | {} |",
        row.contender,
        m.measured(),
        m.rps(),
        m.q(0.5),
        m.q(0.99),
        added(0.5),
        added(0.99),
        if m.envoy_cpu.is_zero() {
            "-".to_string()
        } else {
            format!("{:.0}", per_req(m.envoy_cpu))
        },
        cores(m.window.cpu[LOAD]),
        cores(m.window.cpu[SIM]),
        m.window.cpu.others_cores(),
        m.out.tally.errors,
        if m.window.truncated {
            " (time cap)"
        } else {
            ""
        },
        served(m),
    );
}

pub(crate) fn print_open_tables(reports: &[Report]) {
    for w in &OPEN_WORKLOADS {
        print_open_table(reports, w);
    }
}

pub(crate) fn print_open_table(reports: &[Report], w: &OpenWorkload) {
    let phases: Vec<String> = phases_in_order(reports)
        .into_iter()
        .filter(|p| p.starts_with(w.label))
        .collect();
    if phases.is_empty() {
        return;
    }
    let shape = &w.shape;
    println!(
        "\n#### {}: {} system prompts of {} bytes, {} questions of {} bytes each, hot prefix {:.0}% of requests, {} output tokens, streamed; TTFT = first body byte at the client\n",
        w.label,
        shape.groups,
        shape.system_bytes,
        shape.prompts_per_group,
        shape.question_bytes,
        shape.hot_share * 100.0,
        shape.output_tokens
    );
    println!(
        "Medians over reps; \"÷ gie-default\" is each rep's TTFT p90 over the reference's in the same rep: median (worst), and how many reps were over 0.8×. Cache hit = prompt tokens the simulators reported cached; Pods/group = simulators that served each system prompt. \"Sent after {warm} s\": the requests sent {warm} s or more after the rate's start (a workload's first rate starts from cold caches).\n",
        warm = COLD_START.as_secs()
    );
    println!(
        "| rate | contender | reps | requests | done/s | TTFT p50 ms | p90 ms | p99 ms | p90 range ms | p90 ÷ gie-default | p90 ÷ envoy-rr | cache hit | Pods/group | TTFT predictions within 25% | a fit of its inputs in hindsight within 25% | best single value within 25% | cached tokens as the index predicted | EPP CPU µs/req | errors | p90 ms, sent after {warm} s | p90 ÷ gie-default, sent after {warm} s | served by sim (rep 1) |",
        warm = COLD_START.as_secs()
    );
    println!(
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
    );
    for phase in &phases {
        // Each row with its rep, so that ratios pair rows of one rep even
        // when a contender is missing from another.
        let rows: Vec<(usize, &Row)> = reports
            .iter()
            .flat_map(|r| r.rows.iter().map(move |row| (r.rep, row)))
            .filter(|(_, row)| &row.phase == phase)
            .collect();
        let mut names: Vec<&str> = Vec::new();
        for (_, r) in &rows {
            if !names.contains(&r.contender) {
                names.push(r.contender);
            }
        }
        // Per rep of contender `name`, what `of` reads from its phase.
        let per_rep = |name: &str, of: &dyn Fn(&Measured) -> Option<f64>| -> Vec<(usize, f64)> {
            rows.iter()
                .filter(|(_, r)| r.contender == name)
                .filter_map(|(rep, r)| Some((*rep, of(&r.m)?)))
                .collect()
        };
        let p90s = |name: &str| per_rep(name, &|m| Some(ttft(m, 0.9)));
        let warm_p90s = |name: &str| per_rep(name, &|m| warm_ttft(m, 0.9));
        let (reference, rr) = (p90s("gie-default"), p90s("envoy-rr"));
        let warm_reference = warm_p90s("gie-default");
        for name in names {
            let reps: Vec<&Row> = rows
                .iter()
                .filter(|(_, r)| r.contender == name)
                .map(|(_, r)| *r)
                .collect();
            let of = |f: &dyn Fn(&Row) -> Option<f64>| {
                median(reps.iter().filter_map(|r| f(r)).collect())
            };
            let p90 = p90s(name);
            let warm_p90 = warm_p90s(name);
            let fmt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or("-".to_string(), f);
            let first = reps[0];
            println!(
                "| {} | {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                phase.trim_start_matches(w.label).trim(),
                reps.len(),
                fmt(of(&|r| Some(r.m.measured() as f64)), &|v| format!("{v:.0}")),
                fmt(of(&|r| Some(r.m.rps())), &|v| format!("{v:.1}")),
                fmt(of(&|r| Some(ttft(&r.m, 0.5))), &|v| format!("{v:.0}")),
                fmt(of(&|r| Some(ttft(&r.m, 0.9))), &|v| format!("{v:.0}")),
                fmt(of(&|r| Some(ttft(&r.m, 0.99))), &|v| format!("{v:.0}")),
                range(&p90.iter().map(|(_, v)| *v).collect::<Vec<_>>()),
                if name == "gie-default" {
                    rep_ratios(&p90, &reference)
                } else {
                    rep_ratios_against(&p90, &reference, P90_TARGET)
                },
                rep_ratios(&p90, &rr),
                fmt(of(&|r| r.m.out.cache_hit_share()), &|v| format!(
                    "{:.0}%",
                    v * 100.0
                )),
                fmt(of(&|r| r.m.out.pods_per_group()), &|v| format!("{v:.2}")),
                fmt(of(&|r| r.predictions_within_25), &|v| format!(
                    "{:.0}%",
                    v * 100.0
                )),
                fmt(of(&|r| r.inputs_fit_within_25), &|v| format!(
                    "{:.0}%",
                    v * 100.0
                )),
                fmt(
                    of(&|r| best_single_prediction_share(&r.m.out.first_bytes, 0.25)),
                    &|v| format!("{:.0}%", v * 100.0)
                ),
                fmt(of(&|r| r.events_agree), &|v| format!("{:.0}%", v * 100.0)),
                fmt(
                    of(&|r| r
                        .m
                        .epp_rss
                        .map(|_| per_request_us(r.m.epp_cpu, r.m.measured()))),
                    &|v| format!("{v:.0}")
                ),
                reps.iter().map(|r| r.m.out.tally.errors).sum::<u64>(),
                fmt(of(&|r| warm_ttft(&r.m, 0.9)), &|v| format!("{v:.0}")),
                rep_ratios(&warm_p90, &warm_reference),
                served(&first.m),
            );
        }
    }
}

/// The median of `values` (the mean of the middle two for an even count).
pub(crate) fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

/// `min–max` of `values`, or the one value.
pub(crate) fn range(values: &[f64]) -> String {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    match values.len() {
        0 => "-".into(),
        1 => format!("{min:.0}"),
        _ => format!("{min:.0}–{max:.0}"),
    }
}

/// The shared-prefix target for our TTFT p90 over the reference's, in
/// every rep.
pub(crate) const P90_TARGET: f64 = 0.8;

/// Rep by rep, `ours[i] / theirs[i]`: the median and the worst (highest),
/// as `0.52× (0.61×)`.
pub(crate) fn rep_ratios(ours: &[(usize, f64)], theirs: &[(usize, f64)]) -> String {
    median_and_worst(&per_rep_ratios(ours, theirs))
}

/// `ratios` as `0.52× (0.61×)`: their median and the highest.
pub(crate) fn median_and_worst(ratios: &[f64]) -> String {
    let worst = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    match median(ratios.to_vec()) {
        None => "-".into(),
        Some(m) if ratios.len() == 1 => format!("{m:.2}×"),
        Some(m) => format!("{m:.2}× ({worst:.2}×)"),
    }
}

/// [`rep_ratios`], and over several reps how many were above `target`
/// (the shared-prefix target: ≤ 0.8× the reference in every rep).
pub(crate) fn rep_ratios_against(
    ours: &[(usize, f64)],
    theirs: &[(usize, f64)],
    target: f64,
) -> String {
    let ratios = per_rep_ratios(ours, theirs);
    let over = ratios.iter().filter(|&&r| r > target).count();
    match ratios.len() {
        0 | 1 => median_and_worst(&ratios),
        n => format!(
            "{}, {over} of {n} over {target}×",
            median_and_worst(&ratios)
        ),
    }
}

/// Each rep's `ours` over `theirs` of the same rep.
pub(crate) fn per_rep_ratios(ours: &[(usize, f64)], theirs: &[(usize, f64)]) -> Vec<f64> {
    ours.iter()
        .filter_map(|(rep, o)| {
            let (_, t) = theirs.iter().find(|(r, _)| r == rep)?;
            (*t > 0.005).then(|| o / t)
        })
        .collect()
}

/// (f), per rate: ratios against `gie-default` and `envoy-rr` of the same
/// stage.
pub(crate) fn print_inference_perf_table(reports: &[Report], stage: Duration) {
    let runs: Vec<(&str, &InferencePerfRun)> = reports
        .iter()
        .filter_map(|r| Some((r.contender.name, r.inference_perf.as_ref()?)))
        .collect();
    let Some((_, first)) = runs.first() else {
        return;
    };
    println!(
        "\n#### {IP_LABEL}: {} system prompts of {} tokens, {} questions of {} tokens each, {} output tokens, streamed, Poisson stages of {} s; TTFT as inference-perf measures it; cached = prompt tokens the simulators reported cached\n",
        inference_perf::GROUPS,
        inference_perf::SYSTEM_PROMPT_TOKENS,
        inference_perf::PROMPTS_PER_GROUP,
        inference_perf::QUESTION_TOKENS,
        inference_perf::OUTPUT_TOKENS,
        stage.as_secs(),
    );
    println!(
        "| rate | contender | ok | failed | achieved/s | done/s | TTFT p50 ms | p90 ms | p99 ms | p90 vs gie-default | p90 vs envoy-rr | cached |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let p90_of = |name: &str, i: usize| {
        runs.iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, r)| r.stages.get(i))
            .map(|s| s.ttft_ms[1])
    };
    for i in 0..first.stages.len() {
        for (name, run) in &runs {
            let Some(s) = run.stages.get(i) else { continue };
            let vs = |base: &str| p90_of(base, i).map_or("-".into(), |b| ratio(s.ttft_ms[1], b));
            println!(
                "| {:.0}/s | {name} | {} | {} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} | {} | {} | {:.0}% |",
                s.rate,
                s.successes,
                s.failures,
                s.achieved_rate,
                s.requests_per_sec,
                s.ttft_ms[0],
                s.ttft_ms[1],
                s.ttft_ms[2],
                vs("gie-default"),
                vs("envoy-rr"),
                s.cached_share * 100.0,
            );
        }
    }
}

pub(crate) fn ttft(m: &Measured, q: f64) -> f64 {
    ms(quantile(&m.out.first_bytes, q))
}

/// The TTFT quantile of the requests sent after the cold start, if any.
pub(crate) fn warm_ttft(m: &Measured, q: f64) -> Option<f64> {
    let warm = &m.out.warm_first_bytes;
    (!warm.is_empty()).then(|| ms(quantile(warm, q)))
}

pub(crate) fn print_summary(reports: &[Report], pods: usize) {
    println!("\n#### Per contender\n");
    println!("| contender | what | idle CPU ms/s ({pods} endpoints) | notes |");
    println!("|---|---|---:|---|");
    for r in reports {
        println!(
            "| {} | {} | {} | {} |",
            r.contender.name,
            r.contender.what,
            r.idle_cpu_ms_per_s
                .map_or("-".to_string(), |v| format!("{v:.1}")),
            r.skipped.as_deref().unwrap_or(""),
        );
    }
    print_targets(reports);
}

pub(crate) fn row<'a>(reports: &'a [Report], contender: &str, phase: &str) -> Option<&'a Measured> {
    reports
        .iter()
        .flat_map(|r| &r.rows)
        .find(|r| r.contender == contender && r.phase == phase)
        .map(|r| &r.m)
}

/// The targets, ours against the reference on equivalent objectives
/// (queue) and on each one's default.
pub(crate) fn print_targets(reports: &[Report]) {
    print_latency_targets(reports);
    print_ttft_targets(reports);
}

/// The "220 KB × c150: added p99 < 10 ms"; a negative added p99 is
/// the baseline's own tail, not a result.
pub(crate) fn verdict_220kb(phase: &str, added_p99: f64) -> &'static str {
    match () {
        _ if !phase.contains("220 KB") => "",
        _ if added_p99 < 0.0 => " (below the baseline's own p99: not measurable)",
        _ if added_p99 < 10.0 => " (< 10 ms: met)",
        _ => " (< 10 ms: MISSED)",
    }
}

/// Shared-prefix p90 TTFT of ours ÷ the reference's default profile, per rate
/// (target ≤ 0.8×).
pub(crate) fn print_ttft_targets(reports: &[Report]) {
    let phases: Vec<String> = phases_in_order(reports)
        .into_iter()
        .filter(|p| p.starts_with("(c)"))
        .collect();
    for phase in &phases {
        for ours in ["kinference-ttft", "kinference-queue"] {
            let (Some(a), Some(b)) = (
                row(reports, ours, phase),
                row(reports, "gie-default", phase),
            ) else {
                continue;
            };
            println!(
                "| {phase} | {ours} / gie-default | p90 TTFT {} ({:.0} / {:.0} ms; target ≤ 0.80×) | | |",
                ratio(ttft(a, 0.9), ttft(b, 0.9)),
                ttft(a, 0.9),
                ttft(b, 0.9),
            );
        }
    }
}

pub(crate) fn print_latency_targets(reports: &[Report]) {
    println!("\n#### Against the targets (ours ÷ reference, same phase)\n");
    println!(
        "| phase | pair | EPP CPU/req (target ≤ 0.25×) | added p99 (target ≤ 0.33×) | ours: added p99 ms |"
    );
    println!("|---|---|---:|---:|---:|");
    let pairs = [
        ("kinference-queue", "gie-queue"),
        ("kinference-ttft", "gie-default"),
    ];
    for phase in phases_in_order(reports)
        .iter()
        .filter(|p| !is_open_phase(p))
    {
        let Some(base) = baseline(reports, phase) else {
            continue;
        };
        for (ours, theirs) in pairs {
            let (Some(a), Some(b)) = (row(reports, ours, phase), row(reports, theirs, phase))
            else {
                continue;
            };
            let cpu = |m: &Measured| per_request_us(m.epp_cpu, m.measured());
            let added = |m: &Measured| m.q(0.99) - base.q(0.99);
            println!(
                "| {phase} | {ours} / {theirs} | {} ({:.0} / {:.0} µs) | {} ({:+.2} / {:+.2} ms) | {:+.2}{} |",
                ratio(cpu(a), cpu(b)),
                cpu(a),
                cpu(b),
                ratio(added(a), added(b)),
                added(a),
                added(b),
                added(a),
                verdict_220kb(phase, added(a)),
            );
        }
    }
}

// ---------------------------------------------------------------------------
// Main.
// ---------------------------------------------------------------------------
