//! `timeline.png`: live (allocated) and reserved bytes with the budget or
//! its interval, the retries that released PyTorch's cache and the
//! recommended setting's replayed reserved bytes; the score and its
//! weighted components; and the online forecast with its risk strip,
//! panel under panel on one time axis.

use anyhow::Result;
use plotters::prelude::*;

use super::frame::{
    FONT, PlotConfig, TITLE_PAD, Ticked, check_size, draw_err, fit_title, fonts, text_width, time_axis, title_font,
    x_ticks_for, y_ticks_for,
};
use super::idle::TimeMap;
use crate::analysis::Analysis;
use crate::analysis::predict::Risk;
use crate::output::ticks::{Axis, Unit};

pub(super) type Panel<'a, 'b> = ChartContext<'a, BitMapBackend<'b>, Cartesian2d<Ticked, Ticked>>;

/// Timeline panels whose plot is shorter or narrower than this have no
/// legend (the widest entry, the forecast's, needs about 440 px).
pub(super) const LEGEND_FROM_HEIGHT: u32 = 110;
pub(super) const TIMELINE_LEGEND_FROM_WIDTH: u32 = 460;

/// Height of the forecast panel's risk strip, in score points.
pub(super) const RISK_STRIP: f64 = 6.0;

/// One timeline panel over the whole trace: axes, labels, `y` range;
/// the idle stretches `time` shortens are drawn as grey breaks.
pub(super) fn timeline_panel<'a, 'b>(
    area: &'a DrawingArea<BitMapBackend<'b>, plotters::coord::Shift>,
    time: &TimeMap,
    y: std::ops::Range<f64>,
    y_desc: &str,
    y_unit: Unit,
    last: bool,
    entries: bool,
) -> Result<Panel<'a, 'b>> {
    let (w, h) = area.dim_in_pixel();
    let span = time.span();
    let x_axis = if time.is_identity() {
        time_axis(0.0, span, x_ticks_for(w.saturating_sub(110)), entries, false)
    } else {
        time.axis(x_ticks_for(w.saturating_sub(110)))
    };
    // A panel too short for labels (a tiny image) is drawn bare.
    let tiny = h < 75;
    let y_axis = if tiny {
        Axis { at: Vec::new(), labels: Vec::new() }
    } else {
        Axis::new(y.start, y.end, y_ticks_for(h.saturating_sub(46)).min(6), y_unit)
    };
    // The panels share the time axis: only the last one labels it, and
    // only when its panel has the room.
    let x_labels = if last && !tiny { 30 } else { 0 };
    let mut c = ChartBuilder::on(area)
        .margin(if tiny { 4 } else { 8 })
        .margin_right((text_width(x_axis.widest(), 12) / 2 + 4).max(8))
        .x_label_area_size(x_labels)
        .y_label_area_size((text_width(y_axis.widest(), 12) + 24).max(84))
        .build_cartesian_2d(Ticked::new(0f64..span, &x_axis), Ticked::new(y.clone(), &y_axis))
        .map_err(draw_err)?;
    c.configure_mesh()
        .label_style((FONT, 12))
        .y_desc(if tiny { "" } else { y_desc })
        .x_desc(match (last, entries) {
            (false, _) => "",
            (true, true) => "trace entry (no timestamps)",
            (true, false) => "time",
        })
        .x_label_formatter(&|v| x_axis.label(*v))
        .y_label_formatter(&|v| y_axis.label(*v))
        .draw()
        .map_err(draw_err)?;
    for (from, to, _) in time.breaks() {
        let band = [(from, y.start), (to, y.end)];
        c.draw_series(std::iter::once(Rectangle::new(band, RGBColor(228, 228, 228).filled()))).map_err(draw_err)?;
        for edge in [from, to] {
            let line = PathElement::new(vec![(edge, y.start), (edge, y.end)], RGBColor(150, 150, 150));
            c.draw_series(std::iter::once(line)).map_err(draw_err)?;
        }
    }
    Ok(c)
}

/// A line series with its legend entry.
pub(super) fn line<'a, 'b>(
    c: &mut Panel<'a, 'b>,
    points: Vec<(f64, f64)>,
    colour: RGBColor,
    width: u32,
    label: &str,
) -> Result<()> {
    c.draw_series(LineSeries::new(points, colour.stroke_width(width)))
        .map_err(draw_err)?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour));
    Ok(())
}

