//! `mdtp.png`, the Memory Distribution Timeline Plot: one panel per
//! process (device), blocks rasterised straight into the pixel buffer by
//! coverage, OOMs in red, iteration boundaries marked.

use anyhow::{Result, anyhow, bail};
use plotters::prelude::*;

use super::frame::{
    COMPACT_BELOW, FONT, LEGEND_FROM_WIDTH, PANEL_MIN_HEIGHT, PlotConfig, TITLE_HEIGHT, TITLE_PAD, Ticked, check_size,
    fit_title, fonts, text_width, time_axis, title_font, x_ticks_for, y_ticks_for,
};
use super::idle::TimeMap;
use crate::analysis::Analysis;
use crate::analysis::layout::{Layout, Lifetime};
use crate::output::ticks::{Axis, Unit};
use crate::units::bytes;

/// The processes that get an MDTP panel: `--pid` (each of its devices
/// when it used several), or the `max_panels`
/// with the highest peak live bytes that fit the height, in trace order.
pub(crate) fn panel_pids(a: &Analysis, cfg: &PlotConfig) -> Result<Vec<u32>> {
    if let Some(p) = cfg.pid {
        // A process replayed per device has a panel per device.
        let of_process = |u: u32| u == p || a.trace.units.get(&u).is_some_and(|&(pid, _)| pid == p);
        let units: Vec<u32> = a.peaks.iter().map(|q| q.pid).filter(|&u| of_process(u)).collect();
        if units.is_empty() {
            bail!("--pid {p}: no such process with device memory in this trace");
        }
        return Ok(units);
    }
    let fit = (cfg.height.saturating_sub(TITLE_HEIGHT) / PANEL_MIN_HEIGHT).max(1) as usize;
    let n = cfg.max_panels.max(1).min(fit);
    let mut by_peak: Vec<(usize, &crate::analysis::replay::Peak)> = a.peaks.iter().enumerate().collect();
    by_peak.sort_by(|x, y| y.1.bytes.cmp(&x.1.bytes).then(x.0.cmp(&y.0)));
    by_peak.truncate(n);
    by_peak.sort_by_key(|x| x.0);
    Ok(by_peak.into_iter().map(|x| x.1.pid).collect())
}

/// How many processes with device memory have no panel in the MDTP.
pub fn not_drawn(a: &Analysis, panels: &[PanelGeometry], cfg: &PlotConfig) -> usize {
    if cfg.pid.is_some() { 0 } else { a.peaks.len().saturating_sub(panels.len()) }
}

/// Address → offset in the collapsed footprint (regions laid end to end).
pub(crate) struct Collapse {
    pub(crate) regions: Vec<(u64, u64, u64)>, // start, end, offset of start
    pub(crate) total: u64,
}

impl Collapse {
    pub(crate) fn new(regions: &[(u64, u64)]) -> Collapse {
        let mut off = 0;
        let regions = regions
            .iter()
            .map(|&(s, e)| {
                let r = (s, e, off);
                off += e - s;
                r
            })
            .collect();
        Collapse { regions, total: off }
    }

    pub(crate) fn offset(&self, addr: u64) -> Option<u64> {
        let i = self.regions.partition_point(|r| r.0 <= addr).checked_sub(1)?;
        let (s, e, off) = self.regions[i];
        (addr < e).then(|| off + addr - s)
    }
}

/// The light → dark blue ramp, t in [0, 1].
pub fn size_colour(t: f64) -> [f64; 3] {
    let (light, dark) = ([198.0, 219.0, 239.0], [8.0, 48.0, 107.0]);
    let t = t.clamp(0.0, 1.0);
    [0, 1, 2].map(|c| light[c] + (dark[c] - light[c]) * t)
}

