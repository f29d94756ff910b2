//! A fleet's problem classes, learned once and applied to every new trace
//! (`fragscope classes fit`, `analyze --classes`): the classification
//! paper of the seeds, whole.
//!
//! 1. **Classes.** The samples (one per unit: a process, or a trace's
//!    summary row) are standardised and grouped by k-means with the gap
//!    statistic, exactly as a batch's groups are
//!    ([`crate::analysis::cluster`]). Each group becomes a class, named by
//!    its centroid where its members' own verdicts confirm the name
//!    ([`naming`]), with a one-line direction to optimise.
//! 2. **Classifiers.** The paper's stacked sparse autoencoder ([`ssae`]):
//!    pretrained on every sample, fine-tuned on the labelled ones (the
//!    group of each sample, or the user's label, which takes precedence).
//!    Its layer sizes are chosen by 3-fold cross-validation over
//!    {1, 2, 3} layers × {10, 20, 30} units on at most [`SEARCH_ROWS`]
//!    samples, with the short training (the paper's figure 8). The
//!    baseline is the nearest centroid. Both are cross-validated
//!    ([`FOLDS`] folds, the same folds); the better one classifies, the
//!    nearest centroid on a tie (it is the simpler).
//! 3. **Out of distribution.** A sample whose distance to its class's
//!    centroid is beyond the 99th percentile of the class's members'
//!    distances is `unclassified`, and so is one (with the network
//!    classifying) whose reconstruction error is beyond the class's 99th
//!    percentile of its members'. It is never forced into the nearest
//!    class.
//!
//! The network reads each z-score through the logistic function (its
//! sigmoid outputs reconstruct values in [0, 1]). Everything is
//! deterministic for a seed.

pub mod model;
pub mod naming;
pub mod samples;
pub mod ssae;

use anyhow::Result;
use ndarray::Array2;

pub use model::{Assignment, Class, Model};
pub use naming::Trouble;
pub use samples::{TraceClass, classify, samples_of};

use crate::analysis::cluster::FEATURES;

/// Cross-validation folds of the two classifiers.
pub const FOLDS: usize = 5;
/// The layer-size search runs on at most this many samples (evenly
/// spaced): it compares shapes, which needs the population's shape, not
/// every member.
pub const SEARCH_ROWS: usize = 2000;
/// The layer sizes searched.
pub const LAYER_GRID: [&[usize]; 9] =
    [&[10], &[20], &[30], &[10, 10], &[20, 20], &[30, 30], &[10, 10, 10], &[20, 20, 20], &[30, 30, 30]];

/// One sample: a unit of a trace (None: the trace as a whole, as a summary
/// dataset holds it), its features and what fragscope's verdicts said.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub trace: String,
    pub unit: Option<u32>,
    pub features: [f64; FEATURES.len()],
    pub trouble: Trouble,
}

/// Non-finite features become 0, as the batch's grouping reads them.
fn finite(f: &[f64; FEATURES.len()]) -> [f64; FEATURES.len()] {
    f.map(|v| if v.is_finite() { v } else { 0.0 })
}

/// z-scores of samples under a standardisation.
fn standardise(rows: &[[f64; FEATURES.len()]], mean: &[f64], scale: &[f64]) -> Array2<f64> {
    Array2::from_shape_fn((rows.len(), FEATURES.len()), |(i, j)| (finite(&rows[i])[j] - mean[j]) / scale[j])
}

/// The network's input: each z-score through the logistic function.
fn squash(z: &Array2<f64>) -> Array2<f64> {
    z.mapv(|v| 1.0 / (1.0 + (-v).exp()))
}

fn distance(a: ndarray::ArrayView1<f64>, b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f64>().sqrt()
}

/// The nearest of `centroids` to each row, with the distance (a class
/// without a centroid is never the nearest).
fn nearest(z: &Array2<f64>, centroids: &[Option<Vec<f64>>]) -> Vec<(usize, f64)> {
    z.rows()
        .into_iter()
        .map(|r| {
            centroids
                .iter()
                .enumerate()
                .filter_map(|(c, m)| Some((c, distance(r, m.as_ref()?))))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .unwrap_or((0, f64::INFINITY))
        })
        .collect()
}

