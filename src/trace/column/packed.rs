//! [`Packed`]: a column of 8-byte values that sit close together within a
//! stretch of rows (the module docs of [`super`]).

use ahash::AHashMap;

use super::Row;

/// Rows in a block of a [`Packed`] column: 2¹⁶, so a block of offsets is
/// 256 KiB and a 100 M-row column has 1 526 blocks to look up.
const BLOCK_BITS: u32 = 16;
const BLOCK: usize = 1 << BLOCK_BITS;

/// A column of `u64` stored in blocks of [`BLOCK`] rows, each as narrow as
/// its values allow ([`super`]'s docs). The last, unfilled block is kept
/// plainly until it fills. A full block's rows keep their lower 4 bytes
/// (an offset, or the lower half) in one vector, so reading a row of an
/// offsets block is two loads and an add.
#[derive(Clone, Debug, Default)]
pub struct Packed {
    /// How each full block's rows are read.
    blocks: Vec<Meta>,
    /// Each row of the full blocks: its offset from the block's base, or
    /// its lower half.
    lows: Vec<u32>,
    /// A halves block's upper halves: [`HALVES`] slots a block.
    uppers: Vec<u32>,
    /// A halves block's rows: the code of their upper half.
    codes: Vec<u8>,
    /// A plain block's rows: their upper half.
    highs: Vec<u32>,
    /// The rows after the last full block.
    open: Vec<u64>,
}

/// Upper halves a halves block may have.
const HALVES: usize = 256;

