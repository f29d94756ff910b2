//! The replay's ordered map of live blocks, address → size: a B-tree of
//! two levels with wide leaves, and cursors.
//!
//! Each block placed or freed asks for its neighbours (the gaps on either
//! side change), so with `std`'s `BTreeMap` one placement cost four descents
//! of the tree (the overlap check, the block before, the block after, the
//! insertion) and one free three (removal, before, after): on a 4 M-event
//! trace those descents and the moves of keys within nodes were about a
//! quarter of `analyze` (issue 15: "a B-tree with cursors"). Here one
//! binary search over the leaves' first keys and one inside a leaf find a
//! position; [`LiveMap::insert_between`] and [`LiveMap::remove_between`]
//! read both neighbours from it. Leaves hold up to [`LEAF`] entries, sorted,
//! so neighbours are usually in the same leaf, and a leaf of 64 entries is
//! 1 KiB that an insertion shifts within the cache. std has no cursors on
//! stable Rust, and no crate we know offers this pair of operations on a
//! map without more machinery than the replay needs.

/// Most entries a leaf holds; a fuller one splits in two.
const LEAF: usize = 64;

/// A position: leaf `l`, entry `i`. Normalised: `i` < the leaf's length,
/// or `l` = the number of leaves (the end).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pos {
    l: usize,
    i: usize,
}

/// Address → size, ordered by address.
#[derive(Clone, Debug, Default)]
pub struct LiveMap {
    /// Non-empty sorted runs; every key of a leaf is below every key of
    /// the next.
    leaves: Vec<Vec<(u64, u64)>>,
    /// The first key of each leaf.
    firsts: Vec<u64>,
    len: usize,
}

