//! What every picture shares: the settings ([`PlotConfig`]), the bundled
//! font, sizes and titles, axes whose ticks are [`crate::output::ticks`]'
//! ([`Ticked`]), and writing a PNG.

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::output::ticks::{Axis, Unit};

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
    /// Write the explorable view beside `report.html` (`--no-view`: not).
    pub view: bool,
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
            view: true,
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

/// The smallest and largest images drawn.
pub const MIN_SIZE: (u32, u32) = (200, 100);

/// Height a panel needs for its axis labels and a few rows of plot, in
/// compact form: panels beyond what fits are not drawn.
pub(super) const PANEL_MIN_HEIGHT: u32 = 60;
/// The figure title's font size: 22 px, smaller on narrow images.
pub(crate) fn title_font(width: u32) -> u32 {
    (width / 36).clamp(11, 22)
}

/// Images narrower than this have no size legend.
pub(super) const LEGEND_FROM_WIDTH: u32 = 420;
/// Panels shorter than this lose their caption and most of their margins.
pub(super) const COMPACT_BELOW: u32 = 120;
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
pub(super) const TITLE_HEIGHT: u32 = 30;

/// The time axis over `[0, span]` ns with at most `max` ticks: time, the
/// entry number where the trace has no timestamps (1 ns stands for one
/// entry), or a fraction of the span (`compare`).
/// A time axis over [from, from + span] (a window starts after the
/// trace's first event: its labels stay the trace's own times).
pub(super) fn time_axis(from: f64, span: f64, max: usize, entries: bool, normalised: bool) -> Axis {
    if normalised {
        Axis::scaled(0.0, 1.0, max, Unit::Fraction, span)
    } else if entries {
        Axis::new(from, from + span, max, Unit::Count)
    } else {
        Axis::new(from, from + span, max, Unit::Time)
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
    let bytes = encode_png(buf, w, h).with_context(|| format!("cannot encode {}", path.display()))?;
    crate::trace::write_atomic(path, &bytes)
}

/// An RGB buffer of `w` × `h` as PNG bytes.
pub fn encode_png(buf: &[u8], w: u32, h: u32) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    let mut encoder = png::Encoder::new(&mut bytes, w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::Fast);
    encoder.set_filter(png::Filter::Adaptive);
    encoder.write_header().and_then(|mut writer| {
        writer.write_image_data(buf)?;
        writer.finish()
    })?;
    Ok(bytes)
}

pub(crate) fn draw_err<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> anyhow::Error {
    anyhow!("cannot draw the plot: {e}")
}
