use super::footprint::*;
use super::*;
use crate::analysis::metrics::MetricsConfig;
use crate::trace::event::{Event, EventKind, Events};

fn ev(ts: u64, pid: u32, kind: EventKind, addr: u64, size: u64) -> Event {
    Event::new(ts, pid, kind, addr, size)
}

fn events(list: &[Event]) -> Events {
    let mut ev = Events::default();
    for e in list {
        ev.push(e);
    }
    ev
}

#[test]
fn exit_releases_what_the_process_held_and_only_its_own() {
    use EventKind::*;
    let list = [
        ev(0, 7, Alloc, 0x10000, 0x1000),
        ev(1, 7, Alloc, 0x30000, 0x2000),
        ev(2, 8, Alloc, 0x10000, 0x4000),
        ev(3, 7, Free, 0x10000, 0),
        ev(4, 7, Exit, 0, 0),
        ev(5, 8, Exit, 0, 0),
        ev(6, 9, Exit, 0, 0), // never allocated: nothing to release
    ];
    let evs = events(&list);
    let fp = Footprint::build(&evs);
    for mut r in [Replay::new(MetricsConfig::default(), &fp), Replay::reference(MetricsConfig::default(), &fp)] {
        for e in &list[..5] {
            r.apply(e);
        }
        let m = r.metrics(7);
        assert_eq!((m.live_bytes, m.live_blocks, m.span_bytes, m.gap_count), (0, 0, 0, 0));
        assert_eq!(r.metrics(8).live_bytes, 0x4000);
        for e in &list[5..] {
            r.apply(e);
        }
        let want = [
            ExitRelease { pid: 7, t_ns: 4, bytes: 0x2000, blocks: 1 },
            ExitRelease { pid: 8, t_ns: 5, bytes: 0x4000, blocks: 1 },
        ];
        assert_eq!(r.exits(), &want);
        assert_eq!(r.peak_total(), 0x7000);
        assert_eq!(r.finish().total(), 0);
    }
}

#[test]
fn regions_merge_touching_and_overlapping_ranges() {
    let merged = merge_ranges(vec![(0, 10), (10, 20), (15, 30), (40, 50)]);
    assert_eq!(merged, vec![(0, 30), (40, 50)]);
}

#[test]
fn free_fills_the_hole_and_anomalies_are_counted() {
    use EventKind::*;
    let list = [
        // One early allocation makes 0x10000..0x31000 a single region.
        ev(0, 7, Alloc, 0x10000, 0x21000),
        ev(0, 7, Free, 0x10000, 0),
        ev(1, 7, Alloc, 0x10000, 0x1000),
        ev(2, 7, Alloc, 0x20000, 0x1000),
        ev(3, 7, Alloc, 0x30000, 0x1000),
        ev(4, 7, Free, 0x20000, 0),
        ev(5, 7, Free, 0x20000, 0),       // double free
        ev(6, 7, Free, 0x99000, 0),       // unknown
        ev(7, 7, Alloc, 0x30800, 0x1000), // overlaps the block at 0x30000
    ];
    let evs = events(&list);
    let fp = Footprint::build(&evs);
    let mut r = Replay::new(MetricsConfig::default(), &fp);
    for e in &list[..5] {
        r.apply(e);
    }
    let m = r.metrics(7);
    assert_eq!((m.gap_count, m.largest_gap, m.span_bytes), (2, 0xf000, 0x21000));
    r.apply(&list[5]);
    let m = r.metrics(7);
    assert_eq!((m.gap_count, m.largest_gap, m.live_blocks), (1, 0x1f000, 2));
    for e in &list[6..] {
        r.apply(e);
    }
    assert_eq!(r.live_blocks(7), vec![(0x10000, 0x1000), (0x30800, 0x1000)]);
    let a = r.finish();
    assert_eq!((a.double_free, a.unknown_free, a.overlap), (1, 1, 1));
}

#[test]
fn blocks_in_separate_regions_have_no_gap_between_them() {
    use EventKind::*;
    let list = [ev(1, 7, Alloc, 0x10000, 0x1000), ev(2, 7, Alloc, 0x20000, 0x1000)];
    let evs = events(&list);
    let fp = Footprint::build(&evs);
    assert_eq!(fp.regions(7), &[(0x10000, 0x11000), (0x20000, 0x21000)]);
    let mut r = Replay::new(MetricsConfig::default(), &fp);
    list.iter().for_each(|e| r.apply(e));
    let m = r.metrics(7);
    assert_eq!((m.gap_count, m.span_bytes, m.utilization), (0, 0x2000, 1.0));
}

#[test]
fn processes_are_separate_address_spaces() {
    use EventKind::*;
    let list = [ev(1, 1, Alloc, 0x10000, 0x1000), ev(2, 2, Alloc, 0x10000, 0x2000), ev(3, 1, Free, 0x10000, 0)];
    let evs = events(&list);
    let fp = Footprint::build(&evs);
    let mut r = Replay::new(MetricsConfig::default(), &fp);
    list.iter().for_each(|e| r.apply(e));
    assert_eq!(r.metrics(1).live_blocks, 0);
    assert_eq!(r.metrics(2).live_bytes, 0x2000);
    assert_eq!(r.finish().total(), 0);
}
