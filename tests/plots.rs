//! Pixel tests of the MDTP on a constructed trace, and the PNGs `analyze`
//! writes.

use std::path::Path;

use assert_cmd::Command;
use fragscope::analyze::{Options, analyze_path};
use fragscope::event::{CUDA_ERROR_OUT_OF_MEMORY, Event, EventKind};
use fragscope::plot::{PlotConfig, lifetimes, render_mdtp, size_colour};
use fragscope::replay::Footprint;
use fragscope::trace::{Source, Trace, TraceMeta, TraceWriter};

const MIB: u64 = 1 << 20;
const MS: u64 = 1_000_000;
const BASE: u64 = 0x7f00_0000_0000;
const SMALL_REGION: u64 = 0x7e00_0000_0000;

fn ev(ms: u64, kind: EventKind, addr: u64, size: u64, ret: i32) -> Event {
    Event {
        ts_ns: ms * MS,
        duration_ns: 0,
        pid: 1,
        tid: 1,
        kind,
        addr,
        size,
        ret,
        device: None,
        stream: None,
        extra: Default::default(),
        cuda: Default::default(),
    }
}

/// D: a 128 KiB block alone in its own region (collapsed to the bottom);
/// A: 4 MiB, B: 4 MiB (freed at 50 ms: a hole), C: 64 MiB; an OOM at 70 ms.
fn write_trace(dir: &Path) {
    use EventKind::*;
    let mut meta = TraceMeta::new(Source::Synthetic);
    meta.capacity_bytes = Some(100 * MIB);
    let mut w = TraceWriter::create(dir, meta, 1000).unwrap();
    for e in [
        ev(5, Alloc, SMALL_REGION, 128 << 10, 0),
        ev(10, Alloc, BASE, 4 * MIB, 0),
        ev(20, Alloc, BASE + 4 * MIB, 4 * MIB, 0),
        ev(30, Alloc, BASE + 8 * MIB, 64 * MIB, 0),
        ev(50, Free, BASE + 4 * MIB, 0, 0),
        ev(70, Alloc, 0, 40 * MIB, CUDA_ERROR_OUT_OF_MEMORY),
        ev(100, Launch, 0, 0, 0),
    ] {
        w.push(e).unwrap();
    }
    w.finish().unwrap();
}

/// The analysis (without plots), events and footprint of a trace.
fn analysed(dir: &Path) -> (fragscope::analyze::Analysis, fragscope::event::Events, Footprint) {
    let a = analyze_path(dir, &Options { plot: None, ..Options::default() }).unwrap();
    let (events, _) = Trace::open(dir).unwrap().load_events().unwrap();
    let fp = Footprint::build(&events);
    (a, events, fp)
}

fn rgb(buf: &[u8], width: u32, (x, y): (u32, u32)) -> [u8; 3] {
    let i = ((y * width + x) * 3) as usize;
    [buf[i], buf[i + 1], buf[i + 2]]
}

fn luminance(c: [u8; 3]) -> f64 {
    0.2126 * c[0] as f64 + 0.7152 * c[1] as f64 + 0.0722 * c[2] as f64
}

