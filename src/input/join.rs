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

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use anyhow::{Result, bail};

use super::loaded::Loaded;
use crate::trace::Source;
use crate::trace::details::{Join, JoinOutside, OutsideSpan};
use crate::trace::event::{Event, EventKind, Events, Extra, NO_STACK};
use crate::trace::stacks::{Frame, Stacks};

/// The name of the call site that outside allocations get.
pub const OUTSIDE: &str = "device allocation outside PyTorch's allocator";

/// The stacks (rows of `stacks`) of the allocations a joined recording
/// adds from outside PyTorch's allocator: those whose frames name
/// [`OUTSIDE`].
pub fn outside_stacks(stacks: &Stacks) -> std::collections::HashSet<u32> {
    (0..stacks.stacks.len() as u32).filter(|&id| is_outside(stacks, id)).collect()
}

/// Whether stack `id` is that of an allocation from outside PyTorch's
/// allocator ([`outside_stacks`], for one stack).
pub fn is_outside(stacks: &Stacks, id: u32) -> bool {
    stacks.frames_of(id).any(|f| f.name == OUTSIDE)
}

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
    join_probed(recording, snapshot)
}

/// The join, its inputs checked.
fn join_probed(recording: Loaded, snapshot: Loaded) -> Result<Loaded> {
    let Some(details) = snapshot.trace.meta.as_ref().and_then(|m| m.details.snapshot()) else {
        bail!("{}: not a snapshot", snapshot.trace.dir.display());
    };
    let (rec, snap) = (&recording.events, &snapshot.events);
    let allocs: Vec<Alloc> = (0..rec.len())
        .filter(|&i| rec.kind[i].is_some_and(EventKind::is_device_alloc) && rec.ret[i] == 0 && rec.size.at(i) > 0)
        .map(|i| Alloc { row: i, pid: rec.pid[i], addr: rec.addr.at(i), size: rec.size.at(i) })
        .collect();
    let ends = alloc_ends(rec, &allocs);
    // A first pass without a clock (the earliest unmatched allocation of
    // each address and size) gives the clock; the second pairs each
    // segment with the allocation of its address and size nearest in time.
    let rough = match_segments(snap, rec, &allocs, None);
    let segments_total = (0..snap.len())
        .filter(|&i| matches!(snap.kind[i], Some(EventKind::SegmentAlloc | EventKind::SegmentMap)))
        .count();
    if rough.is_empty() {
        bail!(
            "{} and {}: none of the snapshot's {segments_total} segments is among the recording's {} device allocations \
             (address and size): not the same run, or the recording missed the library PyTorch allocates through",
            recording.trace.dir.display(),
            snapshot.trace.dir.display(),
            allocs.len()
        );
    }
    let wall = recording.trace.meta.as_ref().and_then(|m| m.mono_to_wall_offset_ns);
    let offset = clock_offset(snap, rec, &rough, details, wall);
    let mut matched = match_segments(snap, rec, &allocs, Some(offset));
    // The snapshot is one process's: the recorded process with most
    // matches (another rank may share an address and size by chance).
    let pid = most(matched.iter().map(|m| rec.pid[m.rec_row]));
    matched.retain(|m| rec.pid[m.rec_row] == pid);
    // The device the outside allocations go to: the one with most matches.
    let device = most(matched.iter().map(|m| snap.pid[m.snap_row]));
    let used: std::collections::HashSet<usize> =
        matched.iter().flat_map(|m| std::iter::once(m.rec_row).chain(m.pages.iter().copied())).collect();
    // Outside: the process's other allocations that were live at some time
    // within the snapshot's window (before it, PyTorch's own segments freed
    // before its history began would look like someone else's).
    let on_snapshot_clock = |t: u64| (t as i64).saturating_sub(offset);
    let (first, last) = (snap.ts_ns.first().unwrap_or(0) as i64, snap.ts_ns.last().unwrap_or(0) as i64);
    let outside: Vec<(&Alloc, Option<usize>)> = allocs
        .iter()
        .zip(&ends)
        .filter(|(a, end)| {
            a.pid == pid
                && !used.contains(&a.row)
                && on_snapshot_clock(rec.ts_ns.at(a.row)) <= last
                && end.is_none_or(|f| on_snapshot_clock(rec.ts_ns.at(f)) >= first)
        })
        .map(|(a, end)| (a, *end))
        .collect();

    // The call site of each outside allocation: the library that called.
    let mut stacks: Stacks = snapshot.trace.stacks.as_deref().cloned().unwrap_or_default();
    let mut site_of: BTreeMap<String, u32> = BTreeMap::new();
    let mut out = snapshot.events.clone();
    let to_snapshot_clock = |t: u64| on_snapshot_clock(t).max(0) as u64;
    let wanted: std::collections::HashSet<(u32, u64, u64)> =
        outside.iter().map(|(a, _)| (real_pid(&recording, a.pid), rec.ts_ns.at(a.row), a.addr)).collect();
    let callers = if outside.is_empty() { HashMap::new() } else { callers(&recording, &wanted) };
    let mut maps: HashMap<u32, Option<String>> = HashMap::new();
    let mut spans = Vec::with_capacity(outside.len());
    for &(a, end) in &outside {
        let library = library_of(&recording, &callers, &mut maps, a.row);
        let stack = *site_of.entry(library.clone()).or_insert_with(|| {
            stacks.frames.push(Frame { filename: library.clone(), line: 0, name: OUTSIDE.into() });
            stacks.stacks.push(vec![(stacks.frames.len() - 1) as u32]);
            (stacks.stacks.len() - 1) as u32
        });
        let t = to_snapshot_clock(rec.ts_ns.at(a.row));
        // Every row of it carries the outside call site: `whatif` leaves
        // such rows out of the requests it replays through the allocator.
        let extra = Extra { requested: Some(a.size), stack: Some(stack), device_free: None };
        let row = |t, kind| Event { stream: Some(0), extra, ..Event::new(t, device, kind, a.addr, a.size) };
        out.push(&row(t, EventKind::SegmentAlloc));
        out.push(&row(t, EventKind::BlockAlloc));
        let freed = end.map(|f| to_snapshot_clock(rec.ts_ns.at(f)));
        if let Some(t) = freed {
            out.push(&row(t, EventKind::BlockFree));
            out.push(&row(t, EventKind::SegmentFree));
        }
        spans.push(OutsideSpan { from_ns: t, to_ns: freed, bytes: a.size, library, unit: None });
    }
    // The rows added above come after the snapshot's: sorting them in is no
    // disorder of the files, so the snapshot's count stands.
    out.sort_by_time();
    let by_library = crate::trace::details::by_library(&spans);
    let join = Join {
        launches_at_entry: recording.trace.meta.as_ref().is_some_and(|m| m.details.launches_at_entry()),
        recording: recording.trace.dir.display().to_string(),
        pids: vec![pid],
        probed: false,
        blocks_without_segment: 0,
        runtime_calls: None,
        segments_matched: matched.len() as u64,
        segments_total: segments_total as u64,
        clock_offset_ns: offset,
        clock_disagreement_ns: wall.map(|wall| offset.saturating_add(wall).unsigned_abs().min(i64::MAX as u64) as i64),
        outside: JoinOutside {
            allocations: outside.len() as u64,
            bytes: outside.iter().map(|(a, _)| a.size).sum(),
            by_library,
            spans,
        },
    };
    let mut trace = snapshot.trace;
    if let Some(m) = trace.meta.as_mut() {
        if m.capacity_bytes.is_none() {
            m.capacity_bytes = recording.trace.meta.as_ref().and_then(|r| r.capacity_bytes);
        }
        if let Some(d) = m.details.snapshot_mut() {
            d.join = Some(join);
            // What the process's environment asked, against what the
            // snapshot's allocator used.
            d.asked = recording
                .trace
                .meta
                .as_ref()
                .and_then(|r| r.details.record())
                .and_then(|r| r.asked(pid, device))
                .into_iter()
                .collect();
        }
    }
    trace.stacks = Some(Arc::new(stacks));
    trace.pytorch_columns = true;
    Ok(Loaded { trace, events: out, out_of_order: snapshot.out_of_order })
}

