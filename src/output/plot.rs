//! The pictures (SPEC §7): `mdtp.png`, the Memory Distribution Timeline
//! Plot — x = time, y = address offset within the process's collapsed
//! footprint, every block a rectangle from its allocation to its free,
//! coloured by size on a log scale (light → dark blue), free space white —
//! and `timeline.png`, the metrics over time.
//!
//! Blocks are rasterised straight into the pixel buffer, not drawn one
//! call each: per pixel row, a difference array over the columns collects
//! each block's coverage (the fraction of the row's bytes it covers) and
//! colour, and one prefix-sum pass resolves it, so a block costs O(rows it
//! spans) whatever its duration. A block thinner than a row shades the
//! pixel by its coverage; a block shorter than a column still gets one
//! column. plotters draws the axes, labels, legend and the timeline.

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::analysis::Analysis;
use crate::analysis::layout::{Layout, Lifetime};
use crate::analysis::predict::Risk;
use crate::output::ticks::{Axis, Unit};
use crate::units::bytes;

pub(crate) const FONT: &str = "sans-serif";

/// Registers the bundled DejaVu Sans once (plotters' ab_glyph backend has
/// no system font lookup; bundling keeps plots identical everywhere).
pub(crate) fn fonts() -> Result<()> {
    static ONCE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok =
        *ONCE.get_or_init(|| plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok());
    if ok { Ok(()) } else { bail!("cannot load the bundled plot font") }
}

/// What to draw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlotConfig {
    pub width: u32,
    pub height: u32,
    /// Time window, ns relative to the first event.
    pub time_window: Option<(u64, u64)>,
    /// Address window, bytes of collapsed offset.
    pub addr_window: Option<(u64, u64)>,
    /// Only this process (default: one panel per process).
    pub pid: Option<u32>,
    /// Label the MDTP's time axis as a fraction of the shown span (compare).
    pub normalised_time: bool,
    /// At most this many process panels in the MDTP, the processes with the
    /// highest peak live bytes (fewer when the image is too short for them).
    pub max_panels: usize,
}

/// Default of `--max-panels`.
pub const MAX_PANELS: usize = 8;

impl Default for PlotConfig {
    fn default() -> Self {
        PlotConfig {
            width: 1600,
            height: 900,
            time_window: None,
            addr_window: None,
            pid: None,
            normalised_time: false,
            max_panels: MAX_PANELS,
        }
    }
}

/// An RGB picture.
#[derive(Clone, Debug)]
pub struct Image {
    pub pixels: Vec<u8>,
    pub width: u32,
    pub height: u32,
}

impl Image {
    pub fn write_png(&self, path: &Path) -> Result<()> {
        write_png(&self.pixels, self.width, self.height, path)
    }
}

/// The pictures of one analysis.
#[derive(Clone, Debug)]
pub struct Pictures {
    pub mdtp: Image,
    pub timeline: Image,
    /// Processes with device memory that the MDTP has no panel for
    /// (`--max-panels`, or too little height).
    pub panels_not_drawn: usize,
}

/// Draws `mdtp.png` and `timeline.png`; None when the analysis kept no
/// layout (no device memory, or it was run without `Options::layout`).
pub fn render(a: &Analysis, cfg: &PlotConfig) -> Result<Option<Pictures>> {
    let Some(layout) = &a.layout else { return Ok(None) };
    let started = std::time::Instant::now();
    let (mdtp, panels) = render_mdtp(a, layout, cfg)?;
    let panels_not_drawn = not_drawn(a, &panels, cfg);
    let timeline = render_timeline(a, cfg)?;
    tracing::debug!("plots in {:.3} s", started.elapsed().as_secs_f64());
    let image = |pixels| Image { pixels, width: cfg.width, height: cfg.height };
    Ok(Some(Pictures { mdtp: image(mdtp), timeline: image(timeline), panels_not_drawn }))
}

/// The smallest and largest images drawn.
pub const MIN_SIZE: (u32, u32) = (200, 100);

/// Height a panel needs for its axis labels and a few rows of plot, in
/// compact form: panels beyond what fits are not drawn.
const PANEL_MIN_HEIGHT: u32 = 60;
/// The figure title's font size: 22 px, smaller on narrow images.
pub(crate) fn title_font(width: u32) -> u32 {
    (width / 36).clamp(11, 22)
}

