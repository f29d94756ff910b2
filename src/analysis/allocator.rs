//! A model of PyTorch's CUDA caching allocator (`CUDACachingAllocator.cpp`,
//! the native allocator of PyTorch 2.4–2.5; the expandable-segment code
//! was read at two commits of that era, eb42ad6 and 001074d), for
//! replaying a recorded request stream under other settings. Checked
//! against real PyTorch 2.11 runs on an H100 (`tests/it/outcomes.rs`: 18
//! runs under six settings, every one exact). What 2.11 changed that the
//! model follows: the settings moved to `c10/core/AllocatorConfig` with the
//! same rounding, and garbage collection runs only under a memory
//! fraction below 1 (`allowed_memory_maximum`).
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
//! - **`garbage_collection_threshold`**: only under a per-process memory
//!   fraction below 1 (`torch.cuda.set_per_process_memory_fraction`, as
//!   PyTorch 2.11 calls `garbage_collect_cached_blocks` only with an
//!   `allowed_memory_maximum`, which a fraction of 1 does not set; real
//!   runs under the threshold alone reserved exactly what the defaults
//!   did): before asking for a segment, when reserved memory exceeds the
//!   threshold × the allowed memory, whole free segments are released,
//!   oldest first, until reserved is below it.
//! - **Per-process memory fraction** F: the allocator may hold at most
//!   F × the capacity (the scenario replays on a device that small).
//!
//! - **Expandable segments** (`expandable_segments:True`), as PyTorch:
//!   - A virtual range per stream and pool (`ExpandableSegment`), 9/8 of
//!     the capacity in pages of 2 MiB (small pool) or 20 MiB (large pool),
//!     its blocks tiling it: allocated, free and mapped, or unmapped.
//!   - Best fit among the free mapped blocks, then on to the next larger
//!     one while it could grow less (its size plus an unmapped block right
//!     after it).
//!   - Else `find_expandable_block`: the lowest-addressed unmapped block of
//!     the stream's pool, with a free block just before it, that has room
//!     for the request through free and unmapped blocks; else a new range.
//!     The pages covering what is needed are mapped (`map_block`, one
//!     `segment_map` each, merged with free mapped neighbours), then more
//!     after it until the block is large enough. Pages mapped before a
//!     mapping fails stay mapped.
//!   - A rest of ≥ 512 B is split off in either pool.
//!   - Freed blocks merge only with mapped free neighbours and stay
//!     mapped; releasing the cache (`release_blocks`: large pool, then
//!     small, in pool order) unmaps the whole pages inside every free
//!     block, and a range left wholly unmapped is dropped.
//!   - Out of memory: release the cache, retry, fail.
//!   - Garbage collection and `release_available_cached_blocks` touch only
//!     plain segments (PyTorch asserts that `release_block` never sees an
//!     expandable one).
//!   - Without a capacity a new range spans 1 TiB. Following a recording,
//!     a range starts at its first mapping and ends where other memory
//!     begins.
//!
//! Not modelled: CUDA graph pools, pending
//! `record_stream` events (a block is reusable at its `free_completed`),
//! and the exact ages PyTorch's garbage collection weighs (it releases
//! unsplit large blocks whose age is at least the average; this model
//! releases whole free segments, least recently freed first). Rounding
//! follows PyTorch ≥ 2.4 (`roundup_power2_divisions` of 1 means plain
//! 512 B rounding).

use std::collections::{BTreeMap, BTreeSet};

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
    /// Start of its segment, or of its expandable range.
    segment: u64,
    /// False for the unmapped stretches of an expandable range.
    mapped: bool,
}

