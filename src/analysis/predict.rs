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
//! When the iteration period is known, the inputs also hold, per horizon
//! step, the change the seasonal baseline forecasts (z-scored with the
//! score's std; see [`Inputs`]): W steps cannot tell where in a longer
//! iteration they stand. With zero weight on them it is SPEC §6's model.
//! It predicts the *change* of the score from the last step, divided by
//! its std but not centred, so all-zero parameters mean persistence ("no
//! change") and gradient descent starts from there.
//!
//! Where SPEC §6 leaves room, the model is trained as a careful
//! practitioner would, to stop it chasing noise (issue: verdicts a
//! PyTorch user can trust):
//! - **Early stopping on held-out samples.** The latest fifth of the
//!   training samples (when there are at least twice the minimum) is held
//!   out; gradient descent runs on the rest, "the loss" of the 20-iteration
//!   patience rule is the held-out loss, and the parameters with the lowest
//!   held-out loss are kept. Without enough samples, the training loss.
//! - **Do no harm.** A horizon step whose held-out forecasts are, in mean
//!   absolute error, no better than "no change" is set to no change.
//! - **Warm starts.** The model is trained in one pass over the series, at
//!   every point the cross-validation, the online backtest and the final
//!   forecast need ([`run`]); each training starts from the previous one's
//!   parameters. This and the shared trainings halve the predictor's cost.
//!
//! Every training, held-out part included, only sees samples whose
//! targets lie at or before its step.
//! [`GradientDescent`] implements linfa's `Fit` and `PredictInplace`, so it
//! is used like any linfa model. The gradient is computed from the Gram
//! matrix XᵀX, Xᵀy and the column sums — algebraically the same gradient
//! as over the samples, in O(d²) per iteration instead of O(n·d).
//!
//! The forecasters compared by the same rolling-origin cross-validation:
//! - the model;
//! - persistence: the score stays as it is;
//! - seasonal: the score one iteration period earlier (when iterations
//!   are known and span at least one step);
//! - ridge: a *stable* least-squares fit of the same windowed problem,
//!   `(XᵀX + λI)⁻¹Xᵀy` with λ chosen by the cross-validation, solved by
//!   Cholesky (the system is 7·W + 1 wide and positive definite; a
//!   hand-written solve avoids a LAPACK system dependency). Plain OLS blew
//!   up to 10¹⁵ on the collinear windows of real snapshots.
//!
//! The forecaster with the lowest cross-validated MAE makes the headline
//! forecast and the risk ([`Prediction::forecaster`]); its skill is
//! 1 − MAE / MAE(persistence). The online backtest stays the model's.

use linfa::prelude::*;
use linfa::traits::{Fit, PredictInplace};
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

impl GramStats {
    /// The mean squared error of `X·w + b`, given `waw` = wᵀXᵀX·w,
    /// `sxw` = Σxᵀw and `xtyw` = (Xᵀy)ᵀw.
    fn loss(&self, b: f64, waw: f64, sxw: f64, xtyw: f64) -> f64 {
        (waw + 2.0 * b * sxw - 2.0 * xtyw + self.n * b * b - 2.0 * b * self.sy + self.syy) / self.n
    }

    /// The rows whose products with w the gradient and the loss need:
    /// XᵀX, then Σxᵀ and (Xᵀy)ᵀ.
    fn rows(&self) -> Columns {
        Columns::of(&self.gram, &[&self.sx, &self.xty])
    }
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
            if loss < best {
                best = loss;
                since_best = 0;
                if held_out.is_some() {
                    current_is_best = true;
                    kept_b = b;
                }
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

/// ndarray's dot product of two slices (its eight partial sums, in its
/// order).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    ndarray::ArrayView1::from(a).dot(&ndarray::ArrayView1::from(b))
}

/// A square matrix laid out for the matrix–vector product of every
/// gradient-descent iteration: rows in blocks of `lanes`, each block
/// stored column by column (rows padded with zeros). The product works on
/// one block at a time, a lane per row: each lane computes its row's dot
/// product in exactly the order of ndarray's `dot` (eight partial sums,
/// combined as ndarray combines them, then the rest), so the result is
/// bit for bit `matrix.dot(w)` — without its latency-bound sums of one row
/// at a time, and without an allocation. Lanes only do IEEE adds and
/// multiplies (Rust never fuses them), so the result is also the same
/// whichever vector width the CPU offers; the width is picked at run time.
struct Columns {
    d: usize,
    lanes: usize,
    data: Vec<f64>,
}

impl Columns {
    /// The rows of `m`, then the `extra` rows.
    fn of(m: &Array2<f64>, extra: &[&Array1<f64>]) -> Columns {
        Self::with_lanes(m, extra, if wide_vectors() { 8 } else { 4 })
    }

    fn with_lanes(m: &Array2<f64>, extra: &[&Array1<f64>], lanes: usize) -> Columns {
        let (rows, cols) = m.dim();
        let d = rows + extra.len();
        let mut data = vec![0.0; d.div_ceil(lanes) * lanes * cols];
        let all = m.rows().into_iter().chain(extra.iter().map(|e| e.view()));
        for (r, row) in all.enumerate() {
            for (c, &v) in row.iter().enumerate() {
                data[(r / lanes * cols + c) * lanes + r % lanes] = v;
            }
        }
        Columns { d, lanes, data }
    }

