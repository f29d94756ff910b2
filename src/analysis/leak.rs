//! Leaks: memory that stays allocated, iteration after iteration.
//!
//! The verdict is `leaking`, `not leaking` or `cannot tell`, never stronger
//! than the evidence:
//! - **With iterations** ([`crate::analysis::iterations`]): the *floor* of each
//!   complete iteration — the least memory held inside it — after the first
//!   (warm-up) one. It is a leak when those floors rise across at least 3
//!   complete iterations, by more than the noise threshold (2 % of the peak,
//!   at least 16 MiB) in all, without falling back (each floor at least the
//!   previous one, within that threshold). Fewer than 3 such iterations:
//!   `cannot tell`, since memory allocated once — optimizer moments, caches,
//!   activations held for backward — looks like growth inside one
//!   iteration.
//! - **Without iterations**: the floor of the second quarter of the trace
//!   against the last quarter (the first quarter is warm-up). No growth
//!   beyond the threshold: `not leaking`. Growth: `leaking` only when the
//!   floors of six windows after the first quarter rise at every window (a
//!   monotone growth over at least 5 windows), else `cannot tell`.
//! - Too few steps for either: `cannot tell`.
//!
//! The rate is the growth over the time between the compared floors. Also
//! reported: the blocks still alive at the end, grouped by size (and by
//! call site when the trace carries stacks).

use serde::Serialize;

/// Sizes of blocks alive at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SizeGroup {
    pub size: u64,
    pub count: u64,
    pub bytes: u64,
}

/// What the evidence says about a leak.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    #[serde(rename = "leaking")]
    Leaking,
    #[serde(rename = "not leaking")]
    NotLeaking,
    #[serde(rename = "cannot tell")]
    CannotTell,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Leaking => "leaking",
            Verdict::NotLeaking => "not leaking",
            Verdict::CannotTell => "cannot tell",
        }
    }
}

/// The leak verdict of one process.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LeakReport {
    pub pid: u32,
    pub verdict: Verdict,
    /// Why, in plain words.
    pub reason: String,
    /// True only for [`Verdict::Leaking`].
    pub leaking: bool,
    pub floor_early_bytes: u64,
    pub floor_late_bytes: u64,
    pub growth_bytes: i64,
    pub rate_bytes_per_s: f64,
    pub live_at_end_bytes: u64,
    pub live_at_end_blocks: u64,
    /// Largest groups first (by bytes), at most ten.
    pub by_size: Vec<SizeGroup>,
    /// Live bytes at the end by call site, of the blocks allocated after
    /// the second quarter (the growth), largest first (traces with stacks).
    pub top_sites: Vec<crate::analysis::sites::SiteBytes>,
    /// Traces with stacks and iterations: blocks alive at the end that were
    /// allocated once, in the warm-up (or the only) iteration, by call site
    /// — state such as optimizer moments, not leaks.
    pub allocated_once: Vec<crate::analysis::sites::SiteBytes>,
}

/// Growth below this is noise: 2 % of the peak, at least 16 MiB.
fn threshold(peak: u64) -> u64 {
    (peak / 50).max(16 << 20)
}

/// `series` is (t_ns, live bytes) at each step of the process; `live` its
/// blocks alive at the end; `peak` its peak live bytes; `iterations` its
/// iterations, when found.
pub fn detect(
    pid: u32,
    series: &[(u64, u64)],
    live: &[(u64, u64)],
    peak: u64,
    iterations: Option<&crate::analysis::iterations::Iterations>,
) -> LeakReport {
    let mut groups: std::collections::BTreeMap<u64, (u64, u64)> = Default::default();
    for &(_, size) in live {
        let g = groups.entry(size).or_default();
        g.0 += 1;
        g.1 += size;
    }
    let mut by_size: Vec<SizeGroup> =
        groups.into_iter().map(|(size, (count, bytes))| SizeGroup { size, count, bytes }).collect();
    by_size.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.size.cmp(&b.size)));
    by_size.truncate(10);
    let mut report = LeakReport {
        pid,
        verdict: Verdict::CannotTell,
        reason: String::new(),
        leaking: false,
        floor_early_bytes: 0,
        floor_late_bytes: 0,
        growth_bytes: 0,
        rate_bytes_per_s: 0.0,
        live_at_end_bytes: live.iter().map(|b| b.1).sum(),
        live_at_end_blocks: live.len() as u64,
        by_size,
        top_sites: Vec::new(),
        allocated_once: Vec::new(),
    };
    let noise = threshold(peak);
    let (verdict, reason) = match iterations {
        Some(it) => by_iterations(&mut report, series, it, noise),
        None => by_quarters(&mut report, series, noise),
    };
    report.verdict = verdict;
    report.leaking = verdict == Verdict::Leaking;
    report.reason = reason;
    report
}

