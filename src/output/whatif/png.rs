//! whatif.png: reserved and allocated over time, of the recorded settings
//! against the recommended scenario.

use crate::analysis::whatif::{Scenario, Whatif};

/// whatif.png: reserved (thick) and allocated (thin) bytes over time, of
/// the recorded settings (blue) and the recommended scenario (orange),
/// OOMs as ticks along the bottom in each one's colour. The first device.
pub fn render_png(w: &Whatif, width: u32, height: u32) -> anyhow::Result<crate::output::plot::Image> {
    use crate::output::plot::{Image, Ticked, fonts};
    use crate::output::ticks::{Axis, Unit};
    use anyhow::anyhow;
    use plotters::prelude::*;

    fonts()?;
    let first = |s: &Scenario| s.devices.first().cloned().unwrap_or_default();
    let recorded = first(&w.scenarios[0]);
    let recommended = (w.recommended.0 != 0).then(|| first(&w.scenarios[w.recommended.0]));
    let all: Vec<&(u64, u64, u64)> =
        recorded.series.iter().chain(recommended.iter().flat_map(|o| o.series.iter())).collect();
    let t0 = all.iter().map(|p| p.0).min().unwrap_or(0);
    let span = (all.iter().map(|p| p.0).max().unwrap_or(0) - t0).max(1) as f64;
    let top = (all.iter().map(|p| p.1).max().unwrap_or(1).max(1) as f64 * 1.05).max(1.0);
    let mut buf = vec![255u8; (width * height * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (width, height)).into_drawing_area();
        let title = match &recommended {
            Some(_) => format!("reserved and allocated: recorded settings against {}", w.recommendation()),
            None => "reserved and allocated under the recorded settings (recommendation: keep them)".to_string(),
        };
        let x_axis = Axis::new(0.0, span, (width / 130).clamp(2, 10) as usize, Unit::Time);
        let y_axis = Axis::new(0.0, top, (height / 60).clamp(2, 8) as usize, Unit::Bytes);
        let err = |e: DrawingAreaErrorKind<_>| anyhow!("cannot draw whatif.png: {e}");
        let mut c = ChartBuilder::on(&root.margin(8, 8, 8, 8))
            .caption(title, ("sans-serif", 16))
            .x_label_area_size(36)
            .y_label_area_size(90)
            .margin_right(40)
            .build_cartesian_2d(Ticked::new(0.0..span, &x_axis), Ticked::new(0.0..top, &y_axis))
            .map_err(err)?;
        c.configure_mesh()
            .x_desc("time")
            .y_desc("bytes")
            .label_style(("sans-serif", 12))
            .x_label_formatter(&|v| x_axis.label(*v))
            .y_label_formatter(&|v| y_axis.label(*v))
            .draw()
            .map_err(err)?;
        let blue = RGBColor(31, 90, 170);
        let orange = RGBColor(230, 120, 20);
        let mut draw = |o: &crate::analysis::whatif::Outcome, colour: RGBColor, label: &str| -> anyhow::Result<()> {
            let x = |t: u64| (t - t0) as f64;
            c.draw_series(LineSeries::new(o.series.iter().map(|p| (x(p.0), p.1 as f64)), colour.stroke_width(2)))
                .map_err(err)?
                .label(format!("{label}: reserved"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2)));
            c.draw_series(LineSeries::new(o.series.iter().map(|p| (x(p.0), p.2 as f64)), colour.mix(0.5)))
                .map_err(err)?
                .label(format!("{label}: allocated"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour.mix(0.5)));
            let tick = top * 0.03;
            c.draw_series(o.oom_times.iter().map(|&t| PathElement::new(vec![(x(t), 0.0), (x(t), tick)], colour)))
                .map_err(err)?;
            Ok(())
        };
        draw(&recorded, blue, &format!("recorded ({} OOMs)", recorded.ooms))?;
        if let Some(o) = &recommended {
            draw(o, orange, &format!("recommended ({} OOMs)", o.ooms))?;
        }
        c.configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(Image { pixels: buf, width, height })
}
