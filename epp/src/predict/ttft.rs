//! Per-endpoint TTFT model, calibrated online from the TTFTs the EPP observes.
//!
//! `ttft = base + per_queued·waiting + per_running·running + per_token·uncached_tokens
//!        + per_kv·kv_utilization` (seconds).
//!
//! Fitted by recursive least squares (RLS) with exponential forgetting, on
//! relative errors: each observation is divided by its predicted TTFT before
//! the step, so a 30 ms cache hit predicted at 60 ms weighs as much as a 1.5 s
//! prefill predicted at 3 s. TTFT is bimodal (cached prompts are tens of
//! times faster than uncached ones) and its noise grows with its size; on
//! absolute errors the few slow samples set every coefficient, the fast ones
//! came out 2–10× off, and those are the predictions that decide whether a
//! request keeps its cached prefix.
//!
//! Weighed that way alone, the fit lands near the mean TTFT for given inputs
//! (the clip pulls it a little toward the median). A loaded machine's TTFTs
//! are skewed to the slow side (a core the engine waited for, a queue the
//! scrape missed), so the mean sits above most of them, while a prediction is
//! judged by its error relative to the TTFT observed. So a sample slower than
//! predicted, by a factor of at most [`OBSERVED_BAND`], is also weighed by
//! `(predicted / observed)²`, which makes its error relative to the observed
//! TTFT, and the fit lands nearer the typical TTFT (BENCHMARKS.md, "what the
//! TTFT model's inputs can explain"). Every other sample weighs 1:
//! - a faster one: weighed more, a fast tail (a queue the scrape showed that
//!   had drained) would drag the fit below most TTFTs, and a prefix
//!   mislabelled as uncached, answered in cached time, would drive the
//!   prefill cost to nothing. At weight 1 it still pulls the fit down a
//!   little more than before, against the lighter slow samples;
//! - one more than `OBSERVED_BAND` times slower: a shift, which the model
//!   must follow, or a prefix mislabelled as cached, which the clip bounds.
//!   The weight jumps from a ninth to 1 there on purpose: such a sample is
//!   no longer the tail of the same law.
//!
//! Started from priors (base 20 ms, prefill at 5,000 tok/s, a queued request
//! costing ~250 ms, i.e. about one average prefill plus a few decode steps)
//! whose confidence is the initial covariance. Guards that keep it sane on
//! live data:
//! - invalid observations (NaN, infinite, negative, absurd) are ignored;
//! - the (relative) innovation is clipped at 4× a running residual scale
//!   (Huber-like), so a single 60 s outlier, or a request the prefix index
//!   thought cached that was not, moves the model by a bounded step, while a real shift
//!   (residuals consistently at the bound) grows the scale ~15% per sample and is
//!   followed within a few dozen samples;
//! - coefficients are projected onto `[0, max]` after each step (more queue or
//!   more prompt can never make TTFT smaller);
//! - covariance wind-up (forgetting inflates the covariance of directions the
//!   data does not excite, e.g. `waiting` when queues are always empty) is capped
//!   at the prior covariance by a symmetric diagonal rescaling (keeps it PSD);
//! - the prefill cost moves only on samples whose prefill term (at no less
//!   than the prior's cost) is at least a quarter of the prediction: a cached
//!   answer slowed by a queue the scrape missed is load, not prefill.
//!
//! One global model learns from every observation; each endpoint has its own
//! model (warm-started from the global one) that takes over for prediction once
//! it has seen `min_endpoint_observations` samples.

use kinference_runtime::sync::lock;
use std::sync::Mutex;

const DIM: usize = 5;
/// The uncached-tokens term.
const TOKEN: usize = 3;
/// The prefill cost moves only on samples whose prefill term is at least
/// this share of the predicted TTFT (see `Rls::step`).
const PREFILL_SHARE: f64 = 0.25;
/// Uncached tokens enter the regression in thousands so all features are O(1..100)
/// and the covariance stays well conditioned.
const TOKEN_SCALE: f64 = 1e-3;

/// Samples slower than predicted, by a factor of at most this, are weighed
/// as errors relative to the observed TTFT (see the module doc).
const OBSERVED_BAND: f64 = 3.0;

/// Residual scale, in units of the expected noise, at which the model
/// takes the data for a shift and restarts its covariance from the prior.
const SHIFT_RESET: f64 = 4.0;

/// Feature caps: beyond these an input is treated as garbage.
const MAX_COUNT: f64 = 1e5;
const MAX_TOKENS: f64 = 1e8;

/// Inputs of one prediction, as scraped and estimated for a local candidate.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TtftFeatures {
    /// Requests waiting in the server's queue (`vllm:num_requests_waiting`).
    pub waiting: f64,
    /// Requests being decoded/prefilled (`vllm:num_requests_running`).
    pub running: f64,
    /// Prompt tokens that must be prefilled: prompt tokens − cached prefix tokens.
    pub uncached_tokens: f64,
    /// KV-cache utilization, 0..1 (`vllm:kv_cache_usage_perc` is a fraction).
    pub kv_utilization: f64,
}

impl TtftFeatures {
    /// Builds features from prompt and cached-prefix token counts
    /// (uncached = max(0, prompt − cached)).
    pub fn new(
        waiting: f64,
        running: f64,
        prompt_tokens: f64,
        cached_tokens: f64,
        kv_utilization: f64,
    ) -> Self {
        Self {
            waiting,
            running,
            uncached_tokens: (prompt_tokens - cached_tokens).max(0.0),
            kv_utilization,
        }
    }

    /// The regression vector, or `None` if any input is NaN, infinite,
    /// negative or absurdly large (observations with such inputs are dropped).
    fn strict(&self) -> Option<[f64; DIM]> {
        let ok = |v: f64, max: f64| v.is_finite() && (0.0..=max).contains(&v);
        (ok(self.waiting, MAX_COUNT)
            && ok(self.running, MAX_COUNT)
            && ok(self.uncached_tokens, MAX_TOKENS)
            && ok(self.kv_utilization, 1.5))
        .then(|| {
            [
                1.0,
                self.waiting,
                self.running,
                self.uncached_tokens * TOKEN_SCALE,
                self.kv_utilization.min(1.0),
            ]
        })
    }

