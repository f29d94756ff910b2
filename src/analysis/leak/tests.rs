use super::*;
use crate::trace::event::Event;

const MIB: u64 = 1 << 20;

/// Events of one series: (t, alloc size or 0 to free, address).
fn events(list: &[(u64, u64, u64)]) -> Events {
    let mut ev = Events::default();
    for &(t, size, addr) in list {
        let kind = if size > 0 { EventKind::Alloc } else { EventKind::Free };
        ev.push(&Event::new(t, 1, kind, addr, size));
    }
    ev
}

fn iterations(boundaries: Vec<u64>) -> Iterations {
    Iterations {
        pid: 1,
        count: boundaries.len(),
        complete: boundaries.len() - 1,
        period_s: None,
        warmup_end_t_ns: boundaries.get(1).copied(),
        source: crate::analysis::iterations::IterationSource::Periodicity,
        boundaries_t_ns: boundaries,
        before_trace: 0,
    }
}

/// `iters` iterations of 100 ns: a base block, then per iteration a
/// temporary of `temp(i)` freed at once, and `kept` bytes never freed.
fn loop_trace(iters: u64, kept: u64, temp: impl Fn(u64) -> u64) -> (Events, Iterations) {
    let mut list = vec![(1, 512 * MIB, 0x1000_0000)];
    let mut next = 0x8000_0000u64;
    for i in 0..iters {
        let t = 100 * (i + 1);
        list.push((t + 10, temp(i), 0x4000_0000));
        list.push((t + 20, 0, 0x4000_0000));
        if kept > 0 {
            list.push((t + 30, kept, next));
            next += kept.max(4096);
        }
    }
    let boundaries = (0..iters).map(|i| 100 * (i + 1)).collect();
    (events(&list), iterations(boundaries))
}

fn judge(ev: &Events, it: Option<&Iterations>) -> LeakReport {
    let floors = it.map(|it| iteration_floors(ev, 1, false, it));
    let it = it.zip(floors.as_ref());
    let input = Input {
        pid: 1,
        events: ev,
        allocator_view: false,
        live: &[],
        peak: 4096 * MIB,
        iterations: it,
        stacks: None,
        oom_times: &[],
        exited: None,
    };
    detect(&input)
}

#[test]
fn floors_are_exact_whatever_the_rows() {
    // Live: 10 at t=1, 30 at t=5, 20 at t=7, 50 at t=12, 10 at t=15.
    let ev = events(&[(1, 10, 1), (5, 20, 2), (7, 0, 1), (12, 30, 3), (15, 0, 3)]);
    let spans = [(0, 5), (5, 10), (10, 12), (12, 20), (20, 30)];
    let (f, end) = floors(&ev, 1, false, &spans);
    let got: Vec<(u64, u64)> = f.iter().map(|x| (x.bytes, x.at_t_ns)).collect();
    // [0,5): 0 on entry; [5,10): entering at 10, then 30, 20 at 7;
    // [10,12): no event, 20 all along; [12,20): 20 on entry, 50, 20.
    assert_eq!(got, vec![(0, 0), (10, 5), (20, 10), (20, 12), (20, 20)]);
    assert_eq!(end, 20);
    assert_eq!((f[1].after_rows, f[3].after_rows), (1, 3));
}

#[test]
fn a_deterministic_loop_is_not_leaking_and_a_kept_block_per_iteration_is() {
    let (ev, it) = loop_trace(8, 0, |_| 256 * MIB);
    let r = judge(&ev, Some(&it));
    assert_eq!(r.verdict, Verdict::NotLeaking, "{}", r.reason);
    assert!(r.reason.contains("equal to the byte"), "{}", r.reason);
    // 12 MiB kept per iteration: far under any 2 % of the peak.
    let (ev, it) = loop_trace(8, 12 * MIB, |_| 256 * MIB);
    let r = judge(&ev, Some(&it));
    assert_eq!(r.verdict, Verdict::Leaking, "{}", r.reason);
    assert_eq!(r.growth_per_iteration_bytes, Some(12 * MIB as i64));
    assert_eq!(r.floors.len(), 7);
    assert_eq!(r.floors[1].bytes - r.floors[0].bytes, 12 * MIB);
}