/// Where a panel's plot area lies in the image and what it shows: for tests
/// and for mapping (time, offset) to pixels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PanelGeometry {
    pub pid: u32,
    /// Pixel columns [x0, x1) and rows [y0, y1) of the plot area.
    pub x0: i32,
    pub x1: i32,
    pub y0: i32,
    pub y1: i32,
    /// Absolute ns at the left and right edges.
    pub t0: u64,
    pub t1: u64,
    /// Collapsed offsets at the bottom and top edges.
    pub o0: u64,
    pub o1: u64,
    /// The time axis with idle stretches shortened (`mdtp.png`); None:
    /// true time (the view's tiles, a window).
    pub time: Option<TimeMap>,
}

impl PanelGeometry {
    /// The pixel showing time `t` and offset `o`.
    pub fn pixel(&self, t: u64, o: u64) -> (u32, u32) {
        let fx = match &self.time {
            None => (t.saturating_sub(self.t0)) as f64 / (self.t1 - self.t0).max(1) as f64,
            Some(m) => m.x(t.saturating_sub(self.t0) as f64) / m.span(),
        };
        let fy = (o.saturating_sub(self.o0)) as f64 / (self.o1 - self.o0).max(1) as f64;
        let x = self.x0 + ((self.x1 - self.x0) as f64 * fx).floor().min((self.x1 - self.x0 - 1) as f64) as i32;
        let y = self.y1 - 1 - ((self.y1 - self.y0) as f64 * fy).floor().min((self.y1 - self.y0 - 1) as f64) as i32;
        (x as u32, y as u32)
    }
}

