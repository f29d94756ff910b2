//! PyTorch CUDA memory snapshots (SPEC §8): from the pickle to a trace.
//!
//! Three steps:
//! 1. [`Snapshot::read`] types the plain data [`crate::import::pickle`] parses into
//!    segments, blocks and trace entries (the entries as they are appended
//!    to their list, so their dicts never pile up). Frames are interned as
//!    they are met: a frame dict or frame list shared through the memo is
//!    looked up by identity first, by content second, so a stack shared a
//!    hundred thousand times costs one table row.
//! 2. [`reconstruct`] undoes each device's trace backwards from the final
//!    segments and blocks (the trace is a ring buffer that may have dropped
//!    its start), giving the state before the first entry.
//! 3. It then replays the entries forwards from that state, emitting
//!    events, and checks that the replay ends exactly at the snapshot's
//!    final state; every difference is counted in [`Reconstruction`].
//!
//! Block sizes. Trace entries carry the *requested* size, not the size of
//! the block the allocator handed out. A block still alive at the end has its
//! real size in the snapshot, and the replay uses it. For the others the
//! size follows the caching allocator's rules: the request rounded up to
//! 512 bytes, and the rest of the free block taken too when it would be too
//! small to split off (< 512 B in the small pool, ≤ 1 MiB in the large
//! pool, i.e. for requests above 1 MiB). `max_split_size` settings are not
//! modelled. On blocks whose real size is known the rule is checked, and
//! the agreement is reported (`sizes_checked`, `sizes_agreed`).
//!
//! The files: [`parse`] (the pickle's values to a [`Snapshot`]),
//! [`reconstruct`] (a device's events); this module converts a file and
//! writes the trace.

mod parse;
mod reconstruct;
use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::trace::Stacks;
use crate::trace::details::{Details, Reconstruction, SegmentRow, SnapshotDetails, Totals};
use crate::trace::event::Event;
pub use parse::{BlockState, Segment, Snapshot};
pub use reconstruct::{Sink, reconstruct};

/// What a conversion found, besides the events it emitted.
#[derive(Debug)]
pub struct Converted {
    pub meta: crate::trace::TraceMeta,
    pub stacks: Stacks,
    pub reconstructions: Vec<Reconstruction>,
}

/// Reads `path` and converts the selected device (default: all), sending
/// the events to `sink` in time order.
pub fn convert_file(path: &Path, device: Option<u32>, sink: Sink<'_>) -> Result<Converted> {
    let file_bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let snap = Snapshot::read(path)?;
    let started = std::time::Instant::now();
    let converted = convert(snap, device, &path.display().to_string(), file_bytes, sink)
        .with_context(|| format!("{}: cannot convert the snapshot", path.display()))?;
    tracing::info!("converted in {:.3} s", started.elapsed().as_secs_f64());
    Ok(converted)
}