#[test]
fn release_after_the_last_iteration_does_not_undo_the_verdict() {
    let (mut ev, it) = loop_trace(8, 12 * MIB, |_| 256 * MIB);
    // Everything kept is freed after the last boundary.
    let kept: Vec<u64> = (0..8).map(|i| 0x8000_0000 + i * 12 * MIB).collect();
    for (k, a) in kept.iter().enumerate() {
        ev.push(&Event::new(2000 + k as u64, 1, EventKind::Free, *a, 0));
    }
    let r = judge(&ev, Some(&it));
    assert_eq!(r.verdict, Verdict::Leaking, "{}", r.reason);
    assert!(r.reason.contains("released after the last complete iteration"), "{}", r.reason);
    assert_eq!(r.released_after.map(|x| x.1), Some(6 * 12 * MIB));
}

#[test]
fn variable_shapes_move_the_floor_without_a_leak() {
    // Each iteration's input (of a varying size) lives until the next
    // one's has arrived: the floor is the base plus the smaller of two
    // neighbours, up and down.
    let sizes = [3, 1, 4, 1, 5, 2, 6, 2, 3, 1, 4];
    let mut list = vec![(1, 512 * MIB, 0x1000_0000)];
    for (i, s) in sizes.iter().enumerate() {
        let t = 100 * (i as u64 + 1);
        list.push((t + 1, s * MIB, 0x5000_0000 + i as u64 * 16 * MIB));
        if i > 0 {
            list.push((t + 2, 0, 0x5000_0000 + (i as u64 - 1) * 16 * MIB));
        }
    }
    let it = iterations((0..sizes.len() as u64).map(|i| 100 * (i + 1)).collect());
    let ev = events(&list);
    let r = judge(&ev, Some(&it));
    assert!(r.floors.windows(2).any(|w| w[0].bytes != w[1].bytes));
    assert_eq!(r.verdict, Verdict::NotLeaking, "{}", r.reason);
}

#[test]
fn growth_that_stops_is_bounded() {
    // Kept blocks in iterations 2–5 only, then flat ones.
    let mut list = vec![(1, 512 * MIB, 0x1000_0000)];
    for i in 0..12u64 {
        let t = 100 * (i + 1);
        list.push((t + 10, 64 * MIB, 0x4000_0000));
        list.push((t + 20, 0, 0x4000_0000));
        if (2..6).contains(&i) {
            list.push((t + 30, 8 * MIB, 0x9000_0000 + i * 8 * MIB));
        }
    }
    let ev = events(&list);
    let it = iterations((0..12).map(|i| 100 * (i + 1)).collect());
    let r = judge(&ev, Some(&it));
    assert_eq!(r.verdict, Verdict::NotLeaking, "{}", r.reason);
    assert!(r.reason.contains("from iteration 3 to 7"), "{}", r.reason);
}

/// One rise, then two iterations held: a cache that filled up and a leak
/// the cache absorbs for a while look the same, and the reason says what
/// was seen (a real recording: PyTorch's segments added in the second
/// step, then not one byte more).
#[test]
fn one_rise_then_a_short_hold_cannot_tell_and_says_so() {
    let mut list = vec![(1, 512 * MIB, 0x1000_0000)];
    for i in 0..6u64 {
        let t = 100 * (i + 1);
        list.push((t + 10, 64 * MIB, 0x4000_0000));
        list.push((t + 20, 0, 0x4000_0000));
        if i == 2 {
            list.push((t + 30, 1024 * MIB, 0x9000_0000));
        }
    }
    let ev = events(&list);
    let it = iterations((0..6).map(|i| 100 * (i + 1)).collect());
    let r = judge(&ev, Some(&it));
    assert_eq!(r.verdict, Verdict::CannotTell, "{}", r.reason);
    assert!(r.reason.contains("rose by 1.00 GiB from iteration 3 to 4, then held (equal to the byte)"), "{}", r.reason);
}

/// A staircase (a rise, a hold, a rise, a hold) is not "a rise that then
/// held": the later rise would be left out.
#[test]
fn a_staircase_is_not_described_as_one_rise() {
    let mut list = vec![(1, 512 * MIB, 0x1000_0000)];
    for i in 0..6u64 {
        let t = 100 * (i + 1);
        list.push((t + 10, 64 * MIB, 0x4000_0000));
        list.push((t + 20, 0, 0x4000_0000));
        if i == 1 || i == 3 {
            list.push((t + 30, 1024 * MIB, 0x9000_0000 + i * 1024 * MIB));
        }
    }
    let ev = events(&list);
    let it = iterations((0..6).map(|i| 100 * (i + 1)).collect());
    let r = judge(&ev, Some(&it));
    assert_eq!(r.verdict, Verdict::CannotTell, "{}", r.reason);
    assert!(!r.reason.contains("then held"), "{}", r.reason);
}