    /// The regression vector with bad inputs replaced (NaN/negative → 0,
    /// too large → cap): a prediction is always produced.
    fn lenient(&self) -> [f64; DIM] {
        let fix = |v: f64, max: f64| if v.is_nan() { 0.0 } else { v.clamp(0.0, max) };
        [
            1.0,
            fix(self.waiting, MAX_COUNT),
            fix(self.running, MAX_COUNT),
            fix(self.uncached_tokens, MAX_TOKENS) * TOKEN_SCALE,
            fix(self.kv_utilization, 1.0),
        ]
    }
}

/// Model coefficients in natural units (seconds, seconds per request, seconds
/// per token).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftCoefficients {
    pub base: f64,
    pub per_queued: f64,
    pub per_running: f64,
    pub per_token: f64,
    pub per_kv: f64,
}

impl TtftCoefficients {
    fn to_internal(self) -> [f64; DIM] {
        [
            self.base,
            self.per_queued,
            self.per_running,
            self.per_token / TOKEN_SCALE,
            self.per_kv,
        ]
    }
    fn from_internal(t: &[f64; DIM]) -> Self {
        Self {
            base: t[0],
            per_queued: t[1],
            per_running: t[2],
            per_token: t[3] * TOKEN_SCALE,
            per_kv: t[4],
        }
    }
}

/// Tuning of [`TtftPredictor`]; [`Default`] holds the documented priors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftConfig {
    /// Starting coefficients.
    pub prior: TtftCoefficients,
    /// How far (1 σ) each coefficient may plausibly be from the prior; sets the
    /// initial covariance and the wind-up cap.
    pub prior_std: TtftCoefficients,
    /// Upper bounds of the coefficients.
    pub max: TtftCoefficients,
    /// Lower bounds: a queued or running request costs a little at least,
    /// and prefill is never faster than 100,000 tokens a second. Without
    /// them a fit reaches 0 on a pool whose TTFT barely moves with load
    /// until the batch is full (llm-d-inference-sim's does not at all), or
    /// from answers the prefix index wrongly counted as uncached (outliers
    /// above a prediction are clipped, below it they are not); every Pod
    /// then predicts the same TTFT for a new prefix, and the rank-order tie
    /// scatters the groups.
    pub min: TtftCoefficients,
    /// Expected TTFT noise as a share of the TTFT; scales the prior
    /// covariance and seeds the residual scale used for outlier clipping.
    pub relative_noise: f64,
    /// Predicted and observed TTFTs under this (s) weigh observations as if
    /// they were this long: below it the difference is timer and network
    /// noise, not the model's.
    pub weight_floor: f64,
    /// RLS forgetting factor (0.99 ≈ remembers the last ~100 samples).
    pub forgetting: f64,
    /// Samples an endpoint needs before its own model is used.
    pub min_endpoint_observations: u64,
    /// Observed TTFTs above this (s) are ignored; predictions are capped to it.
    pub max_ttft: f64,
}

impl Default for TtftConfig {
    fn default() -> Self {
        Self {
            prior: TtftCoefficients {
                base: 0.020,
                per_queued: 0.250,
                per_running: 0.005,
                per_token: 1.0 / 5000.0,
                per_kv: 0.0,
            },
            prior_std: TtftCoefficients {
                base: 0.1,
                per_queued: 0.5,
                per_running: 0.05,
                per_token: 5e-4,
                per_kv: 0.5,
            },
            max: TtftCoefficients {
                base: 10.0,
                per_queued: 60.0,
                per_running: 10.0,
                per_token: 0.01,
                per_kv: 60.0,
            },
            min: TtftCoefficients {
                base: 0.0,
                per_queued: 0.002,
                per_running: 0.001,
                per_token: 1.0 / 100_000.0,
                per_kv: 0.0,
            },
            relative_noise: 0.2,
            weight_floor: 0.002,
            forgetting: 0.99,
            min_endpoint_observations: 20,
            max_ttft: 600.0,
        }
    }
}

/// Derived constants shared by all models.
#[derive(Debug, Clone, Copy)]
struct Params {
    p0: [f64; DIM],
    min: [f64; DIM],
    max: [f64; DIM],
    lambda: f64,
    /// The prior's prefill cost (internal units).
    prefill_prior: f64,
    noise: f64,
    floor: f64,
    max_ttft: f64,
}

impl Params {
    fn new(c: &TtftConfig) -> Self {
        let noise = if c.relative_noise.is_finite() && c.relative_noise > 0.0 {
            c.relative_noise
        } else {
            0.2
        };
        let std = c.prior_std.to_internal();
        let mut p0 = [0.0; DIM];
        for i in 0..DIM {
            // P is the parameter covariance divided by the noise variance.
            let s = if std[i].is_finite() && std[i] > 0.0 {
                std[i]
            } else {
                1.0
            };
            p0[i] = (s / noise).powi(2);
        }
        let lambda = if (0.5..=1.0).contains(&c.forgetting) {
            c.forgetting
        } else {
            0.99
        };
        // A bound (or the prior's prefill cost) that is not a positive number is 0.
        let bound = |b: TtftCoefficients| {
            b.to_internal()
                .map(|m| if m.is_finite() && m > 0.0 { m } else { 0.0 })
        };
        let max = bound(c.max);
        let mut min = bound(c.min);
        for i in 0..DIM {
            min[i] = min[i].min(max[i]);
        }
        Self {
            p0,
            min,
            max,
            lambda,
            prefill_prior: bound(c.prior)[TOKEN],
            noise,
            floor: if c.weight_floor.is_finite() && c.weight_floor > 0.0 {
                c.weight_floor
            } else {
                0.002
            },
            max_ttft: if c.max_ttft.is_finite() && c.max_ttft > 0.0 {
                c.max_ttft
            } else {
                600.0
            },
        }
    }
}

#[derive(Debug, Clone)]
struct Rls {
    theta: [f64; DIM],
    p: [[f64; DIM]; DIM],
    resid_scale: f64,
    /// Running mean of the signed standardized residuals: near 0 for noise,
    /// however heavy its tails; near ±`resid_scale` after a shift.
    bias: f64,
    n: u64,
    /// Covariance restarts on a shift (for tests and debugging).
    resets: u64,
}

