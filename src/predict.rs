//! The predictor (SPEC §6): where fragmentation is heading. Input: the
//! metric rows of one process (its regular steps); output: a forecast of the
//! score for the next H steps with a cross-validated confidence, the trend,
//! a risk level, warnings, the two baselines the model must be compared
//! with, and an online backtest (what a live monitor would have said at
//! each step from the data it had).
//!
//! The model is SPEC §6's windowed linear model: z-scored features and
//! score of the last W steps (7·W values) → one linear model per horizon
//! step, trained by batch gradient descent on the mean squared error.
//! [`GradientDescent`] implements linfa's `Fit` and `PredictInplace`, so it
//! is used like any linfa model; ordinary least squares (linfa-linear) is
//! the second baseline. The gradient is computed from the Gram matrix XᵀX,
//! Xᵀy and the column sums — algebraically the same gradient as over the
//! samples, in O(d²) per iteration instead of O(n·d).

use linfa::prelude::*;
use linfa::traits::{Fit, PredictInplace};
use linfa_linear::LinearRegression;
use ndarray::{Array1, Array2, ArrayBase, Data, Ix2};
use serde::Serialize;

/// Columns of a step: E, K, S, C, L, U, score.
pub const COLUMNS: usize = 7;
pub type Step = [f64; COLUMNS];

/// Hyper-parameters and thresholds, all configurable from the command line.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PredictConfig {
    pub window: usize,
    pub horizon: usize,
    pub learning_rate: f64,
    pub max_iterations: usize,
    /// Early stop after this many iterations without a lower loss.
    pub patience: usize,
    pub trend_window: usize,
    pub cv_origins: usize,
    /// The online backtest retrains every this many steps.
    pub retrain_every: usize,
    pub deterioration: f64,
    pub min_confidence: f64,
    pub sharp_jump: f64,
    pub clear_trend: f64,
}

impl Default for PredictConfig {
    fn default() -> Self {
        PredictConfig {
            window: 5,
            horizon: 3,
            learning_rate: 0.01,
            max_iterations: 1000,
            patience: 20,
            trend_window: 20,
            cv_origins: 50,
            retrain_every: 10,
            deterioration: 5.0,
            min_confidence: 0.6,
            sharp_jump: 10.0,
            clear_trend: 0.3,
        }
    }
}

/// Risk levels, from the highest forecast score.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Risk {
    Minimal,
    Low,
    Medium,
    High,
    Critical,
}

impl Risk {
    /// Every level, lowest first.
    pub const ALL: [Risk; 5] = [Risk::Minimal, Risk::Low, Risk::Medium, Risk::High, Risk::Critical];

    pub fn of(score: f64) -> Risk {
        match score {
            s if s >= 80.0 => Risk::Critical,
            s if s >= 70.0 => Risk::High,
            s if s >= 50.0 => Risk::Medium,
            s if s >= 30.0 => Risk::Low,
            _ => Risk::Minimal,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Risk::Minimal => "minimal",
            Risk::Low => "low",
            Risk::Medium => "medium",
            Risk::High => "high",
            Risk::Critical => "critical",
        }
    }
}

// ---------------------------------------------------------------------------
// The gradient-descent linear model, linfa style.

/// Batch gradient descent on the mean squared error with gradient-norm
/// clipping and clamped parameters (SPEC §6 step 4). Start: all zeros.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradientDescent {
    pub learning_rate: f64,
    pub max_iterations: usize,
    pub patience: usize,
    /// Gradients with a larger Euclidean norm are scaled to this norm.
    pub max_gradient_norm: f64,
    /// Weights and bias are clamped to [−clamp, clamp] after each update.
    pub clamp: f64,
}

impl Default for GradientDescent {
    fn default() -> Self {
        GradientDescent { learning_rate: 0.01, max_iterations: 1000, patience: 20, max_gradient_norm: 1.0, clamp: 10.0 }
    }
}

