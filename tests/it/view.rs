//! The explorable view of `report.html` in a real browser (headless
//! Chromium through the DevTools protocol, [`crate::browser`]): pointing
//! at a known block names it, a wheel zooms the axes asked, the page loads
//! only the tiles in view and logs no error, its ticks are the PNGs', and a
//! zoomed window shows what `mdtp.png` shows for that `--time-window`.

use std::path::Path;
use std::time::Duration;

use fragscope::analysis::{Options, analyze_path};
use fragscope::output::plot::{PlotConfig, render_mdtp};
use fragscope::output::ticks::{self, Unit};
use fragscope::trace::event::{CUDA_ERROR_OUT_OF_MEMORY, Event, EventKind};
use fragscope::trace::{Frame, Source, Stacks, TraceMeta, TraceWriter};
use serde_json::{Value, json};

use crate::browser::{Browser, chromium};
use crate::common::fragscope;

const MIB: u64 = 1 << 20;
const MS: u64 = 1_000_000;
const BASE: u64 = 0x7f00_0000_0000;
const WAIT: Duration = Duration::from_secs(60);

/// From 10 ms: A (4 MiB, train.py) for good; B (4 MiB, model.py
/// attention) from 20 ms to 50 ms; C (64 MiB, optim.py step, called from
/// train.py) from 30 ms; a 40 MiB request fails at 70 ms; the end at 100 ms.
fn known_layout(dir: &Path) {
    use EventKind::*;
    let mut meta = TraceMeta::new(Source::Synthetic);
    meta.capacity_bytes = Some(100 * MIB);
    let mut w = TraceWriter::create(dir, meta, 1000).unwrap();
    let ev = |ms: u64, kind, addr, size, ret, stack: Option<u32>| {
        let mut e = Event { ret, ..Event::new(ms * MS, 1, kind, addr, size) };
        e.extra.stack = stack;
        // The PyTorch columns (stacks among them) are read when every row
        // has a requested size.
        e.extra.requested = Some(size);
        e
    };
    for e in [
        ev(10, Alloc, BASE, 4 * MIB, 0, Some(0)),
        ev(20, Alloc, BASE + 4 * MIB, 4 * MIB, 0, Some(1)),
        ev(30, Alloc, BASE + 8 * MIB, 64 * MIB, 0, Some(2)),
        ev(50, Free, BASE + 4 * MIB, 0, 0, None),
        ev(70, Alloc, 0, 40 * MIB, CUDA_ERROR_OUT_OF_MEMORY, Some(2)),
        ev(100, Launch, 0, 0, 0, None),
    ] {
        w.push(e).unwrap();
    }
    let frame = |f: &str, line, name: &str| Frame { filename: f.into(), line, name: name.into() };
    w.write_stacks(&Stacks {
        frames: vec![
            frame("/w/train.py", 12, "build"),
            frame("/w/model.py", 40, "attention"),
            frame("/w/optim.py", 7, "step"),
            frame("/w/train.py", 30, "main"),
        ],
        stacks: vec![vec![0], vec![1], vec![2, 3]],
    })
    .unwrap();
    w.finish().unwrap();
}

/// `view/manifest.js` as JSON.
fn manifest(out: &Path) -> Value {
    let js = std::fs::read_to_string(out.join("view/manifest.js")).unwrap();
    serde_json::from_str(&js[js.find('(').unwrap() + 1..js.rfind(')').unwrap()]).unwrap()
}

/// Opens the report with its view scrolled into sight, every tile drawn.
fn open_view(b: &mut Browser, out: &Path) {
    b.open(&out.join("report.html"), "");
    b.eval("document.getElementById('fragscope-view').scrollIntoView(); true");
    settle(b);
}

/// Waits until the picture in view is complete.
fn settle(b: &mut Browser) {
    b.wait_for("fragscopeView.last && fragscopeView.last.missing === 0 && fragscopeView.last.shown > 0", WAIT);
}

fn pixel(b: &mut Browser, t: f64, o: f64) -> (f64, f64) {
    let p = b.eval(&format!("fragscopeView.pixelOf({t}, {o})"));
    (p["x"].as_f64().unwrap(), p["y"].as_f64().unwrap())
}

fn tip(b: &mut Browser) -> String {
    b.eval("(function(){var t=document.querySelector('#fragscope-view .tip');return t.style.display==='block'?t.textContent:''})()")
        .as_str()
        .unwrap()
        .to_string()
}

