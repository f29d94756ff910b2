//! A time axis with its idle stretches shortened ([`TimeMap`]): a run of
//! time in which no block or segment was allocated or freed, longer than
//! a few iterations, becomes a narrow marked break, so the steps fill the
//! picture. A training run that loads for 6 s and then steps for 3 s
//! otherwise spends two thirds of the picture on the wait.
//!
//! The rule: the span is cut into [`BINS`] equal bins, and a run of bins
//! with no event is idle when it lasts at least [`MIN_IDLE_SHARE`] of the
//! span and at least [`MIN_IDLE_PERIODS`] iteration periods (when the
//! trace has iterations). The longest [`MAX_BREAKS`] such runs are
//! shortened, each to [`BREAK_SHARE`] of the axis, when together they are
//! at least [`MIN_SAVED_SHARE`] of the span; otherwise the axis keeps true
//! time. Ticks are labelled with the true time, so the labels jump at a
//! break. The explorable view keeps true time.

use crate::output::ticks::{Axis, Unit, labels_by_step, step};

/// Bins the span is cut into to find where nothing happened.
pub const BINS: usize = 4096;
/// An idle run lasts at least this share of the span...
pub const MIN_IDLE_SHARE: f64 = 0.05;
/// ...and at least this many iteration periods, where they are known.
pub const MIN_IDLE_PERIODS: f64 = 3.0;
/// Shortening is drawn when the idle runs take this share of the span.
pub const MIN_SAVED_SHARE: f64 = 0.15;
/// Each break's width, as a share of the axis.
pub const BREAK_SHARE: f64 = 0.02;
/// Breaks at most: the longest idle runs.
pub const MAX_BREAKS: usize = 6;

/// What a break stands for, written up its band: "5.2 s idle", "23 ms idle".
pub fn label(idle_ns: f64) -> String {
    if idle_ns >= 1e9 { format!("{:.1} s idle", idle_ns / 1e9) } else { format!("{:.0} ms idle", idle_ns / 1e6) }
}

/// How true time (ns from the trace's first event) maps to the axis. A
/// plain value (`Copy`): a picture's panels carry it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimeMap {
    /// Idle stretches [from, to), ns from the first event, in order: the
    /// first `breaks` of them.
    stretches: [(f64, f64); MAX_BREAKS],
    breaks: usize,
    /// The axis's length, in its own coordinates (ns where time is kept).
    span: f64,
    /// The true span.
    real: f64,
    /// Each break's width on the axis.
    gap: f64,
}

impl TimeMap {
    /// True time over `span` ns.
    pub fn identity(span: f64) -> TimeMap {
        TimeMap { stretches: [(0.0, 0.0); MAX_BREAKS], breaks: 0, span, real: span, gap: 0.0 }
    }

    /// The map for events at `times` (ns from the first event) over
    /// `span` ns; `period`: the iteration period in ns, where known.
    pub fn of(times: impl IntoIterator<Item = u64>, span: f64, period: Option<f64>) -> TimeMap {
        if span.is_nan() || span < BINS as f64 {
            return TimeMap::identity(span);
        }
        let width = span / BINS as f64;
        let mut busy = vec![false; BINS];
        for t in times {
            busy[((t as f64 / width) as usize).min(BINS - 1)] = true;
        }
        let least = (span * MIN_IDLE_SHARE).max(period.map_or(0.0, |p| p * MIN_IDLE_PERIODS));
        let mut runs = Vec::new();
        let mut i = 0;
        while i < BINS {
            if busy[i] {
                i += 1;
                continue;
            }
            let start = i;
            while i < BINS && !busy[i] {
                i += 1;
            }
            let (from, to) = (start as f64 * width, i as f64 * width);
            if to - from >= least {
                runs.push((from, to));
            }
        }
        runs.sort_by(|a, b| (b.1 - b.0).total_cmp(&(a.1 - a.0)));
        runs.truncate(MAX_BREAKS);
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let idle: f64 = runs.iter().map(|r| r.1 - r.0).sum();
        if runs.is_empty() || idle < MIN_SAVED_SHARE * span {
            return TimeMap::identity(span);
        }
        let axis = (span - idle) / (1.0 - BREAK_SHARE * runs.len() as f64);
        let mut stretches = [(0.0, 0.0); MAX_BREAKS];
        stretches[..runs.len()].copy_from_slice(&runs);
        TimeMap { stretches, breaks: runs.len(), span: axis, real: span, gap: BREAK_SHARE * axis }
    }

    /// The idle stretches, in order.
    fn idle(&self) -> &[(f64, f64)] {
        &self.stretches[..self.breaks]
    }

    /// Whether the axis keeps true time.
    pub fn is_identity(&self) -> bool {
        self.breaks == 0
    }

