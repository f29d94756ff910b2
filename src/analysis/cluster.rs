//! Grouping traces by their problem (batch `analyze` with at least
//! [`MIN_TRACES`] traces).
//!
//! Each trace becomes a vector of summary features ([`FEATURES`]: the mean
//! score components over its steps, the share of its OOMs in each class
//! (0 without OOMs: what kind of OOM, not how many, which varies a lot
//! between runs of one workload), and the leak rate = leaked bytes / peak
//! live bytes), standardised across the
//! batch (divided by the standard deviation, but never by less than a
//! floor per feature — 0.05 for ratios — so noise in a feature that barely
//! varies is not blown up to the weight of one that separates traces). k-means (linfa-clustering, k-means++ initialisation,
//! 10 runs, seeded) is fitted for k = 1 … min(10, n − 1), and k is chosen by
//! the gap statistic of Tibshirani, Walther and Hastie (2001) — the method
//! of the classification paper in the seeds: Gap(k) = E*[log W*_k] − log W_k,
//! W_k the within-cluster sum of squares, E* over B = 20 reference data sets
//! drawn uniformly in the box aligned with the data's principal components
//! (their second method: the features are correlated), s_k = sd_k·√(1 + 1/B);
//! the smallest k with Gap(k) ≥ Gap(k+1) − s_{k+1}.
//!
//! A cluster is named from its centroid (in z-scores), by the largest
//! problem feature above +0.5:
//! fragmentation features or fragmentation OOMs → "fragmentation-bound",
//! capacity OOMs → "capacity-bound", leak rate → "leaking", small
//! allocations or size spread → "small-allocation storm", allocator-policy
//! OOMs → "allocator-policy OOMs". Where none stands out, the name says
//! what the members themselves had, since a centroid like the batch's
//! says nothing of the batch: "healthy" only where no member ran out of
//! memory or leaked, else "OOMs in M of N" (with their class where all
//! share one) or "leaking in M of N". One group (k = 1) is always named
//! that way: its centroid is the batch's mean. Everything is
//! deterministic for a seed.

use anyhow::Result;
use linfa::prelude::*;

use crate::analysis::oom::OomClass;
use linfa_clustering::KMeans;
use ndarray::{Array1, Array2, Axis};
use rand::{RngExt, SeedableRng};

/// Fewer traces than this are not clustered.
pub const MIN_TRACES: usize = 8;
const MAX_K: usize = 10;
const REFERENCES: usize = 20;
/// Above this many traces, k-means and the gap statistic run on an evenly
/// spaced sample of this size (in the caller's order), and every trace
/// then joins its nearest centroid: the choice of k needs the shape of the
/// population, not every member, and a fleet's 10 000 traces would
/// otherwise cost 200 k-means fits over all of them (30 s instead of 2).
const SAMPLE: usize = 500;

/// Feature names, in vector order.
pub const FEATURES: [&str; 10] = [
    "external_fragmentation",
    "kernel_unusable_index",
    "small_alloc_ratio",
    "size_cv",
    "large_gap_ratio",
    "utilization",
    "capacity_oom_share",
    "fragmentation_oom_share",
    "policy_oom_share",
    "leak_rate",
];

/// The smallest standard deviation a feature is divided by: 0.05 for the
/// ratios and shares, 0.1 for the size CV.
const SCALE_FLOOR: [f64; 10] = [0.05, 0.05, 0.05, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05];

/// What each feature says when it is high: a problem label, or None for a
/// feature that is good when high (utilization).
pub(crate) fn problem(feature: usize) -> Option<&'static str> {
    match FEATURES[feature] {
        "external_fragmentation" | "kernel_unusable_index" | "large_gap_ratio" | "fragmentation_oom_share" => {
            Some("fragmentation-bound")
        }
        "capacity_oom_share" => Some("capacity-bound"),
        "leak_rate" => Some("leaking"),
        "small_alloc_ratio" | "size_cv" => Some("small-allocation storm"),
        "policy_oom_share" => Some("allocator-policy OOMs"),
        _ => None,
    }
}