impl Rls {
    fn new(theta: [f64; DIM], prm: &Params) -> Self {
        let mut m = Self {
            theta,
            p: [[0.0; DIM]; DIM],
            resid_scale: prm.noise,
            bias: 0.0,
            n: 0,
            resets: 0,
        };
        m.reset_cov(prm);
        m.project(prm);
        m
    }

    fn reset_cov(&mut self, prm: &Params) {
        self.p = [[0.0; DIM]; DIM];
        for i in 0..DIM {
            self.p[i][i] = prm.p0[i];
        }
    }

    fn project(&mut self, prm: &Params) {
        for i in 0..DIM {
            self.theta[i] = if self.theta[i].is_finite() {
                self.theta[i].clamp(prm.min[i], prm.max[i])
            } else {
                prm.min[i]
            };
        }
    }

    fn predict(&self, x: &[f64; DIM]) -> f64 {
        self.theta.iter().zip(x).map(|(t, x)| t * x).sum()
    }

    /// `(P·x, xᵀ·P·x)`.
    fn gain(&self, x: &[f64; DIM]) -> ([f64; DIM], f64) {
        let mut px = [0.0; DIM];
        for (i, row) in self.p.iter().enumerate() {
            px[i] = row.iter().zip(x).map(|(p, x)| p * x).sum();
        }
        let xpx = x.iter().zip(&px).map(|(x, p)| x * p).sum::<f64>();
        (px, xpx)
    }

    /// One observation, as a relative error: the regressor and the target
    /// are divided by the predicted TTFT (at least the floor), in which unit
    /// the outlier clip and the shift detection judge it. Not by the observed
    /// one: after a slowdown the new, slower samples would then weigh less
    /// and less against the old fast ones, and the model would hardly move.
    /// The step's weight makes the error relative to the observed TTFT only
    /// for a sample slower than predicted by at most `OBSERVED_BAND`; every
    /// other sample weighs 1.
    fn update(&mut self, x: &[f64; DIM], y: f64, prm: &Params) {
        let scale = self.predict(x).max(prm.floor);
        let weight = observed_weight(scale, y.max(prm.floor));
        self.step(&x.map(|v| v / scale), y / scale, prm, weight);
    }

    /// One recursive-least-squares step towards `y` at `x`, the error
    /// weighted by `weight`: each part below is named for what it guards.
    fn step(&mut self, x: &[f64; DIM], y: f64, prm: &Params, weight: f64) {
        self.reset_after_a_shift(prm);
        let (mut free, mut xf) = self.regressors_excited(x, prm);
        // A weight w divides the noise's variance by w: λ/w in the step's
        // denominator.
        let lambda = prm.lambda / weight;
        let (px, xpx) = self.gain(&xf);
        // The clip and the residual scale judge the error unweighted, as the
        // spread an unweighted sample would have: the weight says only how
        // far the step follows it.
        let spread = (prm.lambda + xpx).sqrt();
        let denom = lambda + xpx;
        if !(denom.is_finite() && denom > 0.0 && spread.is_finite() && spread > 0.0) {
            self.reset_cov(prm);
            return;
        }
        let target = self.clipped_target(x, y, prm, spread);
        let (px, denom) =
            self.step_within_bounds(x, target, prm, lambda, (&mut free, &mut xf), (px, denom));
        // P ← (P − P x xᵀ P / denom) / λ over the free regressor, kept exactly
        // symmetric.
        for i in 0..DIM {
            for j in i..DIM {
                let v = (self.p[i][j] - px[i] * px[j] / denom) / prm.lambda;
                self.p[i][j] = v;
                self.p[j][i] = v;
            }
        }
        self.cap_variances(prm);
        self.project(prm);
        self.n += 1;
    }

    /// A shift: the residuals have stayed several times the expected noise,
    /// mostly on one side. The covariance the old data shrank would follow
    /// it only slowly (in relative terms an old, faster sample weighs more
    /// than a new, slower one), so the old data's confidence is dropped,
    /// not its estimate. Large residuals on both sides are noise (e.g.
    /// prefixes mislabelled either way) and leave it alone: a restart lets
    /// the next outlier move the model far.
    fn reset_after_a_shift(&mut self, prm: &Params) {
        if self.resid_scale > SHIFT_RESET * prm.noise && self.bias.abs() > 0.5 * self.resid_scale {
            self.reset_cov(prm);
            self.resid_scale = prm.noise;
            self.bias = 0.0;
            self.resets += 1;
        }
    }

    /// Which coefficients the sample at `x` takes part in, and its
    /// regressor with the others zeroed.
    ///
    /// The prefill cost is a property of the engine, seen only where the
    /// prefill is a real part of the TTFT. Elsewhere (a cached system
    /// prompt and a short question) it is tied to `base` and the load
    /// terms by the covariance, its variance (rarely excited) grows back
    /// to the prior, and one cached answer slowed by a queue the scrape
    /// did not show moved it to its floor in a single step; a Pod that
    /// looked able to prefill 6,000 tokens in 60 ms then drew every new
    /// prefix group and collapsed. So it takes no part in such samples.
    /// The share is judged at no less than the prior's cost: judged at an
    /// underestimate, true prefills would look small and never correct it.
    fn regressors_excited(&self, x: &[f64; DIM], prm: &Params) -> ([bool; DIM], [f64; DIM]) {
        let mut free = [true; DIM];
        let mut xf = *x;
        let cost = self.theta[TOKEN].max(prm.prefill_prior);
        let rest = self.predict(x) - self.theta[TOKEN] * x[TOKEN];
        if cost * x[TOKEN] < PREFILL_SHARE * (rest + cost * x[TOKEN]) {
            free[TOKEN] = false;
            xf[TOKEN] = 0.0;
        }
        (free, xf)
    }

