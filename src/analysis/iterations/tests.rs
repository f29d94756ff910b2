use super::*;
use crate::trace::event::Event;

fn ev(ts: u64, kind: EventKind, addr: u64, size: u64) -> Event {
    Event::new(ts, 1, kind, addr, size)
}

#[test]
fn annotations_give_profiler_steps_or_optimizer_step_ends() {
    let a = |stage: &str, name: &str, t| Annotation { stage: stage.into(), name: name.into(), device: 0, t_ns: t };
    let list = vec![
        a("START", "ProfilerStep#3", 100),
        a("END", "ProfilerStep#3", 190),
        a("START", "ProfilerStep#4", 200),
        a("END", "ProfilerStep#4", 290),
        a("START", "Optimizer.step#AdamW.step", 250),
        a("END", "Optimizer.step#AdamW.step", 280),
    ];
    let it = from_annotations(0, &list, None, None).unwrap();
    assert_eq!((it.count, it.complete, it.boundaries_t_ns.clone()), (2, 2, vec![100, 200, 290]));
    assert_eq!(it.index_at(99), None);
    assert_eq!(it.index_at(200), Some(1));
    let only_step = from_annotations(0, &list[4..], None, None).unwrap();
    assert_eq!((only_step.count, only_step.complete, only_step.warmup_end_t_ns), (1, 0, None));
    assert!(from_annotations(1, &list, None, None).is_none());
    // A device that began in the trace: its first event starts the
    // first iteration, which ends at the first optimizer step.
    let began = from_annotations(0, &list[4..], Some(10), None).unwrap();
    assert_eq!((began.count, began.complete, began.boundaries_t_ns.clone()), (1, 1, vec![10, 280]));
    assert_eq!(began.warmup_end_t_ns, Some(280));
    // Profiler steps have their own starts; a start after the first
    // end is not one.
    assert_eq!(from_annotations(0, &list, Some(10), None).unwrap().boundaries_t_ns, vec![100, 200, 290]);
    assert_eq!(from_annotations(0, &list[4..], Some(281), None).unwrap().boundaries_t_ns, vec![280]);
    // A trace that is a window on the run (its first entry at 195,
    // something alive before it): the step that began before it is
    // not in it, and is counted apart.
    let window = from_annotations(0, &list, None, Some(195)).unwrap();
    assert_eq!((window.count, window.complete, window.boundaries_t_ns.clone()), (1, 1, vec![200, 290]));
    assert_eq!(window.before_trace, 1);
    let steps = from_annotations(0, &list[4..], None, Some(281));
    assert!(steps.is_none(), "the only optimizer step ended before the window: {steps:?}");
    assert_eq!(from_annotations(0, &list[4..], None, Some(280)).unwrap().before_trace, 0);
}

/// Only an optimizer's `step` marks an iteration: a diffusion
/// scheduler's `step` or an LR scheduler's does not, and a Windows
/// path reads as a POSIX one.
#[test]
fn a_step_frame_is_an_optimizer_s() {
    let f = |file: &str, name: &str| Frame { filename: file.into(), line: 1, name: name.into() };
    assert!(is_step_frame(&f("/venv/lib/python3.11/site-packages/torch/optim/optimizer.py", "wrapper")));
    assert!(is_step_frame(&f("/venv/lib/python3.11/site-packages/torch/optim/adamw.py", "step")));
    assert!(is_step_frame(&f(r"D:\env\Lib\site-packages\torch\optim\adam.py", "step")));
    assert!(!is_step_frame(&f("/venv/lib/python3.11/site-packages/torch/optim/lr_scheduler.py", "step")));
    assert!(!is_step_frame(&f("/venv/lib/python3.11/site-packages/diffusers/schedulers/scheduling_lcm.py", "step")));
    assert!(!is_step_frame(&f("/w/train.py", "step")));
}

