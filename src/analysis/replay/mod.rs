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
//!
//! The files: [`footprint`] (the first pass), [`process`] (one process's
//! state); this module is the fold over the events.

mod footprint;
mod process;
use std::collections::BTreeMap;

use crate::analysis::livemap::LiveMap;

use ahash::AHashMap;
use serde::Serialize;

use self::process::Proc;
use crate::analysis::metrics::{BlockStats, GapSet, Metrics, MetricsConfig};
use crate::trace::event::{Event, EventKind};
pub use footprint::Footprint;

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
    /// Live segments (for the report's table where no final state was
    /// reconstructed: a recording's view).
    #[serde(skip)]
    pub segments: u64,
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
            segments: p.segments.len() as u64,
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

#[cfg(test)]
mod tests;