/// The mean z-scores of the rows of each class; None for a class with
/// no row among `rows` (all its members held out in a fold).
fn centroids(z: &Array2<f64>, labels: &[usize], classes: usize, rows: &[usize]) -> Vec<Option<Vec<f64>>> {
    (0..classes)
        .map(|c| {
            let members: Vec<usize> = rows.iter().copied().filter(|&i| labels[i] == c).collect();
            (!members.is_empty()).then(|| {
                (0..z.ncols()).map(|j| members.iter().map(|&i| z[[i, j]]).sum::<f64>() / members.len() as f64).collect()
            })
        })
        .collect()
}

/// The 99th percentile of the distribution that `values` (non-negative,
/// like squared distances or squared errors) are drawn from: the larger
/// of their own 99th percentile (linear interpolation between order
/// statistics) and that of a scaled χ² fitted to their mean and variance
/// (Wilson–Hilferty's approximation of its quantile). A class of 20
/// members has no 99th percentile of its own: its largest member would
/// stand for it, and about one new member in 20 would lie beyond.
pub(crate) fn p99(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let at = 0.99 * (values.len() - 1) as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    let empirical = values[lo] + (values[hi] - values[lo]) * (at - lo as f64);
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    if mean <= 0.0 || var <= 0.0 {
        return empirical;
    }
    // mean = g·h, variance = 2·g²·h.
    let (g, h) = (var / (2.0 * mean), 2.0 * mean * mean / var);
    const Z99: f64 = 2.326_347_874;
    let c = 2.0 / (9.0 * h);
    let fitted = g * h * (1.0 - c + Z99 * c.sqrt()).max(0.0).powi(3);
    empirical.max(fitted)
}

/// Folds of `n` rows: a seeded permutation dealt round-robin.
fn folds(n: usize, k: usize, seed: u64) -> Vec<Vec<usize>> {
    use rand::{RngExt, SeedableRng};
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = rand_pcg::Pcg64Mcg::seed_from_u64(seed ^ 0x5eed_f01d);
    for i in (1..n).rev() {
        let j = rng.random_range(0..=i);
        order.swap(i, j);
    }
    let mut out = vec![Vec::new(); k.min(n).max(1)];
    let len = out.len();
    for (i, r) in order.into_iter().enumerate() {
        out[i % len].push(r);
    }
    out
}

/// The share of `rows` whose predicted class is their label.
fn accuracy(predicted: &[usize], labels: &[usize], rows: &[usize]) -> f64 {
    rows.iter().filter(|&&i| predicted[i] == labels[i]).count() as f64 / rows.len().max(1) as f64
}

/// Cross-validated accuracy of the network with `hidden` layers: trained
/// on all folds but one, scored on that one. Runs the folds on two
/// threads.
fn cv_network(
    x: &Array2<f64>,
    labels: &[usize],
    classes: usize,
    hidden: &[usize],
    hy: &ssae::Hyper,
    parts: &[Vec<usize>],
    seed: u64,
) -> f64 {
    let score = |f: usize| -> usize {
        let train: Vec<usize> = (0..parts.len()).filter(|&g| g != f).flat_map(|g| parts[g].clone()).collect();
        let train_labels: Vec<usize> = train.iter().map(|&i| labels[i]).collect();
        let net = ssae::train(&x.select(ndarray::Axis(0), &train), &train_labels, classes, hidden, hy, seed);
        let Some(ready) = net.ready(x.ncols(), classes) else { return 0 };
        let p = ready.probabilities(&x.select(ndarray::Axis(0), &parts[f]));
        parts[f].iter().enumerate().filter(|(r, i)| argmax(p.row(*r)) == labels[**i]).count()
    };
    let right: usize = on_two_threads(parts.len(), &score).into_iter().sum();
    right as f64 / parts.iter().map(Vec::len).sum::<usize>().max(1) as f64
}

/// `f(0..n)` on two threads, results in order.
fn on_two_threads<T: Send>(n: usize, f: &(dyn Fn(usize) -> T + Sync)) -> Vec<T> {
    let half = n.div_ceil(2);
    std::thread::scope(|s| {
        let second = s.spawn(|| (half..n).map(f).collect::<Vec<T>>());
        let mut first: Vec<T> = (0..half).map(f).collect();
        // A panic in the helper is a bug: re-raise it here.
        first.extend(second.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
        first
    })
}

pub(crate) fn argmax(row: ndarray::ArrayView1<f64>) -> usize {
    row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i)
}