/// Iteration boundaries (light grey), OOM markers across the panel, then
/// the legend where the panel is tall enough for it.
pub(super) fn finish_panel<'a, 'b: 'a>(
    c: &mut Panel<'a, 'b>,
    iterations: &[f64],
    ooms: &[f64],
    top: f64,
) -> Result<()> {
    for &b in iterations {
        c.draw_series(std::iter::once(PathElement::new(vec![(b, 0.0), (b, top)], RGBColor(190, 190, 190))))
            .map_err(draw_err)?;
    }
    for &o in ooms {
        c.draw_series(std::iter::once(PathElement::new(vec![(o, 0.0), (o, top)], RED))).map_err(draw_err)?;
    }
    let (pw, ph) = c.plotting_area().dim_in_pixel();
    if ph < LEGEND_FROM_HEIGHT || pw < TIMELINE_LEGEND_FROM_WIDTH {
        return Ok(());
    }
    c.configure_series_labels()
        .label_font((FONT, 12))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(draw_err)?;
    Ok(())
}

/// Renders the timeline: live bytes; score and its weighted components;
/// the online forecast; risk bands; OOM markers.
pub fn render_timeline(a: &Analysis, cfg: &PlotConfig) -> Result<Vec<u8>> {
    fonts()?;
    let (w, h) = (cfg.width, cfg.height);
    check_size(w, h)?;
    let mut buf = vec![255u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        let root = root
            .margin(TITLE_PAD, 0, 0, 0)
            .titled(
                &fit_title(&[format!("{} — metrics over time", a.trace.name), a.trace.name.clone()], w),
                (FONT, title_font(w)),
            )
            .map_err(draw_err)?;
        // Pinned host memory, when the snapshot recorded it: a panel of
        // its own, below the device's.
        let host = a.trace.meta.as_ref().and_then(|m| m.details.snapshot()).and_then(|d| d.host.as_ref());
        let panels = root.split_evenly((if host.is_some() { 4 } else { 3 }, 1));
        let t0 = a.first_ts;
        let pid = cfg.pid.or_else(|| {
            a.predictions.iter().reduce(|b, p| if p.prediction.risk > b.prediction.risk { p } else { b }).map(|p| p.pid)
        });
        let entries = a.entry_order();
        let time = time_map(a, pid, entries);
        let span = time.span();
        let at = |t: u64| time.x(t.saturating_sub(t0) as f64);
        let rows: Vec<&crate::analysis::Row> = a.rows.iter().filter(|r| !r.at_oom && Some(r.pid) == pid).collect();
        let x = |r: &crate::analysis::Row| at(r.t_ns);
        let ooms: Vec<f64> = a.ooms.iter().filter(|o| Some(o.pid) == pid).map(|o| at(o.t_ns)).collect();
        // Iteration starts, when few enough to tell apart (one per 4 px).
        let iterations: Vec<f64> = a
            .iterations
            .iter()
            .filter(|it| Some(it.pid) == pid && it.boundaries_t_ns.len() as u32 <= w / 4)
            .flat_map(|it| it.boundaries_t_ns.iter().map(|&b| at(b)))
            .collect();
        let score: Vec<(f64, f64)> = rows.iter().map(|r| (x(r), r.metrics.score)).collect();

        // 1. Live bytes; for PyTorch's allocator, reserved beside them,
        // the budget (or its interval), the retries that released the
        // cache, and what the recommended setting's replay reserves.
        let m = Memory::of(a, pid, &at);
        let reserved: Vec<(f64, f64)> = if a.allocator_view {
            rows.iter().map(|r| (x(r), r.alloc.map_or(r.metrics.span_bytes, |al| al.reserved_bytes) as f64)).collect()
        } else {
            Vec::new()
        };
        let top = rows
            .iter()
            .map(|r| r.metrics.live_bytes as f64)
            .chain(reserved.iter().map(|p| p.1))
            .chain(m.budget.map(|b| b.1 as f64))
            .chain(m.best.iter().flat_map(|(_, pts)| pts.iter().map(|p| p.1)))
            .fold(1.0, f64::max)
            * 1.05;
        let mut c = timeline_panel(&panels[0], &time, 0.0..top, "bytes", Unit::Bytes, false, entries)?;
        // What each break stands for, written up its band.
        for (from, to, idle) in time.breaks() {
            let text = super::idle::label(idle);
            let font = (FONT, 12).into_font().transform(FontTransform::Rotate90).color(&RGBColor(90, 90, 90));
            c.draw_series(std::iter::once(Text::new(text, ((from + to) / 2.0, top * 0.97), font))).map_err(draw_err)?;
        }
        if let Some((lo, hi)) = m.budget {
            if hi > lo {
                let band = [(0.0, lo as f64), (span, hi as f64)];
                c.draw_series(std::iter::once(Rectangle::new(band, RGBColor(255, 205, 210).mix(0.5).filled())))
                    .map_err(draw_err)?;
            }
            let label = if hi > lo { "budget (the interval the recording allows)" } else { "budget" };
            line(&mut c, vec![(0.0, lo as f64), (span, lo as f64)], RED, 1, label)?;
        }
        let orange = RGBColor(255, 140, 0);
        for (k, &f) in m.retries.iter().enumerate() {
            let drawn =
                c.draw_series(std::iter::once(PathElement::new(vec![(f, 0.0), (f, top)], orange))).map_err(draw_err)?;
            if k == 0 {
                drawn
                    .label("cache released to retry a request")
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], orange));
            }
        }
        if !reserved.is_empty() {
            line(&mut c, reserved, RGBColor(120, 120, 120), 2, "reserved")?;
        }
        if let Some((label, pts)) = m.best {
            line(&mut c, pts, RGBColor(44, 160, 44), 1, &format!("reserved under {label} (replayed)"))?;
        }
        let live = rows.iter().map(|r| (x(r), r.metrics.live_bytes as f64)).collect();
        let what = if a.allocator_view { "allocated (device" } else { "live bytes (process" };
        line(&mut c, live, BLUE, 2, &format!("{what} {})", a.who(pid.unwrap_or(0))))?;
        finish_panel(&mut c, &iterations, &ooms, top)?;

        // 2. Score and its weighted components, risk bands behind.
        let mut c = timeline_panel(&panels[1], &time, 0.0..100.0, "score", Unit::Count, false, entries)?;
        for (lo, hi, colour) in [(70.0, 80.0, RGBColor(255, 224, 178)), (80.0, 100.0, RGBColor(255, 205, 210))] {
            c.draw_series(std::iter::once(Rectangle::new([(0.0, lo), (span, hi)], colour.mix(0.6).filled())))
                .map_err(draw_err)?;
        }
        let names =
            ["fragmentation (50·2E)", "unusable index (15·K)", "allocation mix (10·(0.6S+0.4C))", "large gaps (25·L)"];
        let colours = [RGBColor(31, 119, 180), RGBColor(255, 127, 14), RGBColor(44, 160, 44), RGBColor(148, 103, 189)];
        for (k, (name, colour)) in names.iter().zip(colours).enumerate() {
            let points =
                rows.iter().map(|r| (x(r), crate::analysis::metrics::score_components(&r.metrics)[k])).collect();
            line(&mut c, points, colour, 1, name)?;
        }
        line(&mut c, score.clone(), BLACK, 2, "score")?;
        finish_panel(&mut c, &iterations, &ooms, 100.0)?;

        // 3. Online forecast against the score; the online risk is a strip
        // along the bottom, so both lines stay visible above it.
        let mut c = timeline_panel(&panels[2], &time, 0.0..100.0, "forecast", Unit::Count, host.is_none(), entries)?;
        for pair in rows.windows(2) {
            let colour = match pair[0].risk_online {
                Some(Risk::Critical) => RGBColor(255, 205, 210),
                Some(Risk::High) => RGBColor(255, 224, 178),
                _ => continue,
            };
            let strip = [(x(pair[0]), 0.0), (x(pair[1]), RISK_STRIP)];
            c.draw_series(std::iter::once(Rectangle::new(strip, colour.filled()))).map_err(draw_err)?;
        }
        line(&mut c, score, BLACK, 1, "score")?;
        let forecast = rows.iter().filter_map(|r| Some((x(r), *r.forecast.as_ref()?.first()?))).collect();
        line(&mut c, forecast, MAGENTA, 1, "online forecast, next step (strip: fragmentation level high, critical)")?;
        finish_panel(&mut c, &iterations, &ooms, 100.0)?;

        // 4. Pinned host memory: its pool's reserved and allocated bytes.
        if let Some(h) = host {
            let inside = |t: u64| t >= t0 && t <= a.last_ts.max(t0 + 1);
            let pts: Vec<&(u64, u64, u64)> = h.series.iter().filter(|p| inside(p.0)).collect();
            let top = pts.iter().map(|p| p.2.max(p.1) as f64).fold(1.0, f64::max) * 1.05;
            let mut c = timeline_panel(&panels[3], &time, 0.0..top, "pinned host", Unit::Bytes, true, entries)?;
            let x = at;
            line(
                &mut c,
                pts.iter().map(|p| (x(p.0), p.2 as f64)).collect(),
                RGBColor(120, 120, 120),
                2,
                "host reserved",
            )?;
            line(
                &mut c,
                pts.iter().map(|p| (x(p.0), p.1 as f64)).collect(),
                RGBColor(0, 128, 128),
                2,
                "host allocated",
            )?;
            finish_panel(&mut c, &iterations, &[], top)?;
        }
        root.present().map_err(draw_err)?;
    }
    Ok(buf)
}

