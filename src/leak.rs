//! Leaks: memory that stays allocated. Two views per process:
//! - the *floor* of live bytes — the least memory the process held over a
//!   stretch of time — compared between the second quarter of the trace and
//!   the last quarter (the first quarter is warm-up: weights, optimizer
//!   state). A floor that rose by more than 2 % of the peak (and at least
//!   16 MiB) is a leak: memory that never returned to its earlier level.
//!   The rate is that growth over the time between the two windows.
//! - the blocks still alive at the end, grouped by size (by call site when
//!   the trace carries stacks: PyTorch snapshots, `record --stacks`).

use serde::Serialize;

/// Sizes of blocks alive at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SizeGroup {
    pub size: u64,
    pub count: u64,
    pub bytes: u64,
}

/// The leak verdict of one process.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LeakReport {
    pub pid: u32,
    /// None when there are too few steps to compare quarters.
    pub leaking: Option<bool>,
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
    pub top_sites: Vec<crate::sites::SiteBytes>,
}

/// `series` is (t_ns, live bytes) at each step of the process; `live` its
/// blocks alive at the end; `peak` its peak live bytes.
pub fn detect(pid: u32, series: &[(u64, u64)], live: &[(u64, u64)], peak: u64) -> LeakReport {
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
        leaking: None,
        floor_early_bytes: 0,
        floor_late_bytes: 0,
        growth_bytes: 0,
        rate_bytes_per_s: 0.0,
        live_at_end_bytes: live.iter().map(|b| b.1).sum(),
        live_at_end_blocks: live.len() as u64,
        by_size,
        top_sites: Vec::new(),
    };
    let n = series.len();
    if n < 8 {
        return report;
    }
    let floor = |r: std::ops::Range<usize>| series[r].iter().map(|s| s.1).min().unwrap_or(0);
    let early = floor(n / 4..n / 2);
    let late = floor(3 * n / 4..n);
    let growth = late as i64 - early as i64;
    let seconds = (series[3 * n / 4].0 - series[n / 4].0) as f64 / 1e9;
    report.floor_early_bytes = early;
    report.floor_late_bytes = late;
    report.growth_bytes = growth;
    report.rate_bytes_per_s = if seconds > 0.0 { growth as f64 / seconds } else { 0.0 };
    report.leaking = Some(growth > 0 && growth as u64 > (peak / 50).max(16 << 20));
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_rising_floor_is_a_leak_a_sawtooth_is_not() {
        // Sawtooth over a constant floor of 1 GiB.
        let saw: Vec<(u64, u64)> = (0..100).map(|i| (i * 1_000_000, 1024 * MIB + (i % 10) * 100 * MIB)).collect();
        let r = detect(1, &saw, &[], 2000 * MIB);
        assert_eq!(r.leaking, Some(false));
        assert_eq!(r.growth_bytes, 0);
        // The same with 8 MiB more held every step.
        let leak: Vec<(u64, u64)> = saw.iter().enumerate().map(|(i, &(t, v))| (t, v + i as u64 * 8 * MIB)).collect();
        let r = detect(1, &leak, &[(0, MIB), (MIB, MIB), (4 * MIB, 3 * MIB)], 3000 * MIB);
        assert_eq!(r.leaking, Some(true));
        assert!(r.growth_bytes > 0 && r.rate_bytes_per_s > 0.0);
        assert_eq!(r.by_size[0], SizeGroup { size: 3 * MIB, count: 1, bytes: 3 * MIB });
        assert_eq!(r.by_size[1], SizeGroup { size: MIB, count: 2, bytes: 2 * MIB });
        assert_eq!(detect(1, &saw[..5], &[], 0).leaking, None);
    }
}