#[test]
fn growth_stopped_by_failing_requests_is_still_a_leak() {
    let mut list = vec![(1, 512 * MIB, 0x1000_0000)];
    for i in 0..12u64 {
        let t = 100 * (i + 1);
        if (2..6).contains(&i) {
            list.push((t + 30, 8 * MIB, 0x9000_0000 + i * 8 * MIB));
        }
    }
    let ev = events(&list);
    let it = iterations((0..12).map(|i| 100 * (i + 1)).collect());
    let ooms = [750, 850, 950];
    let floors = iteration_floors(&ev, 1, false, &it);
    let input = Input {
        pid: 1,
        events: &ev,
        allocator_view: false,
        live: &[],
        peak: 4096 * MIB,
        iterations: Some((&it, &floors)),
        stacks: None,
        oom_times: &ooms,
        exited: None,
    };
    let r = detect(&input);
    assert_eq!(r.verdict, Verdict::Leaking, "{}", r.reason);
    assert!(r.reason.contains("only when memory ran out"), "{}", r.reason);
}

#[test]
fn one_iteration_cannot_tell() {
    let (ev, _) = loop_trace(8, 12 * MIB, |_| 256 * MIB);
    let r = judge(&ev, Some(&iterations(vec![100, 500, 800])));
    assert_eq!(r.verdict, Verdict::CannotTell);
    assert!(r.reason.contains("optimizer moments"), "{}", r.reason);
}

#[test]
fn without_iterations_neither_a_flat_floor_nor_a_rising_one_can_be_told() {
    // Sawtooth over a constant floor of 1 GiB: a temporary of up to
    // 900 MiB allocated and freed every 10 ns.
    let mut saw = vec![(0, 1024 * MIB, 0x1000_0000)];
    for i in 1..100u64 {
        saw.push((i * 10, (i % 10) * 100 * MIB + MIB, 0x9000_0000));
        saw.push((i * 10 + 5, 0, 0x9000_0000));
    }
    let r = judge(&events(&saw), None);
    // Without iterations a floor that held over repeated rises is no
    // verdict: the rises may be layers as well as steps.
    assert_eq!((r.verdict, r.leaking), (Verdict::CannotTell, false), "{}", r.reason);
    assert!(r.reason.contains("did not rise") && r.reason.contains("layers, requests or steps"), "{}", r.reason);
    assert_eq!(r.growth_bytes, 0);
    assert_eq!(r.released_after, None, "the last temporary's free is no release: {}", r.reason);
    // The same with 64 MiB more held every 10 ns: a rise, which without
    // iterations may be one pass holding memory as well as a leak.
    let mut leak = saw.clone();
    for i in 1..100u64 {
        leak.push((i * 10 + 7, 64 * MIB, 0x1_0000_0000 + i * 64 * MIB));
    }
    leak.sort_by_key(|x| x.0);
    let r = judge(&events(&leak), None);
    assert_eq!((r.verdict, r.leaking), (Verdict::CannotTell, false), "{}", r.reason);
    assert!(r.reason.contains("higher in each of six equal spans"), "{}", r.reason);
    assert!(r.growth_bytes > 0 && r.rate_bytes_per_s > 0.0);
    assert_eq!(judge(&events(&saw[..5]), None).verdict, Verdict::CannotTell);
    // The same growth all given back at the end: the release is said, and
    // the rise before it is still what is judged.
    let mut back = leak.clone();
    for i in 1..100u64 {
        back.push((2000 + i, 0, 0x1_0000_0000 + i * 64 * MIB));
    }
    let r = judge(&events(&back), None);
    assert_eq!(r.verdict, Verdict::CannotTell, "{}", r.reason);
    assert!(r.released_after.is_some_and(|(_, bytes)| bytes >= 99 * 64 * MIB), "{:?}", r.released_after);
    // Windows follow the events, not the time: a long idle set-up before
    // a short rising run puts the windows in the run.
    let mut idle = vec![(0, 1024 * MIB, 0x1000_0000), (1, 8 * MIB, 0x2000_0000), (1_000_000, 0, 0x2000_0000)];
    idle.extend(back.iter().skip(1).map(|&(t, s, a)| (t + 2_000_000, s, a)));
    let r = judge(&events(&idle), None);
    assert!(r.reason.contains("rose by") && r.growth_bytes > 0, "{}", r.reason);
    assert!(r.floors[0].start_t_ns >= 2_000_000, "the windows lie in the run: {:?}", r.floors);
    // A release stamped with the last rise's time stays out of the run.
    let mut same = leak.clone();
    let t_last = same.last().unwrap().0;
    for i in 1..100u64 {
        same.push((t_last, 0, 0x1_0000_0000 + i * 64 * MIB));
    }
    let r = judge(&events(&same), None);
    assert!(r.growth_bytes > 0 && r.released_after.is_some(), "{} {:?}", r.reason, r.floors);
    // An early spike higher than the run does not hide the run's rise.
    let mut spike = vec![(0, 1024 * MIB, 0x1000_0000)];
    for i in 1..=20u64 {
        spike.push((i * 10, 8192 * MIB, 0x9000_0000));
        spike.push((i * 10 + 5, 0, 0x9000_0000));
    }
    for i in 1..=100u64 {
        spike.push((1000 + i * 10, 32 * MIB, 0x2_0000_0000 + i * 32 * MIB));
    }
    let r = judge(&events(&spike), None);
    assert!(r.reason.contains("rose by") && r.growth_bytes > 0, "{}", r.reason);
}