/// A fitted model, with what happened during training (for tests and
/// diagnostics).
#[derive(Clone, Debug, PartialEq)]
pub struct FittedGradientDescent {
    pub weights: Array1<f64>,
    pub bias: f64,
    pub iterations: usize,
    pub stopped_early: bool,
    /// Iterations whose gradient was scaled down.
    pub clipped: usize,
    /// Whether any parameter hit the clamp.
    pub clamped: bool,
    pub final_loss: f64,
}

/// Sufficient statistics of a least-squares problem: XᵀX, Xᵀy, Σx, Σy,
/// Σy² and n. The mean squared error and its gradient depend on the data
/// only through these.
#[derive(Clone, Debug, PartialEq)]
pub struct GramStats {
    pub n: f64,
    pub gram: Array2<f64>,
    pub xty: Array1<f64>,
    pub sx: Array1<f64>,
    pub sy: f64,
    pub syy: f64,
}

impl GramStats {
    pub fn of<D: Data<Elem = f64>>(x: &ArrayBase<D, Ix2>, y: &Array1<f64>) -> GramStats {
        GramStats {
            n: x.nrows() as f64,
            gram: x.t().dot(x),
            xty: x.t().dot(y),
            sx: x.sum_axis(ndarray::Axis(0)),
            sy: y.sum(),
            syy: y.dot(y),
        }
    }
}

impl GradientDescent {
    /// Trains from the sufficient statistics. Each iteration evaluates the
    /// loss of the current parameters (for early stopping) and the
    /// gradient from the same A·w, then updates.
    pub fn fit_stats(&self, st: &GramStats) -> FittedGradientDescent {
        let (n, d) = (st.n, st.sx.len());
        let mut w = Array1::<f64>::zeros(d);
        let mut b = 0.0;
        let (mut best, mut since_best) = (f64::INFINITY, 0);
        let (mut iterations, mut stopped_early, mut clipped, mut clamped) = (0, false, 0, false);
        let loss = loop {
            let aw = st.gram.dot(&w);
            let sxw = st.sx.dot(&w);
            let loss = (w.dot(&aw) + 2.0 * b * sxw - 2.0 * st.xty.dot(&w) + n * b * b - 2.0 * b * st.sy + st.syy) / n;
            if loss < best {
                best = loss;
                since_best = 0;
            } else {
                since_best += 1;
                if since_best >= self.patience {
                    stopped_early = true;
                    break loss;
                }
            }
            if iterations == self.max_iterations {
                break loss;
            }
            // ∂/∂w = (2/n)(XᵀX w + b Σx − Xᵀy); ∂/∂b = (2/n)(Σxᵀw + n b − Σy).
            let mut gw = (aw + &(&st.sx * b) - &st.xty) * (2.0 / n);
            let mut gb = (sxw + n * b - st.sy) * (2.0 / n);
            let norm = (gw.dot(&gw) + gb * gb).sqrt();
            if norm > self.max_gradient_norm {
                let scale = self.max_gradient_norm / norm;
                gw *= scale;
                gb *= scale;
                clipped += 1;
            }
            w.zip_mut_with(&gw, |wi, gi| {
                let v = *wi - self.learning_rate * gi;
                clamped |= v.abs() > self.clamp;
                *wi = v.clamp(-self.clamp, self.clamp);
            });
            let nb = b - self.learning_rate * gb;
            clamped |= nb.abs() > self.clamp;
            b = nb.clamp(-self.clamp, self.clamp);
            iterations += 1;
        };
        FittedGradientDescent { final_loss: loss, weights: w, bias: b, iterations, stopped_early, clipped, clamped }
    }
}

impl<D: Data<Elem = f64>> Fit<ArrayBase<D, Ix2>, Array1<f64>, linfa::Error> for GradientDescent {
    type Object = FittedGradientDescent;

    fn fit(&self, dataset: &DatasetBase<ArrayBase<D, Ix2>, Array1<f64>>) -> Result<Self::Object, linfa::Error> {
        let (x, y) = (dataset.records(), dataset.targets());
        if x.nrows() == 0 || y.len() != x.nrows() {
            return Err(linfa::Error::NotEnoughSamples);
        }
        Ok(self.fit_stats(&GramStats::of(x, y)))
    }
}

