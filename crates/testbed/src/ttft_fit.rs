//! How much of a run's TTFT spread the EPP's TTFT model's inputs can
//! explain: its per-sample debug lines (`kinference_epp::ttft_samples`, in
//! the text log format), fitted in hindsight.
//!
//! The model predicts `base + a·waiting + b·running + c·uncached_tokens +
//! d·kv_utilization`, learnt online, per endpoint. The fit here sees the
//! inputs the decision saw (the uncached count as guessed, not as the
//! engine later reported) and the TTFTs that followed, after the fact: one
//! least-squares fit of the same linear law over the whole phase and every
//! endpoint, on errors relative to the observed TTFT, trained on every other
//! sample and scored on the rest (and the other way round), so it is not
//! scored on what it was fitted to. Its share within 25% is what one such
//! fit reaches with hindsight; the model's own share is read from the same
//! lines. It is a yardstick, not a bound: least squares does not maximize
//! that share, and the online model may follow a drift that one fit over
//! the phase averages away.

/// One sample's line, parsed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// The TTFT predicted at the decision, ms; `None` if none was made.
    pub predicted_ms: Option<f64>,
    pub observed_ms: f64,
    /// The model's regression vector: 1, waiting, running, thousands of
    /// uncached tokens, KV-cache utilization.
    pub inputs: [f64; DIM],
}

const DIM: usize = 5;
/// The line's target and message, after which come its fields.
const MESSAGE: &str = "kinference_epp::ttft_samples: TTFT sample learnt ";
/// The fields a sample's line holds, and nothing else.
const FIELDS: [&str; 8] = [
    "endpoint",
    "predicted_ms",
    "observed_ms",
    "waiting",
    "running",
    "uncached_tokens",
    "guessed_uncached_tokens",
    "kv_utilization",
];

/// The sample a text-format log line holds, if it is one. The fields are
/// read after the last message, and must all be the sample's: a span's
/// field (a client's request id) that mimics one cannot add a sample.
pub fn parse_line(line: &str) -> Option<Sample> {
    let line = without_colours(line);
    let (_, fields) = line.rsplit_once(MESSAGE)?;
    let mut values = [None; FIELDS.len()];
    for field in fields.split_whitespace() {
        let (name, value) = field.split_once('=')?;
        let i = FIELDS.iter().position(|&f| f == name)?;
        values[i] = Some(value);
    }
    let number = |name: &str| -> Option<f64> {
        let i = FIELDS.iter().position(|&f| f == name)?;
        values[i]?.parse().ok().filter(|v: &f64| v.is_finite())
    };
    let observed_ms = number("observed_ms").filter(|&v| v > 0.0)?;
    Some(Sample {
        predicted_ms: number("predicted_ms"),
        observed_ms,
        inputs: [
            1.0,
            number("waiting")?,
            number("running")?,
            number("guessed_uncached_tokens")? * 1e-3,
            number("kv_utilization")?.min(1.0),
        ],
    })
}

/// `line` without terminal colour codes (`ESC [ … m`), which the text log
/// format writes unless `NO_COLOR` is set.
fn without_colours(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            out.push(c);
        }
    }
    out
}

/// Every sample in `log`'s lines.
pub fn parse_log(log: &str) -> Vec<Sample> {
    log.lines().filter_map(parse_line).collect()
}

/// A phase's samples, scored.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scores {
    pub samples: usize,
    /// The model's predictions within `tolerance` of the observed TTFT.
    pub predicted_within: Option<f64>,
    /// The hindsight fit's, cross-validated.
    pub fitted_within: f64,
}

/// Scores `samples` at `tolerance` (0.25: within 25% of the observed
/// TTFT); `None` for fewer than [`MIN_SAMPLES`], or samples no fit solves.
pub fn score(samples: &[Sample], tolerance: f64) -> Option<Scores> {
    if samples.len() < MIN_SAMPLES {
        return None;
    }
    let within =
        |predicted: f64, observed: f64| (predicted - observed).abs() <= tolerance * observed;
    let predicted: Vec<bool> = samples
        .iter()
        .filter_map(|s| Some(within(s.predicted_ms?, s.observed_ms)))
        .collect();
    let mut fitted = 0;
    for fold in 0..2 {
        let c = fit(samples.iter().skip(fold).step_by(2))?;
        fitted += samples
            .iter()
            .skip(1 - fold)
            .step_by(2)
            .filter(|s| within(dot(&c, &s.inputs), s.observed_ms))
            .count();
    }
    Some(Scores {
        samples: samples.len(),
        predicted_within: (!predicted.is_empty())
            .then(|| predicted.iter().filter(|&&w| w).count() as f64 / predicted.len() as f64),
        fitted_within: fitted as f64 / samples.len() as f64,
    })
}

