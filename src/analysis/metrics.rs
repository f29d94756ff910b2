//! Spatial fragmentation metrics (SPEC §4): the numbers that describe one
//! instant of the replayed address space. [`crate::analysis::replay`] keeps the
//! sufficient statistics up to date event by event ([`GapSet`] and the block
//! counters); [`Metrics::compute`] turns them into a row. [`from_scratch`]
//! recomputes everything from the full live set with plain loops — the
//! reference implementation's approach — and serves as the oracle in tests
//! and as the baseline of the benchmark.

use anyhow::{Result, bail};
use serde::Serialize;

/// The constants of SPEC §4, all configurable from the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MetricsConfig {
    /// Page size P in bytes; a power of two.
    pub page_size: u64,
    /// Blocks of at most this many bytes count as small allocations.
    pub small_threshold: u64,
    /// Gaps of at most this many bytes are alignment slack, not gaps.
    pub min_gap: u64,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig { page_size: 4096, small_threshold: 4 << 20, min_gap: 1024 }
    }
}

impl MetricsConfig {
    pub fn validate(&self) -> Result<()> {
        if !self.page_size.is_power_of_two() {
            bail!("--page-size must be a power of two (got {})", self.page_size);
        }
        Ok(())
    }

    /// Whether a free range of `gap` bytes counts as a gap.
    pub fn is_gap(&self, gap: u64) -> bool {
        gap > self.min_gap
    }
}

/// The metric values describing one instant. Invariants: every ratio is in
/// [0, 1] (the CV may exceed 1), `score` is in [0, 100].
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Metrics {
    pub external_fragmentation: f64,
    pub kernel_unusable_index: f64,
    pub small_alloc_ratio: f64,
    pub size_cv: f64,
    pub large_gap_ratio: f64,
    pub utilization: f64,
    pub score: f64,
    pub live_bytes: u64,
    pub live_blocks: u64,
    pub gap_count: u64,
    pub largest_gap: u64,
    pub span_bytes: u64,
}

/// Sums over the live blocks, kept exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockStats {
    pub bytes: u64,
    pub count: u64,
    pub small: u64,
    pub sum_sq: u128,
}

impl BlockStats {
    pub fn add(&mut self, size: u64, cfg: &MetricsConfig) {
        self.bytes += size;
        self.count += 1;
        self.small += u64::from(size <= cfg.small_threshold);
        self.sum_sq += u128::from(size) * u128::from(size);
    }

    pub fn remove(&mut self, size: u64, cfg: &MetricsConfig) {
        self.bytes -= size;
        self.count -= 1;
        self.small -= u64::from(size <= cfg.small_threshold);
        self.sum_sq -= u128::from(size) * u128::from(size);
    }

    /// Population standard deviation over mean, exact up to the final
    /// square root when the integers fit (they do for any real trace).
    fn cv(&self) -> f64 {
        if self.count == 0 || self.bytes == 0 {
            return 0.0;
        }
        let n = u128::from(self.count);
        let sum = u128::from(self.bytes);
        match n.checked_mul(self.sum_sq).and_then(|a| a.checked_sub(sum * sum)) {
            Some(num) => (num as f64).sqrt() / sum as f64,
            None => {
                let mean = self.bytes as f64 / self.count as f64;
                let var = (self.sum_sq as f64 / self.count as f64 - mean * mean).max(0.0);
                var.sqrt() / mean
            }
        }
    }
}

/// The questions the metrics ask of the set of gaps at one instant.
pub trait GapQuery {
    fn count(&self) -> u64;
    fn sum(&self) -> u64;
    fn largest(&self) -> u64;
    /// Σ ⌊gap / 2^shift⌋.
    fn sum_div_pow2(&self, shift: u32) -> u64;
    /// Σ of the gaps strictly larger than `threshold`.
    fn sum_above(&self, threshold: u64) -> u64;
}