#[test]
fn sizes_alive_at_the_end_are_grouped() {
    let ev = events(&[(1, MIB, 0), (2, MIB, MIB), (3, 3 * MIB, 4 * MIB)]);
    let live = [(0, MIB), (MIB, MIB), (4 * MIB, 3 * MIB)];
    let input = Input {
        pid: 1,
        events: &ev,
        allocator_view: false,
        live: &live,
        peak: 5 * MIB,
        iterations: None,
        stacks: None,
        oom_times: &[],
        exited: None,
    };
    let r = detect(&input);
    assert_eq!(r.by_size[0], SizeGroup { size: 3 * MIB, count: 1, bytes: 3 * MIB });
    assert_eq!(r.by_size[1], SizeGroup { size: MIB, count: 2, bytes: 2 * MIB });
}

proptest::proptest! {
    /// A loop whose allocations return to a constant floor is never
    /// leaking; the same loop keeping k bytes per iteration is, with a
    /// growth of k per iteration.
    #[test]
    fn a_constant_floor_never_leaks_and_k_kept_per_iteration_does(
        iters in 5u64..16,
        temps in proptest::collection::vec((1u64..64, 0u64..3), 1..8),
        k in 1u64..(64 << 20),
    ) {
        let trace = |kept: u64| {
            let mut list = vec![(1, 256 * MIB, 0x1000_0000)];
            for i in 0..iters {
                let t = 1000 * (i + 1);
                // Temporaries of random sizes, nested or not, all
                // freed before the iteration ends.
                for (j, &(size, order)) in temps.iter().enumerate() {
                    let a = 0x2000_0000 + j as u64 * 64 * MIB;
                    list.push((t + 10 + j as u64, size * MIB + i, a));
                    let free_at = if order == 0 { t + 11 + j as u64 } else { t + 500 + j as u64 };
                    list.push((free_at, 0, a));
                }
                if kept > 0 {
                    list.push((t + 900, kept, 0x1_0000_0000 + i * 128 * MIB));
                }
            }
            list.sort_by_key(|x| x.0);
            let boundaries = (0..iters).map(|i| 1000 * (i + 1)).collect();
            (events(&list), iterations(boundaries))
        };
        let (ev, it) = trace(0);
        let r = judge(&ev, Some(&it));
        proptest::prop_assert_ne!(r.verdict, Verdict::Leaking, "{}", r.reason);
        let (ev, it) = trace(k);
        let r = judge(&ev, Some(&it));
        proptest::prop_assert_eq!(r.verdict, Verdict::Leaking, "{}", r.reason);
        proptest::prop_assert_eq!(r.growth_per_iteration_bytes, Some(k as i64));
    }
}

