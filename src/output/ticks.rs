//! Axis ticks at values a reader takes in at a glance, in the axis's own
//! unit, for every plot:
//! - **bytes**: a step of 1, 2 or 5 × 10ⁿ of B, KiB, MiB, GiB or TiB
//!   (0, 1, 2, 3 GiB; 0, 10, 20, 30 GiB; 0, 200, 400 MiB), or, below a unit
//!   the axis reaches, a power of two that divides it (0, 512 MiB, 1 GiB,
//!   1.5 GiB), each label in the largest unit that writes it exactly;
//! - **time** (ns): 1, 2 or 5 × 10ⁿ ns, µs, ms or s, then 1, 2, 5, 10, 15,
//!   30 min and 1, 2, 3, 6, 12, 24 h, labelled in the step's unit;
//! - **fractions** (a normalised axis): 0.1, 0.2, 0.25 or 0.5;
//! - **counts** (trace entries, scores): 1, 2 or 5 × 10ⁿ.
//!
//! The step is the smallest candidate that gives at most the number of
//! ticks asked for; ticks are its multiples inside the range.

/// What an axis measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Bytes,
    /// Nanoseconds.
    Time,
    Fraction,
    Count,
}

const KIB: f64 = 1024.0;
const BYTE_UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
const NS: [(f64, &str); 4] = [(1.0, "ns"), (1e3, "µs"), (1e6, "ms"), (1e9, "s")];
const MINUTE: f64 = 60e9;
const HOUR: f64 = 3600e9;

/// Candidate steps of `unit` for an axis reaching `top`, increasing.
fn candidates(unit: Unit, top: f64) -> Vec<f64> {
    let decades = |scale: f64, from: i32, to: i32| -> Vec<f64> {
        (from..=to).flat_map(|e| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(e) * scale)).collect::<Vec<f64>>()
    };
    let mut c = match unit {
        Unit::Bytes => {
            let mut c = Vec::new();
            for u in 0..BYTE_UNITS.len() {
                let scale = KIB.powi(u as i32);
                if u + 1 < BYTE_UNITS.len() && top >= scale * KIB {
                    // The axis reaches the next unit: steps that divide it
                    // (powers of two: 256 MiB, 512 MiB), so ticks land on
                    // whole and half GiB.
                    c.extend((0..10).map(|k| f64::from(1u32 << k) * scale));
                } else {
                    // 1, 2, 5, 10, …, 500 of the unit.
                    c.extend(decades(scale, 0, 2));
                }
            }
            c.extend(decades(KIB.powi(4), 3, 6));
            c
        }
        Unit::Time => {
            let mut c = decades(1.0, 0, 9);
            c.extend([1.0, 2.0, 5.0, 10.0, 15.0, 30.0].map(|m| m * MINUTE));
            c.extend([1.0, 2.0, 3.0, 6.0, 12.0, 24.0].map(|m| m * HOUR));
            c.extend(decades(24.0 * HOUR, 0, 4));
            c
        }
        Unit::Fraction => {
            let mut c = decades(1.0, -6, -2);
            c.extend([0.1, 0.2, 0.25, 0.5, 1.0]);
            c.extend(decades(1.0, 1, 12));
            c
        }
        Unit::Count => decades(1.0, -6, 15),
    };
    c.sort_by(f64::total_cmp);
    c.dedup();
    c
}

/// The tick step for `[lo, hi]` with at most `max` ticks (at least 2).
pub fn step(lo: f64, hi: f64, max: usize, unit: Unit) -> f64 {
    let span = (hi - lo).abs();
    let max = max.max(2) as f64;
    let all = candidates(unit, lo.abs().max(hi.abs()));
    if !(span > 0.0) || !span.is_finite() {
        return all[0];
    }
    let count = |s: f64| ((hi / s).floor() - (lo / s).ceil() + 1.0).max(0.0);
    all.iter().copied().find(|&s| count(s) <= max).unwrap_or_else(|| {
        // Beyond the candidates: a power of ten that fits.
        10f64.powf((span / (max - 1.0)).log10().ceil())
    })
}

/// Ticks inside `[lo, hi]`: the multiples of [`step`].
pub fn ticks(lo: f64, hi: f64, max: usize, unit: Unit) -> Vec<f64> {
    let s = step(lo, hi, max, unit);
    if !(hi > lo) || !s.is_finite() {
        return vec![lo];
    }
    let first = (lo / s).ceil() as i64;
    let last = (hi / s).floor() as i64;
    (first..=last).map(|k| k as f64 * s).collect()
}

