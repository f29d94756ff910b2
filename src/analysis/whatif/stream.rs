//! The requests a what-if replays, per device ([`DeviceStream`]): read
//! from a snapshot's entries (each free matched to its allocation, the
//! state before the first entry, the program's `empty_cache()` calls as
//! [`Flushes`]) or from a device-level trace's `cudaMalloc`s.

use crate::trace::event::{Event, EventKind};

/// One recorded event of one device, as the model needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Req {
    pub ts_ns: u64,
    pub kind: EventKind,
    pub addr: u64,
    /// Block or segment size.
    pub size: u64,
    pub requested: u64,
    pub stream: u64,
    /// `oom` events: the free device memory CUDA reported.
    pub device_free: Option<u64>,
}

impl Req {
    pub fn of(e: &Event) -> Req {
        Req {
            ts_ns: e.ts_ns,
            kind: e.kind,
            addr: e.addr,
            size: e.size,
            requested: e.extra.requested.unwrap_or(e.size),
            stream: e.stream.unwrap_or(0),
            device_free: e.extra.device_free,
        }
    }
}

/// The events of one device: the reconstructed initial state (its first
/// `initial` events: segments, then live blocks), then the trace.
#[derive(Clone, Debug, Default)]
pub struct DeviceStream {
    pub device: u32,
    pub initial: usize,
    pub events: Vec<Req>,
    /// The times PyTorch released cached segments because the device was
    /// full (its whole cache, or with `max_split_size_mb` first only the
    /// blocks above that size), and the capacity they imply.
    pub flushes: Flushes,
}

/// Cache flushes: runs of `segment_free` that PyTorch's allocator made
/// itself (their stack is the allocation's, not `empty_cache`'s) right
/// before the segment it made room for. Each says the device was full:
/// the capacity is below what was reserved then plus that segment, and at
/// least the most that was ever reserved with a new segment that fit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Flushes {
    pub count: u64,
    pub segments_freed: u64,
    pub bytes_freed: u64,
    /// The capacity interval [lo, hi] they imply, when consistent.
    pub capacity: Option<(u64, u64)>,
}

pub(super) fn is_small_segment(size: u64) -> bool {
    size == crate::allocator::SMALL_BUFFER
}

/// The request stream of each process of a device-level trace (eBPF,
/// synthetic): successful allocations, frees, and failed allocations as
/// requests that ran out of memory.
/// For the units in `pytorch` ([`crate::analysis::oom::Retries`]), a
/// failed request that PyTorch's allocator asked again is one request: a
/// failed second ask is left out, and a failure that the second ask got
/// served is no request that ran out of memory (its `oom` is taken back).
pub fn device_level_streams(
    events: &crate::trace::event::Events,
    pytorch: &crate::analysis::oom::PytorchUnits,
) -> Vec<DeviceStream> {
    use crate::analysis::oom::Ask;
    let mut by: std::collections::BTreeMap<u32, DeviceStream> = Default::default();
    let mut retries = crate::analysis::oom::Retries::of(pytorch.clone());
    for i in 0..events.len() {
        let Some(kind) = events.kind[i] else { continue };
        match retries.see(kind, events.pid[i], events.size[i], events.ret[i]) {
            Ask::Retry => continue,
            Ask::Recovered => {
                if let Some(d) = by.get_mut(&events.pid[i])
                    && let Some(at) = d.events.iter().rposition(|r| r.kind == EventKind::Oom)
                {
                    d.events.remove(at);
                }
            }
            Ask::New => {}
        }
        let k = if kind.is_device_alloc() || (kind.is_alloc_request() && events.ret[i] != 0) {
            if events.ret[i] == 0 { EventKind::BlockAlloc } else { EventKind::Oom }
        } else if kind.releases_block() && events.ret[i] == 0 {
            EventKind::BlockFree
        } else {
            continue;
        };
        let pid = events.pid[i];
        let d = by.entry(pid).or_insert_with(|| DeviceStream { device: pid, ..DeviceStream::default() });
        d.events.push(Req {
            ts_ns: events.ts_ns[i],
            kind: k,
            addr: events.addr[i],
            size: events.size[i],
            requested: events.size[i],
            stream: 0,
            device_free: None,
        });
    }
    by.into_values().collect()
}

/// The kinds of event the allocator model reads.
fn replays(kind: EventKind) -> bool {
    use EventKind::*;
    matches!(
        kind,
        BlockAlloc | BlockFree | BlockFreeRequested | SegmentAlloc | SegmentFree | SegmentMap | SegmentUnmap | Oom
    )
}

