//! The classification paper's network (the seeds' deep-learning performance
//! analysis framework, its §4.2): a stacked sparse autoencoder pretrained
//! layer by layer on every sample, without labels, then a softmax layer on
//! top, and the whole stack fine-tuned on the labelled samples with
//! dropout.
//!
//! Each autoencoder is the paper's equations (4)–(9): h = σ(W x + p),
//! y = σ(Wᵀ h + q) (tied weights, sigmoid units), trained to minimise
//! ½‖y − x‖² averaged over the samples, plus λ/2 ‖W‖² and the sparsity
//! penalty β Σⱼ KL(ρ ‖ η̂ⱼ), η̂ⱼ the mean activation of hidden unit j.
//! Inputs must lie in [0, 1] (sigmoid outputs): the caller maps z-scores
//! through the logistic function.
//!
//! Written on `ndarray` (no deep-learning framework: a network of three
//! 30-unit layers over ten features is a few thousand weights). The
//! optimiser is Adam on mini-batches of [`Hyper::batch`] samples, for a
//! fixed number of steps (not epochs), so the cost of a fit does not grow
//! with the number of samples. Deterministic for a seed.

use ndarray::{Array1, Array2, Axis, Zip};
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

/// The training's settings. The sparsity settings are the usual ones for
/// sparse autoencoders (ρ = 0.05, β = 3, λ = 10⁻⁴: Ng's notes, which the
/// paper's loss follows); the paper gives no values.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hyper {
    /// Sparsity target ρ.
    pub rho: f64,
    /// Weight β of the sparsity penalty.
    pub beta: f64,
    /// Weight decay λ.
    pub lambda: f64,
    /// Share of hidden units dropped in each fine-tuning step.
    pub dropout: f64,
    pub batch: usize,
    pub learning_rate: f64,
    /// Adam steps per autoencoder in pretraining.
    pub pretrain_steps: usize,
    /// Adam steps of the fine-tuning.
    pub finetune_steps: usize,
}

impl Default for Hyper {
    fn default() -> Hyper {
        Hyper {
            rho: 0.05,
            beta: 3.0,
            lambda: 1e-4,
            dropout: 0.2,
            batch: 64,
            learning_rate: 0.01,
            pretrain_steps: 600,
            finetune_steps: 1500,
        }
    }
}

impl Hyper {
    /// The short training of the layer-size search (the paper's
    /// "preliminary training with fewer iterations").
    pub fn short(self) -> Hyper {
        Hyper { pretrain_steps: self.pretrain_steps / 3, finetune_steps: self.finetune_steps / 3, ..self }
    }
}

/// A trained network. Weights are stored as rows of inputs (`w[i][j]`:
/// input i to unit j), readable in the model file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Net {
    /// The encoder layers, input first.
    pub layers: Vec<Dense>,
    /// The softmax layer (its `decoder_bias` is empty).
    pub softmax: Dense,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Dense {
    pub w: Vec<Vec<f64>>,
    pub bias: Vec<f64>,
    /// The autoencoder's output bias q (used for the reconstruction error).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decoder_bias: Vec<f64>,
}

/// A layer as arrays: weights (inputs × units), bias (1 × units), decoder
/// bias (1 × inputs).
#[derive(Clone, Debug)]
struct Layer {
    w: Array2<f64>,
    p: Array2<f64>,
    q: Array2<f64>,
}

impl Layer {
    fn stored(&self) -> Dense {
        Dense {
            w: self.w.rows().into_iter().map(|r| r.to_vec()).collect(),
            bias: self.p.iter().copied().collect(),
            decoder_bias: self.q.iter().copied().collect(),
        }
    }

    fn of(d: &Dense) -> Option<Layer> {
        let rows = d.w.len();
        let cols = d.w.first().map_or(0, Vec::len);
        if rows == 0 || cols == 0 || d.w.iter().any(|r| r.len() != cols) || d.bias.len() != cols {
            return None;
        }
        if !d.decoder_bias.is_empty() && d.decoder_bias.len() != rows {
            return None;
        }
        let w = Array2::from_shape_fn((rows, cols), |(i, j)| d.w[i][j]);
        let p = Array2::from_shape_vec((1, cols), d.bias.clone()).ok()?;
        let q = Array2::from_shape_vec((1, d.decoder_bias.len()), d.decoder_bias.clone()).ok()?;
        Some(Layer { w, p, q })
    }
}