/// Without iterations a floor that held is no verdict: one pass
/// (activations built up, then released once) rises and falls once, and
/// its second quarter is taken mid-pass; three such passes may as well be
/// three layers of one step.
#[test]
fn without_iterations_one_pass_cannot_be_told() {
    // A forward pass: 1 GiB of weights, 60 activations of 64 MiB kept,
    // then the backward frees them in reverse.
    let mut pass = vec![(0, 1024 * MIB, 0x1000_0000)];
    for i in 1..=60u64 {
        pass.push((i * 10, 64 * MIB, 0x1_0000_0000 + i * 64 * MIB));
    }
    for i in (1..=60u64).rev() {
        pass.push((1000 + (61 - i) * 10, 0, 0x1_0000_0000 + i * 64 * MIB));
    }
    let r = judge(&events(&pass), None);
    assert_eq!(r.verdict, Verdict::CannotTell, "{}", r.reason);
    assert!(r.reason.contains("one pass"), "{}", r.reason);
    // Three such passes in a row: repetitions whose floor held.
    let mut three = vec![(0, 1024 * MIB, 0x1000_0000)];
    for k in 0..3u64 {
        three.extend(pass[1..].iter().map(|&(t, s, a)| (t + k * 2000, s, a)));
    }
    let r = judge(&events(&three), None);
    assert_eq!(r.verdict, Verdict::CannotTell, "{}", r.reason);
    assert!(r.reason.contains("over 3 rises (layers, requests or steps"), "{}", r.reason);
    let l = [0, 10, 0, 10, 0, 10];
    assert_eq!(swings(&l, &l, 1), 3);
    let l = [0, 2, 1, 3, 2, 10];
    assert_eq!(swings(&l, &l, 1), 1, "small steps inside one rise are no swings");
    // Weights loaded in ten chunks, then twenty steps of +4/−4: the set-up's
    // climb does not set the scale of a step.
    let mut run: Vec<u64> = (1..=10).collect();
    for _ in 0..20 {
        run.extend([14, 10]);
    }
    run.push(14);
    let n = run.len();
    assert_eq!(swings(&run, &run[n / 4..], 1), 21, "the set-up climbing into the first step, then each step: {run:?}");
}

/// A snapshot whose Python frames show no optimizer step, or that has no
/// frames: what repeats may be layers, so a floor that held is no verdict
/// either way.
#[test]
fn a_snapshot_without_optimizer_steps_is_not_called_leak_free() {
    let mut saw = vec![(0, 1024 * MIB, 0x1000_0000)];
    for i in 1..100u64 {
        saw.push((i * 10, (i % 10) * 100 * MIB + MIB, 0x9000_0000));
        saw.push((i * 10 + 5, 0, 0x9000_0000));
    }
    let mut ev = Events::default();
    for &(t, size, addr) in &saw {
        let kind = if size > 0 { EventKind::BlockAlloc } else { EventKind::BlockFree };
        let mut e = Event::new(t, 1, kind, addr, size);
        e.extra.stack = Some(0);
        ev.push(&e);
    }
    let stacks = crate::trace::Stacks {
        frames: vec![crate::trace::Frame { filename: "/w/model.py".into(), line: 7, name: "forward".into() }],
        stacks: vec![vec![0]],
    };
    let input = Input {
        pid: 1,
        events: &ev,
        allocator_view: true,
        live: &[],
        peak: 4096 * MIB,
        iterations: None,
        stacks: Some(&stacks),
        oom_times: &[],
        exited: None,
    };
    let r = detect(&input);
    assert_eq!(r.verdict, Verdict::CannotTell, "{}", r.reason);
    assert!(r.reason.contains("a leak once per step may not show"), "{}", r.reason);
    assert!(!r.reason.contains("no Python frames"), "{}", r.reason);
    // The same snapshot recorded without frames (`context=None`, or
    // stacks off): nothing to find a step in, and the same doubt.
    let r = detect(&Input { stacks: None, ..input });
    assert_eq!(r.verdict, Verdict::CannotTell, "{}", r.reason);
    assert!(r.reason.contains("the trace holds no Python frames to find one in"), "{}", r.reason);
    // The device view of the same events (an eBPF recording of a program
    // that does not cache, recorded without its launches): the same doubt.
    let device = events(&saw);
    let r = detect(&Input { events: &device, stacks: None, allocator_view: false, ..input });
    assert_eq!(r.verdict, Verdict::CannotTell, "{}", r.reason);
    assert!(r.reason.contains("no repeating sequence of kernel launches"), "{}", r.reason);
}