impl<D: Data<Elem = f64>> PredictInplace<ArrayBase<D, Ix2>, Array1<f64>> for FittedGradientDescent {
    fn predict_inplace(&self, x: &ArrayBase<D, Ix2>, y: &mut Array1<f64>) {
        *y = x.dot(&self.weights) + self.bias;
    }

    fn default_target(&self, x: &ArrayBase<D, Ix2>) -> Array1<f64> {
        Array1::zeros(x.nrows())
    }
}

// ---------------------------------------------------------------------------
// The windowed forecaster.

/// Per-column z-score parameters fitted on a training range.
#[derive(Clone, Debug)]
struct Normalizer {
    mean: [f64; COLUMNS],
    std: [f64; COLUMNS],
}

impl Normalizer {
    fn fit(steps: &[Step]) -> Normalizer {
        let n = steps.len().max(1) as f64;
        let mut mean = [0.0; COLUMNS];
        let mut std = [0.0; COLUMNS];
        for c in 0..COLUMNS {
            mean[c] = steps.iter().map(|s| s[c]).sum::<f64>() / n;
            let var = steps.iter().map(|s| (s[c] - mean[c]).powi(2)).sum::<f64>() / n;
            std[c] = if var.sqrt() < 1e-8 { 1.0 } else { var.sqrt() };
        }
        Normalizer { mean, std }
    }

    fn apply(&self, s: &Step, c: usize) -> f64 {
        (s[c] - self.mean[c]) / self.std[c]
    }
}

/// Which model makes the forecast.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Learner {
    GradientDescent,
    LeastSquares,
}

/// OLS baseline training sets are cut to their latest samples beyond this
/// (solving it costs O(n·d²) at every origin).
const OLS_MAX_SAMPLES: usize = 5000;

/// Raw (not normalised) sufficient statistics of the windowed samples,
/// accumulated as the training range grows: a sample enters once, in
/// origin order, so the cross-validation and the backtest, whose training
/// sets are growing prefixes, pay O(d²) per sample once instead of per
/// training. The statistics of the z-scored problem follow algebraically.
struct Accumulator<'s> {
    series: &'s [Step],
    w: usize,
    h: usize,
    next: usize,
    n: f64,
    s: Array2<f64>,
    sx: Array1<f64>,
    sy: Vec<f64>,
    sxy: Array2<f64>,
    syy: Vec<f64>,
}

impl<'s> Accumulator<'s> {
    fn new(series: &'s [Step], w: usize, h: usize) -> Self {
        let d = COLUMNS * w;
        Accumulator {
            series,
            w,
            h,
            next: w - 1,
            n: 0.0,
            s: Array2::zeros((d, d)),
            sx: Array1::zeros(d),
            sy: vec![0.0; h],
            sxy: Array2::zeros((h, d)),
            syy: vec![0.0; h],
        }
    }

    /// Adds every sample whose targets lie at or before `upto`.
    fn advance(&mut self, upto: usize) {
        let d = COLUMNS * self.w;
        let mut x = vec![0.0; d];
        while self.next + self.h <= upto && self.next + self.h < self.series.len() {
            let t = self.next;
            for (j, step) in self.series[t + 1 - self.w..=t].iter().enumerate() {
                x[j * COLUMNS..(j + 1) * COLUMNS].copy_from_slice(step);
            }
            for a in 0..d {
                self.sx[a] += x[a];
                for b in a..d {
                    self.s[[a, b]] += x[a] * x[b];
                }
            }
            for k in 0..self.h {
                let y = self.series[t + 1 + k][COLUMNS - 1];
                self.sy[k] += y;
                self.syy[k] += y * y;
                for a in 0..d {
                    self.sxy[[k, a]] += y * x[a];
                }
            }
            self.n += 1.0;
            self.next += 1;
        }
    }

