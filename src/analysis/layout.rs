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

impl Layout {
    pub fn build(events: &Events, footprint: Footprint) -> Layout {
        Layout { lives: lifetimes(events), segments: segment_lifetimes(events), footprint }
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
            open.retain(|&(p, addr), &mut (size, start)| {
                if p == pid {
                    out.push(Lifetime { pid, addr, size, start, end: ts });
                }
                p != pid
            });
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
    out.extend(open.into_iter().map(|((pid, addr), (size, start))| Lifetime { pid, addr, size, start, end: last }));
    out
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