/// The labels of an axis's ticks (as [`ticks`] gives them): bytes each in
/// its own largest exact unit; times all in one unit, the largest that the
/// ticks reach and that writes the step with at most two decimals;
/// fractions and counts with the decimals of the step.
pub fn labels(ticks: &[f64], unit: Unit) -> Vec<String> {
    labels_by_step(ticks, if ticks.len() > 1 { ticks[1] - ticks[0] } else { 1.0 }, unit)
}

/// [`labels`] of ticks that are multiples of `step` but not all one step
/// apart (an axis with breaks).
pub fn labels_by_step(ticks: &[f64], step: f64, unit: Unit) -> Vec<String> {
    let top = ticks.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    match unit {
        Unit::Bytes => ticks.iter().map(|&v| bytes_label(v)).collect(),
        Unit::Time => {
            let (scale, name) = time_unit(step, top);
            let d = decimals(step / scale);
            ticks
                .iter()
                .map(|&v| if v == 0.0 { "0".into() } else { format!("{} {name}", number(v / scale, d)) })
                .collect()
        }
        Unit::Fraction | Unit::Count => ticks.iter().map(|&v| number(v, decimals(step))).collect(),
    }
}

/// The unit of a time axis with this step whose ticks reach `top`.
fn time_unit(step: f64, top: f64) -> (f64, &'static str) {
    let whole = |x: f64| (x - x.round()).abs() < 1e-9;
    if step >= HOUR && whole(step / HOUR) {
        (HOUR, "h")
    } else if step >= MINUTE && whole(step / MINUTE) {
        (MINUTE, "min")
    } else {
        NS.iter().rev().copied().find(|&(s, _)| s <= top.max(step) && decimals(step / s) <= 2).unwrap_or(NS[0])
    }
}

/// An axis's ticks in plot coordinates, with their labels: what a chart
/// takes as key points (`with_key_points`) and its label formatter.
#[derive(Clone, Debug, PartialEq)]
pub struct Axis {
    /// Tick positions in the chart's coordinates.
    pub at: Vec<f64>,
    pub labels: Vec<String>,
}

impl Axis {
    /// At most `max` ticks over `[lo, hi]` of `unit`, one coordinate unit
    /// per unit of the axis.
    pub fn new(lo: f64, hi: f64, max: usize, unit: Unit) -> Axis {
        Axis::scaled(lo, hi, max, unit, 1.0)
    }

    /// The same, where one unit of the axis is `scale` chart coordinates
    /// (a fraction of a span drawn in ns: `scale` = the span).
    pub fn scaled(lo: f64, hi: f64, max: usize, unit: Unit, scale: f64) -> Axis {
        let t = ticks(lo, hi, max, unit);
        Axis { labels: labels(&t, unit), at: t.iter().map(|v| v * scale).collect() }
    }

    /// The label of the tick at `v` (empty off the ticks).
    pub fn label(&self, v: f64) -> String {
        let tolerance = self.at.windows(2).map(|w| (w[1] - w[0]) * 1e-6).next().unwrap_or(1e-9).abs();
        self.at.iter().position(|&t| (t - v).abs() <= tolerance).map_or_else(String::new, |i| self.labels[i].clone())
    }

    /// The widest label, in characters.
    pub fn widest(&self) -> usize {
        self.labels.iter().map(|l| l.chars().count()).max().unwrap_or(0)
    }
}

/// The decimals that write multiples of `step` exactly (at most 6).
fn decimals(step: f64) -> usize {
    (0..6).find(|&d| ((step * 10f64.powi(d as i32)).round() - step * 10f64.powi(d as i32)).abs() < 1e-6).unwrap_or(6)
}

fn number(v: f64, decimals: usize) -> String {
    let s = format!("{v:.decimals$}");
    if s.starts_with('-') && s.trim_start_matches(['-', '0', '.']).is_empty() { s[1..].to_string() } else { s }
}

