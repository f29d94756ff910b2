use super::fidelity::*;
use super::simulate::*;
use super::stream::*;
use super::*;
use crate::allocator::Settings;
use crate::trace::event::{Event, EventKind};

const MIB: u64 = 1 << 20;

fn req(kind: EventKind, addr: u64, size: u64, requested: u64) -> Req {
    Req { ts_ns: 0, kind, addr, size, requested, stream: 0, device_free: None }
}

/// Ten 30 MiB blocks freed into the cache, then ten of 50 MiB, which
/// cannot reuse them: garbage collection releases the cached ones, but
/// only under a per-process memory fraction, as in PyTorch.
#[test]
fn garbage_collection_acts_only_under_a_memory_fraction() {
    let mut events = Vec::new();
    for i in 0..10 {
        events.push(req(EventKind::BlockAlloc, (i + 1) << 32, 30 * MIB, 30 * MIB));
    }
    for i in 0..10 {
        events.push(req(EventKind::BlockFree, (i + 1) << 32, 30 * MIB, 30 * MIB));
    }
    for i in 0..10 {
        events.push(req(EventKind::BlockAlloc, (i + 20) << 32, 50 * MIB, 50 * MIB));
    }
    let d = DeviceStream { device: 0, initial: 0, requests: Requests::Built(events), ..Default::default() };
    let peak = |entries: &[&str]| {
        let mut s = Settings::default();
        for e in entries {
            s.apply(e).unwrap();
        }
        simulate(&d, &s, Some(1 << 30), "s", &[]).peak_reserved_bytes
    };
    let plain = peak(&[]);
    assert_eq!(plain, 800 * MIB);
    assert_eq!(peak(&["garbage_collection_threshold:0.3"]), plain);
    // A fraction of 1 sets no limit, and no collection (PyTorch 2.11).
    assert_eq!(peak(&["garbage_collection_threshold:0.3", "per_process_memory_fraction:1.0"]), plain);
    let collected = peak(&["garbage_collection_threshold:0.3", "per_process_memory_fraction:0.99"]);
    assert!(collected < plain, "{collected}");
    // A fraction alone is a smaller device: 0.45 GiB, where the 500 MiB
    // of the second ten does not fit even with the cache released.
    let mut s = Settings::default();
    s.apply("per_process_memory_fraction:0.45").unwrap();
    assert!(simulate(&d, &s, Some(1 << 30), "s", &[]).ooms > 0);
    s.apply("per_process_memory_fraction:0.5").unwrap();
    assert_eq!(simulate(&d, &s, Some(1 << 30), "s", &[]).ooms, 0);
    let note = settings_note(
        &{
            let mut s = Settings::default();
            s.apply("garbage_collection_threshold:0.3").unwrap();
            s
        },
        true,
    );
    assert!(note.is_some_and(|n| n.contains("only under a per-process memory fraction")));
}

#[test]
fn pristine_memory_shrinks_as_the_trace_allocates_in_it() {
    let mut p = Pristine { ranges: [(100, 200), (300, 400)].into_iter().collect() };
    assert!(p.overlaps(150, 160) && p.overlaps(50, 101) && !p.overlaps(200, 300));
    p.reveal(120, 130);
    assert_eq!(p.ranges.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(), vec![(100, 120), (130, 200), (300, 400)]);
    assert!(!p.overlaps(120, 130));
    p.reveal(150, 350);
    assert_eq!(p.ranges.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(), vec![(100, 120), (130, 150), (350, 400)]);
}

/// Twenty cached segments released by the allocator right before the
/// 90 MiB one it needed room for: the device was full then. The
/// program's own empty_cache() says nothing about the capacity.
#[test]
fn cache_flushes_bound_the_capacity() {
    let mut events = Vec::new();
    for i in 0..20 {
        events.push(req(EventKind::SegmentAlloc, (i + 1) << 32, 26 * MIB, 0));
    }
    for i in 0..20 {
        events.push(req(EventKind::SegmentFree, (i + 1) << 32, 26 * MIB, 0));
    }
    events.push(req(EventKind::SegmentAlloc, 40 << 32, 90 * MIB, 0));
    events.push(req(EventKind::BlockAlloc, 40 << 32, 90 * MIB, 90 * MIB));
    let mut d = DeviceStream { device: 0, initial: 0, requests: Requests::Built(events), ..Default::default() };
    let settings = Settings::default();
    // A stack without `empty_cache`: the allocator's.
    let mut callers = vec![Caller::Elsewhere; d.len()];
    d.releases = classify_releases(&d, &callers, true, &settings);
    assert_eq!(d.releases.values().collect::<Vec<_>>(), [&Release::Retry]);
    let f = find_flushes(&d);
    assert_eq!((f.count, f.segments_freed, f.bytes_freed, f.at_least), (1, 20, 520 * MIB, false));
    assert_eq!(f.capacity, Some((520 * MIB, 610 * MIB - 1)));
    // No Python stack (autograd's backward thread) in a trace that has
    // stacks elsewhere: the allocator's too.
    d.releases = classify_releases(&d, &vec![Caller::Unknown; d.len()], true, &settings);
    assert_eq!(find_flushes(&d).count, 1);
    // The program's `empty_cache()`: no retry, no capacity.
    callers[25] = Caller::EmptyCache;
    d.releases = classify_releases(&d, &callers, true, &settings);
    let program = find_flushes(&d);
    assert_eq!((program.count, program.capacity), (0, None));
    // With garbage collection on, a release before a new segment is the
    // collection's; with `max_split_size_mb` at or below every segment freed,
    // a release of the oversize blocks alone.
    let mut gc = Settings::default();
    gc.apply("garbage_collection_threshold:0.6").unwrap();
    d.releases = classify_releases(&d, &vec![Caller::Elsewhere; d.len()], true, &gc);
    let f = find_flushes(&d);
    assert_eq!((f.count, f.gc_releases, f.capacity), (0, 1, None));
    let mut split = Settings::default();
    split.apply("max_split_size_mb:24").unwrap();
    d.releases = classify_releases(&d, &vec![Caller::Elsewhere; d.len()], true, &split);
    let f = find_flushes(&d);
    assert_eq!((f.count, f.oversize_releases), (0, 1));
    // No stacks anywhere: who released cannot be told.
    d.releases = classify_releases(&d, &vec![Caller::Unknown; d.len()], false, &settings);
    let f = find_flushes(&d);
    assert_eq!((f.count, f.at_least), (0, true));
}