/// What the top panel draws of the memory a unit needs: the budget
/// (low and high end), the retries' times, and the recommended setting's
/// replayed reserved bytes, all on the panel's time axis.
struct Memory {
    budget: Option<(u64, u64)>,
    retries: Vec<f64>,
    best: Option<(String, Vec<(f64, f64)>)>,
}

impl Memory {
    fn of(a: &Analysis, pid: Option<u32>, at: &dyn Fn(u64) -> f64) -> Memory {
        let mut m = Memory { budget: None, retries: Vec::new(), best: None };
        let (Some(pid), Some(w)) = (pid, a.whatif.as_ref()) else { return m };
        m.budget = a
            .decision
            .as_ref()
            .and_then(|d| d.memory.iter().find(|u| u.unit == pid))
            .and_then(|u| u.budget.as_ref())
            .map(|b| (b.lo_bytes, b.hi_bytes));
        m.retries =
            w.retry_times.iter().filter(|(d, _)| *d == pid).flat_map(|(_, t)| t.iter().map(|&t| at(t))).collect();
        let j = w.fidelity.iter().position(|f| f.device == pid);
        if let (Some(j), Some(s)) = (j, w.scenarios.get(w.recommended.0).filter(|_| w.recommended.0 != 0))
            && let Some(o) = s.devices.get(j)
        {
            let pts = o.series.iter().map(|&(t, r, _)| (at(t), r as f64)).collect();
            m.best = Some((crate::analysis::whatif::scenario_label(&w.recorded_conf, &s.conf).replace('`', ""), pts));
        }
        m
    }
}