/// Bytes in the largest binary unit that writes them with at most two
/// decimals, exactly: 1.5 GiB, 768 MiB, 0 B.
fn bytes_label(v: f64) -> String {
    if v <= 0.0 {
        return "0 B".into();
    }
    for u in (0..BYTE_UNITS.len()).rev() {
        let x = v / KIB.powi(u as i32);
        if x >= 1.0 {
            let d = decimals(x);
            if d <= 2 {
                return format!("{} {}", number(x, d), BYTE_UNITS[u]);
            }
        }
    }
    format!("{} B", number(v, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    const MIB: f64 = 1024.0 * 1024.0;

    fn axis(lo: f64, hi: f64, max: usize, unit: Unit) -> Vec<String> {
        labels(&ticks(lo, hi, max, unit), unit)
    }

    #[test]
    fn byte_axes_step_in_binary_units() {
        // The examples: 953.67 MiB, 1.86 GiB, … become whole GiB.
        assert_eq!(axis(0.0, 3.9 * GIB, 6, Unit::Bytes), ["0 B", "1 GiB", "2 GiB", "3 GiB"]);
        assert_eq!(axis(0.0, 28.0 * GIB, 4, Unit::Bytes), ["0 B", "10 GiB", "20 GiB"]);
        assert_eq!(axis(0.0, 37.0 * GIB, 5, Unit::Bytes), ["0 B", "10 GiB", "20 GiB", "30 GiB"]);
        assert_eq!(axis(0.0, 1.6 * GIB, 5, Unit::Bytes), ["0 B", "512 MiB", "1 GiB", "1.5 GiB"]);
        assert_eq!(axis(0.0, 900.0 * MIB, 6, Unit::Bytes), ["0 B", "200 MiB", "400 MiB", "600 MiB", "800 MiB"]);
        assert_eq!(axis(0.0, 3000.0, 4, Unit::Bytes), ["0 B", "1 KiB", "2 KiB"]);
        assert_eq!(axis(0.0, 100.0, 6, Unit::Bytes), ["0 B", "20 B", "40 B", "60 B", "80 B", "100 B"]);
        assert_eq!(axis(4.0 * GIB, 7.5 * GIB, 5, Unit::Bytes), ["4 GiB", "5 GiB", "6 GiB", "7 GiB"]);
        assert_eq!(axis(0.0, 3.0 * 1024.0 * GIB, 4, Unit::Bytes), ["0 B", "1 TiB", "2 TiB", "3 TiB"]);
    }

    #[test]
    fn time_axes_step_in_round_units() {
        let s = 1e9;
        assert_eq!(axis(0.0, 100.0 * 60.0 * s, 6, Unit::Time), ["0", "30 min", "60 min", "90 min"]);
        assert_eq!(axis(0.0, 3.7 * s, 5, Unit::Time), ["0", "1 s", "2 s", "3 s"]);
        assert_eq!(axis(0.0, 0.9 * s, 6, Unit::Time), ["0", "200 ms", "400 ms", "600 ms", "800 ms"]);
        assert_eq!(axis(0.0, 1.5 * s, 4, Unit::Time), ["0", "0.5 s", "1.0 s", "1.5 s"]);
        assert_eq!(axis(0.0, 45e3, 5, Unit::Time), ["0", "10 µs", "20 µs", "30 µs", "40 µs"]);
        assert_eq!(axis(0.0, 7.0 * 3600.0 * s, 5, Unit::Time), ["0", "2 h", "4 h", "6 h"]);
        assert_eq!(axis(0.0, 80.0, 5, Unit::Time), ["0", "20 ns", "40 ns", "60 ns", "80 ns"]);
    }

    #[test]
    fn fractions_step_by_a_tenth_or_a_quarter() {
        assert_eq!(
            axis(0.0, 1.0, 11, Unit::Fraction),
            ["0.0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9", "1.0"]
        );
        assert_eq!(axis(0.0, 1.0, 5, Unit::Fraction), ["0.00", "0.25", "0.50", "0.75", "1.00"]);
        assert_eq!(axis(0.0, 1.0, 3, Unit::Fraction), ["0.0", "0.5", "1.0"]);
    }

    #[test]
    fn counts_step_by_one_two_five() {
        assert_eq!(axis(0.0, 100.0, 6, Unit::Count), ["0", "20", "40", "60", "80", "100"]);
        assert_eq!(axis(0.0, 10992.0, 6, Unit::Count), ["0", "2000", "4000", "6000", "8000", "10000"]);
        assert_eq!(axis(0.0, 7.0, 10, Unit::Count), ["0", "1", "2", "3", "4", "5", "6", "7"]);
    }

    #[test]
    fn never_more_ticks_than_asked_and_never_empty() {
        for unit in [Unit::Bytes, Unit::Time, Unit::Fraction, Unit::Count] {
            for &(lo, hi) in &[(0.0, 1.0), (0.0, 1e3), (0.0, 7.77e9), (3.0, 3.5), (0.0, 1e18), (0.0, 1e-3)] {
                for max in 2..12 {
                    let t = ticks(lo, hi, max, unit);
                    assert!(!t.is_empty() && t.len() <= max, "{unit:?} {lo}..{hi} max {max}: {t:?}");
                    assert!(t.iter().all(|&v| v >= lo - 1e-9 * hi.abs() && v <= hi * (1.0 + 1e-9)));
                }
            }
        }
        assert_eq!(ticks(5.0, 5.0, 4, Unit::Count), [5.0]);
    }
}
