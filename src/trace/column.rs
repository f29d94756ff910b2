//! Event columns narrower than their values (issue 60: the analysis holds
//! every event, so each byte of a row is 100 MB of a 100 M-event trace).
//!
//! - [`Coded`]: a column of few distinct values (a trace's processes, a
//!   snapshot's streams). Each row holds a code into the column's table of
//!   values: 1 byte up to 256 values, 2 up to 2¹⁶, 4 beyond while the
//!   values are fewer than a quarter of the rows; past that the rows are
//!   stored plainly. A pid then costs 1 byte, not 4; a stream 1, not 8.
//!   Coding the addresses and sizes too was tried: on 100 M synthetic
//!   events (433 k addresses, 3 M sizes, so 4-byte codes) the peak fell
//!   from 3.45 to 2.78 GB but `analyze` took 25-35 % longer, hashing every
//!   row as it was loaded and reading values through large tables.
//! - [`Sparse`]: a column whose rows nearly all hold one value (the return
//!   code 0, the null of `device_free`). A row costs a bit; the rows with
//!   another value are kept apart, with that value.
//!
//! - [`Packed`]: a column of 8-byte values that sit close together within
//!   a stretch of rows (times, addresses, sizes). Each block of 2¹⁶ rows
//!   is stored as 4-byte offsets from the block's smallest value when its
//!   values span less than 2³²; else as the lower halves with a 1-byte
//!   code of the upper half, when the block has at most 256 upper halves
//!   (a recording's device addresses beside its kernels' addresses); else
//!   plainly. A row of a time, an address and a size then costs 13 bytes,
//!   not 24. Each block is checked once, when it is full, so appending
//!   costs a comparison a row and no table.
//!
//! `Coded` and `Sparse` read by row as a `Vec` does (`column[i]`, a
//! bounds-checked index), so the passes read them unchanged. `Packed`
//! computes each value, so it reads by [`Packed::at`]. All three are
//! written by appending only.

use std::hash::Hash;
use std::ops::Index;

use ahash::AHashMap;

mod packed;
pub use packed::Packed;

/// A row number (or a position in one series' rows) as a list of them
/// stores it: 4 bytes while the rows fit, 8 beyond.
pub trait Row: Copy {
    fn at(j: usize) -> Self;
    fn index(self) -> usize;
}

impl Row for u32 {
    #[inline]
    fn at(j: usize) -> u32 {
        j as u32
    }
    #[inline]
    fn index(self) -> usize {
        self as usize
    }
}

impl Row for usize {
    #[inline]
    fn at(j: usize) -> usize {
        j
    }
    #[inline]
    fn index(self) -> usize {
        self
    }
}

/// A column of few distinct values: a code per row into a table.
#[derive(Clone, Debug)]
pub struct Coded<T> {
    values: Vec<T>,
    codes: Codes,
    /// Each value's code, for appending.
    index: AHashMap<T, u32>,
    /// The value appended last and its code: a run of one value costs a
    /// comparison a row, not a lookup.
    last: Option<(T, u32)>,
}

#[derive(Clone, Debug)]
enum Codes {
    Narrow(Vec<u8>),
    Mid(Vec<u16>),
    Wide(Vec<u32>),
    /// Too many distinct values for codes to pay (more than one in
    /// [`PLAIN_SHARE`] rows, past 2¹⁶ of them): `values` holds every row.
    Plain,
}

/// A column whose distinct values outnumber one in this many rows, once
/// they are more than 2¹⁶, stores its rows plainly: 4-byte codes, the
/// table and its index would cost more than the values.
const PLAIN_SHARE: usize = 4;

/// Applies `$body` to the codes vector, whatever its width; `$plain` when
/// the column is plain.
macro_rules! with_codes {
    ($codes:expr, $c:ident => $body:expr, plain => $plain:expr) => {
        match $codes {
            Codes::Narrow($c) => $body,
            Codes::Mid($c) => $body,
            Codes::Wide($c) => $body,
            Codes::Plain => $plain,
        }
    };
}