    /// The axis's length.
    pub fn span(&self) -> f64 {
        self.span
    }

    /// The axis coordinate of `t` ns from the first event (inside an idle
    /// stretch, its share of the break).
    pub fn x(&self, t: f64) -> f64 {
        let mut removed = 0.0;
        for &(from, to) in self.idle() {
            if t >= to {
                removed += to - from - self.gap;
            } else if t > from {
                return from - removed + (t - from) / (to - from) * self.gap;
            } else {
                break;
            }
        }
        t - removed
    }

    /// The breaks: their start and end on the axis, and the idle time
    /// each stands for (ns).
    pub fn breaks(&self) -> Vec<(f64, f64, f64)> {
        self.idle()
            .iter()
            .map(|&(from, to)| {
                let at = self.x(from);
                (at, at + self.gap, to - from)
            })
            .collect()
    }

    /// At most about `max` time ticks: multiples of one step in the kept
    /// stretches, placed on the axis and labelled with the true time; a
    /// tick closer than half a step to the one before (across a break) is
    /// left out.
    pub fn axis(&self, max: usize) -> Axis {
        let every = step(0.0, self.span, max, Unit::Time);
        let mut kept = Vec::with_capacity(self.breaks + 1);
        let mut from = 0.0;
        for &(a, b) in self.idle() {
            kept.push((from, a));
            from = b;
        }
        kept.push((from, self.real));
        let mut ticks: Vec<f64> = Vec::new();
        let mut last = f64::NEG_INFINITY;
        for (a, b) in kept {
            let mut k = (a / every).ceil();
            while k * every <= b {
                let (t, x) = (k * every, self.x(k * every));
                if x - last >= every / 2.0 {
                    ticks.push(t);
                    last = x;
                }
                k += 1.0;
            }
        }
        Axis { labels: labels_by_step(&ticks, every, Unit::Time), at: ticks.iter().map(|&t| self.x(t)).collect() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    /// Events at 0–1 s, then nothing for 6 s, then steps from 7 s to 10 s.
    fn waits() -> Vec<u64> {
        let mut t: Vec<u64> = (0..100).map(|i| i * S / 100).collect();
        t.extend((0..3000).map(|i| 7 * S + i * S / 1000));
        t.push(10 * S);
        t
    }

    #[test]
    fn a_long_wait_becomes_a_break_and_the_steps_fill_the_axis() {
        let m = TimeMap::of(waits(), (10 * S) as f64, Some(0.1 * S as f64));
        let breaks = m.breaks();
        assert_eq!(breaks.len(), 1, "{m:?}");
        // The break stands for about the 6 s of the wait.
        assert!((breaks[0].2 / S as f64 - 6.0).abs() < 0.01, "{breaks:?}");
        // 4 s of activity and one break of 2 % of the axis.
        assert!((m.span() - 4.0 * S as f64 / 0.98).abs() < 0.01 * S as f64, "{}", m.span());
        // Before the wait, time is kept; after it, shifted by the wait
        // less the break; inside it, on the break.
        assert_eq!(m.x(0.5 * S as f64), 0.5 * S as f64);
        assert!((m.x(8.0 * S as f64) - (8.0 * S as f64 - breaks[0].2 + (breaks[0].1 - breaks[0].0))).abs() < 1.0);
        let mid = m.x(4.0 * S as f64);
        assert!(mid > breaks[0].0 && mid < breaks[0].1);
        // The steps (7–10 s) take most of the axis: they took 30 % of it.
        assert!((m.x(10.0 * S as f64) - m.x(7.0 * S as f64)) / m.span() > 0.7);
        // Ticks are true times, in order on the axis, none inside the wait.
        let axis = m.axis(8);
        assert!(axis.at.windows(2).all(|w| w[0] < w[1]), "{axis:?}");
        assert!(axis.labels.iter().any(|l| l.starts_with('8')), "{axis:?}");
        let mut distinct = axis.labels.clone();
        distinct.dedup();
        assert_eq!(distinct, axis.labels, "every label once");
        assert!(!axis.labels.iter().any(|l| l.starts_with('4')), "{axis:?}");
    }

    #[test]
    fn short_waits_and_busy_traces_keep_true_time() {
        // A wait shorter than three iterations is not idle.
        let m = TimeMap::of(waits(), (10 * S) as f64, Some(2.5 * S as f64));
        assert!(m.is_identity());
        // Events everywhere: nothing to shorten.
        let busy = (0..10_000u64).map(|i| i * S / 1000);
        let m = TimeMap::of(busy, (10 * S) as f64, None);
        assert!(m.is_identity());
        assert_eq!(m.x(3.0 * S as f64), 3.0 * S as f64);
        assert_eq!(m.span(), (10 * S) as f64);
    }
}
