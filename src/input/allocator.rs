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
//! - **Blocks in no recorded segment** lie in segments PyTorch got before
//!   the recording began (`record --pid` on a running program): each counts
//!   as a segment of its own size, and the report says how many.
//! - **Everything else** the process allocated on the device (the math
//!   libraries' workspaces, NCCL, extensions) is outside PyTorch's
//!   allocator: a segment holding one block, at a call site naming the
//!   library that called, as in the join of a recording with a snapshot
//!   ([`super::join`], whose helpers name it).
//! - **Units.** Each process with blocks is a unit of the view (each GPU of
//!   a process that used several, [`super::units`]). One unit is named by
//!   its device, as a snapshot's; several get ids above every pid, named
//!   "PID on GPU N" ([`crate::trace::Trace::units`]).
//! - **OOMs**: a `malloc` that never returned (it threw). The recorder
//!   gives it the free memory CUDA reported to PyTorch during it
//!   (`cudaMemGetInfo`, the figure of PyTorch's error message and of a
//!   snapshot's `oom` entry), so it is classified as a snapshot's is.
//!   Without that figure its class stays unknown: that CUDA refused a
//!   segment bounds the free memory below the segment, which is too loose
//!   to tell capacity from fragmentation (on an H200, the cache's 800 MiB of
//!   tails and 599 MiB on the device beside a 1 GiB request).
//! - **Block sizes** follow PyTorch's own rules on the recorded layout
//!   ([`block_sizes`]): the request rounded under the process's
//!   `PYTORCH_CUDA_ALLOC_CONF` (which `record` keeps), and kept whole
//!   rather than split when PyTorch's split rule says so (a large-pool
//!   block leaves no remainder over 1 MiB; an oversize one is never split),
//!   the free block it came from being what the recorded segments and
//!   blocks leave free there. A size the recording contradicts (a later
//!   block inside the remainder) falls back to the rounded request.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use anyhow::Result;

use super::join::{OUTSIDE, callers, library_of, real_pid};
use super::loaded::Loaded;
use super::units::FIRST_UNIT;
use crate::trace::details::{Details, Join, JoinOutside, OutsideSpan, Reconstruction, SnapshotDetails};
use crate::trace::event::{Event, EventKind, Events, Extra, NO_STACK};
use crate::trace::stacks::{Frame, Stacks};

/// Whether the loaded recording holds PyTorch's blocks (a recording whose
/// recorder was killed before it wrote `trace.json` counts as one).
pub fn has_blocks(l: &Loaded) -> bool {
    l.trace.source().is_none_or(|s| s == crate::trace::Source::Ebpf)
        && l.events.kind.iter().any(|k| *k == Some(EventKind::BlockAlloc))
}

/// The allocator settings of process `pid` of a recording, as `record`
/// kept its `PYTORCH_CUDA_ALLOC_CONF` (PyTorch's defaults without it); an
/// entry this version does not know is left out and given to `bad` with
/// why.
pub(crate) fn recorded_settings(
    trace: &crate::trace::Trace,
    pid: u32,
    mut bad: impl FnMut(&str, String),
) -> crate::allocator::Settings {
    let mut s = crate::allocator::Settings::default();
    let conf =
        trace.meta.as_ref().and_then(|m| m.details.record()).and_then(|d| d.allocator_conf.get(&pid.to_string()));
    for entry in conf.into_iter().flat_map(|c| crate::import::settings::split_conf(c)) {
        if let Err(e) = s.apply(entry) {
            bad(entry, e);
        }
    }
    s
}

/// [`recorded_settings`], warning of each entry left out.
fn settings_of(recording: &Loaded, pid: u32) -> crate::allocator::Settings {
    recorded_settings(&recording.trace, pid, |entry, e| {
        tracing::warn!("PYTORCH_CUDA_ALLOC_CONF of pid {pid}: {entry}: {e}; left out");
    })
}

/// Whether the allocator of `unit` ran with expandable segments, as its
/// segments show: mapped pages (`segment_map`) or whole `cudaMalloc`
/// segments. None: it made no segment in the recording.
pub(crate) fn expandable_in_use(events: &Events, unit: u32) -> Option<bool> {
    let mut plain = false;
    for i in 0..events.len() {
        if events.pid[i] != unit || events.ret[i] != 0 {
            continue;
        }
        match events.kind[i] {
            Some(EventKind::SegmentMap) => return Some(true),
            Some(EventKind::SegmentAlloc) => plain = true,
            _ => {}
        }
    }
    plain.then_some(false)
}