/// Moves the mouse to (x, y) and waits for the tooltip to say `what`.
fn hover_says(b: &mut Browser, (x, y): (f64, f64), what: &str) -> String {
    b.mouse("mouseMoved", x, y);
    let started = std::time::Instant::now();
    loop {
        let t = tip(b);
        if t.contains(what) {
            return t;
        }
        assert!(started.elapsed() < WAIT, "hover at ({x}, {y}): the tooltip says {t:?}, not {what:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn pointing_at_a_known_block_names_it_and_the_wheel_zooms_the_axis_asked() {
    let Some(chrome) = chromium() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, out) = (tmp.path().join("t"), tmp.path().join("out"));
    known_layout(&trace);
    fragscope().arg("analyze").arg(&trace).arg("-o").arg(&out).assert().code(predicates::ord::ge(0));
    assert!(out.join("view/manifest.js").is_file(), "no view written");
    let m = manifest(&out);
    let total = m["panels"][0]["total"].as_f64().unwrap();
    assert_eq!(total, 72.0 * MIB as f64, "{m}");
    let span = m["span"].as_f64().unwrap();
    assert_eq!(span, 90.0 * MS as f64);

    let mut b = Browser::launch(&chrome, 1200, 900);
    open_view(&mut b, &out);

    // C, in the middle of its life and its addresses (times from the
    // first event, at 10 ms; offsets in the collapsed footprint).
    let c = pixel(&mut b, 55.0 * MS as f64, 40.0 * MIB as f64);
    let said = hover_says(&mut b, c, "64.00 MiB");
    for part in ["optim.py:7:step", "allocated 20.000 ms", "process 1"] {
        assert!(said.contains(part), "{said:?} lacks {part:?}");
    }
    // The pixel under the pointer is C's, drawn: blue, not the background.
    let scroll = b.eval("[window.scrollX, window.scrollY]");
    let (sx, sy) = (scroll[0].as_f64().unwrap(), scroll[1].as_f64().unwrap());
    let px = b.screenshot(c.0 + sx - 1.0, c.1 + sy - 1.0, 3.0, 3.0).pixels[4];
    assert!(px[2] > px[0] + 40, "the pixel of C is {px:?}, not blue");
    // B's place once it was freed: free space.
    let hole = pixel(&mut b, 45.0 * MS as f64, 6.0 * MIB as f64);
    hover_says(&mut b, hole, "free space");
    // The OOM at 70 ms (60 ms in): the failed request.
    let oom = pixel(&mut b, 60.0 * MS as f64, 20.0 * MIB as f64);
    let said = hover_says(&mut b, oom, "OOM");
    assert!(said.contains("40.00 MiB"), "{said:?}");
    // The next-OOM button centres the OOM and names it.
    b.eval("document.querySelector('#fragscope-view .oom-next').click(); true");
    let st = b.eval("fragscopeView.state()");
    let centre = (st["ta"].as_f64().unwrap() + st["tb"].as_f64().unwrap()) / 2.0;
    assert!((centre - 60.0 * MS as f64).abs() < 1.0, "{st}");
    let said = b.eval("document.querySelector('#fragscope-view .oom-at').textContent");
    assert!(said.as_str().unwrap().starts_with("OOM 1 of 1 at 60.000 ms: 40.00 MiB requested"), "{said}");
    b.eval("fragscopeView.setView(0, 1e18, 0, 1e18); true");
    settle(&mut b);
    // A click keeps C, with its whole stack.
    b.mouse("mouseMoved", c.0, c.1);
    for kind in ["mousePressed", "mouseReleased"] {
        b.call(
            "Input.dispatchMouseEvent",
            json!({"type": kind, "x": c.0, "y": c.1, "button": "left", "clickCount": 1}),
        );
    }
    b.wait_for("document.querySelector('#fragscope-view .details').textContent.indexOf('train.py:30:main') >= 0", WAIT);

    // A search by file name highlights B, the one block from model.py.
    b.eval(
        "var s=document.querySelector('#fragscope-view input.search');s.value='model.py';s.dispatchEvent(new Event('input'));true",
    );
    b.wait_for("document.querySelector('#fragscope-view .found').textContent.indexOf('1 blocks') === 0", WAIT);

    // Shift + wheel over the plot: time only, around the pointer.
    let plot = b.eval("fragscopeView.pixelOf(0, 0).plot");
    let (px0, py0, pw, ph) = (
        plot["x"].as_f64().unwrap(),
        plot["y"].as_f64().unwrap(),
        plot["w"].as_f64().unwrap(),
        plot["h"].as_f64().unwrap(),
    );
    let before = b.eval("fragscopeView.state()");
    b.wheel(px0 + pw / 2.0, py0 + ph / 2.0, -500.0, 8);
    let after = b.eval("fragscopeView.state()");
    let width = |s: &Value, a: &str, z: &str| s[z].as_f64().unwrap() - s[a].as_f64().unwrap();
    assert!((width(&after, "ta", "tb") / width(&before, "ta", "tb") - 0.5).abs() < 1e-6, "{before} → {after}");
    assert_eq!(width(&after, "oa", "ob"), width(&before, "oa", "ob"), "the address axis moved");
    let centre = 45.0 * MS as f64;
    assert!((after["ta"].as_f64().unwrap() - (centre - width(&after, "ta", "tb") / 2.0)).abs() < 0.01 * span);
    // The wheel over the address axis: address only.
    b.wheel(px0 - 30.0, py0 + ph / 2.0, -500.0, 0);
    let last = b.eval("fragscopeView.state()");
    assert!((width(&last, "oa", "ob") / width(&after, "oa", "ob") - 0.5).abs() < 1e-6, "{after} → {last}");
    assert_eq!(width(&last, "ta", "tb"), width(&after, "ta", "tb"), "the time axis moved");
    // A double-click resets both.
    for (kind, count) in [("mousePressed", 1), ("mouseReleased", 1), ("mousePressed", 2), ("mouseReleased", 2)] {
        b.call(
            "Input.dispatchMouseEvent",
            json!({"type": kind, "x": px0 + 10.0, "y": py0 + 10.0, "button": "left", "clickCount": count}),
        );
    }
    b.wait_for(&format!("fragscopeView.state().tb === {span} && fragscopeView.state().ob === {total}"), WAIT);

    // The address bar keeps the view, and a link to it opens it.
    b.eval(&format!("fragscopeView.setView({}, {}, 0, {}); true", 20 * MS, 50 * MS, 36 * MIB));
    b.wait_for("location.hash.indexOf('#fragscope-view=0,20000000,50000000,0,') === 0", WAIT);
    let link = b.eval("location.hash").as_str().unwrap().to_string();
    // Away first: the same page with another fragment would not load again.
    b.call("Page.navigate", json!({"url": "about:blank"}));
    b.wait_for("location.href === 'about:blank'", WAIT);
    b.open(&out.join("report.html"), &link);
    b.wait_for("fragscopeView.state() && fragscopeView.state().ta === 20000000", WAIT);
    let st = b.eval("fragscopeView.state()");
    assert_eq!((st["tb"].as_f64().unwrap(), st["ob"].as_f64().unwrap()), (50.0 * MS as f64, 36.0 * MIB as f64), "{st}");

    // The page's ticks are the PNGs'.
    for (lo, hi, max, unit, name) in [
        (0.0, 3.9 * 1073741824.0, 6, Unit::Bytes, "bytes"),
        (0.0, 1.6 * 1073741824.0, 5, Unit::Bytes, "bytes"),
        (4.0 * 1073741824.0, 7.5 * 1073741824.0, 5, Unit::Bytes, "bytes"),
        (0.0, 0.9e9, 6, Unit::Time, "time"),
        (0.0, 1.5e9, 4, Unit::Time, "time"),
        (12.5e6, 13.1e6, 8, Unit::Time, "time"),
        (0.0, 7.0 * 3600e9, 5, Unit::Time, "time"),
        (0.0, 45e3, 5, Unit::Time, "time"),
        (0.0, 1234.0, 5, Unit::Count, "count"),
    ] {
        let rust = ticks::labels(&ticks::ticks(lo, hi, max, unit), unit);
        let js = b.eval(&format!("fragscopeView.ticks({lo}, {hi}, {max}, '{name}').labels"));
        assert_eq!(js, json!(rust), "ticks of {lo}..{hi} ({name})");
    }
    let errors = b.console_errors();
    assert!(errors.is_empty(), "the console has errors: {errors:?}");
    assert!(b.eval("fragscopeView.errors.length === 0") == json!(true));
}

/// The tiles a view needs at its level: their file numbers.
fn tiles_in_view(m: &Value, state: &Value) -> std::collections::BTreeSet<i64> {
    let p = &m["panels"][0];
    let (t, a) = (state["level"][0].as_u64().unwrap(), state["level"][1].as_u64().unwrap());
    let ids = p["levels"][format!("{t}-{a}")].as_array().unwrap();
    let (nt, na) = (1u64 << t, 1u64 << a);
    let (span, total) = (m["span"].as_f64().unwrap(), p["total"].as_f64().unwrap());
    let f = |k: &str| state[k].as_f64().unwrap();
    let mut out = std::collections::BTreeSet::new();
    for ty in 0..na {
        for tx in 0..nt {
            let (t0, t1) = (span * tx as f64 / nt as f64, span * (tx + 1) as f64 / nt as f64);
            let (o0, o1) = (total * ty as f64 / na as f64, total * (ty + 1) as f64 / na as f64);
            if t1 > f("ta") && t0 < f("tb") && o1 > f("oa") && o0 < f("ob") {
                out.insert(ids[(ty * nt + tx) as usize].as_i64().unwrap());
            }
        }
    }
    out.remove(&-1);
    out
}

fn tile_requests(b: &Browser) -> Vec<i64> {
    b.requests().iter().filter_map(|u| u.rsplit_once("/view/tiles/")?.1.strip_suffix(".png")?.parse().ok()).collect()
}

/// Mean of `img` over a `n` × `n` grid of cells, per channel.
fn cells(pixels: &dyn Fn(u32, u32) -> [u8; 3], w: u32, h: u32, n: u32) -> Vec<[f64; 3]> {
    let mut out = Vec::new();
    for cy in 0..n {
        for cx in 0..n {
            let (x0, x1, y0, y1) = (cx * w / n, (cx + 1) * w / n, cy * h / n, (cy + 1) * h / n);
            let mut sum = [0.0; 3];
            for y in y0..y1 {
                for x in x0..x1 {
                    let p = pixels(x, y);
                    (0..3).for_each(|k| sum[k] += p[k] as f64);
                }
            }
            let count = ((x1 - x0) * (y1 - y0)).max(1) as f64;
            out.push(sum.map(|s| s / count));
        }
    }
    out
}

#[test]
fn only_tiles_in_view_load_and_a_zoomed_window_matches_mdtp_of_that_time_window() {
    let Some(chrome) = chromium() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, out) = (tmp.path().join("t"), tmp.path().join("out"));
    fragscope().args(["synth", "--pattern", "steady", "--events", "200k", "-o"]).arg(&trace).assert().success();
    fragscope().arg("analyze").arg(&trace).arg("-o").arg(&out).assert().success();
    let m = manifest(&out);
    let p = &m["panels"][0];
    let zt = p["zt"].as_u64().unwrap();
    assert!(zt >= 3, "a 200 k-event steady trace gets at least 3 time levels: {}", p["levels"]);
    let (span, total) = (m["span"].as_f64().unwrap(), p["total"].as_f64().unwrap());

    let mut b = Browser::launch(&chrome, 720, 900); // narrow: the deepest level is deeper than the first shown
    open_view(&mut b, &out);
    let state = b.eval("fragscopeView.state()");
    let first: Vec<i64> = tile_requests(&b);
    let wanted = tiles_in_view(&m, &state);
    assert!(!first.is_empty());
    for id in &first {
        assert!(wanted.contains(id), "tile {id} was loaded but is not in view ({state})");
    }

    // Zoomed to the second column of the deepest time level, whole height.
    let (ta, tb) = (span / (1u64 << zt) as f64, 2.0 * span / (1u64 << zt) as f64);
    let seen = first.len();
    let state = b.eval(&format!("fragscopeView.setView({ta}, {tb}, 0, {total})"));
    settle(&mut b);
    assert_eq!(state["level"][0].as_u64().unwrap(), zt, "{state}");
    let wanted = tiles_in_view(&m, &state);
    let later = tile_requests(&b);
    assert!(later.len() > seen, "zooming in loaded no tile");
    for id in &later[seen..] {
        assert!(wanted.contains(id), "tile {id} was loaded but is not in view ({state})");
    }
    assert!(later.len() - seen <= wanted.len(), "more tiles loaded than in view");

    // The screenshot of that window against mdtp.png of the same
    // --time-window: the same picture at two resolutions, compared over a
    // 24 × 24 grid of cell means.
    let plot = b.eval("fragscopeView.pixelOf(0, 0).plot");
    let scroll = b.eval("[window.scrollX, window.scrollY]");
    let g = |v: &Value| v.as_f64().unwrap();
    // Iteration lines and marks off for the picture: tiles only.
    b.eval("fragscopeView.marksOff = true; fragscopeView.redraw(); true");
    let shot = b.screenshot(
        g(&plot["x"]) + g(&scroll[0]),
        g(&plot["y"]) + g(&scroll[1]),
        g(&plot["w"]).floor(),
        g(&plot["h"]).floor(),
    );
    // mdtp.png of the window at the tile's own resolution, a plot 256
    // pixels wide: a block shorter than a column gets one, so two
    // resolutions of the same window differ where blocks are short.
    let a = analyze_path(&trace, &Options { layout: true, ..Options::default() }).unwrap();
    let window = Some((ta.round() as u64, tb.round() as u64));
    let render = |width: u32| {
        let cfg = PlotConfig { width, height: 600, time_window: window, ..PlotConfig::default() };
        let (buf, panels) = render_mdtp(&a, a.layout.as_ref().unwrap(), &cfg).unwrap();
        (cfg, buf, panels[0])
    };
    let (_, _, q) = render(600);
    let (cfg, buf, q) = render((600 + 256 - (q.x1 - q.x0)) as u32);
    assert_eq!(q.x1 - q.x0, 256, "the plot of mdtp.png is not a tile wide");
    let png = |x: u32, y: u32| {
        let i = (((q.y0 as u32 + y) * cfg.width + q.x0 as u32 + x) * 3) as usize;
        [buf[i], buf[i + 1], buf[i + 2]]
    };
    let view = |x: u32, y: u32| shot.pixels[(y * shot.width + x) as usize];
    let n = 24;
    let (va, pa) =
        (cells(&view, shot.width, shot.height, n), cells(&png, (q.x1 - q.x0) as u32, (q.y1 - q.y0) as u32, n));
    let diff: f64 =
        va.iter().zip(&pa).map(|(x, y)| (0..3).map(|k| (x[k] - y[k]).abs()).sum::<f64>() / 3.0).sum::<f64>()
            / va.len() as f64;
    // Measured: 1.3 for this window, 15.4 for the window shifted by a
    // tenth of its width.
    assert!(diff < 6.0, "the zoomed view and mdtp.png of the window differ by {diff:.1} levels a cell on average");
    let errors = b.console_errors();
    assert!(errors.is_empty(), "the console has errors: {errors:?}");
}