impl LiveMap {
    pub fn new() -> LiveMap {
        LiveMap::default()
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn clear(&mut self) {
        self.leaves.clear();
        self.firsts.clear();
        self.len = 0;
    }

    /// The first position whose key is ≥ `key`.
    fn lower_bound(&self, key: u64) -> Pos {
        let l = self.firsts.partition_point(|&f| f <= key);
        if l == 0 {
            return Pos { l: 0, i: 0 };
        }
        let leaf = &self.leaves[l - 1];
        let i = leaf.partition_point(|e| e.0 < key);
        if i < leaf.len() { Pos { l: l - 1, i } } else { Pos { l, i: 0 } }
    }

    fn at(&self, p: Pos) -> Option<(u64, u64)> {
        self.leaves.get(p.l).map(|leaf| leaf[p.i])
    }

    /// The entry just before position `p`.
    fn before_pos(&self, p: Pos) -> Option<(u64, u64)> {
        if p.i > 0 {
            Some(self.leaves[p.l][p.i - 1])
        } else if p.l > 0 {
            self.leaves[p.l - 1].last().copied()
        } else {
            None
        }
    }

    /// The size of the block at `key`.
    #[cfg(test)]
    pub fn get(&self, key: u64) -> Option<u64> {
        self.at(self.lower_bound(key)).filter(|e| e.0 == key).map(|e| e.1)
    }

    /// The last entry whose key is < `key`.
    pub fn before(&self, key: u64) -> Option<(u64, u64)> {
        self.before_pos(self.lower_bound(key))
    }

    /// The first entry whose key is ≥ `key`.
    pub fn at_or_after(&self, key: u64) -> Option<(u64, u64)> {
        self.at(self.lower_bound(key))
    }

    /// Sets `key` to `value`; the value it had.
    pub fn insert(&mut self, key: u64, value: u64) -> Option<u64> {
        let p = self.lower_bound(key);
        if let Some(leaf) = self.leaves.get_mut(p.l)
            && leaf[p.i].0 == key
        {
            return Some(std::mem::replace(&mut leaf[p.i].1, value));
        }
        self.insert_at(p, key, value);
        None
    }

    /// Inserts `key` → `value` when no key lies in [`key`, `end`), and
    /// returns the entries before and after it: the last key < `key` and
    /// the first key ≥ `end` (one descent). When some key does lie in
    /// [`key`, `end`), nothing is inserted and `Err` comes back.
    #[allow(clippy::type_complexity)]
    pub fn insert_between(
        &mut self,
        key: u64,
        end: u64,
        value: u64,
    ) -> Result<(Option<(u64, u64)>, Option<(u64, u64)>), ()> {
        let p = self.lower_bound(key);
        let next = self.at(p);
        // The next key is ≥ `key`: a clash when it lies before `end`, or is
        // `key` itself (a zero-sized block, or `end` ≤ `key`).
        if next.is_some_and(|(k, _)| k < end || k == key) {
            return Err(());
        }
        let prev = self.before_pos(p);
        self.insert_at(p, key, value);
        Ok((prev, next))
    }

    /// Inserts at `p`, the lower bound of `key`, which is not present.
    fn insert_at(&mut self, p: Pos, key: u64, value: u64) {
        self.len += 1;
        if self.leaves.is_empty() {
            self.leaves.push(vec![(key, value)]);
            self.firsts.push(key);
            return;
        }
        // At a leaf's start (other than the first leaf's), the key goes at
        // the end of the leaf before: the first keys stay as they are.
        let (l, i) = match p {
            Pos { l: 0, i: 0 } => (0, 0),
            Pos { l, i: 0 } => (l - 1, self.leaves[l - 1].len()),
            Pos { l, i } => (l, i),
        };
        let leaf = &mut self.leaves[l];
        leaf.insert(i, (key, value));
        if i == 0 {
            self.firsts[l] = key;
        }
        if leaf.len() > LEAF {
            let right = leaf.split_off(leaf.len() / 2);
            self.firsts.insert(l + 1, right[0].0);
            self.leaves.insert(l + 1, right);
        }
    }

    /// Removes `key`; its value.
    pub fn remove(&mut self, key: u64) -> Option<u64> {
        self.remove_between(key).map(|(v, _, _)| v)
    }

    /// Removes `key` and returns its value with the entries that are now
    /// its neighbours: the last key < `key` and the first key > `key` (one
    /// descent).
    #[allow(clippy::type_complexity)]
    pub fn remove_between(&mut self, key: u64) -> Option<(u64, Option<(u64, u64)>, Option<(u64, u64)>)> {
        let p = self.lower_bound(key);
        let (k, value) = self.at(p)?;
        if k != key {
            return None;
        }
        self.len -= 1;
        let prev = self.before_pos(p);
        let leaf = &mut self.leaves[p.l];
        leaf.remove(p.i);
        let next = if p.i < leaf.len() { Some(leaf[p.i]) } else { self.leaves.get(p.l + 1).map(|n| n[0]) };
        self.rebalance(p.l);
        Some((value, prev, next))
    }

    /// After a removal from leaf `l`: an empty leaf goes, and a leaf under
    /// a quarter full joins its next (or previous) neighbour when both fit
    /// in one leaf, so that the leaves stay few.
    fn rebalance(&mut self, l: usize) {
        let n = self.leaves[l].len();
        if n == 0 {
            self.leaves.remove(l);
            self.firsts.remove(l);
            return;
        }
        self.firsts[l] = self.leaves[l][0].0;
        if n >= LEAF / 4 {
            return;
        }
        let join = if self.leaves.get(l + 1).is_some_and(|r| r.len() + n <= LEAF) {
            Some(l)
        } else if l > 0 && self.leaves[l - 1].len() + n <= LEAF {
            Some(l - 1)
        } else {
            None
        };
        if let Some(j) = join {
            let right = self.leaves.remove(j + 1);
            self.firsts.remove(j + 1);
            self.leaves[j].extend(right);
        }
    }

    /// The entries with keys in [`from`, `to`), in key order.
    pub fn range(&self, from: u64, to: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let p = self.lower_bound(from);
        self.leaves[p.l.min(self.leaves.len())..]
            .iter()
            .enumerate()
            .flat_map(move |(j, leaf)| if j == 0 { &leaf[p.i..] } else { &leaf[..] })
            .copied()
            .take_while(move |e| e.0 < to)
    }

    /// Every entry, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.leaves.iter().flatten().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// An operation on both maps.
    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64, u64),
        InsertBetween(u64, u64),
        Remove(u64),
        RemoveBetween(u64),
        Query(u64, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few distinct keys, so that hits, misses and neighbours all occur,
        // and enough operations to split and join leaves.
        let key = 0u64..600;
        prop_oneof![
            3 => (key.clone(), 0u64..4).prop_map(|(k, v)| Op::Insert(k, v)),
            3 => (key.clone(), 0u64..4).prop_map(|(k, s)| Op::InsertBetween(k, s)),
            2 => key.clone().prop_map(Op::Remove),
            2 => key.clone().prop_map(Op::RemoveBetween),
            1 => (key.clone(), key).prop_map(|(a, b)| Op::Query(a, b)),
        ]
    }

