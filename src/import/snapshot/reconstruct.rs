//! One device's events from a snapshot ([`reconstruct`]): the state before
//! the first trace entry rebuilt from the final segments and the entries,
//! then the entries replayed as events, and the final state checked
//! against the snapshot's.

use ahash::AHashMap;
use anyhow::Result;

use super::parse::{Action, Entries, Entry, Segment, Snapshot};
use crate::import::settings::{MIN_BLOCK, SMALL_SIZE, Settings};
use crate::trace::details::Reconstruction;
use crate::trace::event::{Event, EventKind, Extra};

/// A live block during reconstruction.
#[derive(Clone, Copy, Debug)]
pub(super) struct LiveBlock {
    /// The real size, when the snapshot knows it.
    pub(super) size: Option<u64>,
    pub(super) requested: u64,
    pub(super) stack: Option<u32>,
    pub(super) stream: u64,
}

/// Address ranges of segments (start → (end, expandable, stream)).
pub(super) type Ranges = std::collections::BTreeMap<u64, (u64, bool, u64)>;

/// Adds [a, b) to the ranges. Mapped pages (`merge`) join an adjacent
/// expandable range; a cudaMalloc'ed segment stays on its own.
pub(super) fn add_range(r: &mut Ranges, a: u64, b: u64, expandable: bool, stream: u64, merge: bool) {
    let (mut a, mut b) = (a, b);
    if merge {
        if let Some((&s, &(e, true, _))) = r.range(..=a).next_back()
            && e == a
        {
            r.remove(&s);
            a = s;
        }
        if let Some(&(e, true, _)) = r.get(&b) {
            r.remove(&b);
            b = e;
        }
    }
    r.insert(a, (b, expandable, stream));
}

/// Removes [a, b) from the range containing it; false if none does.
pub(super) fn remove_range(r: &mut Ranges, a: u64, b: u64) -> bool {
    let Some((&s, &(e, x, st))) = r.range(..=a).next_back() else { return false };
    if b > e {
        return false;
    }
    r.remove(&s);
    if s < a {
        r.insert(s, (a, x, st));
    }
    if b < e {
        r.insert(b, (e, x, st));
    }
    true
}

/// The size the caching allocator gives a request placed at `addr`, where
/// the free space runs up to `free_end`, under the recorded `settings`
/// (rounding with `roundup_power2_divisions`; no split at or above
/// `max_split_size`; with expandable segments a rest of 512 B is split off
/// in the large pool too).
pub(super) fn block_size_rule(settings: &Settings, requested: u64, addr: u64, free_end: u64) -> u64 {
    let rounded = settings.round(requested.max(1));
    let room = free_end.saturating_sub(addr);
    if room <= rounded {
        return rounded.min(room.max(rounded.min(room)));
    }
    let rest = room - rounded;
    // With expandable segments every pool splits off a rest of 512 B.
    let unsplit = if rounded > SMALL_SIZE && !settings.expandable_segments {
        rest <= SMALL_SIZE || settings.max_split_size.is_some_and(|m| rounded >= m)
    } else {
        rest < MIN_BLOCK
    };
    if unsplit { room } else { rounded }
}

/// Entries replayed between two returns of their freed chunks to the
/// kernel: about 10 MB.
const GIVE_BACK_EVERY: usize = Entries::CHUNK * 8;