    /// The statistics of the z-scored problem for horizon step `k` (0-based).
    fn normalized(&self, norm: &Normalizer, k: usize) -> GramStats {
        let d = COLUMNS * self.w;
        let n = self.n;
        let (mu, sd): (Vec<f64>, Vec<f64>) = (0..d).map(|a| (norm.mean[a % COLUMNS], norm.std[a % COLUMNS])).unzip();
        let (ms, ss) = (norm.mean[COLUMNS - 1], norm.std[COLUMNS - 1]);
        let mut gram = Array2::zeros((d, d));
        for a in 0..d {
            for b in a..d {
                let v =
                    (self.s[[a, b]] - mu[a] * self.sx[b] - mu[b] * self.sx[a] + n * mu[a] * mu[b]) / (sd[a] * sd[b]);
                gram[[a, b]] = v;
                gram[[b, a]] = v;
            }
        }
        let xty = (0..d)
            .map(|a| (self.sxy[[k, a]] - mu[a] * self.sy[k] - ms * self.sx[a] + n * mu[a] * ms) / (sd[a] * ss))
            .collect();
        let sx = (0..d).map(|a| (self.sx[a] - n * mu[a]) / sd[a]).collect();
        GramStats {
            n,
            gram,
            xty,
            sx,
            sy: (self.sy[k] - n * ms) / ss,
            syy: (self.syy[k] - 2.0 * ms * self.sy[k] + n * ms * ms) / (ss * ss),
        }
    }
}

/// H fitted models and the normalisation they were trained with.
struct Forecaster {
    norm: Normalizer,
    models: Vec<Box<dyn Fn(&Array2<f64>) -> f64>>,
}

impl Forecaster {
    /// Trains on the samples whose targets all lie at or before `upto`
    /// (an index into `series`), with normalisation fitted on `series[..=upto]`.
    /// None if there are too few such samples.
    fn train(series: &[Step], upto: usize, cfg: &PredictConfig, learner: Learner) -> Option<Forecaster> {
        match learner {
            Learner::GradientDescent => {
                let mut acc = Accumulator::new(series, cfg.window, cfg.horizon);
                Forecaster::train_gd(&mut acc, upto, cfg)
            }
            Learner::LeastSquares => Forecaster::train_ols(series, upto, cfg),
        }
    }

    /// Gradient descent from an accumulator (advanced to `upto` here).
    fn train_gd(acc: &mut Accumulator, upto: usize, cfg: &PredictConfig) -> Option<Forecaster> {
        if cfg.window == 0 || upto + 1 > acc.series.len() {
            return None;
        }
        acc.advance(upto);
        if (acc.n as usize) < min_samples(cfg) {
            return None;
        }
        let norm = Normalizer::fit(&acc.series[..=upto]);
        let gd = GradientDescent {
            learning_rate: cfg.learning_rate,
            max_iterations: cfg.max_iterations,
            patience: cfg.patience,
            ..GradientDescent::default()
        };
        let models = (0..cfg.horizon)
            .map(|k| {
                let fitted = gd.fit_stats(&acc.normalized(&norm, k));
                Box::new(move |x: &Array2<f64>| fitted.predict(x)[0]) as Box<dyn Fn(&Array2<f64>) -> f64>
            })
            .collect();
        Some(Forecaster { norm, models })
    }

    /// Ordinary least squares (linfa-linear) on the materialised samples.
    fn train_ols(series: &[Step], upto: usize, cfg: &PredictConfig) -> Option<Forecaster> {
        let (w, h) = (cfg.window, cfg.horizon);
        let last_origin = upto.checked_sub(h)?;
        let first = w - 1;
        // Well determined only with clearly more samples than parameters.
        if last_origin < first || last_origin - first + 1 < 2 * (COLUMNS * w + 1) {
            return None;
        }
        let norm = Normalizer::fit(&series[..=upto]);
        let first = first.max((last_origin + 1).saturating_sub(OLS_MAX_SAMPLES));
        let origins: Vec<usize> = (first..=last_origin).collect();
        let x = design(series, &origins, &norm, w);
        let mut models: Vec<Box<dyn Fn(&Array2<f64>) -> f64>> = Vec::with_capacity(h);
        for k in 1..=h {
            let y: Array1<f64> = origins.iter().map(|&t| norm.apply(&series[t + k], COLUMNS - 1)).collect();
            let fitted = LinearRegression::new().fit(&Dataset::new(x.clone(), y)).ok()?;
            models.push(Box::new(move |x| fitted.predict(x)[0]));
        }
        Some(Forecaster { norm, models })
    }

