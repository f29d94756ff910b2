//! The one product the model's training spends its time in: a row-major
//! matrix times a vector ([`Columns`]), with AVX-512 and AVX paths chosen
//! at run time and a portable one, and the dot product; and the
//! sufficient statistics of a least-squares problem ([`GramStats`]), which
//! the model and ridge both solve from.

use ndarray::{Array1, Array2, ArrayBase, Data, Ix2};

/// ndarray's dot product of two slices (its eight partial sums, in its
/// order).
pub(super) fn dot(a: &[f64], b: &[f64]) -> f64 {
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
pub(super) struct Columns {
    pub(super) d: usize,
    pub(super) lanes: usize,
    pub(super) data: Vec<f64>,
}

impl Columns {
    /// The rows of `m`, then the `extra` rows.
    pub(super) fn of(m: &Array2<f64>, extra: &[&Array1<f64>]) -> Columns {
        Self::with_lanes(m, extra, if wide_vectors() { 8 } else { 4 })
    }

    pub(super) fn with_lanes(m: &Array2<f64>, extra: &[&Array1<f64>], lanes: usize) -> Columns {
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
    pub(super) fn times(&self, w: &[f64], out: &mut [f64]) {
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
pub(super) fn wide_vectors() -> bool {
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
pub(super) unsafe fn blocks_avx512(data: &[f64], w: &[f64], out: &mut [f64]) {
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
pub(super) unsafe fn blocks_avx<const L: usize>(data: &[f64], w: &[f64], out: &mut [f64]) {
    blocks::<L>(data, w, out)
}

/// The product of [`Columns`], `L` rows at a time. The input widths of
/// the default window (7·5 columns, and 3 seasonal inputs with a known
/// period) get code compiled for their width: the loops unroll fully and
/// the tail of fewer than 8 columns runs without a branch per column
/// (it was a fifth of the product's time). Same operations, same order.
#[inline(always)]
pub(super) fn blocks<const L: usize>(data: &[f64], w: &[f64], out: &mut [f64]) {
    match w.len() {
        35 => blocks_of::<L>(data, w, out, 35),
        38 => blocks_of::<L>(data, w, out, 38),
        cols => blocks_of::<L>(data, w, out, cols),
    }
}

#[inline(always)]
pub(super) fn blocks_of<const L: usize>(data: &[f64], w: &[f64], out: &mut [f64], cols: usize) {
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
    pub(super) fn loss(&self, b: f64, waw: f64, sxw: f64, xtyw: f64) -> f64 {
        (waw + 2.0 * b * sxw - 2.0 * xtyw + self.n * b * b - 2.0 * b * self.sy + self.syy) / self.n
    }

    /// The rows whose products with w the gradient and the loss need:
    /// XᵀX, then Σxᵀ and (Xᵀy)ᵀ.
    pub(super) fn rows(&self) -> Columns {
        Columns::of(&self.gram, &[&self.sx, &self.xty])
    }
}