    /// `out = M · w` (one value per row), bit for bit as ndarray computes
    /// each row's `dot`.
    fn times(&self, w: &[f64], out: &mut [f64]) {
        debug_assert_eq!(out.len(), self.d);
        if w.is_empty() {
            // No inputs: every row's dot product is ndarray's empty sum.
            out.fill(0.0);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: each is called only when the CPU has the features it
            // is compiled for.
            if self.lanes == 8 && wide_vectors() {
                return unsafe { blocks_avx512(&self.data, w, out) };
            }
            if self.lanes == 4 && std::arch::is_x86_feature_detected!("avx") {
                return unsafe { blocks_avx::<4>(&self.data, w, out) };
            }
        }
        match self.lanes {
            8 => blocks::<8>(&self.data, w, out),
            _ => blocks::<4>(&self.data, w, out),
        }
    }
}

/// Whether 8 doubles fit one vector register (AVX-512).
fn wide_vectors() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`blocks_of`] for 8 lanes, written with AVX-512 intrinsics: the same
/// multiplies and adds per lane in the same order, but the eight partial
/// sums stay in registers (the generic code, compiled for AVX-512, kept
/// them on the stack: a load and a store around most adds), and a short
/// last block is stored through a mask instead of a `memcpy` call.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn blocks_avx512(data: &[f64], w: &[f64], out: &mut [f64]) {
    use std::arch::x86_64::*;
    let cols = w.len();
    let full = cols / 8 * 8;
    debug_assert!(data.len() >= out.len().div_ceil(8) * 8 * cols);
    for (block, rows) in data.chunks_exact(cols * 8).zip(out.chunks_mut(8)) {
        let a = block.as_ptr();
        // SAFETY (every load below): column c of the block is the 8 values
        // at a + 8c, and c < cols, so they lie inside `block`.
        let column = |c: usize| unsafe { _mm512_loadu_pd(a.add(c * 8)) };
        let mut p = [_mm512_setzero_pd(); 8];
        for (c, x) in (0..full).step_by(8).zip(w.chunks_exact(8)) {
            for i in 0..8 {
                p[i] = _mm512_add_pd(p[i], _mm512_mul_pd(column(c + i), _mm512_set1_pd(x[i])));
            }
        }
        let mut sum = _mm512_setzero_pd();
        for i in 0..4 {
            sum = _mm512_add_pd(sum, _mm512_add_pd(p[i], p[i + 4]));
        }
        for (c, &x) in w.iter().enumerate().skip(full) {
            sum = _mm512_add_pd(sum, _mm512_mul_pd(column(c), _mm512_set1_pd(x)));
        }
        // SAFETY: the mask writes the first rows.len() (≤ 8) values only.
        let mask = ((1u16 << rows.len()) - 1) as u8;
        unsafe { _mm512_mask_storeu_pd(rows.as_mut_ptr(), mask, sum) };
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn blocks_avx<const L: usize>(data: &[f64], w: &[f64], out: &mut [f64]) {
    blocks::<L>(data, w, out)
}

/// The product of [`Columns`], `L` rows at a time. The input widths of
/// the default window (7·5 columns, and 3 seasonal inputs with a known
/// period) get code compiled for their width: the loops unroll fully and
/// the tail of fewer than 8 columns runs without a branch per column
/// (it was a fifth of the product's time). Same operations, same order.
#[inline(always)]
fn blocks<const L: usize>(data: &[f64], w: &[f64], out: &mut [f64]) {
    match w.len() {
        35 => blocks_of::<L>(data, w, out, 35),
        38 => blocks_of::<L>(data, w, out, 38),
        cols => blocks_of::<L>(data, w, out, cols),
    }
}

#[inline(always)]
fn blocks_of<const L: usize>(data: &[f64], w: &[f64], out: &mut [f64], cols: usize) {
    let w = &w[..cols];
    let full = cols / 8 * 8;
    for (block, rows) in data.chunks_exact(cols * L).zip(out.chunks_mut(L)) {
        let (head, rest) = block.split_at(full * L);
        let mut p = [[0.0f64; L]; 8];
        for (chunk, x) in head.chunks_exact(8 * L).zip(w.chunks_exact(8)) {
            for (i, p) in p.iter_mut().enumerate() {
                let a = &chunk[i * L..(i + 1) * L];
                for l in 0..L {
                    p[l] += a[l] * x[i];
                }
            }
        }
        let mut sum = [0.0f64; L];
        for i in 0..4 {
            for l in 0..L {
                sum[l] += p[i][l] + p[i + 4][l];
            }
        }
        for (a, &x) in rest.chunks_exact(L).zip(&w[full..]) {
            for l in 0..L {
                sum[l] += a[l] * x;
            }
        }
        match rows.len() {
            n if n == L => rows.copy_from_slice(&sum),
            n => rows.copy_from_slice(&sum[..n]),
        }
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
type ColumnNorms = (Vec<f64>, Vec<f64>);

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
}

/// Raw (not normalised) sufficient statistics of windowed samples.
#[derive(Clone)]
struct Sums {
    n: f64,
    s: Array2<f64>,
    sx: Array1<f64>,
    sy: Vec<f64>,
    sxy: Array2<f64>,
    syy: Vec<f64>,
}

impl Sums {
    fn new(d: usize, h: usize) -> Sums {
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
    fn add(&mut self, x: &[f64], ys: &[f64]) {
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
    fn minus(&self, head: &Sums) -> Sums {
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
    fn target_scale(&self, k: usize) -> f64 {
        let ms = self.sy[k] / self.n;
        let sd = (self.syy[k] / self.n - ms * ms).max(0.0).sqrt();
        if sd < 1e-8 { 1.0 } else { sd }
    }

    /// The statistics of the z-scored problem for each horizon step k
    /// (0-based), the target divided by `scales[k]`: features z-scored
    /// with `norm`, the target (the score's change over k + 1 steps) not
    /// centred, so that all-zero parameters mean "no change". The horizon
    /// steps share their samples, so XᵀX and Σx are computed once.
    fn normalized(&self, (mu, sd): &(Vec<f64>, Vec<f64>), scales: &[f64]) -> Vec<GramStats> {
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
struct Inputs {
    w: usize,
    h: usize,
    period: Option<usize>,
}

impl Inputs {
    /// A period below one step, or as long as the series, gives nothing.
    fn new(cfg: &PredictConfig, period: Option<usize>, n: usize) -> Inputs {
        Inputs { w: cfg.window, h: cfg.horizon, period: period.filter(|&p| p >= 1 && p < n) }
    }

    fn width(&self) -> usize {
        COLUMNS * self.w + if self.period.is_some() { self.h } else { 0 }
    }

    /// The raw (not normalised) inputs of origin `t`.
    fn raw(&self, series: &[Step], t: usize, x: &mut [f64]) {
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
    fn column_norms(&self, norm: &Normalizer) -> ColumnNorms {
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
struct Accumulator<'s> {
    series: &'s [Step],
    inputs: Inputs,
    all: Sums,
    head: Sums,
}

/// How many of `n` training samples (the latest) are held out for early
/// stopping: a fifth, when there are enough for both parts.
fn held_out(n: usize, cfg: &PredictConfig) -> usize {
    if n >= 2 * min_samples(cfg) { n / 5 } else { 0 }
}

impl<'s> Accumulator<'s> {
    fn new(series: &'s [Step], inputs: Inputs) -> Self {
        let (d, h) = (inputs.width(), inputs.h);
        Accumulator { series, inputs, all: Sums::new(d, h), head: Sums::new(d, h) }
    }

    /// The inputs and targets of the sample with origin `t`.
    fn sample(&self, t: usize, x: &mut [f64], ys: &mut [f64]) {
        self.inputs.raw(self.series, t, x);
        for (k, y) in ys.iter_mut().enumerate() {
            // The target is the change from the last step's score.
            *y = self.series[t + 1 + k][COLUMNS - 1] - self.series[t][COLUMNS - 1];
        }
    }

    /// Adds every sample whose targets lie at or before `upto`, and moves
    /// the head to all but the last `held` of them (`held` may only make
    /// the head grow).
    fn advance(&mut self, upto: usize, cfg: &PredictConfig) {
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
struct Linear {
    weights: Array1<f64>,
    bias: f64,
    scale: f64,
}

/// H fitted linear models, and the inputs and normalisation they were
/// trained with.
struct Forecaster {
    norm: Normalizer,
    inputs: Inputs,
    models: Vec<Linear>,
}

impl Forecaster {
    /// Advances the accumulator to `upto` and fits the normalisation on
    /// `series[..=upto]`: what every training at `upto` shares. None if
    /// there are too few samples.
    fn prepare(acc: &mut Accumulator, upto: usize, cfg: &PredictConfig) -> Option<(Normalizer, ColumnNorms)> {
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
    fn train(
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
    fn train_ridges(
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
    fn no_harm(&mut self, acc: &Accumulator) {
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
    fn forecast(&self, series: &[Step], t: usize) -> Vec<f64> {
        let mut raw = vec![0.0; self.inputs.width()];
        self.inputs.raw(series, t, &mut raw);
        let (mu, sd) = self.inputs.column_norms(&self.norm);
        let x: Array1<f64> = (0..raw.len()).map(|a| (raw[a] - mu[a]) / sd[a]).collect();
        let last = series[t][COLUMNS - 1];
        self.models.iter().map(|m| last + (x.dot(&m.weights) + m.bias) * m.scale).collect()
    }
}

/// Ridge regression from the z-scored sufficient statistics: weights and
/// an unpenalised bias solving `[[XᵀX + λI, Σx], [Σxᵀ, n]] · [w; b] =
/// [Xᵀy; Σy]` by Cholesky. The matrix depends only on the inputs, so the
/// horizon steps share one factor ([`RidgeFactor::of`]) and each solves
/// its own right-hand side ([`RidgeFactor::solve`]).
struct RidgeFactor {
    /// L stored column by column (`c[k·m + i]` = L[i][k], lower triangle).
    c: Vec<f64>,
    m: usize,
}

impl RidgeFactor {
    /// Cholesky A = L·Lᵀ in place, A = [[XᵀX + λI, Σx], [Σxᵀ, n]]. The
    /// updates of one column run over contiguous rows and vectorise; every
    /// entry sees the same operations in the same order as the textbook
    /// row loop. None when A is not (numerically) positive definite:
    /// nothing stable to report.
    fn of(st: &GramStats, lambda: f64) -> Option<RidgeFactor> {
        let d = st.sx.len();
        let m = d + 1;
        let mut c = vec![0.0; m * m];
        for j in 0..d {
            for i in j..d {
                c[j * m + i] = st.gram[[i, j]];
            }
            c[j * m + j] += lambda;
            c[j * m + d] = st.sx[j];
        }
        c[d * m + d] = st.n;
        for j in 0..m {
            let mut diag = c[j * m + j];
            for k in 0..j {
                diag -= c[k * m + j] * c[k * m + j];
            }
            if !(diag > 1e-12 * (1.0 + c[j * m + j].abs())) {
                return None;
            }
            let l = diag.sqrt();
            let (done, column) = c.split_at_mut(j * m);
            column[j] = l;
            let below = &mut column[j + 1..m];
            for k in 0..j {
                let (ljk, lk) = (done[k * m + j], &done[k * m + j + 1..k * m + m]);
                for (v, &lik) in below.iter_mut().zip(lk) {
                    *v -= lik * ljk;
                }
            }
            for v in below {
                *v /= l;
            }
        }
        Some(RidgeFactor { c, m })
    }

    /// Weights and bias for the right-hand side [Xᵀy; Σy] of `st` (whose
    /// inputs must be those the factor was made from): L·z = rhs, then
    /// Lᵀ·x = z. None when the result is not finite.
    fn solve(&self, st: &GramStats) -> Option<(Array1<f64>, f64)> {
        let (c, m) = (&self.c, self.m);
        let d = m - 1;
        let mut rhs: Vec<f64> = st.xty.iter().copied().chain(std::iter::once(st.sy)).collect();
        for i in 0..m {
            let mut v = rhs[i];
            for k in 0..i {
                v -= c[k * m + i] * rhs[k];
            }
            rhs[i] = v / c[i * m + i];
        }
        for i in (0..m).rev() {
            let mut v = rhs[i];
            for k in i + 1..m {
                v -= c[i * m + k] * rhs[k];
            }
            rhs[i] = v / c[i * m + i];
        }
        if !rhs.iter().all(|v| v.is_finite()) {
            return None;
        }
        let bias = rhs[d];
        rhs.truncate(d);
        Some((Array1::from(rhs), bias))
    }
}

/// Ridge penalties tried by the cross-validation, as a multiple of the
/// number of training samples.
const RIDGE_GRID: [f64; 6] = [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0];

fn min_samples(cfg: &PredictConfig) -> usize {
    (cfg.window + cfg.horizon).max(8)
}

/// The forecasters compared by the cross-validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ForecasterKind {
    /// SPEC §6's windowed linear model, trained by gradient descent.
    Model,
    /// "No change": the score stays at its last value.
    Persistence,
    /// The score one iteration period earlier.
    Seasonal,
    /// Ridge regression on the model's inputs.
    Ridge,
}

impl ForecasterKind {
    pub fn name(self) -> &'static str {
        match self {
            ForecasterKind::Model => "model",
            ForecasterKind::Persistence => "persistence",
            ForecasterKind::Seasonal => "seasonal",
            ForecasterKind::Ridge => "ridge",
        }
    }
}

/// Cross-validated mean absolute errors, in score points. A baseline that
/// could not be evaluated is `None`, with the reason.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CvMae {
    pub model: f64,
    pub persistence: f64,
    /// Over the origins with one period of history (`seasonal_origins`);
    /// `None` when fewer than half of the origins have it.
    pub seasonal: Option<f64>,
    pub seasonal_origins: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seasonal_reason: Option<String>,
    pub ridge: Option<f64>,
    /// The ridge penalty the cross-validation chose, per training sample.
    pub ridge_lambda: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ridge_reason: Option<String>,
    pub origins: usize,
}

impl CvMae {
    /// The forecaster with the lowest MAE; ties go to the simpler one
    /// (persistence, then seasonal, ridge, model).
    pub fn best(&self) -> (ForecasterKind, f64) {
        let mut best = (ForecasterKind::Persistence, self.persistence);
        for (kind, mae) in [
            (ForecasterKind::Seasonal, self.seasonal),
            (ForecasterKind::Ridge, self.ridge),
            (ForecasterKind::Model, Some(self.model)),
        ] {
            if let Some(m) = mae.filter(|m| m.is_finite())
                && m < best.1
            {
                best = (kind, m);
            }
        }
        best
    }
}

/// The step whose score is the seasonal forecast of step t + k: the last
/// observed step at the same phase of the period (`period` steps).
fn seasonal_index(t: usize, k: usize, period: usize) -> Option<usize> {
    (t + k).checked_sub(period * k.div_ceil(period))
}

/// The rolling origins of the cross-validation: at most `cv_origins`,
/// from the first step with enough history to the last with H steps after
/// it, one in each of `cv_origins` equal stretches of that range. Empty
/// when there is no such step.
///
/// Within its stretch, origin i sits at the fraction frac(i·φ) (the golden
/// ratio's low-discrepancy sequence), not at the stretch's start. Evenly
/// spaced origins alias with a periodic score: 50 origins over 1 000 steps
/// of 49 iterations are exactly one period apart, so every origin fell at
/// the same phase, and the cross-validation never saw the once-per-
/// iteration spike that decides between the forecasters. The sequence is
/// deterministic, so reruns agree.
fn cv_origins(n: usize, cfg: &PredictConfig) -> Vec<usize> {
    let (w, h) = (cfg.window, cfg.horizon);
    let first = w - 1 + min_samples(cfg) - 1 + h;
    let Some(last) = n.checked_sub(h + 1).filter(|&last| first <= last) else {
        return Vec::new();
    };
    let span = last - first + 1;
    let count = span.min(cfg.cv_origins.max(1));
    const PHI: f64 = 0.618_033_988_749_894_9;
    if count == 1 {
        return vec![last];
    }
    (0..count)
        .map(|i| {
            let (lo, hi) = (i * span / count, (i + 1) * span / count);
            let within = ((i as f64 * PHI).fract() * (hi - lo) as f64) as usize;
            first + lo + within.min(hi - lo - 1)
        })
        .collect()
}

/// The absolute errors of the cross-validation, summed as the origins go.
struct CvTally {
    model: f64,
    persistence: f64,
    seasonal: f64,
    seasonal_m: usize,
    seasonal_origins: usize,
    ridge: [f64; RIDGE_GRID.len()],
    ridge_ok: [bool; RIDGE_GRID.len()],
    m: usize,
    origins: usize,
    /// An origin where the model could not be trained: no cross-validation.
    failed: bool,
}

impl CvTally {
    fn new() -> CvTally {
        CvTally {
            model: 0.0,
            persistence: 0.0,
            seasonal: 0.0,
            seasonal_m: 0,
            seasonal_origins: 0,
            ridge: [0.0; RIDGE_GRID.len()],
            ridge_ok: [true; RIDGE_GRID.len()],
            m: 0,
            origins: 0,
            failed: false,
        }
    }

    /// Scores origin `t`: the model's forecast `f` (trained up to `t`),
    /// persistence, seasonal, and ridge at every penalty of the grid.
    fn add(&mut self, acc: &mut Accumulator, t: usize, f: &[f64], cfg: &PredictConfig, period: Option<usize>) {
        let h = cfg.horizon;
        let series = acc.series;
        let fr: Vec<Option<Vec<f64>>> = Forecaster::train_ridges(acc, t, cfg, &RIDGE_GRID)
            .into_iter()
            .map(|r| r.map(|r| r.forecast(series, t)).filter(|v| v.iter().all(|x| x.is_finite())))
            .collect();
        let score = |i: usize| series[i][COLUMNS - 1];
        for k in 1..=h {
            let actual = score(t + k);
            self.model += (f[k - 1] - actual).abs();
            self.persistence += (score(t) - actual).abs();
            if let Some(i) = period.and_then(|p| seasonal_index(t, k, p)) {
                self.seasonal += (score(i) - actual).abs();
                self.seasonal_m += 1;
                self.seasonal_origins += usize::from(k == 1);
            }
            for (g, r) in fr.iter().enumerate() {
                match r {
                    Some(r) => self.ridge[g] += (r[k - 1] - actual).abs(),
                    None => self.ridge_ok[g] = false,
                }
            }
            self.m += 1;
        }
        self.origins += 1;
    }

    fn finish(self, period: Option<usize>) -> Option<CvMae> {
        if self.failed || self.origins == 0 {
            return None;
        }
        let m = self.m as f64;
        let best_ridge = (0..RIDGE_GRID.len())
            .filter(|&g| self.ridge_ok[g])
            .min_by(|&a, &b| self.ridge[a].total_cmp(&self.ridge[b]));
        let seasonal_reason = match period {
            None => Some("no iteration period is known".to_string()),
            Some(p) if self.seasonal_origins * 2 < self.origins => {
                Some(format!("the period ({p} steps) is longer than the history at most origins"))
            }
            Some(_) => None,
        };
        Some(CvMae {
            model: self.model / m,
            persistence: self.persistence / m,
            seasonal: seasonal_reason.is_none().then(|| self.seasonal / self.seasonal_m as f64),
            seasonal_origins: self.seasonal_origins,
            seasonal_reason,
            ridge: best_ridge.map(|g| self.ridge[g] / m),
            ridge_lambda: best_ridge.map(|g| RIDGE_GRID[g]),
            ridge_reason: best_ridge.is_none().then(|| "no stable fit at every origin".to_string()),
            origins: self.origins,
        })
    }
}

/// Rolling-origin cross-validation: at each origin t (at most
/// `cv_origins`, spread over the series), forecasters trained only on samples whose
/// targets end at or before t predict t+1 … t+H. `period` is the iteration
/// period in steps, when known. None when no origin has enough history.
pub fn cross_validate(series: &[Step], cfg: &PredictConfig, period: Option<usize>) -> Option<CvMae> {
    run(series, cfg, period).cv
}

/// What one pass over a series gives: the model trained on all of it,
/// the cross-validation and the online backtest.
struct Pass {
    model: Option<Forecaster>,
    cv: Option<CvMae>,
    backtest: Backtest,
}

/// One pass over the series. The model is trained, in step order, at each
/// point any consumer needs — every [`retrain_interval`] steps for the
/// online backtest, at each cross-validation origin, and at the last step
/// for the forecast — each training warm-started from the one before
/// (they differ by a few samples). Every training only sees the samples
/// whose targets lie at or before its step.
fn run(series: &[Step], cfg: &PredictConfig, period: Option<usize>) -> Pass {
    let n = series.len();
    let mut pass = Pass { model: None, cv: None, backtest: Backtest { forecasts: vec![None; n], risk: vec![None; n] } };
    if cfg.window == 0 || cfg.horizon == 0 || n == 0 {
        return pass;
    }
    let period = period.filter(|&p| p >= 1 && p < n);
    let origins = cv_origins(n, cfg);
    let every = retrain_interval(cfg, n);
    let mut acc = Accumulator::new(series, Inputs::new(cfg, period, n));
    let mut tally = CvTally::new();
    let mut next_origin = origins.iter().copied().peekable();
    let mut model: Option<Forecaster> = None;
    let mut trained_at = None;
    for t in 0..n {
        let at_origin = next_origin.next_if_eq(&t).is_some();
        if t % every == 0 || model.is_none() || at_origin || t == n - 1 {
            if let Some(m) = Forecaster::train(&mut acc, t, cfg, model.as_ref()) {
                model = Some(m);
                trained_at = Some(t);
            }
        }
        let Some(m) = &model else {
            tally.failed |= at_origin;
            continue;
        };
        let f = m.forecast(series, t);
        if at_origin {
            if trained_at == Some(t) {
                tally.add(&mut acc, t, &f, cfg, period);
            } else {
                tally.failed = true;
            }
        }
        let f: Vec<f64> = f.into_iter().map(|v| v.clamp(0.0, 100.0)).collect();
        pass.backtest.risk[t] = Some(Risk::of(f.iter().copied().fold(f64::MIN, f64::max)));
        pass.backtest.forecasts[t] = Some(f);
    }
    pass.cv = tally.finish(period);
    pass.model = model.filter(|_| trained_at == Some(n - 1));
    pass
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
    /// The headline forecast, by [`Prediction::forecaster`]. None when
    /// there is not enough data (fewer than W + H + 1 steps).
    pub forecast: Option<Vec<f64>>,
    /// The forecaster with the lowest cross-validated MAE (the model when
    /// no origin could be validated).
    pub forecaster: ForecasterKind,
    /// 1 − MAE(forecaster) / MAE(persistence): above 0 it beats "no
    /// change". None without cross-validation or when persistence is exact.
    pub skill: Option<f64>,
    /// The model's own forecast, whatever the forecaster.
    pub model_forecast: Option<Vec<f64>>,
    pub current: f64,
    /// SPEC §6's formula, max(0.1, 1 − MAE/50), for the forecaster used.
    pub confidence: Option<f64>,
    /// The same for the model.
    pub confidence_model: Option<f64>,
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

/// Everything SPEC §6 asks of one series; `period` is the iteration
/// period in steps, when known (the seasonal baseline).
pub fn predict(series: &[Step], cfg: &PredictConfig, period: Option<usize>) -> Prediction {
    predict_with_backtest(series, cfg, period).0
}

/// [`predict`] and [`backtest`] from one pass over the series (see the
/// module documentation).
pub fn predict_with_backtest(series: &[Step], cfg: &PredictConfig, period: Option<usize>) -> (Prediction, Backtest) {
    let scores: Vec<f64> = series.iter().map(|s| s[COLUMNS - 1]).collect();
    let current = scores.last().copied().unwrap_or(0.0);
    let trend = trend(&scores, cfg.trend_window);
    let mut p = Prediction {
        window: cfg.window,
        horizon: cfg.horizon,
        forecast: None,
        forecaster: ForecasterKind::Model,
        skill: None,
        model_forecast: None,
        current,
        confidence: None,
        confidence_model: None,
        trend,
        risk: None,
        warnings: Vec::new(),
        cv_mae: None,
    };
    let Pass { model, cv, backtest } = run(series, cfg, period);
    if cfg.window == 0 || cfg.horizon == 0 || series.len() < cfg.window + cfg.horizon + 1 {
        return (p, backtest);
    }
    let last = series.len() - 1;
    let Some(model) = model else {
        return (p, backtest);
    };
    let clamp = |f: Vec<f64>| -> Vec<f64> { f.into_iter().map(|v| v.clamp(0.0, 100.0)).collect() };
    let model_forecast = clamp(model.forecast(series, last));
    let confidence_of = |mae: f64| (1.0 - mae / 50.0).max(0.1);
    // Without a cross-validation origin nothing is proven: the model, at
    // the lowest confidence.
    let (forecaster, mae) = cv.as_ref().map_or((ForecasterKind::Model, f64::NAN), CvMae::best);
    let forecast = match forecaster {
        ForecasterKind::Model => Some(model_forecast.clone()),
        ForecasterKind::Persistence => Some(vec![current; cfg.horizon]),
        ForecasterKind::Seasonal => period.and_then(|per| {
            (1..=cfg.horizon).map(|k| seasonal_index(last, k, per).map(|i| scores[i])).collect::<Option<Vec<_>>>()
        }),
        ForecasterKind::Ridge => cv.as_ref().and_then(|c| c.ridge_lambda).and_then(|c| {
            let mut acc = Accumulator::new(series, Inputs::new(cfg, period, series.len()));
            Forecaster::train_ridges(&mut acc, last, cfg, &[c]).pop().flatten().map(|r| r.forecast(series, last))
        }),
    };
    // A forecaster that cannot forecast now falls back to "no change".
    let (forecaster, forecast) = match forecast.filter(|f| f.iter().all(|v| v.is_finite())) {
        Some(f) => (forecaster, clamp(f)),
        None => (ForecasterKind::Persistence, vec![current; cfg.horizon]),
    };
    let mae = match (forecaster, &cv) {
        (ForecasterKind::Persistence, Some(c)) => c.persistence,
        _ => mae,
    };
    let confidence = if mae.is_finite() { confidence_of(mae) } else { 0.1 };
    p.confidence_model = Some(cv.as_ref().map_or(0.1, |c| confidence_of(c.model)));
    p.skill = cv.as_ref().filter(|c| c.persistence > 1e-9 && mae.is_finite()).map(|c| 1.0 - mae / c.persistence);
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
    p.forecaster = forecaster;
    p.model_forecast = Some(model_forecast);
    p.confidence = Some(confidence);
    p.cv_mae = cv;
    (p, backtest)
}

/// Steps between retrainings of the online backtest: `retrain_every`, but
/// at most about 200 retrainings over the series (long series with fine
/// steps would otherwise retrain tens of thousands of times).
pub fn retrain_interval(cfg: &PredictConfig, steps: usize) -> usize {
    cfg.retrain_every.max(steps.div_ceil(200)).max(1)
}

/// The online backtest: at each step t, the model's forecast from a model
/// trained on data up to the last retraining point ≤ t (see
/// [`retrain_interval`]; the cross-validation origins are retraining
/// points too), using only steps ≤ t. `period`: the iteration period in
/// steps, when known (an input of the model).
pub fn backtest(series: &[Step], cfg: &PredictConfig, period: Option<usize>) -> Backtest {
    run(series, cfg, period).backtest
}

#[cfg(test)]
mod tests {
    use super::*;
    use linfa_linear::LinearRegression;
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
    fn the_blocked_product_is_bit_for_bit_ndarrays() {
        // Every width around the 4-row blocks and the 8-wide partial sums,
        // a matrix that is not symmetric, and values whose sums round.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        };
        for d in 1..=41 {
            let m = Array2::from_shape_fn((d, d), |(r, c)| next() * 10f64.powi(((r * 7 + c) % 9) as i32 - 4));
            let w = Array1::from_shape_fn(d, |_| next() * 3.0);
            let e = Array1::from_shape_fn(d, |_| next());
            let mut want = m.dot(&w).to_vec();
            want.push(e.dot(&w));
            for lanes in [4, 8] {
                let mut out = vec![0.0; d + 1];
                Columns::with_lanes(&m, &[&e], lanes).times(w.as_slice().unwrap(), &mut out);
                for r in 0..=d {
                    assert_eq!(out[r].to_bits(), want[r].to_bits(), "d = {d}, {lanes} lanes, row {r}");
                }
            }
        }
    }

    #[test]
    fn without_inputs_gradient_descent_fits_the_bias() {
        let ds = Dataset::new(Array2::<f64>::zeros((4, 0)), array![1.0, 2.0, 3.0, 4.0]);
        let fit = GradientDescent { max_iterations: 5000, ..Default::default() }.fit(&ds).unwrap();
        assert!(fit.weights.is_empty());
        assert!((fit.bias - 2.5).abs() < 1e-6, "{}", fit.bias);
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
    fn held_out_early_stopping_keeps_the_parameters_with_the_lowest_held_out_loss() {
        // Training says y = x, the held-out samples say y = −x: every step
        // away from the start makes the held-out loss worse.
        let x = array![[1.0], [2.0], [-1.0], [0.5]];
        let train = GramStats::of(&x, &array![1.0, 2.0, -1.0, 0.5]);
        let held = GramStats::of(&x, &array![-1.0, -2.0, 1.0, -0.5]);
        let gd = GradientDescent::default();
        let fit = gd.fit_monitored(&train, Some(&held), None);
        assert!(fit.stopped_early);
        assert_eq!(fit.iterations, gd.patience);
        assert_eq!((fit.weights[0], fit.bias), (0.0, 0.0));
        // Agreeing held-out samples: training runs on and fits y = x.
        let fit = gd.fit_monitored(&train, Some(&train), None);
        assert!(fit.weights[0] > 0.9, "{fit:?}");
        // A warm start begins where it is told to.
        let start = (array![1.0], 0.0);
        let fit = gd.fit_monitored(&train, Some(&held), Some((&start.0, start.1)));
        assert!(fit.weights[0] <= 1.0 && fit.stopped_early);
    }

    #[test]
    fn held_out_early_stopping_returns_the_best_point_of_the_path() {
        // Training says y = x, the held-out samples y = x / 2: the held-out
        // loss falls while w climbs towards 1/2, then rises. The fit must
        // return exactly the point of the training path where it was
        // lowest (the path itself: plain gradient descent stopped after
        // i updates).
        let x = array![[1.0], [2.0], [-1.0], [0.5]];
        let train = GramStats::of(&x, &array![1.0, 2.0, -1.0, 0.5]);
        let held_y = array![0.5, 1.0, -0.5, 0.25];
        let held = GramStats::of(&x, &held_y);
        let gd = GradientDescent::default();
        let fit = gd.fit_monitored(&train, Some(&held), None);
        assert!(fit.stopped_early, "{fit:?}");
        let held_loss = |w: f64, b: f64| {
            x.column(0).iter().zip(&held_y).map(|(xi, yi)| (xi * w + b - yi).powi(2)).sum::<f64>() / 4.0
        };
        let path: Vec<(f64, f64)> = (0..fit.iterations)
            .map(|i| {
                let p = GradientDescent { max_iterations: i, patience: usize::MAX, ..gd }.fit_stats(&train);
                (p.weights[0], p.bias)
            })
            .collect();
        let best = path.iter().copied().min_by(|a, b| held_loss(a.0, a.1).total_cmp(&held_loss(b.0, b.1))).unwrap();
        assert_eq!((fit.weights[0], fit.bias), best);
        assert!(best != path[0] && best != path[path.len() - 1], "the best point lies inside the path: {best:?}");
    }

    #[test]
    fn one_pass_gives_what_the_separate_calls_give() {
        let series: Vec<Step> = (0..150)
            .map(|i| [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 30.0 + (i as f64 * 0.3).sin() * 4.0 + i as f64 * 0.05])
            .collect();
        let cfg = PredictConfig::default();
        let (p, b) = predict_with_backtest(&series, &cfg, Some(21));
        assert_eq!(p, predict(&series, &cfg, Some(21)));
        assert_eq!(b, backtest(&series, &cfg, Some(21)));
        assert_eq!(p.cv_mae, cross_validate(&series, &cfg, Some(21)));
        assert_eq!(p.cv_mae.unwrap().origins, cfg.cv_origins);
        // The model's forecast at the last step is the backtest's there.
        assert_eq!(p.model_forecast, b.forecasts[149]);
    }

    #[test]
    fn seasonal_inputs_let_the_model_follow_a_periodic_spike() {
        // A spike at one phase of a 10-step period, longer than the window:
        // the last W steps cannot say when it comes; one period earlier can.
        let series: Vec<Step> = (0..400)
            .map(|i| {
                let spike = if i % 10 == 9 { 30.0 } else { 0.0 };
                [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 10.0 + spike + (i as f64 * 1.3).sin()]
            })
            .collect();
        let cfg = PredictConfig::default();
        let with = cross_validate(&series, &cfg, Some(10)).unwrap();
        let without = cross_validate(&series, &cfg, None).unwrap();
        assert!(with.model < 0.5 * with.persistence, "{with:?}");
        assert!(with.model < 0.5 * without.model, "{with:?} {without:?}");
    }

    #[test]
    fn cv_origins_spread_over_the_phases_of_a_period() {
        // 1 000 steps of a 20-step period: evenly spaced origins were
        // exactly 20 steps apart and all fell on 3 of the 20 phases.
        let cfg = PredictConfig::default();
        let origins = cv_origins(1000, &cfg);
        assert_eq!(origins.len(), cfg.cv_origins);
        assert!(origins.windows(2).all(|w| w[0] < w[1]));
        let first = cfg.window - 1 + min_samples(&cfg) - 1 + cfg.horizon;
        assert!(origins[0] >= first && *origins.last().unwrap() < 1000 - cfg.horizon);
        let mut phases = [0usize; 20];
        for t in &origins {
            phases[t % 20] += 1;
        }
        assert!(phases.iter().filter(|&&c| c > 0).count() >= 10, "{phases:?}");
        assert!(phases.iter().all(|&c| c <= cfg.cv_origins / 5), "{phases:?}");
        // Short series: every step with enough history is an origin.
        assert_eq!(cv_origins(first + 10 + cfg.horizon + 1, &cfg), (first..=first + 10).collect::<Vec<_>>());
        assert_eq!(cv_origins(first + cfg.horizon, &cfg), Vec::<usize>::new());
    }

    #[test]
    fn insufficient_data_gives_no_model() {
        let cfg = PredictConfig::default();
        let p = predict(&constant_series(cfg.window + cfg.horizon, 40.0), &cfg, None);
        assert_eq!(p.forecast, None);
        assert_eq!(p.risk, None);
        assert!(backtest(&constant_series(3, 40.0), &cfg, None).risk.iter().all(Option::is_none));
    }

    #[test]
    fn constant_series_is_confident_and_risk_matches_its_level() {
        let cfg = PredictConfig::default();
        for (score, risk) in [(10.0, Risk::Minimal), (55.0, Risk::Medium), (85.0, Risk::Critical)] {
            let p = predict(&constant_series(120, score), &cfg, None);
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
        let p = predict(&series, &cfg, None);
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
        // With and without the seasonal inputs of a known period.
        for period in [None, Some(9)] {
            for upto in [30, 45, 60] {
                let train = |series: &[Step]| {
                    Forecaster::train(
                        &mut Accumulator::new(series, Inputs::new(&cfg, period, series.len())),
                        upto,
                        &cfg,
                        None,
                    )
                    .unwrap()
                    .forecast(series, upto)
                };
                assert_eq!(train(&base), train(&other), "{period:?} {upto}");
            }
            // And the backtest at t only uses steps ≤ t.
            let ba = backtest(&base, &cfg, period);
            let bb = backtest(&other, &cfg, period);
            assert_eq!(ba.forecasts[..=60], bb.forecasts[..=60]);
        }
    }

    #[test]
    fn on_noise_the_headline_is_no_change_or_as_good() {
        // A score that wanders randomly: nothing predicts it better than
        // its last value, and the headline must not claim otherwise.
        let cfg = PredictConfig::default();
        let mut x = 40.0f64;
        let mut seed = 7u64;
        let series: Vec<Step> = (0..300)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                x += ((seed >> 33) as f64 / (1u64 << 31) as f64 - 0.5) * 4.0;
                [0.3, 0.2, 0.5, 0.4, 0.2, 0.7, x]
            })
            .collect();
        let p = predict(&series, &cfg, None);
        let cv = p.cv_mae.clone().unwrap();
        let (best, mae) = cv.best();
        assert_eq!(p.forecaster, best);
        assert!(mae <= cv.persistence && p.skill.unwrap() >= 0.0, "{cv:?}");
        if p.forecaster == ForecasterKind::Persistence {
            assert_eq!(p.forecast.unwrap(), vec![p.current; cfg.horizon]);
        }
        // The model predicts changes: with no signal it stays near the last value.
        let mf = p.model_forecast.unwrap();
        assert!(mf.iter().all(|v| (v - p.current).abs() < 3.0), "{mf:?} from {}", p.current);
    }

    #[test]
    fn a_periodic_score_is_best_forecast_by_the_seasonal_baseline() {
        // A sawtooth of period 10 steps: seasonal is exact.
        let cfg = PredictConfig::default();
        let series: Vec<Step> =
            (0..200).map(|i| [0.3, 0.2, 0.5, 0.4, 0.2, 0.7, 20.0 + 3.0 * (i % 10) as f64]).collect();
        let p = predict(&series, &cfg, Some(10));
        let cv = p.cv_mae.clone().unwrap();
        assert_eq!(cv.seasonal, Some(0.0), "{cv:?}");
        assert_eq!(p.forecaster, ForecasterKind::Seasonal);
        assert_eq!(p.forecast.unwrap(), vec![20.0 + 3.0 * 0.0, 23.0, 26.0]);
        assert_eq!(p.skill, Some(1.0));
        let none = predict(&series, &cfg, None).cv_mae.unwrap();
        assert_eq!((none.seasonal, none.seasonal_reason.as_deref()), (None, Some("no iteration period is known")));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Collinear, constant and wildly scaled windows: the ridge
        /// baseline is never a blown-up number — finite, and its forecast
        /// within the score's range once clamped as the headline is.
        #[test]
        fn ridge_stays_finite_on_collinear_and_constant_windows(
            n in 20usize..160,
            constant in proptest::prelude::any::<bool>(),
            scale in 1e-9f64..1e9,
            slope in -2.0f64..2.0,
        ) {
            let cfg = PredictConfig::default();
            let series: Vec<Step> = (0..n)
                .map(|i| {
                    let v = if constant { 1.0 } else { i as f64 * scale };
                    // Every feature a multiple of the same column: collinear.
                    [v, 2.0 * v, 3.0 * v, v, v, 0.5 * v, (50.0 + slope * i as f64).clamp(0.0, 100.0)]
                })
                .collect();
            let cv = cross_validate(&series, &cfg, None);
            if let Some(cv) = cv {
                proptest::prop_assert!(cv.model.is_finite() && cv.persistence.is_finite());
                if let Some(r) = cv.ridge {
                    proptest::prop_assert!(r.is_finite() && (0.0..=100.0).contains(&r), "{:?}", cv);
                } else {
                    proptest::prop_assert!(cv.ridge_reason.is_some());
                }
            }
            let p = predict(&series, &cfg, None);
            if let Some(f) = p.forecast {
                proptest::prop_assert!(f.iter().all(|v| v.is_finite() && (0.0..=100.0).contains(v)));
            }
        }
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