    /// Scores for t+1 … t+H from the window ending at `t`, in score units.
    fn forecast(&self, series: &[Step], t: usize, w: usize) -> Vec<f64> {
        let x = design(series, &[t], &self.norm, w);
        let (mean, std) = (self.norm.mean[COLUMNS - 1], self.norm.std[COLUMNS - 1]);
        self.models.iter().map(|m| m(&x) * std + mean).collect()
    }
}

fn min_samples(cfg: &PredictConfig) -> usize {
    (cfg.window + cfg.horizon).max(8)
}

/// The design matrix: one row per origin t, the normalised columns of
/// steps t−W+1 … t.
fn design(series: &[Step], origins: &[usize], norm: &Normalizer, w: usize) -> Array2<f64> {
    let mut x = Array2::zeros((origins.len(), COLUMNS * w));
    for (r, &t) in origins.iter().enumerate() {
        for (j, step) in series[t + 1 - w..=t].iter().enumerate() {
            for c in 0..COLUMNS {
                x[[r, j * COLUMNS + c]] = norm.apply(step, c);
            }
        }
    }
    x
}

/// Cross-validated mean absolute errors, in score points.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct CvMae {
    pub model: f64,
    pub persistence: f64,
    /// NaN when OLS could not be fitted at any origin.
    pub ols: f64,
    pub origins: usize,
    /// Origins where OLS was fitted: it needs twice as many samples as the
    /// 7·W + 1 parameters it fits to be well determined, which early
    /// origins may not have.
    pub ols_origins: usize,
}

/// Rolling-origin cross-validation: at each origin t (at most
/// `cv_origins`, evenly spaced), models trained only on samples whose
/// targets end at or before t predict t+1 … t+H. Returns the errors of the
/// model, persistence and OLS, or None when no origin has enough history.
pub fn cross_validate(series: &[Step], cfg: &PredictConfig) -> Option<CvMae> {
    let (w, h) = (cfg.window, cfg.horizon);
    let n = series.len();
    let first = w - 1 + min_samples(cfg) - 1 + h;
    let last = n.checked_sub(h + 1)?;
    if first > last {
        return None;
    }
    let count = (last - first + 1).min(cfg.cv_origins.max(1));
    let origins: Vec<usize> =
        (0..count).map(|i| if count == 1 { last } else { first + i * (last - first) / (count - 1) }).collect();
    let (mut model, mut persistence, mut ols, mut m, mut mo, mut ols_origins) = (0.0, 0.0, 0.0, 0usize, 0usize, 0usize);
    let mut acc = Accumulator::new(series, w, h);
    for &t in &origins {
        let gd = Forecaster::train_gd(&mut acc, t, cfg)?;
        let ls = Forecaster::train(series, t, cfg, Learner::LeastSquares);
        let f = gd.forecast(series, t, w);
        let fo = ls.map(|l| l.forecast(series, t, w)).filter(|fo| fo.iter().all(|v| v.is_finite()));
        ols_origins += usize::from(fo.is_some());
        let score = |i: usize| series[i][COLUMNS - 1];
        for k in 1..=h {
            let actual = score(t + k);
            model += (f[k - 1] - actual).abs();
            persistence += (score(t) - actual).abs();
            if let Some(fo) = &fo {
                ols += (fo[k - 1] - actual).abs();
                mo += 1;
            }
            m += 1;
        }
    }
    let m = m as f64;
    let ols = if mo == 0 { f64::NAN } else { ols / mo as f64 };
    Some(CvMae { model: model / m, persistence: persistence / m, ols, origins: origins.len(), ols_origins })
}