/// A snapshot's blocks rebuilt from its final state (the optimizer's
/// moments, made by steps before the trace began) are no steps of the
/// trace: only recorded events after them count.
#[test]
fn rebuilt_blocks_are_no_optimizer_steps() {
    let stacks = Stacks {
        frames: vec![
            Frame { filename: "/v/torch/optim/optimizer.py".into(), line: 493, name: "wrapper".into() },
            Frame { filename: "/w/model.py".into(), line: 7, name: "forward".into() },
        ],
        stacks: vec![vec![0], vec![1]],
    };
    let mut events = Events::default();
    let push = |events: &mut Events, ts, addr, stack| {
        let mut e = ev(ts, EventKind::BlockAlloc, addr, 4096);
        e.extra.stack = Some(stack);
        events.push(&e);
    };
    // Rebuilt: three bursts of optimizer state, each apart by more
    // than a burst's gap, all at the first instant.
    for burst in 0..3u64 {
        for k in 0..4 {
            push(&mut events, 10, 0x10_0000 * (burst + 1) + k * 0x1000, 0);
        }
        for k in 0..(BURST_GAP as u64 + 1) {
            push(&mut events, 10, 0x100_0000 + burst * 0x10_0000 + k * 0x1000, 1);
        }
    }
    let rebuilt = events.len();
    // Recorded: one forward pass, no optimizer step.
    for k in 0..100u64 {
        push(&mut events, 20 + k, 0x1000_0000 + k * 0x1000, 1);
    }
    let rows = Rows::Range(0, events.len());
    assert!(detect(&events, 1, rows, Some(&stacks), &[], Some(rebuilt)).is_none());
    let counted = detect(&events, 1, rows, Some(&stacks), &[], None).expect("the rebuilt bursts, when not told");
    assert_eq!(counted.count, 3);
}

/// The period leaves the warm-up out when two or more iterations
/// follow it (a first step of 2.5 s, then steps of about 36 ms).
#[test]
fn the_period_leaves_out_the_warm_up() {
    let ms = 1_000_000;
    let b = vec![0, 2527 * ms, 2563 * ms, 2598 * ms, 2639 * ms, 2680 * ms];
    let it = Iterations::new(0, 5, b, IterationSource::Launches);
    assert_eq!(it.period_s, Some(0.0385), "the median of 36, 35, 41 and 41 ms");
    let two = Iterations::new(0, 2, vec![0, 2527 * ms, 2563 * ms], IterationSource::Launches);
    assert_eq!(two.period_s, Some(1.2815), "one iteration after the warm-up: every gap counts");
}

#[test]
fn periodicity_finds_each_start_where_live_memory_leaves_its_floor() {
    let (events, starts) = periodic(None);
    let rows = Rows::Range(0, events.len());
    let it = from_periodicity(&events, 1, rows).unwrap();
    assert_eq!(it.boundaries_t_ns, starts[1..].to_vec());
    assert_eq!((it.count, it.complete), (5, 4));
}

/// The series is stored in units of its block sizes' common divisor, in
/// 4 bytes while every level fits: a level beyond that (here 8 GiB and a
/// byte held throughout, divisor 1) is stored in 8, and the iterations
/// are the same.
#[test]
fn a_series_too_high_for_4_bytes_finds_the_same_iterations() {
    let (small, starts) = periodic(Some(4096));
    let (large, _) = periodic(Some((8 << 30) + 1));
    let (a, b) = (Rows::Range(0, small.len()), Rows::Range(0, large.len()));
    assert!(live_series::<u32>(&small, a, 1).is_some());
    assert!(live_series::<u32>(&large, b, 1).is_none(), "8 GiB in bytes does not fit 4 bytes");
    let (x, y) = (from_periodicity(&small, 1, a).unwrap(), from_periodicity(&large, 1, b).unwrap());
    assert_eq!(x.boundaries_t_ns, starts[1..].to_vec());
    assert_eq!((&x.boundaries_t_ns, x.count, x.complete), (&y.boundaries_t_ns, y.count, y.complete));
}