/// Renders the MDTP into an RGB buffer; returns the buffer and the panels.
/// `segments` (allocator view, else empty): address space outside every
/// live segment is drawn light grey, reserved free space white.
pub fn render_mdtp(a: &Analysis, layout: &Layout, cfg: &PlotConfig) -> Result<(Vec<u8>, Vec<PanelGeometry>)> {
    let (lives, segments, footprint) = (&layout.lives, &layout.segments, &layout.footprint);
    fonts()?;
    let (w, h) = (cfg.width, cfg.height);
    check_size(w, h)?;
    let pids = panel_pids(a, cfg)?;
    let hidden = if cfg.pid.is_some() { 0 } else { a.peaks.len() - pids.len() };
    let (t_first, t_last) = (a.first_ts, a.last_ts.max(a.first_ts + 1));
    let (t0, t1) = match cfg.time_window {
        Some((s, e)) => {
            let t0 = t_first.saturating_add(s);
            let end = if e == u64::MAX { t_last } else { t_first.saturating_add(e) };
            (t0, end.max(t0.saturating_add(1)))
        }
        None => (t_first, t_last),
    };
    if cfg.time_window.is_some() && t0 >= t_last {
        tracing::warn!(
            "{}: --time-window starts at {:.6} s, after the trace's last event ({:.6} s from its first): the MDTP is \
             empty",
            a.trace.name,
            (t0 - t_first) as f64 / 1e9,
            (t_last - t_first) as f64 / 1e9
        );
    }
    // The whole trace's idle stretches shortened, as on the timeline (one
    // map for every panel: they share the time axis). A window, the
    // normalised axis of `compare` and a trace without timestamps keep
    // true time.
    let time = Some(super::timeline::time_map(a, None, a.entry_order()))
        .filter(|m| !m.is_identity() && cfg.time_window.is_none() && !cfg.normalised_time);
    let (min_size, max_size) = lives.iter().fold((u64::MAX, 0), |(lo, hi), l| (lo.min(l.size), hi.max(l.size)));
    let (lmin, lmax) = ((min_size.max(1) as f64).log2(), (max_size.max(1) as f64).log2());
    let mut buf = vec![255u8; (w * h * 3) as usize];
    let mut panels = Vec::new();
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        let s = crate::analysis::summary::Summary::of(a);
        let long = format!(
            "{} — peak live {}, score {:.1}, {} OOM{}",
            a.trace.name,
            bytes(s.peak_live_bytes),
            s.score.final_,
            s.ooms,
            if s.ooms == 1 { "" } else { "s" },
        );
        let title = fit_title(
            &[
                if hidden > 0 { format!("{long} · +{hidden} processes not drawn") } else { long.clone() },
                long,
                a.trace.name.clone(),
            ],
            w,
        );
        let root = root.margin(TITLE_PAD, 0, 0, 0).titled(&title, (FONT, title_font(w))).map_err(|e| anyhow!("{e}"))?;
        let areas = root.split_evenly((pids.len().max(1), 1));
        for (area, &pid) in areas.iter().zip(&pids) {
            let collapse = Collapse::new(footprint.regions(pid));
            let (o0, o1) = match cfg.addr_window {
                Some((s, e)) => (s, e.max(s + 1)),
                None => (0, collapse.total.max(1)),
            };
            // A short panel drops its caption and tightens its margins so
            // that the plot keeps some rows.
            let compact = area.dim_in_pixel().1 < COMPACT_BELOW;
            // A narrow image has no room for the size legend on the right.
            let legend = area.dim_in_pixel().0 >= LEGEND_FROM_WIDTH;
            let caption = format!("{} {}", if a.unit() == "device" { "device" } else { "process" }, a.who(pid));
            let (area_w, area_h) = area.dim_in_pixel();
            let entries = a.entry_order();
            // Labelled in the trace's own time: a window's axis starts at
            // the window's start, not at 0.
            let from = if cfg.normalised_time { 0.0 } else { (t0 - t_first) as f64 };
            let x_axis = match &time {
                Some(m) => m.axis(x_ticks_for(area_w.saturating_sub(220))),
                None => time_axis(
                    from,
                    (t1 - t0) as f64,
                    x_ticks_for(area_w.saturating_sub(220)),
                    entries,
                    cfg.normalised_time,
                ),
            };
            let x_span = time.as_ref().map_or((t1 - t0) as f64, |m| m.span());
            let x_label_area = if compact { 22 } else { 36 };
            let y_axis =
                Axis::new(o0 as f64, o1 as f64, y_ticks_for(area_h.saturating_sub(x_label_area + 30)), Unit::Bytes);
            // Room for half the last x label past the plot's right edge.
            // The size legend's column is as wide as its widest text.
            let legend_width = ["block size".to_string(), format!("≥ {}", bytes(max_size))]
                .iter()
                .map(|t| text_width(t.chars().count(), 12) + 28)
                .max()
                .unwrap_or(0);
            let right = if legend { legend_width.max(130) } else { (text_width(x_axis.widest(), 13) / 2 + 4).max(8) };
            let mut builder = ChartBuilder::on(area);
            builder
                .margin(if compact { 5 } else { 8 })
                .margin_right(right)
                .x_label_area_size(x_label_area)
                .y_label_area_size((text_width(y_axis.widest(), 13) + 24).max(if legend { 84 } else { 64 }));
            if !compact {
                builder.caption(caption, (FONT, 15));
            }
            // The rotated axis title, as long as the panel's height allows.
            let plot_h = area_h.saturating_sub(x_label_area + if compact { 10 } else { 40 });
            let y_desc = ["address offset (collapsed)", "offset"]
                .into_iter()
                .find(|d| (!compact || d.len() < 10) && text_width(d.chars().count(), 13) + 4 <= plot_h)
                .unwrap_or("");
            let mut chart = builder
                .build_cartesian_2d(
                    Ticked::new(from..from + x_span, &x_axis),
                    Ticked::new(o0 as f64..o1 as f64, &y_axis),
                )
                .map_err(|e| anyhow!("{e}"))?;
            chart
                .configure_mesh()
                .disable_mesh()
                .x_desc(match (cfg.normalised_time, entries) {
                    (true, _) if cfg.time_window.is_some() => {
                        "time / duration shown (from the steps, start-up left out)"
                    }
                    (true, _) => "time / duration",
                    (false, true) => "trace entry (no timestamps)",
                    (false, false) => "time",
                })
                .y_desc(y_desc)
                .label_style((FONT, 13))
                .x_label_formatter(&|v| x_axis.label(*v))
                .y_label_formatter(&|v| y_axis.label(*v))
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
            let (xr, yr) = chart.plotting_area().get_pixel_range();
            // Clipped to the image: every pixel index below stays inside.
            let (x0, x1) = (xr.start.clamp(0, w as i32), xr.end.clamp(0, w as i32));
            let (y0, y1) = (yr.start.clamp(0, h as i32), yr.end.clamp(0, h as i32));
            if x1 - x0 < 1 || y1 - y0 < 1 {
                continue; // no room for a single pixel: not drawn, counted
            }
            panels.push(PanelGeometry { pid, x0, x1, y0, y1, t0, t1, o0, o1, time });
            if legend {
                // Size legend in the right margin: the ramp with its ends,
                // shortened to the panel's height.
                let (lx, ly) = (xr.end + 20, yr.start);
                let steps = ((y1 - y0 - 30) / 4).clamp(2, 40);
                for i in 0..steps {
                    let c = size_colour(1.0 - i as f64 / (steps - 1) as f64);
                    let y = ly + i * 4;
                    area.draw(&Rectangle::new(
                        [
                            (lx - area.get_base_pixel().0, y - area.get_base_pixel().1),
                            (lx + 16 - area.get_base_pixel().0, y + 4 - area.get_base_pixel().1),
                        ],
                        RGBColor(c[0] as u8, c[1] as u8, c[2] as u8).filled(),
                    ))
                    .map_err(|e| anyhow!("{e}"))?;
                }
                let (bx, by) = area.get_base_pixel();
                let style = TextStyle::from((FONT, 12).into_font()).color(&BLACK);
                let _ = area.draw_text(&format!("≥ {}", bytes(max_size)), &style, (lx + 20 - bx, ly - by));
                let _ = area.draw_text(
                    &format!("{}", bytes(min_size.min(max_size))),
                    &style,
                    (lx + 20 - bx, ly + steps * 4 - 12 - by),
                );
                let _ = area.draw_text("block size", &style, (lx - bx, ly + steps * 4 + 6 - by));
            }
        }
        root.present().map_err(|e| anyhow!("{e}"))?;
    }
    for p in &panels {
        let collapse = Collapse::new(footprint.regions(p.pid));
        let reserved = segments.iter().any(|s| s.pid == p.pid);
        raster_panel(&mut buf, w, p, &collapse, lives.iter(), segments, reserved, (lmin, lmax));
    }
    if let Some(m) = &time {
        draw_breaks(&mut buf, (w, h), &panels, m)?;
    }
    // Last: nothing covers an OOM's mark.
    for p in &panels {
        oom_marks(&mut buf, w, p, a);
    }
    Ok((buf, panels))
}

