//! Replay (SPEC §3, device view): applies events in time order to the set of
//! live blocks of each process and keeps, incrementally, the sufficient
//! statistics of the metrics ([`crate::analysis::metrics`]). A fold: [`Replay::new`],
//! [`Replay::apply`] per event, [`Replay::metrics`] whenever a row is
//! wanted, [`Replay::finish`] for the anomaly counts.
//!
//! Addresses are per process, so every process has its own state keyed by
//! address. The arenas are the process's *footprint regions*: the union of
//! every range it successfully allocated anywhere in the trace, merged into
//! maximal disjoint regions ([`Footprint`], built by a first pass). Address
//! space between regions was never used and is never a gap.
//!
//! Anomalies are counted, never fatal:
//! - a free of an address that is not live and was never allocated earlier
//!   in the trace (`unknown_free`: it was allocated before recording began,
//!   its size is unknown, so it cannot be placed),
//! - a free of an address that was allocated earlier and is no longer live
//!   (`double_free`),
//! - an allocation overlapping live blocks (`overlap`): the device cannot
//!   hand out memory twice, so the overlapped blocks were freed by calls the
//!   trace lost; they are removed and the new block is placed,
//! - rows out of time order (`out_of_order`, counted by the loader, which
//!   then sorts stably),
//! - kind names this version does not know (`unknown_kind`).
//!
//! A process's `exit` event (recorded traces) releases every block it still
//! holds, as the driver does when a process ends: they are counted as
//! released at exit ([`ExitRelease`]), neither live nor leaked afterwards.

use std::collections::BTreeMap;

use crate::analysis::livemap::LiveMap;

use ahash::AHashMap;
use serde::Serialize;

use crate::analysis::metrics::{BlockStats, GapSet, Metrics, MetricsConfig};
use crate::trace::event::{Event, EventKind, Events};

/// Anomaly counts of one replay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Anomalies {
    pub unknown_free: u64,
    pub double_free: u64,
    pub overlap: u64,
    pub out_of_order: u64,
    pub unknown_kind: u64,
    /// Allocator view: blocks outside every live segment, and live blocks
    /// a segment free or unmap took away.
    #[serde(skip_serializing_if = "is_zero")]
    pub outside_segment: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Anomalies {
    pub fn total(&self) -> u64 {
        self.unknown_free
            + self.double_free
            + self.overlap
            + self.out_of_order
            + self.unknown_kind
            + self.outside_segment
    }
}

/// Allocator-view figures of one instant (SPEC §3, §4).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct AllocatorFigures {
    /// Σ live segment sizes (the metrics' span).
    pub reserved_bytes: u64,
    /// Σ active block sizes (the metrics' live bytes).
    pub allocated_bytes: u64,
    /// Σ requested sizes of the active blocks.
    pub requested_bytes: u64,
    /// PyTorch's figure: Σ(free range)² / (Σ segment size)².
    pub pytorch_fragmentation: f64,
}

/// Per process: its footprint regions, and for each address the time of its
/// first successful allocation (to tell a double free from a free of a block
/// allocated before the trace began).
#[derive(Clone, Debug, Default)]
pub struct Footprint {
    procs: AHashMap<u32, ProcFootprint>,
}

#[derive(Clone, Debug, Default)]
struct ProcFootprint {
    regions: Vec<(u64, u64)>,
    first_alloc: AHashMap<u64, u64>,
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
            let (addr, size) = (events.addr[i], events.size[i]);
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
            let ts = if kind.creates_block() { events.ts_ns[i] } else { u64::MAX };
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
fn merge_ranges(sorted: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (start, end) in sorted {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// The live state of one process.
#[derive(Clone, Debug)]
struct Proc<'f> {
    pid: u32,
    footprint: Option<&'f ProcFootprint>,
    /// Reference mode only: the live blocks, unordered.
    hashed: AHashMap<u64, u64>,
    /// New blocks not yet in `live`, sorted by address (see `Proc::alloc`).
    pending: Vec<(u64, u64)>,
    live: LiveMap,
    blocks: BlockStats,
    gaps: GapSet,
    span: u64,
    peak_span: u64,
    peak_bytes: u64,
    peak_t_ns: u64,
    /// Allocator view only: the live segments (start → end, expandable),
    /// requested size and stack of each live block, Σ requested, and
    /// Σ(free range)² over every free range (gaps or not).
    segments: BTreeMap<u64, (u64, bool)>,
    block_info: AHashMap<u64, (u64, u32)>,
    requested: u64,
    free_sq: u128,
}

/// What a process still held when it exited, released by its `exit`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ExitRelease {
    pub pid: u32,
    pub t_ns: u64,
    pub bytes: u64,
    pub blocks: u64,
}

/// Exact peak of one process's live bytes (between rows too).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Peak {
    pub pid: u32,
    pub bytes: u64,
    pub t_ns: u64,
    /// Allocator view: the exact peak of the reserved bytes (the segments'
    /// span), at every segment event. Not used in the device view.
    pub span_bytes: u64,
}