impl<T> Default for Coded<T> {
    fn default() -> Self {
        Coded { values: Vec::new(), codes: Codes::Narrow(Vec::new()), index: AHashMap::new(), last: None }
    }
}

impl<T: Copy + Eq + Hash> Coded<T> {
    pub fn len(&self) -> usize {
        with_codes!(&self.codes, c => c.len(), plain => self.values.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The code of `v`, added to the table when new (the codes widened
    /// when the table outgrows them). None: the column turned plain.
    fn code_of(&mut self, v: T) -> Option<u32> {
        if let Some((last, code)) = self.last
            && last == v
        {
            return Some(code);
        }
        let code = match self.index.get(&v) {
            Some(&code) => code,
            None => {
                let code = self.values.len() as u32;
                self.values.push(v);
                self.index.insert(v, code);
                self.codes = match std::mem::replace(&mut self.codes, Codes::Plain) {
                    // Wider codes keep the room reserved for the rows.
                    Codes::Narrow(c) if code == 1 << 8 => Codes::Mid(widen(c)),
                    Codes::Mid(c) if code == 1 << 16 => Codes::Wide(widen(c)),
                    Codes::Wide(c) if code >= 1 << 16 && self.values.len() * PLAIN_SHARE > c.len() => {
                        self.turn_plain(c);
                        return None;
                    }
                    codes => codes,
                };
                code
            }
        };
        self.last = Some((v, code));
        Some(code)
    }

    /// Replaces the table by the rows' values (the room reserved for the
    /// rows kept).
    fn turn_plain(&mut self, codes: Vec<u32>) {
        let mut rows = Vec::new();
        let _ = rows.try_reserve_exact(codes.capacity());
        rows.extend(codes.iter().map(|&c| self.values[c as usize]));
        self.values = rows;
        self.index = AHashMap::new();
        self.last = None;
        self.codes = Codes::Plain;
    }

    pub fn push(&mut self, v: T) {
        if matches!(self.codes, Codes::Plain) {
            self.values.push(v);
            return;
        }
        match (self.code_of(v), &mut self.codes) {
            (Some(code), Codes::Narrow(c)) => c.push(code as u8),
            (Some(code), Codes::Mid(c)) => c.push(code as u16),
            (Some(code), Codes::Wide(c)) => c.push(code),
            (_, Codes::Plain) | (None, _) => self.values.push(v),
        }
    }

    pub fn extend_from_slice(&mut self, values: &[T]) {
        for &v in values {
            self.push(v);
        }
    }

    /// Appends `v` until the column has `n` rows (shortens it to `n` when
    /// longer).
    pub fn resize(&mut self, n: usize, v: T) {
        if n <= self.len() {
            with_codes!(&mut self.codes, c => c.truncate(n), plain => self.values.truncate(n));
        } else {
            while self.len() < n {
                self.push(v);
            }
        }
    }

    pub fn try_reserve_exact(&mut self, rows: usize) -> Result<(), std::collections::TryReserveError> {
        with_codes!(&mut self.codes, c => c.try_reserve_exact(rows), plain => self.values.try_reserve_exact(rows))
    }

    pub fn get(&self, i: usize) -> Option<T> {
        (i < self.len()).then(|| self[i])
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = T> + '_ {
        (0..self.len()).map(|i| self[i])
    }

    /// Rows `from..from + out.len()` into `out`, the codes' width matched
    /// once. Panics past the end.
    pub fn read_into(&self, from: usize, out: &mut [T]) {
        let rows = from..from + out.len();
        with_codes!(&self.codes, c => {
            out.iter_mut().zip(&c[rows]).for_each(|(o, &k)| *o = self.values[k as usize]);
        }, plain => out.copy_from_slice(&self.values[rows]))
    }

    /// The column's `rows`, in that order (a row may be taken twice).
    pub fn take_rows<R: Row>(&self, rows: &[R]) -> Self {
        fn take<C: Copy, R: Row>(c: &[C], rows: &[R]) -> Vec<C> {
            rows.iter().map(|&r| c[r.index()]).collect()
        }
        let (values, codes) = match &self.codes {
            Codes::Narrow(c) => (self.values.clone(), Codes::Narrow(take(c, rows))),
            Codes::Mid(c) => (self.values.clone(), Codes::Mid(take(c, rows))),
            Codes::Wide(c) => (self.values.clone(), Codes::Wide(take(c, rows))),
            Codes::Plain => (take(&self.values, rows), Codes::Plain),
        };
        Coded { values, codes, index: self.index.clone(), last: None }
    }

    /// Bytes a row costs: its code's width, or the value's in a plain
    /// column.
    #[cfg(test)]
    pub fn row_bytes(&self) -> usize {
        match &self.codes {
            Codes::Narrow(_) => 1,
            Codes::Mid(_) => 2,
            Codes::Wide(_) => 4,
            Codes::Plain => std::mem::size_of::<T>(),
        }
    }

    /// The values in the table (0 for a plain column): every value the
    /// column has held, including those of rows a take or a shortening
    /// left out, so not the distinct values of its rows.
    #[cfg(test)]
    pub fn table_len(&self) -> usize {
        if matches!(self.codes, Codes::Plain) { 0 } else { self.values.len() }
    }
}

/// Codes in a wider integer, with the same room for rows.
fn widen<A: Copy, B: From<A>>(codes: Vec<A>) -> Vec<B> {
    let mut wide = Vec::with_capacity(codes.capacity());
    wide.extend(codes.into_iter().map(B::from));
    wide
}

impl<T: Copy + Eq + Hash> Index<usize> for Coded<T> {
    type Output = T;

    #[inline(always)]
    fn index(&self, i: usize) -> &T {
        match &self.codes {
            Codes::Narrow(c) => &self.values[c[i] as usize],
            Codes::Mid(c) => &self.values[c[i] as usize],
            Codes::Wide(c) => &self.values[c[i] as usize],
            Codes::Plain => &self.values[i],
        }
    }
}

impl<T: Copy + Eq + Hash> From<Vec<T>> for Coded<T> {
    fn from(values: Vec<T>) -> Self {
        let mut c = Coded::default();
        let _ = c.try_reserve_exact(values.len());
        c.extend_from_slice(&values);
        c
    }
}

/// Equal when every row is (the tables may differ in order).
impl<T: Copy + Eq + Hash> PartialEq for Coded<T> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl<T: Copy + Eq + Hash> PartialEq<Vec<T>> for Coded<T> {
    fn eq(&self, other: &Vec<T>) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter().copied())
    }
}

/// A column whose rows nearly all hold `fill`: a bit per row says which do
/// not, and those rows' values are kept apart, in row order.
#[derive(Clone, Debug, PartialEq)]
pub struct Sparse<T> {
    fill: T,
    len: usize,
    /// Bit `i` set: row `i` holds another value than `fill`.
    bits: Vec<u64>,
    rows: Vec<usize>,
    values: Vec<T>,
}

impl<T: Copy + PartialEq> Sparse<T> {
    /// An empty column whose rows hold `fill` unless given another value.
    pub fn new(fill: T) -> Self {
        Sparse { fill, len: 0, bits: Vec::new(), rows: Vec::new(), values: Vec::new() }
    }

