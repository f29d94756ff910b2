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

mod expandable;

pub use crate::import::settings::{LARGE_BUFFER, MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE, Settings};

pub use crate::import::settings::{MIN_LARGE_ALLOC, ROUND_LARGE};

/// The bit of a stream key that marks a private pool (a `MemPool`, or a
/// CUDA graph's): the import gives such blocks the key
/// `PRIVATE_POOL | pool index << 40 | stream` ([`private_stream`]), so the
/// model keeps them apart as PyTorch keeps a private pool's blocks, and
/// never releases their segments when it releases its cache (PyTorch
/// frees a private pool only once nothing uses it, which a trace does not
/// show).
pub const PRIVATE_POOL: u64 = 1 << 63;

/// The stream key of `stream` in private pool `index` (1, 2, …).
pub fn private_stream(stream: u64, index: u64) -> u64 {
    PRIVATE_POOL | (index << 40) | (stream & ((1 << 40) - 1))
}

/// A stream key's CUDA stream and private pool index (None: the default
/// pool).
pub fn split_stream(key: u64) -> (u64, Option<u64>) {
    let stream = key & ((1 << 40) - 1);
    if is_private(key) { (stream, Some((key & !PRIVATE_POOL) >> 40)) } else { (stream, None) }
}

/// Whether a stream key is of a private pool.
pub fn is_private(stream: u64) -> bool {
    stream & PRIVATE_POOL != 0
}

/// The size of a new segment for a rounded request under PyTorch's
/// default settings ([`Settings::segment_size`]).
pub fn segment_size(rounded: u64) -> u64 {
    Settings::default().segment_size(rounded)
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
    /// Requests that found the device full and released cached memory to
    /// make room (each release a `cudaFree` that synchronizes the device).
    pub flushes: u64,
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

/// Whether a free block is split for a rounded request (the rest stays
/// free), as PyTorch's `should_split`.
fn splits(settings: &Settings, block: &Block, rounded: u64) -> bool {
    let rest = block.size - rounded;
    if block.small || settings.expandable_segments {
        rest >= MIN_BLOCK
    } else {
        settings.max_split_size.is_none_or(|m| rounded < m) && rest > SMALL_SIZE
    }
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
            if rounded >= max && size >= rounded + self.settings.non_split_rounding() {
                return None;
            }
        }
        Some(addr)
    }

    fn should_split(&self, block: &Block, rounded: u64) -> bool {
        splits(&self.settings, block, rounded)
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
        // The block is changed in place and the rest inserted after it: the
        // replay's most frequent step, in four tree operations.
        let e = self.blocks.get_mut(&addr).filter(|b| b.mapped && !b.allocated)?;
        let b = *e;
        let split = splits(&self.settings, &b, rounded);
        let size = if split { rounded } else { b.size };
        (e.size, e.allocated) = (size, true);
        let pool = if b.small { &mut self.free_small } else { &mut self.free_large };
        pool.remove(&(b.stream, b.size, addr));
        if split {
            pool.insert((b.stream, b.size - rounded, addr + rounded));
            self.blocks.insert(addr + rounded, Block { size: b.size - rounded, ..b });
        }
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
        self.allocated -= b.size;
        self.clock += 1;
        // Merged with its free neighbours in the segment, as
        // `insert_mapped` does, but in place: the replay's second most
        // frequent step.
        let (mut start, mut size) = (addr, b.size);
        let pool = if b.small { &mut self.free_small } else { &mut self.free_large };
        let end = addr + b.size;
        if let Some(n) = self.blocks.get(&end).copied().filter(|n| n.segment == b.segment && !n.allocated && n.mapped) {
            pool.remove(&(n.stream, n.size, end));
            self.blocks.remove(&end);
            size += n.size;
        }
        let prev = self
            .blocks
            .range_mut(..addr)
            .next_back()
            .filter(|(p, pb)| pb.segment == b.segment && **p + pb.size == addr && !pb.allocated && pb.mapped);
        if let Some((&p, pb)) = prev {
            pool.remove(&(pb.stream, pb.size, p));
            pb.size += size;
            (start, size) = (p, pb.size);
            self.blocks.remove(&addr);
        } else if let Some(e) = self.blocks.get_mut(&addr) {
            (e.size, e.allocated) = (size, false);
        }
        pool.insert((b.stream, size, start));
        // Only a block that now starts its segment can be all of it: the
        // segment is looked up for those alone.
        if start == b.segment
            && let Some(s) = self.segments.get_mut(&b.segment)
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
                let free: Vec<u64> = pool
                    .iter()
                    .filter(|k| !is_private(k.0))
                    .map(|k| k.2)
                    .filter(|a| self.in_range(&self.blocks[a]))
                    .collect();
                for addr in free {
                    unmapped += self.unmap_block(addr);
                }
            }
        }
        let whole: Vec<u64> = self
            .segments
            .iter()
            .filter(|(a, s)| {
                !is_private(s.stream) && self.blocks.get(a).is_some_and(|b| !b.allocated && b.size == s.size)
            })
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
            .filter(|(a, s)| {
                !is_private(s.stream) && self.blocks.get(a).is_some_and(|b| !b.allocated && b.size == s.size)
            })
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
        let seg = self.settings.segment_size(rounded);
        if let (Some(g), Some(cap)) = (self.settings.collects_garbage(), capacity)
            && self.reserved as f64 > g * cap as f64
        {
            self.collect_garbage((g * cap as f64) as u64);
        }
        let fits = |a: &Allocator| capacity.is_none_or(|c| a.reserved + seg <= c);
        // As PyTorch: a new segment; else release oversize cached blocks
        // (with max_split_size) and try again; else release every cached
        // segment and try again; else out of memory.
        if !fits(self) {
            self.flushes += 1;
        }
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
mod tests;