/// The replay fold over a whole trace (all processes).
#[derive(Debug)]
pub struct Replay<'f> {
    cfg: MetricsConfig,
    footprint: &'f Footprint,
    /// In order of first device-memory event.
    procs: Vec<Proc<'f>>,
    index: AHashMap<u32, usize>,
    last: Option<(u32, usize)>,
    anomalies: Anomalies,
    exits: Vec<ExitRelease>,
    live_total: u64,
    peak_total: u64,
    mode: Mode,
}

/// Which replay: the device view, the allocator view, or the device view
/// by the reference implementation's method (the benchmark baseline).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Device,
    Allocator,
    Reference,
}

impl<'f> Replay<'f> {
    pub fn new(cfg: MetricsConfig, footprint: &'f Footprint) -> Self {
        Replay {
            cfg,
            footprint,
            procs: Vec::new(),
            index: AHashMap::new(),
            last: None,
            anomalies: Anomalies::default(),
            exits: Vec::new(),
            live_total: 0,
            peak_total: 0,
            mode: Mode::Device,
        }
    }

    /// The allocator view (PyTorch snapshots): arenas are the live
    /// segments, whole, so their free head and tail are gaps too; blocks
    /// come from `block_alloc`/`block_free`, segments from
    /// `segment_alloc/free/map/unmap`. Mapped pages join the expandable
    /// segment they extend.
    pub fn allocator(cfg: MetricsConfig, footprint: &'f Footprint) -> Self {
        Replay { mode: Mode::Allocator, ..Replay::new(cfg, footprint) }
    }

    /// The reference implementation's method, as a baseline: live blocks
    /// in a hash map only, and at every row [`Replay::metrics`] collects
    /// them, sorts them by address and recomputes every metric from
    /// scratch. Allocations overlapping live blocks are not detected (the
    /// reference does not); on traces without such anomalies the rows equal
    /// the incremental ones.
    pub fn reference(cfg: MetricsConfig, footprint: &'f Footprint) -> Self {
        Replay { mode: Mode::Reference, ..Replay::new(cfg, footprint) }
    }

    fn proc_index(&mut self, pid: u32) -> usize {
        if let Some((p, i)) = self.last
            && p == pid
        {
            return i;
        }
        let i = match self.index.get(&pid) {
            Some(&i) => i,
            None => {
                self.procs.push(Proc {
                    pid,
                    footprint: self.footprint.procs.get(&pid),
                    hashed: AHashMap::new(),
                    pending: Vec::new(),
                    live: LiveMap::new(),
                    blocks: BlockStats::default(),
                    gaps: GapSet::default(),
                    span: 0,
                    peak_span: 0,
                    peak_bytes: 0,
                    peak_t_ns: 0,
                    segments: BTreeMap::new(),
                    block_info: AHashMap::new(),
                    requested: 0,
                    free_sq: 0,
                });
                self.index.insert(pid, self.procs.len() - 1);
                self.procs.len() - 1
            }
        };
        self.last = Some((pid, i));
        i
    }

    /// Whether [`Replay::apply`] does anything with an event of this
    /// kind: the kinds it [`tracks`] in its view, and process exits.
    pub fn reads(&self, kind: EventKind) -> bool {
        kind == EventKind::Exit || tracks(kind, self.mode == Mode::Allocator)
    }