/// The column (fractional) of time `t` in panel `p` of `cols` columns:
/// true time, or `time`'s axis with its idle stretches shortened.
fn column(t: u64, p: &PanelGeometry, ns_per_col: f64, cols: usize) -> f64 {
    match &p.time {
        None => (t - p.t0) as f64 / ns_per_col,
        Some(m) => m.x((t - p.t0) as f64) / (m.span() / cols as f64),
    }
}

/// Grey bands over the breaks of `time` in every panel, with the idle
/// time each stands for written up the band (as on the timeline).
fn draw_breaks(buf: &mut [u8], (w, h): (u32, u32), panels: &[PanelGeometry], time: &TimeMap) -> Result<()> {
    for p in panels {
        let cols = (p.x1 - p.x0).max(1) as usize;
        for (from, to, _) in time.breaks() {
            let per = time.span() / cols as f64;
            let (c0, c1) = ((from / per) as i32, ((to / per).ceil() as i32).max((from / per) as i32 + 1));
            for x in (p.x0 + c0).min(p.x1 - 1)..(p.x0 + c1).min(p.x1) {
                let edge = x == p.x0 + c0 || x == p.x0 + c1 - 1;
                for y in p.y0..p.y1 {
                    let px = ((y as u32 * w + x as u32) * 3) as usize;
                    // Darker than the unreserved background (225): a break is
                    // never read as address space.
                    buf[px..px + 3].fill(if edge { 110 } else { 195 });
                }
            }
        }
    }
    let root = BitMapBackend::with_buffer(buf, (w, h)).into_drawing_area();
    let font = (FONT, 12).into_font().transform(FontTransform::Rotate90).color(&RGBColor(90, 90, 90));
    for p in panels.iter().filter(|p| p.y1 - p.y0 >= 80) {
        let cols = (p.x1 - p.x0).max(1) as f64;
        for (from, to, idle) in time.breaks() {
            let text = super::idle::label(idle);
            let x = p.x0 + ((from + to) / 2.0 / time.span() * cols) as i32 + 5;
            root.draw(&Text::new(text, (x, p.y0 + 6), font.clone())).map_err(|e| anyhow!("{e}"))?;
        }
    }
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// Where a lifetime lands in a panel: its columns [c0, c1) (at least one)
/// and, per pixel row it touches, the fraction of the row it covers. None
/// when it is outside the panel.
pub(super) fn placement(
    l: &Lifetime,
    p: &PanelGeometry,
    collapse: &Collapse,
    ns_per_col: f64,
    bytes_per_row: f64,
    cols: usize,
    rows: usize,
) -> Option<(usize, usize, impl Iterator<Item = (usize, f32)>)> {
    if l.end < p.t0 || l.start > p.t1 {
        return None;
    }
    let o = collapse.offset(l.addr)?;
    let (lo, hi) = (o.max(p.o0), (o + l.size).min(p.o1));
    if lo >= hi {
        return None;
    }
    let c0 = column(l.start.max(p.t0), p, ns_per_col, cols) as usize;
    let c1 = (column(l.end.min(p.t1), p, ns_per_col, cols).ceil() as usize).max(c0 + 1).min(cols);
    let (r0, r1) = ((lo - p.o0) as f64 / bytes_per_row, (hi - p.o0) as f64 / bytes_per_row);
    let cells = (r0.floor() as usize..rows)
        .take_while(move |&r| (r as f64) < r1)
        .map(move |r| (r, (r1.min(r as f64 + 1.0) - r0.max(r as f64)) as f32));
    Some((c0.min(cols - 1), c1, cells))
}

/// Background of address space outside every live segment.
pub(crate) const UNRESERVED: f32 = 225.0;

/// Draws `lives` (and `segments`, the reserved space, when `reserved`)
/// of process `p.pid` into the plot area of `p` in `buf`, an RGB image
/// `width` pixels wide. The view's tiles are drawn by this too, in true
/// time; `p.time` shortens the idle stretches of `mdtp.png`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn raster_panel(
    buf: &mut [u8],
    width: u32,
    p: &PanelGeometry,
    collapse: &Collapse,
    lives: impl Iterator<Item = Lifetime>,
    segments: &[Lifetime],
    reserved: bool,
    log: (f64, f64),
) {
    let cols = (p.x1 - p.x0).max(1) as usize;
    let rows = (p.y1 - p.y0).max(1) as usize;
    let ns_per_col = (p.t1 - p.t0) as f64 / cols as f64;
    let bytes_per_row = (p.o1 - p.o0) as f64 / rows as f64;
    // Per row, difference arrays of coverage and coverage-weighted colour.
    let mut acc = vec![[0f32; 4]; rows * (cols + 1)];
    // The same for reserved space (allocator view).
    let mut seg_acc = vec![0f32; if reserved { rows * (cols + 1) } else { 0 }];
    for l in segments.iter().filter(|l| l.pid == p.pid) {
        if let Some((c0, c1, cells)) = placement(l, p, collapse, ns_per_col, bytes_per_row, cols, rows) {
            for (r, cov) in cells {
                seg_acc[r * (cols + 1) + c0] += cov;
                seg_acc[r * (cols + 1) + c1] -= cov;
            }
        }
    }
    for l in lives.filter(|l| l.pid == p.pid) {
        let Some((c0, c1, cells)) = placement(&l, p, collapse, ns_per_col, bytes_per_row, cols, rows) else {
            continue;
        };
        let t = if log.1 > log.0 { ((l.size as f64).log2() - log.0) / (log.1 - log.0) } else { 1.0 };
        let colour = size_colour(t);
        for (r, cov) in cells {
            let add = [cov, cov * colour[0] as f32, cov * colour[1] as f32, cov * colour[2] as f32];
            let base = r * (cols + 1);
            for k in 0..4 {
                acc[base + c0][k] += add[k];
                acc[base + c1][k] -= add[k];
            }
        }
    }
    for r in 0..rows {
        let mut run = [0f32; 4];
        let mut seg_run = 0f32;
        let y = p.y1 - 1 - r as i32; // offsets grow upwards
        for c in 0..cols {
            let d = acc[r * (cols + 1) + c];
            let seg_d = if reserved { seg_acc[r * (cols + 1) + c] } else { 0.0 };
            let px = ((y as u32 * width + (p.x0 as u32 + c as u32)) * 3) as usize;
            // Nothing starts or ends here (most columns): the sums, and so
            // the pixel, are the previous column's.
            if c > 0 && d == [0.0; 4] && seg_d == 0.0 {
                buf.copy_within(px - 3..px, px);
                continue;
            }
            for k in 0..4 {
                run[k] += d[k];
            }
            let bg = if reserved {
                seg_run += seg_d;
                if seg_run > 0.5 { 255.0 } else { UNRESERVED }
            } else {
                255.0
            };
            let cov = run[0].clamp(0.0, 1.0);
            if run[0] > 1e-6 {
                for k in 0..3 {
                    let colour = run[k + 1] / run[0];
                    buf[px + k] = (bg * (1.0 - cov) + colour * cov).round().clamp(0.0, 255.0) as u8;
                }
            } else {
                buf[px..px + 3].fill(bg as u8);
            }
        }
    }
    // Thin grey separators where collapsed regions meet, over free space
    // only, so they never hide a block (the allocator view's background
    // shows the segments instead).
    for &(_, _, off) in collapse.regions.iter().skip(1).filter(|_| !reserved) {
        if off > p.o0 && off < p.o1 {
            let r = (((off - p.o0) as f64 / bytes_per_row) as i32).min(rows as i32 - 1);
            let y = p.y1 - 1 - r;
            for c in 0..cols {
                let px = ((y as u32 * width + p.x0 as u32 + c as u32) * 3) as usize;
                if buf[px..px + 3] == [255, 255, 255] {
                    buf[px..px + 3].copy_from_slice(&[150, 150, 150]);
                }
            }
        }
    }
}

