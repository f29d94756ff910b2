//! The live state of one process ([`Proc`]) and its operations: the
//! device view's blocks and gaps within the footprint regions, and the
//! allocator view's blocks within segments, each keeping the metrics'
//! sufficient statistics up to date.

use std::collections::BTreeMap;

use crate::analysis::livemap::LiveMap;

use ahash::AHashMap;

use super::footprint::ProcFootprint;
use crate::analysis::metrics::{BlockStats, GapSet, MetricsConfig};

/// The live state of one process.
#[derive(Clone, Debug)]
pub(super) struct Proc<'f> {
    pub(super) pid: u32,
    pub(super) footprint: Option<&'f ProcFootprint>,
    /// Reference mode only: the live blocks, unordered.
    pub(super) hashed: AHashMap<u64, u64>,
    /// New blocks not yet in `live`, sorted by address (see `Proc::alloc`).
    pub(super) pending: Vec<(u64, u64)>,
    pub(super) live: LiveMap,
    pub(super) blocks: BlockStats,
    pub(super) gaps: GapSet,
    pub(super) span: u64,
    pub(super) peak_span: u64,
    pub(super) peak_bytes: u64,
    pub(super) peak_t_ns: u64,
    /// Allocator view only: the live segments (start → end, expandable),
    /// requested size and stack of each live block, Σ requested, and
    /// Σ(free range)² over every free range (gaps or not).
    pub(super) segments: BTreeMap<u64, (u64, bool)>,
    pub(super) block_info: AHashMap<u64, (u64, u32)>,
    pub(super) requested: u64,
    pub(super) free_sq: u128,
}

/// Pending blocks are placed in the ordered structures beyond this many.
pub(super) const PENDING_MAX: usize = 64;

impl Proc<'_> {
    pub(super) fn add_gap(&mut self, g: u64, cfg: &MetricsConfig) {
        if cfg.is_gap(g) {
            self.gaps.insert(g);
        }
    }

    pub(super) fn remove_gap(&mut self, g: u64, cfg: &MetricsConfig) {
        if cfg.is_gap(g) {
            self.gaps.remove(g);
        }
    }

    /// A new block: removes the live blocks it overlaps (true if any), then
    /// holds it as pending. Pending blocks (address-sorted, disjoint from
    /// each other and from the placed ones) enter the ordered structures
    /// only at [`Proc::flush`]: a temporary freed before that never costs a
    /// tree update.
    pub(super) fn alloc(&mut self, addr: u64, size: u64, regions: &[(u64, u64)], cfg: &MetricsConfig) -> bool {
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
    pub(super) fn free(&mut self, addr: u64, regions: &[(u64, u64)], cfg: &MetricsConfig) -> Option<u64> {
        let size = match self.pending.binary_search_by_key(&addr, |p| p.0) {
            Ok(i) => self.pending.remove(i).1,
            Err(_) => self.unplace(addr, regions, cfg)?,
        };
        self.blocks.remove(size, cfg);
        Some(size)
    }

    /// Places every pending block in the ordered structures.
    pub(super) fn flush(&mut self, regions: &[(u64, u64)], cfg: &MetricsConfig) {
        let pending = std::mem::take(&mut self.pending);
        for &(addr, size) in &pending {
            self.place(addr, size, regions, cfg);
        }
        self.pending = pending;
        self.pending.clear();
    }

    /// Puts a block that overlaps nothing into the ordered map, the gaps and
    /// the span. Its predecessor is the last block starting before its end.
    pub(super) fn place(&mut self, addr: u64, size: u64, regions: &[(u64, u64)], cfg: &MetricsConfig) {
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
    pub(super) fn unplace(&mut self, addr: u64, regions: &[(u64, u64)], cfg: &MetricsConfig) -> Option<u64> {
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
    pub(super) fn add_free(&mut self, g: u64, cfg: &MetricsConfig) {
        self.free_sq += u128::from(g) * u128::from(g);
        self.add_gap(g, cfg);
    }

    pub(super) fn remove_free(&mut self, g: u64, cfg: &MetricsConfig) {
        self.free_sq -= u128::from(g) * u128::from(g);
        self.remove_gap(g, cfg);
    }

    /// The free ranges of [s, e) given the live blocks inside it.
    pub(super) fn free_ranges(&self, s: u64, e: u64) -> Vec<u64> {
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
    pub(super) fn segment_of(&self, addr: u64) -> Option<(u64, u64)> {
        self.segments.range(..=addr).next_back().map(|(&s, &(e, _))| (s, e)).filter(|&(_, e)| addr < e)
    }

    pub(super) fn segment_add(&mut self, a: u64, b: u64, expandable: bool, cfg: &MetricsConfig) {
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
    pub(super) fn segment_remove(&mut self, a: u64, b: u64, cfg: &MetricsConfig) -> u64 {
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
    pub(super) fn free_bounds(&self, addr: u64, end: u64, s: u64, e: u64) -> (u64, u64) {
        let pred = self.live.before(addr).filter(|&(a, _)| a >= s).map_or(s, |(a, size)| a + size);
        let succ = self.live.at_or_after(end).filter(|&(a, _)| a < e).map_or(e, |(a, _)| a);
        (pred, succ)
    }

    /// Places a block; returns (overlapped live blocks, outside every segment).
    pub(super) fn block_alloc(
        &mut self,
        addr: u64,
        size: u64,
        requested: u64,
        stack: u32,
        cfg: &MetricsConfig,
    ) -> (bool, bool) {
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
    pub(super) fn block_free(&mut self, addr: u64, cfg: &MetricsConfig) -> bool {
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
pub(super) fn region_of(regions: &[(u64, u64)], addr: u64) -> (u64, u64) {
    let i = regions.partition_point(|&(start, _)| start <= addr);
    match i.checked_sub(1).map(|i| regions[i]) {
        Some(r) if addr < r.1 => r,
        _ => (addr, addr.saturating_add(1)),
    }
}