    #[cfg(test)]
    pub fn from_vec(values: Vec<T>, fill: T) -> Self {
        let mut s = Sparse::new(fill);
        let _ = s.try_reserve_exact(values.len());
        s.extend_from_slice(&values);
        s
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The rows that hold another value than `fill`.
    #[cfg(test)]
    pub fn others(&self) -> usize {
        self.rows.len()
    }

    pub fn push(&mut self, v: T) {
        let i = self.len;
        if i % 64 == 0 {
            self.bits.push(0);
        }
        if v != self.fill {
            self.bits[i / 64] |= 1 << (i % 64);
            self.rows.push(i);
            self.values.push(v);
        }
        self.len += 1;
    }

    pub fn extend_from_slice(&mut self, values: &[T]) {
        for &v in values {
            self.push(v);
        }
    }

    /// Appends `fill` until the column has `n` rows (shortens it to `n`
    /// when longer).
    pub fn resize(&mut self, n: usize) {
        if n < self.len {
            let keep = self.rows.partition_point(|&r| r < n);
            self.rows.truncate(keep);
            self.values.truncate(keep);
            self.bits.truncate(n.div_ceil(64));
            if n % 64 != 0
                && let Some(last) = self.bits.last_mut()
            {
                *last &= (1 << (n % 64)) - 1;
            }
        } else {
            self.bits.resize(n.div_ceil(64), 0);
        }
        self.len = n;
    }

    pub fn try_reserve_exact(&mut self, rows: usize) -> Result<(), std::collections::TryReserveError> {
        self.bits.try_reserve_exact((self.len + rows).div_ceil(64).saturating_sub(self.bits.len()))
    }

    pub fn get(&self, i: usize) -> Option<T> {
        (i < self.len).then(|| self[i])
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = T> + '_ {
        (0..self.len).map(|i| self[i])
    }

    /// The column's `rows`, in that order (a row may be taken twice).
    pub fn take_rows<R: Row>(&self, rows: &[R]) -> Self {
        let mut s = Sparse::new(self.fill);
        let _ = s.try_reserve_exact(rows.len());
        for &r in rows {
            s.push(self[r.index()]);
        }
        s
    }
}

impl<T: Copy + PartialEq> PartialEq<Vec<T>> for Sparse<T> {
    fn eq(&self, other: &Vec<T>) -> bool {
        self.len == other.len() && self.iter().eq(other.iter().copied())
    }
}

impl<T: Copy + PartialEq> Index<usize> for Sparse<T> {
    type Output = T;