/// OOM instants: a red line, and the failed request's size as a red bar at
/// the top of the plot, to compare with the holes around it.
pub(super) fn oom_marks(buf: &mut [u8], width: u32, p: &PanelGeometry, a: &Analysis) {
    let rows = (p.y1 - p.y0).max(1) as f64;
    let bytes_per_row = (p.o1 - p.o0) as f64 / rows;
    for o in a.ooms.iter().filter(|o| o.pid == p.pid && o.t_ns >= p.t0 && o.t_ns <= p.t1) {
        let (x, _) = p.pixel(o.t_ns, p.o0);
        for y in p.y0..p.y1 {
            let px = ((y as u32 * width + x) * 3) as usize;
            buf[px..px + 3].copy_from_slice(&[220, 0, 0]);
        }
        let bar = ((o.requested as f64 / bytes_per_row).ceil() as i32).clamp(2.min(p.y1 - p.y0), p.y1 - p.y0);
        for y in p.y0..p.y0 + bar {
            for dx in 0..3 {
                let xx = (x as i32 + dx - 1).clamp(p.x0, p.x1 - 1) as u32;
                let px = ((y as u32 * width + xx) * 3) as usize;
                buf[px..px + 3].copy_from_slice(&[255, 0, 0]);
            }
        }
    }
}
