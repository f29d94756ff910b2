//! Expandable segments (`expandable_segments:True`): per stream and pool
//! one virtual range of 9/8 of the device's memory, mapped and unmapped in
//! pages (2 MiB small, 20 MiB large) as blocks need them; a request takes
//! room at the end of the mapped part, and the cache release unmaps whole
//! free pages. The rest of the allocator is in [`super`].

use super::{Allocator, Block, Placement, Range, Refused, SMALL_BUFFER, SMALL_SIZE};

impl Allocator {
    /// The page size of an expandable range: 2 MiB (small pool), the
    /// large segment size (20 MiB unless `large_segment_size_mb`).
    pub(super) fn page(&self, small: bool) -> u64 {
        if small { SMALL_BUFFER } else { self.settings.large_segment() }
    }

    /// The virtual size of a new expandable range: 9/8 of the device's
    /// memory in whole pages, as PyTorch reserves; 1 TiB when the capacity
    /// is unknown.
    pub fn range_span(&self, small: bool, capacity: Option<u64>) -> u64 {
        let page = self.page(small);
        capacity.map_or(1 << 40, |c| c + c / 8).div_ceil(page) * page
    }

    /// Ends the expandable range that reaches over `addr` there, when all
    /// it has from `addr` on is its unmapped tail (ranges never overlap
    /// other memory). False when something else lies there.
    pub(super) fn cut_range_at(&mut self, addr: u64) -> bool {
        let Some((&base, &r)) = self.ranges.range(..=addr).next_back() else { return true };
        if base + r.size <= addr {
            return true;
        }
        // The range keeps whole pages.
        let page = self.page(r.small);
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
    pub(super) fn add_range(&mut self, base: u64, span: u64, stream: u64, small: bool) -> bool {
        if !self.cut_range_at(base) || !self.is_vacant(base, 1) {
            return false;
        }
        let page = self.page(small);
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
    pub(super) fn find_expandable_block(
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
        let span = self.range_span(small, capacity);
        let base = new_range_at(span);
        self.add_range(base, span, stream, small).then_some(base)
    }

    /// `map_block`: maps the pages covering the first `size` bytes of the
    /// unmapped block at `addr` (the rest stays unmapped) and merges them
    /// with free mapped neighbours. False when the device has no room.
    pub(super) fn map_block(&mut self, addr: u64, size: u64, capacity: Option<u64>) -> bool {
        let Some(b) = self.blocks.get(&addr).copied().filter(|b| !b.mapped && !b.allocated) else { return false };
        let Some(r) = self.ranges.get(&b.segment).copied() else { return false };
        let page = self.page(r.small);
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
    pub(super) fn map_in(&mut self, start: u64, b: Block, addr: u64, size: u64) {
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
    pub(super) fn merged(&mut self, addr: u64, size: u64, like: Block, mapped: bool) -> (u64, u64) {
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
    pub(super) fn insert_mapped(&mut self, addr: u64, size: u64, like: Block) -> (u64, u64) {
        let (start, len) = self.merged(addr, size, like, true);
        self.insert_free(start, Block { size: len, mapped: true, allocated: false, ..like });
        (start, len)
    }

    /// Inserts [addr, addr + size) as an unmapped block of `like`'s range,
    /// merged with unmapped neighbours; a range left wholly unmapped is
    /// released (`release_expandable_segment`).
    pub(super) fn insert_unmapped(&mut self, addr: u64, size: u64, like: Block) {
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
    pub(super) fn unmap_block(&mut self, addr: u64) -> u64 {
        let Some(b) = self.blocks.get(&addr).copied().filter(|b| b.mapped && !b.allocated) else { return 0 };
        let Some(r) = self.ranges.get(&b.segment).copied() else { return 0 };
        let page = self.page(r.small);
        let first = b.segment + (addr - b.segment).div_ceil(page) * page;
        let last = b.segment + (addr + b.size - b.segment) / page * page;
        if first >= last {
            return 0;
        }
        self.unmap_exact(first, last - first)
    }

    /// Takes the free block `b` at `start` out, leaving free (mapped or
    /// not, as it was) what lies before `addr` and after `addr + size`.
    pub(super) fn carve(&mut self, start: u64, b: Block, addr: u64, size: u64) {
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
                if !self.add_range(addr, self.range_span(small, capacity), stream, small) {
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
    pub(super) fn try_allocate_expandable(
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
    pub(super) fn malloc_expandable(
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
        self.flushes += u64::from(found.is_none());
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
}