/// Two rounds, with a model swapped out for a moment inside the second:
/// the second quarter's floor is that dip, the last quarter's the round's
/// level. Too few repetitions for the quarters' floors to compare: no
/// rise is claimed.
#[test]
fn two_rounds_with_a_dip_claim_no_rise() {
    let mut list = vec![(0, 512 * MIB, 0x1000_0000), (1, 512 * MIB, 0x2000_0000)];
    let mut t = 10;
    for round in 0..2u64 {
        for i in 0..40u64 {
            list.push((t, 50 * MIB, 0x1_0000_0000 + i * 64 * MIB));
            t += 10;
        }
        for i in 0..40u64 {
            list.push((t, 0, 0x1_0000_0000 + i * 64 * MIB));
            t += 10;
        }
        if round == 0 {
            // The swap: one copy out, back in.
            list.push((t, 0, 0x2000_0000));
            for k in 0..20u64 {
                list.push((t + 1 + k, 4096, 0x3000_0000 + k * 4096));
                list.push((t + 2 + k, 0, 0x3000_0000 + k * 4096));
            }
            list.push((t + 50, 512 * MIB, 0x2000_0000));
            t += 60;
        }
    }
    list.sort_by_key(|x| x.0);
    let r = judge(&events(&list), None);
    assert_eq!(r.verdict, Verdict::CannotTell, "{}", r.reason);
    assert!(!r.reason.contains("floor of live memory rose"), "{}", r.reason);
    assert!(r.reason.contains("too few repetitions"), "{}", r.reason);
}

/// A floor that dips once in the second quarter (a model swapped out for a
/// moment) and otherwise holds is no rise: the first window already stood
/// where the last quarter does.
#[test]
fn a_dip_in_the_second_quarter_is_no_rise() {
    let mut list = vec![(0, 512 * MIB, 0x1000_0000), (1, 512 * MIB, 0x2000_0000)];
    let mut t = 10;
    for k in 0..100u64 {
        if k == 42 {
            // Out and back in.
            list.push((t, 0, 0x2000_0000));
            list.push((t + 2, 512 * MIB, 0x2000_0000));
            t += 5;
        }
        list.push((t, 800 * MIB, 0x9000_0000));
        list.push((t + 5, 0, 0x9000_0000));
        t += 10;
    }
    let r = judge(&events(&list), None);
    assert_eq!(r.verdict, Verdict::CannotTell, "{}", r.reason);
    assert!(r.reason.contains("dipped to 512.00 MiB") && r.reason.contains("did not rise"), "{}", r.reason);
    assert_eq!((r.floor_early_bytes, r.growth_bytes), (1024 * MIB, 0));
    // A floor that, after the dip, climbs past where it began is no dip.
    let mut climb = list.clone();
    let t_end = climb.last().unwrap().0;
    for i in 0..40u64 {
        climb.push((t_end + 10 + i, 40 * MIB, 0x4_0000_0000 + i * 64 * MIB));
        climb.push((t_end + 10 + i, 800 * MIB, 0x9000_0000));
        climb.push((t_end + 10 + i, 0, 0x9000_0000));
    }
    climb.sort_by_key(|x| x.0);
    let r = judge(&events(&climb), None);
    assert!(!r.reason.contains("dipped"), "{}", r.reason);
}

/// A trace that stops in the middle of a forward pass says so.
#[test]
fn a_trace_cut_off_while_rising_says_so() {
    let mut list = vec![(0, 1024 * MIB, 0x1000_0000)];
    for i in 1..=60u64 {
        list.push((i * 10, 64 * MIB, 0x1_0000_0000 + i * 64 * MIB));
        list.push((i * 10 + 1, 8 * MIB, 0x9000_0000));
        list.push((i * 10 + 2, 0, 0x9000_0000));
    }
    let r = judge(&events(&list), None);
    assert_eq!(r.verdict, Verdict::CannotTell, "{}", r.reason);
    assert!(r.reason.contains("the trace ends near its highest"), "{}", r.reason);
}