/// The request stream of each device of an imported snapshot (its time-
/// sorted events), with the reconstructed state before the first trace
/// entry: the first `initial_segments + initial_blocks` events of each
/// device.
pub fn streams(
    events: &crate::trace::event::Events,
    details: &crate::trace::details::SnapshotDetails,
    stacks: Option<&crate::trace::Stacks>,
) -> Vec<DeviceStream> {
    let mut by: std::collections::BTreeMap<u32, DeviceStream> = Default::default();
    for r in &details.reconstruction {
        by.insert(
            r.device,
            DeviceStream {
                device: r.device,
                initial: (r.initial_segments + r.initial_blocks) as usize,
                events: Vec::new(),
                flushes: Flushes::default(),
            },
        );
    }
    if let [only] = details.reconstruction.as_slice()
        && let Some(d) = by.get_mut(&only.device)
    {
        d.events.reserve_exact(events.len());
    }
    // A recording joined with the snapshot adds the allocations PyTorch
    // did not make, at their own call site: they are not the allocator's
    // requests, and its model does not replay them.
    let outside: std::collections::HashSet<u32> = stacks.map_or_else(Default::default, crate::input::outside_stacks);
    for i in 0..events.len() {
        // The allocator's own events only: a recording's view also holds
        // its kernel launches, which would split a run of segment frees.
        let Some(kind) = events.kind[i].filter(|&k| replays(k)) else { continue };
        let Some(d) = by.get_mut(&events.pid[i]) else { continue };
        if !outside.is_empty() && events.stack.get(i).is_some_and(|s| outside.contains(s)) {
            continue;
        }
        let requested = events.requested.get(i).copied().filter(|&r| r != u64::MAX).unwrap_or(events.size[i]);
        d.events.push(Req {
            ts_ns: events.ts_ns[i],
            kind,
            addr: events.addr[i],
            size: events.size[i],
            requested,
            stream: events.stream.get(i).copied().unwrap_or(0),
            device_free: events.device_free.get(i).copied().filter(|&v| v != u64::MAX),
        });
    }
    // Segment frees made by the allocator, not by empty_cache(): with a
    // stack that has no `empty_cache` frame.
    let by_allocator = |i: usize| {
        let id = events.stack.get(i).copied().unwrap_or(crate::trace::event::NO_STACK);
        id != crate::trace::event::NO_STACK
            && stacks.is_some_and(|st| {
                st.frames_of(id).next().is_some() && !st.frames_of(id).any(|f| f.name == "empty_cache")
            })
    };
    let mut flagged: std::collections::BTreeMap<u32, Vec<bool>> = Default::default();
    for i in 0..events.len() {
        if events.kind[i] == Some(EventKind::SegmentFree) && by.contains_key(&events.pid[i]) {
            flagged.entry(events.pid[i]).or_default().push(by_allocator(i));
        }
    }
    let mut out: Vec<DeviceStream> = by.into_values().collect();
    for d in &mut out {
        d.flushes = find_flushes(d, flagged.get(&d.device).map_or(&[][..], |v| v.as_slice()));
    }
    out
}

/// The cache flushes of a device's stream; `by_allocator[k]`: whether its
/// k-th `segment_free` was made by the allocator (see [`Flushes`]).
pub(super) fn find_flushes(d: &DeviceStream, by_allocator: &[bool]) -> Flushes {
    let mut f = Flushes::default();
    let mut reserved: u64 = 0;
    let (mut lo, mut hi) = (0u64, u64::MAX);
    let mut nth_free = 0usize;
    let mut run: Option<(u64, u64, u64, bool)> = None; // (reserved before, segments, bytes, by allocator)
    for (i, r) in d.events.iter().enumerate() {
        match r.kind {
            EventKind::SegmentFree => {
                let mine = by_allocator.get(nth_free).copied().unwrap_or(false);
                nth_free += 1;
                let e = run.get_or_insert((reserved, 0, 0, true));
                *e = (e.0, e.1 + 1, e.2 + r.size, e.3 && mine);
                reserved = reserved.saturating_sub(r.size);
            }
            EventKind::SegmentAlloc => {
                if i >= d.initial
                    && let Some((before, segments, bytes, true)) = run
                {
                    f.count += 1;
                    f.segments_freed += segments;
                    f.bytes_freed += bytes;
                    hi = hi.min((before + r.size).saturating_sub(1));
                }
                run = None;
                reserved += r.size;
                lo = lo.max(reserved);
            }
            EventKind::SegmentMap => {
                run = None;
                reserved += r.size;
                lo = lo.max(reserved);
            }
            EventKind::SegmentUnmap => reserved = reserved.saturating_sub(r.size),
            _ => run = None,
        }
    }
    f.capacity = (f.count > 0 && lo <= hi).then_some((lo, hi));
    f
}

/// The capacity a recording's first `oom` entry implies: the free memory
/// CUDA reported plus what the recording had reserved then.
pub fn inferred_capacity(d: &DeviceStream) -> Option<u64> {
    let mut reserved: u64 = 0;
    for r in &d.events {
        match r.kind {
            EventKind::SegmentAlloc | EventKind::SegmentMap => reserved += r.size,
            EventKind::SegmentFree | EventKind::SegmentUnmap => reserved = reserved.saturating_sub(r.size),
            EventKind::Oom => {
                if let Some(free) = r.device_free {
                    return Some(free + reserved);
                }
            }
            _ => {}
        }
    }
    None
}