/// The size of each block of a unit (its `rows`, in time order; by its
/// `block_alloc` row), as
/// PyTorch's allocator would have carved it from the recorded layout: the
/// allocator model ([`crate::allocator`]) follows the unit's
/// recorded segments and blocks, and takes each block where it was
/// recorded, splitting by PyTorch's rules. Blocks of expandable segments,
/// and those the model cannot place, keep the rounded request. Then any
/// block that a later block lands inside while it lives is cut back to the
/// rounded request: the recording shows PyTorch did split there.
fn block_sizes(
    rec: &Events,
    rows: &[usize],
    pytorch: &HashSet<usize>,
    settings: &crate::allocator::Settings,
) -> HashMap<usize, u64> {
    use crate::allocator::{Allocator, SMALL_BUFFER};
    let mut model = Allocator::new(settings.clone());
    let mut sizes: HashMap<usize, u64> = HashMap::new();
    let mut rounded: HashMap<usize, u64> = HashMap::new();
    for &i in rows.iter().filter(|&&i| rec.ret[i] == 0) {
        let Some(kind) = rec.kind[i] else { continue };
        let (addr, size) = (rec.addr.at(i), rec.size.at(i));
        let stream = rec.stream.get(i).unwrap_or(0);
        match kind {
            EventKind::Alloc | EventKind::AllocAsync | EventKind::AllocManaged if pytorch.contains(&i) => {
                model.add_segment(addr, size, stream, size == SMALL_BUFFER);
            }
            k if k.is_device_free() && k != EventKind::MemUnmap => {
                model.release_segment(addr);
            }
            EventKind::BlockAlloc => {
                let requested = rec.requested.get(i).copied().filter(|&r| r != u64::MAX).unwrap_or(size);
                let r = settings.round(requested);
                rounded.insert(i, r);
                let carved = model.take(addr, r).or_else(|| model.take_exact(addr, r).then_some(r));
                sizes.insert(i, carved.unwrap_or(r));
            }
            EventKind::BlockFree => {
                model.free(addr);
            }
            _ => {}
        }
    }
    // Where the recording shows a split the model did not make.
    let mut live: BTreeMap<u64, usize> = BTreeMap::new();
    for &i in rows.iter().filter(|&&i| rec.ret[i] == 0) {
        match rec.kind[i] {
            Some(EventKind::BlockAlloc) => {
                let addr = rec.addr.at(i);
                if let Some((&a, &row)) = live.range(..addr).next_back()
                    && a + sizes[&row] > addr
                {
                    sizes.insert(row, rounded[&row]);
                }
                let end = addr + sizes[&i];
                if live.range(addr + 1..end).next().is_some() {
                    sizes.insert(i, rounded[&i]);
                }
                live.insert(addr, i);
            }
            Some(EventKind::BlockFree) => {
                live.remove(&rec.addr.at(i));
            }
            _ => {}
        }
    }
    sizes
}

/// What one unit's rows are, found before any event is written.
struct Unit {
    /// The unit's rows in the recording (pid, or a per-device unit id).
    key: u32,
    /// Its id in the view.
    id: u32,
    /// Its rows, in time order.
    rows: Vec<usize>,
    /// Rows of device allocations that are PyTorch's segments.
    pytorch: HashSet<usize>,
    /// Rows of device allocations outside PyTorch's allocator.
    outside: Vec<usize>,
}