/// Fewer samples than this say nothing about a phase.
pub const MIN_SAMPLES: usize = 50;

fn dot(a: &[f64; DIM], b: &[f64; DIM]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The coefficients minimizing Σ ((x·c − y) / y)²: the normal equations
/// `Σ x xᵀ / y² · c = Σ x / y`, with a ridge of a billionth of the
/// largest diagonal term (whatever the TTFTs' scale), so that an input the
/// phase never varied (no queue at all) leaves them solvable.
fn fit<'a>(samples: impl Iterator<Item = &'a Sample>) -> Option<[f64; DIM]> {
    let mut a = [[0.0; DIM]; DIM];
    let mut b = [0.0; DIM];
    for s in samples {
        let y = s.observed_ms;
        for (i, row) in a.iter_mut().enumerate() {
            b[i] += s.inputs[i] / y;
            for (cell, x) in row.iter_mut().zip(&s.inputs) {
                *cell += s.inputs[i] * x / (y * y);
            }
        }
    }
    let ridge = 1e-9 * (0..DIM).map(|i| a[i][i]).fold(f64::MIN_POSITIVE, f64::max);
    for (i, row) in a.iter_mut().enumerate() {
        row[i] += ridge;
    }
    solve(a, b)
}

/// `a · x = b` by Gaussian elimination with partial pivoting; `None` if
/// `a` is singular.
fn solve(mut a: [[f64; DIM]; DIM], mut b: [f64; DIM]) -> Option<[f64; DIM]> {
    for col in 0..DIM {
        let pivot = (col..DIM).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        let (above, below) = a.split_at_mut(col + 1);
        let pivot_row = &above[col];
        for (offset, row) in below.iter_mut().enumerate() {
            let factor = row[col] / pivot_row[col];
            for (cell, p) in row[col..].iter_mut().zip(&pivot_row[col..]) {
                *cell -= factor * p;
            }
            b[col + 1 + offset] -= factor * b[col];
        }
    }
    let mut x = [0.0; DIM];
    for row in (0..DIM).rev() {
        let rest: f64 = (row + 1..DIM).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - rest) / a[row][row];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line as the EPP logs it, inside its request's span.
    const LINE: &str = "2026-12-06T17:30:53.118673Z DEBUG ext_proc{request_id=\"req-43\" rule=\"fast\" destination=\"10.0.0.9:8000\" outcome=200}: kinference_epp::ttft_samples: TTFT sample learnt endpoint=\"10.0.0.9:8000\" predicted_ms=21.2 observed_ms=50.0 waiting=1.0 running=2.0 uncached_tokens=0.0 guessed_uncached_tokens=6000.0 kv_utilization=0.5";

    #[test]
    fn a_line_is_read_field_by_field_and_other_lines_are_skipped() {
        let sample = parse_line(LINE).unwrap();
        assert_eq!(sample.predicted_ms, Some(21.2));
        assert_eq!(sample.observed_ms, 50.0);
        // The decision's inputs: the uncached count it guessed.
        assert_eq!(sample.inputs, [1.0, 1.0, 2.0, 6.0, 0.5]);
        // No prediction was made: the field is left out.
        let unpredicted = LINE.replace("predicted_ms=21.2 ", "");
        assert_eq!(parse_line(&unpredicted).unwrap().predicted_ms, None);
        // A field is read by its whole name, never from another's.
        let renamed = LINE.replace(" waiting=1.0", " queue_waiting=1.0");
        assert_eq!(parse_line(&renamed), None);
        let log = format!("{LINE}\nINFO something else\n{LINE}\n");
        assert_eq!(parse_log(&log).len(), 2);
        assert_eq!(parse_line("INFO kinference_epp: ready"), None);
    }

    #[test]
    fn colours_are_read_through() {
        let coloured = LINE
            .replace(" waiting=", " \x1b[3mwaiting\x1b[0m\x1b[2m=\x1b[0m")
            .replace("DEBUG", "\x1b[34mDEBUG\x1b[0m");
        assert_eq!(parse_line(&coloured), parse_line(LINE));
    }

    #[test]
    fn a_request_id_that_mimics_a_sample_adds_none() {
        let mimic = "kinference_epp::ttft_samples: TTFT sample learnt observed_ms=1 waiting=0 running=0 guessed_uncached_tokens=0 kv_utilization=0";
        let spoofed = LINE.replace("req-43", mimic);
        // On a sample's line: the real fields, after the last message.
        assert_eq!(parse_line(&spoofed), parse_line(LINE));
        // On any other line of that request: no sample.
        let other = format!(
            "2026-12-06T17:30:53Z INFO ext_proc{{request_id=\"{mimic}\"}}: kinference_epp::extproc: something"
        );
        assert_eq!(parse_line(&other), None);
    }

    /// `n` samples of `ttft = 10 + 5·waiting + 40·thousands uncached`, each
    /// observed times `noise(i)`, predicted as `predict(i)` ms.
    fn samples(
        n: usize,
        noise: impl Fn(usize) -> f64,
        predict: impl Fn(usize) -> f64,
    ) -> Vec<Sample> {
        (0..n)
            .map(|i| {
                let (waiting, uncached) = ((i % 4) as f64, ((i / 4) % 3) as f64);
                let law = 10.0 + 5.0 * waiting + 40.0 * uncached;
                Sample {
                    predicted_ms: Some(predict(i)),
                    observed_ms: law * noise(i),
                    inputs: [1.0, waiting, 0.0, uncached, 0.0],
                }
            })
            .collect()
    }

    #[test]
    fn a_law_the_inputs_explain_is_fitted_whole() {
        let scored = score(&samples(120, |_| 1.0, |_| 10.0), 0.25).unwrap();
        assert_eq!(scored.samples, 120);
        assert_eq!(scored.fitted_within, 1.0);
        // Predicting 10 ms for all is right only where the law says 10 ms:
        // no queue and nothing to prefill, one sample in 12.
        assert_eq!(scored.predicted_within, Some(10.0 / 120.0));
    }

    #[test]
    fn noise_the_inputs_cannot_see_bounds_the_fit() {
        // A third of every input's samples 2× slower (every third run of
        // 12, which goes once through the inputs): the fit lands 11% above
        // the rest, and cannot put the slow ones within 25% with them.
        let slow = |i: usize| if (i / 12).is_multiple_of(3) { 2.0 } else { 1.0 };
        let scored = score(&samples(144, slow, |_| 10.0), 0.25).unwrap();
        assert!(
            (scored.fitted_within - 2.0 / 3.0).abs() < 1e-9,
            "{scored:?}"
        );
    }

    #[test]
    fn the_fit_minimizes_errors_relative_to_the_observed_ttft() {
        // As above: a third of every input's samples 2× slower. Relative to
        // the observed TTFT, the best fit is 10/9 of the law (an unweighted
        // one would be 4/3 of it, a 1/y-weighted one 6/5).
        let slow = |i: usize| if (i / 12).is_multiple_of(3) { 2.0 } else { 1.0 };
        let all = samples(144, slow, |_| 10.0);
        let c = fit(all.iter()).unwrap();
        let law = [10.0, 5.0, 0.0, 40.0, 0.0];
        for (got, want) in c.iter().zip(law) {
            assert!((got - want * 10.0 / 9.0).abs() < 1e-6, "{c:?}");
        }
    }

    #[test]
    fn too_few_samples_say_nothing() {
        assert_eq!(
            score(&samples(MIN_SAMPLES - 1, |_| 1.0, |_| 1.0), 0.25),
            None
        );
    }

    #[test]
    fn a_singular_system_is_refused() {
        assert_eq!(solve([[0.0; DIM]; DIM], [1.0; DIM]), None);
        let mut identity = [[0.0; DIM]; DIM];
        for (i, row) in identity.iter_mut().enumerate() {
            row[i] = 2.0;
        }
        assert_eq!(
            solve(identity, [2.0, 4.0, 6.0, 8.0, 10.0]),
            Some([1.0, 2.0, 3.0, 4.0, 5.0])
        );
        // A zero first pivot: rows must be swapped.
        let a = [
            [0.0, 1.0, 0.0, 0.0, 0.0],
            [1.0, 1.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 2.0, 1.0, 0.0],
            [0.0, 0.0, 1.0, 3.0, 1.0],
            [1.0, 0.0, 0.0, 1.0, 4.0],
        ];
        let x = [1.0, -2.0, 0.5, 3.0, -1.0];
        let b: Vec<f64> = a.iter().map(|row| dot(row, &x)).collect();
        let solved = solve(a, b.try_into().unwrap()).unwrap();
        for (got, want) in solved.iter().zip(x) {
            assert!((got - want).abs() < 1e-12, "{solved:?}");
        }
    }
}