/// An OOM comes after a retry that released the whole cache; where the
/// cache held nothing to release, the retry shows in no entry and is
/// counted from the OOM.
#[test]
fn every_oom_counts_one_retry() {
    let mut events = vec![
        req(EventKind::SegmentAlloc, 1 << 32, 20 * MIB, 0),
        req(EventKind::BlockAlloc, 1 << 32, 20 * MIB, 20 * MIB),
        req(EventKind::Oom, 0, 0, 90 * MIB),
    ];
    let mut d = DeviceStream { device: 0, initial: 0, requests: Requests::Built(events.clone()), ..Default::default() };
    d.releases = classify_releases(&d, &[Caller::Elsewhere; 3], true, &Settings::default());
    assert_eq!(find_flushes(&d).count, 1);
    // A release right before the OOM is the same retry, not a second one.
    events.insert(2, req(EventKind::SegmentAlloc, 2 << 32, 20 * MIB, 0));
    events.insert(3, req(EventKind::SegmentFree, 2 << 32, 20 * MIB, 0));
    let mut d = DeviceStream { device: 0, initial: 0, requests: Requests::Built(events), ..Default::default() };
    d.releases = classify_releases(&d, &[Caller::Elsewhere; 5], true, &Settings::default());
    assert_eq!(find_flushes(&d).count, 1);
}

/// A recorded `garbage_collection_threshold` does nothing without a memory
/// fraction below 1, so a recommendation does not advise it again; with
/// such a fraction it stays. A scenario that sets it keeps it.
#[test]
fn an_inert_recorded_garbage_collection_is_not_advised_again() {
    let recorded = ["garbage_collection_threshold:0.8".to_string()];
    let expandable = ["expandable_segments:True".to_string()];
    assert_eq!(conf_line(&recorded, &expandable), "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True");
    let with_fraction = ["expandable_segments:True".to_string(), "per_process_memory_fraction:0.9".to_string()];
    assert_eq!(
        conf_line(&recorded, &with_fraction),
        "PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.8,expandable_segments:True and torch.cuda.set_per_process_memory_fraction(0.9)"
    );
    let only_gc = ["garbage_collection_threshold:0.6".to_string()];
    assert_eq!(conf_line(&[], &only_gc), "PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.6");
}

/// `KEY:default` puts back PyTorch's default for that key: the recorded
/// settings without it. The advised line leaves it out, and a line with
/// nothing left is the defaults.
#[test]
fn a_recorded_entry_can_be_left_out() {
    let mut s = Settings::default();
    s.apply("max_split_size_mb:128").unwrap();
    s.apply("roundup_power2_divisions:4").unwrap();
    s.apply("max_split_size_mb:default").unwrap();
    s.apply("roundup_power2_divisions:default").unwrap();
    assert_eq!(s, Settings::default());
    assert!(s.apply("nonsense:default").is_err());
    let recorded = ["max_split_size_mb:128".to_string()];
    let without = ["max_split_size_mb:default".to_string()];
    assert_eq!(conf_line(&recorded, &without), "PyTorch's default settings (no PYTORCH_CUDA_ALLOC_CONF)");
    let both = ["expandable_segments:True".to_string(), "max_split_size_mb:default".to_string()];
    assert_eq!(conf_line(&recorded, &both), "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True");
    // The sweep tries the recording without each rounding or split
    // threshold it ran with, alone and under expandable segments.
    let mut rec = Settings::default();
    rec.apply("max_split_size_mb:128").unwrap();
    let sweep = default_sweep(&[], &rec, None, None);
    assert!(sweep.contains(&without.to_vec()) && sweep.contains(&both.to_vec()), "{sweep:?}");
}

/// `max_split_size_mb` with expandable segments follows the same code as
/// each alone, but no real run checked the pair: its rows say so.
#[test]
fn the_unchecked_pair_of_settings_is_noted() {
    let mut s = Settings::default();
    s.apply("expandable_segments:True").unwrap();
    assert_eq!(settings_note(&s, true), None);
    s.apply("max_split_size_mb:32").unwrap();
    assert!(settings_note(&s, true).is_some_and(|n| n.contains("no real run has checked")));
}