/// The events of one device: the reconstructed initial state at the first
/// entry's time, then every entry. `t0_ns` is the time given to the initial
/// state when the device's trace is empty.
/// `entries` are the device's, taken out of `snap`: the replay forwards
/// frees them chunk by chunk as it emits their events.
pub fn reconstruct(
    snap: &Snapshot,
    entries: Entries,
    device: u32,
    t0_ns: u64,
    out: Sink<'_>,
) -> Result<Reconstruction> {
    let settings = Settings::from_snapshot(&snap.allocator_settings);
    let mut rec = Reconstruction { device, entries: entries.len() as u64, ..Default::default() };
    let segs: Vec<&Segment> = snap.segments.iter().filter(|s| s.device == device).collect();

    // The final state.
    let mut ranges = Ranges::new();
    let mut live: AHashMap<u64, LiveBlock> = AHashMap::new();
    for s in &segs {
        ranges.insert(s.address, (s.address.saturating_add(s.total_size), s.is_expandable, s.stream));
        for b in s.blocks.iter().filter(|b| b.state.is_live()) {
            live.insert(
                b.address,
                LiveBlock { size: Some(b.size), requested: b.requested, stack: b.stack, stream: s.stream },
            );
        }
    }
    let final_ranges = ranges.clone();
    let final_live = live.clone();

    // Backwards: undo each entry. `known[i]` is the real size of the block
    // alloc entry i created, when that block is still alive at the end:
    // a map, since those are few (a vector by entry was 16 bytes for each
    // of millions of entries, all but a few thousand of them None).
    let mut known: AHashMap<usize, u64> = AHashMap::new();
    for (back, e) in entries.iter().rev().enumerate() {
        let i = entries.len() - 1 - back;
        match e.action {
            Action::Alloc => match live.remove(&e.addr) {
                Some(b) => {
                    if let Some(size) = b.size {
                        known.insert(i, size);
                    }
                }
                None => rec.inconsistent_entries += 1,
            },
            Action::FreeCompleted => {
                let b = LiveBlock { size: None, requested: e.size, stack: e.stack(), stream: e.stream };
                if live.insert(e.addr, b).is_some() {
                    rec.inconsistent_entries += 1;
                }
            }
            Action::SegmentAlloc | Action::SegmentMap => {
                if !remove_range(&mut ranges, e.addr, e.addr.saturating_add(e.size)) {
                    rec.inconsistent_entries += 1;
                }
            }
            Action::SegmentFree => {
                add_range(&mut ranges, e.addr, e.addr.saturating_add(e.size), false, e.stream, false)
            }
            Action::SegmentUnmap => add_range(&mut ranges, e.addr, e.addr.saturating_add(e.size), true, e.stream, true),
            Action::FreeRequested | Action::Snapshot | Action::Oom | Action::Annotate => {}
        }
    }

    // Forwards, emitting events.
    let with_time = !entries.is_empty() && entries.iter().all(|e| e.time_us().is_some());
    let ts_of = |i: usize, e: &Entry| -> u64 {
        if with_time { (e.time_us().unwrap_or(0) as u64).saturating_mul(1000) } else { t0_ns + i as u64 }
    };
    let t_start = entries.first().map_or(t0_ns, |e| ts_of(0, e));
    let pid = device;
    // Private pools: their blocks' and segments' stream key carries the
    // pool (`crate::allocator::private_stream`), from the final segment
    // holding the address (a private segment freed before the end is not
    // known, and counts as the default pool's).
    let mut pools: Vec<(u64, u64)> = segs.iter().map(|s| s.pool).filter(|&p| p != (0, 0)).collect();
    pools.sort_unstable();
    pools.dedup();
    let private: std::collections::BTreeMap<u64, (u64, u64)> = segs
        .iter()
        .filter_map(|s| {
            let index = pools.binary_search(&s.pool).ok()? as u64 + 1;
            Some((s.address, (s.address.saturating_add(s.total_size), index)))
        })
        .collect();
    let key = |addr: u64, stream: u64| match private.range(..=addr).next_back() {
        Some((_, &(end, index))) if addr < end => crate::allocator::private_stream(stream, index),
        _ => stream,
    };
    let ev = |ts: u64, kind: EventKind, addr: u64, size: u64, stream: u64, extra: Extra| Event {
        ts_ns: ts,
        duration_ns: 0,
        pid,
        tid: 0,
        kind,
        addr,
        size,
        ret: 0,
        device: Some(device as i32),
        stream: Some(key(addr, stream)),
        extra,
        cuda: Default::default(),
    };
    rec.initial_segments = ranges.len() as u64;
    for (&a, &(b, expandable, stream)) in &ranges {
        let kind = if expandable { EventKind::SegmentMap } else { EventKind::SegmentAlloc };
        out(ev(t_start, kind, a, b - a, stream, Extra::default()))?;
    }
    // Live blocks by address, for the free space after a new block.
    let mut placed: std::collections::BTreeMap<u64, LiveBlock> = std::collections::BTreeMap::new();
    let free_end = |placed: &std::collections::BTreeMap<u64, LiveBlock>, ranges: &Ranges, addr: u64| -> u64 {
        let seg_end = ranges.range(..=addr).next_back().map_or(addr, |(_, &(e, _, _))| e);
        let next = placed.range(addr + 1..).next().map_or(u64::MAX, |(&a, _)| a);
        seg_end.min(next).max(addr)
    };
    let mut initial: Vec<(u64, LiveBlock)> = live.into_iter().collect();
    initial.sort_unstable_by_key(|p| p.0);
    rec.initial_blocks = initial.len() as u64;
    for (addr, mut b) in initial.into_iter().rev() {
        let size =
            b.size.unwrap_or_else(|| block_size_rule(&settings, b.requested, addr, free_end(&placed, &ranges, addr)));
        b.size = Some(size);
        placed.insert(addr, b);
    }
    for (&addr, b) in &placed {
        let extra = Extra { requested: Some(b.requested), stack: b.stack, device_free: None };
        out(ev(t_start, EventKind::BlockAlloc, addr, b.size.unwrap_or(0), b.stream, extra))?;
    }
    for (i, e) in entries.into_chunks().flat_map(Vec::into_iter).enumerate() {
        // The chunks consumed so far (and, at the first entry, what parsing
        // freed) go back to the kernel as the events are built.
        if i % GIVE_BACK_EVERY == 0 {
            crate::heap::give_back_freed();
        }
        let ts = ts_of(i, &e);
        let end = e.addr.saturating_add(e.size);
        match e.action {
            Action::Alloc => {
                if placed.contains_key(&e.addr) {
                    continue; // counted as inconsistent on the way back
                }
                let rule = block_size_rule(&settings, e.size, e.addr, free_end(&placed, &ranges, e.addr));
                let size = match known.get(&i).copied() {
                    Some(real) => {
                        rec.sizes_checked += 1;
                        rec.sizes_agreed += u64::from(real == rule);
                        real
                    }
                    None => rule,
                };
                placed.insert(
                    e.addr,
                    LiveBlock { size: Some(size), requested: e.size, stack: e.stack(), stream: e.stream },
                );
                let extra = Extra { requested: Some(e.size), stack: e.stack(), device_free: None };
                out(ev(ts, EventKind::BlockAlloc, e.addr, size, e.stream, extra))?;
            }
            Action::FreeRequested | Action::FreeCompleted => {
                let Some(b) = placed.get(&e.addr).copied() else { continue };
                let kind = if e.action == Action::FreeCompleted {
                    placed.remove(&e.addr);
                    EventKind::BlockFree
                } else {
                    EventKind::BlockFreeRequested
                };
                let extra = Extra { requested: Some(e.size), stack: e.stack(), device_free: None };
                out(ev(ts, kind, e.addr, b.size.unwrap_or(0), e.stream, extra))?;
            }
            Action::SegmentAlloc => {
                add_range(&mut ranges, e.addr, end, false, e.stream, false);
                out(ev(ts, EventKind::SegmentAlloc, e.addr, e.size, e.stream, Extra::default()))?;
            }
            Action::SegmentMap => {
                add_range(&mut ranges, e.addr, end, true, e.stream, true);
                out(ev(ts, EventKind::SegmentMap, e.addr, e.size, e.stream, Extra::default()))?;
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                if remove_range(&mut ranges, e.addr, end) {
                    let kind =
                        if e.action == Action::SegmentFree { EventKind::SegmentFree } else { EventKind::SegmentUnmap };
                    // Its stack tells the program's empty_cache() from the
                    // allocator's own release before a retry.
                    out(ev(ts, kind, e.addr, e.size, e.stream, Extra { stack: e.stack(), ..Extra::default() }))?;
                }
            }
            Action::Oom => {
                let extra = Extra { requested: Some(e.size), stack: e.stack(), device_free: e.device_free() };
                out(ev(ts, EventKind::Oom, 0, e.size, e.stream, extra))?;
            }
            Action::Snapshot | Action::Annotate => {}
        }
    }

    // The end state against the snapshot.
    let fc = &mut rec.final_check;
    fc.blocks_expected = final_live.len() as u64;
    for (addr, b) in &final_live {
        match placed.get(addr) {
            None => fc.blocks_missing += 1,
            Some(p) if p.size != b.size || p.requested != b.requested => fc.blocks_size_mismatch += 1,
            Some(_) => {}
        }
    }
    fc.blocks_unexpected = placed.keys().filter(|a| !final_live.contains_key(a)).count() as u64;
    fc.segments_expected = segs.len() as u64;
    fc.segment_bytes_expected = segs.iter().map(|s| s.total_size).sum();
    fc.segment_bytes_replayed = ranges.iter().map(|(a, (b, _, _))| b - a).sum();
    let flat = |r: &Ranges| -> Vec<(u64, u64)> { r.iter().map(|(&a, &(b, _, _))| (a, b)).collect() };
    let (want, got) = (flat(&final_ranges), flat(&ranges));
    fc.segment_ranges_mismatch = want.iter().filter(|r| !got.contains(r)).count() as u64
        + got.iter().filter(|r| !want.contains(r)).count() as u64;
    Ok(rec)
}