/// An expandable segment's virtual range (`ExpandableSegment`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Range {
    size: u64,
    stream: u64,
    small: bool,
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
    /// Expandable segments: the virtual ranges by start. Their blocks tile
    /// them: allocated, free and mapped, or unmapped.
    ranges: BTreeMap<u64, Range>,
    /// The unmapped blocks of the ranges, per pool, by (stream, address):
    /// PyTorch's `BlockPool::unmapped`.
    unmapped_small: BTreeSet<(u64, u64)>,
    unmapped_large: BTreeSet<(u64, u64)>,
    /// Bytes mapped so far (to tell what one request mapped).
    mapped_total: u64,
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

    fn unmapped_set(&mut self, small: bool) -> &mut BTreeSet<(u64, u64)> {
        if small { &mut self.unmapped_small } else { &mut self.unmapped_large }
    }

    /// A free block: mapped ones go to their pool, unmapped ones to the
    /// pool's unmapped set.
    fn insert_free(&mut self, addr: u64, b: Block) {
        self.blocks.insert(addr, Block { allocated: false, ..b });
        if b.mapped {
            self.pool(b.small).insert((b.stream, b.size, addr));
        } else {
            self.unmapped_set(b.small).insert((b.stream, addr));
        }
    }

    fn remove_free(&mut self, addr: u64) -> Option<Block> {
        let b = *self.blocks.get(&addr)?;
        if b.allocated {
            return None;
        }
        if b.mapped {
            self.pool(b.small).remove(&(b.stream, b.size, addr));
        } else {
            self.unmapped_set(b.small).remove(&(b.stream, addr));
        }
        self.blocks.remove(&addr);
        Some(b)
    }

    /// The block just before `addr` in the same segment or range.
    fn prev_block(&self, addr: u64, segment: u64) -> Option<(u64, Block)> {
        let (&p, &pb) = self.blocks.range(..addr).next_back()?;
        (pb.segment == segment && p + pb.size == addr).then_some((p, pb))
    }

    /// The block starting at `addr` when it is in `segment`.
    fn block_at(&self, addr: u64, segment: u64) -> Option<Block> {
        self.blocks.get(&addr).copied().filter(|b| b.segment == segment)
    }

    /// Whether a block belongs to an expandable range.
    fn in_range(&self, b: &Block) -> bool {
        self.ranges.contains_key(&b.segment)
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

    /// Adds a plain segment at `addr`, all free. False (and nothing added)
    /// when it is empty or overlaps memory the model holds.
    pub fn add_segment(&mut self, addr: u64, size: u64, stream: u64, small: bool) -> bool {
        if size == 0 || !self.cut_range_at(addr) || !self.is_vacant(addr, size) {
            return false;
        }
        self.note(crate::trace::event::EventKind::SegmentAlloc, addr, size);
        self.segments.insert(addr, Segment { size, stream, small, freed_at: self.clock });
        self.reserved += size;
        self.insert_free(addr, Block { size, stream, allocated: false, small, segment: addr, mapped: true });
        true
    }

    /// Whether no block the model holds overlaps [addr, addr + size).
    fn is_vacant(&self, addr: u64, size: u64) -> bool {
        let end = addr.saturating_add(size);
        self.blocks.range(addr..end).next().is_none()
            && self.blocks.range(..addr).next_back().is_none_or(|(&a, b)| a.saturating_add(b.size) <= addr)
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
        let mut candidates = pool.range((stream, rounded, 0)..);
        let &(s, mut size, mut addr) = candidates.next()?;
        if s != stream {
            return None;
        }
        // In an expandable range, best fit weighs a block by what it can
        // grow to (an unmapped block after it counts): the next larger
        // block is taken while it can grow less.
        if self.settings.expandable_segments {
            let growable = |size: u64, addr: u64| {
                let b = self.blocks[&addr];
                size + self.block_at(addr + size, b.segment).filter(|n| !n.mapped).map_or(0, |n| n.size)
            };
            while self.in_range(&self.blocks[&addr]) {
                match candidates.next() {
                    Some(&(s, next_size, next)) if s == stream && growable(next_size, next) < growable(size, addr) => {
                        (size, addr) = (next_size, next);
                    }
                    _ => break,
                }
            }
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
        let b = Block {
            size: segment,
            stream: 0,
            allocated: false,
            small: rounded <= SMALL_SIZE,
            segment: 0,
            mapped: true,
        };
        if self.should_split(&b, rounded) { rounded } else { segment }
    }

    /// Takes the free block at `addr` for a rounded request: the low end,
    /// the rest stays free when the split rules allow. Returns the block's
    /// size.
    pub fn take(&mut self, addr: u64, rounded: u64) -> Option<u64> {
        if !self.blocks.get(&addr)?.mapped {
            return None;
        }
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
        Some(size)
    }

    /// Places `addr` (an exact block the recording had) inside a free
    /// block: for building the initial state and following a recording.
    /// False when no free block covers it.
    pub fn take_exact(&mut self, addr: u64, size: u64) -> bool {
        let Some((&start, &b)) = self.blocks.range(..=addr).next_back() else { return false };
        if size == 0 || b.allocated || !b.mapped || addr.saturating_add(size) > start + b.size {
            return false;
        }
        self.carve(start, b, addr, size);
        self.blocks.insert(addr, Block { size, allocated: true, ..b });
        self.allocated += size;
        self.clock += 1;
        true
    }

    /// Frees the allocated block at `addr`, merging it with free
    /// neighbours in its segment. Returns its size.
    pub fn free(&mut self, addr: u64) -> Option<u64> {
        let b = *self.blocks.get(&addr).filter(|b| b.allocated)?;
        self.blocks.remove(&addr);
        self.allocated -= b.size;
        self.clock += 1;
        let (start, size) = self.insert_mapped(addr, b.size, b);
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
        // Expandable ranges: every free block's whole pages are unmapped
        // (`release_blocks`, large pool then small, each in pool order);
        // then every entirely free plain segment.
        let mut unmapped = 0;
        if !self.ranges.is_empty() {
            for small in [false, true] {
                let pool = if small { &self.free_small } else { &self.free_large };
                let free: Vec<u64> = pool.iter().map(|k| k.2).filter(|a| self.in_range(&self.blocks[a])).collect();
                for addr in free {
                    unmapped += self.unmap_block(addr);
                }
            }
        }
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

    /// The virtual size of a new expandable range: 9/8 of the device's
    /// memory in whole pages, as PyTorch reserves; 1 TiB when the capacity
    /// is unknown.
    pub fn range_span(small: bool, capacity: Option<u64>) -> u64 {
        let page = Self::page(small);
        capacity.map_or(1 << 40, |c| c + c / 8).div_ceil(page) * page
    }

    /// Ends the expandable range that reaches over `addr` there, when all
    /// it has from `addr` on is its unmapped tail (ranges never overlap
    /// other memory). False when something else lies there.
    fn cut_range_at(&mut self, addr: u64) -> bool {
        let Some((&base, &r)) = self.ranges.range(..=addr).next_back() else { return true };
        if base + r.size <= addr {
            return true;
        }
        // The range keeps whole pages.
        let page = Self::page(r.small);
        let end = base + (addr - base) / page * page;
        let Some((&t, &tb)) = self.blocks.range(..=addr).next_back() else { return false };
        if tb.mapped || tb.allocated || tb.segment != base || t + tb.size != base + r.size || t > end {
            return false;
        }
        self.remove_free(t);
        if t < end {
            self.insert_free(t, Block { size: end - t, ..tb });
        }
        if end == base {
            self.ranges.remove(&base);
        } else {
            self.ranges.insert(base, Range { size: end - base, ..r });
        }
        true
    }

    /// Starts an expandable range at `base`, all unmapped, ending at the
    /// next memory the model holds if that comes before `span`.
    fn add_range(&mut self, base: u64, span: u64, stream: u64, small: bool) -> bool {
        if !self.cut_range_at(base) || !self.is_vacant(base, 1) {
            return false;
        }
        let page = Self::page(small);
        let span = span.min((u64::MAX - base) / page * page);
        let size = self.blocks.range(base..).next().map_or(span, |(&a, _)| span.min((a - base) / page * page));
        if size == 0 {
            return false;
        }
        self.ranges.insert(base, Range { size, stream, small });
        self.insert_free(base, Block { size, stream, allocated: false, small, segment: base, mapped: false });
        true
    }

    /// `find_expandable_block`: the lowest unmapped block of the stream's
    /// pool (with the free block before it, if any) that has `size` bytes
    /// of free or unmapped space from its start; else a new range from
    /// `new_range_at`. Returns the start of that space.
    fn find_expandable_block(
        &mut self,
        stream: u64,
        small: bool,
        size: u64,
        capacity: Option<u64>,
        new_range_at: &mut dyn FnMut(u64) -> u64,
    ) -> Option<u64> {
        let mut from = (stream, 0);
        loop {
            let set = if small { &self.unmapped_small } else { &self.unmapped_large };
            let Some(&(s, c)) = set.range(from..).next() else { break };
            if s != stream {
                break;
            }
            let Some(next) = c.checked_add(1) else { break };
            from = (stream, next);
            let segment = self.blocks[&c].segment;
            let start = match self.prev_block(c, segment) {
                Some((p, pb)) if !pb.allocated => p,
                _ => c,
            };
            let (mut bytes, mut at) = (0, start);
            while bytes < size {
                match self.block_at(at, segment) {
                    Some(b) if !b.allocated && b.size > 0 => {
                        bytes += b.size;
                        at += b.size;
                    }
                    _ => break,
                }
            }
            if bytes >= size {
                return Some(start);
            }
        }
        let span = Self::range_span(small, capacity);
        let base = new_range_at(span);
        self.add_range(base, span, stream, small).then_some(base)
    }

    /// `map_block`: maps the pages covering the first `size` bytes of the
    /// unmapped block at `addr` (the rest stays unmapped) and merges them
    /// with free mapped neighbours. False when the device has no room.
    fn map_block(&mut self, addr: u64, size: u64, capacity: Option<u64>) -> bool {
        let Some(b) = self.blocks.get(&addr).copied().filter(|b| !b.mapped && !b.allocated) else { return false };
        let Some(r) = self.ranges.get(&b.segment).copied() else { return false };
        let page = Self::page(r.small);
        let end = (b.segment + (addr + size - b.segment).div_ceil(page) * page).min(addr + b.size);
        let bytes = end - addr;
        if capacity.is_some_and(|c| self.reserved + bytes > c) {
            return false;
        }
        self.map_in(addr, b, addr, bytes);
        true
    }

    /// Maps [addr, addr + size) of the unmapped block `b` at `start`: the
    /// rest of `b` stays unmapped, the mapped stretch merges with free
    /// mapped neighbours, and a `segment_map` is noted.
    fn map_in(&mut self, start: u64, b: Block, addr: u64, size: u64) {
        self.carve(start, b, addr, size);
        self.insert_mapped(addr, size, b);
        self.reserved += size;
        self.mapped_total += size;
        self.note(crate::trace::event::EventKind::SegmentMap, addr, size);
    }

    /// Merges [addr, addr + size) with the free neighbours in `like`'s
    /// segment or range that are `mapped` as it is (PyTorch's
    /// `try_merge_blocks`: mapped with mapped, unmapped with unmapped),
    /// and returns the merged block's start and size, not yet inserted.
    fn merged(&mut self, addr: u64, size: u64, like: Block, mapped: bool) -> (u64, u64) {
        let (mut start, mut len) = (addr, size);
        if let Some((p, pb)) = self.prev_block(addr, like.segment)
            && !pb.allocated
            && pb.mapped == mapped
        {
            self.remove_free(p);
            start = p;
            len += pb.size;
        }
        if let Some(nb) = self.block_at(addr + size, like.segment)
            && !nb.allocated
            && nb.mapped == mapped
        {
            self.remove_free(addr + size);
            len += nb.size;
        }
        (start, len)
    }

    /// Inserts [addr, addr + size) as a free mapped block of `like`'s
    /// segment or range, merged with free mapped neighbours; returns the
    /// merged block's start and size.
    fn insert_mapped(&mut self, addr: u64, size: u64, like: Block) -> (u64, u64) {
        let (start, len) = self.merged(addr, size, like, true);
        self.insert_free(start, Block { size: len, mapped: true, allocated: false, ..like });
        (start, len)
    }

    /// Inserts [addr, addr + size) as an unmapped block of `like`'s range,
    /// merged with unmapped neighbours; a range left wholly unmapped is
    /// released (`release_expandable_segment`).
    fn insert_unmapped(&mut self, addr: u64, size: u64, like: Block) {
        let (start, len) = self.merged(addr, size, like, false);
        if self.ranges.get(&like.segment).is_some_and(|r| start == like.segment && len == r.size) {
            self.ranges.remove(&like.segment);
            self.blocks.remove(&start);
        } else {
            self.insert_free(start, Block { size: len, mapped: false, ..like });
        }
    }

    /// `unmap_block`: unmaps the whole pages inside the free mapped block
    /// at `addr`; the ends stay free and mapped. Returns the bytes unmapped.
    fn unmap_block(&mut self, addr: u64) -> u64 {
        let Some(b) = self.blocks.get(&addr).copied().filter(|b| b.mapped && !b.allocated) else { return 0 };
        let Some(r) = self.ranges.get(&b.segment).copied() else { return 0 };
        let page = Self::page(r.small);
        let first = b.segment + (addr - b.segment).div_ceil(page) * page;
        let last = b.segment + (addr + b.size - b.segment) / page * page;
        if first >= last {
            return 0;
        }
        self.unmap_exact(first, last - first)
    }

    /// Takes the free block `b` at `start` out, leaving free (mapped or
    /// not, as it was) what lies before `addr` and after `addr + size`.
    fn carve(&mut self, start: u64, b: Block, addr: u64, size: u64) {
        self.remove_free(start);
        if start < addr {
            self.insert_free(start, Block { size: addr - start, ..b });
        }
        let end = start + b.size;
        if addr + size < end {
            self.insert_free(addr + size, Block { size: end - addr - size, ..b });
        }
    }

    /// Unmaps [addr, addr + size), which a free mapped block of a range
    /// covers. Returns the bytes unmapped (0 when no such block covers it).
    pub fn unmap_exact(&mut self, addr: u64, size: u64) -> u64 {
        let Some((&start, &b)) = self.blocks.range(..=addr).next_back() else { return 0 };
        if size == 0 || b.allocated || !b.mapped || !self.in_range(&b) || addr.saturating_add(size) > start + b.size {
            return 0;
        }
        self.carve(start, b, addr, size);
        self.insert_unmapped(addr, size, b);
        self.reserved -= size;
        self.note(crate::trace::event::EventKind::SegmentUnmap, addr, size);
        size
    }

    /// Maps [addr, addr + size) as the recording did: inside an unmapped
    /// block of a range of the stream's pool, else as the start of a new
    /// range there (ending the unmapped tail of another range that reached
    /// over it). False when that cannot be done.
    pub fn map_exact(&mut self, addr: u64, size: u64, stream: u64, small: bool, capacity: Option<u64>) -> bool {
        if size == 0 {
            return false;
        }
        let covering = self
            .blocks
            .range(..=addr)
            .next_back()
            .filter(|(a, b)| **a + b.size > addr)
            .map(|(a, b)| (*a, *b))
            .filter(|(_, b)| self.ranges.get(&b.segment).is_some_and(|r| r.stream == stream && r.small == small));
        let (start, b) = match covering {
            Some(c) => c,
            None => {
                if !self.add_range(addr, Self::range_span(small, capacity), stream, small) {
                    return false;
                }
                (addr, self.blocks[&addr])
            }
        };
        if b.mapped || b.allocated || addr.saturating_add(size) > start + b.size {
            return false;
        }
        self.map_in(start, b, addr, size);
        true
    }

    /// The pool of the stream's expandable range that holds `addr`, if
    /// the model has one.
    pub fn range_pool_at(&self, addr: u64, stream: u64) -> Option<bool> {
        let (&base, r) = self.ranges.range(..=addr).next_back()?;
        (base + r.size > addr && r.stream == stream).then_some(r.small)
    }

    /// `try_allocate_expandable_block`: finds room (see
    /// [`Allocator::find_expandable_block`]) and maps what of it is
    /// unmapped, up to `size` bytes. Returns the free block's start. Pages
    /// mapped before a later mapping fails stay mapped, as in PyTorch.
    fn try_allocate_expandable(
        &mut self,
        size: u64,
        stream: u64,
        small: bool,
        capacity: Option<u64>,
        new_range_at: &mut dyn FnMut(u64) -> u64,
    ) -> Option<u64> {
        let c = self.find_expandable_block(stream, small, size, capacity, new_range_at)?;
        let mut candidate = c;
        let b = self.blocks[&c];
        if !b.mapped {
            if !self.map_block(c, b.size.min(size), capacity) {
                return None;
            }
            // Merged with a free block before it, if any.
            candidate = *self.blocks.range(..=c).next_back()?.0;
        }
        loop {
            let b = self.blocks[&candidate];
            if b.size >= size {
                return Some(candidate);
            }
            let next = candidate + b.size;
            let nb = self.block_at(next, b.segment).filter(|n| !n.mapped)?;
            if !self.map_block(next, (size - b.size).min(nb.size), capacity) {
                return None;
            }
        }
    }

    /// A request with expandable segments (PyTorch's `malloc` with
    /// `expandable_segments:True`): a free block by best fit, else map
    /// pages of the stream's range; when the device is full, release the
    /// cache (unmapping every free page) and try once more.
    fn malloc_expandable(
        &mut self,
        rounded: u64,
        stream: u64,
        capacity: Option<u64>,
        new_range_at: &mut dyn FnMut(u64) -> u64,
    ) -> Result<Placement, Refused> {
        let small = rounded <= SMALL_SIZE;
        if let Some(addr) = self.find_free(rounded, stream) {
            let size = self.take(addr, rounded).unwrap_or(rounded);
            return Ok(Placement { addr, size, new_segment: None });
        }
        if let (Some(g), Some(cap)) = (self.settings.collects_garbage(), capacity)
            && self.reserved as f64 > g * cap as f64
        {
            self.collect_garbage((g * cap as f64) as u64);
        }
        let before = self.mapped_total;
        let mut found = self.try_allocate_expandable(rounded, stream, small, capacity, new_range_at);
        if found.is_none() && self.release_available(rounded, stream) {
            found = self.try_allocate_expandable(rounded, stream, small, capacity, new_range_at);
        }
        if found.is_none() {
            self.release_cache();
            found = self.try_allocate_expandable(rounded, stream, small, capacity, new_range_at);
        }
        let Some(addr) = found else {
            return Err(Refused::OutOfMemory { reserved: self.reserved, segment: rounded });
        };
        let size = self.take(addr, rounded).unwrap_or(rounded);
        let mapped = self.mapped_total - before;
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
            return self.malloc_expandable(rounded, stream, capacity, new_segment_at);
        }
        if let Some(addr) = self.find_free(rounded, stream) {
            let size = self.take(addr, rounded).unwrap_or(rounded);
            return Ok(Placement { addr, size, new_segment: None });
        }
        let seg = segment_size(rounded);
        if let (Some(g), Some(cap)) = (self.settings.collects_garbage(), capacity)
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
        if !self.add_segment(addr, seg, stream, rounded <= SMALL_SIZE) {
            // The device gave memory the model holds: cannot happen with
            // the fresh addresses of a scenario.
            return Err(Refused::OutOfMemory { reserved: self.reserved, segment: seg });
        }
        let size = self.take(addr, rounded).unwrap_or(rounded);
        Ok(Placement { addr, size, new_segment: Some(seg) })
    }

    /// The end of the highest memory the model holds (ranges included).
    pub fn top(&self) -> u64 {
        self.blocks.last_key_value().map_or(0, |(&a, b)| a.saturating_add(b.size))
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
        assert!(a.add_segment(0, 100 * MIB, 0, false));
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
        assert!(a.add_segment(1 << 30, 40 * MIB, 0, false));
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

    /// The invariants of expandable ranges, checked by a walk over every
    /// block.
    fn check_ranges(a: &Allocator) {
        let mut mapped = 0;
        for (&base, r) in &a.ranges {
            let page = Allocator::page(r.small);
            let (mut at, mut last): (u64, Option<Block>) = (base, None);
            for (&addr, b) in a.blocks.range(base..base + r.size) {
                assert_eq!(addr, at, "the blocks of a range tile it");
                assert_eq!((b.segment, b.stream, b.small), (base, r.stream, r.small));
                if !b.mapped {
                    assert!(!b.allocated);
                    assert!((addr - base) % page == 0 && b.size % page == 0, "unmapped blocks are whole pages");
                    assert!(a.unmapped_set_of(b.small).contains(&(b.stream, addr)));
                } else {
                    mapped += b.size;
                    assert_eq!(!b.allocated, a.pool_of(b.small).contains(&(b.stream, b.size, addr)));
                }
                if let Some(l) = last {
                    assert!(l.allocated || b.allocated || l.mapped != b.mapped, "free neighbours of one kind merge");
                }
                last = Some(*b);
                at += b.size;
            }
            assert_eq!(at, base + r.size);
        }
        let plain: u64 = a.segments.values().map(|s| s.size).sum();
        assert_eq!(a.reserved, mapped + plain);
        let allocated: u64 = a.blocks.values().filter(|b| b.allocated).map(|b| b.size).sum();
        assert_eq!(a.allocated, allocated);
        let free = a.blocks.values().filter(|b| !b.allocated && b.mapped).count();
        assert_eq!(free, a.free_small.len() + a.free_large.len());
        assert_eq!(a.blocks.values().filter(|b| !b.mapped).count(), a.unmapped_small.len() + a.unmapped_large.len());
    }

    impl Allocator {
        fn pool_of(&self, small: bool) -> &BTreeSet<(u64, u64, u64)> {
            if small { &self.free_small } else { &self.free_large }
        }
        fn unmapped_set_of(&self, small: bool) -> &BTreeSet<(u64, u64)> {
            if small { &self.unmapped_small } else { &self.unmapped_large }
        }
    }

    #[test]
    fn expandable_ranges_keep_their_invariants() {
        // Random requests and frees of mixed sizes on two streams, cache
        // releases now and then, on a device small enough to fail some.
        let mut s = Settings::default();
        s.apply("expandable_segments:True").unwrap();
        let mut a = Allocator::new(s);
        let mut dev = bump(1 << 40);
        let mut live: Vec<u64> = Vec::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rand = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let (mut served, mut failed, mut released) = (0, 0, 0);
        for _ in 0..3000 {
            if rand(50) == 0 {
                released += a.release_cache();
            } else if live.is_empty() || rand(3) != 0 {
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
            check_ranges(&a);
        }
        assert!(served > 1000 && failed > 10 && released > 0, "{served} served, {failed} failed");
        for addr in live {
            a.free(addr).unwrap();
        }
        a.release_cache();
        check_ranges(&a);
        assert_eq!((a.reserved, a.ranges.len()), (0, 0), "everything unmapped, every range dropped");
    }

    #[test]
    fn expandable_best_fit_prefers_blocks_that_cannot_grow() {
        let mut s = Settings::default();
        s.apply("expandable_segments:True").unwrap();
        let mut a = Allocator::new(s);
        let mut dev = bump(1 << 40);
        let x = a.malloc(6 * MIB, 0, None, &mut dev).unwrap();
        assert_eq!((x.new_segment, a.reserved), (Some(20 * MIB), 20 * MIB), "one 20 MiB page");
        let base = x.addr;
        let y = a.malloc(10 * MIB, 0, None, &mut dev).unwrap();
        assert_eq!((y.addr, y.new_segment), (base + 6 * MIB, None));
        a.free(x.addr).unwrap();
        // Free: 6 MiB at the start, 4 MiB at the end of the page with the
        // unmapped rest of the range after it. Best fit by size would take
        // the 4 MiB block; PyTorch walks on to the 6 MiB one, which cannot
        // grow.
        let z = a.malloc(3 * MIB, 0, None, &mut dev).unwrap();
        assert_eq!(z.addr, base);
        // 30 MiB: no free block fits. The free 4 MiB tail and the unmapped
        // block after it have room; 26 MiB more are needed, so two pages
        // (40 MiB) are mapped, and the block starts at the tail.
        let w = a.malloc(30 * MIB, 0, None, &mut dev).unwrap();
        assert_eq!((w.addr, w.new_segment, a.reserved), (base + 16 * MIB, Some(40 * MIB), 60 * MIB));
        check_ranges(&a);
        // Freed, the merged block [16, 60) MiB is unmapped from 20 MiB on;
        // the 4 MiB before that page boundary stay mapped.
        a.free(w.addr).unwrap();
        assert_eq!(a.release_cache(), 40 * MIB);
        assert_eq!(a.reserved, 20 * MIB);
        check_ranges(&a);
    }

    #[test]
    fn empty_or_overlapping_memory_is_refused() {
        // A corrupt snapshot can carry mappings, unmappings or segments of
        // size 0, or overlapping ones: refused, so that no block of size 0
        // (on which the search for room would never advance) gets in.
        let mut s = Settings::default();
        s.apply("expandable_segments:True").unwrap();
        let mut a = Allocator::new(s);
        assert!(!a.map_exact(1 << 40, 0, 0, false, None));
        assert!(a.map_exact(1 << 40, 20 * MIB, 0, false, None));
        assert!(!a.map_exact((1 << 40) + 20 * MIB, 0, 0, false, None));
        assert_eq!(a.unmap_exact(1 << 40, 0), 0);
        assert!(!a.take_exact(1 << 40, 0));
        assert!(!a.add_segment(1 << 41, 0, 0, false));
        assert!(!a.add_segment((1 << 40) + 4 * MIB, 40 * MIB, 0, false), "inside the range");
        assert!(a.add_segment(1 << 30, 40 * MIB, 0, false));
        assert!(!a.add_segment((1 << 30) + 20 * MIB, 40 * MIB, 0, false), "over a segment");
        check_ranges(&a);
        // Requests are still served.
        let mut dev = bump(1 << 42);
        let p = a.malloc(30 * MIB, 0, None, &mut dev).unwrap();
        assert_eq!(p.addr, 1 << 30, "the plain segment's free block fits best");
        let q = a.malloc(60 * MIB, 0, None, &mut dev).unwrap();
        assert_eq!(q.addr, 1 << 40, "the range grows from its free start");
        check_ranges(&a);
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
