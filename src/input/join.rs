//! One view of a run recorded both ways (`analyze TRACE --snapshot SNAP`):
//! PyTorch's memory snapshot sees its blocks inside its segments; the eBPF
//! recording sees every device allocation of the process, PyTorch's
//! segments among them, and also those PyTorch did not make (the math
//! libraries' workspaces, NCCL, extensions), which no snapshot shows.
//!
//! - **Matching.** Each segment of the snapshot (`segment_alloc`, or with
//!   expandable segments `segment_map`) is matched, in time order, to the
//!   recording's device allocation of the same address and size
//!   (`cudaMalloc`, `cuMemAlloc`) or to the recorded `cuMemMap`s that tile
//!   it page by page. The processes with matches are the snapshot's.
//! - **Clocks.** The recording's clock minus the snapshot's, the median
//!   over the matched segments (segments that existed before the snapshot's
//!   history began carry no time of their own and fall outside the median
//!   as long as they are fewer than the matched ones).
//! - **Outside PyTorch.** Every successful device allocation of those
//!   processes that matched no segment enters the snapshot's timeline as a
//!   segment holding one block of its size, from its allocation to its
//!   free, with a call site of its own: the library that called (the file
//!   mapped at the call's return address, which `record` keeps), else
//!   "library unknown".
//!   With several devices in the snapshot they go to the device with the
//!   most matched segments of their process.
//!
//! The result is analysed as the snapshot is (allocator view, per device),
//! and `join` in its details says what was matched.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use anyhow::{Result, bail};

use super::loaded::Loaded;
use crate::trace::Source;
use crate::trace::details::{Join, JoinOutside};
use crate::trace::event::{Event, EventKind, Events, Extra, NO_STACK};
use crate::trace::stacks::{Frame, Stacks};

/// The name of the call site that outside allocations get.
pub const OUTSIDE: &str = "device allocation outside PyTorch's allocator";

/// A successful device allocation of the recording.
#[derive(Clone, Copy, Debug)]
struct Alloc {
    row: usize,
    pid: u32,
    addr: u64,
    size: u64,
}