/// The result: a cluster per trace (in input order) and a label per cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct Clustering {
    pub k: usize,
    pub assignments: Vec<usize>,
    pub labels: Vec<String>,
    /// Gap(k) and s_k for k = 1 …, as computed.
    pub gaps: Vec<(f64, f64)>,
    /// Centroids in z-scores, one row per cluster.
    pub centroids: Vec<Vec<f64>>,
}

/// Eigenvalues and eigenvectors (columns) of a symmetric matrix, by cyclic
/// Jacobi rotations (d ≤ 10 here; written out rather than pulling in LAPACK
/// for one 10×10 matrix).
fn eigen(a: &Array2<f64>) -> (Vec<f64>, Array2<f64>) {
    let d = a.nrows();
    let mut a = a.clone();
    let mut v = Array2::<f64>::eye(d);
    for _ in 0..100 {
        let off: f64 = (0..d).map(|i| (0..d).filter(|&j| j != i).map(|j| a[[i, j]].powi(2)).sum::<f64>()).sum();
        if off < 1e-22 {
            break;
        }
        for p in 0..d {
            for q in p + 1..d {
                if a[[p, q]].abs() < 1e-300 {
                    continue;
                }
                let theta = (a[[q, q]] - a[[p, p]]) / (2.0 * a[[p, q]]);
                let t = if theta == 0.0 { 1.0 } else { theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt()) };
                let (c, s) = (1.0 / (t * t + 1.0).sqrt(), t / (t * t + 1.0).sqrt());
                for k in 0..d {
                    let (akp, akq) = (a[[k, p]], a[[k, q]]);
                    a[[k, p]] = c * akp - s * akq;
                    a[[k, q]] = s * akp + c * akq;
                }
                for k in 0..d {
                    let (apk, aqk) = (a[[p, k]], a[[q, k]]);
                    a[[p, k]] = c * apk - s * aqk;
                    a[[q, k]] = s * apk + c * aqk;
                }
                for k in 0..d {
                    let (vkp, vkq) = (v[[k, p]], v[[k, q]]);
                    v[[k, p]] = c * vkp - s * vkq;
                    v[[k, q]] = s * vkp + c * vkq;
                }
            }
        }
    }
    ((0..d).map(|i| a[[i, i]]).collect(), v)
}

/// Within-cluster sum of squares of `x` for k clusters, and the model.
fn fit(x: &Array2<f64>, k: usize, seed: u64) -> Result<(f64, Array1<usize>, Array2<f64>)> {
    // (within-cluster sum of squares, assignments, centroids)
    if k == 1 {
        let mean = x.mean_axis(Axis(0)).unwrap_or_else(|| Array1::zeros(x.ncols()));
        let w = x.rows().into_iter().map(|r| (&r - &mean).mapv(|v| v * v).sum()).sum();
        return Ok((w, Array1::zeros(x.nrows()), mean.insert_axis(Axis(0))));
    }
    let data = DatasetBase::from(x.clone());
    let rng = <rand_xoshiro::Xoshiro256Plus as rand_xoshiro::rand_core::SeedableRng>::seed_from_u64(seed);
    let model = KMeans::params_with_rng(k, rng).n_runs(10).max_n_iterations(300).tolerance(1e-8).fit(&data)?;
    let assign = model.predict(x);
    let c = model.centroids().clone();
    let w = x.rows().into_iter().zip(assign.iter()).map(|(r, &a)| (&r - &c.row(a)).mapv(|v| v * v).sum()).sum();
    Ok((w, assign, c))
}

/// The nearest centroid of each row of `x`.
fn nearest(x: &Array2<f64>, centroids: &Array2<f64>) -> Array1<usize> {
    x.rows()
        .into_iter()
        .map(|r| {
            (0..centroids.nrows())
                .min_by(|&a, &b| {
                    let d = |c: usize| (&r - &centroids.row(c)).mapv(|v| v * v).sum();
                    d(a).total_cmp(&d(b))
                })
                .unwrap_or(0)
        })
        .collect()
}