#[test]
fn a_fraction_is_advised_as_the_python_call_beside_the_environment_line() {
    let conf = ["garbage_collection_threshold:0.8".to_string(), "per_process_memory_fraction:1.0".to_string()];
    assert_eq!(
        conf_line(&["expandable_segments:True".to_string()], &conf),
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,garbage_collection_threshold:0.8 and torch.cuda.set_per_process_memory_fraction(1.0)"
    );
    assert_eq!(conf_line(&[], &conf[1..]), "torch.cuda.set_per_process_memory_fraction(1.0)");
    let mut s = Settings::default();
    for bad in ["per_process_memory_fraction:0", "per_process_memory_fraction:1.5", "per_process_memory_fraction:x"] {
        assert!(s.apply(bad).is_err(), "{bad}");
    }
}

/// A recording the model reproduces: a segment, two blocks in it, a
/// free and a reuse of the hole.
#[test]
fn a_faithful_recording_matches_everywhere() {
    let base = 1 << 40;
    let d = DeviceStream {
        device: 0,
        initial: 0,
        requests: Requests::Built(vec![
            req(EventKind::SegmentAlloc, base, 20 * MIB, 0),
            req(EventKind::BlockAlloc, base, 4 * MIB, 4 * MIB),
            req(EventKind::BlockAlloc, base + 4 * MIB, 3 * MIB, 3 * MIB - 100),
            req(EventKind::BlockFree, base, 4 * MIB, 4 * MIB),
            req(EventKind::BlockAlloc, base, 2 * MIB, 2 * MIB),
        ]),
        flushes: Flushes::default(),
        releases: Default::default(),
        ..Default::default()
    };
    let f = fidelity(&d, &Settings::default());
    assert_eq!((f.allocations, f.same_address, f.same_size), (3, 3, 3), "{f:?}");
    assert_eq!((f.segments_requested, f.segments_same_size, f.desynchronised), (1, 1, 0));
    // A block placed elsewhere than the model would is reported.
    let mut other = d.clone();
    other.built()[4].addr = base + 7 * MIB;
    let f = fidelity(&other, &Settings::default());
    assert_eq!((f.same_address, f.first_mismatches.len()), (2, 1));
    assert_eq!(f.first_mismatches[0].model_addr, Some(base));
}

/// The same with expandable segments: pages mapped in a range, blocks
/// in them; a wrong mapping and a wrong block are both reported.
#[test]
fn an_expandable_recording_is_checked_page_by_page() {
    let base = 1 << 40;
    let mut s = Settings::default();
    s.apply("expandable_segments:True").unwrap();
    let d = DeviceStream {
        device: 0,
        initial: 0,
        requests: Requests::Built(vec![
            req(EventKind::SegmentMap, base, 20 * MIB, 0),
            req(EventKind::BlockAlloc, base, 12 * MIB, 12 * MIB),
            // 12 MiB more: the free 8 MiB at the end and one more page.
            req(EventKind::SegmentMap, base + 20 * MIB, 20 * MIB, 0),
            req(EventKind::BlockAlloc, base + 12 * MIB, 12 * MIB, 12 * MIB),
            // Freed, then the cache released: the whole page inside
            // the free [12, 40) MiB is unmapped.
            req(EventKind::BlockFree, base + 12 * MIB, 12 * MIB, 12 * MIB),
            req(EventKind::SegmentUnmap, base + 20 * MIB, 20 * MIB, 0),
            req(EventKind::BlockAlloc, base + 12 * MIB, 2 * MIB, 2 * MIB),
        ]),
        flushes: Flushes::default(),
        releases: Default::default(),
        ..Default::default()
    };
    let f = fidelity(&d, &s);
    assert!(f.not_measured.is_none(), "{f:?}");
    assert_eq!((f.allocations, f.same_address, f.same_size), (3, 3, 3), "{f:?}");
    assert_eq!((f.segments_requested, f.segments_same_size, f.desynchronised), (2, 2, 0), "{f:?}");
    // PyTorch mapping two pages where the model maps one.
    let mut other = d.clone();
    other.built()[2].size = 40 * MIB;
    let f = fidelity(&other, &s);
    assert_eq!((f.segments_requested, f.segments_same_size, f.same_address), (2, 1, 3), "{f:?}");
    // A block placed elsewhere than the model would.
    let mut other = d.clone();
    other.built()[6].addr = base + 14 * MIB;
    let f = fidelity(&other, &s);
    assert_eq!((f.same_address, f.first_mismatches.len()), (2, 1), "{f:?}");
    assert_eq!(f.first_mismatches[0].model_addr, Some(base + 12 * MIB));
    // An unmapping of pages that are not free cannot be followed.
    let mut other = d.clone();
    other.built()[5].addr = base;
    assert_eq!(fidelity(&other, &s).desynchronised, 1, "a page a live block holds");
    // A corrupt recording: an empty mapping is not followed (and the
    // model's search for room does not hang on it).
    let mut other = d.clone();
    other.built().insert(2, req(EventKind::SegmentMap, base + 20 * MIB, 0, 0));
    let f = fidelity(&other, &s);
    assert!(f.desynchronised >= 1 && f.allocations == 3, "{f:?}");
}