#[test]
fn mdtp_pixels_show_holes_sizes_ooms_and_coverage() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("t");
    write_trace(&dir);
    let (a, events, fp) = analysed(&dir);
    let cfg = PlotConfig { width: 800, height: 600, ..PlotConfig::default() };
    let (buf, panels) = render_mdtp(&a, &lifetimes(&events), &[], &fp, &cfg).unwrap();
    assert_eq!(buf.len(), 800 * 600 * 3);
    let p = panels[0];
    // Collapsed: D's region [0, 128 KiB), then A B C from 128 KiB.
    let off = |addr: u64| if addr >= BASE { (128 << 10) + addr - BASE } else { addr - SMALL_REGION };

    // The hole left by B is white after 50 ms, B itself was coloured before.
    let hole = p.pixel(60 * MS, off(BASE + 6 * MIB));
    assert_eq!(rgb(&buf, 800, hole), [255, 255, 255]);
    let before = p.pixel(40 * MS, off(BASE + 6 * MIB));
    assert_ne!(rgb(&buf, 800, before), [255, 255, 255]);

    // The 64 MiB block is darker than the 4 MiB one.
    let large = rgb(&buf, 800, p.pixel(60 * MS, off(BASE + 40 * MIB)));
    let small = rgb(&buf, 800, p.pixel(60 * MS, off(BASE + 2 * MIB)));
    assert!(luminance(large) < luminance(small) - 20.0, "{large:?} vs {small:?}");
    let darkest = size_colour(1.0);
    assert_eq!(large, darkest.map(|c| c.round() as u8));

    // The OOM column is red.
    let (x, _) = p.pixel(70 * MS, 0);
    assert_eq!(rgb(&buf, 800, (x, p.y1 as u32 - 2)), [220, 0, 0]);
    // The failed request's size (40 MiB) as a red bar at the top.
    assert_eq!(rgb(&buf, 800, (x, p.y0 as u32 + 2)), [255, 0, 0]);

    // D covers ~0.3 of the bottom row: shaded partially, neither white nor
    // its full colour. At 7 ms it is the only block alive.
    let d = rgb(&buf, 800, p.pixel(7 * MS, 0));
    let bytes_per_row = (p.o1 - p.o0) as f64 / (p.y1 - p.y0) as f64;
    assert!(((128 << 10) as f64) < bytes_per_row, "D must be thinner than a row");
    assert_ne!(d, [255, 255, 255]);
    let full = size_colour(0.0).map(|c| c.round() as u8);
    assert!(luminance(d) > luminance(full) + 5.0, "{d:?} should be lighter than {full:?}");

    // Axis labels: ink left of the plot area and below it.
    let ink = |xs: std::ops::Range<u32>, ys: std::ops::Range<u32>| {
        xs.flat_map(|x| ys.clone().map(move |y| (x, y))).filter(|&px| luminance(rgb(&buf, 800, px)) < 128.0).count()
    };
    assert!(ink(0..p.x0 as u32 - 2, p.y0 as u32..p.y1 as u32) > 50, "y-axis labels");
    assert!(ink(p.x0 as u32..p.x1 as u32, p.y1 as u32 + 3..600) > 50, "x-axis labels");
}

#[test]
fn analyze_writes_both_pngs_at_the_requested_size() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("t");
    write_trace(&dir);
    let out = tmp.path().join("out");
    Command::cargo_bin("fragscope")
        .unwrap()
        .arg("analyze")
        .arg(&dir)
        .args(["--size", "640x480", "-o"])
        .arg(&out)
        .assert()
        .success();
    for name in ["mdtp.png", "timeline.png"] {
        let img = image::open(out.join(name)).unwrap();
        assert_eq!((img.width(), img.height()), (640, 480), "{name}");
    }
    let out2 = tmp.path().join("none");
    Command::cargo_bin("fragscope")
        .unwrap()
        .arg("analyze")
        .arg(&dir)
        .args(["--no-plots", "-o"])
        .arg(&out2)
        .assert()
        .success();
    assert!(!out2.join("mdtp.png").exists());
    Command::cargo_bin("fragscope")
        .unwrap()
        .arg("analyze")
        .arg(&dir)
        .args(["--size", "10x10", "-o"])
        .arg(tmp.path().join("x"))
        .assert()
        .code(2);
}

#[test]
fn windows_restrict_the_view() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("t");
    write_trace(&dir);
    let (a, events, fp) = analysed(&dir);
    let cfg = PlotConfig {
        width: 800,
        height: 600,
        time_window: Some((40 * MS, 60 * MS)),
        addr_window: Some((0, 16 * MIB)),
        ..PlotConfig::default()
    };
    let (buf, panels) = render_mdtp(&a, &lifetimes(&events), &[], &fp, &cfg).unwrap();
    let p = panels[0];
    assert_eq!((p.t0, p.t1, p.o0, p.o1), (45 * MS, 65 * MS, 0, 16 * MIB));
    // Zoomed in, B's hole (4–8 MiB of BASE) spans many rows and is white.
    let hole = p.pixel(55 * MS, (128 << 10) + 6 * MIB);
    assert_eq!(rgb(&buf, 800, hole), [255, 255, 255]);
}
