//! A recording made with the probes on PyTorch's caching allocator
//! (`record`, issue 40) holds both levels of memory: each tensor's block
//! (`block_alloc`, `block_free`, `oom`) and the device allocations
//! underneath (`cudaMalloc`, `cuMemMap`), PyTorch's segments among them.
//! It is analysed as a snapshot is, in the allocator view:
//!
//! - **PyTorch's segments** are the device allocations of the process that
//!   a block of it was placed in while they lived (PyTorch allocates a
//!   segment only to place a block there); they become `segment_alloc` (or
//!   `segment_map`) and their frees `segment_free` (`segment_unmap`).
//! - **Everything else** the process allocated on the device (the math
//!   libraries' workspaces, NCCL, extensions) is outside PyTorch's
//!   allocator, named by the library that called, as in the join of a
//!   recording with a snapshot ([`super::join`]): the same code does it,
//!   with the blocks recorded here in place of a snapshot's.
//! - **One process**: the one with the most blocks (the join is one
//!   process's). Its device is the unit of the replay, as a snapshot's.
//!   Other processes with blocks are said on stderr: record them one at a
//!   time (`--pid`) to see each.
//! - **OOMs**: a `malloc` that never returned (it threw). When CUDA refused
//!   the segment PyTorch asked for during it, the device had less than
//!   that free: the OOM is classified with nothing free beyond PyTorch's
//!   cache, as a snapshot's would be with CUDA's free memory; otherwise
//!   its class stays unknown.
//! - **Block sizes** are the requested size rounded as PyTorch's default
//!   rounding does (512-byte multiples); the block PyTorch carved can be
//!   larger (an unsplit remainder, `roundup_power2_divisions`), which the
//!   probes do not see.

use std::collections::{BTreeMap, HashMap, HashSet};

use anyhow::Result;

use super::loaded::Loaded;
use crate::trace::details::{Details, SnapshotDetails};
use crate::trace::event::{Event, EventKind, Events, NO_STACK};

/// Whether the loaded recording holds PyTorch's blocks.
pub fn has_blocks(l: &Loaded) -> bool {
    l.trace.source() == Some(crate::trace::Source::Ebpf)
        && l.events.kind.iter().any(|k| *k == Some(EventKind::BlockAlloc))
}

