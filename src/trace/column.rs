//! Event columns narrower than their values (issue 60: the analysis holds
//! every event, so each byte of a row is 100 MB of a 100 M-event trace).
//!
//! - [`Coded`]: a column of few distinct values (a trace's processes, a
//!   snapshot's streams). Each row holds a 1-byte code into the column's
//!   table of values, or a 4-byte one once the column has more than 256
//!   distinct values. A pid then costs 1 byte, not 4; a stream 1, not 8.
//! - [`Sparse`]: a column whose rows nearly all hold one value (the return
//!   code 0, the null of `device_free`). A row costs a bit; the rows with
//!   another value are kept apart, with that value.
//!
//! Both read by row as a `Vec` does (`column[i]`, a bounds-checked index),
//! so the passes read them unchanged. They are written by appending only.

use std::hash::Hash;
use std::ops::Index;

use ahash::AHashMap;

use super::event::Row;

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
    Wide(Vec<u32>),
}

impl<T> Default for Coded<T> {
    fn default() -> Self {
        Coded { values: Vec::new(), codes: Codes::Narrow(Vec::new()), index: AHashMap::new(), last: None }
    }
}

impl<T: Copy + Eq + Hash> Coded<T> {
    pub fn len(&self) -> usize {
        match &self.codes {
            Codes::Narrow(c) => c.len(),
            Codes::Wide(c) => c.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The code of `v`, added to the table when new.
    fn code_of(&mut self, v: T) -> u32 {
        if let Some((last, code)) = self.last
            && last == v
        {
            return code;
        }
        let code = match self.index.get(&v) {
            Some(&code) => code,
            None => {
                let code = self.values.len() as u32;
                self.values.push(v);
                self.index.insert(v, code);
                if code == 256
                    && let Codes::Narrow(c) = &self.codes
                {
                    self.codes = Codes::Wide(c.iter().map(|&x| u32::from(x)).collect());
                }
                code
            }
        };
        self.last = Some((v, code));
        code
    }

    pub fn push(&mut self, v: T) {
        let code = self.code_of(v);
        match &mut self.codes {
            Codes::Narrow(c) => c.push(code as u8),
            Codes::Wide(c) => c.push(code),
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
        match &mut self.codes {
            Codes::Narrow(c) if n <= c.len() => c.truncate(n),
            Codes::Wide(c) if n <= c.len() => c.truncate(n),
            _ => {
                let code = self.code_of(v);
                match &mut self.codes {
                    Codes::Narrow(c) => c.resize(n, code as u8),
                    Codes::Wide(c) => c.resize(n, code),
                }
            }
        }
    }

    pub fn try_reserve_exact(&mut self, rows: usize) -> Result<(), std::collections::TryReserveError> {
        match &mut self.codes {
            Codes::Narrow(c) => c.try_reserve_exact(rows),
            Codes::Wide(c) => c.try_reserve_exact(rows),
        }
    }

    pub fn get(&self, i: usize) -> Option<T> {
        (i < self.len()).then(|| self[i])
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = T> + '_ {
        (0..self.len()).map(|i| self[i])
    }

    /// The distinct values, in the order they first appeared.
    pub fn values(&self) -> &[T] {
        &self.values
    }

    /// The column's `rows`, in that order (a row may be taken twice).
    pub fn take_rows<R: Row>(&self, rows: &[R]) -> Self {
        let codes = match &self.codes {
            Codes::Narrow(c) => Codes::Narrow(rows.iter().map(|&r| c[r.index()]).collect()),
            Codes::Wide(c) => Codes::Wide(rows.iter().map(|&r| c[r.index()]).collect()),
        };
        Coded { values: self.values.clone(), codes, index: self.index.clone(), last: None }
    }
}

impl<T: Copy + Eq + Hash> Index<usize> for Coded<T> {
    type Output = T;

    #[inline]
    fn index(&self, i: usize) -> &T {
        match &self.codes {
            Codes::Narrow(c) => &self.values[c[i] as usize],
            Codes::Wide(c) => &self.values[c[i] as usize],
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
            let at = self.rows.binary_search(&i).unwrap_or_else(|at| at);
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
        assert!(matches!(c.codes, Codes::Wide(_)));
        assert!(c.iter().eq(want.iter().copied()));
        assert_eq!(c.values().len(), 300);
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