    /// The value the step moves the prediction at `x` towards: `y`, its
    /// error clipped, and the residual scale and bias updated with it.
    ///
    /// The innovation's expected spread is σ·`spread` (σ = `resid_scale`):
    /// wide while the model is uncertain (so the prior is left quickly),
    /// ≈ σ once it has converged. The clip is at 4 such spreads
    /// (Huber-like), but never below 10% of the prediction (with a small
    /// configured noise the spreads could be).
    fn clipped_target(&mut self, x: &[f64; DIM], y: f64, prm: &Params, spread: f64) -> f64 {
        let pred = self.predict(x);
        let bound = (4.0 * self.resid_scale * spread).max(0.1 * pred.abs());
        let e = (y - pred).clamp(-bound, bound);
        // σ estimate from standardized clipped residuals. Clipped residuals
        // grow it by 15% per sample, so a genuine shift widens the clip within
        // a few dozen samples; the floor keeps a run of perfect samples from
        // making the clip so tight that the next real change is ignored.
        self.resid_scale = (0.95 * self.resid_scale + 0.05 * e.abs() / spread).max(prm.noise * 0.2);
        // Slower than the scale: a run of noise must not pass for a bias.
        self.bias = 0.99 * self.bias + 0.01 * e / spread;
        pred + e
    }

    /// Takes the step towards `target` with every coefficient within its
    /// bounds, by a small active set; returns the gain and denominator of
    /// the coefficients left free, for the covariance update.
    ///
    /// Take the RLS step; if it pushes coefficients out of bounds, pin them
    /// at the bound and redo the step with only the free coefficients
    /// explaining the observation. Simply clamping after the step would
    /// throw away the part of the correction that went into the clamped
    /// coefficient (e.g. a fast server vs. the prefill prior: the step
    /// drives per_token negative, the clamp restores most of the error, and
    /// the model stalls).
    fn step_within_bounds(
        &mut self,
        x: &[f64; DIM],
        target: f64,
        prm: &Params,
        lambda: f64,
        (free, xf): (&mut [bool; DIM], &mut [f64; DIM]),
        (mut px, mut denom): ([f64; DIM], f64),
    ) -> ([f64; DIM], f64) {
        let theta0 = self.theta;
        let mut theta = theta0;
        for _ in 0..=DIM {
            let r = target - theta.iter().zip(x).map(|(t, x)| t * x).sum::<f64>();
            let mut cand = theta;
            for i in 0..DIM {
                if free[i] {
                    cand[i] = theta0[i] + px[i] * r / denom;
                }
            }
            let mut pinned = false;
            for i in 0..DIM {
                let c = cand[i];
                if free[i] && !(prm.min[i]..=prm.max[i]).contains(&c) {
                    // Pin it: it no longer takes part in this observation.
                    theta[i] = if c.is_finite() {
                        c.clamp(prm.min[i], prm.max[i])
                    } else {
                        theta0[i]
                    };
                    free[i] = false;
                    xf[i] = 0.0;
                    pinned = true;
                }
            }
            if !pinned {
                theta = cand;
                break;
            }
            let xpx;
            (px, xpx) = self.gain(xf);
            denom = lambda + xpx;
        }
        self.theta = theta;
        (px, denom)
    }

    /// Anti-wind-up: caps each variance at its prior by scaling row and
    /// column i (D·P·D with D diagonal positive stays PSD). Resets on
    /// numerical trouble.
    fn cap_variances(&mut self, prm: &Params) {
        for i in 0..DIM {
            let d = self.p[i][i];
            if !(d.is_finite() && d > 0.0) {
                self.reset_cov(prm);
                break;
            }
            if d > prm.p0[i] {
                let s = (prm.p0[i] / d).sqrt();
                for j in 0..DIM {
                    self.p[i][j] *= s;
                    self.p[j][i] *= s;
                }
            }
        }
    }
}

/// The step's weight: `(predicted / observed)²` for a sample slower than
/// predicted by at most [`OBSERVED_BAND`] times, which turns its error
/// relative to the prediction into one relative to the observed TTFT; 1
/// otherwise.
fn observed_weight(predicted: f64, observed: f64) -> f64 {
    let ratio = predicted / observed;
    if (1.0 / OBSERVED_BAND..=1.0).contains(&ratio) {
        ratio * ratio
    } else {
        1.0
    }
}

/// One endpoint's own TTFT model, owned by its registry slot (created and
/// dropped with it). Starts empty; the first observation warm-starts it from
/// the global model.
#[derive(Default)]
pub struct EndpointTtft {
    rls: Mutex<Option<Rls>>,
}

/// Thread-safe online TTFT predictor (see the module doc): the shared global
/// model and the tuning; each endpoint's own model is an [`EndpointTtft`].
/// Predictions cost one short mutex hold and a 5-term dot product;
/// observations a 5×5 RLS step.
pub struct TtftPredictor {
    cfg: TtftConfig,
    prm: Params,
    global: Mutex<Rls>,
}

impl Default for TtftPredictor {
    fn default() -> Self {
        Self::new(TtftConfig::default())
    }
}

impl TtftPredictor {
    pub fn new(cfg: TtftConfig) -> Self {
        let prm = Params::new(&cfg);
        Self {
            global: Mutex::new(Rls::new(cfg.prior.to_internal(), &prm)),
            cfg,
            prm,
        }
    }

    pub fn config(&self) -> &TtftConfig {
        &self.cfg
    }

    /// Predicted TTFT in seconds, finite and within `[0, max_ttft]`. Uses the
    /// endpoint's own model once it has enough observations, else the global one.
    pub fn predict(&self, endpoint: &EndpointTtft, f: &TtftFeatures) -> f64 {
        let x = f.lenient();
        let own = lock(&endpoint.rls)
            .as_ref()
            .filter(|rls| rls.n >= self.cfg.min_endpoint_observations)
            .map(|rls| rls.predict(&x));
        let y = own.unwrap_or_else(|| lock(&self.global).predict(&x));
        if y.is_finite() {
            y.clamp(0.0, self.prm.max_ttft)
        } else {
            self.prm.max_ttft
        }
    }

    /// Learns from one served request: the features it was routed with and the
    /// TTFT observed (seconds). Invalid inputs are ignored.
    pub fn observe(&self, endpoint: &EndpointTtft, f: &TtftFeatures, observed_ttft: f64) {
        let Some(x) = f.strict() else { return };
        if !(observed_ttft.is_finite() && observed_ttft > 0.0 && observed_ttft <= self.prm.max_ttft)
        {
            return;
        }
        let warm_start = {
            let mut g = lock(&self.global);
            g.update(&x, observed_ttft, &self.prm);
            g.theta
        };
        lock(&endpoint.rls)
            .get_or_insert_with(|| Rls::new(warm_start, &self.prm))
            .update(&x, observed_ttft, &self.prm);
    }