/// A scenario's fresh addresses lie above the ranges of the recorded
/// state: a range that grows far does not meet a new one, and nothing
/// is released for want of an address.
#[test]
fn new_ranges_do_not_collide_with_recorded_ones() {
    let base = 1 << 40;
    let mut s = Settings::default();
    s.apply("expandable_segments:True").unwrap();
    let mut on_stream_1 = req(EventKind::BlockAlloc, base + 4 * MIB, 2 * MIB, 2 * MIB);
    on_stream_1.stream = 1;
    // The recording's addresses end near `base` (its blocks were
    // small); the scenario asks for 3 GiB on stream 0.
    let d = DeviceStream {
        device: 0,
        initial: 1,
        requests: Requests::Built(vec![
            req(EventKind::SegmentMap, base, 20 * MIB, 0),
            req(EventKind::BlockAlloc, base, 2 * MIB, 3 << 30),
            req(EventKind::BlockFree, base, 2 * MIB, 3 << 30),
            on_stream_1,
        ]),
        flushes: Flushes::default(),
        releases: Default::default(),
        ..Default::default()
    };
    let mut kinds = Vec::new();
    let mut sink = |e: Event| kinds.push(e.kind);
    let o = simulate_into(&d, &s, None, "recorded", &[], Some(&mut sink));
    assert_eq!(o.ooms, 0);
    assert!(!kinds.contains(&EventKind::SegmentUnmap), "{kinds:?}");
    assert_eq!(
        o.peak_reserved_bytes,
        3100 * MIB,
        "3 GiB in 20 MiB pages (the first one recorded), then one page on stream 1"
    );
}

#[test]
fn the_capacity_is_read_off_the_first_oom() {
    let base = 1 << 40;
    let mut oom = req(EventKind::Oom, 0, 0, 30 * MIB);
    oom.device_free = Some(12 * MIB);
    let mut later = oom;
    later.device_free = Some(1);
    let d = DeviceStream {
        device: 0,
        initial: 1,
        requests: Requests::Built(vec![
            req(EventKind::SegmentAlloc, base, 20 * MIB, 0),
            req(EventKind::SegmentMap, base + 40 * MIB, 40 * MIB, 0),
            req(EventKind::SegmentUnmap, base + 60 * MIB, 20 * MIB, 0),
            oom,
            later,
        ]),
        flushes: Flushes::default(),
        releases: Default::default(),
        ..Default::default()
    };
    // 20 + 40 − 20 MiB reserved, 12 MiB free.
    assert_eq!(inferred_capacity(&d), Some(52 * MIB));
    // What the fidelity replay finds there too.
    assert_eq!(fidelity(&d, &Settings::default()).inferred_capacity, None, "a plain recording with a mapping");
    let plain = DeviceStream { requests: Requests::Built(vec![d.at(0), d.at(3)]), ..d.clone() };
    assert_eq!(fidelity(&plain, &Settings::default()).inferred_capacity, inferred_capacity(&plain));
}

#[test]
fn scenarios_count_segments_peaks_and_ooms() {
    let base = 1 << 40;
    let mut events = Vec::new();
    // Alternating 30 MiB and 1 MiB+ requests, the large ones freed.
    for i in 0..4u64 {
        events.push(req(EventKind::BlockAlloc, base + i * 100 * MIB, 30 * MIB, 30 * MIB));
        events.push(req(EventKind::BlockAlloc, base + i * 100 * MIB + 50 * MIB, 2 * MIB, 2 * MIB));
        events.push(req(EventKind::BlockFree, base + i * 100 * MIB, 30 * MIB, 30 * MIB));
    }
    let d = DeviceStream { device: 0, initial: 0, requests: Requests::Built(events), ..Default::default() };
    let o = simulate(&d, &Settings::default(), None, "recorded", &[]);
    assert_eq!((o.allocations, o.ooms), (8, 0));
    assert!(o.peak_reserved_bytes >= 50 * MIB && o.peak_allocated_bytes >= 32 * MIB, "{o:?}");
    let tight = simulate(&d, &Settings::default(), Some(40 * MIB), "tight", &[]);
    assert!(tight.ooms > 0 && tight.peak_reserved_bytes <= 40 * MIB, "{tight:?}");
}

#[test]
fn slack_at_peak_is_taken_where_allocated_is_highest() {
    // 8 MiB opens a 20 MiB segment (12 MiB slack), then 6 MiB fits in
    // it: reserved stays at its peak while the slack falls to 6 MiB.
    let base = 1 << 40;
    let events = vec![
        req(EventKind::BlockAlloc, base, 8 * MIB, 8 * MIB),
        req(EventKind::BlockAlloc, base + 8 * MIB, 6 * MIB, 6 * MIB),
        req(EventKind::BlockFree, base, 8 * MIB, 8 * MIB),
        req(EventKind::BlockFree, base + 8 * MIB, 6 * MIB, 6 * MIB),
    ];
    let d = DeviceStream { device: 0, initial: 0, requests: Requests::Built(events), ..Default::default() };
    let o = simulate(&d, &Settings::default(), None, "recorded", &[]);
    assert_eq!((o.peak_reserved_bytes, o.peak_allocated_bytes), (20 * MIB, 14 * MIB));
    assert_eq!(o.reserved_minus_allocated_at_peak, 6 * MIB);
}

