//! The layout the pictures draw: every block's life (allocation to free)
//! and every segment's, kept as data so the output stage can draw them
//! without the events. Computed only when `Options::layout` asks for it.

use ahash::AHashMap;

use crate::analysis::replay::Footprint;
use crate::trace::event::{EventKind, Events};

/// What `output::plot` draws: block and segment lives, and the footprint
/// that collapses their addresses.
#[derive(Clone, Debug)]
pub struct Layout {
    pub lives: Vec<Lifetime>,
    pub segments: Vec<Lifetime>,
    pub footprint: Footprint,
}

/// The block and segment lives of a layout, which depend on the events
/// alone (`analyze` finds them beside the replay).
#[derive(Clone, Debug)]
pub struct Lives {
    pub blocks: Vec<Lifetime>,
    pub segments: Vec<Lifetime>,
}

impl Lives {
    pub fn of(events: &Events) -> Lives {
        Lives { blocks: lifetimes(events), segments: segment_lifetimes(events) }
    }

    pub fn with(self, footprint: Footprint) -> Layout {
        Layout { lives: self.blocks, segments: self.segments, footprint }
    }
}

/// One block's life. `end` is the trace's last timestamp for blocks alive
/// at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    pub pid: u32,
    pub addr: u64,
    pub size: u64,
    pub start: u64,
    pub end: u64,
}

/// Block lifetimes from time-sorted events (device view: successful
/// allocations until their free; an allocation at a live address closes
/// the old block).
pub fn lifetimes(events: &Events) -> Vec<Lifetime> {
    let mut open: AHashMap<(u32, u64), (u64, u64)> = AHashMap::new();
    let mut out = Vec::new();
    let last = events.ts_ns.last().copied().unwrap_or(0);
    for i in 0..events.len() {
        let Some(kind) = events.kind[i] else { continue };
        if kind == crate::trace::event::EventKind::Exit {
            // The process ended: the driver released what it held.
            let (pid, ts) = (events.pid[i], events.ts_ns[i]);
            let mut ended = Vec::new();
            open.retain(|&(p, addr), &mut (size, start)| {
                if p == pid {
                    ended.push(Lifetime { pid, addr, size, start, end: ts });
                }
                p != pid
            });
            out.extend(in_address_order(ended));
            continue;
        }
        if events.ret[i] != 0 || events.addr[i] == 0 {
            continue;
        }
        let (pid, addr, ts) = (events.pid[i], events.addr[i], events.ts_ns[i]);
        if kind.creates_block() && events.size[i] > 0 {
            if let Some((size, start)) = open.insert((pid, addr), (events.size[i], ts)) {
                out.push(Lifetime { pid, addr, size, start, end: ts });
            }
        } else if kind.releases_block()
            && let Some((size, start)) = open.remove(&(pid, addr))
        {
            out.push(Lifetime { pid, addr, size, start, end: ts });
        }
    }
    out.extend(in_address_order(
        open.into_iter().map(|((pid, addr), (size, start))| Lifetime { pid, addr, size, start, end: last }).collect(),
    ));
    out
}

/// Lives taken out of a hash map, in a fixed order: the MDTP sums their
/// coverage in f32, so the map's per-process random order changed pixels
/// from one run to the next.
fn in_address_order(mut lives: Vec<Lifetime>) -> Vec<Lifetime> {
    lives.sort_unstable_by_key(|l| (l.pid, l.addr));
    lives
}

/// Segment lifetimes (allocator view): `segment_alloc` to `segment_free`,
/// each `segment_map`ped range to the `segment_unmap` that covers its
/// start. Empty for device-view traces.
pub fn segment_lifetimes(events: &Events) -> Vec<Lifetime> {
    let mut open: std::collections::BTreeMap<(u32, u64), (u64, u64)> = Default::default();
    let mut out = Vec::new();
    let last = events.ts_ns.last().copied().unwrap_or(0);
    for i in 0..events.len() {
        let Some(kind) = events.kind[i] else { continue };
        let (pid, addr, size, ts) = (events.pid[i], events.addr[i], events.size[i], events.ts_ns[i]);
        match kind {
            EventKind::SegmentAlloc | EventKind::SegmentMap if size > 0 => {
                open.insert((pid, addr), (size, ts));
            }
            EventKind::SegmentFree | EventKind::SegmentUnmap => {
                let ended: Vec<(u32, u64)> =
                    open.range((pid, addr)..(pid, addr.saturating_add(size.max(1)))).map(|(k, _)| *k).collect();
                for k in ended {
                    if let Some((size, start)) = open.remove(&k) {
                        out.push(Lifetime { pid, addr: k.1, size, start, end: ts });
                    }
                }
            }
            _ => {}
        }
    }
    out.extend(open.into_iter().map(|((pid, addr), (size, start))| Lifetime { pid, addr, size, start, end: last }));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::event::Event;

    #[test]
    fn lives_left_open_come_in_address_order_every_time() {
        let mut events = Events::default();
        // 300 blocks never freed, then an exit of process 2 closing its own.
        for i in 0..300u64 {
            let addr = 0x7000_0000 + (i * 7919 % 300) * 4096;
            events.push(&Event::new(10 + i, 1 + (i % 2) as u32, EventKind::Alloc, addr, 512));
        }
        events.push(&Event::new(1_000, 2, EventKind::Exit, 0, 0));
        let (a, b) = (lifetimes(&events), lifetimes(&events));
        assert_eq!(a, b);
        let (exited, open): (Vec<Lifetime>, Vec<Lifetime>) = a.iter().partition(|l| l.pid == 2);
        assert_eq!((exited.len(), open.len()), (150, 150));
        for part in [&exited, &open] {
            assert!(part.windows(2).all(|w| w[0].addr < w[1].addr), "not in address order");
        }
    }
}