/// Joins `recording` (an eBPF trace) and `snapshot` (a PyTorch snapshot of
/// the same run) into one loaded trace on the snapshot's clock.
pub fn join(recording: Loaded, snapshot: Loaded) -> Result<Loaded> {
    let Some(details) = snapshot.trace.meta.as_ref().and_then(|m| m.details.snapshot()) else {
        bail!(
            "{}: --snapshot takes a PyTorch memory snapshot (a pickle, or a trace imported from one)",
            snapshot.trace.dir.display()
        );
    };
    if recording.trace.source() == Some(Source::PytorchSnapshot) {
        bail!(
            "{}: with --snapshot the trace must be a recording (`fragscope record`), not another snapshot",
            recording.trace.dir.display()
        );
    }
    if details.entry_order() {
        bail!(
            "{}: its trace entries carry no time (entry order), so its clock cannot be set against the recording's",
            snapshot.trace.dir.display()
        );
    }
    let (rec, snap) = (&recording.events, &snapshot.events);
    let allocs: Vec<Alloc> = (0..rec.len())
        .filter(|&i| rec.kind[i].is_some_and(EventKind::is_device_alloc) && rec.ret[i] == 0 && rec.size[i] > 0)
        .map(|i| Alloc { row: i, pid: rec.pid[i], addr: rec.addr[i], size: rec.size[i] })
        .collect();
    let matched = match_segments(snap, rec, &allocs);
    let segments_total = (0..snap.len())
        .filter(|&i| matches!(snap.kind[i], Some(EventKind::SegmentAlloc | EventKind::SegmentMap)))
        .count();
    if matched.is_empty() {
        bail!(
            "{} and {}: none of the snapshot's {segments_total} segments is among the recording's {} device allocations \
             (address and size): not the same run, or the recording missed the library PyTorch allocates through",
            recording.trace.dir.display(),
            snapshot.trace.dir.display(),
            allocs.len()
        );
    }
    let mut offsets: Vec<i64> =
        matched.iter().map(|m| rec.ts_ns[m.rec_row] as i64 - snap.ts_ns[m.snap_row] as i64).collect();
    offsets.sort_unstable();
    let offset = offsets[offsets.len() / 2];
    // The processes that are the snapshot's, and the device each one's
    // outside allocations go to.
    let mut by_pid: HashMap<u32, BTreeMap<u32, usize>> = HashMap::new();
    for m in &matched {
        *by_pid.entry(rec.pid[m.rec_row]).or_default().entry(snap.pid[m.snap_row]).or_default() += 1;
    }
    let device_of: HashMap<u32, u32> = by_pid
        .iter()
        .map(|(&pid, devices)| {
            (pid, devices.iter().max_by_key(|(d, n)| (**n, std::cmp::Reverse(**d))).map_or(0, |(d, _)| *d))
        })
        .collect();
    let used: std::collections::HashSet<usize> =
        matched.iter().flat_map(|m| std::iter::once(m.rec_row).chain(m.pages.iter().copied())).collect();
    let outside: Vec<&Alloc> =
        allocs.iter().filter(|a| device_of.contains_key(&a.pid) && !used.contains(&a.row)).collect();

    // The call site of each outside allocation: its library, where the
    // recording symbolised stacks.
    let mut stacks: Stacks = snapshot.trace.stacks.as_deref().cloned().unwrap_or_default();
    let mut site_of: BTreeMap<String, u32> = BTreeMap::new();
    let mut by_library: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut out = snapshot.events.clone();
    let to_snapshot_clock = |t: u64| (t as i64 - offset).max(0) as u64;
    let callers = if outside.is_empty() { HashMap::new() } else { callers(&recording) };
    for a in &outside {
        let library = library_of(&recording, &callers, a.row);
        let entry = by_library.entry(library.clone()).or_default();
        entry.0 += 1;
        entry.1 += a.size;
        let stack = *site_of.entry(library.clone()).or_insert_with(|| {
            stacks.frames.push(Frame { filename: library.clone(), line: 0, name: OUTSIDE.into() });
            stacks.stacks.push(vec![(stacks.frames.len() - 1) as u32]);
            (stacks.stacks.len() - 1) as u32
        });
        let device = device_of[&a.pid];
        let t = to_snapshot_clock(rec.ts_ns[a.row]);
        let extra = Extra { requested: Some(a.size), stack: Some(stack), device_free: None };
        out.push(&Event { stream: Some(0), ..Event::new(t, device, EventKind::SegmentAlloc, a.addr, a.size) });
        out.push(&Event { stream: Some(0), extra, ..Event::new(t, device, EventKind::BlockAlloc, a.addr, a.size) });
        // Its free, when the recording has one.
        if let Some(f) = (a.row + 1..rec.len()).find(|&i| {
            rec.pid[i] == a.pid
                && rec.addr[i] == a.addr
                && rec.kind[i].is_some_and(EventKind::is_device_free)
                && rec.ret[i] == 0
        }) {
            let t = to_snapshot_clock(rec.ts_ns[f]);
            out.push(&Event { stream: Some(0), ..Event::new(t, device, EventKind::BlockFree, a.addr, a.size) });
            out.push(&Event { stream: Some(0), ..Event::new(t, device, EventKind::SegmentFree, a.addr, a.size) });
        }
    }
    let out_of_order = out.sort_by_time();
    let join = Join {
        recording: recording.trace.dir.display().to_string(),
        pids: {
            let mut p: Vec<u32> = device_of.keys().copied().collect();
            p.sort_unstable();
            p
        },
        segments_matched: matched.len() as u64,
        segments_total: segments_total as u64,
        clock_offset_ns: offset,
        clock_disagreement_ns: recording
            .trace
            .meta
            .as_ref()
            .and_then(|m| m.mono_to_wall_offset_ns)
            .map(|wall| offset.saturating_add(wall).abs()),
        outside: JoinOutside {
            allocations: outside.len() as u64,
            bytes: outside.iter().map(|a| a.size).sum(),
            by_library: by_library.into_iter().map(|(l, (n, b))| (l, n, b)).collect(),
        },
    };
    let mut trace = snapshot.trace;
    if let Some(m) = trace.meta.as_mut() {
        if m.capacity_bytes.is_none() {
            m.capacity_bytes = recording.trace.meta.as_ref().and_then(|r| r.capacity_bytes);
        }
        if let Some(d) = m.details.snapshot_mut() {
            d.join = Some(join);
        }
    }
    trace.stacks = Some(Arc::new(stacks));
    trace.pytorch_columns = true;
    // The rows added above come after the snapshot's: sorting them in is no
    // disorder of the files.
    let _ = out_of_order;
    Ok(Loaded { trace, events: out, out_of_order: snapshot.out_of_order })
}

/// A snapshot segment matched to the recording: its allocation, or its
/// first page's map (and the other pages' maps).
struct Matched {
    snap_row: usize,
    rec_row: usize,
    pages: Vec<usize>,
}