/// `FRAGSCOPE_VIEW_SHOT=OUT.png cargo test --release view_screenshot --
/// --ignored`: the view of the bundled example (or of the trace or
/// snapshot `FRAGSCOPE_VIEW_INPUT`), zoomed and pointing at a block, as in
/// the README (docs/view-fragmenting.png).
#[test]
#[ignore]
fn view_screenshot() {
    let Ok(shot) = std::env::var("FRAGSCOPE_VIEW_SHOT") else { return };
    let chrome = chromium().expect("no chromium");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let example = std::env::var_os("FRAGSCOPE_VIEW_INPUT")
        .map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/fragmenting-small"), Into::into);
    fragscope().arg("analyze").arg(&example).arg("-o").arg(&out).assert().code(predicates::ord::ge(0));
    let mut b = Browser::launch(&chrome, 1100, 1100);
    open_view(&mut b, &out);
    let m = manifest(&out);
    let (span, total) = (m["span"].as_f64().unwrap(), m["panels"][0]["total"].as_f64().unwrap());
    b.eval(&format!("fragscopeView.setView({}, {}, 0, {total}); true", span * 0.35, span * 0.6));
    settle(&mut b);
    // Pointing at a block: the first of a few places that has one.
    for k in 0..40 {
        let (x, y) = pixel(&mut b, span * (0.4 + 0.005 * k as f64), total * (0.2 + 0.017 * k as f64));
        b.eval("fragscopeView.lastHit = undefined; true");
        b.mouse("mouseMoved", x, y);
        b.wait_for("fragscopeView.lastHit !== undefined", WAIT);
        if b.eval("fragscopeView.lastHit && fragscopeView.lastHit.exact") == json!(true) {
            break;
        }
    }
    let r = b.eval(
        "(function(){var r=document.getElementById('fragscope-view').getBoundingClientRect();\
         return [r.left+window.scrollX, r.top+window.scrollY, r.width, r.height]})()",
    );
    let g = |i: usize| r[i].as_f64().unwrap();
    let img = b.call(
        "Page.captureScreenshot",
        json!({"format": "png", "clip": {"x": g(0), "y": g(1), "width": g(2), "height": g(3).min(1000.0), "scale": 1}}),
    );
    use base64::Engine as _;
    let png = base64::engine::general_purpose::STANDARD.decode(img["data"].as_str().unwrap()).unwrap();
    std::fs::write(&shot, png).unwrap();
}

