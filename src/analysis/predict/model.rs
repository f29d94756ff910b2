//! SPEC §6's model: the windowed inputs ([`Inputs`]), their z-scoring
//! ([`Normalizer`]), the sufficient statistics accumulated as the training
//! range grows ([`Accumulator`]), batch gradient descent with clipping,
//! clamping and early stopping ([`GradientDescent`], a linfa model), and
//! the H fitted linear maps that forecast ([`Forecaster`]).

use linfa::prelude::*;
use linfa::traits::{Fit, PredictInplace};
use ndarray::{Array1, Array2, ArrayBase, Data, Ix2};

use super::baselines::{RidgeFactor, seasonal_index};
use super::linalg::{GramStats, dot};
use super::series::{COLUMNS, PredictConfig, Step};

/// Batch gradient descent on the mean squared error with gradient-norm
/// clipping and clamped parameters (SPEC §6 step 4). Start: all zeros.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradientDescent {
    pub learning_rate: f64,
    pub max_iterations: usize,
    pub patience: usize,
    /// A fall of the watched loss smaller than this share of the loss at
    /// the last real fall counts toward `patience` (0: any fall resets it).
    pub tolerance: f64,
    /// Gradients with a larger Euclidean norm are scaled to this norm.
    pub max_gradient_norm: f64,
    /// Weights and bias are clamped to [−clamp, clamp] after each update.
    pub clamp: f64,
}