/// What one trace itself had, beside its features: the label of a group
/// in which no feature stands out.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Trouble {
    /// Its OOMs' most frequent class, if it had any.
    pub oom_class: Option<crate::analysis::oom::OomClass>,
    pub leaking: bool,
}

/// The name of a group in which no feature stands out, from its members'
/// own troubles.
fn plain_label(members: &[Trouble]) -> String {
    let n = members.len();
    let ooms: Vec<OomClass> = members.iter().filter_map(|t| t.oom_class).collect();
    if !ooms.is_empty() {
        let class =
            ooms.iter().all(|c| *c == ooms[0] && *c != OomClass::Unknown).then(|| format!(" ({})", ooms[0].name()));
        return format!("OOMs in {} of {n}{}", ooms.len(), class.unwrap_or_default());
    }
    match members.iter().filter(|t| t.leaking).count() {
        0 => "healthy".to_string(),
        m => format!("leaking in {m} of {n}"),
    }
}

/// The standardisation of [`cluster`]: each feature's mean, and its
/// standard deviation but never less than its floor ([`SCALE_FLOOR`]).
/// Non-finite values must have been replaced (by 0) before.
pub fn scaling(raw: &Array2<f64>) -> (Vec<f64>, Vec<f64>) {
    let d = raw.ncols();
    let mean = raw.mean_axis(Axis(0)).unwrap_or_else(|| Array1::zeros(d));
    let sd = raw.std_axis(Axis(0), 0.0);
    (mean.to_vec(), (0..d).map(|j| sd[j].max(SCALE_FLOOR[j])).collect())
}