    fn before(m: &BTreeMap<u64, u64>, k: u64) -> Option<(u64, u64)> {
        m.range(..k).next_back().map(|(&a, &b)| (a, b))
    }

    fn at_or_after(m: &BTreeMap<u64, u64>, k: u64) -> Option<(u64, u64)> {
        m.range(k..).next().map(|(&a, &b)| (a, b))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn behaves_as_a_btreemap(ops in prop::collection::vec(op(), 1..3000)) {
            let (mut ours, mut std) = (LiveMap::new(), BTreeMap::new());
            for op in ops {
                match op {
                    Op::Insert(k, v) => prop_assert_eq!(ours.insert(k, v), std.insert(k, v)),
                    Op::InsertBetween(k, size) => {
                        let end = k + size;
                        let clash = std.range(k..end.max(k + 1)).next().is_some();
                        let want = (before(&std, k), at_or_after(&std, end));
                        match ours.insert_between(k, end, size) {
                            Ok(got) => {
                                prop_assert!(!clash);
                                prop_assert_eq!(got, want);
                                std.insert(k, size);
                            }
                            Err(()) => prop_assert!(clash),
                        }
                    }
                    Op::Remove(k) => prop_assert_eq!(ours.remove(k), std.remove(&k)),
                    Op::RemoveBetween(k) => {
                        let want = std.remove(&k).map(|v| (v, before(&std, k), at_or_after(&std, k + 1)));
                        prop_assert_eq!(ours.remove_between(k), want);
                    }
                    Op::Query(a, b) => {
                        prop_assert_eq!(ours.before(a), before(&std, a));
                        prop_assert_eq!(ours.at_or_after(a), at_or_after(&std, a));
                        prop_assert_eq!(ours.get(a), std.get(&a).copied());
                        let want: Vec<(u64, u64)> = std.range(a..b.max(a)).map(|(&x, &y)| (x, y)).collect();
                        prop_assert_eq!(ours.range(a, b).collect::<Vec<_>>(), want);
                    }
                }
                prop_assert_eq!(ours.len(), std.len());
            }
            prop_assert_eq!(ours.iter().collect::<Vec<_>>(), std.into_iter().collect::<Vec<_>>());
            // The leaves stay sorted, non-empty, within bounds and indexed.
            prop_assert_eq!(ours.leaves.len(), ours.firsts.len());
            for (leaf, &first) in ours.leaves.iter().zip(&ours.firsts) {
                prop_assert!(!leaf.is_empty() && leaf.len() <= LEAF);
                prop_assert_eq!(leaf[0].0, first);
            }
        }
    }

    #[test]
    fn a_present_key_clashes_whatever_the_end() {
        let mut m = LiveMap::new();
        assert_eq!(m.insert(u64::MAX, 1), None);
        assert_eq!(m.insert_between(u64::MAX, u64::MAX, 2), Err(()));
        assert_eq!(m.insert_between(5, 5, 2), Ok((None, Some((u64::MAX, 1)))));
        assert_eq!(m.insert_between(5, 0, 3), Err(()));
        assert_eq!(m.iter().collect::<Vec<_>>(), [(5, 2), (u64::MAX, 1)]);
    }

    #[test]
    fn many_blocks_split_and_join_leaves() {
        let mut m = LiveMap::new();
        // Descending keys: nothing before each new one, the last one after.
        for k in (0..10_000u64).rev() {
            let next = (k < 9_999).then(|| ((k + 1) * 16, 8));
            assert_eq!(m.insert_between(k * 16, k * 16 + 8, 8), Ok((None, next)));
        }
        assert!(m.leaves.len() > 10_000 / LEAF);
        for k in 0..10_000u64 {
            let next = (k < 9_999).then(|| ((k + 1) * 16, 8));
            assert_eq!(m.remove_between(k * 16), Some((8, None, next)));
        }
        assert!(m.is_empty() && m.leaves.is_empty());
    }
}