    /// Applies one event. Events must come in time order. A process joins
    /// the replay at its first device-memory event (allocation, free or
    /// OOM, failed or not).
    pub fn apply(&mut self, e: &Event) {
        if e.kind == EventKind::Exit {
            return self.exit(e.pid, e.ts_ns);
        }
        if self.mode == Mode::Allocator {
            return self.apply_allocator(e);
        }
        let kind = e.kind;
        if !tracks(kind, false) {
            return;
        }
        let i = self.proc_index(e.pid);
        if e.ret != 0 || kind == EventKind::Oom {
            return;
        }
        let cfg = self.cfg;
        let proc = &mut self.procs[i];
        let fp = proc.footprint;
        let before = proc.blocks.bytes;
        if self.mode == Mode::Reference {
            if kind.is_device_alloc() {
                if e.addr == 0 || e.size == 0 || e.addr.checked_add(e.size).is_none() {
                    return;
                }
                if let Some(old) = proc.hashed.insert(e.addr, e.size) {
                    proc.blocks.remove(old, &cfg);
                }
                proc.blocks.add(e.size, &cfg);
            } else if e.addr != 0 {
                match proc.hashed.remove(&e.addr) {
                    Some(size) => proc.blocks.remove(size, &cfg),
                    None => match fp.and_then(|f| f.first_alloc.get(&e.addr)) {
                        Some(&first) if first < e.ts_ns => self.anomalies.double_free += 1,
                        _ => self.anomalies.unknown_free += 1,
                    },
                }
            }
        } else if kind.is_device_alloc() {
            let Some(fp) = fp else { return };
            if e.addr == 0 || e.size == 0 || e.addr.checked_add(e.size).is_none() {
                return;
            }
            if proc.alloc(e.addr, e.size, &fp.regions, &cfg) {
                self.anomalies.overlap += 1;
            }
        } else if e.addr != 0 {
            let regions = fp.map_or(&[][..], |f| &f.regions);
            if proc.free(e.addr, regions, &cfg).is_none() {
                match fp.and_then(|f| f.first_alloc.get(&e.addr)) {
                    Some(&first) if first < e.ts_ns => self.anomalies.double_free += 1,
                    _ => self.anomalies.unknown_free += 1,
                }
            }
        }
        self.note_peaks(i, before, e.ts_ns);
    }

    fn apply_allocator(&mut self, e: &Event) {
        use EventKind::*;
        let kind = e.kind;
        if !tracks(kind, true) {
            return;
        }
        let i = self.proc_index(e.pid);
        if e.ret != 0 || kind == Oom {
            return;
        }
        let cfg = self.cfg;
        let proc = &mut self.procs[i];
        let before = proc.blocks.bytes;
        let end = e.addr.saturating_add(e.size);
        match kind {
            BlockAlloc if e.size > 0 => {
                let requested = e.extra.requested.unwrap_or(e.size);
                let stack = e.extra.stack.unwrap_or(crate::trace::event::NO_STACK);
                let (overlapped, outside) = proc.block_alloc(e.addr, e.size, requested, stack, &cfg);
                self.anomalies.overlap += u64::from(overlapped);
                self.anomalies.outside_segment += u64::from(outside);
            }
            BlockFree => {
                if !proc.block_free(e.addr, &cfg) {
                    match self.footprint.procs.get(&e.pid).and_then(|f| f.first_alloc.get(&e.addr)) {
                        Some(&first) if first < e.ts_ns => self.anomalies.double_free += 1,
                        _ => self.anomalies.unknown_free += 1,
                    }
                }
            }
            SegmentAlloc => proc.segment_add(e.addr, end, false, &cfg),
            SegmentMap => proc.segment_add(e.addr, end, true, &cfg),
            SegmentFree | SegmentUnmap => self.anomalies.outside_segment += proc.segment_remove(e.addr, end, &cfg),
            _ => {}
        }
        self.note_peaks(i, before, e.ts_ns);
    }

    /// Process `pid` ended: the driver released every block it held.
    fn exit(&mut self, pid: u32, t_ns: u64) {
        let Some(&i) = self.index.get(&pid) else { return };
        let proc = &mut self.procs[i];
        let (before, blocks) = (proc.blocks.bytes, proc.blocks.count);
        if blocks == 0 {
            return;
        }
        proc.hashed.clear();
        proc.pending.clear();
        proc.live.clear();
        proc.blocks = BlockStats::default();
        proc.gaps = GapSet::default();
        proc.span = 0;
        self.exits.push(ExitRelease { pid, t_ns, bytes: before, blocks });
        self.note_peaks(i, before, t_ns);
    }