    /// Coefficients currently used for `endpoint` (its own model once trained,
    /// else the global one), e.g. for debugging or metrics.
    pub(crate) fn coefficients(&self, endpoint: &EndpointTtft) -> TtftCoefficients {
        if let Some(rls) = lock(&endpoint.rls).as_ref()
            && rls.n >= self.cfg.min_endpoint_observations
        {
            return TtftCoefficients::from_internal(&rls.theta);
        }
        self.global_coefficients()
    }

    /// Global model coefficients.
    pub(crate) fn global_coefficients(&self) -> TtftCoefficients {
        TtftCoefficients::from_internal(&lock(&self.global).theta)
    }

    /// Valid observations recorded for `endpoint`.
    pub fn observations(&self, endpoint: &EndpointTtft) -> u64 {
        lock(&endpoint.rls).as_ref().map_or(0, |rls| rls.n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};
    use std::sync::Arc;

    #[derive(Clone, Copy)]
    struct Law {
        base: f64,
        q: f64,
        r: f64,
        tok_per_s: f64,
        kv: f64,
    }

    impl Law {
        fn ttft(&self, f: &TtftFeatures) -> f64 {
            self.base
                + self.q * f.waiting
                + self.r * f.running
                + f.uncached_tokens / self.tok_per_s
                + self.kv * f.kv_utilization
        }
    }

    const LAWS: [Law; 3] = [
        Law {
            base: 0.015,
            q: 0.10,
            r: 0.002,
            tok_per_s: 12_000.0,
            kv: 0.0,
        },
        Law {
            base: 0.030,
            q: 0.30,
            r: 0.006,
            tok_per_s: 5_000.0,
            kv: 0.05,
        },
        Law {
            base: 0.050,
            q: 0.60,
            r: 0.010,
            tok_per_s: 2_000.0,
            kv: 0.20,
        },
    ];

    fn features(rng: &mut StdRng) -> TtftFeatures {
        TtftFeatures {
            waiting: rng.random_range(0..12) as f64,
            running: rng.random_range(0..64) as f64,
            uncached_tokens: rng.random_range(0.0..16_000.0),
            kv_utilization: rng.random_range(0.0..1.0),
        }
    }

    fn gauss(rng: &mut StdRng) -> f64 {
        // Box–Muller.
        let u1: f64 = rng.random_range(f64::EPSILON..1.0);
        let u2: f64 = rng.random_range(0.0..1.0);
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    fn train(
        p: &TtftPredictor,
        m: &[EndpointTtft],
        rng: &mut StdRng,
        n: usize,
        noise: f64,
        outliers: bool,
    ) {
        for _ in 0..n {
            for (i, law) in LAWS.iter().enumerate() {
                let f = features(rng);
                let mut y = law.ttft(&f) + noise * gauss(rng);
                let mut f_obs = f;
                if outliers {
                    match rng.random_range(0..40) {
                        0 => y *= 30.0,
                        1 => y = f64::NAN,
                        2 => y = -1.0,
                        3 => f_obs.waiting = -3.0,
                        4 => f_obs.uncached_tokens = f64::NAN,
                        5 => f_obs.kv_utilization = f64::INFINITY,
                        6 => y = 0.0005, // a cache hit faster than the law
                        _ => {}
                    }
                }
                p.observe(&m[i], &f_obs, y);
            }
        }
    }

    fn mae(p: &TtftPredictor, m: &[EndpointTtft], rng: &mut StdRng) -> [f64; 3] {
        let mut out = [0.0; 3];
        for (i, law) in LAWS.iter().enumerate() {
            let n = 500;
            for _ in 0..n {
                let f = features(rng);
                out[i] += (p.predict(&m[i], &f) - law.ttft(&f)).abs() / n as f64;
            }
        }
        out
    }

    fn models(n: usize) -> Vec<EndpointTtft> {
        (0..n).map(|_| EndpointTtft::default()).collect()
    }

    #[test]
    fn priors_are_sane() {
        let p = TtftPredictor::default();
        let m = models(2);
        let f = TtftFeatures::new(0.0, 0.0, 5000.0, 0.0, 0.2);
        let y = p.predict(&m[1], &f);
        assert!((y - 1.02).abs() < 1e-9, "{y}");
        // Cached prefix lowers the prediction; queue raises it.
        let cached = TtftFeatures::new(0.0, 0.0, 5000.0, 4000.0, 0.2);
        assert!(p.predict(&m[1], &cached) < y);
        let queued = TtftFeatures::new(4.0, 0.0, 5000.0, 0.0, 0.2);
        assert!(p.predict(&m[1], &queued) > y);
        assert_eq!(
            TtftFeatures::new(0.0, 0.0, 10.0, 50.0, 0.0).uncached_tokens,
            0.0
        );
    }

    #[test]
    fn converges_and_ranks() {
        let mut rng = StdRng::seed_from_u64(1);
        let p = TtftPredictor::default();
        let m = models(3);
        let before = mae(&p, &m, &mut StdRng::seed_from_u64(99));
        train(&p, &m, &mut rng, 600, 0.02, false);
        let after = mae(&p, &m, &mut StdRng::seed_from_u64(99));
        for i in 0..3 {
            // Against the noise-free law (samples had σ = 20 ms noise); measured ≈ 1-3 ms.
            assert!(
                after[i] < 0.01,
                "endpoint {i}: mae {} (before {})",
                after[i],
                before[i]
            );
            assert!(
                after[i] < before[i] / 5.0,
                "endpoint {i}: {after:?} vs {before:?}"
            );
        }
        let c = p.coefficients(&m[2]);
        assert!((c.per_token * 2000.0 - 1.0).abs() < 0.05, "{c:?}");
        assert!((c.per_queued - 0.6).abs() < 0.05, "{c:?}");
        // Ranking matches the true ranking on fresh feature vectors, whenever
        // the true TTFTs differ by a meaningful margin.
        let mut checked = 0;
        for _ in 0..300 {
            let fs: Vec<TtftFeatures> = (0..3).map(|_| features(&mut rng)).collect();
            for a in 0..3 {
                for b in 0..3 {
                    let (ta, tb) = (LAWS[a].ttft(&fs[a]), LAWS[b].ttft(&fs[b]));
                    if ta + 0.1 < tb {
                        checked += 1;
                        let (pa, pb) = (p.predict(&m[a], &fs[a]), p.predict(&m[b], &fs[b]));
                        assert!(pa < pb, "rank {a}:{ta}/{pa} vs {b}:{tb}/{pb}");
                    }
                }
            }
        }
        assert!(checked > 500);
    }

    #[test]
    fn robust_to_outliers_and_garbage() {
        let mut rng = StdRng::seed_from_u64(2);
        let p = TtftPredictor::default();
        let m = models(3);
        train(&p, &m, &mut rng, 1000, 0.02, true);
        let after = mae(&p, &m, &mut StdRng::seed_from_u64(98));
        for (i, m) in after.iter().enumerate() {
            // Measured ≈ 3-21 ms with ~17% of the samples corrupted.
            assert!(*m < 0.05, "endpoint {i}: mae {m}");
        }
        // Garbage features still produce a finite, bounded prediction.
        let bad = TtftFeatures {
            waiting: f64::NAN,
            running: -5.0,
            uncached_tokens: f64::INFINITY,
            kv_utilization: 7.0,
        };
        let y = p.predict(&m[0], &bad);
        assert!(y.is_finite() && (0.0..=600.0).contains(&y));
        let c = p.global_coefficients();
        for v in [c.base, c.per_queued, c.per_running, c.per_token, c.per_kv] {
            assert!(v.is_finite() && v >= 0.0);
        }
    }

    #[test]
    fn global_model_until_enough_observations() {
        let p = TtftPredictor::new(TtftConfig {
            min_endpoint_observations: 10,
            ..Default::default()
        });
        let f = TtftFeatures::new(1.0, 2.0, 3000.0, 0.0, 0.5);
        let (fast, slow) = (&EndpointTtft::default(), &EndpointTtft::default());
        for _ in 0..9 {
            p.observe(fast, &f, 0.05);
        }
        assert_eq!(p.observations(fast), 9);
        assert_eq!(
            p.predict(fast, &f),
            p.predict(slow, &f),
            "both on the global model"
        );
        p.observe(fast, &f, 0.05);
        for _ in 0..40 {
            p.observe(slow, &f, 3.0);
        }
        assert!(p.predict(fast, &f) < 0.3, "{}", p.predict(fast, &f));
        assert!(p.predict(slow, &f) > 2.0, "{}", p.predict(slow, &f));
    }

    #[test]
    fn coefficients_stay_non_negative() {
        // Anti-correlated data (more queue, faster TTFT) must not drive
        // per_queued negative.
        let p = TtftPredictor::default();
        let m = models(2);
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..500 {
            let w = rng.random_range(0..10) as f64;
            let f = TtftFeatures::new(w, 0.0, 1000.0, 0.0, 0.0);
            p.observe(&m[1], &f, (2.0 - 0.15 * w).max(0.05));
        }
        let c = p.coefficients(&m[1]);
        assert!(
            c.per_queued >= 0.0 && c.per_token >= 0.0 && c.base >= 0.0,
            "{c:?}"
        );
    }

    /// A model that learnt 300 samples of `before`, then `n` of `after`.
    fn after_a_change(
        seed: u64,
        before: Law,
        after: Law,
        n: usize,
    ) -> (TtftPredictor, EndpointTtft) {
        let p = TtftPredictor::default();
        let mut rng = StdRng::seed_from_u64(seed);
        let e = EndpointTtft::default();
        for (law, samples) in [(before, 300), (after, n)] {
            for _ in 0..samples {
                let f = features(&mut rng);
                p.observe(&e, &f, law.ttft(&f));
            }
        }
        (p, e)
    }

    #[test]
    fn tracks_a_slowdown() {
        let fast = LAWS[0];
        let slow = Law {
            tok_per_s: 1500.0,
            ..fast
        };
        // λ = 0.99 remembers ~100 samples: after 300 the old law has faded.
        let (p, e) = after_a_change(4, fast, slow, 300);
        let resets = lock(&e.rls).as_ref().map_or(0, |r| r.resets);
        assert!(resets >= 1, "a slowdown is a shift: {resets} restarts");
        let f = TtftFeatures::new(0.0, 10.0, 8000.0, 0.0, 0.3);
        let y = p.predict(&e, &f);
        assert!(
            (y - slow.ttft(&f)).abs() < 0.1 * slow.ttft(&f),
            "{y} vs {}",
            slow.ttft(&f)
        );
    }

    /// The share of `samples` predicted within 25% of their TTFT.
    fn within_25(p: &TtftPredictor, e: &EndpointTtft, samples: &[(TtftFeatures, f64)]) -> f64 {
        let close = samples
            .iter()
            .filter(|(f, y)| (p.predict(e, f) - y).abs() <= 0.25 * y)
            .count();
        close as f64 / samples.len() as f64
    }

    /// A prefix-cached pool's requests: 90% find their prefix cached (a few
    /// dozen tokens to prefill), 10% prefill 3,600 tokens, so TTFT is 6–55 ms
    /// or about 1.5 s (llm-d-inference-sim's law: 5 ms + 0.4 ms a token, and
    /// 25 ms per request ahead in the queue), with 10% noise and 2 ms jitter.
    fn bimodal(rng: &mut StdRng) -> (TtftFeatures, f64) {
        let uncached = if rng.random_range(0..10) == 0 {
            3600.0
        } else {
            rng.random_range(2.0..60.0)
        };
        let waiting = if rng.random_range(0..5) == 0 {
            1.0
        } else {
            0.0
        };
        let f = TtftFeatures::new(waiting, rng.random_range(0..4) as f64, uncached, 0.0, 0.3);
        let law = 0.005 + 0.0004 * uncached + 0.025 * waiting;
        let y = law * (1.0 + 0.1 * gauss(rng)).max(0.5) + rng.random_range(0.0..0.002);
        (f, y)
    }

    #[test]
    fn bimodal_ttft_is_predicted_within_25_percent() {
        let mut rng = StdRng::seed_from_u64(5);
        let p = TtftPredictor::default();
        let e = &EndpointTtft::default();
        for _ in 0..400 {
            let (mut f, y) = bimodal(&mut rng);
            // 1 in 50 is mislabelled: the index thought the prefix cached
            // and it was not, or the other way round (a sixth of the
            // samples labelled as prefills).
            if rng.random_range(0..50) == 0 {
                f.uncached_tokens = 3600.0 - f.uncached_tokens;
            }
            p.observe(e, &f, y);
        }
        // Each mode on its own: the cached answers are 90% of the traffic,
        // and the prefills are the predictions that send a request away.
        let (cached, prefills): (Vec<_>, Vec<_>) = (0..2000)
            .map(|_| bimodal(&mut rng))
            .partition(|(f, _)| f.uncached_tokens < 1000.0);
        for (mode, samples) in [("cached", &cached), ("prefill", &prefills)] {
            let share = within_25(&p, e, samples);
            assert!(
                share >= 0.9,
                "{mode}: {share} of {} within 25%: {:?}",
                samples.len(),
                p.coefficients(e)
            );
        }
    }

    /// Cached answers: three in four at the law with 5% noise, one in four
    /// `tail` times it. The law is one constant (17 ms); the running count
    /// it ignores still moves the predictions by the model's minimum cost
    /// of a running request (1 ms each), which the shares below include.
    /// A loaded machine's tail is slower (a core the engine waited for, a
    /// queue the scrape missed): on the peer benchmark, answers alike in
    /// every input took 12/16/25 ms (p10/p50/p90). These tails are longer,
    /// so that a fit on the mean and one on the typical TTFT differ clearly.
    fn tailed(rng: &mut StdRng, tail: std::ops::Range<f64>) -> (TtftFeatures, f64) {
        let f = TtftFeatures::new(0.0, rng.random_range(0..4) as f64, 30.0, 0.0, 0.2);
        let law = 0.005 + 0.0004 * f.uncached_tokens;
        let y = if rng.random_range(0..4) == 0 {
            law * rng.random_range(tail)
        } else {
            law * (1.0 + 0.05 * gauss(rng))
        };
        (f, y)
    }

    /// The share of predictions within 25% after learning from `tailed`.
    fn within_25_of_tailed(tail: std::ops::Range<f64>) -> f64 {
        let mut rng = StdRng::seed_from_u64(8);
        let p = TtftPredictor::default();
        let e = &EndpointTtft::default();
        for _ in 0..1000 {
            let (f, y) = tailed(&mut rng, tail.clone());
            p.observe(e, &f, y);
        }
        let samples: Vec<_> = (0..2000).map(|_| tailed(&mut rng, tail.clone())).collect();
        within_25(&p, e, &samples)
    }

    #[test]
    fn a_slow_tail_does_not_lift_the_typical_prediction() {
        // The law is within 25% of three in four of these TTFTs; their
        // mean (1.3 times the law) of about one in five. The unweighted fit
        // (clipped, so a little below the mean) put 37% there.
        let share = within_25_of_tailed(1.4..3.0);
        assert!(share >= 0.65, "{share} within 25%");
    }

    #[test]
    fn a_fast_tail_does_not_drag_the_typical_prediction_down() {
        // Answers faster than their inputs say (a queue the scrape showed
        // that had drained): the law is within 25% of three in four. The
        // unweighted fit put 43% there, and fast samples weighed against
        // the observed TTFT 16%.
        let share = within_25_of_tailed(0.35..0.75);
        assert!(share >= 0.55, "{share} within 25%");
    }

    #[test]
    fn a_moderate_slowdown_is_followed() {
        let law = LAWS[1];
        // Every term 1.5 times as slow: not far enough to be a shift, so
        // followed by the fit alone, with these samples weighed at 0.44.
        // After 100 of them the unweighted fit was 9% short of the new law
        // and this one 13%; weighed at 0.04 (ratio⁸) it stayed 28% short.
        let slower = Law {
            base: law.base * 1.5,
            q: law.q * 1.5,
            r: law.r * 1.5,
            tok_per_s: law.tok_per_s / 1.5,
            kv: law.kv * 1.5,
        };
        let (p, e) = after_a_change(9, law, slower, 100);
        let resets = lock(&e.rls).as_ref().map_or(0, |r| r.resets);
        assert_eq!(resets, 0, "not a shift");
        let f = TtftFeatures::new(1.0, 10.0, 2000.0, 0.0, 0.3);
        let y = p.predict(&e, &f);
        assert!(
            (y - slower.ttft(&f)).abs() < 0.2 * slower.ttft(&f),
            "{y} vs {} (before: {})",
            slower.ttft(&f),
            law.ttft(&f)
        );
    }

    /// An idle queue, 0–3 running requests, and 40 tokens to prefill, or
    /// `prefill` tokens one time in ten.
    fn mostly_cached(rng: &mut StdRng, prefill: f64) -> TtftFeatures {
        let running = rng.random_range(0..4) as f64;
        let uncached = if rng.random_range(0..10) == 0 {
            prefill
        } else {
            40.0
        };
        TtftFeatures::new(0.0, running, uncached, 0.0, 0.0)
    }

    #[test]
    fn a_busier_pod_predicts_slower_even_where_load_costs_nothing() {
        // llm-d-inference-sim's law: the batch does not slow a prefill.
        let p = TtftPredictor::default();
        let e = &EndpointTtft::default();
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..500 {
            let f = mostly_cached(&mut rng, 3600.0);
            p.observe(e, &f, 0.005 + 0.0004 * f.uncached_tokens);
        }
        let idle = TtftFeatures::new(0.0, 0.0, 3600.0, 0.0, 0.0);
        let busy = TtftFeatures::new(0.0, 2.0, 3600.0, 0.0, 0.0);
        // Not a tie: a tie goes to the first Pod in rank order, every time.
        assert!(
            p.predict(e, &busy) > p.predict(e, &idle),
            "{:?}",
            p.coefficients(e)
        );
    }

    /// The bench's failure: a Pod holding every prefix, which the prefix
    /// index (wrongly) thinks cold for some requests, answers every one of
    /// those "6,000 uncached tokens" requests in cached time. The prefill
    /// cost must not fit to nothing: an idle Pod without the prefix still
    /// predicts slower than a busy one holding it.
    #[test]
    fn requests_mislabelled_as_uncached_do_not_make_prefill_free() {
        let p = TtftPredictor::default();
        let e = &EndpointTtft::default();
        let mut rng = StdRng::seed_from_u64(8);
        for _ in 0..2000 {
            let f = mostly_cached(&mut rng, 6000.0);
            p.observe(e, &f, 0.025 + 0.0004 * 40.0);
        }
        let cold = TtftFeatures::new(0.0, 0.0, 6000.0, 0.0, 0.0);
        let cached_and_busy = TtftFeatures::new(0.0, 4.0, 40.0, 0.0, 0.0);
        let (cold, busy) = (p.predict(e, &cold), p.predict(e, &cached_and_busy));
        assert!(cold >= 0.06, "{cold}: {:?}", p.coefficients(e));
        assert!(cold > busy, "{cold} vs {busy}: {:?}", p.coefficients(e));
    }

    /// A slow engine (2,000 tokens/s, far from the prior's 5,000).
    const SLOW_PREFILL: Law = Law {
        base: 0.008,
        q: 0.02,
        r: 0.001,
        tok_per_s: 2000.0,
        kv: 0.0,
    };

    /// A new prefix group on an idle Pod: what the model predicts, and the
    /// truth.
    fn cold_prefill(p: &TtftPredictor, e: &EndpointTtft) -> (f64, f64) {
        let cold = TtftFeatures::new(0.0, 0.0, 6000.0, 0.0, 0.2);
        (p.predict(e, &cold), SLOW_PREFILL.ttft(&cold))
    }

    /// A Pod holding a hot prefix group: most answers are cached (a short
    /// question to prefill), a few are new groups (6,000 tokens). Then its
    /// queue grows faster than the scrape shows it: cached answers take
    /// 50–200 ms where the features say idle. That is load, not prefill;
    /// the Pod must still be predicted slow to prefill a new group.
    #[test]
    fn a_queue_the_scrape_missed_does_not_make_prefill_cheap() {
        let law = SLOW_PREFILL;
        let p = TtftPredictor::default();
        let e = &EndpointTtft::default();
        let mut rng = StdRng::seed_from_u64(11);
        let sample = |rng: &mut StdRng| {
            let uncached = if rng.random_range(0..20) == 0 {
                6000.0
            } else {
                rng.random_range(0.0..80.0)
            };
            let running = rng.random_range(0..5) as f64;
            TtftFeatures::new(0.0, running, uncached, 0.0, 0.2)
        };
        for _ in 0..500 {
            let f = sample(&mut rng);
            p.observe(e, &f, law.ttft(&f));
        }
        let (learnt, truth) = cold_prefill(&p, e);
        assert!(
            (learnt / truth - 1.0).abs() < 0.25,
            "{learnt} against {truth}"
        );
        for _ in 0..200 {
            let mut f = sample(&mut rng);
            f.uncached_tokens = f.uncached_tokens.min(10.0);
            p.observe(e, &f, rng.random_range(0.05..0.2));
        }
        let (predicted, truth) = cold_prefill(&p, e);
        assert!(
            (0.75 * truth..1.5 * truth).contains(&predicted),
            "{predicted} against {truth}: {:?}",
            p.coefficients(e)
        );
    }

    /// The guard above judges the share at no less than the prior's cost: a
    /// prefill cost learnt far too low (here from answers mislabelled as
    /// cold on a busy Pod) would make a true prefill there look like a small
    /// share of its TTFT, and such samples must still raise it.
    #[test]
    fn an_underestimated_prefill_cost_is_corrected_by_true_prefills_on_a_busy_pod() {
        let law = Law {
            q: 0.08,
            ..SLOW_PREFILL
        };
        let p = TtftPredictor::default();
        let e = &EndpointTtft::default();
        let mut rng = StdRng::seed_from_u64(12);
        let busy = |rng: &mut StdRng| {
            let waiting = rng.random_range(4..9) as f64;
            let running = rng.random_range(0..5) as f64;
            let uncached = rng.random_range(3000.0..9000.0);
            TtftFeatures::new(waiting, running, uncached, 0.0, 0.2)
        };
        for _ in 0..300 {
            let f = busy(&mut rng);
            let cached = TtftFeatures {
                uncached_tokens: 0.0,
                ..f
            };
            p.observe(e, &f, law.ttft(&cached));
        }
        let cold = TtftFeatures::new(0.0, 0.0, 6000.0, 0.0, 0.2);
        let (low, truth) = (p.predict(e, &cold), law.ttft(&cold));
        assert!(low < 0.5 * truth, "the premise: {low} against {truth}");
        for _ in 0..300 {
            let f = busy(&mut rng);
            p.observe(e, &f, law.ttft(&f));
        }
        let recovered = p.predict(e, &cold);
        assert!(
            (recovered / truth - 1.0).abs() < 0.25,
            "{recovered} against {truth}: {:?}",
            p.coefficients(e)
        );
    }

    #[test]
    fn heavy_tailed_noise_on_both_sides_is_not_taken_for_a_shift() {
        let mut rng = StdRng::seed_from_u64(6);
        let p = TtftPredictor::default();
        let e = &EndpointTtft::default();
        let law = LAWS[1];
        for _ in 0..3000 {
            let f = features(&mut rng);
            // Every sample far off, as often too fast as too slow: twice
            // the law, or a fiftieth of it.
            let off = if rng.random_range(0..2) == 0 {
                2.0
            } else {
                0.02
            };
            p.observe(e, &f, law.ttft(&f) * off);
        }
        let rls = lock(&e.rls);
        let rls = rls.as_ref().unwrap();
        assert_eq!(
            rls.resets, 0,
            "residual scale {}, bias {}",
            rls.resid_scale, rls.bias
        );
    }

    #[test]
    fn concurrent_observe_and_predict() {
        let p = Arc::new(TtftPredictor::default());
        let m = Arc::new(models(3));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let (p, m) = (p.clone(), m.clone());
                std::thread::spawn(move || {
                    let mut rng = StdRng::seed_from_u64(t);
                    for _ in 0..2000 {
                        let f = features(&mut rng);
                        let k = rng.random_range(0..3);
                        p.observe(&m[k], &f, LAWS[k].ttft(&f));
                        assert!(p.predict(&m[k], &f).is_finite());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(m.iter().map(|e| p.observations(e)).sum::<u64>(), 8000);
    }
}