/// Target block T of the unusable-free-space index:
/// max(2 · 2^⌈log2 avg⌉, P), with avg the mean live block size.
pub fn target_block(blocks: &BlockStats, page_size: u64) -> u64 {
    if blocks.count == 0 {
        return page_size;
    }
    // The smallest power of two ≥ the real mean is the smallest one ≥ its
    // ceiling, since powers of two are integers.
    let avg_ceil = blocks.bytes.div_ceil(blocks.count).max(1);
    avg_ceil.checked_next_power_of_two().and_then(|p| p.checked_mul(2)).unwrap_or(1 << 63).max(page_size)
}

impl Metrics {
    /// The names of [`Metrics::features`], in the same order (the
    /// `metrics.parquet` column names).
    pub const FEATURE_NAMES: [&'static str; 6] = [
        "external_fragmentation",
        "kernel_unusable_index",
        "small_alloc_ratio",
        "size_cv",
        "large_gap_ratio",
        "utilization",
    ];

    /// The six features of SPEC §6, in its order: E, K, S, C, L, U.
    pub fn features(&self) -> [f64; 6] {
        [
            self.external_fragmentation,
            self.kernel_unusable_index,
            self.small_alloc_ratio,
            self.size_cv,
            self.large_gap_ratio,
            self.utilization,
        ]
    }

    /// The metrics of SPEC §4 from the block sums, the summed arena span and
    /// the gaps.
    pub fn compute<G: GapQuery + ?Sized>(blocks: &BlockStats, span: u64, gaps: &G, cfg: &MetricsConfig) -> Metrics {
        let g = gaps.sum();
        let count = gaps.count();
        let external = if span == 0 { 0.0 } else { g as f64 / span as f64 };

        let target = target_block(blocks, cfg.page_size);
        let free_pages = g.div_ceil(cfg.page_size);
        let suitable = gaps.sum_div_pow2(target.trailing_zeros());
        let theoretical = free_pages / (target / cfg.page_size).max(1);
        let unusable = if free_pages == 0 {
            0.0
        } else if theoretical == 0 {
            1.0
        } else {
            (1.0 - (suitable as f64 / theoretical as f64).min(1.0)).powf(0.25)
        };

        let small = if blocks.count == 0 { 0.0 } else { blocks.small as f64 / blocks.count as f64 };
        let cv = blocks.cv();
        // gap > 2·(G / count)  ⇔  gap > ⌊2G / count⌋ for integer gaps.
        let large = if g == 0 {
            0.0
        } else {
            let threshold = (2 * u128::from(g) / u128::from(count)) as u64;
            gaps.sum_above(threshold) as f64 / g as f64
        };
        let utilization = if span == 0 { 0.0 } else { blocks.bytes as f64 / span as f64 };
        let score = score(external, unusable, small, cv, large);
        Metrics {
            external_fragmentation: external,
            kernel_unusable_index: unusable,
            small_alloc_ratio: small,
            size_cv: cv,
            large_gap_ratio: large,
            utilization,
            score,
            live_bytes: blocks.bytes,
            live_blocks: blocks.count,
            gap_count: count,
            largest_gap: gaps.largest(),
            span_bytes: span,
        }
    }
}

/// The weighted score of SPEC §4, clamped to [0, 100]. Unlike the reference
/// C++ code, K is not divided by 10 first: its weight is the stated 15 %.
pub fn score(external: f64, unusable: f64, small: f64, cv: f64, large: f64) -> f64 {
    let s =
        50.0 * (2.0 * external).min(1.0) + 15.0 * unusable + 10.0 * (0.6 * small + 0.4 * cv.min(1.0)) + 25.0 * large;
    s.clamp(0.0, 100.0)
}

/// The four weighted components of the score, in score points (for plots
/// and reports): fragmentation, unusable index, allocation mix, large gaps.
pub fn score_components(m: &Metrics) -> [f64; 4] {
    [
        50.0 * (2.0 * m.external_fragmentation).min(1.0),
        15.0 * m.kernel_unusable_index,
        10.0 * (0.6 * m.small_alloc_ratio + 0.4 * m.size_cv.min(1.0)),
        25.0 * m.large_gap_ratio,
    ]
}

