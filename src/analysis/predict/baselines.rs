//! The baselines the model must beat: persistence (the score stays as
//! it is: a forecast of no change), seasonal (the score one iteration
//! period earlier, [`seasonal_index`]) and ridge, a stable least-squares
//! fit of the same windowed problem solved by Cholesky ([`RidgeFactor`]).

use ndarray::Array1;

use super::linalg::GramStats;

/// Ridge regression from the z-scored sufficient statistics: weights and
/// an unpenalised bias solving `[[XᵀX + λI, Σx], [Σxᵀ, n]] · [w; b] =
/// [Xᵀy; Σy]` by Cholesky. The matrix depends only on the inputs, so the
/// horizon steps share one factor ([`RidgeFactor::of`]) and each solves
/// its own right-hand side ([`RidgeFactor::solve`]).
pub(super) struct RidgeFactor {
    /// L stored column by column (`c[k·m + i]` = L[i][k], lower triangle).
    pub(super) c: Vec<f64>,
    pub(super) m: usize,
}

impl RidgeFactor {
    /// Cholesky A = L·Lᵀ in place, A = [[XᵀX + λI, Σx], [Σxᵀ, n]]. The
    /// updates of one column run over contiguous rows and vectorise; every
    /// entry sees the same operations in the same order as the textbook
    /// row loop. None when A is not (numerically) positive definite:
    /// nothing stable to report.
    pub(super) fn of(st: &GramStats, lambda: f64) -> Option<RidgeFactor> {
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
    pub(super) fn solve(&self, st: &GramStats) -> Option<(Array1<f64>, f64)> {
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
pub(super) const RIDGE_GRID: [f64; 6] = [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0];

/// The step whose score is the seasonal forecast of step t + k: the last
/// observed step at the same phase of the period (`period` steps).
pub(super) fn seasonal_index(t: usize, k: usize, period: usize) -> Option<usize> {
    (t + k).checked_sub(period * k.div_ceil(period))
}