/// Images narrower than this have no size legend.
const LEGEND_FROM_WIDTH: u32 = 420;
/// Panels shorter than this lose their caption and most of their margins.
const COMPACT_BELOW: u32 = 120;
/// The first of `candidates` (longest first) whose title fits `width`
/// pixels, else the last one cut short with an ellipsis.
pub(crate) fn fit_title(candidates: &[String], width: u32) -> String {
    let room = width.saturating_sub(16);
    let fits = |t: &str| text_width(t.chars().count(), title_font(width)) <= room;
    if let Some(t) = candidates.iter().find(|t| fits(t)) {
        return t.clone();
    }
    let last = candidates.last().map_or("", String::as_str);
    let mut cut: String = last.chars().collect();
    while !cut.is_empty() && !fits(&format!("{cut}…")) {
        cut.pop();
    }
    format!("{cut}…")
}

/// Space above the figure title, so that no text touches the image border.
pub(crate) const TITLE_PAD: u32 = 6;
/// Height of the figure title.
const TITLE_HEIGHT: u32 = 30;

/// The processes that get an MDTP panel: `--pid`, or the `max_panels`
/// with the highest peak live bytes that fit the height, in trace order.
fn panel_pids(a: &Analysis, cfg: &PlotConfig) -> Result<Vec<u32>> {
    if let Some(p) = cfg.pid {
        if !a.peaks.iter().any(|q| q.pid == p) {
            bail!("--pid {p}: no such process with device memory in this trace");
        }
        return Ok(vec![p]);
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
struct Collapse {
    regions: Vec<(u64, u64, u64)>, // start, end, offset of start
    total: u64,
}

impl Collapse {
    fn new(regions: &[(u64, u64)]) -> Collapse {
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

    fn offset(&self, addr: u64) -> Option<u64> {
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
}

impl PanelGeometry {
    /// The pixel showing time `t` and offset `o`.
    pub fn pixel(&self, t: u64, o: u64) -> (u32, u32) {
        let fx = (t.saturating_sub(self.t0)) as f64 / (self.t1 - self.t0).max(1) as f64;
        let fy = (o.saturating_sub(self.o0)) as f64 / (self.o1 - self.o0).max(1) as f64;
        let x = self.x0 + ((self.x1 - self.x0) as f64 * fx).floor().min((self.x1 - self.x0 - 1) as f64) as i32;
        let y = self.y1 - 1 - ((self.y1 - self.y0) as f64 * fy).floor().min((self.y1 - self.y0 - 1) as f64) as i32;
        (x as u32, y as u32)
    }
}

/// The time axis over `[0, span]` ns with at most `max` ticks: time, the
/// entry number where the trace has no timestamps (1 ns stands for one
/// entry), or a fraction of the span (`compare`).
fn time_axis(span: f64, max: usize, entries: bool, normalised: bool) -> Axis {
    if normalised {
        Axis::scaled(0.0, 1.0, max, Unit::Fraction, span)
    } else if entries {
        Axis::new(0.0, span, max, Unit::Count)
    } else {
        Axis::new(0.0, span, max, Unit::Time)
    }
}

/// A numeric axis whose ticks are an [`Axis`]'s: plotters' own f64 axis
/// picks decimal steps, whatever the unit.
#[derive(Clone)]
pub(crate) struct Ticked {
    inner: RangedCoordf64,
    ticks: Vec<f64>,
}

impl Ticked {
    pub(crate) fn new(range: std::ops::Range<f64>, axis: &Axis) -> Ticked {
        Ticked { inner: range.into(), ticks: axis.at.clone() }
    }
}

impl Ranged for Ticked {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        self.inner.map(value, limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        self.ticks.clone()
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.inner.range()
    }
}

/// How many x ticks fit `width` pixels of axis (a label every ~110 px).
pub(crate) fn x_ticks_for(width: u32) -> usize {
    (width / 110).clamp(2, 10) as usize
}

/// How many y ticks fit `height` pixels of axis (a label every ~40 px).
pub(crate) fn y_ticks_for(height: u32) -> usize {
    (height / 40).clamp(2, 8) as usize
}

/// Approximate width in pixels of `chars` characters of the label font at
/// `size` px (DejaVu Sans averages a little over half the size).
pub(crate) fn text_width(chars: usize, size: u32) -> u32 {
    (chars as u32 * size * 6).div_ceil(10)
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
        Some((s, e)) => (t_first + s, t_first + e.max(s + 1)),
        None => (t_first, t_last),
    };
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
            let caption = format!("{} {pid}", if a.allocator_view { "device" } else { "process" });
            let (area_w, area_h) = area.dim_in_pixel();
            let entries = a.entry_order();
            let x_axis =
                time_axis((t1 - t0) as f64, x_ticks_for(area_w.saturating_sub(220)), entries, cfg.normalised_time);
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
                    Ticked::new(0f64..(t1 - t0) as f64, &x_axis),
                    Ticked::new(o0 as f64..o1 as f64, &y_axis),
                )
                .map_err(|e| anyhow!("{e}"))?;
            chart
                .configure_mesh()
                .disable_mesh()
                .x_desc(match (cfg.normalised_time, entries) {
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
            panels.push(PanelGeometry { pid, x0, x1, y0, y1, t0, t1, o0, o1 });
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
        raster_panel(&mut buf, w, p, &collapse, lives, segments, (lmin, lmax));
        oom_marks(&mut buf, w, p, a);
    }
    Ok((buf, panels))
}

/// Where a lifetime lands in a panel: its columns [c0, c1) (at least one)
/// and, per pixel row it touches, the fraction of the row it covers. None
/// when it is outside the panel.
fn placement(
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
    let c0 = ((l.start.max(p.t0) - p.t0) as f64 / ns_per_col) as usize;
    let c1 = (((l.end.min(p.t1) - p.t0) as f64 / ns_per_col).ceil() as usize).max(c0 + 1).min(cols);
    let (r0, r1) = ((lo - p.o0) as f64 / bytes_per_row, (hi - p.o0) as f64 / bytes_per_row);
    let cells = (r0.floor() as usize..rows)
        .take_while(move |&r| (r as f64) < r1)
        .map(move |r| (r, (r1.min(r as f64 + 1.0) - r0.max(r as f64)) as f32));
    Some((c0.min(cols - 1), c1, cells))
}

/// Background of address space outside every live segment.
const UNRESERVED: f32 = 225.0;

fn raster_panel(
    buf: &mut [u8],
    width: u32,
    p: &PanelGeometry,
    collapse: &Collapse,
    lives: &[Lifetime],
    segments: &[Lifetime],
    log: (f64, f64),
) {
    let cols = (p.x1 - p.x0).max(1) as usize;
    let rows = (p.y1 - p.y0).max(1) as usize;
    let ns_per_col = (p.t1 - p.t0) as f64 / cols as f64;
    let bytes_per_row = (p.o1 - p.o0) as f64 / rows as f64;
    // Per row, difference arrays of coverage and coverage-weighted colour.
    let mut acc = vec![[0f32; 4]; rows * (cols + 1)];
    // The same for reserved space (allocator view).
    let reserved = segments.iter().any(|s| s.pid == p.pid);
    let mut seg_acc = vec![0f32; if reserved { rows * (cols + 1) } else { 0 }];
    for l in segments.iter().filter(|l| l.pid == p.pid) {
        if let Some((c0, c1, cells)) = placement(l, p, collapse, ns_per_col, bytes_per_row, cols, rows) {
            for (r, cov) in cells {
                seg_acc[r * (cols + 1) + c0] += cov;
                seg_acc[r * (cols + 1) + c1] -= cov;
            }
        }
    }
    for l in lives.iter().filter(|l| l.pid == p.pid) {
        let Some((c0, c1, cells)) = placement(l, p, collapse, ns_per_col, bytes_per_row, cols, rows) else {
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
fn oom_marks(buf: &mut [u8], width: u32, p: &PanelGeometry, a: &Analysis) {
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

/// Refuses image sizes outside what the plots are laid out for.
pub fn check_size(w: u32, h: u32) -> Result<()> {
    if w < MIN_SIZE.0 || h < MIN_SIZE.1 || w > 20_000 || h > 20_000 {
        bail!("--size {w}x{h}: a plot must be between {}x{} and 20000x20000 pixels", MIN_SIZE.0, MIN_SIZE.1);
    }
    Ok(())
}

/// Writes an RGB buffer as PNG through a temporary file, renamed into
/// place only once it is complete. The `png` crate directly, with fast
/// compression (fdeflate) and adaptive filters: the `image` crate's
/// defaults, which these files were written with before. Balanced
/// compression makes them 45 % smaller but a batch of 40 small traces
/// 10 % slower.
pub fn write_png(buf: &[u8], w: u32, h: u32, path: &Path) -> Result<()> {
    if buf.len() as u64 != u64::from(w) * u64::from(h) * 3 {
        bail!(
            "internal: a {w}x{h} image needs {} bytes, the buffer has {}",
            u64::from(w) * u64::from(h) * 3,
            buf.len()
        );
    }
    let mut bytes = Vec::new();
    let mut encoder = png::Encoder::new(&mut bytes, w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::Fast);
    encoder.set_filter(png::Filter::Adaptive);
    let encoded = encoder.write_header().and_then(|mut writer| {
        writer.write_image_data(buf)?;
        writer.finish()
    });
    encoded.with_context(|| format!("cannot encode {}", path.display()))?;
    let tmp = path.with_extension("png.tmp");
    std::fs::write(&tmp, &bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

type Panel<'a, 'b> = ChartContext<'a, BitMapBackend<'b>, Cartesian2d<Ticked, Ticked>>;

pub(crate) fn draw_err<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> anyhow::Error {
    anyhow!("cannot draw the plot: {e}")
}

/// Timeline panels whose plot is shorter or narrower than this have no
/// legend (the widest entry, the forecast's, needs about 440 px).
const LEGEND_FROM_HEIGHT: u32 = 110;
const TIMELINE_LEGEND_FROM_WIDTH: u32 = 460;

/// Height of the forecast panel's risk strip, in score points.
const RISK_STRIP: f64 = 6.0;

/// One timeline panel over the whole trace: axes, labels, `y` range.
fn timeline_panel<'a, 'b>(
    area: &'a DrawingArea<BitMapBackend<'b>, plotters::coord::Shift>,
    span: f64,
    y: std::ops::Range<f64>,
    y_desc: &str,
    y_unit: Unit,
    last: bool,
    entries: bool,
) -> Result<Panel<'a, 'b>> {
    let (w, h) = area.dim_in_pixel();
    let x_axis = time_axis(span, x_ticks_for(w.saturating_sub(110)), entries, false);
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
        .build_cartesian_2d(Ticked::new(0f64..span, &x_axis), Ticked::new(y, &y_axis))
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
    Ok(c)
}

/// A line series with its legend entry.
fn line<'a, 'b>(
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
fn finish_panel<'a, 'b: 'a>(c: &mut Panel<'a, 'b>, iterations: &[f64], ooms: &[f64], top: f64) -> Result<()> {
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
        let panels = root.split_evenly((3, 1));
        let t0 = a.first_ts;
        let span = (a.last_ts.max(t0 + 1) - t0) as f64;
        let pid = cfg.pid.or_else(|| {
            a.predictions.iter().reduce(|b, p| if p.prediction.risk > b.prediction.risk { p } else { b }).map(|p| p.pid)
        });
        let rows: Vec<&crate::analysis::Row> = a.rows.iter().filter(|r| !r.at_oom && Some(r.pid) == pid).collect();
        let x = |r: &crate::analysis::Row| (r.t_ns - t0) as f64;
        let ooms: Vec<f64> = a.ooms.iter().filter(|o| Some(o.pid) == pid).map(|o| (o.t_ns - t0) as f64).collect();
        // Iteration starts, when few enough to tell apart (one per 4 px).
        let iterations: Vec<f64> = a
            .iterations
            .iter()
            .filter(|it| Some(it.pid) == pid && it.boundaries_t_ns.len() as u32 <= w / 4)
            .flat_map(|it| it.boundaries_t_ns.iter().map(|&b| b.saturating_sub(t0) as f64))
            .collect();
        let entries = a.entry_order();
        let score: Vec<(f64, f64)> = rows.iter().map(|r| (x(r), r.metrics.score)).collect();

        // 1. Live bytes.
        let top = rows.iter().map(|r| r.metrics.live_bytes).max().unwrap_or(1).max(1) as f64 * 1.05;
        let mut c = timeline_panel(&panels[0], span, 0.0..top, "live", Unit::Bytes, false, entries)?;
        let live = rows.iter().map(|r| (x(r), r.metrics.live_bytes as f64)).collect();
        line(&mut c, live, BLUE, 2, &format!("live bytes (process {})", pid.unwrap_or(0)))?;
        finish_panel(&mut c, &iterations, &ooms, top)?;

        // 2. Score and its weighted components, risk bands behind.
        let mut c = timeline_panel(&panels[1], span, 0.0..100.0, "score", Unit::Count, false, entries)?;
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
        let mut c = timeline_panel(&panels[2], span, 0.0..100.0, "forecast", Unit::Count, true, entries)?;
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
        root.present().map_err(draw_err)?;
    }
    Ok(buf)
}