/// The multiset of gap sizes, maintained incrementally under insertion and
/// removal, answering every [`GapQuery`] without visiting all gaps:
/// `bit_counts[b]` = how many gaps have bit b set (so Σ ⌊g / 2^j⌋ =
/// Σ_{b ≥ j} bit_counts[b] · 2^(b−j), exactly, for any j), and per size
/// bucket (exponent and three mantissa bits) the sum and the distinct
/// sizes, so that `largest` and `sum_above` look inside one bucket only.
/// Counting set bits costs an update one step per set bit (gap sizes are
/// mostly round: a few) where sums of every shift cost one per bit of the
/// size (20 to 35). The sizes are counted in a hash map, not an ordered
/// one: nothing needs them in order, and the map is updated at every gap
/// that opens or closes.
#[derive(Clone, Debug)]
pub struct GapSet {
    count: u64,
    sum: u64,
    bit_counts: [u64; 64],
    bucket_sum: Box<[u64; BUCKETS]>,
    /// Each distinct size: how many gaps have it, and its index in its
    /// bucket's `distinct` list.
    sizes: ahash::AHashMap<u64, (u32, u32)>,
    distinct: Box<[Vec<u64>]>,
}

const BUCKETS: usize = 512;

fn bucket(g: u64) -> usize {
    if g < 8 {
        return g as usize;
    }
    let e = 63 - g.leading_zeros();
    (e as usize) * 8 + ((g >> (e - 3)) & 7) as usize
}

impl Default for GapSet {
    fn default() -> Self {
        GapSet {
            count: 0,
            sum: 0,
            bit_counts: [0; 64],
            bucket_sum: Box::new([0; BUCKETS]),
            sizes: ahash::AHashMap::new(),
            distinct: vec![Vec::new(); BUCKETS].into_boxed_slice(),
        }
    }
}

impl GapSet {
    pub fn insert(&mut self, g: u64) {
        self.count += 1;
        self.sum += g;
        let mut v = g;
        while v != 0 {
            self.bit_counts[v.trailing_zeros() as usize] += 1;
            v &= v - 1;
        }
        let b = bucket(g);
        self.bucket_sum[b] += g;
        let list = &mut self.distinct[b];
        self.sizes.entry(g).and_modify(|(n, _)| *n += 1).or_insert_with(|| {
            list.push(g);
            (1, (list.len() - 1) as u32)
        });
    }

    /// Removes one gap of size `g`, which must be present.
    pub fn remove(&mut self, g: u64) {
        let b = bucket(g);
        match self.sizes.get_mut(&g) {
            Some((n, _)) if *n > 1 => *n -= 1,
            Some(&mut (_, i)) => {
                self.sizes.remove(&g);
                let list = &mut self.distinct[b];
                list.swap_remove(i as usize);
                if let Some(&moved) = list.get(i as usize)
                    && let Some(m) = self.sizes.get_mut(&moved)
                {
                    m.1 = i;
                }
            }
            None => panic!("GapSet::remove of a gap of {g} bytes that is not present (replay bug)"),
        }
        self.count -= 1;
        self.sum -= g;
        let mut v = g;
        while v != 0 {
            self.bit_counts[v.trailing_zeros() as usize] -= 1;
            v &= v - 1;
        }
        self.bucket_sum[b] -= g;
    }

    /// Every gap, smallest first.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        let mut sizes: Vec<(u64, u32)> = self.sizes.iter().map(|(&g, &(n, _))| (g, n)).collect();
        sizes.sort_unstable();
        sizes.into_iter().flat_map(|(g, n)| std::iter::repeat_n(g, n as usize))
    }
}

impl GapQuery for GapSet {
    fn count(&self) -> u64 {
        self.count
    }
    fn sum(&self) -> u64 {
        self.sum
    }
    fn largest(&self) -> u64 {
        let top = self.distinct.iter().rev().find(|l| !l.is_empty());
        top.and_then(|l| l.iter().copied().max()).unwrap_or(0)
    }
    fn sum_div_pow2(&self, shift: u32) -> u64 {
        let from = (shift as usize).min(64);
        self.bit_counts[from..].iter().enumerate().map(|(k, &n)| n << k).sum()
    }
    fn sum_above(&self, threshold: u64) -> u64 {
        let Some(first) = threshold.checked_add(1) else {
            return 0;
        };
        let b0 = bucket(first);
        let mut total: u64 = self.bucket_sum[b0 + 1..].iter().sum();
        for &g in self.distinct[b0].iter().filter(|&&g| g >= first) {
            total += g * u64::from(self.sizes[&g].0);
        }
        total
    }
}