/// Each snapshot segment, in time order, with the recording's first
/// unmatched allocation of its address and size; or, for a `segment_map`,
/// with the first recorded maps that tile it.
fn match_segments(snap: &Events, rec: &Events, allocs: &[Alloc]) -> Vec<Matched> {
    let mut whole: HashMap<(u64, u64), VecDeque<usize>> = HashMap::new();
    let mut maps: BTreeMap<u64, VecDeque<(usize, u64)>> = BTreeMap::new();
    for a in allocs {
        if rec.kind[a.row] == Some(EventKind::MemMap) {
            maps.entry(a.addr).or_default().push_back((a.row, a.size));
        } else {
            whole.entry((a.addr, a.size)).or_default().push_back(a.row);
        }
    }
    let mut out = Vec::new();
    for i in 0..snap.len() {
        match snap.kind[i] {
            Some(EventKind::SegmentAlloc) => {
                if let Some(row) = whole.get_mut(&(snap.addr[i], snap.size[i])).and_then(VecDeque::pop_front) {
                    out.push(Matched { snap_row: i, rec_row: row, pages: Vec::new() });
                }
            }
            Some(EventKind::SegmentMap) => {
                // The pages, from the segment's start up.
                let (start, end) = (snap.addr[i], snap.addr[i] + snap.size[i]);
                let mut at = start;
                let mut rows = Vec::new();
                while at < end {
                    let Some(&(_, size)) = maps.get(&at).and_then(|q| q.front()) else { break };
                    rows.push(at);
                    at += size.max(1);
                }
                if at == end && !rows.is_empty() {
                    let mut taken: Vec<usize> =
                        rows.iter().filter_map(|page| maps.get_mut(page)?.pop_front().map(|(r, _)| r)).collect();
                    let first = taken.remove(0);
                    out.push(Matched { snap_row: i, rec_row: first, pages: taken });
                }
            }
            _ => {}
        }
    }
    out
}

/// The return address of each recorded device allocation, read straight
/// from the recording's parts (the loader keeps no such column), by
/// (pid, time, address); empty for recordings made before it was kept.
fn callers(recording: &Loaded) -> HashMap<(u32, u64, u64), u64> {
    use arrow_array::Array;
    use arrow_array::cast::AsArray;
    use arrow_array::types::{UInt32Type, UInt64Type};
    let mut out = HashMap::new();
    for part in &recording.trace.parts {
        let Ok(table) = crate::trace::table::Table::open(part) else { continue };
        let b = table.batch();
        let (Some(ts), Some(pid), Some(addr), Some(caller)) =
            (b.column_by_name("ts_ns"), b.column_by_name("pid"), b.column_by_name("addr"), b.column_by_name("caller"))
        else {
            continue;
        };
        let (Some(ts), Some(pid), Some(addr), Some(caller)) = (
            ts.as_primitive_opt::<UInt64Type>(),
            pid.as_primitive_opt::<UInt32Type>(),
            addr.as_primitive_opt::<UInt64Type>(),
            caller.as_primitive_opt::<UInt64Type>(),
        ) else {
            continue;
        };
        for i in (0..b.num_rows()).filter(|&i| caller.is_valid(i)) {
            out.insert((pid.value(i), ts.value(i), addr.value(i)), caller.value(i));
        }
    }
    out
}

/// The library that made the recorded call at `row`: the file mapped at
/// its return address (the process's copied maps say which), else the
/// first frame of its recorded stack outside CUDA's own libraries.
fn library_of(recording: &Loaded, callers: &HashMap<(u32, u64, u64), u64>, row: usize) -> String {
    let e = &recording.events;
    if let Some(&caller) = callers.get(&(e.pid[row], e.ts_ns[row], e.addr[row]))
        && let Some((file, _)) =
            crate::trace::symbols::mapped_file(&recording.trace.dir.join("maps").join(e.pid[row].to_string()), caller)
    {
        return file.file_name().map_or_else(|| file.display().to_string(), |n| n.to_string_lossy().into_owned());
    }
    let unknown = || "library unknown (no return address or stack recorded)".to_string();
    let (Some(stacks), Some(&id)) = (recording.trace.stacks.as_deref(), recording.events.stack.get(row)) else {
        return unknown();
    };
    if id == NO_STACK {
        return unknown();
    }
    stacks
        .frames_of(id)
        .map(|f| f.filename.rsplit('/').next().unwrap_or(&f.filename).to_string())
        .find(|lib| !lib.is_empty() && !lib.starts_with("libcuda") && !lib.starts_with("libcudart"))
        .unwrap_or_else(unknown)
}
