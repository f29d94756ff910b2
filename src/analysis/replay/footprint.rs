//! The footprint regions of each process: the union of every range it
//! successfully allocated anywhere in the trace, merged into maximal
//! disjoint regions, built by a first pass over the events. They are the
//! arenas of the replay: space between regions is never a gap.

use ahash::AHashMap;

use crate::trace::event::{EventKind, Events};

/// Per process: its footprint regions, and for each address the time of its
/// first successful allocation (to tell a double free from a free of a block
/// allocated before the trace began).
#[derive(Clone, Debug, Default)]
pub struct Footprint {
    pub(super) procs: AHashMap<u32, ProcFootprint>,
}

#[derive(Clone, Debug, Default)]
pub(super) struct ProcFootprint {
    pub(super) regions: Vec<(u64, u64)>,
    pub(super) first_alloc: AHashMap<u64, u64>,
}

impl Footprint {
    /// One pass over the (time-sorted) events.
    pub fn build(events: &Events) -> Footprint {
        // For each start address: the largest end and the first time.
        let mut per_pid: AHashMap<u32, AHashMap<u64, (u64, u64)>> = AHashMap::new();
        let mut last_pid = u32::MAX;
        let mut current: Option<&mut AHashMap<u64, (u64, u64)>> = None;
        for i in 0..events.len() {
            let Some(kind) = events.kind[i] else { continue };
            let covers = kind.creates_block() || matches!(kind, EventKind::SegmentAlloc | EventKind::SegmentMap);
            if !covers || events.ret[i] != 0 {
                continue;
            }
            let (addr, size) = (events.addr.at(i), events.size.at(i));
            let Some(end) = addr.checked_add(size) else {
                continue;
            };
            if addr == 0 || size == 0 {
                continue;
            }
            let pid = events.pid[i];
            if pid != last_pid || current.is_none() {
                last_pid = pid;
                current = Some(per_pid.entry(pid).or_default());
            }
            let Some(map) = current.as_deref_mut() else {
                continue;
            };
            let ts = if kind.creates_block() { events.ts_ns.at(i) } else { u64::MAX };
            map.entry(addr).and_modify(|e| e.0 = e.0.max(end)).or_insert((end, ts));
        }
        let procs = per_pid
            .into_iter()
            .map(|(pid, starts)| {
                let mut ranges: Vec<(u64, u64)> = starts.iter().map(|(&a, &(end, _))| (a, end)).collect();
                ranges.sort_unstable();
                let regions = merge_ranges(ranges);
                let first_alloc =
                    starts.into_iter().filter(|s| s.1.1 != u64::MAX).map(|(a, (_, ts))| (a, ts)).collect();
                (pid, ProcFootprint { regions, first_alloc })
            })
            .collect();
        Footprint { procs }
    }

    /// The regions of `pid`, sorted and disjoint.
    pub fn regions(&self, pid: u32) -> &[(u64, u64)] {
        self.procs.get(&pid).map_or(&[], |p| &p.regions)
    }
}

/// Merges sorted ranges into maximal disjoint regions (touching ranges
/// merge too).
pub(super) fn merge_ranges(sorted: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (start, end) in sorted {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}