/// Where converted events go.
pub type Sink<'s> = &'s mut dyn FnMut(Event) -> Result<()>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::import::snapshot::parse::{Block, BlockState};

    fn entry(action: Action, addr: u64, size: u64, time_us: i64) -> Entry {
        Entry { action, addr, size, stream: 0, time_us, stack: crate::trace::event::NO_STACK }
    }

    /// Entries over several chunks: the way back finds the real size of the
    /// block the first entry made (read by entry index across chunks), and
    /// the way forwards emits every entry once, in order, with its time.
    #[test]
    fn entries_over_several_chunks_replay_in_order_with_their_indices() {
        let base = 0x7f00_0000_0000u64;
        let mut snap = Snapshot::default();
        // The block entry 0 made is alive at the end, 1536 B where the rule
        // would give 1 000 B's rounding, 1 024 B.
        snap.segments.push(Segment {
            device: 0,
            address: base,
            total_size: 20 << 20,
            stream: 0,
            segment_type: "large".into(),
            is_expandable: false,
            blocks: vec![Block {
                address: base,
                size: 1536,
                requested: 1000,
                state: BlockState::ActiveAllocated,
                stack: None,
            }],
            pool: (0, 0),
        });
        let mut entries = Entries::default();
        entries.push(entry(Action::Alloc, base, 1000, 0));
        let pairs = Entries::CHUNK + 7;
        for p in 0..pairs as i64 {
            entries.push(entry(Action::Alloc, base + (1 << 20), 512, 2 * p + 1));
            entries.push(entry(Action::FreeCompleted, base + (1 << 20), 512, 2 * p + 2));
        }
        assert_eq!(entries.len(), 1 + 2 * pairs);
        assert!(entries.len() > 2 * Entries::CHUNK, "three chunks at least");
        let mut got = Vec::new();
        let rec = reconstruct(&snap, entries, 0, 0, &mut |e| {
            got.push(e);
            Ok(())
        })
        .unwrap();
        // The initial segment, then one event per entry.
        assert_eq!(got.len(), 1 + 1 + 2 * pairs);
        assert_eq!(got[0].kind, EventKind::SegmentAlloc);
        assert_eq!((got[1].kind, got[1].size, got[1].ts_ns), (EventKind::BlockAlloc, 1536, 0));
        for (i, e) in got[2..].iter().enumerate() {
            let kind = if i % 2 == 0 { EventKind::BlockAlloc } else { EventKind::BlockFree };
            assert_eq!((e.kind, e.size, e.ts_ns), (kind, 512, (i as u64 + 1) * 1000), "entry {}", i + 1);
        }
        assert_eq!((rec.sizes_checked, rec.sizes_agreed, rec.inconsistent_entries), (1, 0, 0));
        assert!(rec.final_check.exact(), "{:?}", rec.final_check);
        assert_eq!(rec.final_check.blocks_expected, 1);
    }

    #[test]
    fn entries_in_chunks_read_as_one_list() {
        let mut entries = Entries::default();
        assert!(entries.is_empty() && entries.first().is_none());
        let n = 2 * Entries::CHUNK + 3;
        for i in 0..n {
            entries.push(entry(Action::Alloc, i as u64, 512, i as i64));
        }
        assert_eq!(entries.len(), n);
        assert_eq!(entries.first().map(|e| e.addr), Some(0));
        assert!(entries.iter().map(|e| e.addr).eq(0..n as u64));
        assert!(entries.iter().rev().map(|e| e.addr).eq((0..n as u64).rev()));
        let chunks: Vec<Vec<Entry>> = entries.into_chunks().collect();
        assert_eq!(chunks.iter().map(Vec::len).collect::<Vec<_>>(), [Entries::CHUNK, Entries::CHUNK, 3]);
        assert!(chunks.into_iter().flatten().map(|e| e.addr).eq(0..n as u64));
    }
}
