//! compare.png: both MDTPs side by side, and below them the two runs'
//! iterations side by side (where both have them) or their score curves.

use anyhow::{Result, anyhow};
use plotters::prelude::*;

use crate::analysis::Analysis;
use crate::output::plot::{Image, Ticked};
use crate::output::ticks::{self, Axis};

/// Where a run's iterations begin to be drawn: after the last idle stretch
/// (no event for five steady iterations or more) from its first iteration
/// on, so that the steps, not the start-up, fill the MDTP. None without a
/// steady period.
pub(super) fn busy_from(an: &Analysis, ev: &crate::trace::event::Events) -> Option<u64> {
    let it = an
        .iterations
        .iter()
        .filter(|it| it.period_s.is_some_and(|p| p > 0.0) && it.boundaries_t_ns.len() >= 2)
        .min_by_key(|it| it.boundaries_t_ns[0])?;
    let (first, end) = (it.boundaries_t_ns[0], *it.boundaries_t_ns.last()?);
    let idle = (it.period_s? * 5e9) as u64;
    let mut from = first;
    let mut last = first;
    // Only a gap before the last boundary: an idle stretch after the steps
    // (a checkpoint, the teardown) must not leave them out.
    for &t in ev.ts_ns.iter().filter(|&&t| t >= first && t <= end) {
        if t - last > idle {
            from = t;
        }
        last = last.max(t);
    }
    Some(from)
}

/// The peak and the floor of live memory of each complete iteration (the
/// warm-up first) of the unit with the highest peak among those whose leak
/// verdict was reached on iterations: at least two.
pub(super) fn iteration_peaks(an: &Analysis) -> Option<Vec<(u64, u64)>> {
    an.leaks
        .iter()
        .filter(|l| l.method == crate::analysis::leak::Method::Iterations && l.floors.len() >= 2)
        .max_by_key(|l| l.floors.iter().map(|f| f.peak_bytes).max())
        .map(|l| l.floors.iter().map(|f| (f.bytes, f.peak_bytes)).collect())
}

/// The two MDTPs side by side; below, their iterations side by side where
/// both have them, else both score curves.
pub(super) fn compose(a: &Analysis, ia: &Image, b: &Analysis, ib: &Image, w: u32, h: u32) -> Result<Image> {
    crate::output::plot::fonts()?;
    let mut buf = vec![255u8; (w * h * 3) as usize];
    for (k, img) in [ia, ib].iter().enumerate() {
        let (px, iw, ih) = (&img.pixels, &img.width, &img.height);
        let x0 = k as u32 * (w / 2);
        for y in 0..(*ih).min(h) {
            for x in 0..(*iw).min(w - x0) {
                let (s, d) = (((y * iw + x) * 3) as usize, ((y * w + x0 + x) * 3) as usize);
                buf[d..d + 3].copy_from_slice(&px[s..s + 3]);
            }
        }
    }
    let top = ia.height;
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        let (_, bottom) = root.split_vertically(top);
        let (bw, bh) = bottom.dim_in_pixel();
        if let (Some(pa), Some(pb)) = (iteration_peaks(a), iteration_peaks(b)) {
            iterations_chart(&bottom, a, &pa, b, &pb)?;
        } else {
            scores_chart(&bottom, a, b, bw, bh)?;
        }
        root.present().map_err(|e| anyhow!("{e}"))?;
    }
    Ok(Image { pixels: buf, width: w, height: h })
}