fn sigmoid(v: f64) -> f64 {
    1.0 / (1.0 + (-v).exp())
}

/// Adam over a list of parameter arrays.
struct Adam {
    m: Vec<Array2<f64>>,
    v: Vec<Array2<f64>>,
    t: i32,
    lr: f64,
}

impl Adam {
    fn new(params: &[&Array2<f64>], lr: f64) -> Adam {
        Adam {
            m: params.iter().map(|p| Array2::zeros(p.raw_dim())).collect(),
            v: params.iter().map(|p| Array2::zeros(p.raw_dim())).collect(),
            t: 0,
            lr,
        }
    }

    fn step(&mut self, params: &mut [&mut Array2<f64>], grads: &[Array2<f64>]) {
        const B1: f64 = 0.9;
        const B2: f64 = 0.999;
        self.t += 1;
        let (c1, c2) = (1.0 - B1.powi(self.t), 1.0 - B2.powi(self.t));
        let lr = self.lr;
        for ((p, g), (m, v)) in params.iter_mut().zip(grads).zip(self.m.iter_mut().zip(self.v.iter_mut())) {
            Zip::from(&mut **p).and(g).and(m).and(v).for_each(|p, &g, m, v| {
                *m = B1 * *m + (1.0 - B1) * g;
                *v = B2 * *v + (1.0 - B2) * g * g;
                *p -= lr * (*m / c1) / ((*v / c2).sqrt() + 1e-8);
            });
        }
    }
}

/// Mini-batches: a seeded permutation of the rows, walked in chunks and
/// reshuffled at its end.
struct Batches {
    order: Vec<usize>,
    at: usize,
    size: usize,
}

impl Batches {
    fn new(n: usize, size: usize) -> Batches {
        Batches { order: (0..n).collect(), at: n, size: size.min(n).max(1) }
    }

    fn next(&mut self, rng: &mut rand_pcg::Pcg64Mcg) -> &[usize] {
        if self.at + self.size > self.order.len() {
            // Fisher–Yates.
            for i in (1..self.order.len()).rev() {
                let j = rng.random_range(0..=i);
                self.order.swap(i, j);
            }
            self.at = 0;
        }
        self.at += self.size;
        &self.order[self.at - self.size..self.at]
    }
}

fn uniform(rows: usize, cols: usize, rng: &mut rand_pcg::Pcg64Mcg) -> Array2<f64> {
    let r = (6.0 / (rows + cols + 1) as f64).sqrt();
    Array2::from_shape_fn((rows, cols), |_| rng.random_range(-r..r))
}

/// Trains one sparse autoencoder on `x` (rows in [0, 1]).
fn pretrain(x: &Array2<f64>, hidden: usize, hy: &Hyper, rng: &mut rand_pcg::Pcg64Mcg) -> Layer {
    let d = x.ncols();
    let mut layer = Layer { w: uniform(d, hidden, rng), p: Array2::zeros((1, hidden)), q: Array2::zeros((1, d)) };
    let mut adam = Adam::new(&[&layer.w, &layer.p, &layer.q], hy.learning_rate);
    let mut batches = Batches::new(x.nrows(), hy.batch);
    for _ in 0..hy.pretrain_steps {
        let xb = x.select(Axis(0), batches.next(rng));
        let m = xb.nrows() as f64;
        let h = (xb.dot(&layer.w) + &layer.p).mapv(sigmoid);
        let y = (h.dot(&layer.w.t()) + &layer.q).mapv(sigmoid);
        let eta = h.mean_axis(Axis(0)).unwrap_or_else(|| Array1::zeros(hidden)).mapv(|v| v.clamp(1e-6, 1.0 - 1e-6));
        let sparsity = eta.mapv(|e| hy.beta * (-hy.rho / e + (1.0 - hy.rho) / (1.0 - e)) / m).insert_axis(Axis(0));
        let d3 = (&y - &xb) * &y.mapv(|v| v * (1.0 - v)) / m;
        let d2 = (d3.dot(&layer.w) + &sparsity) * &h.mapv(|v| v * (1.0 - v));
        let gw = xb.t().dot(&d2) + d3.t().dot(&h) + &layer.w * hy.lambda;
        let gp = d2.sum_axis(Axis(0)).insert_axis(Axis(0));
        let gq = d3.sum_axis(Axis(0)).insert_axis(Axis(0));
        adam.step(&mut [&mut layer.w, &mut layer.p, &mut layer.q], &[gw, gp, gq]);
    }
    layer
}

