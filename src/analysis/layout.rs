//! The layout the pictures draw: every block's life (allocation to free)
//! and every segment's, kept as data so the output stage can draw them
//! without the events. Computed only when `Options::layout` asks for it.

use ahash::AHashMap;

use crate::analysis::replay::Footprint;
use crate::trace::column::{Coded, Packed};
use crate::trace::event::{EventKind, Events, NO_STACK};

/// What `output::plot` draws: block and segment lives, and the footprint
/// that collapses their addresses.
#[derive(Clone, Debug)]
pub struct Layout {
    pub lives: LifeTable,
    pub segments: Vec<Lifetime>,
    pub footprint: Footprint,
    /// The CUDA stream of each life allocated on another stream than the
    /// default one: (index in `lives`, stream), by index.
    pub streams: Vec<(u32, u64)>,
}

impl Layout {
    /// The stream `lives[i]` was allocated on (0: the default stream, or
    /// none recorded).
    pub fn stream_of(&self, i: usize) -> u64 {
        self.streams.binary_search_by_key(&(i as u32), |s| s.0).map_or(0, |k| self.streams[k].1)
    }
}

/// The block and segment lives of a layout, which depend on the events
/// alone (`analyze` finds them beside the replay).
#[derive(Clone, Debug)]
pub struct Lives {
    pub blocks: LifeTable,
    pub segments: Vec<Lifetime>,
    pub streams: Vec<(u32, u64)>,
}

impl Lives {
    pub fn of(events: &Events) -> Lives {
        let (blocks, streams) = lifetimes_with_streams(events);
        Lives { blocks, segments: segment_lifetimes(events), streams }
    }

    pub fn with(self, footprint: Footprint) -> Layout {
        Layout { lives: self.blocks, segments: self.segments, footprint, streams: self.streams }
    }
}

/// One block's life. `end` is the trace's last timestamp for blocks alive
/// at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    pub pid: u32,
    /// Row of the trace's stack table that allocated it
    /// ([`crate::trace::event::NO_STACK`]: none recorded, or a segment).
    pub stack: u32,
    pub addr: u64,
    pub size: u64,
    pub start: u64,
    pub end: u64,
}

/// Lives kept by column, as the events are: a life takes about 19 bytes
/// where a [`Lifetime`] takes 40. The pictures keep every block's life
/// from the analysis to the drawing, on top of the events while the
/// replay runs: 21 M lives of a 100 M-event training trace took 0.78 GiB
/// as a vector of `Lifetime`s, and 0.37 GiB so (4 bytes for each time and
/// size, 5 for an address, 1 each for process and stack). Times, addresses and sizes
/// are [`Packed`]; the process and the stack are [`Coded`] (one process,
/// and no stacks, in most recordings).
#[derive(Clone, Debug, Default)]
pub struct LifeTable {
    pid: Coded<u32>,
    stack: Coded<u32>,
    addr: Packed,
    size: Packed,
    start: Packed,
    end: Packed,
}

impl LifeTable {
    pub fn len(&self) -> usize {
        self.size.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn push(&mut self, l: &Lifetime) {
        self.pid.push(l.pid);
        self.stack.push(l.stack);
        self.addr.push(l.addr);
        self.size.push(l.size);
        self.start.push(l.start);
        self.end.push(l.end);
    }

    /// Room for `n` more lives, reserved once (where it cannot be, each
    /// column grows as it goes).
    pub fn reserve_exact(&mut self, n: usize) {
        let _ = self.pid.try_reserve_exact(n);
        let _ = self.stack.try_reserve_exact(n);
        for c in [&mut self.addr, &mut self.size, &mut self.start, &mut self.end] {
            let _ = c.try_reserve_exact(n);
        }
    }

    /// Life `i`. Panics past the end, as a slice does.
    #[inline(always)]
    pub fn get(&self, i: usize) -> Lifetime {
        Lifetime {
            pid: self.pid[i],
            stack: self.stack[i],
            addr: self.addr.at(i),
            size: self.size.at(i),
            start: self.start.at(i),
            end: self.end.at(i),
        }
    }

    /// Life `i`'s process, read alone.
    #[inline]
    pub fn pid(&self, i: usize) -> u32 {
        self.pid[i]
    }

    /// Life `i`'s size, read alone.
    #[inline]
    pub fn size(&self, i: usize) -> u64 {
        self.size.at(i)
    }

    /// Life `i`'s length, `end - start`, read alone.
    #[inline]
    pub fn duration(&self, i: usize) -> u64 {
        self.end.at(i) - self.start.at(i)
    }

    /// Every life in order, read a stretch of rows at a time: a pass over
    /// all lives (the pictures make several) costs about what it did over
    /// a vector of them. Read each by [`LifeTable::get`], the MDTP and
    /// timeline of a 10 M-event trace took 0.54–0.60 s against 0.34–0.45 s.
    pub fn iter(&self) -> LifeIter<'_> {
        LifeIter { table: self, next: 0, at: 0, n: 0, buf: Box::new(Stretch::default()) }
    }
}

