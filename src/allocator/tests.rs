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
        let page = a.page(r.small);
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

/// PyTorch 2.6's `max_non_split_rounding_mb`: an oversize request takes a
/// cached block up to that much larger (20 MiB without it).
#[test]
fn max_non_split_rounding_lets_an_oversize_request_take_a_larger_block() {
    let mut s = Settings::default();
    s.apply("max_split_size_mb:64").unwrap();
    s.apply("max_non_split_rounding_mb:40").unwrap();
    let mut a = Allocator::new(s);
    assert!(a.add_segment(0, 100 * MIB, 0, false));
    assert_eq!(a.find_free(70 * MIB, 0), Some(0), "30 MiB wasted < 40 MiB");
    assert_eq!(a.find_free(60 * MIB - 1024, 0), None, "below max_split_size: never an oversize block");
    let mut dev = bump(1 << 30);
    let p = a.malloc(70 * MIB, 0, None, &mut dev).unwrap();
    assert_eq!((p.addr, p.size, p.new_segment), (0, 100 * MIB, None), "kept whole, not split");
    // Below the large segment size PyTorch refuses it.
    let e = Settings::default().apply("max_non_split_rounding_mb:10").unwrap_err();
    assert!(e.contains("at least 20 (MiB)"), "{e}");
    assert!(Settings::default().apply("max_split_size_mb:20").is_ok(), "PyTorch takes 20 (≥ kLargeBuffer)");
}

/// PyTorch 2.11's `large_segment_size_mb`: the segment of a large request
/// under 10 MiB and the large pool's expandable page.
#[test]
fn large_segment_size_sets_medium_segments_and_large_pages() {
    let mut s = Settings::default();
    s.apply("large_segment_size_mb:64").unwrap();
    assert_eq!((s.segment_size(2 * MIB), s.segment_size(512), s.segment_size(11 * MIB)), (64 * MIB, 2 * MIB, 12 * MIB));
    assert_eq!(s.non_split_rounding(), 64 * MIB, "its default follows");
    let mut a = Allocator::new(s.clone());
    let mut dev = bump(0);
    let p = a.malloc(3 * MIB, 0, None, &mut dev).unwrap();
    assert_eq!(p.new_segment, Some(64 * MIB));
    s.apply("expandable_segments:True").unwrap();
    let a = Allocator::new(s);
    assert_eq!(a.page(false), 64 * MIB);
    assert!(Settings::default().apply("large_segment_size_mb:10").is_err());
    // max_split_size_mb may not be below it.
    let mut t = Settings::default();
    t.apply("large_segment_size_mb:64").unwrap();
    assert!(t.apply("max_split_size_mb:32").unwrap_err().contains("at least 64"));
}

/// Keys of 2.12–2.15 that move no block are accepted and named; a key
/// PyTorch does not know is refused, naming it; another backend is not
/// this model.
#[test]
fn keys_without_effect_are_named_and_unknown_ones_refused() {
    let mut s = Settings::default();
    for e in ["pinned_use_cuda_host_register:True", "throw_on_cudamalloc_oom:True", "backend:native"] {
        s.apply(e).unwrap();
    }
    assert_eq!(s.inert.len(), 3);
    assert_eq!(
        s.conf_entries(),
        ["pinned_use_cuda_host_register:True", "throw_on_cudamalloc_oom:True", "backend:native"]
    );
    let mut a = Allocator::new(s);
    let mut dev = bump(0);
    assert_eq!(a.malloc(3 * MIB, 0, None, &mut dev).unwrap().new_segment, Some(20 * MIB), "as the defaults");
    let e = Settings::default().apply("expandable_segment:True").unwrap_err();
    assert!(e.contains("unknown key `expandable_segment`"), "{e}");
    let e = Settings::default().apply("backend:cudaMallocAsync").unwrap_err();
    assert!(e.contains("another allocator"), "{e}");
}

/// `roundup_power2_divisions:[…]` as PyTorch parses the list, and the
/// conf split at commas outside brackets.
#[test]
fn a_divisions_list_parses_as_pytorch_parses_it() {
    let mut s = Settings::default();
    let conf = "roundup_power2_divisions:[64:8,256:4,>:1], max_split_size_mb:128";
    let entries: Vec<&str> = crate::import::settings::split_conf(conf).collect();
    assert_eq!(entries, ["roundup_power2_divisions:[64:8,256:4,>:1]", "max_split_size_mb:128"]);
    for e in entries {
        s.apply(e).unwrap();
    }
    // Index i: the interval from 2^i MiB. 64 = index 6 (and all below),
    // 256 = index 8 (7 keeps 0); `>` then fills from the last interval
    // named on, that one included (`std::fill(begin + last_index, end)`
    // in AllocatorConfig.cpp), so 256's 4 becomes 1.
    let mut want = vec![8u64; 7];
    want.push(0);
    want.extend([1; 8]);
    assert_eq!(s.roundup_power2_divisions, want);
    assert!(Settings::default().apply("roundup_power2_divisions:[48:8]").is_err());
}

/// A private pool's free segment stays when the cache is released
/// (PyTorch frees a private pool only once nothing uses it), and its
/// blocks serve only its own requests.
#[test]
fn private_pools_keep_their_segments_and_their_blocks() {
    let mut a = Allocator::new(Settings::default());
    let private = private_stream(0, 1);
    assert!(a.add_segment(0, 20 * MIB, private, false));
    assert!(a.add_segment(1 << 30, 20 * MIB, 0, false));
    assert_eq!(a.find_free(6 * MIB, 0), Some(1 << 30), "the default pool's own segment");
    assert_eq!(a.find_free(6 * MIB, private), Some(0));
    assert_eq!(a.release_cache(), 20 * MIB, "only the default pool's segment");
    assert_eq!(a.find_free(6 * MIB, private), Some(0));
    assert_eq!(split_stream(private_stream(7, 3)), (7, Some(3)));
    assert_eq!(split_stream(7), (7, None));
}