/// The floor of `series` over [t0, t1).
fn floor_between(series: &[(u64, u64)], t0: u64, t1: u64) -> Option<u64> {
    series.iter().filter(|s| s.0 >= t0 && s.0 < t1).map(|s| s.1).min()
}

fn by_iterations(
    r: &mut LeakReport,
    series: &[(u64, u64)],
    it: &crate::analysis::iterations::Iterations,
    noise: u64,
) -> (Verdict, String) {
    // Complete iterations after the warm-up one, with a row inside.
    let spans: Vec<(u64, u64, u64)> =
        it.spans().skip(1).filter_map(|(a, b)| floor_between(series, a, b).map(|f| (a, b, f))).collect();
    if spans.len() < 3 {
        return (
            Verdict::CannotTell,
            format!(
                "{} complete iteration{} after the warm-up (at least 3 are needed): memory allocated once — optimizer \
                 moments, caches, activations held for backward — cannot be told from a leak within one iteration",
                spans.len(),
                if spans.len() == 1 { "" } else { "s" }
            ),
        );
    }
    let (first, last) = (spans[0], spans[spans.len() - 1]);
    r.floor_early_bytes = first.2;
    r.floor_late_bytes = last.2;
    r.growth_bytes = last.2 as i64 - first.2 as i64;
    let seconds = (last.0 - first.0) as f64 / 1e9;
    r.rate_bytes_per_s = if seconds > 0.0 && r.growth_bytes > 0 { r.growth_bytes as f64 / seconds } else { 0.0 };
    let never_falls = spans.windows(2).all(|w| w[1].2 + noise >= w[0].2);
    let n = spans.len();
    if r.growth_bytes > noise as i64 && never_falls {
        (
            Verdict::Leaking,
            format!(
                "the floor of {n} complete iterations after the warm-up rose from {} to {} without falling back",
                crate::units::bytes(first.2),
                crate::units::bytes(last.2)
            ),
        )
    } else if r.growth_bytes > noise as i64 {
        (
            Verdict::CannotTell,
            format!("the floor of {n} complete iterations rose in all but fell back in between: no steady growth"),
        )
    } else {
        (
            Verdict::NotLeaking,
            format!("the floor of {n} complete iterations after the warm-up did not rise beyond the noise"),
        )
    }
}