/// Rows [`LifeIter`] reads at once.
const STRETCH: usize = 256;

/// A stretch of lives, column by column.
#[derive(Clone)]
struct Stretch {
    pid: [u32; STRETCH],
    stack: [u32; STRETCH],
    addr: [u64; STRETCH],
    size: [u64; STRETCH],
    start: [u64; STRETCH],
    end: [u64; STRETCH],
}

impl Default for Stretch {
    fn default() -> Self {
        Stretch {
            pid: [0; STRETCH],
            stack: [0; STRETCH],
            addr: [0; STRETCH],
            size: [0; STRETCH],
            start: [0; STRETCH],
            end: [0; STRETCH],
        }
    }
}

/// The lives of a [`LifeTable`] in order ([`LifeTable::iter`]).
#[derive(Clone)]
pub struct LifeIter<'a> {
    table: &'a LifeTable,
    /// The first row not yet read into `buf`.
    next: usize,
    /// The next life in `buf`, and how many it holds.
    at: usize,
    n: usize,
    buf: Box<Stretch>,
}

impl Iterator for LifeIter<'_> {
    type Item = Lifetime;

    #[inline]
    fn next(&mut self) -> Option<Lifetime> {
        if self.at == self.n {
            let n = STRETCH.min(self.table.len() - self.next);
            if n == 0 {
                return None;
            }
            let (t, b, from) = (self.table, &mut *self.buf, self.next);
            t.pid.read_into(from, &mut b.pid[..n]);
            t.stack.read_into(from, &mut b.stack[..n]);
            t.addr.read_into(from, &mut b.addr[..n]);
            t.size.read_into(from, &mut b.size[..n]);
            t.start.read_into(from, &mut b.start[..n]);
            t.end.read_into(from, &mut b.end[..n]);
            (self.next, self.at, self.n) = (from + n, 0, n);
        }
        let (b, k) = (&*self.buf, self.at);
        self.at += 1;
        Some(Lifetime {
            pid: b.pid[k],
            stack: b.stack[k],
            addr: b.addr[k],
            size: b.size[k],
            start: b.start[k],
            end: b.end[k],
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.n - self.at + self.table.len() - self.next;
        (left, Some(left))
    }
}

impl ExactSizeIterator for LifeIter<'_> {}

/// Block lifetimes from time-sorted events (device view: successful
/// allocations until their free; an allocation at a live address closes
/// the old block).
pub fn lifetimes(events: &Events) -> LifeTable {
    lifetimes_with_streams(events).0
}

/// [`lifetimes`], and the stream of each life allocated on a stream other
/// than 0 (index in the lives, stream).
fn lifetimes_with_streams(events: &Events) -> (LifeTable, Vec<(u32, u64)>) {
    #[derive(Clone, Copy)]
    struct Open {
        size: u64,
        start: u64,
        stack: u32,
        stream: u64,
    }
    let mut open: AHashMap<(u32, u64), Open> = AHashMap::new();
    // Room for a life per allocation, reserved once: grown by doubling,
    // the lives of a long trace were held twice while they moved, on top
    // of the events. Pages never written cost nothing.
    let mut out = LifeTable::default();
    out.reserve_exact(events.kind.iter().filter(|k| k.is_some_and(EventKind::creates_block)).count());
    let mut streams = Vec::new();
    let mut close = |out: &mut LifeTable, pid: u32, addr: u64, o: Open, end: u64| {
        if o.stream != 0 {
            streams.push((out.len() as u32, o.stream));
        }
        out.push(&Lifetime { pid, stack: o.stack, addr, size: o.size, start: o.start, end });
    };
    let last = events.ts_ns.last().unwrap_or(0);
    for i in 0..events.len() {
        let Some(kind) = events.kind[i] else { continue };
        if kind == crate::trace::event::EventKind::Exit {
            // The process ended: the driver released what it held.
            let (pid, ts) = (events.pid[i], events.ts_ns.at(i));
            let mut ended: Vec<(u64, Open)> = Vec::new();
            open.retain(|&(p, addr), o| {
                if p == pid {
                    ended.push((addr, *o));
                }
                p != pid
            });
            ended.sort_unstable_by_key(|e| e.0);
            for (addr, o) in ended {
                close(&mut out, pid, addr, o, ts);
            }
            continue;
        }
        let addr = events.addr.at(i);
        if events.ret[i] != 0 || addr == 0 {
            continue;
        }
        let (pid, ts, size) = (events.pid[i], events.ts_ns.at(i), events.size.at(i));
        if kind.creates_block() && size > 0 {
            let new = Open {
                size,
                start: ts,
                stack: events.stack.get(i).copied().unwrap_or(NO_STACK),
                stream: events.stream.get(i).unwrap_or(0),
            };
            if let Some(o) = open.insert((pid, addr), new) {
                close(&mut out, pid, addr, o, ts);
            }
        } else if kind.releases_block()
            && let Some(o) = open.remove(&(pid, addr))
        {
            close(&mut out, pid, addr, o, ts);
        }
    }
    // Lives taken out of a hash map, in a fixed order: the MDTP sums their
    // coverage in f32, so the map's per-process random order changed pixels
    // from one run to the next.
    let mut left: Vec<((u32, u64), Open)> = open.into_iter().collect();
    left.sort_unstable_by_key(|e| e.0);
    for ((pid, addr), o) in left {
        close(&mut out, pid, addr, o, last);
    }
    (out, streams)
}

/// What a `segment_free` or `segment_unmap` at `addr` gives back of the
/// mapped `ranges` (each piece valued with its map's start by `map_of`):
/// a free names its segment's start, and all of that segment ends (its
/// size may be missing); an unmap ends [addr, addr + size), which may cut
/// a mapped range anywhere. None when nothing is named.
pub fn released_span<V: Clone + Eq>(
    ranges: &rangemap::RangeMap<u64, V>,
    kind: EventKind,
    addr: u64,
    size: u64,
    map_of: impl Fn(&V) -> u64,
) -> Option<std::ops::Range<u64>> {
    let end = addr.saturating_add(size);
    let span = match (kind, ranges.get(&addr)) {
        (EventKind::SegmentFree, Some(v)) => {
            // Its pieces follow one another from `addr` (no other segment
            // lies inside one): read them, not every range held.
            let at = map_of(v);
            let last = ranges
                .overlapping(addr..u64::MAX)
                .take_while(|(_, w)| map_of(w) == at)
                .map(|(r, _)| r.end)
                .last()
                .unwrap_or(end);
            addr..last.max(end)
        }
        _ => addr..end,
    };
    (span.end > span.start).then_some(span)
}

/// Segment lifetimes (allocator view): `segment_alloc` to `segment_free`,
/// and each `segment_map`ped range to its `segment_unmap`. An expandable
/// segment unmaps pages anywhere in what one request mapped: the pages
/// unmapped end there, and the rest of the range lives on from its map.
/// Empty for device-view traces.
pub fn segment_lifetimes(events: &Events) -> Vec<Lifetime> {
    // Per process: each mapped byte range → (its map's time, its map's
    // start), so that two segments that touch stay two.
    let mut open: std::collections::BTreeMap<u32, rangemap::RangeMap<u64, (u64, u64)>> = Default::default();
    let mut out = Vec::new();
    let last = events.ts_ns.last().unwrap_or(0);
    for i in 0..events.len() {
        let Some(kind) = events.kind[i] else { continue };
        if !matches!(
            kind,
            EventKind::SegmentAlloc | EventKind::SegmentMap | EventKind::SegmentFree | EventKind::SegmentUnmap
        ) {
            continue;
        }
        let (pid, addr, size, ts) = (events.pid[i], events.addr.at(i), events.size.at(i), events.ts_ns.at(i));
        let end = addr.saturating_add(size);
        match kind {
            EventKind::SegmentAlloc | EventKind::SegmentMap if end > addr => {
                open.entry(pid).or_default().insert(addr..end, (ts, addr));
            }
            EventKind::SegmentFree | EventKind::SegmentUnmap => {
                let Some(ranges) = open.get_mut(&pid) else { continue };
                let Some(span) = released_span(ranges, kind, addr, size, |v| v.1) else { continue };
                let ended: Vec<(std::ops::Range<u64>, u64)> = ranges
                    .overlapping(span.clone())
                    .map(|(r, v)| (r.start.max(span.start)..r.end.min(span.end), v.0))
                    .collect();
                for (r, start) in ended {
                    out.push(Lifetime { pid, stack: NO_STACK, addr: r.start, size: r.end - r.start, start, end: ts });
                }
                ranges.remove(span);
            }
            _ => {}
        }
    }
    out.extend(open.into_iter().flat_map(|(pid, ranges)| {
        ranges.into_iter().map(move |(r, (start, _))| Lifetime {
            pid,
            stack: NO_STACK,
            addr: r.start,
            size: r.end - r.start,
            start,
            end: last,
        })
    }));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::event::Event;

    /// An expandable segment unmaps pages inside what one request mapped:
    /// those pages end there, the rest lives on from its map; two maps
    /// that touch stay two, and a `segment_free` ends its whole segment.
    #[test]
    fn an_unmap_inside_a_mapped_range_ends_only_its_pages() {
        const P: u64 = 20 << 20;
        let mut events = Events::default();
        for (t, kind, addr, size) in [
            (1, EventKind::SegmentMap, 0x1000_0000, 5 * P),
            (2, EventKind::SegmentMap, 0x1000_0000 + 5 * P, P),
            (3, EventKind::SegmentUnmap, 0x1000_0000 + P, 2 * P),
            (4, EventKind::SegmentAlloc, 0x9000_0000, P),
            (5, EventKind::SegmentFree, 0x9000_0000, P),
            (9, EventKind::BlockAlloc, 0x1000_0000, 512),
        ] {
            events.push(&Event::new(t, 0, kind, addr, size));
        }
        let mut lives: Vec<(u64, u64, u64, u64)> =
            segment_lifetimes(&events).iter().map(|l| (l.addr, l.size, l.start, l.end)).collect();
        lives.sort();
        assert_eq!(
            lives,
            vec![
                (0x1000_0000, P, 1, 9),
                (0x1000_0000 + P, 2 * P, 1, 3),
                (0x1000_0000 + 3 * P, 2 * P, 1, 9),
                (0x1000_0000 + 5 * P, P, 2, 9),
                (0x9000_0000, P, 4, 5),
            ]
        );
    }

    /// Lives read back by row, by field and a stretch at a time, across
    /// the stretches and the blocks of the columns, with the processes,
    /// stacks and addresses varying.
    #[test]
    fn a_life_table_reads_back_what_was_pushed() {
        let want: Vec<Lifetime> = (0..70_000u64)
            .map(|i| Lifetime {
                pid: (i % 3) as u32,
                stack: if i % 5 == 0 { NO_STACK } else { (i % 700) as u32 },
                addr: if i % 2 == 0 { 0x7f00_0000_0000 + i * 512 } else { 0x5555_0000 + i },
                size: 512 * (1 + i % 97),
                start: 1_000 + i * 10,
                end: 1_000 + i * 10 + i % 4_000,
            })
            .collect();
        let mut t = LifeTable::default();
        t.reserve_exact(want.len());
        want.iter().for_each(|l| t.push(l));
        assert_eq!(t.len(), want.len());
        assert!(t.iter().eq(want.iter().copied()));
        assert_eq!(t.iter().len(), want.len());
        let mut it = t.iter();
        assert_eq!(it.nth(300), Some(want[300]));
        assert_eq!(it.len(), want.len() - 301);
        for i in [0, 255, 256, 65_535, 65_536, 69_999] {
            assert_eq!(t.get(i), want[i]);
            assert_eq!((t.pid(i), t.size(i), t.duration(i)), (want[i].pid, want[i].size, want[i].end - want[i].start));
        }
        assert!(LifeTable::default().iter().next().is_none());
    }

    #[test]
    fn lives_left_open_come_in_address_order_every_time() {
        let mut events = Events::default();
        // 300 blocks never freed, then an exit of process 2 closing its own.
        for i in 0..300u64 {
            let addr = 0x7000_0000 + (i * 7919 % 300) * 4096;
            events.push(&Event::new(10 + i, 1 + (i % 2) as u32, EventKind::Alloc, addr, 512));
        }
        events.push(&Event::new(1_000, 2, EventKind::Exit, 0, 0));
        let (a, b): (Vec<Lifetime>, Vec<Lifetime>) =
            (lifetimes(&events).iter().collect(), lifetimes(&events).iter().collect());
        assert_eq!(a, b);
        let (exited, open): (Vec<Lifetime>, Vec<Lifetime>) = a.iter().partition(|l| l.pid == 2);
        assert_eq!((exited.len(), open.len()), (150, 150));
        for part in [&exited, &open] {
            assert!(part.windows(2).all(|w| w[0].addr < w[1].addr), "not in address order");
        }
    }
}
