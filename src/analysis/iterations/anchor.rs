//! The anchor of the periodicity search: the token (a kernel launch
//! address, or a successful allocation of one exact size) that comes back
//! at near-constant spacing and at whose spacing live memory best repeats
//! itself.
//!
//! Only a token that may be regular has its positions kept. A first look
//! counts each token and sums its gaps and their squares, exactly, in
//! integers; a second look collects the positions of the tokens whose sums
//! pass the tests (with a margin that float rounding cannot cross), and
//! the tests are made again on those positions as they always were. On a
//! training trace of 100 M events, 74 M positions were kept
//! in 4 bytes each (0.32 GiB with the lists' spare room), beside the live
//! bytes series; most tokens repeat several times per iteration, at
//! uneven gaps, and are not kept now.

use ahash::AHashMap;

use super::{ANCHOR_MAX_CV, ANCHOR_MIN_COUNT, Level, MIN_AUTOCORRELATION, Rows};
use crate::trace::event::{EventKind, Events, Row};

/// Pearson correlation of `v[i]` with `v[i + lag]`, on at most about 50 000
/// evenly spaced pairs.
fn autocorrelation<V: Level>(v: &[V], lag: usize, grain: u64) -> f64 {
    if lag == 0 || lag >= v.len() {
        return f64::NAN;
    }
    let n = v.len() - lag;
    let stride = (n / 50_000).max(1);
    let (mut sx, mut sy, mut sxx, mut syy, mut sxy, mut m) = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for i in (0..n).step_by(stride) {
        let (x, y) = (v[i].bytes(grain) as f64, v[i + lag].bytes(grain) as f64);
        sx += x;
        sy += y;
        sxx += x * x;
        syy += y * y;
        sxy += x * y;
        m += 1.0;
    }
    let cov = sxy / m - (sx / m) * (sy / m);
    let (vx, vy) = (sxx / m - (sx / m).powi(2), syy / m - (sy / m).powi(2));
    if vx <= 0.0 || vy <= 0.0 { f64::NAN } else { cov / (vx * vy).sqrt() }
}

/// Positions (in the pid's event sequence) of the most regular anchor
/// token: a launch address or a successful allocation size.
pub(super) fn anchor<V: Level>(events: &Events, idx: Rows<'_>, live: &[V], grain: u64) -> Option<Vec<usize>> {
    if idx.len() <= u32::MAX as usize {
        anchor_in::<u32, V>(events, idx, live, grain)
    } else {
        anchor_in::<usize, V>(events, idx, live, grain)
    }
}

/// The token of row `i`, if it is one.
#[inline(always)]
fn token(events: &Events, i: usize) -> Option<(u8, u64)> {
    match events.kind[i] {
        Some(EventKind::Launch) => Some((0, events.addr.at(i))),
        Some(k) if k.creates_block() && events.ret[i] == 0 => Some((1 + k as u8, events.size.at(i))),
        _ => None,
    }
}

/// A token's count and its gaps' sum and sum of squares, in positions.
#[derive(Clone, Copy, Default)]
struct Gaps {
    count: u64,
    last: u64,
    sum: u128,
    squares: u128,
}

impl Gaps {
    fn add(&mut self, j: u64) {
        if self.count > 0 {
            let gap = u128::from(j - self.last);
            self.sum += gap;
            self.squares += gap * gap;
        }
        self.count += 1;
        self.last = j;
    }

    /// Whether the token can pass [`anchor_in`]'s tests: at least
    /// [`ANCHOR_MIN_COUNT`] times, a mean gap of 8 or more and a
    /// coefficient of variation of at most [`ANCHOR_MAX_CV`]; the mean and
    /// the square of the cv with a margin of a millionth, which the float
    /// tests' rounding cannot cross.
    /// With `n` gaps of sum `s` and sum of squares `q`: the mean is `s/n`,
    /// and cv ≤ c exactly when `n·q − s²` ≤ c²·s². A sum too large to test
    /// in 128 bits passes.
    fn may_be_regular(&self) -> bool {
        if self.count < ANCHOR_MIN_COUNT as u64 {
            return false;
        }
        let (n, s, q) = (u128::from(self.count - 1), self.sum, self.squares);
        // The mean: s ≥ 8·n·(1 − 10⁻⁶).
        if s * 1_000_000 < n * 7_999_992 {
            return false;
        }
        // c = 1/4: 16·(n·q − s²) ≤ s²·(1 + 10⁻⁶).
        const _: () = assert!(ANCHOR_MAX_CV == 0.25);
        let test = || -> Option<bool> {
            let spread = n.checked_mul(q)?.checked_sub(s.checked_mul(s)?)?;
            let s2 = s.checked_mul(s)?;
            Some(spread.checked_mul(16_000_000)? <= s2.checked_mul(1_000_001)?)
        };
        test().unwrap_or(true)
    }
}