    /// Blocks released by process exits, in time order.
    pub fn exits(&self) -> &[ExitRelease] {
        &self.exits
    }

    /// After an event changed process `i`'s live bytes from `before`: its
    /// peak and the peak of the total.
    fn note_peaks(&mut self, i: usize, before: u64, t_ns: u64) {
        let proc = &mut self.procs[i];
        proc.peak_span = proc.peak_span.max(proc.span);
        if proc.blocks.bytes > proc.peak_bytes {
            proc.peak_bytes = proc.blocks.bytes;
            proc.peak_t_ns = t_ns;
        }
        self.live_total = self.live_total + proc.blocks.bytes - before;
        self.peak_total = self.peak_total.max(self.live_total);
    }

    /// Allocator view: the figures of `pid` now (None in the device view).
    pub fn allocator_figures(&self, pid: u32) -> Option<AllocatorFigures> {
        if self.mode != Mode::Allocator {
            return None;
        }
        let p = self.proc(pid)?;
        let reserved = p.span;
        Some(AllocatorFigures {
            reserved_bytes: reserved,
            allocated_bytes: p.blocks.bytes,
            requested_bytes: p.requested,
            pytorch_fragmentation: if reserved == 0 {
                0.0
            } else {
                p.free_sq as f64 / (reserved as f64 * reserved as f64)
            },
        })
    }

    /// Allocator view: live blocks of `pid` as (address, size, requested,
    /// stack id), sorted by address.
    pub fn live_blocks_detailed(&mut self, pid: u32) -> Vec<(u64, u64, u64, u32)> {
        let blocks = self.live_blocks(pid);
        let Some(p) = self.proc(pid) else { return Vec::new() };
        blocks
            .into_iter()
            .map(|(a, s)| {
                let (r, st) = p.block_info.get(&a).copied().unwrap_or((s, crate::trace::event::NO_STACK));
                (a, s, r, st)
            })
            .collect()
    }

    /// Processes seen so far, in order of their first device-memory event.
    pub fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.procs.iter().map(|p| p.pid)
    }

    /// Exact peaks per process, in the order of [`Replay::pids`].
    pub fn peaks(&self) -> Vec<Peak> {
        self.procs
            .iter()
            .map(|p| Peak { pid: p.pid, bytes: p.peak_bytes, t_ns: p.peak_t_ns, span_bytes: p.peak_span })
            .collect()
    }

    /// Exact peak of the live bytes summed over processes.
    pub fn peak_total(&self) -> u64 {
        self.peak_total
    }

    fn proc(&self, pid: u32) -> Option<&Proc<'f>> {
        self.index.get(&pid).map(|&i| &self.procs[i])
    }

    /// Counts a row the loader could not turn into an event.
    pub fn note_unknown_kind(&mut self) {
        self.anomalies.unknown_kind += 1;
    }

    /// Places the pending blocks of `pid` (before a row is computed).
    fn flush(&mut self, pid: u32) {
        if let Some(&i) = self.index.get(&pid) {
            let proc = &mut self.procs[i];
            if !proc.pending.is_empty() {
                let regions = proc.footprint.map_or(&[][..], |f| &f.regions);
                proc.flush(regions, &self.cfg);
            }
        }
    }

    /// The metrics of `pid` in the current state.
    pub fn metrics(&mut self, pid: u32) -> Metrics {
        self.flush(pid);
        if self.mode == Mode::Reference {
            let mut blocks: Vec<(u64, u64)> =
                self.proc(pid).map_or_else(Vec::new, |p| p.hashed.iter().map(|(&a, &s)| (a, s)).collect());
            blocks.sort_unstable();
            return crate::analysis::metrics::from_scratch(&blocks, self.footprint.regions(pid), &self.cfg);
        }
        match self.proc(pid) {
            Some(p) => Metrics::compute(&p.blocks, p.span, &p.gaps, &self.cfg),
            None => Metrics::default(),
        }
    }

    /// Live blocks of `pid` as (address, size), sorted by address.
    pub fn live_blocks(&mut self, pid: u32) -> Vec<(u64, u64)> {
        self.flush(pid);
        self.proc(pid).map_or_else(Vec::new, |p| p.live.iter().collect())
    }

    /// Ends the fold.
    pub fn finish(self) -> Anomalies {
        self.anomalies
    }
}