/// Trains the network: `x` rows in [0, 1], `labels` in 0..`classes`,
/// `hidden` the units of each encoder layer.
pub fn train(x: &Array2<f64>, labels: &[usize], classes: usize, hidden: &[usize], hy: &Hyper, seed: u64) -> Net {
    let mut rng = rand_pcg::Pcg64Mcg::seed_from_u64(seed);
    // Pretraining, layer by layer: each autoencoder learns the codes of the
    // one below.
    let mut layers: Vec<Layer> = Vec::new();
    let mut codes = x.clone();
    for &h in hidden {
        let layer = pretrain(&codes, h, hy, &mut rng);
        codes = (codes.dot(&layer.w) + &layer.p).mapv(sigmoid);
        layers.push(layer);
    }
    let top = hidden.last().copied().unwrap_or(x.ncols());
    let mut v = uniform(top, classes, &mut rng);
    let mut b = Array2::zeros((1, classes));
    // Fine-tuning of the whole stack with the softmax layer, dropout on the
    // hidden units (inverted: kept units are scaled by 1 / (1 − rate)).
    let mut params: Vec<Array2<f64>> = Vec::new();
    for l in &layers {
        params.push(l.w.clone());
        params.push(l.p.clone());
    }
    params.push(v.clone());
    params.push(b.clone());
    let mut adam = Adam::new(&params.iter().collect::<Vec<_>>(), hy.learning_rate);
    let mut batches = Batches::new(x.nrows(), hy.batch);
    let keep = 1.0 - hy.dropout;
    for _ in 0..hy.finetune_steps {
        let idx = batches.next(&mut rng).to_vec();
        let xb = x.select(Axis(0), &idx);
        let m = xb.nrows() as f64;
        // Forward: the outputs (after dropout) and the masks.
        let mut outs = vec![xb];
        let mut sig = Vec::new();
        let mut masks = Vec::new();
        for l in &layers {
            let s = (outs[outs.len() - 1].dot(&l.w) + &l.p).mapv(sigmoid);
            let mask = Array2::from_shape_fn(s.raw_dim(), |_| if rng.random_bool(keep) { 1.0 / keep } else { 0.0 });
            outs.push(&s * &mask);
            sig.push(s);
            masks.push(mask);
        }
        let probs = softmax(&(outs[outs.len() - 1].dot(&v) + &b));
        let mut dlogits = probs;
        for (r, &i) in idx.iter().enumerate() {
            dlogits[[r, labels[i]]] -= 1.0;
        }
        dlogits /= m;
        let top_out = &outs[outs.len() - 1];
        let mut grads = vec![Array2::zeros((0, 0)); 2 * layers.len() + 2];
        grads[2 * layers.len()] = top_out.t().dot(&dlogits) + &v * hy.lambda;
        grads[2 * layers.len() + 1] = dlogits.sum_axis(Axis(0)).insert_axis(Axis(0));
        let mut da = dlogits.dot(&v.t());
        for k in (0..layers.len()).rev() {
            let dz = &da * &masks[k] * &sig[k].mapv(|s| s * (1.0 - s));
            grads[2 * k] = outs[k].t().dot(&dz) + &layers[k].w * hy.lambda;
            grads[2 * k + 1] = dz.sum_axis(Axis(0)).insert_axis(Axis(0));
            if k > 0 {
                da = dz.dot(&layers[k].w.t());
            }
        }
        let mut refs: Vec<&mut Array2<f64>> = Vec::new();
        for l in layers.iter_mut() {
            refs.push(&mut l.w);
            refs.push(&mut l.p);
        }
        refs.push(&mut v);
        refs.push(&mut b);
        adam.step(&mut refs, &grads);
    }
    Net {
        layers: layers.iter().map(Layer::stored).collect(),
        softmax: Layer { w: v, p: b, q: Array2::zeros((1, 0)) }.stored(),
    }
}