/// Both combined score curves over normalised time.
fn scores_chart(bottom: &Area<'_>, a: &Analysis, b: &Analysis, bw: u32, bh: u32) -> Result<()> {
    {
        let series = |an: &Analysis| -> Vec<(f64, f64)> {
            let span = (an.last_ts - an.first_ts).max(1) as f64;
            let mut out: Vec<(f64, f64)> = Vec::new();
            for r in an.rows.iter().filter(|r| !r.at_oom) {
                let t = (r.t_ns - an.first_ts) as f64 / span;
                match out.last_mut() {
                    Some(last) if last.0 == t => last.1 = last.1.max(r.metrics.score),
                    _ => out.push((t, r.metrics.score)),
                }
            }
            out
        };
        let x_axis = Axis::new(0.0, 1.0, (bw / 110).clamp(2, 11) as usize, ticks::Unit::Fraction);
        let y_axis = Axis::new(0.0, 100.0, (bh.saturating_sub(70) / 30).clamp(2, 6) as usize, ticks::Unit::Count);
        let mut chart = ChartBuilder::on(bottom)
            .margin(10)
            .margin_right(40)
            .caption("fragmentation score over normalised time (A blue, B orange)", ("sans-serif", 16))
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(Ticked::new(0f64..1f64, &x_axis), Ticked::new(0f64..100f64, &y_axis))
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("time / duration")
            .y_desc("score")
            .label_style(("sans-serif", 12))
            .x_label_formatter(&|v| x_axis.label(*v))
            .y_label_formatter(&|v| y_axis.label(*v))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        let blue = RGBColor(31, 90, 170);
        let orange = RGBColor(230, 120, 20);
        chart
            .draw_series(LineSeries::new(series(a), blue.stroke_width(2)))
            .map_err(|e| anyhow!("{e}"))?
            .label(format!("A: {}", a.trace.name))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], blue.stroke_width(2)));
        chart
            .draw_series(LineSeries::new(series(b), orange.stroke_width(2)))
            .map_err(|e| anyhow!("{e}"))?
            .label(format!("B: {}", b.trace.name))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], orange.stroke_width(2)));
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
    }
    Ok(())
}

/// A part of compare.png.
type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

/// Live memory per iteration, aligned by iteration number: each run's
/// peak (thick) and floor (thin) of every complete iteration.
fn iterations_chart(bottom: &Area<'_>, a: &Analysis, pa: &[(u64, u64)], b: &Analysis, pb: &[(u64, u64)]) -> Result<()> {
    let (bw, bh) = bottom.dim_in_pixel();
    let n = pa.len().max(pb.len()).max(2) as f64;
    let top = (pa.iter().chain(pb).map(|p| p.1).max().unwrap_or(1).max(1) as f64 * 1.05).max(1.0);
    let x_axis = Axis::new(0.0, n - 1.0, (bw / 110).clamp(2, 11) as usize, ticks::Unit::Count);
    let y_axis = Axis::new(0.0, top, (bh.saturating_sub(70) / 30).clamp(2, 6) as usize, ticks::Unit::Bytes);
    let err = |e: DrawingAreaErrorKind<_>| anyhow!("cannot draw compare.png: {e}");
    let mut chart = ChartBuilder::on(bottom)
        .margin(10)
        .margin_right(40)
        .caption(
            "live memory per iteration, by iteration number: peak (thick) and floor (thin), warm-up first (A blue, B orange)",
            ("sans-serif", 16),
        )
        .x_label_area_size(30)
        .y_label_area_size(80)
        .build_cartesian_2d(Ticked::new(0f64..(n - 1.0), &x_axis), Ticked::new(0f64..top, &y_axis))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("complete iteration")
        .y_desc("live")
        .label_style(("sans-serif", 12))
        .x_label_formatter(&|v| x_axis.label(*v))
        .y_label_formatter(&|v| y_axis.label(*v))
        .draw()
        .map_err(err)?;
    for (side, an, points, colour) in [("A", a, pa, RGBColor(31, 90, 170)), ("B", b, pb, RGBColor(230, 120, 20))] {
        let at = |f: fn(&(u64, u64)) -> u64| points.iter().enumerate().map(move |(i, p)| (i as f64, f(p) as f64));
        chart
            .draw_series(LineSeries::new(at(|p| p.1), colour.stroke_width(2)))
            .map_err(err)?
            .label(format!("{side}: {}", an.trace.name))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2)));
        chart.draw_series(LineSeries::new(at(|p| p.0), colour.stroke_width(1))).map_err(err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 12))
        .draw()
        .map_err(err)?;
    Ok(())
}