/// Whether the replay keeps a process for a pid with an event of this
/// kind: device allocations, frees and OOMs, or in the allocator view
/// (a PyTorch snapshot) its blocks, segments and OOMs.
pub fn tracks(kind: EventKind, allocator_view: bool) -> bool {
    use EventKind::*;
    if allocator_view {
        matches!(kind, BlockAlloc | BlockFree | SegmentAlloc | SegmentFree | SegmentMap | SegmentUnmap | Oom)
    } else {
        kind.is_device_alloc() || kind.is_device_free() || kind == Oom
    }
}

/// Pending blocks are placed in the ordered structures beyond this many.
const PENDING_MAX: usize = 64;

impl Proc<'_> {
    fn add_gap(&mut self, g: u64, cfg: &MetricsConfig) {
        if cfg.is_gap(g) {
            self.gaps.insert(g);
        }
    }

    fn remove_gap(&mut self, g: u64, cfg: &MetricsConfig) {
        if cfg.is_gap(g) {
            self.gaps.remove(g);
        }
    }

    /// A new block: removes the live blocks it overlaps (true if any), then
    /// holds it as pending. Pending blocks (address-sorted, disjoint from
    /// each other and from the placed ones) enter the ordered structures
    /// only at [`Proc::flush`]: a temporary freed before that never costs a
    /// tree update.
    fn alloc(&mut self, addr: u64, size: u64, regions: &[(u64, u64)], cfg: &MetricsConfig) -> bool {
        let end = addr + size;
        let mut evicted = false;
        let first = self.pending.partition_point(|p| p.0 + p.1 <= addr);
        while first < self.pending.len() && self.pending[first].0 < end {
            let (_, s) = self.pending.remove(first);
            self.blocks.remove(s, cfg);
            evicted = true;
        }
        while let Some((a, s)) = self.live.before(end) {
            if a + s <= addr {
                break;
            }
            self.unplace(a, regions, cfg);
            self.blocks.remove(s, cfg);
            evicted = true;
        }
        self.pending.insert(first, (addr, size));
        self.blocks.add(size, cfg);
        if self.pending.len() > PENDING_MAX {
            self.flush(regions, cfg);
        }
        evicted
    }

    /// Frees the block starting at `addr`; its size, or None if not live.
    fn free(&mut self, addr: u64, regions: &[(u64, u64)], cfg: &MetricsConfig) -> Option<u64> {
        let size = match self.pending.binary_search_by_key(&addr, |p| p.0) {
            Ok(i) => self.pending.remove(i).1,
            Err(_) => self.unplace(addr, regions, cfg)?,
        };
        self.blocks.remove(size, cfg);
        Some(size)
    }

    /// Places every pending block in the ordered structures.
    fn flush(&mut self, regions: &[(u64, u64)], cfg: &MetricsConfig) {
        let pending = std::mem::take(&mut self.pending);
        for &(addr, size) in &pending {
            self.place(addr, size, regions, cfg);
        }
        self.pending = pending;
        self.pending.clear();
    }

    /// Puts a block that overlaps nothing into the ordered map, the gaps and
    /// the span. Its predecessor is the last block starting before its end.
    fn place(&mut self, addr: u64, size: u64, regions: &[(u64, u64)], cfg: &MetricsConfig) {
        let region = region_of(regions, addr);
        let end = addr + size;
        // One descent for both neighbours and the insertion; a block
        // already at `addr` (only a zero-sized one can be) takes the long way.
        let (pred, succ) = self.live.insert_between(addr, end, size).unwrap_or_else(|()| {
            let around = (self.live.before(end), self.live.at_or_after(end));
            self.live.insert(addr, size);
            around
        });
        let pred = pred.filter(|&(a, _)| a >= region.0).map(|(a, s)| a + s);
        let succ = succ.filter(|&(a, _)| a < region.1).map(|(a, _)| a);
        match (pred, succ) {
            (Some(p_end), Some(q_start)) => {
                self.remove_gap(q_start - p_end, cfg);
                self.add_gap(addr - p_end, cfg);
                self.add_gap(q_start - end, cfg);
            }
            (Some(p_end), None) => {
                self.add_gap(addr - p_end, cfg);
                self.span += end - p_end;
            }
            (None, Some(q_start)) => {
                self.add_gap(q_start - end, cfg);
                self.span += q_start - addr;
            }
            (None, None) => self.span += size,
        }
    }

    /// Takes the placed block starting at `addr` out of the ordered map,
    /// the gaps and the span; its size, or None.
    fn unplace(&mut self, addr: u64, regions: &[(u64, u64)], cfg: &MetricsConfig) -> Option<u64> {
        let (size, pred, succ) = self.live.remove_between(addr)?;
        let end = addr + size;
        let region = region_of(regions, addr);
        let pred = pred.filter(|&(a, _)| a >= region.0).map(|(a, s)| (a, a + s));
        let succ = succ.filter(|&(a, _)| a < region.1).map(|(a, s)| (a, a + s));
        match (pred, succ) {
            (Some((_, p_end)), Some((q_start, _))) => {
                self.remove_gap(addr - p_end, cfg);
                self.remove_gap(q_start - end, cfg);
                self.add_gap(q_start - p_end, cfg);
            }
            (Some((_, p_end)), None) => {
                self.remove_gap(addr - p_end, cfg);
                self.span -= end - p_end;
            }
            (None, Some((q_start, _))) => {
                self.remove_gap(q_start - end, cfg);
                self.span -= q_start - addr;
            }
            (None, None) => self.span -= size,
        }
        Some(size)
    }
}

