//! Pixel tests of the MDTP on a constructed trace, and the PNGs `analyze`
//! writes.

use std::path::Path;

use crate::common::fragscope;
use fragscope::analysis::{Options, analyze_path};
use fragscope::output::plot::{PlotConfig, render_mdtp, size_colour};
use fragscope::trace::event::{CUDA_ERROR_OUT_OF_MEMORY, Event, EventKind};
use fragscope::trace::{Source, TraceMeta, TraceWriter};

const MIB: u64 = 1 << 20;
const MS: u64 = 1_000_000;
const BASE: u64 = 0x7f00_0000_0000;
const SMALL_REGION: u64 = 0x7e00_0000_0000;

fn ev(ms: u64, kind: EventKind, addr: u64, size: u64, ret: i32) -> Event {
    Event { ret, ..Event::new(ms * MS, 1, kind, addr, size) }
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

/// The analysis of a trace, with the layout the MDTP draws.
fn analysed(dir: &Path) -> fragscope::analysis::Analysis {
    analyze_path(dir, &Options { layout: true, ..Options::default() }).unwrap()
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
    let a = analysed(&dir);
    // Seven events: every gap between them is an idle stretch, which the
    // picture shortens to a grey break (the one from 50 to 70 ms here)...
    let cfg = PlotConfig { width: 800, height: 600, ..PlotConfig::default() };
    let (buf, panels) = render_mdtp(&a, a.layout.as_ref().unwrap(), &cfg).unwrap();
    let p = panels[0];
    assert!(p.time.is_some_and(|m| !m.is_identity()));
    assert_eq!(rgb(&buf, 800, p.pixel(60 * MS, 0)), [195, 195, 195]);
    // ...and a window keeps true time: the pixels below are read there.
    let cfg = PlotConfig { time_window: Some((0, u64::MAX)), ..cfg };
    let (buf, panels) = render_mdtp(&a, a.layout.as_ref().unwrap(), &cfg).unwrap();
    assert_eq!(buf.len(), 800 * 600 * 3);
    let p = panels[0];
    assert_eq!(p.time, None);
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
    fragscope().arg("analyze").arg(&dir).args(["--size", "640x480", "-o"]).arg(&out).assert().success();
    for name in ["mdtp.png", "timeline.png"] {
        let img = crate::common::read_png(&out.join(name));
        assert_eq!((img.width, img.height), (640, 480), "{name}");
        crate::common::assert_clear_border(&out.join(name), 4);
    }
    // At the default size too, with several processes (multi pattern).
    let multi = tmp.path().join("multi");
    fragscope().args(["synth", "--pattern", "multi", "--events", "20000", "-o"]).arg(&multi).assert().success();
    let out_multi = tmp.path().join("out-multi");
    fragscope().arg("analyze").arg(&multi).arg("-o").arg(&out_multi).assert().success();
    for name in ["mdtp.png", "timeline.png"] {
        crate::common::assert_clear_border(&out_multi.join(name), 4);
    }
    let out2 = tmp.path().join("none");
    fragscope().arg("analyze").arg(&dir).args(["--no-plots", "-o"]).arg(&out2).assert().success();
    assert!(!out2.join("mdtp.png").exists());
    fragscope().arg("analyze").arg(&dir).args(["--size", "10x10", "-o"]).arg(tmp.path().join("x")).assert().code(2);
}

#[test]
fn windows_restrict_the_view() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("t");
    write_trace(&dir);
    let a = analysed(&dir);
    let cfg = PlotConfig {
        width: 800,
        height: 600,
        time_window: Some((40 * MS, 60 * MS)),
        addr_window: Some((0, 16 * MIB)),
        ..PlotConfig::default()
    };
    let (buf, panels) = render_mdtp(&a, a.layout.as_ref().unwrap(), &cfg).unwrap();
    let p = panels[0];
    assert_eq!((p.t0, p.t1, p.o0, p.o1), (45 * MS, 65 * MS, 0, 16 * MIB));
    // Zoomed in, B's hole (4–8 MiB of BASE) spans many rows and is white.
    let hole = p.pixel(55 * MS, (128 << 10) + 6 * MIB);
    assert_eq!(rgb(&buf, 800, hole), [255, 255, 255]);
}

/// `n` processes with `per` allocations each (the same addresses in each,
/// as device addresses are per process), in time order; process p frees
/// every other block, and the odd ones exit holding the rest.
fn write_processes(dir: &Path, n: u32, per: u64) {
    use EventKind::*;
    let mut w = TraceWriter::create(dir, TraceMeta::new(Source::Synthetic), 100_000).unwrap();
    let mut t = 0;
    let mut at = |pid: u32, kind: EventKind, addr: u64, size: u64| {
        t += 1;
        Event { pid, tid: pid, ts_ns: t * 1000, ..ev(0, kind, addr, size, 0) }
    };
    for pid in 1..=n {
        for k in 0..per {
            w.push(at(pid, Alloc, BASE + k * 4 * MIB, (1 + (k + pid as u64) % 4) * MIB)).unwrap();
        }
        for k in (0..per).step_by(2) {
            w.push(at(pid, Free, BASE + k * 4 * MIB, 0)).unwrap();
        }
        if pid % 2 == 1 {
            w.push(at(pid, Exit, 0, 0)).unwrap();
        }
    }
    w.finish().unwrap();
}