/// `FRAGSCOPE_VIEW_BENCH=OUT cargo test --release view_budgets -- --ignored
/// --nocapture` (scripts/bench-view): the view of the analysis in OUT, in a
/// fresh browser each run: the first complete picture after navigation,
/// then 8 zoom steps (×2 in, alternating both axes and time only), 6 drags
/// and 8 zoom steps out, each from its event to its complete picture; then
/// 40 hovers: a block named that holds the point and is a pixel or more
/// wide and tall must be drawn there. Prints one JSON line per run.
#[test]
#[ignore]
fn view_budgets() {
    let Ok(out) = std::env::var("FRAGSCOPE_VIEW_BENCH") else { return };
    let out = Path::new(&out);
    let chrome = chromium().expect("no chromium");
    let runs: usize = std::env::var("RUNS").ok().and_then(|r| r.parse().ok()).unwrap_or(5);
    let m = manifest(out);
    for _ in 0..runs {
        let mut b = Browser::launch(&chrome, 1280, 900);
        b.open(&out.join("report.html"), "#fragscope-view");
        b.wait_for("fragscopeView.firstComplete !== undefined", WAIT);
        let first = b.eval("fragscopeView.firstComplete").as_f64().unwrap();
        let plot = b.eval("fragscopeView.pixelOf(0, 0).plot");
        let g = |k: &str| plot[k].as_f64().unwrap();
        let (cx, cy) = (g("x") + g("w") * 0.4, g("y") + g("h") * 0.55);
        let step = |b: &mut Browser, n: usize| {
            b.wait_for(&format!("fragscopeView.steps.length >= {n}"), WAIT);
        };
        let mut n = 0;
        for k in 0..8 {
            b.wheel(cx, cy, -500.0, if k % 2 == 0 { 0 } else { 8 });
            n += 1;
            step(&mut b, n);
        }
        for k in 0..6 {
            let dx = if k % 2 == 0 { 150.0 } else { -90.0 };
            b.call(
                "Input.dispatchMouseEvent",
                json!({"type": "mousePressed", "x": cx, "y": cy, "button": "left", "clickCount": 1}),
            );
            b.call(
                "Input.dispatchMouseEvent",
                json!({"type": "mouseMoved", "x": cx + dx, "y": cy + 20.0, "button": "left", "buttons": 1}),
            );
            b.call(
                "Input.dispatchMouseEvent",
                json!({"type": "mouseReleased", "x": cx + dx, "y": cy + 20.0, "button": "left", "clickCount": 1}),
            );
            n += 1;
            step(&mut b, n);
        }
        for k in 0..8 {
            b.wheel(cx, cy, 500.0, if k % 2 == 0 { 0 } else { 8 });
            n += 1;
            step(&mut b, n);
        }
        let list = |b: &mut Browser, what: &str| -> Vec<f64> {
            let mut v: Vec<f64> = b.eval(what).as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let steps = list(&mut b, "fragscopeView.steps");
        let frames = list(&mut b, "fragscopeView.frames");
        // Hovers over the whole view, back at the start.
        b.eval(&format!("fragscopeView.setView(0, {}, 0, {}); true", m["span"], m["panels"][0]["total"]));
        settle(&mut b);
        let scroll = b.eval("[window.scrollX, window.scrollY]");
        let (sx, sy) = (scroll[0].as_f64().unwrap(), scroll[1].as_f64().unwrap());
        let (mut named, mut exact, mut drawn) = (0, 0, 0);
        for k in 0..40 {
            let (x, y) = (
                g("x") + g("w") * ((k * 37 % 40) as f64 + 0.5) / 40.0,
                g("y") + g("h") * ((k * 13 % 40) as f64 + 0.5) / 40.0,
            );
            b.eval("fragscopeView.lastHit = undefined; true");
            b.mouse("mouseMoved", x, y);
            b.wait_for("fragscopeView.lastHit !== undefined", WAIT);
            let hit = b.eval("fragscopeView.lastHit");
            if hit.is_null() {
                continue;
            }
            named += 1;
            let said = tip(&mut b);
            let size = hit["block"][3].as_f64().unwrap();
            assert!(said.contains("call site"), "{said:?}");
            assert!(size > 0.0);
            // Blocks at least a pixel wide and tall: the pixel is theirs.
            let st = b.eval("fragscopeView.state()");
            let f = |v: &Value| v.as_f64().unwrap();
            let wide = (f(&hit["block"][1]) - f(&hit["block"][0])) / (f(&st["tb"]) - f(&st["ta"])) * g("w") >= 1.0;
            let tall = size / (f(&st["ob"]) - f(&st["oa"])) * g("h") >= 1.0;
            if hit["exact"] == json!(true) && wide && tall {
                exact += 1;
                let px = b.screenshot(x + sx, y + sy, 1.0, 1.0).pixels[0];
                if px != [255, 255, 255] && px != [225, 225, 225] {
                    drawn += 1;
                }
            }
        }
        let errors = b.console_errors();
        assert!(errors.is_empty(), "the console has errors: {errors:?}");
        println!(
            "{}",
            json!({
                "first_paint_ms": first,
                "steps": steps.len(),
                "first_frame_median_ms": frames[frames.len() / 2],
                "first_frame_max_ms": frames[frames.len() - 1],
                "complete_median_ms": steps[steps.len() / 2],
                "complete_max_ms": steps[steps.len() - 1],
                "hovers": 40, "named": named, "exact": exact, "exact_drawn": drawn,
            })
        );
        assert_eq!(drawn, exact, "a block named under the pointer was not drawn there");
    }
}

#[test]
fn every_panel_of_the_mdtp_can_be_chosen_and_pointed_at() {
    let Some(chrome) = chromium() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, out) = (tmp.path().join("t"), tmp.path().join("out"));
    fragscope().args(["synth", "--pattern", "multi", "--events", "40k", "-o"]).arg(&trace).assert().success();
    fragscope().arg("analyze").arg(&trace).arg("-o").arg(&out).assert().code(predicates::ord::ge(0));
    let m = manifest(&out);
    let panels = m["panels"].as_array().unwrap();
    assert_eq!(panels.len(), 4, "four ranks, four panels");
    let mut b = Browser::launch(&chrome, 1000, 900);
    open_view(&mut b, &out);
    let options = b.eval("Array.prototype.map.call(document.querySelectorAll('#fragscope-view select.panel option'), function (o) { return o.textContent; })");
    let labels: Vec<Value> = panels.iter().map(|p| p["label"].clone()).collect();
    assert_eq!(options, json!(labels));
    for k in [2, 3] {
        b.eval(&format!(
            "var s=document.querySelector('#fragscope-view select.panel');s.value='{k}';s.dispatchEvent(new Event('change'));true"
        ));
        settle(&mut b);
        assert_eq!(b.eval("fragscopeView.state().panel"), json!(k));
        // Some block of this panel is under one of a few points.
        let (span, total) = (m["span"].as_f64().unwrap(), panels[k]["total"].as_f64().unwrap());
        let mut named = None;
        for i in 0..20 {
            let at = pixel(&mut b, span * (0.1 + 0.04 * i as f64), total * (0.1 + 0.04 * i as f64));
            b.eval("fragscopeView.lastHit = undefined; true");
            b.mouse("mouseMoved", at.0, at.1);
            b.wait_for("fragscopeView.lastHit !== undefined", WAIT);
            if b.eval("fragscopeView.lastHit !== null") == json!(true) {
                named = Some(tip(&mut b));
                break;
            }
        }
        let said = named.unwrap_or_else(|| panic!("no block named in panel {k}"));
        let label = panels[k]["label"].as_str().unwrap();
        assert!(said.contains(label), "{said:?} does not name {label}");
    }
    let errors = b.console_errors();
    assert!(errors.is_empty(), "the console has errors: {errors:?}");
}