/// The recording in the allocator view (unchanged without blocks).
pub fn view(recording: Loaded) -> Result<Loaded> {
    if !has_blocks(&recording) {
        return Ok(recording);
    }
    let rec = &recording.events;
    let keys: BTreeSet<u32> =
        (0..rec.len()).filter(|&i| rec.kind[i] == Some(EventKind::BlockAlloc)).map(|i| rec.pid[i]).collect();
    // Each unit's rows, found in one pass.
    let mut rows_of: BTreeMap<u32, Vec<usize>> = keys.iter().map(|&k| (k, Vec::new())).collect();
    for i in 0..rec.len() {
        if let Some(rows) = rows_of.get_mut(&rec.pid[i]) {
            rows.push(i);
        }
    }
    let details = recording.trace.meta.as_ref().and_then(|m| m.details.record());
    // A unit's process and device.
    let whose = |key: u32| -> (u32, i32) {
        if let Some(&(pid, d)) = recording.trace.units.get(&key) {
            return (pid, d);
        }
        let device = details.and_then(|d| d.devices.get(&key.to_string())).and_then(|d| d.first().copied());
        (key, device.unwrap_or(0))
    };
    let several = keys.len() > 1;
    let units: Vec<Unit> = rows_of
        .into_iter()
        .enumerate()
        .map(|(n, (key, rows))| {
            let pytorch = pytorch_segments(rec, &rows);
            let outside = rows
                .iter()
                .copied()
                .filter(|&i| rec.ret[i] == 0 && rec.size.at(i) > 0)
                .filter(|&i| rec.kind[i].is_some_and(EventKind::is_device_alloc) && !pytorch.contains(&i))
                .collect();
            let id = if several { FIRST_UNIT + n as u32 } else { whose(key).1.max(0) as u32 };
            Unit { key, id, rows, pytorch, outside }
        })
        .collect();

    // The library that made each outside allocation.
    let wanted: HashSet<(u32, u64, u64)> = units
        .iter()
        .flat_map(|u| u.outside.iter().map(|&i| (real_pid(&recording, rec.pid[i]), rec.ts_ns.at(i), rec.addr.at(i))))
        .collect();
    let callers = if wanted.is_empty() { HashMap::new() } else { callers(&recording, &wanted) };
    let mut maps = HashMap::new();
    let mut stacks = Stacks::default();
    let mut site_of: BTreeMap<String, u32> = BTreeMap::new();
    let mut library: HashMap<usize, (String, u32)> = HashMap::new();
    for &i in units.iter().flat_map(|u| u.outside.iter()) {
        let name = library_of(&recording, &callers, &mut maps, i);
        let stack = *site_of.entry(name.clone()).or_insert_with(|| {
            stacks.frames.push(Frame { filename: name.clone(), line: 0, name: OUTSIDE.into() });
            stacks.stacks.push(vec![(stacks.frames.len() - 1) as u32]);
            (stacks.stacks.len() - 1) as u32
        });
        library.insert(i, (name, stack));
    }

    let mut out = Events::default();
    let mut launches: Vec<Event> = Vec::new();
    let mut spans = Vec::new();
    let (mut segments, mut orphans, mut runtime_calls) = (0u64, 0u64, 0u64);
    for u in &units {
        let id = u.id;
        let sizes = block_sizes(rec, &u.rows, &u.pytorch, &settings_of(&recording, whose(u.key).0));
        let mut row = |kind: EventKind, addr: u64, size: u64, e: &Event, extra: Extra| {
            out.push(&Event { stream: e.stream.or(Some(0)), extra, ..Event::new(e.ts_ns, id, kind, addr, size) });
        };
        let plain = |e: &Event, size: u64| Extra {
            requested: e.extra.requested.or(Some(size)),
            stack: Some(NO_STACK),
            device_free: e.extra.device_free,
        };
        // Live PyTorch segments (start → size, mapped page), outside
        // allocations (start → size, stack, span), blocks (address → size,
        // in a segment of its own).
        let mut live_segments: BTreeMap<u64, (u64, bool)> = BTreeMap::new();
        let mut live_outside: HashMap<u64, (u64, u32, usize)> = HashMap::new();
        let mut live_blocks: HashMap<u64, (u64, bool)> = HashMap::new();
        for &i in &u.rows {
            let (Some(kind), Some(mut e)) = (rec.kind[i], rec.get(i)) else { continue };
            let (addr, size) = (rec.addr.at(i), rec.size.at(i));
            runtime_calls += u64::from(kind.is_device_alloc() || kind.is_device_free());
            if rec.ret[i] != 0 && !matches!(kind, EventKind::Oom | EventKind::Launch) {
                continue;
            }
            match kind {
                k if k.is_device_alloc() && u.pytorch.contains(&i) => {
                    let map = k == EventKind::MemMap;
                    live_segments.insert(addr, (size, map));
                    segments += 1;
                    let kind = if map { EventKind::SegmentMap } else { EventKind::SegmentAlloc };
                    row(kind, addr, size, &e, plain(&e, size));
                }
                k if k.is_device_alloc() && size > 0 => {
                    let Some((name, stack)) = library.get(&i) else { continue };
                    let extra = Extra { requested: Some(size), stack: Some(*stack), device_free: None };
                    row(EventKind::SegmentAlloc, addr, size, &e, extra);
                    row(EventKind::BlockAlloc, addr, size, &e, extra);
                    live_outside.insert(addr, (size, *stack, spans.len()));
                    let unit = several.then_some(id);
                    spans.push(OutsideSpan { from_ns: e.ts_ns, to_ns: None, bytes: size, library: name.clone(), unit });
                }
                k if k.is_device_free() => {
                    let end = if k == EventKind::MemUnmap { addr.saturating_add(size) } else { addr.saturating_add(1) };
                    let pages: Vec<(u64, u64, bool)> =
                        live_segments.range(addr..end).map(|(&a, &(s, map))| (a, s, map)).collect();
                    for (a, s, map) in pages {
                        // A whole segment goes with cudaFree; pages with cuMemUnmap.
                        if map == (k == EventKind::MemUnmap) {
                            live_segments.remove(&a);
                            let kind = if map { EventKind::SegmentUnmap } else { EventKind::SegmentFree };
                            row(kind, a, s, &e, plain(&e, s));
                        }
                    }
                    if let Some((s, stack, span)) = live_outside.remove(&addr) {
                        let extra = Extra { requested: Some(s), stack: Some(stack), device_free: None };
                        row(EventKind::BlockFree, addr, s, &e, extra);
                        row(EventKind::SegmentFree, addr, s, &e, extra);
                        spans[span].to_ns = Some(e.ts_ns);
                    }
                }
                EventKind::BlockAlloc => {
                    let inside = live_segments.range(..=addr).next_back().is_some_and(|(&a, &(s, _))| a + s > addr);
                    if !inside {
                        orphans += 1;
                        row(EventKind::SegmentAlloc, addr, size, &e, plain(&e, size));
                    }
                    let size = if inside { sizes.get(&i).copied().unwrap_or(size) } else { size };
                    live_blocks.insert(addr, (size, !inside));
                    row(kind, addr, size, &e, plain(&e, size));
                }
                EventKind::BlockFree => {
                    // A block allocated before the recording began is unknown.
                    if let Some((s, own_segment)) = live_blocks.remove(&addr) {
                        e.extra.requested = None;
                        row(kind, addr, s, &e, plain(&e, s));
                        if own_segment {
                            row(EventKind::SegmentFree, addr, s, &e, plain(&e, s));
                        }
                    }
                }
                // Its `device_free` is what the recorder kept with the call
                // (CUDA's free memory as it failed), if any.
                EventKind::Oom => row(kind, 0, size, &e, plain(&e, size)),
                // Kernel launches, whole: the iterations of a recording
                // without Python frames are found from them.
                EventKind::Launch => launches.push(Event { pid: id, ..e }),
                _ => {}
            }
        }
    }
    for e in &launches {
        out.push(e);
    }
    out.sort_by_time();

    let join = Join {
        launches_at_entry: recording.trace.meta.as_ref().is_some_and(|m| m.details.launches_at_entry()),
        recording: recording.trace.dir.display().to_string(),
        pids: units.iter().map(|u| whose(u.key).0).collect::<BTreeSet<_>>().into_iter().collect(),
        probed: true,
        blocks_without_segment: orphans,
        runtime_calls: Some(runtime_calls),
        segments_matched: segments,
        segments_total: segments,
        clock_offset_ns: 0,
        clock_disagreement_ns: None,
        outside: JoinOutside {
            allocations: spans.len() as u64,
            bytes: spans.iter().map(|s| s.bytes).sum(),
            by_library: crate::trace::details::by_library(&spans),
            spans,
        },
    };
    // Whether the first unit's segments show expandable segments (one scan).
    let expandable_used = units.first().and_then(|u| expandable_in_use(&out, u.id));
    let snapshot = SnapshotDetails {
        snapshot: format!("{} (PyTorch's allocator, as recorded)", recording.trace.dir.display()),
        layout: "recorded by `fragscope record` (probes on PyTorch's caching allocator)".into(),
        devices: units.iter().map(|u| u.id).collect(),
        device_count: units.len(),
        time_source: "the recording's clock (CLOCK_MONOTONIC)".into(),
        // What `whatif` replays: each unit, from an empty state (the
        // recording starts with the process, or with `--pid` mid-run).
        reconstruction: units
            .iter()
            .map(|u| Reconstruction {
                device: u.id,
                entries: out
                    .pid
                    .iter()
                    .zip(&out.kind)
                    .filter(|&(p, &k)| p == u.id && k != Some(EventKind::Launch))
                    .count() as u64,
                ..Default::default()
            })
            .collect(),
        join: Some(join),
        // What `whatif` replays as the recorded settings: the first
        // process's (a snapshot records one process's too), with
        // expandable segments as its segments show them, not as asked.
        allocator_settings: units.first().map_or(serde_json::Value::Null, |u| {
            let pid = whose(u.key).0;
            let mut s = settings_of(&recording, pid);
            if let Some(used) = expandable_used {
                // Asked in `PYTORCH_ALLOC_CONF` alone and not in force: the
                // allocator did not read that variable (PyTorch 2.9), so
                // none of its keys were in force either.
                let env = details.and_then(|d| d.allocator_env.get(&pid.to_string()));
                let only_new = env.is_some_and(|e| e.len() == 1 && e.contains_key("PYTORCH_ALLOC_CONF"));
                if s.expandable_segments && !used && only_new {
                    s = crate::allocator::Settings::default();
                }
                s.expandable_segments = used;
            }
            s.to_snapshot()
        }),
        inferred_settings: expandable_used.map(|_| vec!["expandable_segments".to_string()]).unwrap_or_default(),
        asked: units.iter().filter_map(|u| details?.asked(whose(u.key).0, u.id)).collect(),
        ..SnapshotDetails::default()
    };
    let new_units = if several { units.iter().map(|u| (u.id, whose(u.key))).collect() } else { BTreeMap::new() };
    let mut trace = recording.trace;
    // A recording without trace.json (its recorder was killed) gets one
    // here: the view's details live in it.
    let meta = trace.meta.get_or_insert_with(|| crate::trace::TraceMeta::new(crate::trace::Source::Ebpf));
    meta.details = Details::Snapshot(Box::new(snapshot));
    trace.units = new_units;
    trace.stacks = Some(Arc::new(stacks));
    trace.pytorch_columns = true;
    Ok(Loaded { trace, events: out, out_of_order: recording.out_of_order })
}