/// A request that failed in the recording and that a scenario serves is
/// held for an instant, then freed: it counts in the scenario's peak of
/// allocated memory, and in what reserved held at its peak (it was
/// allocated, not cached). The real varshape run under expandable
/// segments peaked at what the replay gives this way, to the byte.
#[test]
fn a_request_the_recording_failed_counts_where_a_scenario_serves_it() {
    let events = vec![
        req(EventKind::BlockAlloc, 1 << 32, 100 * MIB, 100 * MIB),
        req(EventKind::Oom, 0, 300 * MIB, 300 * MIB),
        req(EventKind::BlockFree, 1 << 32, 100 * MIB, 100 * MIB),
    ];
    let d = DeviceStream { device: 0, initial: 0, requests: Requests::Built(events), ..Default::default() };
    let roomy = simulate(&d, &Settings::default(), Some(1 << 30), "s", &[]);
    assert_eq!(roomy.ooms, 0);
    assert_eq!(roomy.peak_allocated_bytes, 400 * MIB);
    assert_eq!(roomy.peak_reserved_bytes, 400 * MIB);
    assert_eq!(roomy.reserved_minus_allocated_at_peak, 0);
    // Where it fails again, it holds nothing.
    let tight = simulate(&d, &Settings::default(), Some(300 * MIB), "s", &[]);
    assert_eq!((tight.ooms, tight.peak_allocated_bytes), (1, 100 * MIB));
}

/// A scenario over two devices, the OOMs on the second.
fn two_devices(conf: &[&str], reserved: [u64; 2], ooms: [u64; 2]) -> Scenario {
    let conf: Vec<String> = conf.iter().map(|s| s.to_string()).collect();
    let outcome = |j: usize| Outcome {
        peak_reserved_bytes: reserved[j],
        ooms: ooms[j],
        allocations: 10,
        segment_allocs: 3,
        ..Default::default()
    };
    Scenario::of(if conf.is_empty() { "recorded" } else { "s" }, &conf, vec![outcome(0), outcome(1)])
}

/// OOMs compare where each recorded one fell on a device whose capacity is
/// known, though another device has none; between settings exactly as
/// good, the milder wins; a trace whose requests all fit in the cache it
/// began with judges no setting.
#[test]
fn recommendations_judge_what_the_replay_can_show() {
    let rec = two_devices(&[], [8 << 30, 78 << 30], [0, 1]);
    let fix32 = two_devices(&["max_split_size_mb:32"], [9 << 30, 70 << 30], [0, 0]);
    let fix512 = two_devices(&["max_split_size_mb:512"], [9 << 30, 70 << 30], [0, 0]);
    let scenarios = vec![rec.clone(), fix32, fix512];
    let (i, why) = recommend(&scenarios, &[], &[None, Some(79 << 30)], None, None);
    assert_eq!((i, scenarios[i].conf.clone()), (2, vec!["max_split_size_mb:512".to_string()]), "{why}");
    assert!(why.contains("summed over its 2 devices"), "{why}");
    // The OOM on a device without a capacity: nothing to compare.
    let (i, why) = recommend(&scenarios, &[], &[Some(79 << 30), None], None, None);
    assert_eq!(i, 0, "{why}");
    assert!(why.contains("without a capacity"), "{why}");
    let (i, why) = recommend(&scenarios, &[], &[Some(1), Some(1)], None, Some("it holds no allocation to replay"));
    assert_eq!((i, why.as_str()), (0, "it holds no allocation to replay"));
}

/// A segment freed by the program's `empty_cache()` gives its addresses
/// back: the next segment takes the address the recording gave it, even
/// where that reuses the freed range (sqattn, a public snapshot, emptied
/// its cache after each of 28 layers; without this the replay's ties went
/// otherwise and it reserved 392 MiB more than PyTorch did).
#[test]
fn a_freed_segment_s_addresses_are_handed_out_again() {
    let (low, high) = (1u64 << 32, 1u64 << 33);
    let events = vec![
        req(EventKind::SegmentAlloc, high, 20 * MIB, 0),
        req(EventKind::BlockAlloc, high, 20 * MIB, 20 * MIB),
        req(EventKind::BlockFree, high, 20 * MIB, 20 * MIB),
        req(EventKind::SegmentFree, high, 20 * MIB, 0),
        // The driver hands the freed range out again, then a lower one.
        req(EventKind::SegmentAlloc, high, 20 * MIB, 0),
        req(EventKind::BlockAlloc, high, 20 * MIB, 20 * MIB),
        req(EventKind::SegmentAlloc, low, 20 * MIB, 0),
        req(EventKind::BlockAlloc, low, 20 * MIB, 20 * MIB),
    ];
    let d = DeviceStream { device: 0, initial: 0, requests: Requests::Built(events), ..Default::default() };
    let mut segments = Vec::new();
    let mut sink = |e: Event| {
        if e.kind == EventKind::SegmentAlloc {
            segments.push(e.addr);
        }
    };
    let o = simulate_into(&d, &Settings::default(), None, "recorded", &[], Some(&mut sink));
    assert_eq!(segments, vec![high, high, low], "{o:?}");
    assert_eq!((o.segment_allocs, o.peak_reserved_bytes), (3, 40 * MIB));
}