/// The recording in the allocator view (unchanged without blocks).
pub fn view(recording: Loaded) -> Result<Loaded> {
    if !has_blocks(&recording) {
        return Ok(recording);
    }
    let rec = &recording.events;
    let mut blocks_of: BTreeMap<u32, usize> = BTreeMap::new();
    for i in 0..rec.len() {
        if rec.kind[i] == Some(EventKind::BlockAlloc) {
            *blocks_of.entry(rec.pid[i]).or_default() += 1;
        }
    }
    let pid = blocks_of.iter().max_by_key(|&(p, n)| (*n, std::cmp::Reverse(*p))).map_or(0, |(p, _)| *p);
    if blocks_of.len() > 1 {
        let others: Vec<String> = blocks_of.keys().filter(|&&p| p != pid).map(u32::to_string).collect();
        eprintln!(
            "fragscope: {}: PyTorch's blocks of {} processes; the allocator view is pid {pid}'s (the most blocks). \
             Pids {} are left out: record each with --pid to see it.",
            recording.trace.dir.display(),
            blocks_of.len(),
            others.join(", ")
        );
    }
    let details = recording.trace.meta.as_ref().and_then(|m| m.details.record());
    let unit = details
        .and_then(|d| d.devices.get(&pid.to_string()))
        .and_then(|d| d.first())
        .map_or(0, |&d| d.max(0) as u32);

    let pytorch = pytorch_segments(rec, pid);
    let mut out = Events::default();
    let mut live_segments: HashMap<u64, (u64, bool)> = HashMap::new();
    let mut live_blocks: HashMap<u64, u64> = HashMap::new();
    for i in (0..rec.len()).filter(|&i| rec.pid[i] == pid && rec.ret[i] == 0) {
        let Some(kind) = rec.kind[i] else { continue };
        let Some(mut e) = rec.get(i) else { continue };
        let (addr, size) = (rec.addr[i], rec.size[i]);
        let mut row = |kind: EventKind, addr: u64, size: u64, e: &Event| {
            let stream = e.stream.or(Some(0));
            let requested = e.extra.requested.or(Some(size));
            let device_free = e.extra.device_free;
            let extra = crate::trace::event::Extra { requested, stack: Some(NO_STACK), device_free };
            out.push(&Event { stream, extra, ..Event::new(e.ts_ns, unit, kind, addr, size) });
        };
        match kind {
            k if k.is_device_alloc() && pytorch.contains(&i) => {
                let map = k == EventKind::MemMap;
                live_segments.insert(addr, (size, map));
                row(if map { EventKind::SegmentMap } else { EventKind::SegmentAlloc }, addr, size, &e);
            }
            EventKind::MemUnmap => {
                let pages: Vec<(u64, u64)> = live_segments
                    .iter()
                    .filter(|(a, (s, map))| *map && **a >= addr && **a + *s <= addr + size)
                    .map(|(a, (s, _))| (*a, *s))
                    .collect();
                for (a, s) in pages {
                    live_segments.remove(&a);
                    row(EventKind::SegmentUnmap, a, s, &e);
                }
            }
            k if k.is_device_free() => {
                if let Some((s, false)) = live_segments.get(&addr).copied() {
                    live_segments.remove(&addr);
                    row(EventKind::SegmentFree, addr, s, &e);
                }
            }
            EventKind::BlockAlloc => {
                live_blocks.insert(addr, size);
                row(kind, addr, size, &e);
            }
            EventKind::BlockFree => {
                // A block allocated before the recording began is unknown.
                if let Some(s) = live_blocks.remove(&addr) {
                    e.extra.requested = None;
                    row(kind, addr, s, &e);
                }
            }
            EventKind::Oom => {
                e.extra.device_free = refused_segment(rec, pid, i).map(|_| 0);
                row(kind, 0, size, &e)
            }
            _ => {}
        }
    }
    // OOMs are written as failed calls never returning: their `ret` is 0
    // like a snapshot's; the rows above kept only successful ones.
    let synthetic_details = SnapshotDetails {
        snapshot: format!("{} (PyTorch's allocator, as recorded)", recording.trace.dir.display()),
        layout: "recorded by `fragscope record` (probes on PyTorch's caching allocator)".into(),
        devices: vec![unit],
        device_count: 1,
        // What `whatif` replays: this device, from an empty state (the
        // recording starts with the process, or with `--pid` mid-run).
        reconstruction: vec![crate::trace::details::Reconstruction {
            device: unit,
            entries: out.len() as u64,
            ..Default::default()
        }],
        time_source: "the recording's clock (CLOCK_MONOTONIC)".into(),
        ..SnapshotDetails::default()
    };
    let mut trace = recording.trace.clone();
    if let Some(m) = trace.meta.as_mut() {
        m.details = Details::Snapshot(Box::new(synthetic_details));
    }
    trace.pytorch_columns = true;
    let synthetic = Loaded { trace, events: out, out_of_order: 0 };
    let mut joined = super::join::join_probed(recording, synthetic)?;
    if let Some(j) = joined.trace.meta.as_mut().and_then(|m| m.details.snapshot_mut()).and_then(|d| d.join.as_mut()) {
        // One clock: nothing to agree on.
        j.clock_disagreement_ns = None;
        j.probed = true;
    }
    Ok(joined)
}

/// The device allocation of `pid` that CUDA refused with out-of-memory
/// during the allocation that ended in the OOM at row `oom` (after its
/// start, before the process's next block event): PyTorch asked CUDA for a
/// segment and got none, so the device had less than that free. The OOM
/// is then classified with no device memory free beyond PyTorch's cache
/// (`device_free` 0), as a snapshot's OOM with CUDA's free memory is.
fn refused_segment(rec: &Events, pid: u32, oom: usize) -> Option<usize> {
    (oom + 1..rec.len())
        .filter(|&i| rec.pid[i] == pid)
        .take_while(|&i| !matches!(rec.kind[i], Some(EventKind::BlockAlloc | EventKind::BlockFree | EventKind::Oom)))
        .find(|&i| rec.kind[i].is_some_and(EventKind::can_run_out_of_memory) && rec.ret[i] == crate::trace::event::CUDA_ERROR_OUT_OF_MEMORY)
}

/// The rows of `pid`'s device allocations that a block of it was placed in
/// while they lived.
fn pytorch_segments(rec: &Events, pid: u32) -> HashSet<usize> {
    let mut live: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
    let mut out = HashSet::new();
    for i in (0..rec.len()).filter(|&i| rec.pid[i] == pid && rec.ret[i] == 0) {
        let Some(kind) = rec.kind[i] else { continue };
        let (addr, size) = (rec.addr[i], rec.size[i]);
        if kind.is_device_alloc() && size > 0 {
            live.insert(addr, (addr + size, i));
        } else if kind == EventKind::MemUnmap {
            let inside: Vec<u64> = live.range(addr..addr.saturating_add(size)).map(|(&a, _)| a).collect();
            for a in inside {
                live.remove(&a);
            }
        } else if kind.is_device_free() {
            live.remove(&addr);
        } else if kind == EventKind::BlockAlloc
            && let Some((_, &(end, row))) = live.range(..=addr).next_back()
            && end > addr
        {
            out.insert(row);
        }
    }
    out
}