/// The process of replay unit `id` (itself, or one device of a process
/// replayed per device, [`super::units`]).
pub(super) fn real_pid(recording: &Loaded, id: u32) -> u32 {
    recording.trace.units.get(&id).map_or(id, |u| u.0)
}

/// The value that comes most often (the smallest of equals); 0 for none.
fn most(values: impl Iterator<Item = u32>) -> u32 {
    let mut count: BTreeMap<u32, usize> = BTreeMap::new();
    for v in values {
        *count.entry(v).or_default() += 1;
    }
    count.into_iter().max_by_key(|&(v, n)| (n, std::cmp::Reverse(v))).map_or(0, |(v, _)| v)
}

/// A snapshot segment matched to the recording: its allocation, or its
/// first page's map (and the other pages' maps).
struct Matched {
    snap_row: usize,
    rec_row: usize,
    pages: Vec<usize>,
}

/// Each allocation's free: the first successful free of the same process
/// and address after it, of a kind that frees it (`cudaFree` an
/// allocation, `cuMemUnmap` a map), and before the next allocation there
/// (a free the recording missed is not taken from a later allocation).
fn alloc_ends(rec: &Events, allocs: &[Alloc]) -> Vec<Option<usize>> {
    let mut at: HashMap<(u32, u64), Vec<usize>> = HashMap::new();
    for i in 0..rec.len() {
        let Some(k) = rec.kind[i] else { continue };
        if rec.ret[i] == 0 && (k.is_device_alloc() || k.is_device_free()) {
            at.entry((rec.pid[i], rec.addr.at(i))).or_default().push(i);
        }
    }
    allocs
        .iter()
        .map(|a| {
            let rows = at.get(&(a.pid, a.addr))?;
            let map = rec.kind[a.row] == Some(EventKind::MemMap);
            let after = rows.partition_point(|&r| r <= a.row);
            rows[after..]
                .iter()
                .copied()
                .take_while(|&r| !rec.kind[r].is_some_and(EventKind::is_device_alloc))
                .find(|&r| (rec.kind[r] == Some(EventKind::MemUnmap)) == map)
        })
        .collect()
}