/// 6 iterations: two allocations up, a marker kernel at the peak, two
/// frees down, then noise kernels and a temporary at the floor; first, a
/// block of `held` bytes that is never freed, when given. The trace and
/// each iteration's start.
fn periodic(held: Option<u64>) -> (Events, Vec<u64>) {
    let mut list = Vec::new();
    let mut t = 0;
    if let Some(size) = held {
        t += 10;
        list.push(ev(t, EventKind::Alloc, 0x7000_0000, size));
    }
    let mut starts = Vec::new();
    for it in 0..6u64 {
        starts.push(t + 10);
        let mut push = |k, a, s| {
            t += 10;
            list.push(ev(t, k, a, s));
        };
        push(EventKind::Alloc, 0x1000, 4096 + it);
        push(EventKind::Alloc, 0x9000, 8192);
        push(EventKind::Launch, 0xfeed, 0);
        push(EventKind::Free, 0x1000, 0);
        push(EventKind::Free, 0x9000, 0);
        for k in 0..(6 + it % 3) {
            push(EventKind::Launch, 0x100 + k * (it + 1), 0);
        }
        push(EventKind::Alloc, 0x5000, 512 * (it + 1));
        push(EventKind::Free, 0x5000, 0);
        push(EventKind::Launch, 0x200, 0);
    }
    let mut events = Events::default();
    for e in &list {
        events.push(e);
    }
    (events, starts)
}

/// A training loop as a cached recording sees it: memory allocated
/// once, then a launch sequence that repeats once per step, the layers
/// repeating inside each step, the first step longer (set-up).
fn cached_training(steps: usize, layers: usize, seed: u64) -> Events {
    let mut events = Events::default();
    let mut t = 0;
    let mut push = |events: &mut Events, kind, addr, size| {
        t += 1000;
        events.push(&ev(t, kind, addr, size));
    };
    push(&mut events, EventKind::Alloc, 0x1000, 1 << 30);
    let mut noise = seed;
    for step in 0..steps {
        if step == 0 {
            for k in 0..40 {
                push(&mut events, EventKind::Launch, 0x9000 + k, 0);
            }
        }
        push(&mut events, EventKind::Launch, 0x100, 0); // embedding
        for _ in 0..layers {
            for k in 0..6 {
                push(&mut events, EventKind::Launch, 0x200 + k, 0);
            }
        }
        for _ in 0..layers {
            for k in 0..9 {
                push(&mut events, EventKind::Launch, 0x300 + k, 0);
            }
        }
        // Now and then a step launches a few more kernels.
        noise = noise.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        for k in 0..if noise >> 62 == 0 { 3 } else { 0 } {
            push(&mut events, EventKind::Launch, 0x700 + k, 0);
        }
        for k in 0..5 {
            push(&mut events, EventKind::Launch, 0x400 + k, 0); // optimizer
        }
    }
    events
}

#[test]
fn launches_give_the_steps_of_a_cached_run_not_its_layers() {
    for steps in [4, 6, 9] {
        let events = cached_training(steps, 8, steps as u64);
        let rows = Rows::Range(0, events.len());
        assert!(from_periodicity(&events, 1, rows).is_none(), "live memory is flat: no periodicity");
        let it = detect(&events, 1, rows, None, &[], None).expect("iterations from the launches");
        assert_eq!((it.count, it.source), (steps, IterationSource::Launches), "{steps} steps");
        assert_eq!(it.complete, steps - 1);
    }
    // Three repetitions are too few, and a sequence that does not
    // repeat has no period.
    let events = cached_training(3, 8, 3);
    let rows = Rows::Range(0, events.len());
    assert!(detect(&events, 1, rows, None, &[], None).is_none());
    let mut random = Events::default();
    let mut x: u64 = 7;
    for t in 0..5000 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        random.push(&ev(t * 1000, EventKind::Launch, 0x100 + (x >> 58), 0));
    }
    let rows = Rows::Range(0, random.len());
    assert!(from_launches(&random, 1, rows).is_none(), "random launches have no period");
}