/// The time axis of `pid`'s timeline (every process's, with none): its
/// idle stretches shortened ([`TimeMap`]), judged by when blocks and
/// segments were allocated and freed, when requests failed, and by the
/// iteration period. True
/// time for a trace without timestamps.
pub(super) fn time_map(a: &Analysis, pid: Option<u32>, entries: bool) -> TimeMap {
    let t0 = a.first_ts;
    let span = (a.last_ts.max(t0 + 1) - t0) as f64;
    let Some(layout) = a.layout.as_ref().filter(|_| !entries) else { return TimeMap::identity(span) };
    let mine = |l: &crate::analysis::layout::Lifetime| pid.is_none_or(|p| l.pid == p);
    // An OOM is an event too: a break must never hide its mark.
    let ooms = a.ooms.iter().filter(|o| pid.is_none_or(|p| o.pid == p)).map(|o| o.t_ns);
    let times = layout
        .lives
        .iter()
        .chain(layout.segments.iter().copied())
        .filter(mine)
        .flat_map(|l| [l.start, l.end])
        .chain(ooms)
        .map(|t| t.saturating_sub(t0));
    // The median iteration period of the process.
    let mut periods: Vec<u64> = a
        .iterations
        .iter()
        .filter(|it| pid.is_none_or(|p| it.pid == p))
        .flat_map(|it| it.boundaries_t_ns.windows(2).map(|w| w[1].saturating_sub(w[0])))
        .collect();
    periods.sort_unstable();
    let period = periods.get(periods.len() / 2).map(|&p| p as f64);
    TimeMap::of(times, span, period)
}