/// Clusters `features` (one row per trace, [`FEATURES`] order); `troubles`
/// (the same order) name a group in which no feature stands out.
pub fn cluster(features: &[[f64; FEATURES.len()]], troubles: &[Trouble], seed: u64) -> Result<Option<Clustering>> {
    let n = features.len();
    if n < MIN_TRACES {
        return Ok(None);
    }
    let d = FEATURES.len();
    let raw = Array2::from_shape_fn((n, d), |(i, j)| if features[i][j].is_finite() { features[i][j] } else { 0.0 });
    // Standardise, but never divide by less than the feature's smallest
    // meaningful change: a feature that barely varies (noise around one
    // value) must not weigh as much as one that separates the traces.
    let (mean, scale) = scaling(&raw);
    let x = Array2::from_shape_fn((n, d), |(i, j)| (raw[[i, j]] - mean[j]) / scale[j]);
    // k-means and the gap statistic run on the principal components that
    // carry 90 % of the variance: the reference data must have the data's
    // own dimension, or tight groups keep "gaining" from every split. The
    // reference data are uniform over the box aligned with those components
    // (Tibshirani et al.'s second method).
    let centre = x.mean_axis(Axis(0)).unwrap_or_else(|| Array1::zeros(d));
    let centred = &x - &centre;
    let cov = centred.t().dot(&centred) / n as f64;
    let (values, vectors) = eigen(&cov);
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]));
    let total: f64 = values.iter().map(|v| v.max(0.0)).sum();
    let mut kept = 0;
    let mut cumulative = 0.0;
    while kept < d && (kept == 0 || cumulative < 0.9 * total) {
        cumulative += values[order[kept]].max(0.0);
        kept += 1;
    }
    let basis = Array2::from_shape_fn((d, kept), |(i, j)| vectors[[i, order[j]]]);
    let pcs = centred.dot(&basis);
    let lo = pcs.fold_axis(Axis(0), f64::INFINITY, |a, &b| a.min(b));
    let hi = pcs.fold_axis(Axis(0), f64::NEG_INFINITY, |a, &b| a.max(b));
    let kmax = MAX_K.min(n - 1);
    let sampled: Vec<usize> = (0..n.min(SAMPLE)).map(|i| i * n / n.min(SAMPLE)).collect();
    let sample = if n > SAMPLE { pcs.select(Axis(0), &sampled) } else { pcs.clone() };
    let mut rng = rand_pcg::Pcg64Mcg::seed_from_u64(seed);
    let references: Vec<Array2<f64>> = (0..REFERENCES)
        .map(|_| {
            Array2::from_shape_fn((sample.nrows(), kept), |(_, j)| {
                if hi[j] > lo[j] { rng.random_range(lo[j]..hi[j]) } else { lo[j] }
            })
        })
        .collect();
    let log = |w: f64| w.max(1e-12).ln();
    let mut gaps: Vec<(f64, f64)> = Vec::new();
    let mut fits = Vec::new();
    for k in 1..=kmax {
        let (w, assign, centroids) = fit(&sample, k, seed)?;
        let assign = if n > SAMPLE { nearest(&pcs, &centroids) } else { assign };
        // The references' fits are independent: two threads.
        let half = REFERENCES / 2;
        let (a, b) = std::thread::scope(|scope| {
            let first = scope.spawn(|| {
                references[..half].iter().map(|r| fit(r, k, seed).map(|f| log(f.0))).collect::<Result<Vec<f64>>>()
            });
            let second =
                references[half..].iter().map(|r| fit(r, k, seed).map(|f| log(f.0))).collect::<Result<Vec<f64>>>();
            (first.join().unwrap_or_else(|_| Err(anyhow::anyhow!("k-means failed"))), second)
        });
        let mut refs = a?;
        refs.extend(b?);
        let m = refs.iter().sum::<f64>() / refs.len() as f64;
        let sd = (refs.iter().map(|v| (v - m).powi(2)).sum::<f64>() / refs.len() as f64).sqrt();
        gaps.push((m - log(w), sd * (1.0 + 1.0 / REFERENCES as f64).sqrt()));
        fits.push(assign);
        // The rule needs Gap(k+1): stop once k is settled.
        if k >= 2 && gaps[k - 2].0 >= gaps[k - 1].0 - gaps[k - 1].1 {
            break;
        }
    }
    let k = (1..gaps.len()).find(|&k| gaps[k - 1].0 >= gaps[k].0 - gaps[k].1).unwrap_or(gaps.len());
    let assign = fits.swap_remove(k - 1);
    // Centroids in the standardised features, for naming.
    let centroids: Vec<Vec<f64>> = (0..k)
        .map(|c| {
            let members: Vec<usize> = (0..n).filter(|&i| assign[i] == c).collect();
            (0..d).map(|j| members.iter().map(|&i| x[[i, j]]).sum::<f64>() / members.len().max(1) as f64).collect()
        })
        .collect();
    let mut labels: Vec<String> = centroids
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let worst = (0..d).filter(|&j| problem(j).is_some()).max_by(|&a, &b| c[a].total_cmp(&c[b]));
            match (worst.and_then(problem), worst) {
                (Some(name), Some(j)) if c[j] > 0.5 => name.to_string(),
                _ => {
                    let members: Vec<Trouble> = (0..n)
                        .filter(|&i| assign[i] == k)
                        .map(|i| troubles.get(i).copied().unwrap_or_default())
                        .collect();
                    plain_label(&members)
                }
            }
        })
        .collect();
    // Two clusters with one name get numbered.
    for i in 0..labels.len() {
        let same: Vec<usize> = (0..labels.len()).filter(|&j| labels[j] == labels[i]).collect();
        if same.len() > 1 && same[0] == i {
            for (n, &j) in same.iter().enumerate() {
                labels[j] = format!("{} ({})", labels[j], n + 1);
            }
        }
    }
    Ok(Some(Clustering { k, assignments: assign.to_vec(), labels, gaps, centroids }))
}