    #[inline]
    fn index(&self, i: usize) -> &T {
        assert!(i < self.len, "row {i} of a column of {} rows", self.len);
        if self.bits[i / 64] >> (i % 64) & 1 == 0 {
            &self.fill
        } else {
            // The bit is set only for rows kept apart.
            let at = self.rows.binary_search(&i).expect("a set bit names a row kept apart");
            &self.values[at]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_coded_column_reads_back_what_was_written_across_its_widening() {
        let mut c: Coded<u64> = Coded::default();
        let mut want = Vec::new();
        // 300 distinct values: the codes widen at the 257th.
        for i in 0..3000u64 {
            let v = (i * 7919) % 300 + 1_000_000;
            c.push(v);
            want.push(v);
        }
        assert_eq!(c.len(), 3000);
        assert!(matches!(c.codes, Codes::Mid(_)));
        assert_eq!((c.row_bytes(), c.table_len()), (2, 300));
        assert!(c.iter().eq(want.iter().copied()));
        let mut stretch = vec![0; 7];
        c.read_into(2993, &mut stretch);
        assert_eq!(stretch, want[2993..]);
        assert_eq!(c.get(2999), Some(want[2999]));
        assert_eq!(c.get(3000), None);
        let rows: Vec<u32> = vec![5, 5, 2999, 0];
        let taken = c.take_rows(&rows);
        assert!(taken.iter().eq([want[5], want[5], want[2999], want[0]]));
        assert_eq!(Coded::from(want.clone()), c);
        // A run and a resize keep the narrow codes.
        let mut n: Coded<u32> = Coded::default();
        n.resize(4, 9);
        n.extend_from_slice(&[1, 2, 1]);
        assert!(matches!(n.codes, Codes::Narrow(_)));
        assert!(n.iter().eq([9, 9, 9, 9, 1, 2, 1]));
        n.resize(5, 0);
        assert!(n.iter().eq([9, 9, 9, 9, 1]));
        // Tables in another order read as equal.
        let (mut a, mut b) = (Coded::default(), Coded::default());
        a.extend_from_slice(&[1u32, 2]);
        b.push(2u32);
        b.resize(0, 0);
        b.extend_from_slice(&[1, 2]);
        assert_eq!(a, b);
        b.push(3);
        assert_ne!(a, b);
    }

    /// Past 2¹⁶ distinct values the codes take 4 bytes while the values
    /// are few against the rows, and the column turns plain when they are
    /// not: every row reads back the same through each change.
    #[test]
    fn a_coded_column_widens_to_4_bytes_then_turns_plain() {
        let mut c: Coded<u64> = Coded::default();
        let mut want = Vec::new();
        // 300 000 rows of 1 000 values, then 69 000 new ones once each:
        // 4-byte codes, as the values stay fewer than a quarter of the rows.
        for i in 0..300_000u64 {
            c.push(i % 1000 * 3);
            want.push(i % 1000 * 3);
        }
        for v in 1000..70_000u64 {
            c.push(v * 3);
            want.push(v * 3);
        }
        assert_eq!((c.row_bytes(), c.table_len()), (4, 70_000));
        assert!(c.iter().eq(want.iter().copied()));
        let mut stretch = vec![0; 1000];
        c.read_into(299_500, &mut stretch);
        assert_eq!(stretch, want[299_500..300_500]);
        // 100 000 new values in a row: more than one in 4 rows are
        // distinct, so it turns plain.
        for v in 0..100_000u64 {
            c.push(v * 3 + 1);
            want.push(v * 3 + 1);
        }
        assert_eq!((c.row_bytes(), c.table_len()), (8, 0));
        assert!(c.iter().eq(want.iter().copied()));
        c.read_into(299_500, &mut stretch);
        assert_eq!(stretch, want[299_500..300_500]);
        let rows: Vec<usize> = vec![449_999, 0, 350_000];
        assert!(c.take_rows(&rows).iter().eq([want[449_999], want[0], want[350_000]]));
        c.resize(10, 0);
        assert!(c.iter().eq(want[..10].iter().copied()));
        c.resize(12, 5);
        assert_eq!((c[10], c[11], c.len()), (5, 5, 12));
    }

    #[test]
    fn a_sparse_column_reads_back_what_was_written() {
        let mut want: Vec<i32> = vec![0; 200];
        for (i, v) in [(0, 2), (63, -1), (64, 5), (130, 7), (199, 1)] {
            want[i] = v;
        }
        let s = Sparse::from_vec(want.clone(), 0);
        assert_eq!((s.len(), s.others()), (200, 5));
        assert!(s.iter().eq(want.iter().copied()));
        assert_eq!((s.get(64), s.get(65), s.get(200)), (Some(5), Some(0), None));
        let taken = s.take_rows(&[199usize, 1, 64, 64]);
        assert!(taken.iter().eq([1, 0, 5, 5]));
        assert_eq!(taken.others(), 3);
        // Shortened and grown again: the rows cut off are gone.
        let mut r = s.clone();
        r.resize(100);
        assert!(r.iter().eq(want[..100].iter().copied()));
        r.resize(200);
        assert_eq!(r.others(), 3);
        assert_eq!((r[130], r[199], r[64]), (0, 0, 5));
        r.push(4);
        assert_eq!((r.len(), r[200]), (201, 4));
        // Another fill.
        let d = Sparse::from_vec(vec![u64::MAX, 3, u64::MAX], u64::MAX);
        assert_eq!((d.others(), d[1], d[2]), (1, 3, u64::MAX));
    }

    #[test]
    #[should_panic(expected = "row 3 of a column of 3 rows")]
    fn a_sparse_column_refuses_a_row_beyond_its_end() {
        let s = Sparse::from_vec(vec![0i32, 0, 0], 0);
        let _ = s[3];
    }
}