/// The recording's clock minus the snapshot's: the median over the
/// segments the snapshot's history saw. Segments that existed before it
/// began are stamped with its first entry's time (the reconstruction's),
/// not theirs, and are left out; with none left, the recording's own
/// offset to wall time (the snapshot's clock), else every match.
fn clock_offset(
    snap: &Events,
    rec: &Events,
    matched: &[Matched],
    details: &crate::trace::details::SnapshotDetails,
    wall: Option<i64>,
) -> i64 {
    let mut start: HashMap<u32, u64> = HashMap::new();
    for i in 0..snap.len() {
        start.entry(snap.pid[i]).or_insert(snap.ts_ns.at(i));
    }
    let had_initial = |d: u32| details.reconstruction.iter().any(|r| r.device == d && r.initial_segments > 0);
    let offsets = |all: bool| -> Vec<i64> {
        let mut o: Vec<i64> = matched
            .iter()
            .filter(|m| {
                all || !(had_initial(snap.pid[m.snap_row])
                    && Some(&snap.ts_ns.at(m.snap_row)) == start.get(&snap.pid[m.snap_row]))
            })
            .map(|m| (rec.ts_ns.at(m.rec_row) as i64).saturating_sub(snap.ts_ns.at(m.snap_row) as i64))
            .collect();
        o.sort_unstable();
        o
    };
    let seen = offsets(false);
    if let Some(&o) = seen.get(seen.len() / 2) {
        return o;
    }
    if let Some(w) = wall {
        return w.saturating_neg();
    }
    let all = offsets(true);
    all.get(all.len() / 2).copied().unwrap_or(0)
}