fn by_quarters(r: &mut LeakReport, series: &[(u64, u64)], noise: u64) -> (Verdict, String) {
    let n = series.len();
    if n < 8 {
        return (Verdict::CannotTell, format!("{n} steps: too few to compare the floor of live memory over time"));
    }
    let floor = |r: std::ops::Range<usize>| series[r].iter().map(|s| s.1).min().unwrap_or(0);
    let early = floor(n / 4..n / 2);
    let late = floor(3 * n / 4..n);
    let growth = late as i64 - early as i64;
    let seconds = (series[3 * n / 4].0 - series[n / 4].0) as f64 / 1e9;
    r.floor_early_bytes = early;
    r.floor_late_bytes = late;
    r.growth_bytes = growth;
    r.rate_bytes_per_s = if seconds > 0.0 { growth as f64 / seconds } else { 0.0 };
    if growth <= 0 || growth as u64 <= noise {
        return (
            Verdict::NotLeaking,
            "no iterations found; the floor of live memory did not rise from the second quarter to the last".into(),
        );
    }
    // Six windows after the first quarter: a leak rises at each.
    let rest = &series[n / 4..];
    let w = rest.len() / 6;
    let monotone = w > 0 && {
        let floors: Vec<u64> =
            (0..6).map(|k| rest[k * w..(k + 1) * w].iter().map(|s| s.1).min().unwrap_or(0)).collect();
        floors.windows(2).all(|p| p[1] > p[0])
    };
    if monotone {
        (
            Verdict::Leaking,
            "no iterations found; the floor of live memory rose at each of six windows after the first quarter".into(),
        )
    } else {
        (
            Verdict::CannotTell,
            "no iterations found; the floor of live memory rose, but not steadily: one pass that holds memory \
             (a forward pass keeping activations, a cache filling up) looks the same"
                .into(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn without_iterations_a_steady_rise_is_a_leak_a_sawtooth_is_not() {
        // Sawtooth over a constant floor of 1 GiB.
        let saw: Vec<(u64, u64)> = (0..100).map(|i| (i * 1_000_000, 1024 * MIB + (i % 10) * 100 * MIB)).collect();
        let r = detect(1, &saw, &[], 2000 * MIB, None);
        assert_eq!((r.verdict, r.leaking), (Verdict::NotLeaking, false));
        assert_eq!(r.growth_bytes, 0);
        // The same with 8 MiB more held every step.
        let leak: Vec<(u64, u64)> = saw.iter().enumerate().map(|(i, &(t, v))| (t, v + i as u64 * 8 * MIB)).collect();
        let r = detect(1, &leak, &[(0, MIB), (MIB, MIB), (4 * MIB, 3 * MIB)], 3000 * MIB, None);
        assert_eq!((r.verdict, r.leaking), (Verdict::Leaking, true));
        assert!(r.growth_bytes > 0 && r.rate_bytes_per_s > 0.0);
        assert_eq!(r.by_size[0], SizeGroup { size: 3 * MIB, count: 1, bytes: 3 * MIB });
        assert_eq!(r.by_size[1], SizeGroup { size: MIB, count: 2, bytes: 2 * MIB });
        assert_eq!(detect(1, &saw[..5], &[], 0, None).verdict, Verdict::CannotTell);
        // One pass that grows then plateaus: growth, but not at every window.
        let pass: Vec<(u64, u64)> = (0..100).map(|i| (i * 1_000_000, (i.min(60)) * 50 * MIB)).collect();
        let r = detect(1, &pass, &[], 3000 * MIB, None);
        assert_eq!(r.verdict, Verdict::CannotTell, "{}", r.reason);
    }

    fn iterations(boundaries: Vec<u64>) -> crate::analysis::iterations::Iterations {
        crate::analysis::iterations::Iterations {
            pid: 1,
            count: boundaries.len(),
            complete: boundaries.len() - 1,
            period_s: None,
            warmup_end_t_ns: boundaries.get(1).copied(),
            source: crate::analysis::iterations::IterationSource::Periodicity,
            boundaries_t_ns: boundaries,
        }
    }

    #[test]
    fn with_iterations_the_floors_after_warm_up_decide() {
        // 10 iterations of 10 steps: a sawtooth from a floor.
        let series = |growth: u64| -> Vec<(u64, u64)> {
            (0..100u64).map(|i| (i, 1024 * MIB + (i / 10) * growth + (i % 10) * 100 * MIB)).collect()
        };
        let all = iterations((0..10).map(|k| k * 10).collect());
        let r = detect(1, &series(0), &[], 2000 * MIB, Some(&all));
        assert_eq!(r.verdict, Verdict::NotLeaking, "{}", r.reason);
        let r = detect(1, &series(64 * MIB), &[], 2000 * MIB, Some(&all));
        assert_eq!(r.verdict, Verdict::Leaking, "{}", r.reason);
        assert_eq!(r.growth_bytes, 7 * 64 * MIB as i64);
        // Growth inside one iteration: cannot tell, whatever the quarters say.
        let one = iterations(vec![0, 50, 99]);
        let r = detect(1, &series(64 * MIB), &[], 2000 * MIB, Some(&one));
        assert_eq!(r.verdict, Verdict::CannotTell);
        assert!(r.reason.contains("optimizer moments"), "{}", r.reason);
    }
}