/// `run` judges no setting where every request fit in the cache reserved
/// before the trace (each scenario starts from it), nor where the trace
/// holds no request; a trace that asked a segment is judged.
#[test]
fn run_judges_no_setting_the_trace_cannot_show() {
    let base = 1u64 << 36;
    let cached = vec![
        req(EventKind::SegmentAlloc, base, 20 * MIB, 0),
        req(EventKind::BlockAlloc, base, 4 * MIB, 4 * MIB),
        req(EventKind::BlockFree, base, 4 * MIB, 4 * MIB),
    ];
    let d = DeviceStream { device: 0, initial: 1, requests: Requests::Built(cached.clone()), ..Default::default() };
    let w = run(&[d], &Settings::default(), None, Vec::new(), Source::Snapshot, None).unwrap();
    assert!(w.untestable.as_deref().is_some_and(|why| why.contains("reserved before it began")), "{:?}", w.untestable);
    assert_eq!(w.recommendation(), "none: the settings cannot be judged from this trace");
    let empty =
        DeviceStream { device: 0, initial: 1, requests: Requests::Built(cached[..1].to_vec()), ..Default::default() };
    let w = run(&[empty], &Settings::default(), None, Vec::new(), Source::Snapshot, None).unwrap();
    assert_eq!(w.untestable.as_deref(), Some("it holds no allocation to replay"));
    let mut grew = cached.clone();
    grew.extend([
        req(EventKind::SegmentAlloc, base + (1 << 30), 40 * MIB, 0),
        req(EventKind::BlockAlloc, base + (1 << 30), 40 * MIB, 40 * MIB),
    ]);
    let d = DeviceStream { device: 0, initial: 1, requests: Requests::Built(grew), ..Default::default() };
    let w = run(&[d], &Settings::default(), None, Vec::new(), Source::Snapshot, None).unwrap();
    assert_eq!(w.untestable, None);
}

/// A setting that reserves less only by releasing its cache more often (a
/// device-wide synchronisation each time) is not recommended for the
/// saving; one that removes an OOM is, however often it releases.
#[test]
fn a_saving_bought_with_cache_flushes_is_not_recommended() {
    let one = |conf: &[&str], reserved: u64, ooms: u64, flushes: u64| {
        let conf: Vec<String> = conf.iter().map(|s| s.to_string()).collect();
        let o = Outcome { peak_reserved_bytes: reserved, ooms, flushes, allocations: 10, ..Default::default() };
        Scenario::of(if conf.is_empty() { "recorded" } else { "s" }, &conf, vec![o])
    };
    let cap = [Some(32u64 << 30)];
    let scenarios = vec![
        one(&[], 21 << 30, 0, 1),
        one(&["max_split_size_mb:4096"], 20 << 30, 0, 59),
        one(&["x:1"], 21 << 30, 0, 1),
    ];
    let (i, why) = recommend(&scenarios, &[], &cap, None, None);
    assert_eq!(i, 0, "{why}");
    assert!(why.contains("without releasing its cache more often"), "{why}");
    let scenarios = vec![one(&[], 21 << 30, 2, 1), one(&["max_split_size_mb:4096"], 20 << 30, 0, 59)];
    assert_eq!(recommend(&scenarios, &[], &cap, None, None).0, 1);
    // Every other scenario flushes more: said so, not "no other scenario
    // ran" above a table of them.
    let scenarios = vec![one(&[], 21 << 30, 0, 1), one(&["max_split_size_mb:4096"], 22 << 30, 0, 59)];
    let (i, why) = recommend(&scenarios, &[], &cap, None, None);
    assert_eq!(i, 0);
    assert!(why.starts_with("every other scenario releases its cache more often"), "{why}");
}

/// The sweep's split thresholds stop below the device (a 76 GiB request
/// gave `max_split_size_mb:131072` on an 80 GiB GPU), and garbage
/// collection is tried under a capacity given only: its memory fraction
/// is of the whole device, which an inferred capacity is not.
#[test]
fn the_sweep_fits_the_capacity_it_knows() {
    let events = [100 * MIB, 400 * MIB, 76 << 30]
        .iter()
        .enumerate()
        .map(|(i, &s)| req(EventKind::BlockAlloc, (i as u64 + 1) << 40, s, s))
        .collect();
    let d = [DeviceStream { device: 0, requests: Requests::Built(events), ..Default::default() }];
    let gc = vec!["garbage_collection_threshold:0.8".to_string(), "per_process_memory_fraction:0.99".to_string()];
    let splits = |sweep: &[Vec<String>]| -> Vec<String> {
        sweep.iter().flatten().filter(|c| c.starts_with("max_split_size_mb:")).cloned().collect()
    };
    let free = default_sweep(&d, &Settings::default(), None, None);
    assert!(splits(&free).contains(&"max_split_size_mb:131072".to_string()), "{free:?}");
    assert!(!free.contains(&gc));
    let inferred = default_sweep(&d, &Settings::default(), None, Some(80 << 30));
    assert_eq!(splits(&inferred), ["max_split_size_mb:128", "max_split_size_mb:512"], "{inferred:?}");
    assert!(!inferred.contains(&gc));
    let given = default_sweep(&d, &Settings::default(), Some(80 << 30), Some(80 << 30));
    assert_eq!(splits(&given), splits(&inferred));
    assert!(given.contains(&gc));
}

