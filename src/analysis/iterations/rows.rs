//! The rows of one series, held as compactly as they can be: iteration
//! detection needs each series' rows in order, and on a long trace the
//! list of them was as large as a column of the trace itself (8 bytes an
//! event: 0.8 GB at 100 M events).
//!
//! A series that has every row of the trace (a trace of one process, the
//! common case) stores nothing. Otherwise each row index takes 4 bytes,
//! unless the trace has 2³² rows or more.

use ahash::AHashMap;

use crate::trace::event::Events;

/// The rows of one series, owned ([`by_pid`]).
#[derive(Clone, Debug)]
pub enum RowList {
    /// Every row of a trace of `n` rows.
    All(usize),
    Narrow(Vec<u32>),
    Wide(Vec<usize>),
}

impl RowList {
    pub fn rows(&self) -> Rows<'_> {
        match self {
            RowList::All(n) => Rows::Range(0, *n),
            RowList::Narrow(v) => Rows::Narrow(v),
            RowList::Wide(v) => Rows::Wide(v),
        }
    }
}

/// The rows of one series, in order: a view of a [`RowList`].
#[derive(Clone, Copy, Debug)]
pub enum Rows<'a> {
    /// The rows `start..end`.
    Range(usize, usize),
    Narrow(&'a [u32]),
    Wide(&'a [usize]),
}

impl<'a> Rows<'a> {
    pub fn len(&self) -> usize {
        match *self {
            Rows::Range(start, end) => end - start,
            Rows::Narrow(v) => v.len(),
            Rows::Wide(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The trace row of the series' `j`-th row.
    #[inline]
    pub fn get(&self, j: usize) -> usize {
        match *self {
            Rows::Range(start, _) => start + j,
            Rows::Narrow(v) => v[j] as usize,
            Rows::Wide(v) => v[j],
        }
    }

    pub fn first(&self) -> Option<usize> {
        (!self.is_empty()).then(|| self.get(0))
    }

    /// The trace rows, in order.
    pub fn iter(self) -> impl Iterator<Item = usize> + 'a {
        (0..self.len()).map(move |j| self.get(j))
    }

    /// The rows from the series' `k`-th on.
    pub fn from_position(self, k: usize) -> Rows<'a> {
        match self {
            Rows::Range(start, end) => Rows::Range((start + k).min(end), end),
            Rows::Narrow(v) => Rows::Narrow(&v[k..]),
            Rows::Wide(v) => Rows::Wide(&v[k..]),
        }
    }
}

/// The rows of each series (pid) of `events`, in order: computed once for
/// [`super::detect`], which looks at one series at a time.
pub fn by_pid(events: &Events) -> AHashMap<u32, RowList> {
    // Counted first, so that each list is allocated once at its size: at
    // 10 M events, growing them by doubling copied and zeroed twice the
    // memory they end with.
    // By runs of one pid: a trace's rows come in long runs of one process.
    let mut count: AHashMap<u32, usize> = AHashMap::new();
    let mut run: Option<(u32, usize)> = None;
    for pid in events.pid.iter() {
        match &mut run {
            Some((p, n)) if *p == pid => *n += 1,
            _ => {
                if let Some((p, n)) = run {
                    *count.entry(p).or_default() += n;
                }
                run = Some((pid, 1));
            }
        }
    }
    if let Some((p, n)) = run {
        *count.entry(p).or_default() += n;
    }
    if count.len() == 1 {
        return count.into_iter().map(|(pid, n)| (pid, RowList::All(n))).collect();
    }
    if events.len() <= u32::MAX as usize {
        let lists = fill(events, count, |i| i as u32);
        lists.into_iter().map(|(pid, v)| (pid, RowList::Narrow(v))).collect()
    } else {
        let lists = fill(events, count, |i| i);
        lists.into_iter().map(|(pid, v)| (pid, RowList::Wide(v))).collect()
    }
}

/// Each pid's row indices, as `index` writes them, in lists allocated at
/// the sizes `count` gives.
fn fill<T>(events: &Events, count: AHashMap<u32, usize>, index: impl Fn(usize) -> T) -> AHashMap<u32, Vec<T>> {
    let mut by: AHashMap<u32, Vec<T>> = count.into_iter().map(|(pid, n)| (pid, Vec::with_capacity(n))).collect();
    let mut last: Option<(u32, &mut Vec<T>)> = None;
    for (i, pid) in events.pid.iter().enumerate() {
        match &mut last {
            Some((p, rows)) if *p == pid => rows.push(index(i)),
            _ => {
                let rows = by.get_mut(&pid).expect("counted above");
                rows.push(index(i));
                last = Some((pid, rows));
            }
        }
    }
    by
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::event::{Event, EventKind};

    fn events(pids: &[u32]) -> Events {
        let mut events = Events::default();
        for (i, &p) in pids.iter().enumerate() {
            events.push(&Event::new(i as u64, p, EventKind::Alloc, 0, 1));
        }
        events
    }

    #[test]
    fn one_series_stores_nothing_and_several_store_their_rows_in_order() {
        let one = by_pid(&events(&[7, 7, 7]));
        assert!(matches!(one[&7], RowList::All(3)));
        assert_eq!(one[&7].rows().iter().collect::<Vec<_>>(), [0, 1, 2]);
        let two = by_pid(&events(&[1, 2, 1, 1, 2]));
        assert_eq!(two[&1].rows().iter().collect::<Vec<_>>(), [0, 2, 3]);
        assert_eq!(two[&2].rows().iter().collect::<Vec<_>>(), [1, 4]);
        assert!(matches!(two[&1], RowList::Narrow(_)));
        let rows = two[&1].rows();
        assert_eq!((rows.len(), rows.first(), rows.get(2)), (3, Some(0), 3));
        assert_eq!(rows.from_position(1).iter().collect::<Vec<_>>(), [2, 3]);
        assert_eq!(one[&7].rows().from_position(2).iter().collect::<Vec<_>>(), [2]);
        assert!(one[&7].rows().from_position(3).is_empty());
    }
}