/// Each snapshot segment, in time order, paired with an unmatched
/// recorded allocation of its address and size: the earliest without a
/// clock, else the one nearest in time on the recording's clock (`offset`:
/// its clock minus the snapshot's). A `segment_map` is paired with maps
/// that tile it, page by page, each chosen the same way.
fn match_segments(snap: &Events, rec: &Events, allocs: &[Alloc], offset: Option<i64>) -> Vec<Matched> {
    let mut whole: HashMap<(u64, u64), Vec<usize>> = HashMap::new();
    let mut maps: BTreeMap<u64, Vec<(usize, u64)>> = BTreeMap::new();
    for a in allocs {
        if rec.kind[a.row] == Some(EventKind::MemMap) {
            maps.entry(a.addr).or_default().push((a.row, a.size));
        } else {
            whole.entry((a.addr, a.size)).or_default().push(a.row);
        }
    }
    let mut used = std::collections::HashSet::new();
    // Of `rows`, the unused one to take for a segment at snapshot time `t`.
    let pick = |rows: &[usize], t: u64, used: &mut std::collections::HashSet<usize>| -> Option<usize> {
        let free = rows.iter().copied().filter(|r| !used.contains(r));
        let chosen = match offset {
            None => free.min(),
            Some(o) => {
                let at = (t as i64).saturating_add(o);
                free.min_by_key(|&r| ((rec.ts_ns.at(r) as i64).saturating_sub(at).unsigned_abs(), r))
            }
        }?;
        used.insert(chosen);
        Some(chosen)
    };
    let mut out = Vec::new();
    for i in 0..snap.len() {
        match snap.kind[i] {
            Some(EventKind::SegmentAlloc) => {
                if let Some(rows) = whole.get(&(snap.addr.at(i), snap.size.at(i)))
                    && let Some(row) = pick(rows, snap.ts_ns.at(i), &mut used)
                {
                    out.push(Matched { snap_row: i, rec_row: row, pages: Vec::new() });
                }
            }
            Some(EventKind::SegmentMap) => {
                // The pages, from the segment's start up; taken only when
                // they tile it.
                let (start, end) = (snap.addr.at(i), snap.addr.at(i).saturating_add(snap.size.at(i)));
                let mut at = start;
                let mut taken = Vec::new();
                while at < end {
                    let Some(pages) = maps.get(&at) else { break };
                    let rows: Vec<usize> = pages.iter().map(|p| p.0).collect();
                    let Some(row) = pick(&rows, snap.ts_ns.at(i), &mut used) else { break };
                    let size = pages.iter().find(|p| p.0 == row).map_or(0, |p| p.1);
                    taken.push(row);
                    at = at.saturating_add(size.max(1));
                }
                if at == end && !taken.is_empty() {
                    let first = taken.remove(0);
                    out.push(Matched { snap_row: i, rec_row: first, pages: taken });
                } else {
                    for r in taken {
                        used.remove(&r);
                    }
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
pub(super) fn callers(
    recording: &Loaded,
    wanted: &std::collections::HashSet<(u32, u64, u64)>,
) -> HashMap<(u32, u64, u64), u64> {
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
            let key = (pid.value(i), ts.value(i), addr.value(i));
            if wanted.contains(&key) {
                out.insert(key, caller.value(i));
            }
        }
    }
    out
}

/// The library that made the recorded call at `row`: the file mapped at
/// its return address (the process's copied maps say which), else the
/// first frame of its recorded stack outside CUDA's own libraries.
pub(super) fn library_of(
    recording: &Loaded,
    callers: &HashMap<(u32, u64, u64), u64>,
    maps: &mut HashMap<u32, Option<String>>,
    row: usize,
) -> String {
    let e = &recording.events;
    let pid = real_pid(recording, e.pid[row]);
    if let Some(&caller) = callers.get(&(pid, e.ts_ns.at(row), e.addr.at(row))) {
        // Each process's copied maps are read once.
        let text = maps
            .entry(pid)
            .or_insert_with(|| std::fs::read_to_string(recording.trace.dir.join("maps").join(pid.to_string())).ok());
        if let Some((file, _)) = text.as_deref().and_then(|t| crate::trace::symbols::file_at(t, caller)) {
            return file.file_name().map_or_else(|| file.display().to_string(), |n| n.to_string_lossy().into_owned());
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn events(rows: &[(u64, EventKind, u64, u64)]) -> Events {
        let mut e = Events::default();
        for &(t, kind, addr, size) in rows {
            e.push(&Event::new(t, 7, kind, addr, size));
        }
        e
    }

    /// An address freed and allocated again (PyTorch's cache emptied and
    /// refilled): each allocation ends at its own free, one never freed has
    /// none, and each snapshot segment is paired with the allocation live at
    /// its time, not the first of its address and size.
    #[test]
    fn reused_addresses_pair_by_time_and_end_at_their_own_free() {
        use EventKind::{Alloc, Free, SegmentAlloc, SegmentFree};
        let rec = events(&[
            (1_000, Alloc, 0x10, 64),
            (2_000, Free, 0x10, 0),
            (3_000, Alloc, 0x10, 64),
            (3_500, Alloc, 0x90, 8),
        ]);
        let allocs: Vec<super::Alloc> = [0, 2, 3]
            .iter()
            .map(|&row| super::Alloc { row, pid: 7, addr: rec.addr.at(row), size: rec.size.at(row) })
            .collect();
        assert_eq!(alloc_ends(&rec, &allocs), vec![Some(1), None, None]);
        // The snapshot saw only the second life of the segment (its clock
        // 500 ns behind the recording's).
        let snap = events(&[(2_500, SegmentAlloc, 0x10, 64), (2_900, SegmentFree, 0x10, 64)]);
        let rough = match_segments(&snap, &rec, &allocs, None);
        assert_eq!(rough[0].rec_row, 0, "without a clock, the earliest");
        let timed = match_segments(&snap, &rec, &allocs, Some(500));
        assert_eq!(timed[0].rec_row, 2, "with the clock, the one live then");
    }
}