/// Converts a typed snapshot: reconstruction and events per device, and the
/// trace metadata (SPEC §2: device count, allocator settings, final segment
/// table; plus the reconstruction's checks and PyTorch's totals). With one
/// device the events stream straight to `sink`; with several, each
/// device's events are collected and merged by time.
pub fn convert(
    mut snap: Snapshot,
    device: Option<u32>,
    source: &str,
    file_bytes: u64,
    sink: Sink<'_>,
) -> Result<Converted> {
    let all = snap.devices();
    let devices: Vec<u32> = match device {
        Some(d) if all.contains(&d) => vec![d],
        Some(d) => bail!("device {d} is not in this snapshot (it has device(s) {all:?})"),
        None => all.clone(),
    };
    let timed = |snap: &Snapshot, d: u32| {
        snap.traces.get(d as usize).is_some_and(|t| !t.is_empty() && t.iter().all(|e| e.time_us().is_some()))
    };
    let t0 = devices
        .iter()
        .filter(|&&d| timed(&snap, d))
        .filter_map(|&d| snap.traces[d as usize].first()?.time_us())
        .min()
        .map_or(0, |t| (t as u64).saturating_mul(1000));
    let untimed: Vec<u32> = devices
        .iter()
        .copied()
        .filter(|&d| !timed(&snap, d) && snap.traces.get(d as usize).is_some_and(|t| !t.is_empty()))
        .collect();
    let mut reconstructions = Vec::new();
    // Each device's entries are taken out, to be freed as they are replayed.
    fn take(snap: &mut Snapshot, d: u32) -> parse::Entries {
        snap.traces.get_mut(d as usize).map(std::mem::take).unwrap_or_default()
    }
    if devices.len() == 1 {
        let entries = take(&mut snap, devices[0]);
        reconstructions.push(reconstruct(&snap, entries, devices[0], t0, sink)?);
    } else {
        let mut per_device: Vec<std::vec::IntoIter<Event>> = Vec::new();
        for &d in &devices {
            let mut events = Vec::new();
            let entries = take(&mut snap, d);
            reconstructions.push(reconstruct(&snap, entries, d, t0, &mut |e| {
                events.push(e);
                Ok(())
            })?);
            per_device.push(events.into_iter());
        }
        // k-way merge by time (ties: lower device first).
        let mut heads: std::collections::BinaryHeap<std::cmp::Reverse<(u64, usize)>> = Default::default();
        let mut next: Vec<Option<Event>> = per_device.iter_mut().map(|it| it.next()).collect();
        for (i, e) in next.iter().enumerate() {
            if let Some(e) = e {
                heads.push(std::cmp::Reverse((e.ts_ns, i)));
            }
        }
        while let Some(std::cmp::Reverse((_, i))) = heads.pop() {
            if let Some(e) = next[i].take() {
                sink(e)?;
            }
            next[i] = per_device[i].next();
            if let Some(e) = &next[i] {
                heads.push(std::cmp::Reverse((e.ts_ns, i)));
            }
        }
    }

    let mut meta = crate::trace::TraceMeta::new(crate::trace::Source::PytorchSnapshot);
    meta.host = String::new();
    let segments: Vec<&Segment> = snap.segments.iter().filter(|s| devices.contains(&s.device)).collect();
    let totals: std::collections::BTreeMap<String, Totals> = devices
        .iter()
        .map(|&d| (d.to_string(), Totals::of(segments.iter().copied().filter(|s| s.device == d))))
        .collect();
    let table: Vec<SegmentRow> = segments
        .iter()
        .map(|s| {
            let active = |st: BlockState| s.blocks.iter().filter(|b| b.state == st).map(|b| b.size).sum::<u64>();
            SegmentRow {
                device: u64::from(s.device),
                address: s.address,
                total_size: s.total_size,
                stream: s.stream,
                segment_type: s.segment_type.clone(),
                is_expandable: s.is_expandable,
                blocks: s.blocks.len() as u64,
                active_allocated_bytes: active(BlockState::ActiveAllocated),
                active_pending_free_bytes: active(BlockState::ActivePendingFree),
            }
        })
        .collect();
    meta.details = Details::Snapshot(Box::new(SnapshotDetails {
        snapshot: source.to_string(),
        file_bytes,
        compression: None,
        layout: if snap.bare_list { "bare list of segments" } else { "dict" }.into(),
        devices: devices.clone(),
        device_count: snap.traces.len().max(all.iter().map(|&d| d as usize + 1).max().unwrap_or(0)),
        allocator_settings: snap.allocator_settings.clone(),
        inferred_settings: snap.inferred_settings.clone(),
        untimed_devices: untimed.clone(),
        time_source: if untimed.is_empty() {
            "time_us".to_string()
        } else {
            format!("event order (device(s) {untimed:?} have trace entries without time_us: 1 ns per entry)")
        },
        legacy_history_blocks: snap.legacy_history_blocks,
        blocks_without_address: snap.blocks_without_address,
        unknown_actions: snap.unknown_actions,
        stacks: snap.stacks.stacks.len(),
        frames: snap.stacks.frames.len(),
        annotations: snap.annotations.iter().filter(|a| devices.contains(&a.device)).cloned().collect(),
        totals,
        reconstruction: reconstructions.clone(),
        segments: table,
        join: None,
        asked: Vec::new(),
        host: host_memory(&snap.host_segments, &snap.host_trace),
    }));
    Ok(Converted { meta, stacks: std::mem::take(&mut snap.stacks), reconstructions })
}