/// The allocator view's operations. Free ranges are the spaces between
/// consecutive live blocks of a segment and its free head and tail (all of
/// them enter `free_sq`; those above the minimum gap enter `gaps`).
impl Proc<'_> {
    fn add_free(&mut self, g: u64, cfg: &MetricsConfig) {
        self.free_sq += u128::from(g) * u128::from(g);
        self.add_gap(g, cfg);
    }

    fn remove_free(&mut self, g: u64, cfg: &MetricsConfig) {
        self.free_sq -= u128::from(g) * u128::from(g);
        self.remove_gap(g, cfg);
    }

    /// The free ranges of [s, e) given the live blocks inside it.
    fn free_ranges(&self, s: u64, e: u64) -> Vec<u64> {
        let mut out = Vec::new();
        let mut prev = s;
        for (a, size) in self.live.range(s, e) {
            out.push(a.saturating_sub(prev));
            prev = prev.max(a + size);
        }
        out.push(e.saturating_sub(prev));
        out
    }

    /// The live segment holding `addr`.
    fn segment_of(&self, addr: u64) -> Option<(u64, u64)> {
        self.segments.range(..=addr).next_back().map(|(&s, &(e, _))| (s, e)).filter(|&(_, e)| addr < e)
    }

    fn segment_add(&mut self, a: u64, b: u64, expandable: bool, cfg: &MetricsConfig) {
        if b <= a {
            return;
        }
        let (mut s, mut e) = (a, b);
        if expandable {
            if let Some((&ps, &(pe, true))) = self.segments.range(..a).next_back()
                && pe == a
            {
                for g in self.free_ranges(ps, pe) {
                    self.remove_free(g, cfg);
                }
                self.segments.remove(&ps);
                s = ps;
            }
            if let Some(&(ne, true)) = self.segments.get(&b) {
                for g in self.free_ranges(b, ne) {
                    self.remove_free(g, cfg);
                }
                self.segments.remove(&b);
                e = ne;
            }
        }
        self.segments.insert(s, (e, expandable));
        for g in self.free_ranges(s, e) {
            self.add_free(g, cfg);
        }
        self.span += b - a;
    }

    /// Removes [a, b) from the segment holding it; returns how many live
    /// blocks it took away (an anomaly: PyTorch frees only empty memory).
    fn segment_remove(&mut self, a: u64, b: u64, cfg: &MetricsConfig) -> u64 {
        let Some((s, e)) = self.segment_of(a) else { return 0 };
        let b = b.min(e);
        let expandable = self.segments.get(&s).is_some_and(|x| x.1);
        for g in self.free_ranges(s, e) {
            self.remove_free(g, cfg);
        }
        self.segments.remove(&s);
        let doomed: Vec<(u64, u64)> = self.live.range(a, b).collect();
        for &(addr, size) in &doomed {
            self.live.remove(addr);
            self.blocks.remove(size, cfg);
            if let Some((r, _)) = self.block_info.remove(&addr) {
                self.requested -= r;
            }
        }
        for (ps, pe) in [(s, a), (b, e)] {
            if pe > ps {
                self.segments.insert(ps, (pe, expandable));
                for g in self.free_ranges(ps, pe) {
                    self.add_free(g, cfg);
                }
            }
        }
        self.span -= b - a;
        doomed.len() as u64
    }

    /// The end of the live block (or segment start) before `addr` and the
    /// start of the live block (or segment end) after `end`, within [s, e).
    fn free_bounds(&self, addr: u64, end: u64, s: u64, e: u64) -> (u64, u64) {
        let pred = self.live.before(addr).filter(|&(a, _)| a >= s).map_or(s, |(a, size)| a + size);
        let succ = self.live.at_or_after(end).filter(|&(a, _)| a < e).map_or(e, |(a, _)| a);
        (pred, succ)
    }

    /// Places a block; returns (overlapped live blocks, outside every segment).
    fn block_alloc(&mut self, addr: u64, size: u64, requested: u64, stack: u32, cfg: &MetricsConfig) -> (bool, bool) {
        let end = addr.saturating_add(size);
        let mut overlapped = false;
        while let Some((a, s)) = self.live.before(end) {
            if a + s <= addr {
                break;
            }
            self.block_free(a, cfg);
            overlapped = true;
        }
        let seg = self.segment_of(addr);
        if let Some((s, e)) = seg {
            let end = end.min(e);
            let (pred, succ) = self.free_bounds(addr, end, s, e);
            self.remove_free(succ - pred, cfg);
            self.add_free(addr - pred, cfg);
            self.add_free(succ - end, cfg);
        }
        self.live.insert(addr, size);
        self.blocks.add(size, cfg);
        self.block_info.insert(addr, (requested, stack));
        self.requested += requested;
        (overlapped, seg.is_none())
    }

    /// Frees the live block at `addr`; false if there is none.
    fn block_free(&mut self, addr: u64, cfg: &MetricsConfig) -> bool {
        let Some(size) = self.live.remove(addr) else { return false };
        self.blocks.remove(size, cfg);
        if let Some((r, _)) = self.block_info.remove(&addr) {
            self.requested -= r;
        }
        if let Some((s, e)) = self.segment_of(addr) {
            let end = addr.saturating_add(size).min(e);
            let (pred, succ) = self.free_bounds(addr, end, s, e);
            self.remove_free(addr - pred, cfg);
            self.remove_free(succ - end, cfg);
            self.add_free(succ - pred, cfg);
        }
        true
    }
}