/// Least-squares slope of the last `window` values against their index.
pub fn trend(values: &[f64], window: usize) -> f64 {
    let v = &values[values.len().saturating_sub(window.max(2))..];
    let n = v.len() as f64;
    if v.len() < 2 {
        return 0.0;
    }
    let mx = (n - 1.0) / 2.0;
    let my = v.iter().sum::<f64>() / n;
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (i, y) in v.iter().enumerate() {
        sxy += (i as f64 - mx) * (y - my);
        sxx += (i as f64 - mx).powi(2);
    }
    sxy / sxx
}

/// The prediction of one process.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prediction {
    pub window: usize,
    pub horizon: usize,
    /// None when there is not enough data (fewer than W + H + 1 steps).
    pub forecast: Option<Vec<f64>>,
    pub current: f64,
    pub confidence: Option<f64>,
    pub trend: f64,
    pub risk: Option<Risk>,
    pub warnings: Vec<String>,
    pub cv_mae: Option<CvMae>,
}

/// The online backtest of one process: per step, the forecasts and risk a
/// monitor would have reported from the data up to that step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Backtest {
    pub forecasts: Vec<Option<Vec<f64>>>,
    pub risk: Vec<Option<Risk>>,
}

/// Everything SPEC §6 asks of one series.
pub fn predict(series: &[Step], cfg: &PredictConfig) -> Prediction {
    let scores: Vec<f64> = series.iter().map(|s| s[COLUMNS - 1]).collect();
    let current = scores.last().copied().unwrap_or(0.0);
    let trend = trend(&scores, cfg.trend_window);
    let mut p = Prediction {
        window: cfg.window,
        horizon: cfg.horizon,
        forecast: None,
        current,
        confidence: None,
        trend,
        risk: None,
        warnings: Vec::new(),
        cv_mae: None,
    };
    if cfg.window == 0 || cfg.horizon == 0 || series.len() < cfg.window + cfg.horizon + 1 {
        return p;
    }
    let Some(model) = Forecaster::train(series, series.len() - 1, cfg, Learner::GradientDescent) else {
        return p;
    };
    let forecast: Vec<f64> =
        model.forecast(series, series.len() - 1, cfg.window).into_iter().map(|v| v.clamp(0.0, 100.0)).collect();
    let cv = cross_validate(series, cfg);
    // Without a cross-validation origin the model is unproven: lowest confidence.
    let confidence = cv.map_or(0.1, |cv| (1.0 - cv.model / 50.0).max(0.1));
    let highest = forecast.iter().copied().fold(f64::MIN, f64::max);
    if forecast.iter().any(|f| f - current > cfg.deterioration) && confidence > cfg.min_confidence {
        p.warnings.push(format!(
            "significant deterioration: the score is forecast to rise from {current:.1} to {highest:.1} (confidence {confidence:.2})"
        ));
    }
    if let Some(w) = forecast.windows(2).find(|w| w[1] - w[0] > cfg.sharp_jump) {
        p.warnings.push(format!("sharp deterioration: consecutive forecasts jump from {:.1} to {:.1}", w[0], w[1]));
    }
    if trend.abs() > cfg.clear_trend {
        let dir = if trend > 0.0 { "rising" } else { "falling" };
        p.warnings.push(format!("clear trend: the score is {dir} by {:.2} points per step", trend.abs()));
    }
    p.risk = Some(Risk::of(highest));
    p.forecast = Some(forecast);
    p.confidence = Some(confidence);
    p.cv_mae = cv;
    p
}

/// Steps between retrainings of the online backtest: `retrain_every`, but
/// at most about 200 retrainings over the series (long series with fine
/// steps would otherwise retrain tens of thousands of times).
pub fn retrain_interval(cfg: &PredictConfig, steps: usize) -> usize {
    cfg.retrain_every.max(steps.div_ceil(200)).max(1)
}

