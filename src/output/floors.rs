//! `floors.png`: the exact floor of every complete iteration
//! ([`crate::analysis::leak`]), one panel per process (device) whose leak
//! verdict rests on iterations. x = iteration (the warm-up first, in
//! grey), y = the least live bytes inside it, with the verdict and the
//! growth per iteration in the panel's caption: the picture a reader
//! checks a leak verdict against.

use anyhow::Result;
use plotters::prelude::*;

use crate::analysis::Analysis;
use crate::analysis::leak::{LeakReport, Method, Verdict};
use crate::output::plot::{
    FONT, TITLE_PAD, Ticked, check_size, draw_err, fit_title, fonts, text_width, title_font, x_ticks_for, y_ticks_for,
};
use crate::output::ticks::{Axis, Unit};
use crate::units::bytes;

/// At most this many panels: the series with the most floors first.
pub const MAX_PANELS: usize = 4;
/// The height of one panel.
const PANEL_HEIGHT: u32 = 300;

/// The leak reports drawn: those with at least two iteration floors.
pub fn drawn(a: &Analysis) -> Vec<&LeakReport> {
    let mut v: Vec<&LeakReport> =
        a.leaks.iter().filter(|l| l.method == Method::Iterations && l.floors.len() >= 2).collect();
    v.sort_by(|x, y| y.floors.len().cmp(&x.floors.len()).then(x.pid.cmp(&y.pid)));
    v.truncate(MAX_PANELS);
    v
}

/// Renders `floors.png` (RGB pixels, `width` × its height), or None when
/// no series has iteration floors to draw.
pub fn render(a: &Analysis, width: u32) -> Result<Option<(Vec<u8>, u32)>> {
    let series = drawn(a);
    if series.is_empty() {
        return Ok(None);
    }
    fonts()?;
    let h = PANEL_HEIGHT * series.len() as u32 + 40;
    check_size(width, h)?;
    let mut buf = vec![255u8; (width * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (width, h)).into_drawing_area();
        let title =
            fit_title(&[format!("{} — the floor of each iteration", a.trace.name), a.trace.name.clone()], width);
        let root = root.margin(TITLE_PAD, 0, 0, 0).titled(&title, (FONT, title_font(width))).map_err(draw_err)?;
        let panels = root.split_evenly((series.len(), 1));
        for (area, l) in panels.iter().zip(series) {
            panel(area, a, l)?;
        }
        root.present().map_err(draw_err)?;
    }
    Ok(Some((buf, h)))
}

fn panel(area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>, a: &Analysis, l: &LeakReport) -> Result<()> {
    let (w, h) = area.dim_in_pixel();
    let n = l.floors.len();
    let top = l.floors.iter().map(|f| f.bytes).max().unwrap_or(1).max(1) as f64 * 1.1;
    let x_axis = Axis::new(1.0, n as f64, x_ticks_for(w.saturating_sub(110)), Unit::Count);
    let y_axis = Axis::new(0.0, top, y_ticks_for(h.saturating_sub(60)).min(6), Unit::Bytes);
    let verdict = match l.verdict {
        Verdict::Leaking => {
            format!("leaking, {} per iteration", bytes(l.growth_per_iteration_bytes.unwrap_or(0).max(0) as u64))
        }
        v => v.name().to_string(),
    };
    let caption = format!("{} {}: {verdict}", a.unit(), a.who(l.pid));
    let mut c = ChartBuilder::on(area)
        .caption(caption, (FONT, 14))
        .margin(8)
        .margin_right((text_width(x_axis.widest(), 12) / 2 + 4).max(12))
        .x_label_area_size(30)
        .y_label_area_size((text_width(y_axis.widest(), 12) + 24).max(84))
        .build_cartesian_2d(Ticked::new(0.5..n as f64 + 0.5, &x_axis), Ticked::new(0.0..top, &y_axis))
        .map_err(draw_err)?;
    c.configure_mesh()
        .label_style((FONT, 12))
        .x_desc("complete iteration (1: warm-up)")
        .y_desc("floor")
        .x_label_formatter(&|v| x_axis.label(*v))
        .y_label_formatter(&|v| y_axis.label(*v))
        .draw()
        .map_err(draw_err)?;
    let colour = if l.leaking { RED } else { BLUE };
    let points: Vec<(f64, f64)> = l.floors.iter().enumerate().map(|(i, f)| ((i + 1) as f64, f.bytes as f64)).collect();
    c.draw_series(LineSeries::new(points.iter().skip(1).copied(), colour.stroke_width(2))).map_err(draw_err)?;
    c.draw_series(
        points
            .iter()
            .enumerate()
            .map(|(i, &p)| Circle::new(p, 4, if i == 0 { RGBColor(160, 160, 160) } else { colour }.filled())),
    )
    .map_err(draw_err)?;
    Ok(())
}