/// Pinned host memory, when the snapshot recorded any: the end state, and
/// a walk over its entries from the state before them (the end state less
/// what the entries did). None without host segments or entries.
fn host_memory(segments: &[Segment], trace: &[parse::Entry]) -> Option<crate::trace::details::HostMemory> {
    use parse::Action::*;
    if segments.is_empty() && trace.is_empty() {
        return None;
    }
    let reserved: u64 = segments.iter().map(|s| s.total_size).sum();
    let allocated: u64 = segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == BlockState::ActiveAllocated)
        .map(|b| b.requested)
        .sum();
    // What an entry changes: (allocated, reserved).
    let change = |e: &parse::Entry| -> Option<(i128, i128)> {
        let n = e.size as i128;
        Some(match e.action {
            Alloc => (n, 0),
            FreeCompleted => (-n, 0),
            SegmentAlloc | SegmentMap => (0, n),
            SegmentFree | SegmentUnmap => (0, -n),
            _ => return None,
        })
    };
    // The state before the entries: the end state less what they changed.
    let (da, dr) = trace.iter().filter_map(change).fold((0, 0), |(x, y), (a, r)| (x + a, y + r));
    let (mut a, mut r) = ((allocated as i128 - da).max(0), (reserved as i128 - dr).max(0));
    let (mut peak_a, mut peak_r) = (a as u64, r as u64);
    let mut all = Vec::with_capacity(trace.len());
    for e in trace {
        let Some((x, y)) = change(e) else { continue };
        (a, r) = (a + x, r + y);
        let (x, y) = (a.max(0) as u64, r.max(0) as u64);
        (peak_a, peak_r) = (peak_a.max(x), peak_r.max(y));
        all.push((e.time_us().map_or(0, |t| (t as u64).saturating_mul(1000)), x, y));
    }
    // Thinned for the picture: every k-th state, and each peak.
    let k = all.len().div_ceil(crate::trace::details::HostMemory::POINTS).max(1);
    let series = all
        .iter()
        .enumerate()
        .filter(|(i, p)| i % k == 0 || i + 1 == all.len() || p.1 == peak_a || p.2 == peak_r)
        .map(|(_, p)| *p)
        .collect();
    Some(crate::trace::details::HostMemory {
        segments: segments.len() as u64,
        reserved_bytes: reserved,
        allocated_bytes: allocated,
        entries: trace.len() as u64,
        allocations: trace.iter().filter(|e| e.action == Alloc).count() as u64,
        peak_allocated_bytes: peak_a,
        peak_reserved_bytes: peak_r,
        series,
    })
}

/// `fragscope import`: writes the converted snapshot as a trace directory.
/// The output directory appears only once the snapshot has been read.
/// `origin`: the compressed file `path` was decompressed from, if any.
pub fn import(
    path: &Path,
    out: &Path,
    device: Option<u32>,
    origin: Option<&crate::trace::details::CompressedOrigin>,
) -> Result<Converted> {
    let file_bytes = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?.len();
    let snap = Snapshot::read(path)?;
    let started = std::time::Instant::now();
    let meta = crate::trace::TraceMeta::new(crate::trace::Source::PytorchSnapshot);
    if let Some(d) = device
        && !snap.devices().contains(&d)
    {
        bail!("{}: device {d} is not in this snapshot (it has device(s) {:?})", path.display(), snap.devices());
    }
    // Parts of 65 536 rows: the part being filled and the one in flight
    // hold about 14 MB of events each. Parts twice as big cost 48 MiB more
    // peak memory on the 100 MB late-ring snapshot (above twice its size)
    // and 85 MiB on the 220 MB one, for 5 % less time on the latter
    // (BENCHMARKS.md, "PyTorch snapshots").
    let mut writer = crate::trace::TraceWriter::create(out, meta, 1 << 16)?;
    writer.write_behind();
    let converted = convert(snap, device, &path.display().to_string(), file_bytes, &mut |e| writer.push(e))
        .with_context(|| format!("{}: cannot convert the snapshot", path.display()));
    let converted = match converted {
        Ok(c) => c,
        Err(e) => {
            writer.abandon();
            return Err(e);
        }
    };
    writer.write_stacks(&converted.stacks)?;
    let mut details = converted.meta.details.clone();
    if let Some(o) = origin {
        details.name_compressed_source(o);
    }
    writer.set_details(details);
    let meta = writer.finish()?;
    tracing::info!("converted and written in {:.3} s", started.elapsed().as_secs_f64());
    Ok(Converted { meta, ..converted })
}

/// Whether a file's first bytes are a pickle's of protocol 2 to 5.
pub fn head_is_pickle(head: &[u8]) -> bool {
    matches!(head, [0x80, v, ..] if (2..=5).contains(v))
}
