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
    for t in ev.ts_ns.iter().filter(|&t| t >= first && t <= end) {
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
/// both have them (`iterations`: A's and B's, from [`iteration_peaks`]),
/// else both score curves.
pub(super) fn compose(
    a: &Analysis,
    ia: &Image,
    b: &Analysis,
    ib: &Image,
    iterations: Option<&(Vec<(u64, u64)>, Vec<(u64, u64)>)>,
    (w, h): (u32, u32),
) -> Result<Image> {
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
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        let (_, bottom) = root.split_vertically(ia.height);
        let names = [format!("A: {}", a.trace.name), format!("B: {}", b.trace.name)];
        match iterations {
            Some((pa, pb)) => {
                // Per side: its peaks (thick, labelled), then its floors.
                let lines = |v: &[(u64, u64)]| {
                    let at = |f: fn(&(u64, u64)) -> u64| {
                        v.iter().enumerate().map(|(i, p)| (i as f64, f(p) as f64)).collect()
                    };
                    vec![(at(|p| p.1), 2), (at(|p| p.0), 1)]
                };
                let n = pa.len().max(pb.len()).max(2) as f64;
                let top = (pa.iter().chain(pb).map(|p| p.1).max().unwrap_or(1).max(1) as f64 * 1.05).max(1.0);
                side_by_side(
                    &bottom,
                    "live memory per iteration, by iteration number: peak (thick) and floor (thin), warm-up first (A blue, B orange)",
                    (n - 1.0, ticks::Unit::Count, "complete iteration"),
                    (top, ticks::Unit::Bytes, "live", 80),
                    [(&names[0], lines(pa)), (&names[1], lines(pb))],
                )?;
            }
            None => side_by_side(
                &bottom,
                "fragmentation score over normalised time (A blue, B orange)",
                (1.0, ticks::Unit::Fraction, "time / duration"),
                (100.0, ticks::Unit::Count, "score", 50),
                [(&names[0], vec![(scores(a), 2)]), (&names[1], vec![(scores(b), 2)])],
            )?,
        }
        root.present().map_err(|e| anyhow!("{e}"))?;
    }
    Ok(Image { pixels: buf, width: w, height: h })
}

/// A run's combined score over its normalised time.
fn scores(an: &Analysis) -> Vec<(f64, f64)> {
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
}

/// A part of compare.png.
type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

/// One chart of A (blue) and B (orange) over x from 0 to `x.0` and y from
/// 0 to `y.0`: each side's lines (points, stroke width), the first of them
/// named in the legend.
fn side_by_side(
    bottom: &Area<'_>,
    caption: &str,
    x: (f64, ticks::Unit, &str),
    y: (f64, ticks::Unit, &str, u32),
    sides: [(&String, Vec<(Vec<(f64, f64)>, u32)>); 2],
) -> Result<()> {
    let (bw, bh) = bottom.dim_in_pixel();
    let x_axis = Axis::new(0.0, x.0, (bw / 110).clamp(2, 11) as usize, x.1);
    let y_axis = Axis::new(0.0, y.0, (bh.saturating_sub(70) / 30).clamp(2, 6) as usize, y.1);
    let err = |e: DrawingAreaErrorKind<_>| anyhow!("cannot draw compare.png: {e}");
    let mut chart = ChartBuilder::on(bottom)
        .margin(10)
        .margin_right(40)
        .caption(caption, ("sans-serif", 16))
        .x_label_area_size(30)
        .y_label_area_size(y.3)
        .build_cartesian_2d(Ticked::new(0f64..x.0, &x_axis), Ticked::new(0f64..y.0, &y_axis))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x.2)
        .y_desc(y.2)
        .label_style(("sans-serif", 12))
        .x_label_formatter(&|v| x_axis.label(*v))
        .y_label_formatter(&|v| y_axis.label(*v))
        .draw()
        .map_err(err)?;
    for ((name, lines), colour) in sides.into_iter().zip([RGBColor(31, 90, 170), RGBColor(230, 120, 20)]) {
        for (k, (points, width)) in lines.into_iter().enumerate() {
            let drawn = chart.draw_series(LineSeries::new(points, colour.stroke_width(width))).map_err(err)?;
            if k == 0 {
                drawn
                    .label(name.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(width)));
            }
        }
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