/// The rows of a unit's device allocations (of its `rows`, in time order)
/// that a block of it was placed in while they lived: every one the block
/// overlaps (a block of an expandable segment spans many mapped pages).
fn pytorch_segments(rec: &Events, rows: &[usize]) -> HashSet<usize> {
    let mut live: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
    let mut out = HashSet::new();
    for &i in rows.iter().filter(|&&i| rec.ret[i] == 0) {
        let Some(kind) = rec.kind[i] else { continue };
        let (addr, size) = (rec.addr.at(i), rec.size.at(i));
        if kind.is_device_alloc() && size > 0 {
            live.insert(addr, (addr + size, i));
        } else if kind == EventKind::MemUnmap {
            let inside: Vec<u64> = live.range(addr..addr.saturating_add(size)).map(|(&a, _)| a).collect();
            for a in inside {
                live.remove(&a);
            }
        } else if kind.is_device_free() {
            live.remove(&addr);
        } else if kind == EventKind::BlockAlloc {
            // The allocation the block starts in, and those it runs into.
            let first = live.range(..=addr).next_back().filter(|(_, e)| e.0 > addr).map(|(_, e)| e.1);
            let end = addr.saturating_add(size.max(1));
            out.extend(first.into_iter().chain(live.range(addr.saturating_add(1)..end).map(|(_, &(_, row))| row)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(t: u64, addr: u64, requested: u64) -> Event {
        let mut e = Event::new(t, 7, EventKind::BlockAlloc, addr, requested.div_ceil(512) * 512);
        e.extra.requested = Some(requested);
        e
    }

    #[test]
    fn block_sizes_follow_pytorchs_split_rule_unless_the_recording_says_otherwise() {
        const MIB: u64 = 1 << 20;
        let (a, b, c) = (0x1000_0000, 0x2000_0000, 0x3000_0000);
        let mut ev = Events::default();
        for e in [
            // A 20 MiB segment and a request leaving 0.5 MiB: not split.
            Event::new(1, 7, EventKind::Alloc, a, 20 * MIB),
            block(2, a, 19 * MIB + MIB / 2),
            // Another, and a request leaving 10 MiB: split.
            Event::new(3, 7, EventKind::Alloc, b, 20 * MIB),
            block(4, b, 10 * MIB),
            // A third where the rule says whole, but a later block lands in
            // the remainder while it lives: the recording wins.
            Event::new(5, 7, EventKind::Alloc, c, 20 * MIB),
            block(6, c, 19 * MIB + MIB / 2),
            block(7, c + 19 * MIB + MIB / 2, 4096),
        ] {
            ev.push(&e);
        }
        let rows: Vec<usize> = (0..ev.len()).collect();
        let pytorch = pytorch_segments(&ev, &rows);
        let sizes = block_sizes(&ev, &rows, &pytorch, &crate::allocator::Settings::default());
        assert_eq!(sizes[&1], 20 * MIB);
        assert_eq!(sizes[&3], 10 * MIB);
        assert_eq!(sizes[&5], 19 * MIB + MIB / 2);
        assert_eq!(sizes[&6], 4096);
    }

    /// The real H100 snapshots of `../shared` know PyTorch's true block
    /// sizes: seen as the probes see them (segments as `cudaMalloc`s,
    /// blocks with their requests), the sizes derived here must agree.
    #[test]
    fn block_sizes_agree_with_pytorchs_on_the_real_snapshots() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/gpu-h100/snapshots");
        let Ok(rd) = std::fs::read_dir(&dir) else {
            eprintln!("SKIPPED block_sizes_agree_with_pytorchs_on_the_real_snapshots: no {}", dir.display());
            return;
        };
        let mut files: Vec<_> =
            rd.map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "pickle")).collect();
        files.sort();
        let (mut total, mut same, mut whole, mut whole_same) = (0u64, 0u64, 0u64, 0u64);
        for path in files {
            let loaded = crate::input::open(&path, None).unwrap();
            let details = loaded.trace.meta.as_ref().and_then(|m| m.details.snapshot()).unwrap();
            let settings = crate::allocator::Settings::from_snapshot(&details.allocator_settings);
            let snap = &loaded.events;
            for device in snap.pid.iter().collect::<BTreeSet<u32>>() {
                // The snapshot as a recording: segments as cudaMalloc/cudaFree
                // (pages as cuMemMap/cuMemUnmap), blocks with their requests.
                let mut rec = Events::default();
                let mut truth = Vec::new();
                for i in (0..snap.len()).filter(|&i| snap.pid[i] == device) {
                    let Some(mut e) = snap.get(i) else { continue };
                    e.kind = match e.kind {
                        EventKind::SegmentAlloc => EventKind::Alloc,
                        EventKind::SegmentFree => EventKind::Free,
                        EventKind::SegmentMap => EventKind::MemMap,
                        EventKind::SegmentUnmap => EventKind::MemUnmap,
                        EventKind::BlockAlloc => {
                            let rounded = settings.round(e.extra.requested.unwrap_or(e.size));
                            truth.push((rec.len(), e.size, e.size != rounded));
                            EventKind::BlockAlloc
                        }
                        EventKind::BlockFree => EventKind::BlockFree,
                        _ => continue,
                    };
                    rec.push(&e);
                }
                let rows: Vec<usize> = (0..rec.len()).collect();
                let pytorch = pytorch_segments(&rec, &rows);
                let sizes = block_sizes(&rec, &rows, &pytorch, &settings);
                let agree = truth.iter().filter(|(row, size, _)| sizes.get(row) == Some(size)).count() as u64;
                let unsplit: Vec<_> = truth.iter().filter(|t| t.2).collect();
                let unsplit_agree = unsplit.iter().filter(|(row, size, _)| sizes.get(row) == Some(size)).count();
                eprintln!(
                    "{}: device {device}: {agree} of {} block sizes; of the {} larger than the rounded request, {unsplit_agree}",
                    path.display(),
                    truth.len(),
                    unsplit.len()
                );
                total += truth.len() as u64;
                same += agree;
                whole += unsplit.len() as u64;
                whole_same += unsplit_agree as u64;
            }
        }
        eprintln!("all: {same} of {total}; larger than the rounded request: {whole_same} of {whole}");
        // Every one, the blocks PyTorch left unsplit among them (on the
        // H100 runs: 132 272 blocks, 2 009 of them unsplit).
        assert!(total > 0 && whole > 0);
        assert_eq!((same, whole_same), (total, whole));
    }

    /// An event of a snapshot (or of one joined with a recording) as the
    /// probes record it: segments as the device allocations they were,
    /// blocks with their request rounded as the probe rounds it, no stack;
    /// `None` for what they do not see (`outside`: an allocation outside
    /// PyTorch, which has no block).
    fn as_probed(mut e: Event, outside: bool) -> Option<Event> {
        e.kind = match (e.kind, outside) {
            (EventKind::SegmentAlloc, _) => EventKind::Alloc,
            (EventKind::SegmentFree, _) => EventKind::Free,
            (EventKind::SegmentMap, _) => EventKind::MemMap,
            (EventKind::SegmentUnmap, _) => EventKind::MemUnmap,
            (EventKind::BlockAlloc, false) => {
                e.size = e.extra.requested.unwrap_or(e.size).div_ceil(512) * 512;
                EventKind::BlockAlloc
            }
            (k @ (EventKind::BlockFree | EventKind::Oom), false) => k,
            _ => return None,
        };
        e.extra.stack = None;
        Some(e)
    }

    /// The real H100 run recorded both ways (`training-default`), joined
    /// (the trusted view: the snapshot's blocks, the recording's outside
    /// memory), then written back as the probes would have recorded it
    /// (segments as `cudaMalloc`s, blocks with their requests, the outside
    /// allocations as they were) and put in this view: the same segments,
    /// outside memory and figures. The verdicts differ only where the
    /// snapshot knows more: its annotations mark the steps.
    #[test]
    fn a_real_run_seen_by_the_probes_is_analysed_as_its_snapshot_joined_with_its_recording() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/gpu-h100");
        let (rec_dir, snap_file) = (root.join("ebpf/training-default"), root.join("snapshots/training-default.pickle"));
        if !rec_dir.is_dir() || !snap_file.is_file() {
            eprintln!("SKIPPED a_real_run_seen_by_the_probes_is_analysed_as_its_snapshot: no {}", root.display());
            return;
        }
        let open = |p: &std::path::Path| crate::input::open(p, None).unwrap();
        let rec = open(&rec_dir);
        let joined = crate::input::join(open(&rec_dir), open(&snap_file)).unwrap();
        let j = joined.trace.meta.as_ref().and_then(|m| m.details.snapshot()).and_then(|d| d.join.clone()).unwrap();
        let outside: HashSet<u32> =
            joined.trace.stacks.as_deref().map_or_else(Default::default, crate::input::outside_stacks);
        let mut events = Events::default();
        for i in 0..joined.events.len() {
            let Some(e) = joined.events.get(i) else { continue };
            let is_outside = e.extra.stack.is_some_and(|s| outside.contains(&s));
            let Some(mut e) = as_probed(e, is_outside) else { continue };
            e.pid = j.pids[0];
            events.push(&e);
        }
        // The recording's kernel launches, which the probes record too
        // (the join leaves them out).
        for i in 0..rec.events.len() {
            if rec.events.kind[i] == Some(EventKind::Launch)
                && let Some(mut e) = rec.events.get(i)
            {
                // On the snapshot's clock, as the joined view is.
                e.pid = j.pids[0];
                e.ts_ns = (e.ts_ns as i64 - j.clock_offset_ns) as u64;
                events.push(&e);
            }
        }
        events.sort_by_time();
        let rec_probed = events.clone();
        let probed = view(Loaded { trace: rec.trace.clone(), events, out_of_order: 0 }).unwrap();
        let pj = probed.trace.meta.as_ref().and_then(|m| m.details.snapshot()).and_then(|d| d.join.clone()).unwrap();
        assert_eq!((pj.segments_matched, pj.blocks_without_segment), (j.segments_matched, 0));
        assert_eq!((pj.outside.allocations, pj.outside.bytes), (j.outside.allocations, j.outside.bytes));
        let opts = crate::analysis::Options::default();
        let (a, b) = (
            crate::analysis::analyze_loaded(probed, &opts).unwrap(),
            crate::analysis::analyze_loaded(joined, &opts).unwrap(),
        );
        let figures = |x: &crate::analysis::Analysis| {
            let last = x.rows.iter().rev().find_map(|r| r.alloc);
            let peaks: Vec<(u64, u64)> = x.peaks.iter().map(|p| (p.bytes, p.span_bytes)).collect();
            (peaks, x.ooms.len(), last.map(|f| (f.reserved_bytes, f.allocated_bytes)), x.rows.len())
        };
        assert_eq!(figures(&a), figures(&b));
        // The snapshot's `ProfilerStep` annotations give its iterations,
        // equal floors: not leaking. The probes see no annotation and no
        // Python frame; their kernel launches give the iterations, and the
        // same verdict.
        let verdicts = |x: &crate::analysis::Analysis| x.leaks.iter().map(|l| l.verdict).collect::<Vec<_>>();
        assert_eq!(verdicts(&b), vec![crate::analysis::leak::Verdict::NotLeaking], "{:?}", b.leaks[0].reason);
        assert_eq!(verdicts(&a), verdicts(&b), "{:?}", a.leaks[0].reason);
        assert_eq!(a.iterations[0].source, crate::analysis::iterations::IterationSource::Launches);
        assert_eq!((a.iterations[0].count, a.iterations[0].complete), (6, 5), "docs/recording.md says so");
        // Without its launches (`record --no-launch`), nothing marks a
        // step: a floor that held over repeated rises may be layers as well
        // as steps, so it cannot tell.
        let mut no_launches = rec_probed.clone();
        no_launches.retain(|e, i| e.kind[i] != Some(EventKind::Launch));
        let c = view(Loaded { trace: rec.trace.clone(), events: no_launches, out_of_order: 0 }).unwrap();
        let c = crate::analysis::analyze_loaded(c, &opts).unwrap();
        assert_eq!(verdicts(&c), vec![crate::analysis::leak::Verdict::CannotTell], "{:?}", c.leaks[0].reason);
        assert!(c.leaks[0].reason.contains("no Python frames to find one in"), "{}", c.leaks[0].reason);
    }

    /// The real fragmentation OOM of the H100 fixtures (`varshape`: 1 GiB
    /// asked, 600 MiB on the device and 800 MiB in the cached tails) as the
    /// probes record it: its snapshot's segments as `cudaMalloc`s, its
    /// blocks and its OOM, in a recording of the same program. With the
    /// free memory CUDA reported during the failed call (the recorder's
    /// `cudaMemGetInfo`), it is the snapshot's fragmentation OOM, and the
    /// capacity is inferred as the snapshot's. Without that figure it is
    /// unknown, and no capacity is inferred from it: that CUDA refused a
    /// segment says only that less than the segment was free, and the
    /// cache alone (800 MiB) would make it one of capacity.
    #[test]
    fn a_recorded_oom_is_classified_from_the_free_memory_cuda_reported_during_it() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/gpu-h100");
        let (rec_dir, snap_file) = (root.join("ebpf/varshape-default"), root.join("snapshots/varshape-default.pickle"));
        if !rec_dir.is_dir() || !snap_file.is_file() {
            eprintln!(
                "SKIPPED a_recorded_oom_is_classified_from_the_free_memory_cuda_reported_during_it: no {}",
                root.display()
            );
            return;
        }
        let open = |p: &std::path::Path| crate::input::open(p, None).unwrap();
        let snap = open(&snap_file);
        let opts = crate::analysis::Options { whatif: true, ..Default::default() };
        // `capacity`: the GPU's total, as the recorder reads it from NVML.
        let probed = |keep_free: bool, capacity: Option<u64>| {
            let mut rec = open(&rec_dir);
            rec.trace.meta.as_mut().unwrap().capacity_bytes = capacity;
            let pid = rec.trace.meta.as_ref().unwrap().pids[0];
            let mut events = Events::default();
            for i in 0..snap.events.len() {
                let Some(mut e) = snap.events.get(i).and_then(|e| as_probed(e, false)) else { continue };
                if !keep_free {
                    e.extra.device_free = None;
                }
                e.pid = pid;
                events.push(&e);
            }
            let v = view(Loaded { trace: rec.trace, events, out_of_order: 0 }).unwrap();
            crate::analysis::analyze_loaded(v, &opts).unwrap()
        };
        let truth = crate::analysis::analyze_loaded(open(&snap_file), &opts).unwrap();
        let class = |a: &crate::analysis::Analysis| a.ooms.iter().map(|o| o.class).collect::<Vec<_>>();
        assert_eq!(class(&truth), vec![crate::analysis::oom::OomClass::Fragmentation]);
        let with = probed(true, None);
        assert_eq!(class(&with), class(&truth));
        assert_eq!(
            (with.ooms[0].cuda_free, with.ooms[0].device_free, with.ooms[0].largest_free),
            (truth.ooms[0].cuda_free, truth.ooms[0].device_free, truth.ooms[0].largest_free)
        );
        let without = probed(false, None);
        assert_eq!(class(&without), vec![crate::analysis::oom::OomClass::Unknown]);
        assert_eq!(without.ooms[0].device_free, None);
        // The what-if replays PyTorch's requests under what the process had
        // (the OOM's figure), as the snapshot's does, not under the GPU's
        // total that the recorder read from NVML: the budget's blocker
        // outside PyTorch held the rest. Both recommend the same setting,
        // the one that removed this OOM on the H100 (outcomes.json).
        let recommended = |a: &crate::analysis::Analysis| {
            let w = a.whatif.as_ref().unwrap();
            (w.scenarios[w.recommended.0].name.clone(), w.recommended.1.clone(), w.capacity, w.capacity_inferred)
        };
        let h100 = 85_045_231_616;
        let nvml = probed(true, Some(h100));
        assert_eq!(nvml.trace.meta.as_ref().unwrap().capacity_bytes, Some(h100));
        let (w, t) = (recommended(&nvml), recommended(&truth));
        assert_eq!(w, t);
        assert!(w.0 == "expandable_segments:True" && w.3, "{w:?}");
    }

    #[test]
    fn a_block_over_several_mapped_pages_makes_each_of_them_pytorchs() {
        const PAGE: u64 = 2 << 20;
        let mut ev = Events::default();
        // Three pages of an expandable segment, a block over the first two
        // and a half, and a workspace of another library beside them.
        for (t, kind, addr, size) in [
            (1, EventKind::MemMap, 0x1000_0000, PAGE),
            (2, EventKind::MemMap, 0x1000_0000 + PAGE, PAGE),
            (3, EventKind::MemMap, 0x1000_0000 + 2 * PAGE, PAGE),
            (4, EventKind::Alloc, 0x9000_0000, 64 << 20),
            (5, EventKind::BlockAlloc, 0x1000_0000, 2 * PAGE + 4096),
        ] {
            ev.push(&Event::new(t, 7, kind, addr, size));
        }
        let rows = pytorch_segments(&ev, &(0..ev.len()).collect::<Vec<_>>());
        assert_eq!(rows, HashSet::from([0, 1, 2]));
    }
}