/// The region holding `addr`. Every successfully allocated address lies in
/// one; a block that somehow does not gets a region of its own.
fn region_of(regions: &[(u64, u64)], addr: u64) -> (u64, u64) {
    let i = regions.partition_point(|&(start, _)| start <= addr);
    match i.checked_sub(1).map(|i| regions[i]) {
        Some(r) if addr < r.1 => r,
        _ => (addr, addr.saturating_add(1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(ts: u64, pid: u32, kind: EventKind, addr: u64, size: u64) -> Event {
        Event::new(ts, pid, kind, addr, size)
    }

    fn events(list: &[Event]) -> Events {
        let mut ev = Events::default();
        for e in list {
            ev.push(e);
        }
        ev
    }

    #[test]
    fn exit_releases_what_the_process_held_and_only_its_own() {
        use EventKind::*;
        let list = [
            ev(0, 7, Alloc, 0x10000, 0x1000),
            ev(1, 7, Alloc, 0x30000, 0x2000),
            ev(2, 8, Alloc, 0x10000, 0x4000),
            ev(3, 7, Free, 0x10000, 0),
            ev(4, 7, Exit, 0, 0),
            ev(5, 8, Exit, 0, 0),
            ev(6, 9, Exit, 0, 0), // never allocated: nothing to release
        ];
        let evs = events(&list);
        let fp = Footprint::build(&evs);
        for mut r in [Replay::new(MetricsConfig::default(), &fp), Replay::reference(MetricsConfig::default(), &fp)] {
            for e in &list[..5] {
                r.apply(e);
            }
            let m = r.metrics(7);
            assert_eq!((m.live_bytes, m.live_blocks, m.span_bytes, m.gap_count), (0, 0, 0, 0));
            assert_eq!(r.metrics(8).live_bytes, 0x4000);
            for e in &list[5..] {
                r.apply(e);
            }
            let want = [
                ExitRelease { pid: 7, t_ns: 4, bytes: 0x2000, blocks: 1 },
                ExitRelease { pid: 8, t_ns: 5, bytes: 0x4000, blocks: 1 },
            ];
            assert_eq!(r.exits(), &want);
            assert_eq!(r.peak_total(), 0x7000);
            assert_eq!(r.finish().total(), 0);
        }
    }

    #[test]
    fn regions_merge_touching_and_overlapping_ranges() {
        let merged = merge_ranges(vec![(0, 10), (10, 20), (15, 30), (40, 50)]);
        assert_eq!(merged, vec![(0, 30), (40, 50)]);
    }

    #[test]
    fn free_fills_the_hole_and_anomalies_are_counted() {
        use EventKind::*;
        let list = [
            // One early allocation makes 0x10000..0x31000 a single region.
            ev(0, 7, Alloc, 0x10000, 0x21000),
            ev(0, 7, Free, 0x10000, 0),
            ev(1, 7, Alloc, 0x10000, 0x1000),
            ev(2, 7, Alloc, 0x20000, 0x1000),
            ev(3, 7, Alloc, 0x30000, 0x1000),
            ev(4, 7, Free, 0x20000, 0),
            ev(5, 7, Free, 0x20000, 0),       // double free
            ev(6, 7, Free, 0x99000, 0),       // unknown
            ev(7, 7, Alloc, 0x30800, 0x1000), // overlaps the block at 0x30000
        ];
        let evs = events(&list);
        let fp = Footprint::build(&evs);
        let mut r = Replay::new(MetricsConfig::default(), &fp);
        for e in &list[..5] {
            r.apply(e);
        }
        let m = r.metrics(7);
        assert_eq!((m.gap_count, m.largest_gap, m.span_bytes), (2, 0xf000, 0x21000));
        r.apply(&list[5]);
        let m = r.metrics(7);
        assert_eq!((m.gap_count, m.largest_gap, m.live_blocks), (1, 0x1f000, 2));
        for e in &list[6..] {
            r.apply(e);
        }
        assert_eq!(r.live_blocks(7), vec![(0x10000, 0x1000), (0x30800, 0x1000)]);
        let a = r.finish();
        assert_eq!((a.double_free, a.unknown_free, a.overlap), (1, 1, 1));
    }

    #[test]
    fn blocks_in_separate_regions_have_no_gap_between_them() {
        use EventKind::*;
        let list = [ev(1, 7, Alloc, 0x10000, 0x1000), ev(2, 7, Alloc, 0x20000, 0x1000)];
        let evs = events(&list);
        let fp = Footprint::build(&evs);
        assert_eq!(fp.regions(7), &[(0x10000, 0x11000), (0x20000, 0x21000)]);
        let mut r = Replay::new(MetricsConfig::default(), &fp);
        list.iter().for_each(|e| r.apply(e));
        let m = r.metrics(7);
        assert_eq!((m.gap_count, m.span_bytes, m.utilization), (0, 0x2000, 1.0));
    }

    #[test]
    fn processes_are_separate_address_spaces() {
        use EventKind::*;
        let list = [ev(1, 1, Alloc, 0x10000, 0x1000), ev(2, 2, Alloc, 0x10000, 0x2000), ev(3, 1, Free, 0x10000, 0)];
        let evs = events(&list);
        let fp = Footprint::build(&evs);
        let mut r = Replay::new(MetricsConfig::default(), &fp);
        list.iter().for_each(|e| r.apply(e));
        assert_eq!(r.metrics(1).live_blocks, 0);
        assert_eq!(r.metrics(2).live_bytes, 0x2000);
        assert_eq!(r.finish().total(), 0);
    }
}