/// Adjusted Rand index of two labelings (Hubert and Arabie), for tests and
/// for judging a clustering against known groups.
pub fn adjusted_rand_index(a: &[usize], b: &[usize]) -> f64 {
    let n = a.len();
    let ka = a.iter().max().map_or(0, |m| m + 1);
    let kb = b.iter().max().map_or(0, |m| m + 1);
    let mut table = vec![vec![0u64; kb]; ka];
    for (&x, &y) in a.iter().zip(b) {
        table[x][y] += 1;
    }
    let c2 = |v: u64| (v * v.saturating_sub(1)) as f64 / 2.0;
    let index: f64 = table.iter().flatten().map(|&v| c2(v)).sum();
    let rows: f64 = table.iter().map(|r| c2(r.iter().sum())).sum();
    let cols: f64 = (0..kb).map(|j| c2(table.iter().map(|r| r[j]).sum())).sum();
    let expected = rows * cols / c2(n as u64);
    let max = (rows + cols) / 2.0;
    if (max - expected).abs() < 1e-12 { 1.0 } else { (index - expected) / (max - expected) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_separated_groups_give_k_3_and_the_right_names() {
        // 1200 traces: above SAMPLE, so k-means runs on a sample and every
        // trace joins its nearest centroid.
        for n in [30, 1200] {
            groups_of(n);
        }
    }

    fn groups_of(n: usize) {
        let mut f = Vec::new();
        let mut truth = Vec::new();
        let mut state = 12345u64;
        let mut noise = |scale: f64| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * scale
        };
        for i in 0..n {
            let g = i % 3;
            let mut v = [0.0; FEATURES.len()];
            for x in v.iter_mut() {
                *x = noise(0.03);
            }
            v[5] += 0.9; // utilization
            match g {
                0 => {}
                1 => {
                    v[0] += 0.6;
                    v[7] += 3.0;
                    v[5] -= 0.4;
                }
                _ => v[9] += 0.6,
            }
            f.push(v);
            truth.push(g);
        }
        let c = cluster(&f, &[], 7).unwrap().unwrap();
        assert_eq!(c.k, 3, "{n} traces: gaps {:?}", c.gaps);
        assert!(adjusted_rand_index(&c.assignments, &truth) > 0.99);
        let name = |g: usize| c.labels[c.assignments[truth.iter().position(|&t| t == g).unwrap()]].clone();
        assert_eq!(
            (name(0).as_str(), name(1).as_str(), name(2).as_str()),
            ("healthy", "fragmentation-bound", "leaking")
        );
        // Deterministic for a seed.
        assert_eq!(cluster(&f, &[], 7).unwrap().unwrap(), c);
    }

    #[test]
    fn a_group_like_the_batch_is_named_for_what_its_members_had() {
        // Eight runs of one program: nothing stands out from the batch's
        // mean, which says nothing of the batch itself.
        let mut state = 99u64;
        let f: Vec<[f64; FEATURES.len()]> = (0..8)
            .map(|_| {
                let mut v = [0.0; FEATURES.len()];
                for x in v.iter_mut() {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    *x = 0.5 + ((state >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 0.01;
                }
                v
            })
            .collect();
        let oom = |class| Trouble { oom_class: Some(class), leaking: false };
        use OomClass::{Capacity, Fragmentation};
        let label = |t: &[Trouble]| {
            let c = cluster(&f, t, 3).unwrap().unwrap();
            assert_eq!(c.k, 1, "{:?}", c.gaps);
            c.labels[0].clone()
        };
        assert_eq!(label(&[oom(Fragmentation); 8]), "OOMs in 8 of 8 (fragmentation)");
        let mut mixed = vec![Trouble::default(); 8];
        mixed[2] = oom(Capacity);
        mixed[5] = oom(Fragmentation);
        assert_eq!(label(&mixed), "OOMs in 2 of 8");
        mixed[2] = Trouble { oom_class: None, leaking: true };
        mixed[5] = mixed[2];
        assert_eq!(label(&mixed), "leaking in 2 of 8");
        assert_eq!(label(&[Trouble::default(); 8]), "healthy");
    }

    #[test]
    fn too_few_traces_are_not_clustered_and_ari_is_exact() {
        assert!(cluster(&[[0.0; FEATURES.len()]; 5], &[], 1).unwrap().is_none());
        assert_eq!(adjusted_rand_index(&[0, 0, 1, 1], &[1, 1, 0, 0]), 1.0);
        assert!(adjusted_rand_index(&[0, 1, 0, 1], &[0, 0, 1, 1]) < 0.0);
    }
}
