//! A model of PyTorch's CUDA caching allocator (`CUDACachingAllocator.cpp`,
//! the native allocator of PyTorch 2.1–2.5, without expandable segments),
//! for replaying a recorded request stream under other settings.
//!
//! What it follows:
//! - **Rounding**: requests below 512 B become 512 B; with
//!   `roundup_power2_divisions` d > 1 for the request's power-of-two
//!   interval (and a request above 512·d B), up to the next of d equal
//!   divisions of that interval; otherwise up to a multiple of 512 B.
//! - **Pools**: small (≤ 1 MiB) and large, each ordered by (stream, size,
//!   address); a request takes the first free block of its stream and pool
//!   at least its size (best fit, lowest address on ties).
//! - **`max_split_size`**: a request below it never takes a block at or
//!   above it; a request at or above it takes such a block only when it
//!   wastes less than 20 MiB.
//! - **New segments**: 2 MiB for small requests, 20 MiB for large ones
//!   below 10 MiB, otherwise the request rounded up to 2 MiB. The block
//!   goes at the start of the segment.
//! - **Splitting**: the block takes the low end of the free block; the rest
//!   stays free when it is ≥ 512 B (small pool) or > 1 MiB (large pool,
//!   and only for requests below `max_split_size`).
//! - **Freeing** (`free_completed`): the block merges with free neighbours
//!   of its segment.
//! - **Out of memory**: when a new segment does not fit the capacity, the
//!   oversize cached segments are released (`release_available_cached_blocks`,
//!   with `max_split_size`), then every cached free segment
//!   (`release_cached_blocks`), retrying after each; then the request fails.
//! - **`garbage_collection_threshold`**: before asking for a segment, when
//!   reserved memory exceeds the threshold × capacity, whole free segments
//!   are released, oldest first, until reserved is below it.
//!
//! - **Expandable segments** (`expandable_segments:True`): one virtual
//!   range per stream and pool that grows at its end; a block maps the
//!   2 MiB (small) or 20 MiB (large) pages it covers, any remainder of
//!   ≥ 512 B is split off, and freed pages stay mapped until the cache is
//!   released — before an OOM, every page no allocated block touches is
//!   unmapped, so holes cost no physical memory. Best fit takes a free
//!   block's current size, not what it could grow to (PyTorch also counts
//!   an unmapped neighbour), and garbage collection does not apply.
//!
//! Not modelled: CUDA graph pools, pending
//! `record_stream` events (a block is reusable at its `free_completed`),
//! and the exact ages PyTorch's garbage collection weighs (it releases
//! unsplit large blocks whose age is at least the average; this model
//! releases whole free segments, least recently freed first). Rounding
//! follows PyTorch ≥ 2.4 (`roundup_power2_divisions` of 1 means plain
//! 512 B rounding).

use std::collections::{BTreeMap, BTreeSet, HashMap};

pub use crate::import::settings::{LARGE_BUFFER, MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE, Settings};

/// PyTorch's constants for new segments.
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
pub const ROUND_LARGE: u64 = 2 << 20;

/// The size of a new segment for a rounded request.
pub fn segment_size(rounded: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        rounded.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Block {
    size: u64,
    stream: u64,
    allocated: bool,
    small: bool,
    /// Start of its segment.
    segment: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Segment {
    size: u64,
    stream: u64,
    small: bool,
    /// When its last block was freed (for garbage collection order).
    freed_at: u64,
}

/// Why a request got no block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// A new segment would exceed the capacity, even after releasing the
    /// cache.
    OutOfMemory { reserved: u64, segment: u64 },
}

/// The allocator's state: every block by address, the free ones also in
/// their pool's (stream, size, address) order, and the segments.
#[derive(Clone, Debug, Default)]
pub struct Allocator {
    pub settings: Settings,
    blocks: BTreeMap<u64, Block>,
    free_small: BTreeSet<(u64, u64, u64)>,
    free_large: BTreeSet<(u64, u64, u64)>,
    segments: BTreeMap<u64, Segment>,
    pub reserved: u64,
    pub allocated: u64,
    clock: u64,
    /// Expandable segments: per (stream, small pool) one virtual range,
    /// its start and the end of the blocks in it.
    ranges: BTreeMap<(u64, bool), (u64, u64)>,
    /// Mapped pages of the ranges: start → page size.
    mapped: BTreeMap<u64, u64>,
    /// Expandable segments: allocated blocks touching each page, and the
    /// mapped pages none touches — what `release_cached_blocks` unmaps.
    /// Kept as blocks come and go, so that releasing the cache before
    /// each out-of-memory retry does not walk every block (a run that
    /// keeps failing requests once memory is full made that quadratic).
    page_users: HashMap<u64, u32>,
    idle_pages: BTreeSet<u64>,
    /// When on: the segment changes (`segment_alloc`, `segment_free`,
    /// `segment_map`, `segment_unmap`: kind, address, size) since the
    /// last [`Allocator::take_log`].
    pub log: Option<Vec<(crate::trace::event::EventKind, u64, u64)>>,
}

/// Where a request was placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub addr: u64,
    pub size: u64,
    /// A new segment of this size was needed.
    pub new_segment: Option<u64>,
}