#[test]
fn hundreds_of_processes_analyse_with_at_most_max_panels() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("t");
    write_processes(&dir, 400, 30);
    let out = tmp.path().join("out");
    // 240 steps: the predictor runs once per process, and 400 of them at
    // the default 1000 steps take most of a minute (issue: predictor cost).
    fragscope().arg("analyze").arg(&dir).args(["--step", "50ev", "-o"]).arg(&out).assert().success();
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["processes"].as_array().unwrap().len(), 400);
    assert_eq!(report["plots"]["panels_not_drawn"], 392);
    let released = report["released_at_exit"].as_array().unwrap();
    assert_eq!(released.len(), 200);
    assert!(released.iter().all(|r| r["blocks"] == 15), "{released:?}");
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("+392 processes not drawn") && md.contains("Released at exit: 200 processes"), "{md}");
    // Processes that exited hold nothing at the end; the others keep theirs.
    let leaks = report["leaks"].as_array().unwrap();
    let live_at_end = |pid: u64| leaks.iter().find(|l| l["pid"] == pid).unwrap()["live_at_end_blocks"].as_u64();
    assert_eq!((live_at_end(1), live_at_end(2)), (Some(0), Some(15)));
    let img = crate::common::read_png(&out.join("mdtp.png"));
    assert_eq!((img.width, img.height), (1600, 900));
    fragscope().arg("analyze").arg(&dir).args(["--max-panels", "0", "-o"]).arg(tmp.path().join("x")).assert().code(2);
}

mod many_processes {
    use super::*;
    use fragscope::analysis::StepSpec;
    use fragscope::output::plot::{not_drawn, render_timeline};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Any number of processes, any image size down to 200×100, any
        /// --max-panels: rendering never panics, every panel lies inside
        /// the image with at least one pixel row, and every process is
        /// either drawn or counted as not drawn.
        #[test]
        fn rendering_never_panics(
            n in prop_oneof![1u32..=12, 13u32..=2000],
            w in 200u32..=1200,
            h in 100u32..=900,
            max_panels in 1usize..=40,
        ) {
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path().join("t");
            write_processes(&dir, n, 3);
            // Few steps: the predictor has too little data and stays cheap.
            let opts = Options { layout: true, step: StepSpec::Events(2000), ..Options::default() };
            let a = analyze_path(&dir, &opts).unwrap();
            let cfg = PlotConfig { width: w, height: h, max_panels, ..PlotConfig::default() };
            let (buf, panels) = render_mdtp(&a, a.layout.as_ref().unwrap(), &cfg).unwrap();
            prop_assert_eq!(buf.len(), (w * h * 3) as usize);
            prop_assert!(panels.len() <= max_panels);
            prop_assert!(!panels.is_empty(), "even a 200x100 image has room for one panel");
            for p in &panels {
                prop_assert!(p.x0 >= 0 && p.x1 <= w as i32 && p.x1 - p.x0 >= 1, "{:?}", p);
                prop_assert!(p.y0 >= 0 && p.y1 <= h as i32 && p.y1 - p.y0 >= 1, "{:?}", p);
            }
            prop_assert_eq!(panels.len() + not_drawn(&a, &panels, &cfg), n as usize);
            let timeline = render_timeline(&a, &cfg).unwrap();
            prop_assert_eq!(timeline.len(), (w * h * 3) as usize);
            // No text or line touches the border, whatever the size.
            for (name, img) in [("mdtp", &buf), ("timeline", &timeline)] {
                let touching = (0..w).flat_map(|x| [(x, 0), (x, h - 1)]).chain((0..h).flat_map(|y| [(0, y), (w - 1, y)]));
                for (x, y) in touching {
                    prop_assert_eq!(rgb(img, w, (x, y)), [255, 255, 255], "{} {}x{}: ink at ({}, {})", name, w, h, x, y);
                }
            }
        }
    }
}

/// An analysis written into the folder of an earlier one leaves none of the
/// earlier pictures behind (they would show another analysis, in the
/// folder and inside report.html).
#[test]
fn a_second_analysis_into_the_same_folder_leaves_no_old_picture() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("t");
    fragscope().args(["synth", "--pattern", "leak", "--events", "20k", "-o"]).arg(&trace).assert().success();
    let out = tmp.path().join("out");
    fragscope().arg("analyze").arg(&trace).arg("-o").arg(&out).assert().success();
    for f in ["mdtp.png", "timeline.png", "floors.png"] {
        assert!(out.join(f).is_file(), "{f} drawn the first time");
    }
    fragscope().arg("analyze").arg(&trace).arg("-o").arg(&out).arg("--no-plots").assert().success();
    for f in ["mdtp.png", "timeline.png", "floors.png", "view"] {
        assert!(!out.join(f).exists(), "{f} left from the first analysis");
    }
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(!html.contains("floors.png"), "report.html shows an old picture");
}