/// Gaps as a plain list: the brute-force side.
impl GapQuery for [u64] {
    fn count(&self) -> u64 {
        self.len() as u64
    }
    fn sum(&self) -> u64 {
        self.iter().sum()
    }
    fn largest(&self) -> u64 {
        self.iter().copied().max().unwrap_or(0)
    }
    fn sum_div_pow2(&self, shift: u32) -> u64 {
        self.iter().map(|g| g >> shift).sum()
    }
    fn sum_above(&self, threshold: u64) -> u64 {
        self.iter().filter(|&&g| g > threshold).sum()
    }
}

/// Recomputes every metric from the full live set, as the reference
/// implementation does at each step: `blocks` are (address, size) of the
/// live blocks sorted by address, `regions` the footprint regions
/// (start, end) sorted and disjoint. Each block lies inside one region.
pub fn from_scratch(blocks: &[(u64, u64)], regions: &[(u64, u64)], cfg: &MetricsConfig) -> Metrics {
    let mut stats = BlockStats::default();
    let mut gaps = Vec::new();
    let mut span = 0;
    let mut region = usize::MAX;
    let mut arena: Option<(u64, u64)> = None;
    for &(addr, size) in blocks {
        stats.add(size, cfg);
        let r = regions.partition_point(|&(start, _)| start <= addr).wrapping_sub(1);
        match arena {
            Some((lo, hi)) if r == region => {
                if cfg.is_gap(addr - hi) {
                    gaps.push(addr - hi);
                }
                arena = Some((lo, addr + size));
            }
            _ => {
                if let Some((lo, hi)) = arena {
                    span += hi - lo;
                }
                region = r;
                arena = Some((addr, addr + size));
            }
        }
    }
    if let Some((lo, hi)) = arena {
        span += hi - lo;
    }
    Metrics::compute(&stats, span, gaps.as_slice(), cfg)
}