/// [`anchor`], with positions stored as `P`.
fn anchor_in<P: Row, V: Level>(events: &Events, idx: Rows<'_>, live: &[V], grain: u64) -> Option<Vec<usize>> {
    // The first look: every token's gaps, summed.
    let mut gaps: AHashMap<(u8, u64), Gaps> = AHashMap::new();
    for (j, i) in idx.iter().enumerate() {
        if let Some(key) = token(events, i) {
            gaps.entry(key).or_default().add(j as u64);
        }
    }
    // The second: the positions of those that may be regular, each list
    // allocated at its length.
    let mut positions: AHashMap<(u8, u64), Vec<P>> = gaps
        .iter()
        .filter(|(_, g)| g.may_be_regular())
        .map(|(&k, g)| (k, Vec::with_capacity(g.count as usize)))
        .collect();
    drop(gaps);
    if positions.is_empty() {
        return None;
    }
    // Most tokens are not kept: a bit per hash of 4 096 answers for
    // nearly all of them without a lookup in the map.
    let bit = |(kind, v): (u8, u64)| (v ^ u64::from(kind)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 52;
    let mut kept = [0u64; 64];
    positions.keys().for_each(|&k| kept[(bit(k) >> 6) as usize] |= 1 << (bit(k) & 63));
    for (j, i) in idx.iter().enumerate() {
        if let Some(key) = token(events, i)
            && kept[(bit(key) >> 6) as usize] & 1 << (bit(key) & 63) != 0
            && let Some(pos) = positions.get_mut(&key)
        {
            pos.push(P::at(j));
        }
    }
    // Regular tokens: (count, cv, key).
    let mut regular: Vec<(usize, f64, (u8, u64))> = Vec::new();
    for (key, pos) in &positions {
        // Two or three gaps agree by chance too often to mean anything.
        if pos.len() < ANCHOR_MIN_COUNT {
            continue;
        }
        let gaps: Vec<f64> = pos.windows(2).map(|w| (w[1].index() - w[0].index()) as f64).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        if mean < 8.0 {
            continue; // several times per iteration, or noise
        }
        let sd = (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
        if sd / mean <= ANCHOR_MAX_CV {
            regular.push((pos.len(), sd / mean, *key));
        }
    }
    // Regular tokens also come by chance (a few gaps that agree), or twice
    // per iteration half a period apart: the anchor is the one whose
    // spacing live memory itself repeats at best (autocorrelation at the
    // anchor's median gap), then the one that comes most often.
    let best = regular
        .iter()
        .map(|r| {
            let pos = &positions[&r.2];
            let mut gaps: Vec<usize> = pos.windows(2).map(|w| w[1].index() - w[0].index()).collect();
            gaps.sort_unstable();
            (autocorrelation(live, gaps[gaps.len() / 2], grain), r)
        })
        .filter(|(c, _)| *c >= MIN_AUTOCORRELATION)
        .max_by(|x, y| x.0.total_cmp(&y.0).then(x.1.0.cmp(&y.1.0)).then(y.1.2.cmp(&x.1.2)))
        .map(|(_, r)| (r.1, r.0, r.2));
    best.map(|(_, _, key)| positions.remove(&key).unwrap_or_default().into_iter().map(P::index).collect())
}

#[cfg(test)]
mod tests {
    use super::Gaps;

    fn gaps(positions: &[u64]) -> Gaps {
        let mut g = Gaps::default();
        positions.iter().for_each(|&j| g.add(j));
        g
    }

    /// The float tests of `anchor_in`, as it makes them.
    fn regular(positions: &[u64]) -> bool {
        let gaps: Vec<f64> = positions.windows(2).map(|w| (w[1] - w[0]) as f64).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let sd = (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
        positions.len() >= super::ANCHOR_MIN_COUNT && mean >= 8.0 && sd / mean <= super::ANCHOR_MAX_CV
    }

    #[test]
    fn the_first_look_keeps_every_token_the_tests_pass() {
        // Gaps at the edges: a mean of exactly 8, a cv of exactly 1/4
        // (gaps 6 and 10: mean 8, sd 2), and just past each.
        let cases: [&[u64]; 6] = [
            &[0, 8, 16, 24, 32],
            &[0, 6, 16, 22, 32],
            &[0, 7, 14, 21, 28],
            &[0, 5, 16, 21, 32],
            &[0, 10, 20, 30],
            &[0, 100, 200, 300, 400, 500, 600],
        ];
        for case in cases {
            let (may, is) = (gaps(case).may_be_regular(), regular(case));
            assert!(may || !is, "{case:?}: regular, but the first look dropped it");
        }
        assert!(gaps(cases[0]).may_be_regular() && gaps(cases[1]).may_be_regular());
        assert!(!gaps(cases[2]).may_be_regular(), "a mean gap of 7 is kept");
        assert!(!gaps(cases[3]).may_be_regular(), "gaps 5 and 11 (cv 0.375) are kept");
        assert!(!gaps(cases[4]).may_be_regular(), "four times is kept");
    }

    #[test]
    fn the_first_look_agrees_with_the_tests_on_random_gaps() {
        // A small generator, so that the test needs no crate: gaps of
        // 1..=40 around a base, in lists of 5 to 40.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % m
        };
        let (mut kept, mut dropped) = (0, 0);
        for _ in 0..20_000 {
            let (base, spread, len) = (4 + next(30), 1 + next(12), 5 + next(36) as usize);
            let mut pos = vec![next(100)];
            for _ in 1..len {
                let last = *pos.last().unwrap();
                pos.push(last + base + next(spread));
            }
            let (may, is) = (gaps(&pos).may_be_regular(), regular(&pos));
            assert!(may || !is, "{pos:?}: regular, but the first look dropped it");
            if is {
                kept += 1;
            } else if !may {
                dropped += 1;
            }
        }
        assert!(kept > 1000 && dropped > 1000, "both sides tested: {kept} regular, {dropped} dropped");
    }
}
