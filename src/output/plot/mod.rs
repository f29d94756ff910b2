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
//!
//! The files: [`frame`] (settings, fonts, axes, PNG), [`mdtp`],
//! [`timeline`], [`idle`] (the timeline's idle stretches shortened); this
//! module draws both for an analysis.

mod frame;
mod idle;
mod mdtp;
mod timeline;

use anyhow::Result;

use crate::analysis::Analysis;
pub(crate) use frame::{
    FONT, TITLE_PAD, Ticked, draw_err, fit_title, fonts, text_width, title_font, x_ticks_for, y_ticks_for,
};
pub use frame::{Image, MAX_PANELS, MIN_SIZE, PlotConfig, check_size, encode_png, write_png};
pub(crate) use mdtp::{Collapse, UNRESERVED, panel_pids, raster_panel};
pub use mdtp::{PanelGeometry, not_drawn, render_mdtp, size_colour};
pub use timeline::render_timeline;

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