/// The allocator view's metrics from scratch (the reference the
/// incremental replay is tested against): `blocks` sorted by address,
/// `segments` sorted and disjoint. Free ranges are the spaces between
/// consecutive blocks starting inside a segment, and its free head and
/// tail; also returns Σ(free range)² over all of them.
pub fn from_scratch_allocator(blocks: &[(u64, u64)], segments: &[(u64, u64)], cfg: &MetricsConfig) -> (Metrics, u128) {
    let mut stats = BlockStats::default();
    for &(_, size) in blocks {
        stats.add(size, cfg);
    }
    let mut gaps = Vec::new();
    let mut free_sq = 0u128;
    let mut span = 0;
    for &(s, e) in segments {
        span += e - s;
        let mut prev = s;
        let first = blocks.partition_point(|b| b.0 < s);
        let mut ranges = Vec::new();
        for &(a, size) in blocks[first..].iter().take_while(|b| b.0 < e) {
            ranges.push(a.saturating_sub(prev));
            prev = prev.max(a + size);
        }
        ranges.push(e.saturating_sub(prev));
        for g in ranges {
            free_sq += u128::from(g) * u128::from(g);
            if cfg.is_gap(g) {
                gaps.push(g);
            }
        }
    }
    (Metrics::compute(&stats, span, gaps.as_slice(), cfg), free_sq)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * 1024;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn empty_state_is_all_zero() {
        let m = from_scratch(&[], &[], &MetricsConfig::default());
        assert_eq!(m, Metrics::default());
    }

    #[test]
    fn one_block_has_no_fragmentation() {
        let cfg = MetricsConfig::default();
        let m = from_scratch(&[(0x1000, 8 * MIB)], &[(0x1000, 0x1000 + 8 * MIB)], &cfg);
        assert_eq!(m.span_bytes, 8 * MIB);
        assert_eq!(m.gap_count, 0);
        assert_eq!(m.external_fragmentation, 0.0);
        assert_eq!(m.kernel_unusable_index, 0.0);
        assert_eq!(m.small_alloc_ratio, 0.0);
        assert_eq!(m.size_cv, 0.0);
        assert_eq!(m.utilization, 1.0);
        assert_eq!(m.score, 0.0);
    }

    #[test]
    fn hand_computed_three_blocks_two_gaps() {
        // Blocks of 1 MiB, 1 MiB and 2 MiB with gaps of 1 MiB and 3 MiB.
        let cfg = MetricsConfig::default();
        let blocks = [(0, MIB), (2 * MIB, MIB), (6 * MIB, 2 * MIB)];
        let m = from_scratch(&blocks, &[(0, 8 * MIB)], &cfg);
        assert_eq!(m.span_bytes, 8 * MIB);
        assert_eq!(m.gap_count, 2);
        assert_eq!(m.largest_gap, 3 * MIB);
        // E = 4/8.
        assert!(close(m.external_fragmentation, 0.5));
        // avg = 4/3 MiB → 2^⌈log2⌉ = 2 MiB → T = 4 MiB; free pages = 1024;
        // suitable = ⌊1/4⌋ + ⌊3/4⌋ = 0; theoretical = 1024 / 1024 = 1 → K = 1.
        assert!(close(m.kernel_unusable_index, 1.0));
        assert!(close(m.small_alloc_ratio, 1.0));
        // sizes 1,1,2: mean 4/3, var = (1+1+4)/3 − 16/9 = 2/9.
        let cv = (2.0f64 / 9.0).sqrt() / (4.0 / 3.0);
        assert!(close(m.size_cv, cv));
        // mean gap 2 MiB: only 3 MiB > 4 MiB? no → L = 0.
        assert!(close(m.large_gap_ratio, 0.0));
        assert!(close(m.utilization, 0.5));
        let expected = 50.0 * 1.0 + 15.0 * 1.0 + 10.0 * (0.6 + 0.4 * cv) + 0.0;
        assert!(close(m.score, expected), "{} vs {expected}", m.score);
    }

    #[test]
    fn unusable_index_partial_and_large_gaps() {
        // Four 64 KiB blocks, gaps 8 KiB, 8 KiB, 512 KiB: T = 128 KiB.
        let cfg = MetricsConfig::default();
        let b = 64 * KIB;
        let blocks = [(0, b), (b + 8 * KIB, b), (2 * b + 16 * KIB, b), (3 * b + 528 * KIB, b)];
        let end = 4 * b + 528 * KIB;
        let m = from_scratch(&blocks, &[(0, end)], &cfg);
        let g = 528 * KIB;
        assert_eq!(m.gap_count, 3);
        // free pages 132, T/P = 32 → theoretical 4; suitable = 512/128 = 4 → K = 0.
        assert!(close(m.kernel_unusable_index, 0.0));
        // mean gap 176 KiB → threshold 352 KiB → 512 KiB is large.
        assert!(close(m.large_gap_ratio, 512.0 / 528.0));
        assert!(close(m.external_fragmentation, g as f64 / end as f64));
        assert!(close(m.size_cv, 0.0));
    }

    #[test]
    fn unusable_index_fractional() {
        // Two suitable chunks out of three possible: K = (1 − 2/3)^0.25.
        let cfg = MetricsConfig::default();
        let b = 64 * KIB; // T = 128 KiB
        let blocks = [(0, b), (b + 200 * KIB, b), (2 * b + 400 * KIB, b)];
        let m = from_scratch(&blocks, &[(0, 3 * b + 400 * KIB)], &cfg);
        // free pages = 100, T/P = 32 → theoretical 3; suitable = 1 + 1 = 2.
        let expected = (1.0f64 - 2.0 / 3.0).powf(0.25);
        assert!(close(m.kernel_unusable_index, expected));
    }

    #[test]
    fn gaps_at_or_below_threshold_are_slack() {
        let cfg = MetricsConfig::default();
        let blocks = [(0, 4096), (4096 + 1024, 4096), (2 * 4096 + 1024 + 1025, 4096)];
        let m = from_scratch(&blocks, &[(0, 1 << 20)], &cfg);
        assert_eq!(m.gap_count, 1);
        assert_eq!(m.largest_gap, 1025);
        // The slack still counts in the span.
        assert_eq!(m.span_bytes, 3 * 4096 + 1024 + 1025);
    }

    #[test]
    fn two_regions_do_not_count_the_hole_between_them() {
        let cfg = MetricsConfig::default();
        let regions = [(0, 4 * MIB), (1 << 40, (1 << 40) + 4 * MIB)];
        let blocks = [(0, MIB), (1 << 40, MIB), ((1 << 40) + 3 * MIB, MIB)];
        let m = from_scratch(&blocks, &regions, &cfg);
        assert_eq!(m.gap_count, 1);
        assert_eq!(m.largest_gap, 2 * MIB);
        assert_eq!(m.span_bytes, MIB + 4 * MIB);
        assert!(close(m.external_fragmentation, 2.0 / 5.0));
        assert!(close(m.utilization, 3.0 / 5.0));
    }

    #[test]
    fn free_space_without_suitable_size_gives_unusable_one() {
        // Huge mean block: T far above the free pages → theoretical 0, K = 1.
        let cfg = MetricsConfig::default();
        let blocks = [(0, 1 << 30), ((1 << 30) + 8 * KIB, 1 << 30)];
        let m = from_scratch(&blocks, &[(0, 1 << 32)], &cfg);
        assert_eq!(m.kernel_unusable_index, 1.0);
    }

    #[test]
    fn gap_set_answers_like_a_list() {
        let mut set = GapSet::default();
        let values = [5000u64, 5000, 7, 1 << 20, 3 << 20, 123_456, 1 << 20, 999_999, 8, 9];
        for &v in &values {
            set.insert(v);
        }
        set.remove(5000);
        set.remove(1 << 20);
        let list: Vec<u64> = set.iter().collect();
        assert_eq!(list.len(), values.len() - 2);
        for t in [0, 6, 7, 8, 4999, 5000, 123_455, 123_456, 1 << 20, u64::MAX] {
            assert_eq!(set.sum_above(t), list.as_slice().sum_above(t), "threshold {t}");
        }
        for s in 0..64 {
            assert_eq!(set.sum_div_pow2(s), list.as_slice().sum_div_pow2(s));
        }
        assert_eq!(set.largest(), 3 << 20);
        assert_eq!(GapQuery::sum(&set), list.as_slice().sum());
    }

    /// Many inserts and removals of sizes that share buckets (so removals
    /// move other sizes inside their bucket's list): every query still
    /// answers as the plain list does.
    #[test]
    fn gap_set_follows_a_list_through_churn() {
        use rand::RngExt;
        use rand::SeedableRng;
        let mut rng = rand_pcg::Pcg64::seed_from_u64(7);
        let mut set = GapSet::default();
        let mut list: Vec<u64> = Vec::new();
        for step in 0..20_000 {
            if list.is_empty() || rng.random_range(0..3) > 0 {
                // Sizes clustered in a few buckets, with repeats.
                let g = (1u64 << rng.random_range(3..30)) + rng.random_range(0..64) * 512;
                set.insert(g);
                list.push(g);
            } else {
                let g = list.swap_remove(rng.random_range(0..list.len()));
                set.remove(g);
            }
            if step % 97 == 0 {
                let l = list.as_slice();
                assert_eq!((set.count(), GapQuery::sum(&set), set.largest()), (l.count(), l.sum(), l.largest()));
                let t = rng.random_range(0..1u64 << 30);
                assert_eq!(set.sum_above(t), l.sum_above(t), "step {step}, threshold {t}");
                let j = rng.random_range(0..40);
                assert_eq!(set.sum_div_pow2(j), l.sum_div_pow2(j), "step {step}, shift {j}");
            }
        }
        let mut sorted = list.clone();
        sorted.sort_unstable();
        assert_eq!(set.iter().collect::<Vec<_>>(), sorted);
    }

    #[test]
    fn score_weights_and_clamp() {
        assert_eq!(score(0.0, 0.0, 0.0, 0.0, 0.0), 0.0);
        assert!(close(score(0.25, 0.0, 0.0, 0.0, 0.0), 25.0));
        assert!(close(score(1.0, 1.0, 1.0, 5.0, 1.0), 100.0));
        assert!(close(score(0.0, 1.0, 0.0, 0.0, 0.0), 15.0));
    }
}