/// The online backtest: at each step t, the forecast from a model trained
/// on data up to the last retraining point ≤ t (see [`retrain_interval`]),
/// using only steps ≤ t.
pub fn backtest(series: &[Step], cfg: &PredictConfig) -> Backtest {
    let n = series.len();
    let mut out = Backtest { forecasts: vec![None; n], risk: vec![None; n] };
    if cfg.window == 0 || cfg.horizon == 0 {
        return out;
    }
    let every = retrain_interval(cfg, n);
    let mut acc = Accumulator::new(series, cfg.window, cfg.horizon);
    let mut model: Option<Forecaster> = None;
    for t in 0..n {
        if (t % every == 0 || model.is_none())
            && let Some(m) = Forecaster::train_gd(&mut acc, t, cfg)
        {
            model = Some(m);
        }
        if let Some(m) = &model {
            let f: Vec<f64> = m.forecast(series, t, cfg.window).into_iter().map(|v| v.clamp(0.0, 100.0)).collect();
            out.risk[t] = Some(Risk::of(f.iter().copied().fold(f64::MIN, f64::max)));
            out.forecasts[t] = Some(f);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::array;

    fn constant_series(n: usize, score: f64) -> Vec<Step> {
        (0..n).map(|_| [0.2, 0.1, 0.3, 0.4, 0.1, 0.6, score]).collect()
    }

    #[test]
    fn gradient_descent_approaches_the_closed_form() {
        // y = 0.5 x1 − 0.25 x2 + 0.1, noiseless.
        let x = array![[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.5], [0.5, -1.0], [2.0, 1.0], [-0.5, -0.5]];
        let y: Array1<f64> = x.rows().into_iter().map(|r| 0.5 * r[0] - 0.25 * r[1] + 0.1).collect();
        let ds = Dataset::new(x.clone(), y.clone());
        let gd = GradientDescent { max_iterations: 20_000, learning_rate: 0.05, ..Default::default() };
        let fit = gd.fit(&ds).unwrap();
        let ols = LinearRegression::new().fit(&ds).unwrap();
        assert!((fit.weights[0] - 0.5).abs() < 1e-3, "{:?}", fit.weights);
        assert!((fit.weights[1] + 0.25).abs() < 1e-3);
        assert!((fit.bias - 0.1).abs() < 1e-3);
        assert!((ols.params()[0] - 0.5).abs() < 1e-9);
        let pred = fit.predict(&x);
        assert!(pred.iter().zip(y.iter()).all(|(p, t)| (p - t).abs() < 1e-3));
    }

    #[test]
    fn gram_gradient_equals_the_sample_gradient_path() {
        // One step of plain sample-wise GD from zero equals ours.
        let x = array![[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]];
        let y = array![1.0, -2.0, 0.25];
        let ds = Dataset::new(x.clone(), y.clone());
        let gd = GradientDescent { max_iterations: 1, max_gradient_norm: 1e9, ..Default::default() };
        let fit = gd.fit(&ds).unwrap();
        let n = 3.0;
        let gw0 = -(2.0 / n) * (1.0 * 1.0 + 3.0 * -2.0 + 0.5 * 0.25);
        let gw1 = -(2.0 / n) * (2.0 * 1.0 + -1.0 * -2.0 + 0.5 * 0.25);
        let gb = -(2.0 / n) * (1.0 - 2.0 + 0.25);
        assert!((fit.weights[0] + 0.01 * gw0).abs() < 1e-12);
        assert!((fit.weights[1] + 0.01 * gw1).abs() < 1e-12);
        assert!((fit.bias + 0.01 * gb).abs() < 1e-12);
    }

    #[test]
    fn clipping_clamping_and_early_stopping_are_observable() {
        // Huge targets: gradients clipped every step, parameters clamped.
        let x = array![[1.0], [2.0], [3.0]];
        let y = array![1000.0, 2000.0, 3000.0];
        let gd = GradientDescent { learning_rate: 1.0, max_iterations: 200, ..Default::default() };
        let fit = gd.fit(&Dataset::new(x, y)).unwrap();
        assert_eq!(fit.clipped, fit.iterations);
        assert!(fit.clamped);
        assert!(fit.weights[0] <= 10.0 && fit.bias <= 10.0);
        assert_eq!(fit.weights[0], 10.0);
        // Perfectly fitted already (y = 0): the loss never improves on the
        // start, so training stops after `patience` iterations.
        let x = array![[1.0], [2.0]];
        let fit = GradientDescent::default().fit(&Dataset::new(x, array![0.0, 0.0])).unwrap();
        assert!(fit.stopped_early);
        assert_eq!(fit.iterations, 20);
    }

    #[test]
    fn insufficient_data_gives_no_model() {
        let cfg = PredictConfig::default();
        let p = predict(&constant_series(cfg.window + cfg.horizon, 40.0), &cfg);
        assert_eq!(p.forecast, None);
        assert_eq!(p.risk, None);
        assert!(backtest(&constant_series(3, 40.0), &cfg).risk.iter().all(Option::is_none));
    }

    #[test]
    fn constant_series_is_confident_and_risk_matches_its_level() {
        let cfg = PredictConfig::default();
        for (score, risk) in [(10.0, Risk::Minimal), (55.0, Risk::Medium), (85.0, Risk::Critical)] {
            let p = predict(&constant_series(120, score), &cfg);
            let f = p.forecast.unwrap();
            assert!(f.iter().all(|v| (v - score).abs() < 0.5), "{f:?}");
            assert!(p.confidence.unwrap() > 0.95);
            assert_eq!(p.risk, Some(risk));
            assert!(p.warnings.is_empty(), "{:?}", p.warnings);
        }
    }

    #[test]
    fn on_a_rising_trend_the_model_beats_persistence() {
        let cfg = PredictConfig::default();
        let series: Vec<Step> = (0..200)
            .map(|i| {
                let e = i as f64 / 400.0;
                let score = 10.0 + 0.4 * i as f64;
                [e, 0.2, 0.3, 0.5, 0.1 + e / 2.0, 0.9 - e, score]
            })
            .collect();
        let p = predict(&series, &cfg);
        let cv = p.cv_mae.unwrap();
        assert!(cv.model < cv.persistence, "{cv:?}");
        assert!(p.trend > 0.39 && p.trend < 0.41);
        assert!(p.warnings.iter().any(|w| w.starts_with("clear trend")));
    }

    #[test]
    fn cross_validation_never_sees_the_future_of_an_origin() {
        // Two series equal up to step 60, wildly different afterwards: a
        // forecaster trained up to an origin ≤ 60 − H must not differ.
        let cfg = PredictConfig::default();
        let base: Vec<Step> =
            (0..120).map(|i| [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 20.0 + (i as f64 * 0.7).sin() * 5.0]).collect();
        let mut other = base.clone();
        for s in &mut other[61..] {
            *s = [0.9, 0.9, 0.9, 3.0, 0.9, 0.1, 99.0];
        }
        for upto in [30, 45, 60] {
            let a = Forecaster::train(&base, upto, &cfg, Learner::GradientDescent).unwrap();
            let b = Forecaster::train(&other, upto, &cfg, Learner::GradientDescent).unwrap();
            assert_eq!(a.forecast(&base, upto, cfg.window), b.forecast(&other, upto, cfg.window));
        }
        // And the backtest at t only uses steps ≤ t.
        let ba = backtest(&base, &cfg);
        let bb = backtest(&other, &cfg);
        assert_eq!(ba.forecasts[..=60], bb.forecasts[..=60]);
    }

    #[test]
    fn trend_is_the_least_squares_slope() {
        let v: Vec<f64> = (0..30).map(|i| 3.0 + 0.5 * i as f64).collect();
        assert!((trend(&v, 20) - 0.5).abs() < 1e-12);
        assert_eq!(trend(&[4.0], 20), 0.0);
    }

    #[test]
    fn risk_levels() {
        assert_eq!(Risk::of(80.0), Risk::Critical);
        assert_eq!(Risk::of(79.9), Risk::High);
        assert_eq!(Risk::of(50.0), Risk::Medium);
        assert_eq!(Risk::of(30.0), Risk::Low);
        assert_eq!(Risk::of(29.9), Risk::Minimal);
    }
}