/// Ten 30 MiB tensors, five of them freed into the cache, then five of
/// 50 MiB: with no budget the cache keeps the freed segments (550 MiB
/// reserved); the smallest budget that fits is what is live at the end,
/// 400 MiB, reached by releasing the cache once; 2 MiB less fails.
#[test]
fn memory_needed_is_the_smallest_budget_that_fits() {
    let mut events = Vec::new();
    for i in 0..10 {
        events.push(req(EventKind::BlockAlloc, (i + 1) << 32, 30 * MIB, 30 * MIB));
    }
    for i in 0..5 {
        events.push(req(EventKind::BlockFree, (i + 1) << 32, 30 * MIB, 30 * MIB));
    }
    for i in 0..5 {
        events.push(req(EventKind::BlockAlloc, (i + 20) << 32, 50 * MIB, 50 * MIB));
    }
    let d = DeviceStream { device: 0, initial: 0, requests: Requests::Built(events), ..Default::default() };
    let n = needed(&d, &Settings::default(), None);
    assert_eq!(n.no_flush_from_bytes, 550 * MIB);
    assert_eq!(n.fits_from_bytes, Some(400 * MIB));
    assert_eq!((n.flushes_at_fits_from, n.precision_bytes), (1, 2 * MIB));
    assert_eq!(n.peak_allocated_bytes, 400 * MIB);
    // The same, given the replay with no budget.
    let free = simulate(&d, &Settings::default(), None, "free", &[]);
    assert_eq!(needed(&d, &Settings::default(), Some((&free, &Default::default()))).fits_from_bytes, Some(400 * MIB));
    // Under expandable segments the freed pages are reused: no release.
    let mut e = Settings::default();
    e.expandable_segments = true;
    let n = needed(&d, &e, None);
    assert_eq!((n.fits_from_bytes, n.flushes_at_fits_from), (Some(400 * MIB), 0));
    assert_eq!(n.no_flush_from_bytes, 400 * MIB);
}

/// Garbage collection's releases bound the budget of a run whose memory
/// fraction the snapshot does not hold: PyTorch collects only when what it
/// reserved exceeds threshold × budget. A release at 200 MiB reserved says
/// the budget is below 200 / 0.5 = 400 MiB; a new segment made at
/// 100 MiB reserved with a wholly free one cached, and no collection,
/// says it is at least 200 MiB; every segment that fit, at least 250 MiB.
/// The recorded settings then replay with collection on, at that budget.
#[test]
fn garbage_collection_bounds_the_budget() {
    let events = vec![
        req(EventKind::SegmentAlloc, 1 << 32, 100 * MIB, 0),
        req(EventKind::BlockAlloc, 1 << 32, 100 * MIB, 100 * MIB),
        req(EventKind::BlockFree, 1 << 32, 100 * MIB, 100 * MIB),
        req(EventKind::SegmentAlloc, 2 << 32, 100 * MIB, 0),
        req(EventKind::BlockAlloc, 2 << 32, 100 * MIB, 100 * MIB),
        req(EventKind::SegmentFree, 1 << 32, 100 * MIB, 0),
        req(EventKind::SegmentAlloc, 3 << 32, 150 * MIB, 0),
        req(EventKind::BlockAlloc, 3 << 32, 150 * MIB, 150 * MIB),
    ];
    let mut d = DeviceStream { device: 0, initial: 0, requests: Requests::Built(events), ..Default::default() };
    let mut gc = Settings::default();
    gc.apply("garbage_collection_threshold:0.5").unwrap();
    d.releases = classify_releases(&d, &vec![Caller::Elsewhere; d.len()], true, &gc);
    d.flushes = find_flushes(&d);
    let f = d.flushes;
    assert_eq!((f.count, f.gc_releases, f.capacity), (0, 1, None));
    assert_eq!((f.gc_reserved_before, f.gc_quiet_max, f.peak_fit), (Some(200 * MIB), 100 * MIB, 250 * MIB));
    assert_eq!(f.gc_budget(0.5), Some((250 * MIB, 400 * MIB - 1)));
    // A threshold the releases contradict gives no budget.
    assert_eq!(f.gc_budget(0.9), None);
    let w =
        run(&[d.clone()], &gc, None, vec![vec!["expandable_segments:True".into()]], Source::Snapshot, None).unwrap();
    assert_eq!(w.flushes[0].1.gc_capacity, Some((250 * MIB, 400 * MIB - 1)));
    assert_eq!(w.capacities, vec![Some(250 * MIB)]);
    assert!(w.capacity_from_collection);
    // Collection is on in the replay: no note says it replays as unset.
    assert!(w.scenarios[0].note.is_none(), "{:?}", w.scenarios[0].note);
    assert!(w.scenarios[0].at_high.is_some());
    // Without a collection, nothing is inferred, and collection stays off.
    let mut quiet = d.clone();
    quiet.releases.clear();
    quiet.flushes = find_flushes(&quiet);
    let w = run(&[quiet], &gc, None, Vec::new(), Source::Snapshot, None).unwrap();
    assert_eq!(w.capacities, vec![None]);
    assert!(w.scenarios[0].note.as_deref().is_some_and(|n| n.contains("only under a per-process memory fraction")));
}