impl Allocator {
    pub fn new(settings: Settings) -> Allocator {
        Allocator { settings, ..Allocator::default() }
    }

    fn pool(&mut self, small: bool) -> &mut BTreeSet<(u64, u64, u64)> {
        if small { &mut self.free_small } else { &mut self.free_large }
    }

    fn insert_free(&mut self, addr: u64, b: Block) {
        self.blocks.insert(addr, Block { allocated: false, ..b });
        self.pool(b.small).insert((b.stream, b.size, addr));
    }

    fn remove_free(&mut self, addr: u64) -> Option<Block> {
        let b = *self.blocks.get(&addr)?;
        if b.allocated {
            return None;
        }
        self.pool(b.small).remove(&(b.stream, b.size, addr));
        self.blocks.remove(&addr);
        Some(b)
    }

    /// Adds a segment at `addr` (all free). `small`: the small pool's.
    fn note(&mut self, kind: crate::trace::event::EventKind, addr: u64, size: u64) {
        if let Some(log) = &mut self.log {
            log.push((kind, addr, size));
        }
    }

    /// The segment changes noted since the last call.
    pub fn take_log(&mut self) -> Vec<(crate::trace::event::EventKind, u64, u64)> {
        self.log.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn add_segment(&mut self, addr: u64, size: u64, stream: u64, small: bool) {
        self.note(crate::trace::event::EventKind::SegmentAlloc, addr, size);
        self.segments.insert(addr, Segment { size, stream, small, freed_at: self.clock });
        self.reserved += size;
        self.insert_free(addr, Block { size, stream, allocated: false, small, segment: addr });
    }

    /// Removes the segment at `addr` when it is entirely free.
    pub fn release_segment(&mut self, addr: u64) -> bool {
        let Some(s) = self.segments.get(&addr).copied() else { return false };
        match self.blocks.get(&addr) {
            Some(b) if !b.allocated && b.size == s.size => {
                self.note(crate::trace::event::EventKind::SegmentFree, addr, s.size);
                self.remove_free(addr);
                self.segments.remove(&addr);
                self.reserved -= s.size;
                true
            }
            _ => false,
        }
    }

    /// The free block the allocator would take for a rounded request.
    pub fn find_free(&self, rounded: u64, stream: u64) -> Option<u64> {
        let small = rounded <= SMALL_SIZE;
        let pool = if small { &self.free_small } else { &self.free_large };
        let &(s, size, addr) = pool.range((stream, rounded, 0)..).next()?;
        if s != stream {
            return None;
        }
        if let Some(max) = self.settings.max_split_size {
            if rounded < max && size >= max {
                return None;
            }
            if rounded >= max && size >= rounded + LARGE_BUFFER {
                return None;
            }
        }
        Some(addr)
    }

    fn should_split(&self, block: &Block, rounded: u64) -> bool {
        let rest = block.size - rounded;
        if block.small || self.settings.expandable_segments {
            rest >= MIN_BLOCK
        } else {
            self.settings.max_split_size.is_none_or(|m| rounded < m) && rest > SMALL_SIZE
        }
    }

    /// The size of the block a rounded request would get from the free
    /// block at `addr` (None when there is no free block there).
    pub fn would_take(&self, addr: u64, rounded: u64) -> Option<u64> {
        let b = self.blocks.get(&addr).filter(|b| !b.allocated && b.size >= rounded)?;
        Some(if self.should_split(b, rounded) { rounded } else { b.size })
    }

    /// The size of the block a rounded request would get from a new
    /// segment of `segment` bytes.
    pub fn would_take_new(&self, segment: u64, rounded: u64) -> u64 {
        let b = Block { size: segment, stream: 0, allocated: false, small: rounded <= SMALL_SIZE, segment: 0 };
        if self.should_split(&b, rounded) { rounded } else { segment }
    }

    /// Takes the free block at `addr` for a rounded request: the low end,
    /// the rest stays free when the split rules allow. Returns the block's
    /// size.
    pub fn take(&mut self, addr: u64, rounded: u64) -> Option<u64> {
        let b = self.remove_free(addr)?;
        let size = if self.should_split(&b, rounded) {
            self.insert_free(addr + rounded, Block { size: b.size - rounded, ..b });
            rounded
        } else {
            b.size
        };
        self.blocks.insert(addr, Block { size, allocated: true, ..b });
        self.allocated += size;
        self.clock += 1;
        self.count_users(addr, size, b.small, true);
        Some(size)
    }

    /// Places `addr` (an exact block the recording had) inside a free
    /// block: for building the initial state and following a recording.
    /// False when no free block covers it.
    pub fn take_exact(&mut self, addr: u64, size: u64) -> bool {
        let Some((&start, &b)) = self.blocks.range(..=addr).next_back() else { return false };
        if b.allocated || addr + size > start + b.size {
            return false;
        }
        self.remove_free(start);
        if addr > start {
            self.insert_free(start, Block { size: addr - start, ..b });
        }
        let end = start + b.size;
        if addr + size < end {
            self.insert_free(addr + size, Block { size: end - addr - size, ..b });
        }
        self.blocks.insert(addr, Block { size, allocated: true, ..b });
        self.allocated += size;
        self.clock += 1;
        self.count_users(addr, size, b.small, true);
        true
    }

    /// With expandable segments: counts a block that becomes allocated
    /// (`used`) or free on the pages it touches, keeping `idle_pages`.
    fn count_users(&mut self, addr: u64, size: u64, small: bool, used: bool) {
        if !self.settings.expandable_segments {
            return;
        }
        let page = Self::page(small);
        let mut p = addr / page * page;
        while p < addr + size {
            let n = self.page_users.entry(p).or_default();
            if used {
                *n += 1;
                if *n == 1 {
                    self.idle_pages.remove(&p);
                }
            } else {
                *n -= 1;
                if *n == 0 {
                    self.page_users.remove(&p);
                    if self.mapped.contains_key(&p) {
                        self.idle_pages.insert(p);
                    }
                }
            }
            p += page;
        }
    }

    /// Frees the allocated block at `addr`, merging it with free
    /// neighbours in its segment. Returns its size.
    pub fn free(&mut self, addr: u64) -> Option<u64> {
        let b = *self.blocks.get(&addr).filter(|b| b.allocated)?;
        self.blocks.remove(&addr);
        self.allocated -= b.size;
        self.count_users(addr, b.size, b.small, false);
        self.clock += 1;
        let (mut start, mut size) = (addr, b.size);
        if let Some((&p, &pb)) = self.blocks.range(..addr).next_back()
            && !pb.allocated
            && pb.segment == b.segment
            && p + pb.size == addr
        {
            self.remove_free(p);
            start = p;
            size += pb.size;
        }
        if let Some(&nb) = self.blocks.get(&(addr + b.size))
            && !nb.allocated
            && nb.segment == b.segment
        {
            self.remove_free(addr + b.size);
            size += nb.size;
        }
        self.insert_free(start, Block { size, ..b });
        if let Some(s) = self.segments.get_mut(&b.segment)
            && start == b.segment
            && size == s.size
        {
            s.freed_at = self.clock;
        }
        Some(b.size)
    }

    /// Releases every entirely free segment (`release_cached_blocks`);
    /// returns the bytes released.
    pub fn release_cache(&mut self) -> u64 {
        // With expandable segments: the unused pages of the ranges, and
        // any plain segment left from before (the recorded initial state).
        let unmapped = if self.settings.expandable_segments { self.unmap_free_pages() } else { 0 };
        let whole: Vec<u64> = self
            .segments
            .iter()
            .filter(|(a, s)| self.blocks.get(a).is_some_and(|b| !b.allocated && b.size == s.size))
            .map(|(a, _)| *a)
            .collect();
        let before = self.reserved;
        for a in whole {
            self.release_segment(a);
        }
        unmapped + before - self.reserved
    }

    /// `release_available_cached_blocks`: with `max_split_size`, releases
    /// the smallest free oversize segment of the stream at least the
    /// request (or max_split_size), else oversize ones from the largest
    /// below down until their total reaches it. True when it released
    /// enough.
    fn release_available(&mut self, rounded: u64, stream: u64) -> bool {
        let Some(mss) = self.settings.max_split_size else { return false };
        let small = rounded <= SMALL_SIZE;
        let want = rounded.max(mss);
        let whole = |a: &Allocator, addr: u64| {
            a.segments.get(&addr).zip(a.blocks.get(&addr)).is_some_and(|(s, b)| !b.allocated && b.size == s.size)
        };
        let pool = if small { &self.free_small } else { &self.free_large };
        if let Some(&(s, _, addr)) = pool.range((stream, want, 0)..).next()
            && s == stream
        {
            return whole(self, addr) && self.release_segment(addr);
        }
        let below: Vec<(u64, u64)> = pool
            .range(..(stream, want, 0))
            .rev()
            .take_while(|k| k.0 == stream && k.1 >= mss)
            .map(|k| (k.1, k.2))
            .collect();
        let mut total = 0;
        for (size, addr) in below {
            if total >= want {
                break;
            }
            if whole(self, addr) && self.release_segment(addr) {
                total += size;
            }
        }
        total >= want
    }

    /// Garbage collection: releases whole free segments, least recently
    /// freed first, until reserved is at most `target`.
    fn collect_garbage(&mut self, target: u64) {
        let mut whole: Vec<(u64, u64)> = self
            .segments
            .iter()
            .filter(|(a, s)| self.blocks.get(a).is_some_and(|b| !b.allocated && b.size == s.size))
            .map(|(a, s)| (s.freed_at, *a))
            .collect();
        whole.sort_unstable();
        for (_, a) in whole {
            if self.reserved <= target {
                break;
            }
            self.release_segment(a);
        }
    }

    /// The page size of an expandable range: 2 MiB (small pool), 20 MiB.
    fn page(small: bool) -> u64 {
        if small { SMALL_BUFFER } else { LARGE_BUFFER }
    }

    /// Bytes of pages covering [addr, addr + size) that are not mapped.
    fn unmapped_in(&self, addr: u64, size: u64, page: u64) -> u64 {
        let (first, last) = (addr / page * page, (addr + size).div_ceil(page) * page);
        (first..last).step_by(page as usize).filter(|p| !self.mapped.contains_key(p)).count() as u64 * page
    }

    fn map(&mut self, addr: u64, size: u64, page: u64) -> bool {
        let (first, last) = (addr / page * page, (addr + size).div_ceil(page) * page);
        let mut any = false;
        for p in (first..last).step_by(page as usize) {
            if self.mapped.insert(p, page).is_none() {
                if !self.page_users.contains_key(&p) {
                    self.idle_pages.insert(p);
                }
                self.reserved += page;
                self.note(crate::trace::event::EventKind::SegmentMap, p, page);
                any = true;
            }
        }
        any
    }

    /// Unmaps every mapped page no allocated block touches
    /// (`release_cached_blocks` with expandable segments); returns the
    /// bytes released.
    fn unmap_free_pages(&mut self) -> u64 {
        let before = self.reserved;
        for p in std::mem::take(&mut self.idle_pages) {
            if let Some(s) = self.mapped.remove(&p) {
                self.reserved -= s;
                self.note(crate::trace::event::EventKind::SegmentUnmap, p, s);
            }
        }
        before - self.reserved
    }

    /// A request with expandable segments: the best-fit free block of the
    /// stream's range, else the range grows at its end; the pages the
    /// block covers are mapped, releasing unused pages first when the
    /// capacity would be exceeded. Returns the placement; `new_segment` is
    /// the bytes newly mapped.
    fn malloc_expandable(&mut self, rounded: u64, stream: u64, capacity: Option<u64>) -> Result<Placement, Refused> {
        let small = rounded <= SMALL_SIZE;
        let page = Self::page(small);
        // Fresh virtual ranges, 1 TiB apart, starting on a page.
        let next_start = ((1u64 << 44) + (self.ranges.len() as u64) * (1u64 << 40)).div_ceil(page) * page;
        let (start, end) = *self.ranges.entry((stream, small)).or_insert((next_start, next_start));
        let addr = match self.find_free(rounded, stream) {
            Some(a) => a,
            None => {
                // Grow: the free block at the end of the range, or the end.
                let at = match self.blocks.range(start..end).next_back() {
                    Some((&a, b)) if !b.allocated && a + b.size == end => a,
                    _ => end,
                };
                let new_end = end.max(at + rounded);
                if at < end {
                    let b = self.remove_free(at).expect("the last block is free");
                    self.insert_free(at, Block { size: new_end - at, ..b });
                } else {
                    let b = Block { size: new_end - end, stream, allocated: false, small, segment: start };
                    self.insert_free(end, b);
                }
                self.ranges.insert((stream, small), (start, new_end));
                at
            }
        };
        // A free block of a plain segment (one alive before the trace, in
        // the recorded state) is reserved already: nothing to map.
        let segment = self.blocks.get(&addr).map_or(start, |b| b.segment);
        if !self.ranges.values().any(|&(s, _)| s == segment) {
            let size = self.take(addr, rounded).unwrap_or(rounded);
            return Ok(Placement { addr, size, new_segment: None });
        }
        let need = self.unmapped_in(addr, rounded, page);
        let fits = |a: &Allocator| capacity.is_none_or(|c| a.reserved + need <= c);
        if !fits(self) {
            self.unmap_free_pages();
            let need = self.unmapped_in(addr, rounded, page);
            if capacity.is_some_and(|c| self.reserved + need > c) {
                return Err(Refused::OutOfMemory { reserved: self.reserved, segment: need });
            }
        }
        let before = self.reserved;
        let size = self.take(addr, rounded).unwrap_or(rounded);
        self.map(addr, size, page);
        let mapped = self.reserved - before;
        Ok(Placement { addr, size, new_segment: (mapped > 0).then_some(mapped) })
    }

    /// Serves a request in simulation: a free block, else a new segment
    /// from `new_segment_at` (the address the device gives) within
    /// `capacity`, releasing the cache and retrying once when it does not
    /// fit.
    pub fn malloc(
        &mut self,
        requested: u64,
        stream: u64,
        capacity: Option<u64>,
        new_segment_at: &mut dyn FnMut(u64) -> u64,
    ) -> Result<Placement, Refused> {
        let rounded = self.settings.round(requested);
        if self.settings.expandable_segments {
            return self.malloc_expandable(rounded, stream, capacity);
        }
        if let Some(addr) = self.find_free(rounded, stream) {
            let size = self.take(addr, rounded).unwrap_or(rounded);
            return Ok(Placement { addr, size, new_segment: None });
        }
        let seg = segment_size(rounded);
        if let (Some(g), Some(cap)) = (self.settings.garbage_collection_threshold, capacity)
            && self.reserved as f64 > g * cap as f64
        {
            self.collect_garbage((g * cap as f64) as u64);
        }
        let fits = |a: &Allocator| capacity.is_none_or(|c| a.reserved + seg <= c);
        // As PyTorch: a new segment; else release oversize cached blocks
        // (with max_split_size) and try again; else release every cached
        // segment and try again; else out of memory.
        if !fits(self) && !(self.release_available(rounded, stream) && fits(self)) {
            self.release_cache();
            if !fits(self) {
                return Err(Refused::OutOfMemory { reserved: self.reserved, segment: seg });
            }
        }
        let addr = new_segment_at(seg);
        self.add_segment(addr, seg, stream, rounded <= SMALL_SIZE);
        let size = self.take(addr, rounded).unwrap_or(rounded);
        Ok(Placement { addr, size, new_segment: Some(seg) })
    }

    /// The largest free block, in either pool.
    pub fn largest_free(&self) -> u64 {
        self.free_small.iter().chain(&self.free_large).map(|k| k.1).max().unwrap_or(0)
    }

    /// Whether the segment starting at `addr` is in the small pool.
    pub fn segment_is_small(&self, addr: u64) -> Option<bool> {
        self.segments.get(&addr).map(|s| s.small)
    }

    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A device that hands out segments one after the other from `start`.
    fn bump(start: u64) -> impl FnMut(u64) -> u64 {
        let mut next = start;
        move |size| {
            let at = next;
            next += size;
            at
        }
    }

    #[test]
    fn rounding_follows_pytorch() {
        let s = Settings::default();
        assert_eq!((s.round(1), s.round(512), s.round(513), s.round(5000)), (512, 512, 1024, 5120));
        let mut p = Settings::default();
        p.apply("roundup_power2_divisions:4").unwrap();
        // 1200 MiB lies in [1024, 2048) MiB, four divisions of 256 MiB.
        assert_eq!(p.round(1200 * MIB), 1280 * MIB);
        assert_eq!(p.round(1024 * MIB), 1024 * MIB);
        assert_eq!(p.round(1000), 1024, "a request below 512·4 B is rounded to 512 B");
    }

    #[test]
    fn segment_sizes() {
        assert_eq!(segment_size(512), 2 * MIB);
        assert_eq!(segment_size(SMALL_SIZE + 512), 20 * MIB);
        assert_eq!(segment_size(10 * MIB), 10 * MIB);
        assert_eq!(segment_size(11 * MIB + 1), 12 * MIB);
    }

    #[test]
    fn best_fit_split_and_merge() {
        let mut a = Allocator::new(Settings::default());
        let mut dev = bump(0x1000_0000);
        let x = a.malloc(3 * MIB, 0, None, &mut dev).unwrap();
        assert_eq!(x.new_segment, Some(20 * MIB));
        let y = a.malloc(3 * MIB, 0, None, &mut dev).unwrap();
        assert_eq!((y.addr, y.new_segment), (x.addr + 3 * MIB, None), "the rest of the segment, low end first");
        // A remainder of exactly 1 MiB is not split off in the large pool.
        let z = a.malloc(13 * MIB, 0, None, &mut dev).unwrap();
        assert_eq!((z.addr, z.size), (y.addr + 3 * MIB, 14 * MIB));
        a.free(y.addr).unwrap();
        a.free(x.addr).unwrap();
        // x and y merged: a 6 MiB hole at the segment's start.
        assert_eq!(a.find_free(6 * MIB, 0), Some(x.addr));
        a.free(z.addr).unwrap();
        assert_eq!(a.release_cache(), 20 * MIB);
        assert_eq!((a.reserved, a.allocated), (0, 0));
    }

    #[test]
    fn max_split_size_keeps_oversize_blocks_whole() {
        let mut s = Settings::default();
        s.apply("max_split_size_mb:64").unwrap();
        let mut a = Allocator::new(s);
        a.add_segment(0, 100 * MIB, 0, false);
        assert_eq!(a.find_free(4 * MIB, 0), None, "a small request never takes an oversize block");
        assert_eq!(a.find_free(90 * MIB, 0), Some(0));
        assert_eq!(a.find_free(70 * MIB, 0), None, "it would waste 30 MiB ≥ 20 MiB");
        assert!(Settings::default().apply("max_split_size_mb:10").is_err());
        assert!(Settings::default().apply("nonsense:1").unwrap_err().contains("unknown key"));
    }

    #[test]
    fn expandable_segments_grow_where_plain_segments_are_stuck() {
        // A 30 MiB block freed, a small long-lived 4 MiB block split from
        // it, then 40 MiB, on a 60 MiB device.
        let run = |expandable: bool| {
            let mut s = Settings::default();
            if expandable {
                s.apply("expandable_segments:True").unwrap();
            }
            let mut a = Allocator::new(s);
            let mut dev = bump(0);
            let cap = Some(60 * MIB);
            let x = a.malloc(30 * MIB, 0, cap, &mut dev).unwrap();
            a.free(x.addr).unwrap();
            let small = a.malloc(4 * MIB, 0, cap, &mut dev).unwrap();
            assert_eq!(small.addr, x.addr, "best fit: the freed block's low end");
            (a.malloc(40 * MIB, 0, cap, &mut dev), a.reserved, x.addr)
        };
        // Plain: the 30 MiB segment holds the 4 MiB block, so it cannot be
        // released, and 30 + 40 MiB exceed the device.
        assert!(run(false).0.is_err());
        // Expandable: the range grows from its free tail; 20 MiB pages,
        // 60 MiB mapped in all.
        let (got, reserved, base) = run(true);
        let p = got.unwrap();
        assert_eq!((p.addr, p.size, reserved), (base + 4 * MIB, 40 * MIB, 60 * MIB));
    }

    #[test]
    fn expandable_requests_reuse_plain_segments_without_mapping_them_again() {
        // The recorded state before the trace has plain segments; a
        // scenario with expandable segments serves a request from their
        // free space without reserving it a second time.
        let mut s = Settings::default();
        s.apply("expandable_segments:True").unwrap();
        let mut a = Allocator::new(s);
        a.add_segment(1 << 30, 40 * MIB, 0, false);
        assert!(a.take_exact(1 << 30, 10 * MIB));
        let mut dev = bump(0);
        let p = a.malloc(25 * MIB, 0, Some(60 * MIB), &mut dev).unwrap();
        assert_eq!((p.addr, p.new_segment, a.reserved), ((1 << 30) + 10 * MIB, None, 40 * MIB));
        // Only what does not fit grows the range: 20 MiB pages.
        let q = a.malloc(15 * MIB, 0, Some(60 * MIB), &mut dev).unwrap();
        assert_eq!((q.new_segment, a.reserved), (Some(20 * MIB), 60 * MIB));
        a.free(p.addr).unwrap();
        a.free(q.addr).unwrap();
        assert_eq!(a.release_cache(), 20 * MIB, "the range's page is unmapped, the plain segment still holds a block");
        assert_eq!(a.reserved, 40 * MIB);
    }

    #[test]
    fn idle_pages_are_the_mapped_pages_no_allocated_block_touches() {
        // Random requests and frees of mixed sizes on two streams, on a
        // device small enough to fail some: after every step the pages kept
        // idle equal those a walk over every block finds.
        let mut s = Settings::default();
        s.apply("expandable_segments:True").unwrap();
        let mut a = Allocator::new(s);
        let mut dev = bump(0);
        let mut live: Vec<u64> = Vec::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rand = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let (mut served, mut failed) = (0, 0);
        for _ in 0..3000 {
            if live.is_empty() || rand(3) != 0 {
                let size = if rand(2) == 0 { 1 + rand(MIB) } else { MIB + rand(60 * MIB) };
                match a.malloc(size, rand(2), Some(600 * MIB), &mut dev) {
                    Ok(p) => {
                        live.push(p.addr);
                        served += 1;
                    }
                    Err(_) => failed += 1,
                }
            } else {
                let i = rand(live.len() as u64) as usize;
                a.free(live.swap_remove(i)).unwrap();
            }
            let mut used = BTreeSet::new();
            for (&addr, b) in a.blocks.iter().filter(|(_, b)| b.allocated) {
                let page = Allocator::page(b.small);
                let mut p = addr / page * page;
                while p < addr + b.size {
                    used.insert(p);
                    p += page;
                }
            }
            let idle: BTreeSet<u64> = a.mapped.keys().filter(|p| !used.contains(p)).copied().collect();
            assert_eq!(idle, a.idle_pages);
        }
        assert!(served > 1000 && failed > 10, "{served} served, {failed} failed");
    }

    #[test]
    fn out_of_memory_releases_the_cache_first() {
        let mut a = Allocator::new(Settings::default());
        let mut dev = bump(0);
        let cap = Some(40 * MIB);
        let x = a.malloc(12 * MIB, 0, cap, &mut dev).unwrap();
        a.free(x.addr);
        // 12 MiB cached + 30 MiB would exceed 40 MiB: the cache goes first.
        let y = a.malloc(30 * MIB, 0, cap, &mut dev).unwrap();
        assert_eq!((a.reserved, y.new_segment), (30 * MIB, Some(30 * MIB)));
        assert!(matches!(a.malloc(12 * MIB, 0, cap, &mut dev), Err(Refused::OutOfMemory { .. })));
    }
}