/// What `fit` is given besides the samples.
#[derive(Clone, Debug, Default)]
pub struct FitOptions {
    pub seed: u64,
    /// The user's labels: trace name → class name. They take precedence
    /// over the groups.
    pub labels: std::collections::BTreeMap<String, String>,
    /// A model whose class names are kept where a new class matches one.
    pub from: Option<Model>,
    /// Training settings (tests shorten them).
    pub hyper: ssae::Hyper,
}

/// Learns the classes and both classifiers from `samples`.
pub fn fit(samples: &[Sample], opts: &FitOptions) -> Result<Model> {
    if samples.len() < crate::analysis::cluster::MIN_TRACES {
        anyhow::bail!(
            "{} samples: classes need at least {} (one per process of each trace, or per summary row)",
            samples.len(),
            crate::analysis::cluster::MIN_TRACES
        );
    }
    let raw: Vec<[f64; FEATURES.len()]> = samples.iter().map(|s| finite(&s.features)).collect();
    let matrix = Array2::from_shape_fn((raw.len(), FEATURES.len()), |(i, j)| raw[i][j]);
    let (mean, scale) = crate::analysis::cluster::scaling(&matrix);
    let z = standardise(&raw, &mean, &scale);
    let troubles: Vec<crate::analysis::cluster::Trouble> = samples
        .iter()
        .map(|s| crate::analysis::cluster::Trouble {
            oom_class: s.trouble.oom_class,
            leaking: s.trouble.leak == Some(crate::analysis::leak::Verdict::Leaking),
        })
        .collect();
    let grouping = crate::analysis::cluster::cluster(&raw, &troubles, opts.seed)?
        .ok_or_else(|| anyhow::anyhow!("too few samples to group"))?;
    // Labels: the user's where given, else the group's name.
    let all: Vec<usize> = (0..samples.len()).collect();
    let group_centroids = centroids(&z, &grouping.assignments, grouping.k, &all);
    let group_names: Vec<String> = (0..grouping.k)
        .map(|g| {
            let v = naming::Verdicts::of(
                samples.iter().zip(&grouping.assignments).filter(|(_, a)| **a == g).map(|(s, _)| &s.trouble),
            );
            naming::name(group_centroids[g].as_deref().unwrap_or_default(), &v)
        })
        .collect();
    let mut names: Vec<String> = Vec::new();
    let mut user_labelled = 0;
    let mut label_names: Vec<String> = Vec::with_capacity(samples.len());
    for (s, &g) in samples.iter().zip(&grouping.assignments) {
        let name = match opts.labels.get(&s.trace) {
            Some(l) => {
                user_labelled += 1;
                l.clone()
            }
            None => format!("{g}\u{0}{}", group_names[g]),
        };
        label_names.push(name);
    }
    // Groups of one name stay apart (numbered below); a user's name is one
    // class wherever it is given.
    for n in &label_names {
        if !names.contains(n) {
            names.push(n.clone());
        }
    }
    let labels: Vec<usize> = label_names.iter().map(|n| names.iter().position(|m| m == n).unwrap_or(0)).collect();
    // A group's name carries its group number before a NUL; a user's does not.
    let by_user: Vec<bool> = names.iter().map(|n| !n.contains('\u{0}')).collect();
    let mut display: Vec<String> =
        names.iter().map(|n| n.split('\u{0}').next_back().unwrap_or(n).to_string()).collect();
    number_duplicates(&mut display, &by_user);
    model::build(samples, &z, &mean, &scale, &labels, (display, by_user), &grouping, user_labelled, opts)
}

/// Two classes of one name get numbered: "healthy (1)", "healthy (2)".
/// (A user's name is kept as given, and a group named like it is
/// numbered; a number already taken is skipped.)
fn number_duplicates(names: &mut [String], by_user: &[bool]) {
    for i in 0..names.len() {
        if by_user[i] {
            continue;
        }
        let same: Vec<usize> = (0..names.len()).filter(|&j| !by_user[j] && names[j] == names[i]).collect();
        let taken_by_user = (0..names.len()).any(|j| by_user[j] && names[j] == names[i]);
        if (same.len() > 1 || taken_by_user) && same[0] == i {
            let base = names[i].clone();
            let mut n = 0;
            for &j in &same {
                let name = loop {
                    n += 1;
                    let candidate = format!("{base} ({n})");
                    if !names.contains(&candidate) {
                        break candidate;
                    }
                };
                names[j] = name;
            }
        }
    }
}

#[cfg(test)]
mod tests;