fn softmax(logits: &Array2<f64>) -> Array2<f64> {
    let mut out = logits.clone();
    for mut row in out.rows_mut() {
        let top = row.fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        row.mapv_inplace(|v| (v - top).exp());
        let sum = row.sum();
        row /= sum;
    }
    out
}

/// A network ready to classify: its arrays, checked against the input
/// width and class count once.
pub struct Ready {
    layers: Vec<Layer>,
    softmax: Layer,
}

impl Net {
    /// The network as arrays; None when its shapes do not chain from
    /// `inputs` to `classes` (a damaged or edited model file).
    pub fn ready(&self, inputs: usize, classes: usize) -> Option<Ready> {
        let layers: Vec<Layer> = self.layers.iter().map(Layer::of).collect::<Option<_>>()?;
        let softmax = Layer::of(&self.softmax)?;
        let mut width = inputs;
        for l in &layers {
            if l.w.nrows() != width || l.q.ncols() != width {
                return None;
            }
            width = l.w.ncols();
        }
        (softmax.w.nrows() == width && softmax.w.ncols() == classes).then_some(Ready { layers, softmax })
    }

    /// The encoder sizes.
    pub fn hidden(&self) -> Vec<usize> {
        self.layers.iter().map(|l| l.bias.len()).collect()
    }
}

impl Ready {
    /// Class probabilities of each row.
    pub fn probabilities(&self, x: &Array2<f64>) -> Array2<f64> {
        let mut a = x.clone();
        for l in &self.layers {
            a = (a.dot(&l.w) + &l.p).mapv(sigmoid);
        }
        softmax(&(a.dot(&self.softmax.w) + &self.softmax.p))
    }

    /// The mean squared error of each row's reconstruction through the
    /// whole stack: encoded to the top layer, then decoded back down with
    /// each autoencoder's tied weights and output bias.
    pub fn reconstruction_error(&self, x: &Array2<f64>) -> Vec<f64> {
        let mut a = x.clone();
        for l in &self.layers {
            a = (a.dot(&l.w) + &l.p).mapv(sigmoid);
        }
        for l in self.layers.iter().rev() {
            a = (a.dot(&l.w.t()) + &l.q).mapv(sigmoid);
        }
        (&a - x).rows().into_iter().map(|r| r.mapv(|v| v * v).mean().unwrap_or(0.0)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two classes that differ in one input: the network separates them,
    /// and the same seed trains the same weights.
    #[test]
    fn the_network_learns_two_groups_and_is_deterministic() {
        let n = 200;
        let mut state = 7u64;
        let mut noise = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 0.1
        };
        let labels: Vec<usize> = (0..n).map(|i| i % 2).collect();
        let x = Array2::from_shape_fn((n, 4), |(i, j)| {
            let base = if j == 1 && labels[i] == 1 { 0.8 } else { 0.3 };
            base + noise()
        });
        let hy = Hyper::default().short();
        let net = train(&x, &labels, 2, &[6, 6], &hy, 3);
        let ready = net.ready(4, 2).unwrap();
        let p = ready.probabilities(&x);
        let right = (0..n).filter(|&i| (p[[i, 1]] > 0.5) == (labels[i] == 1)).count();
        assert_eq!(right, n, "{right} of {n}");
        assert_eq!(train(&x, &labels, 2, &[6, 6], &hy, 3), net);
        // A row far from both groups reconstructs worse than the rows seen.
        let seen = ready.reconstruction_error(&x);
        let worst = seen.iter().fold(0.0f64, |a, &b| a.max(b));
        let odd = Array2::from_shape_vec((1, 4), vec![1.0, 0.0, 1.0, 1.0]).unwrap();
        assert!(ready.reconstruction_error(&odd)[0] > worst, "{:?} vs {worst}", ready.reconstruction_error(&odd));
        // Shapes that do not chain are refused, not indexed.
        assert!(net.ready(5, 2).is_none());
        assert!(net.ready(4, 3).is_none());
    }
}