impl Default for GradientDescent {
    fn default() -> Self {
        GradientDescent {
            learning_rate: 0.01,
            max_iterations: 1000,
            patience: 20,
            tolerance: 0.0,
            max_gradient_norm: 1.0,
            clamp: 10.0,
        }
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

impl GradientDescent {
    /// Trains from the sufficient statistics. Each iteration evaluates the
    /// loss of the current parameters (for early stopping) and the
    /// gradient from the same A·w, then updates.
    pub fn fit_stats(&self, st: &GramStats) -> FittedGradientDescent {
        self.fit_monitored(st, None, None)
    }

    /// Trains on `st`; with `held_out`, early stopping watches the loss on
    /// those samples instead of the training loss, and the parameters with
    /// the lowest held-out loss are returned.
    pub fn fit_monitored(
        &self,
        st: &GramStats,
        held_out: Option<&GramStats>,
        start: Option<(&Array1<f64>, f64)>,
    ) -> FittedGradientDescent {
        let (n, d) = (st.n, st.sx.len());
        let (mut w, mut b) = match start {
            Some((w, b)) if w.len() == d => (w.to_vec(), b),
            _ => (vec![0.0; d], 0.0),
        };
        let (mut best, mut since_best) = (f64::INFINITY, 0);
        // The loss at the last fall of more than `tolerance` of it.
        let mut anchor = f64::INFINITY;
        // The parameters with the lowest held-out loss. While they are the
        // current ones (`current_is_best`), the next update is written to
        // `spare` and the buffers rotate, instead of copying w each time
        // the loss falls.
        let (mut kept_w, mut kept_b, mut spare) = (w.clone(), b, vec![0.0; d]);
        let mut current_is_best = false;
        let (mut iterations, mut stopped_early, mut clipped, mut clamped) = (0, false, 0, false);
        // The products of each iteration with the training rows and the
        // held-out ones are the whole cost; the rest is O(d) on plain
        // slices (ndarray's iterators did not vectorise) and reuses these
        // buffers. Each product ends with Σxᵀw and (Xᵀy)ᵀw. Every
        // operation is the one ndarray did, in its order.
        let train = st.rows();
        let check = held_out.map(|v| (v, v.rows()));
        let (sx, xty) = (st.sx.to_vec(), st.xty.to_vec());
        let (mut aw, mut vw, mut gw) = (vec![0.0; d + 2], vec![0.0; d + 2], vec![0.0; d]);
        let loss = loop {
            train.times(&w, &mut aw);
            let sxw = aw[d];
            let loss = match &check {
                Some((v, rows)) => {
                    rows.times(&w, &mut vw);
                    v.loss(b, dot(&w, &vw[..d]), vw[d], vw[d + 1])
                }
                None => st.loss(b, dot(&w, &aw[..d]), sxw, aw[d + 1]),
            };
            let fell = loss < best;
            if fell {
                best = loss;
                if held_out.is_some() {
                    current_is_best = true;
                    kept_b = b;
                }
            }
            if fell && loss < anchor * (1.0 - self.tolerance) {
                anchor = loss;
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
            let two_n = 2.0 / n;
            for (((g, &a), &s), &t) in gw.iter_mut().zip(&aw[..d]).zip(&sx).zip(&xty) {
                *g = (a + s * b - t) * two_n;
            }
            let mut gb = (sxw + n * b - st.sy) * two_n;
            let norm = (dot(&gw, &gw) + gb * gb).sqrt();
            if norm > self.max_gradient_norm {
                let scale = self.max_gradient_norm / norm;
                gw.iter_mut().for_each(|g| *g *= scale);
                gb *= scale;
                clipped += 1;
            }
            if current_is_best {
                for ((next, &wi), &gi) in spare.iter_mut().zip(&w).zip(&gw) {
                    let v = wi - self.learning_rate * gi;
                    clamped |= v.abs() > self.clamp;
                    *next = v.clamp(-self.clamp, self.clamp);
                }
                std::mem::swap(&mut kept_w, &mut w);
                std::mem::swap(&mut w, &mut spare);
                current_is_best = false;
            } else {
                for (wi, &gi) in w.iter_mut().zip(&gw) {
                    let v = *wi - self.learning_rate * gi;
                    clamped |= v.abs() > self.clamp;
                    *wi = v.clamp(-self.clamp, self.clamp);
                }
            }
            let nb = b - self.learning_rate * gb;
            clamped |= nb.abs() > self.clamp;
            b = nb.clamp(-self.clamp, self.clamp);
            iterations += 1;
        };
        let (loss, w, b) = match held_out {
            Some(_) if current_is_best => (best, w, b),
            Some(_) => (best, kept_w, kept_b),
            None => (loss, w, b),
        };
        let w = Array1::from(w);
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

/// Each input's mean and std, from [`Inputs::column_norms`].
pub(super) type ColumnNorms = (Vec<f64>, Vec<f64>);

/// Per-column z-score parameters fitted on a training range.
#[derive(Clone, Debug)]
pub(super) struct Normalizer {
    pub(super) mean: [f64; COLUMNS],
    pub(super) std: [f64; COLUMNS],
}

impl Normalizer {
    pub(super) fn fit(steps: &[Step]) -> Normalizer {
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
}

/// Raw (not normalised) sufficient statistics of windowed samples.
#[derive(Clone)]
pub(super) struct Sums {
    pub(super) n: f64,
    pub(super) s: Array2<f64>,
    pub(super) sx: Array1<f64>,
    pub(super) sy: Vec<f64>,
    pub(super) sxy: Array2<f64>,
    pub(super) syy: Vec<f64>,
}

impl Sums {
    pub(super) fn new(d: usize, h: usize) -> Sums {
        Sums {
            n: 0.0,
            s: Array2::zeros((d, d)),
            sx: Array1::zeros(d),
            sy: vec![0.0; h],
            sxy: Array2::zeros((h, d)),
            syy: vec![0.0; h],
        }
    }

    /// Adds one sample: the window `x` and its H targets.
    pub(super) fn add(&mut self, x: &[f64], ys: &[f64]) {
        let d = x.len();
        for a in 0..d {
            self.sx[a] += x[a];
            for b in a..d {
                self.s[[a, b]] += x[a] * x[b];
            }
        }
        for (k, &y) in ys.iter().enumerate() {
            self.sy[k] += y;
            self.syy[k] += y * y;
            for a in 0..d {
                self.sxy[[k, a]] += y * x[a];
            }
        }
        self.n += 1.0;
    }

    /// The statistics of the samples in `self` but not in `head` (a prefix).
    pub(super) fn minus(&self, head: &Sums) -> Sums {
        Sums {
            n: self.n - head.n,
            s: &self.s - &head.s,
            sx: &self.sx - &head.sx,
            sy: self.sy.iter().zip(&head.sy).map(|(a, b)| a - b).collect(),
            sxy: &self.sxy - &head.sxy,
            syy: self.syy.iter().zip(&head.syy).map(|(a, b)| a - b).collect(),
        }
    }

    /// The std of horizon step `k`'s target (1 when it is constant).
    pub(super) fn target_scale(&self, k: usize) -> f64 {
        let ms = self.sy[k] / self.n;
        let sd = (self.syy[k] / self.n - ms * ms).max(0.0).sqrt();
        if sd < 1e-8 { 1.0 } else { sd }
    }

    /// The statistics of the z-scored problem for each horizon step k
    /// (0-based), the target divided by `scales[k]`: features z-scored
    /// with `norm`, the target (the score's change over k + 1 steps) not
    /// centred, so that all-zero parameters mean "no change". The horizon
    /// steps share their samples, so XᵀX and Σx are computed once.
    pub(super) fn normalized(&self, (mu, sd): &(Vec<f64>, Vec<f64>), scales: &[f64]) -> Vec<GramStats> {
        let d = self.sx.len();
        let n = self.n;
        let mut gram = Array2::zeros((d, d));
        for a in 0..d {
            for b in a..d {
                let v =
                    (self.s[[a, b]] - mu[a] * self.sx[b] - mu[b] * self.sx[a] + n * mu[a] * mu[b]) / (sd[a] * sd[b]);
                gram[[a, b]] = v;
                gram[[b, a]] = v;
            }
        }
        let sx: Array1<f64> = (0..d).map(|a| (self.sx[a] - n * mu[a]) / sd[a]).collect();
        scales
            .iter()
            .enumerate()
            .map(|(k, &scale)| {
                let xty = (0..d).map(|a| (self.sxy[[k, a]] - mu[a] * self.sy[k]) / (sd[a] * scale)).collect();
                let (gram, sx) = (gram.clone(), sx.clone());
                GramStats { n, gram, xty, sx, sy: self.sy[k] / scale, syy: self.syy[k] / (scale * scale) }
            })
            .collect()
    }
}

/// What the linear maps see at an origin t: the seven columns of steps
/// t−W+1 … t, and, when the iteration period p is known, for each horizon
/// step k the change the seasonal baseline forecasts (the score at the
/// same phase one period earlier, minus the score at t; 0 before one
/// period of history). A window of W steps cannot tell where in an
/// iteration of p > W steps it stands; with these inputs the model can
/// learn how far to follow the seasonal pattern, and with weight 0 on
/// them it is SPEC §6's model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Inputs {
    pub(super) w: usize,
    pub(super) h: usize,
    pub(super) period: Option<usize>,
}

impl Inputs {
    /// A period below one step, or as long as the series, gives nothing.
    pub(super) fn new(cfg: &PredictConfig, period: Option<usize>, n: usize) -> Inputs {
        Inputs { w: cfg.window, h: cfg.horizon, period: period.filter(|&p| p >= 1 && p < n) }
    }

    pub(super) fn width(&self) -> usize {
        COLUMNS * self.w + if self.period.is_some() { self.h } else { 0 }
    }

    /// The raw (not normalised) inputs of origin `t`.
    pub(super) fn raw(&self, series: &[Step], t: usize, x: &mut [f64]) {
        for (j, step) in series[t + 1 - self.w..=t].iter().enumerate() {
            x[j * COLUMNS..(j + 1) * COLUMNS].copy_from_slice(step);
        }
        if let Some(p) = self.period {
            let now = series[t][COLUMNS - 1];
            for k in 1..=self.h {
                x[COLUMNS * self.w + k - 1] = seasonal_index(t, k, p).map_or(0.0, |i| series[i][COLUMNS - 1] - now);
            }
        }
    }

    /// The (mean, std) input column `a` is z-scored with: its step
    /// column's, and for a seasonal change the score's std, not centred
    /// (a change of two z-scored scores).
    pub(super) fn column_norms(&self, norm: &Normalizer) -> ColumnNorms {
        (0..self.width())
            .map(|a| {
                if a < COLUMNS * self.w {
                    (norm.mean[a % COLUMNS], norm.std[a % COLUMNS])
                } else {
                    (0.0, norm.std[COLUMNS - 1])
                }
            })
            .unzip()
    }
}

/// The sufficient statistics of the windowed samples, accumulated as the
/// training range grows: a sample enters once, in origin order, so the
/// cross-validation and the backtest, whose training sets are growing
/// prefixes, pay O(d²) per sample once instead of per training. The
/// statistics of the z-scored problem follow algebraically.
///
/// `head` holds the samples before the held-out tail the model's early
/// stopping watches (the last fifth of the samples, see [`held_out`]).
pub(super) struct Accumulator<'s> {
    pub(super) series: &'s [Step],
    pub(super) inputs: Inputs,
    pub(super) all: Sums,
    pub(super) head: Sums,
}

/// How many of `n` training samples (the latest) are held out for early
/// stopping: a fifth, when there are enough for both parts.
pub(super) fn held_out(n: usize, cfg: &PredictConfig) -> usize {
    if n >= 2 * min_samples(cfg) { n / 5 } else { 0 }
}

impl<'s> Accumulator<'s> {
    pub(super) fn new(series: &'s [Step], inputs: Inputs) -> Self {
        let (d, h) = (inputs.width(), inputs.h);
        Accumulator { series, inputs, all: Sums::new(d, h), head: Sums::new(d, h) }
    }

    /// The inputs and targets of the sample with origin `t`.
    pub(super) fn sample(&self, t: usize, x: &mut [f64], ys: &mut [f64]) {
        self.inputs.raw(self.series, t, x);
        for (k, y) in ys.iter_mut().enumerate() {
            // The target is the change from the last step's score.
            *y = self.series[t + 1 + k][COLUMNS - 1] - self.series[t][COLUMNS - 1];
        }
    }

    /// Adds every sample whose targets lie at or before `upto`, and moves
    /// the head to all but the last `held` of them (`held` may only make
    /// the head grow).
    pub(super) fn advance(&mut self, upto: usize, cfg: &PredictConfig) {
        let mut x = vec![0.0; self.inputs.width()];
        let mut ys = vec![0.0; self.inputs.h];
        let first = self.inputs.w - 1;
        loop {
            let t = first + self.all.n as usize;
            if t + self.inputs.h > upto || t + self.inputs.h >= self.series.len() {
                break;
            }
            self.sample(t, &mut x, &mut ys);
            self.all.add(&x, &ys);
        }
        let n = self.all.n as usize;
        let head = n - held_out(n, cfg);
        while (self.head.n as usize) < head {
            self.sample(first + self.head.n as usize, &mut x, &mut ys);
            self.head.add(&x, &ys);
        }
    }
}

/// One fitted linear map of the z-scored window, and the scale its output
/// is turned back into a score change with.
#[derive(Clone, Debug)]
pub(super) struct Linear {
    pub(super) weights: Array1<f64>,
    pub(super) bias: f64,
    pub(super) scale: f64,
}

/// H fitted linear models, and the inputs and normalisation they were
/// trained with.
pub(super) struct Forecaster {
    pub(super) norm: Normalizer,
    pub(super) inputs: Inputs,
    pub(super) models: Vec<Linear>,
}

impl Forecaster {
    /// Advances the accumulator to `upto` and fits the normalisation on
    /// `series[..=upto]`: what every training at `upto` shares. None if
    /// there are too few samples.
    pub(super) fn prepare(
        acc: &mut Accumulator,
        upto: usize,
        cfg: &PredictConfig,
    ) -> Option<(Normalizer, ColumnNorms)> {
        if cfg.window == 0 || upto + 1 > acc.series.len() {
            return None;
        }
        acc.advance(upto, cfg);
        if (acc.all.n as usize) < min_samples(cfg) {
            return None;
        }
        let norm = Normalizer::fit(&acc.series[..=upto]);
        let cols = acc.inputs.column_norms(&norm);
        Some((norm, cols))
    }

    /// Trains the model on the samples whose targets all lie at or before
    /// `upto` (an index into `series`), with normalisation fitted on
    /// `series[..=upto]` (the accumulator is advanced to `upto` here).
    /// Gradient descent runs on all but the latest fifth of them and stops
    /// where its error on that fifth stops falling ([`held_out`]). None if
    /// there are too few samples.
    pub(super) fn train(
        acc: &mut Accumulator,
        upto: usize,
        cfg: &PredictConfig,
        start: Option<&Forecaster>,
    ) -> Option<Forecaster> {
        let (norm, cols) = Self::prepare(acc, upto, cfg)?;
        let gd = GradientDescent {
            learning_rate: cfg.learning_rate,
            max_iterations: cfg.max_iterations,
            patience: cfg.patience,
            tolerance: cfg.tolerance,
            ..GradientDescent::default()
        };
        let tail = (acc.head.n < acc.all.n).then(|| acc.all.minus(&acc.head));
        let scales: Vec<f64> = (0..cfg.horizon).map(|k| acc.all.target_scale(k)).collect();
        let (fit, check) = match &tail {
            Some(tail) => (acc.head.normalized(&cols, &scales), Some(tail.normalized(&cols, &scales))),
            None => (acc.all.normalized(&cols, &scales), None),
        };
        let mut models = Vec::with_capacity(cfg.horizon);
        for (k, (st, &scale)) in fit.iter().zip(&scales).enumerate() {
            let from = start.and_then(|f| f.models.get(k)).map(|m| (&m.weights, m.bias));
            let fitted = gd.fit_monitored(st, check.as_ref().map(|c| &c[k]), from);
            models.push(Linear { weights: fitted.weights, bias: fitted.bias, scale });
        }
        let mut f = Forecaster { norm, inputs: acc.inputs, models };
        if tail.is_some() {
            f.no_harm(acc);
        }
        Some(f)
    }

    /// The ridge baseline at `upto`, one per penalty (λ = that × the
    /// number of samples), fitted on all the samples whose targets lie at
    /// or before `upto`; the penalties share the normalisation and the
    /// statistics. None for a penalty whose fit is not finite at some
    /// horizon step; all None if there are too few samples.
    pub(super) fn train_ridges(
        acc: &mut Accumulator,
        upto: usize,
        cfg: &PredictConfig,
        penalties: &[f64],
    ) -> Vec<Option<Forecaster>> {
        let Some((norm, cols)) = Self::prepare(acc, upto, cfg) else {
            return penalties.iter().map(|_| None).collect();
        };
        let scales: Vec<f64> = (0..cfg.horizon).map(|k| acc.all.target_scale(k)).collect();
        let sts = acc.all.normalized(&cols, &scales);
        let models = penalties.iter().map(|c| {
            let first = sts.first()?;
            let factor = RidgeFactor::of(first, c * first.n)?;
            sts.iter()
                .zip(&scales)
                .map(|(st, &scale)| factor.solve(st).map(|(weights, bias)| Linear { weights, bias, scale }))
                .collect::<Option<Vec<Linear>>>()
        });
        models.map(|m| m.map(|models| Forecaster { norm: norm.clone(), inputs: acc.inputs, models })).collect()
    }

    /// "Do no harm": a horizon step whose forecasts of the held-out
    /// samples (see [`held_out`]) are, in mean absolute error, no better
    /// than "no change" is set to no change (all-zero parameters). On the
    /// flat, spiky scores of real single-step snapshots a linear fit of 35
    /// inputs otherwise chases noise.
    pub(super) fn no_harm(&mut self, acc: &Accumulator) {
        let first = acc.inputs.w - 1;
        let h = self.models.len();
        let (mut model, mut none) = (vec![0.0; h], vec![0.0; h]);
        for t in first + acc.head.n as usize..first + acc.all.n as usize {
            let f = self.forecast(acc.series, t);
            let last = acc.series[t][COLUMNS - 1];
            for k in 0..h {
                let y = acc.series[t + 1 + k][COLUMNS - 1];
                model[k] += (f[k] - y).abs();
                none[k] += (last - y).abs();
            }
        }
        for (k, m) in self.models.iter_mut().enumerate() {
            if model[k] >= none[k] {
                m.weights.fill(0.0);
                m.bias = 0.0;
            }
        }
    }

    /// Scores for t+1 … t+H from the inputs of origin `t`, in score units.
    pub(super) fn forecast(&self, series: &[Step], t: usize) -> Vec<f64> {
        let mut raw = vec![0.0; self.inputs.width()];
        self.inputs.raw(series, t, &mut raw);
        let (mu, sd) = self.inputs.column_norms(&self.norm);
        let x: Array1<f64> = (0..raw.len()).map(|a| (raw[a] - mu[a]) / sd[a]).collect();
        let last = series[t][COLUMNS - 1];
        self.models.iter().map(|m| last + (x.dot(&m.weights) + m.bias) * m.scale).collect()
    }
}

pub(super) fn min_samples(cfg: &PredictConfig) -> usize {
    (cfg.window + cfg.horizon).max(8)
}