#[derive(Clone, Copy, Debug)]
struct Meta {
    form: Form,
    /// Offsets: the block's smallest value.
    base: u64,
    /// Halves, plain: the block's place among the blocks of its form.
    nth: u32,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Form {
    /// Each row is `base + low`.
    Offsets,
    /// Each row is `uppers[code] << 32 | low`.
    Halves,
    /// Each row is `high << 32 | low`.
    Plain,
}

impl Packed {
    pub fn len(&self) -> usize {
        self.lows.len() + self.open.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub fn push(&mut self, v: u64) {
        if self.open.capacity() == 0 {
            self.open.reserve_exact(BLOCK);
        }
        self.open.push(v);
        if self.open.len() == BLOCK {
            self.seal();
        }
    }

    /// Stores the full open block in its narrowest form.
    #[inline(never)]
    fn seal(&mut self) {
        let rows = &self.open;
        let (lo, hi) = (rows.iter().copied().min().unwrap_or(0), rows.iter().copied().max().unwrap_or(0));
        let meta = if hi - lo <= u32::MAX as u64 {
            self.lows.extend(rows.iter().map(|&v| (v - lo) as u32));
            Meta { form: Form::Offsets, base: lo, nth: 0 }
        } else if let Some(uppers) = halves(rows, &mut self.codes) {
            let nth = (self.uppers.len() / HALVES) as u32;
            self.uppers.extend_from_slice(&uppers);
            self.uppers.resize(self.uppers.len() + HALVES - uppers.len(), 0);
            self.lows.extend(rows.iter().map(|&v| v as u32));
            Meta { form: Form::Halves, base: 0, nth }
        } else {
            let nth = (self.highs.len() / BLOCK) as u32;
            self.highs.extend(rows.iter().map(|&v| (v >> 32) as u32));
            self.lows.extend(rows.iter().map(|&v| v as u32));
            Meta { form: Form::Plain, base: 0, nth }
        };
        self.blocks.push(meta);
        self.open.clear();
    }

    pub fn extend_from_slice(&mut self, mut values: &[u64]) {
        while !values.is_empty() {
            if self.open.capacity() == 0 {
                self.open.reserve_exact(BLOCK);
            }
            let (now, later) = values.split_at(values.len().min(BLOCK - self.open.len()));
            self.open.extend_from_slice(now);
            if self.open.len() == BLOCK {
                self.seal();
            }
            values = later;
        }
    }

    /// Room for `rows` more rows (their lower 4 bytes; a block's other
    /// bytes are added when it fills), so the column does not grow by
    /// doubling.
    pub fn try_reserve_exact(&mut self, rows: usize) -> Result<(), std::collections::TryReserveError> {
        // Saturating: an impossible count fails in the reservation, as a
        // Vec's does, instead of wrapping.
        let full = self.len().saturating_add(rows) / BLOCK * BLOCK;
        self.lows.try_reserve_exact(full.saturating_sub(self.lows.len()))?;
        self.blocks.try_reserve_exact(full / BLOCK - self.blocks.len())
    }

    /// Row `i`'s value. Panics past the end, as indexing a `Vec` does.
    /// Inlined in every pass's loop.
    #[inline(always)]
    pub fn at(&self, i: usize) -> u64 {
        let Some(m) = self.blocks.get(i >> BLOCK_BITS) else {
            return self.open_at(i);
        };
        let low = self.lows[i] as u64;
        match m.form {
            Form::Offsets => m.base + low,
            Form::Halves => {
                let code = self.codes[m.nth as usize * BLOCK + (i & (BLOCK - 1))] as usize;
                (self.uppers[m.nth as usize * HALVES + code] as u64) << 32 | low
            }
            Form::Plain => (self.highs[m.nth as usize * BLOCK + (i & (BLOCK - 1))] as u64) << 32 | low,
        }
    }

    #[inline]
    fn open_at(&self, i: usize) -> u64 {
        match self.open.get(i.wrapping_sub(self.lows.len())) {
            Some(&v) => v,
            None => beyond_the_end(i, self.len()),
        }
    }

    pub fn get(&self, i: usize) -> Option<u64> {
        (i < self.len()).then(|| self.at(i))
    }

    pub fn first(&self) -> Option<u64> {
        self.get(0)
    }

    pub fn last(&self) -> Option<u64> {
        self.len().checked_sub(1).map(|i| self.at(i))
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = u64> + DoubleEndedIterator + Clone + '_ {
        (0..self.len()).map(|i| self.at(i))
    }

    /// Rows `from..from + out.len()` into `out`, a block's form read once
    /// for all its rows there (reading a stretch of rows one by one looks
    /// the form up at each). Panics past the end.
    pub fn read_into(&self, from: usize, out: &mut [u64]) {
        let end = from + out.len();
        if end > self.len() {
            beyond_the_end(end - 1, self.len());
        }
        let (mut i, mut done) = (from, 0);
        while i < end {
            let Some(m) = self.blocks.get(i >> BLOCK_BITS) else {
                let o = i - self.lows.len();
                out[done..].copy_from_slice(&self.open[o..o + end - i]);
                return;
            };
            let stop = end.min(((i >> BLOCK_BITS) + 1) << BLOCK_BITS);
            let (dst, lows) = (&mut out[done..done + stop - i], &self.lows[i..stop]);
            let at = m.nth as usize * BLOCK + (i & (BLOCK - 1));
            match m.form {
                Form::Offsets => dst.iter_mut().zip(lows).for_each(|(d, &l)| *d = m.base + l as u64),
                Form::Halves => {
                    let uppers = &self.uppers[m.nth as usize * HALVES..][..HALVES];
                    let codes = &self.codes[at..at + dst.len()];
                    for ((d, &l), &c) in dst.iter_mut().zip(lows).zip(codes) {
                        *d = (uppers[c as usize] as u64) << 32 | l as u64;
                    }
                }
                Form::Plain => {
                    let highs = &self.highs[at..at + dst.len()];
                    for ((d, &l), &h) in dst.iter_mut().zip(lows).zip(highs) {
                        *d = (h as u64) << 32 | l as u64;
                    }
                }
            }
            done += stop - i;
            i = stop;
        }
    }

    /// The first row for which `pred` is false, the column being
    /// partitioned by it (true, then false), as `slice::partition_point`.
    pub fn partition_point(&self, mut pred: impl FnMut(u64) -> bool) -> usize {
        let (mut lo, mut hi) = (0, self.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if pred(self.at(mid)) { lo = mid + 1 } else { hi = mid }
        }
        lo
    }

    /// The column's `rows`, in that order (a row may be taken twice).
    pub fn take_rows<R: Row>(&self, rows: &[R]) -> Self {
        let mut p = Packed::default();
        let _ = p.try_reserve_exact(rows.len());
        for &r in rows {
            p.push(self.at(r.index()));
        }
        p
    }

    /// Bytes a full block's row takes, block by block.
    #[cfg(test)]
    fn forms(&self) -> Vec<usize> {
        self.blocks
            .iter()
            .map(|m| match m.form {
                Form::Offsets => 4,
                Form::Halves => 5,
                Form::Plain => 8,
            })
            .collect()
    }

    /// Bytes the rows take (the open block counted at 8 a row).
    #[cfg(test)]
    pub fn row_bytes(&self) -> usize {
        self.forms().iter().sum::<usize>() * BLOCK + self.open.len() * 8
    }
}

/// A block's upper halves (at most [`HALVES`]), each row's code into them
/// appended to `codes`; None, with `codes` as it was, when it has more.
fn halves(rows: &[u64], codes: &mut Vec<u8>) -> Option<Vec<u32>> {
    let mut uppers: Vec<u32> = Vec::new();
    let mut index: AHashMap<u32, u8> = AHashMap::new();
    let mut last: Option<(u32, u8)> = None;
    let before = codes.len();
    for &v in rows {
        let upper = (v >> 32) as u32;
        let code = match last {
            Some((u, c)) if u == upper => c,
            _ => {
                // A short table is searched, a long one looked up.
                let known = if uppers.len() <= 16 {
                    uppers.iter().position(|&u| u == upper).map(|c| c as u8)
                } else {
                    index.get(&upper).copied()
                };
                match known {
                    Some(c) => c,
                    None if uppers.len() < HALVES => {
                        let c = uppers.len() as u8;
                        uppers.push(upper);
                        index.insert(upper, c);
                        c
                    }
                    None => {
                        codes.truncate(before);
                        return None;
                    }
                }
            }
        };
        last = Some((upper, code));
        codes.push(code);
    }
    Some(uppers)
}

#[cold]
#[inline(never)]
fn beyond_the_end(i: usize, len: usize) -> ! {
    panic!("row {i} of a column of {len} rows")
}

impl From<Vec<u64>> for Packed {
    fn from(values: Vec<u64>) -> Self {
        values.into_iter().collect()
    }
}

impl FromIterator<u64> for Packed {
    fn from_iter<I: IntoIterator<Item = u64>>(iter: I) -> Self {
        let mut p = Packed::default();
        for v in iter {
            p.push(v);
        }
        p
    }
}

/// Equal when every row is (blocks pack alike, so this compares rows).
impl PartialEq for Packed {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl PartialEq<Vec<u64>> for Packed {
    fn eq(&self, other: &Vec<u64>) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three blocks in each of the three forms and an open block: every
    /// row reads back, by row, in order, by search and by take.
    #[test]
    fn a_packed_column_reads_back_each_form_of_block() {
        let mut want: Vec<u64> = Vec::new();
        // Times: a block of offsets from 1.7e18.
        want.extend((0..BLOCK as u64).map(|i| 1_700_000_000_000_000_000 + i * 977));
        // Device addresses beside kernel addresses: two upper halves.
        want.extend((0..BLOCK as u64).map(|i| if i % 3 == 0 { 0x5555_0000 + i } else { 0x7f00_0000_0000 + i * 4096 }));
        // 300 upper halves: plain.
        want.extend((0..BLOCK as u64).map(|i| (i % 300) << 32 | i));
        // An open block of 10 rows, one at the edge of u64.
        want.extend([u64::MAX, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
        let p = Packed::from(want.clone());
        assert_eq!(p.len(), want.len());
        assert_eq!(p.forms(), [4, 5, 8]);
        assert_eq!(p.row_bytes(), 17 * BLOCK + 80);
        assert!(p.iter().eq(want.iter().copied()));
        assert!(p.iter().rev().eq(want.iter().rev().copied()));
        assert_eq!((p.first(), p.last(), p.get(want.len())), (Some(want[0]), Some(8), None));
        assert_eq!(p, want);
        // Appended in pieces that straddle the blocks: the same blocks.
        let mut q = Packed::default();
        for piece in want.chunks(10_000) {
            q.extend_from_slice(piece);
        }
        assert_eq!((q.forms(), q.len()), (p.forms(), p.len()));
        assert_eq!(q, p);
        // A sorted column searches as a slice does.
        let sorted = Packed::from(want[..BLOCK].to_vec());
        for t in [0, want[0], want[0] + 977 * 5, want[0] + 977 * 5 + 1, u64::MAX] {
            assert_eq!(sorted.partition_point(|v| v < t), want[..BLOCK].partition_point(|&v| v < t), "{t}");
        }
        let rows: Vec<u32> = vec![3 * BLOCK as u32 + 9, 0, BLOCK as u32 + 3, 2 * BLOCK as u32 + 299, 0];
        let taken = p.take_rows(&rows);
        assert!(taken.iter().eq(rows.iter().map(|&r| want[r as usize])));
        // Read a stretch at a time, stretches that straddle the blocks and
        // end in the open one.
        for (from, n) in [(0, want.len()), (BLOCK - 3, 7), (BLOCK + 5, 2 * BLOCK), (3 * BLOCK - 1, 11), (17, 0)] {
            let mut out = vec![0; n];
            p.read_into(from, &mut out);
            assert_eq!(out, want[from..from + n], "{from} + {n}");
        }
    }

    #[test]
    #[should_panic(expected = "row 70000 of a column of 70000 rows")]
    fn a_packed_column_refuses_a_stretch_beyond_its_end() {
        let p = Packed::from(vec![1; 70_000]);
        p.read_into(69_990, &mut [0; 11]);
    }

    /// A block of offsets spans at most 2³²-1: one more and it stores halves.
    #[test]
    fn a_packed_block_takes_offsets_up_to_a_span_of_2_to_the_32() {
        let mut fits = vec![5u64; BLOCK];
        fits[7] = 5 + u32::MAX as u64;
        assert_eq!(Packed::from(fits.clone()).row_bytes(), 4 * BLOCK);
        fits[7] += 1;
        let p = Packed::from(fits.clone());
        assert_eq!(p.row_bytes(), 5 * BLOCK);
        assert!(p.iter().eq(fits.iter().copied()));
    }

    /// A reservation past what memory can address is an error, not a
    /// wrapped count.
    #[test]
    fn a_packed_column_refuses_an_impossible_reservation() {
        let mut p = Packed::from(vec![7; 10]);
        assert!(p.try_reserve_exact(usize::MAX).is_err());
        assert_eq!((p.len(), p.at(9)), (10, 7));
    }

    #[test]
    #[should_panic(expected = "row 70000 of a column of 70000 rows")]
    fn a_packed_column_refuses_a_row_beyond_its_end() {
        let p = Packed::from(vec![1; 70_000]);
        let _ = p.at(70_000);
    }
}