/// A replay under a budget resumed from a checkpoint of the unbounded
/// replay ends as the replay from the start does, at every budget (below
/// the carried-in state, at and around the memory needed, and above the
/// peak), and the memory needed is the same with checkpoints and without.
#[test]
fn a_replay_from_a_checkpoint_ends_as_one_from_the_start() {
    use super::replay::{Checkpoints, replay, replay_from, replay_keeping};
    // Allocations of mixed sizes, two in five of them freed again later:
    // a cache whose reserved memory keeps rising past what is live.
    let mut events = Vec::new();
    let mut live: Vec<u64> = Vec::new();
    let mut x: u64 = 7;
    for i in 0..3000u64 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        if live.len() > 4 && (x >> 33) % 5 < 2 {
            let at = live.swap_remove(((x >> 20) as usize) % live.len());
            events.push(req(EventKind::BlockFree, at, 0, 0));
        } else {
            // Sizes grow through the trace, so freed blocks stay cached
            // unused until a release.
            let size = [MIB / 2, 3 * MIB, 9 * MIB][((x >> 40) % 3) as usize] * (1 + i / 500) + (x >> 50) % MIB;
            events.push(req(EventKind::BlockAlloc, (i + 1) << 32, size, size));
            live.push((i + 1) << 32);
        }
    }
    let d = DeviceStream { device: 0, initial: 0, requests: Requests::Built(events), ..Default::default() };
    let mut split = Settings::default();
    split.max_split_size = Some(8 * MIB);
    for s in [Settings::default(), split] {
        let (free, kept) = replay_keeping(&d, &s, "free", &[]);
        let with = needed(&d, &s, Some((&free, &kept)));
        let without = needed(&d, &s, Some((&free, &Checkpoints::default())));
        assert_eq!(Needed { replays: 0, ..with.clone() }, Needed { replays: 0, ..without });
        let fits = with.fits_from_bytes.expect("fits under its peak");
        assert!(fits < free.peak_reserved_bytes, "{with:?}");
        // At each checkpoint's most reserved, and just below it, where
        // the checkpoint before must be taken.
        let at_checkpoints = kept.most().into_iter().flat_map(|m| [m, m - GRAIN]);
        assert!(at_checkpoints.clone().count() > 20);
        let around = [64 * MIB, fits - 6 * MIB, fits - GRAIN, fits, fits + GRAIN, free.peak_reserved_bytes + GRAIN];
        for budget in around.into_iter().chain(at_checkpoints) {
            let resumed = replay_from(&d, &s, budget, &kept);
            let whole = replay(&d, &s, Some(budget), true, "needed", &[], None);
            assert_eq!((resumed.ooms, resumed.flushes), (whole.ooms, whole.flushes), "budget {budget}");
        }
    }
}

/// A stream of a trace's rows reads each request from its row, as the
/// copy it replaced did: a snapshot's requested size (the block's own
/// where none), stream and CUDA's free memory; a device-level trace's
/// allocations as block requests, its failed ones as `oom`s, its frees
/// as block frees, on stream 0. Copied out, it reads the same.
#[test]
fn a_stream_of_rows_reads_each_request_from_its_row() {
    use crate::trace::event::{Event, Events};
    let mut events = Events::default();
    let mut seg = Event::new(1, 0, EventKind::SegmentAlloc, 1 << 40, 20 * MIB);
    seg.stream = Some(7);
    let mut block = Event::new(2, 0, EventKind::BlockAlloc, 1 << 40, 2 * MIB);
    block.extra.requested = Some(2 * MIB - 100);
    block.stream = Some(7);
    let mut oom = Event::new(3, 0, EventKind::Oom, 0, 30 * MIB);
    oom.extra.device_free = Some(12 * MIB);
    let launch = Event::new(4, 0, EventKind::Launch, 0xfeed, 0);
    let free = Event::new(5, 0, EventKind::BlockFree, 1 << 40, 2 * MIB);
    for e in [&seg, &block, &oom, &launch, &free] {
        events.push(e);
    }
    let details = crate::trace::details::SnapshotDetails {
        reconstruction: vec![crate::trace::details::Reconstruction { device: 0, ..Default::default() }],
        ..Default::default()
    };
    let d = &streams(&events, &details, None)[0];
    let want = vec![
        Req {
            ts_ns: 1,
            kind: EventKind::SegmentAlloc,
            addr: 1 << 40,
            size: 20 * MIB,
            requested: 20 * MIB,
            stream: 7,
            device_free: None,
        },
        Req {
            ts_ns: 2,
            kind: EventKind::BlockAlloc,
            addr: 1 << 40,
            size: 2 * MIB,
            requested: 2 * MIB - 100,
            stream: 7,
            device_free: None,
        },
        Req {
            ts_ns: 3,
            kind: EventKind::Oom,
            addr: 0,
            size: 30 * MIB,
            requested: 30 * MIB,
            stream: 0,
            device_free: Some(12 * MIB),
        },
        Req {
            ts_ns: 5,
            kind: EventKind::BlockFree,
            addr: 1 << 40,
            size: 2 * MIB,
            requested: 2 * MIB,
            stream: 0,
            device_free: None,
        },
    ];
    assert_eq!(d.all().collect::<Vec<_>>(), want, "the launch is no request");
    assert_eq!(d.clone().into_owned().all().collect::<Vec<_>>(), want);

    let mut device = Events::default();
    let mut failed = Event::new(3, 9, EventKind::Alloc, 0, 8 * MIB);
    failed.ret = crate::trace::event::CUDA_ERROR_OUT_OF_MEMORY;
    for e in [
        &Event::new(1, 9, EventKind::Alloc, 0x1000, 4 * MIB),
        &Event::new(2, 9, EventKind::Launch, 0xfeed, 0),
        &failed,
        &Event::new(4, 9, EventKind::Free, 0x1000, 0),
    ] {
        device.push(e);
    }
    let d = &device_level_streams(&device, &Default::default())[0];
    let kinds: Vec<(EventKind, u64, u64, u64)> = d.all().map(|r| (r.kind, r.size, r.requested, r.stream)).collect();
    assert_eq!(
        kinds,
        vec![
            (EventKind::BlockAlloc, 4 * MIB, 4 * MIB, 0),
            (EventKind::Oom, 8 * MIB, 8 * MIB, 0),
            (EventKind::BlockFree, 0, 0, 0)
        ]
    );
}
