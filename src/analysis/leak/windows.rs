//! The leak verdict without iterations: the floors of windows of a
//! series' events, how often its live memory swung, and whether its
//! frames are the program's.

use super::*;

/// Without iterations: the floors of windows of the series' activity (its
/// events, not its time: a run that sets up for seconds and then works for
/// a fraction of one has its windows where the work is), up to the final
/// descent. What is freed then is the end's release (a function returning,
/// generation ending, the process exiting), which says nothing about the
/// growth before it. A floor that did not rise is no leak. One that rose
/// is not called a leak either: without iterations a leak across steps,
/// one pass that holds memory (a forward pass keeping activations) and a
/// working set that grows by design (a KV cache) look the same.
pub(super) fn by_windows(r: &mut LeakReport, input: &Input<'_>) -> (Verdict, String) {
    let ev = input.events;
    let b = crate::units::bytes;
    let noise = threshold(input.peak);
    // Its events that move live memory (not a snapshot's segment events,
    // which differ between allocator settings for the same requests).
    let series = || (0..ev.len()).filter(|&i| ev.pid[i] == input.pid && moves_live(ev, i, input.allocator_view));
    // Its live bytes after each of them.
    let mut live = LiveBytes::new(input.allocator_view);
    let level: Vec<u64> = series()
        .map(|i| {
            live.apply(ev, i);
            live.now
        })
        .collect();
    let at_end = live.now;
    // The final descent, read back from the end: live memory rises to the
    // descent's top and stays within the noise of it; where it stood more
    // than the noise lower, the run was still climbing. The events up to
    // the top (`n` of them) are the run; after it, the end's release.
    let mut top: Option<(usize, u64)> = None;
    for (k, &l) in level.iter().enumerate().rev() {
        let best = top.map_or(at_end, |t| t.1);
        if l > best {
            top = Some((k, l));
        } else if l.saturating_add(noise) < best {
            break;
        }
    }
    let n = top.map_or(level.len(), |t| t.0 + 1);
    if n < 8 {
        return (Verdict::CannotTell, format!("{n} events: too few to compare the floor of live memory over time"));
    }
    // Six windows after the first quarter, then the second quarter and
    // the last one, by position among the run's events.
    let q = n / 4;
    let mut spans: Vec<(usize, usize)> = (0..6).map(|k| (q + k * (n - q) / 6, q + (k + 1) * (n - q) / 6)).collect();
    spans.retain(|s| s.1 > s.0);
    let six = spans.len();
    spans.extend([(q, 2 * q), (3 * q, n)]);
    let mut all = floors_at(ev, series(), &level, &spans);
    let late = all.pop().expect("the last quarter");
    let early = all.pop().expect("the second quarter");
    if late.end_t_ns.saturating_sub(all.first().map_or(late.start_t_ns, |f| f.start_t_ns)) < 8 {
        return (Verdict::CannotTell, format!("{n} events: too few to compare the floor of live memory over time"));
    }
    r.floors = all;
    r.floor_early_bytes = early.bytes;
    r.floor_late_bytes = late.bytes;
    let growth = late.bytes as i64 - early.bytes as i64;
    r.growth_bytes = growth;
    let seconds = late.at_t_ns.saturating_sub(early.at_t_ns) as f64 / 1e9;
    r.rate_bytes_per_s = if seconds > 0.0 && growth > 0 { growth as f64 / seconds } else { 0.0 };
    // What was freed after the run's last rise, said where it took live
    // memory below the run's last floor (a temporary's free is not).
    let back = match top {
        Some((_, t)) if late.bytes.saturating_sub(at_end) > noise => {
            r.released_after = Some((late.end_t_ns, t - at_end));
            let how = match input.exited {
                Some((held, _)) if held >= t - at_end => "released by its exit".to_string(),
                Some((held, _)) if held > 0 => {
                    format!("freed by the end of the trace ({} of it by its exit)", b(held))
                }
                _ => "freed by the end of the trace".to_string(),
            };
            format!(
                "; after the run's last rise, {} was {how} ({} → {}), which says nothing either way",
                b(t - at_end),
                b(t),
                b(at_end)
            )
        }
        // The trace ends at (within the noise of) the run's top, well
        // above its last floor: a pass may have been cut off.
        _ if at_end > late.bytes.saturating_add(noise)
            && top.is_none_or(|(_, t)| t.saturating_sub(at_end) <= noise) =>
        {
            format!(
                "; the trace ends near its highest, {} above its last quarter's floor ({} at its end)",
                b(at_end - late.bytes),
                b(at_end)
            )
        }
        _ => String::new(),
    };
    // A floor that held says nothing of steps unless the run repeated
    // itself: one pass (a forward pass, a forward and a backward) rises
    // and falls once, and its second quarter is taken mid-pass.
    let swings = swings(&level[..n], &level[q..n], noise);
    if (growth <= 0 || growth as u64 <= noise) && swings < MIN_SWINGS {
        return (
            Verdict::CannotTell,
            format!(
                "no iterations found, and live memory rose by half its range (its lowest to its highest) only {} in \
                 the run's events{}: {}, so a leak across steps cannot show (its floor was {} in the second quarter \
                 of those events and {} in the last){back}",
                rises(swings),
                if swings >= 2 { " (falling back between)" } else { "" },
                if swings <= 1 { "as in one pass, not repeated steps" } else { "too few repetitions" },
                b(early.bytes),
                b(late.bytes)
            ),
        );
    }
    // A floor that held over repeated rises is no verdict either: without
    // iterations, what repeats may be layers or requests as well as steps
    // (a transformer's layers repeat as regularly as its steps; a pass of
    // inference frees each layer's memory before the next), and a leak
    // once per step would not show. `not leaking` needs iterations.
    if growth <= 0 || growth as u64 <= noise {
        let what = if input.allocator_view {
            let framed = input.stacks.is_some_and(|st| python_frames(ev, series(), st));
            format!(
                "no optimizer step or profiler step marks iterations here{}",
                if framed { "" } else { ", and the trace holds no Python frames to find one in" }
            )
        } else {
            "no iterations found (no regular period in its allocations, no repeating sequence of kernel launches)"
                .to_string()
        };
        return (
            Verdict::CannotTell,
            format!(
                "{what}; the floor of live memory {} over {swings} rises (layers, requests or steps: the trace does not \
                 say which): a leak once per step may not show{back}",
                if growth > 0 {
                    format!(
                        "rose by only {} from the second quarter of its events to the last, within the noise ({}: 2 % \
                         of the peak, at least 16 MiB),",
                        b(growth as u64),
                        b(noise)
                    )
                } else {
                    "did not rise from the second quarter of its events to the last,".to_string()
                }
            ),
        );
    }
    let steady = six >= 2 && r.floors.windows(2).all(|p| p[1].bytes > p[0].bytes);
    // A floor that rose unsteadily over a run that hardly repeated: the
    // quarters fall where they fall (a dip of one round against the next
    // round's level), so the two floors are not compared.
    if !steady && swings < MIN_SWINGS {
        return (
            Verdict::CannotTell,
            format!(
                "no iterations found, and live memory rose by half its range (its lowest to its highest) only {} in \
                 the run's events ({}at least {MIN_SWINGS} are needed): too few repetitions for the floors of its \
                 quarters ({} → {}) to say anything{back}",
                rises(swings),
                if swings >= 2 { "falling back between; " } else { "" },
                b(early.bytes),
                b(late.bytes)
            ),
        );
    }
    // The second quarter's floor is a dip (a model swapped out for a
    // moment), not a level the run rose from: the first window stood
    // higher by more than the noise, every window after the lowest came
    // back to within the noise of it, and so did the last quarter.
    let lowest = r.floors.iter().enumerate().min_by_key(|(_, f)| f.bytes).map_or(0, |(k, _)| k);
    let dip = r.floors.first().map(|f| f.bytes).filter(|&first| {
        !steady
            && first > early.bytes.saturating_add(noise)
            && late.bytes.abs_diff(first) <= noise
            && r.floors[lowest + 1..].iter().all(|f| f.bytes.abs_diff(first) <= noise)
    });
    if let Some(first) = dip {
        // The floors compared are then the first window's and the last
        // quarter's.
        r.floor_early_bytes = first;
        r.growth_bytes = late.bytes as i64 - first as i64;
        r.rate_bytes_per_s = 0.0;
        let held = if late.bytes > first {
            format!("rose by only {} from its first window, within the noise ({})", b(late.bytes - first), b(noise))
        } else {
            "did not rise from its first window".to_string()
        };
        return (
            Verdict::CannotTell,
            format!(
                "no iterations found; the floor of live memory dipped to {} in the second quarter of the run's events \
                 and otherwise {held} ({} in its first window, {} in its last quarter){back}",
                b(early.bytes),
                b(first),
                b(late.bytes)
            ),
        );
    }
    if steady && let Some(st) = input.stacks {
        r.top_sites = growth_sites(input, st, early.after_rows, late.after_rows);
    }
    (
        Verdict::CannotTell,
        format!(
            "no iterations found; the floor of live memory (the least live over a span of events) rose by {} from \
             the second quarter of the run to the last, {}{back}. Without iterations a leak across steps, a set-up \
             (a model moved to the GPU), one pass that holds memory (a forward pass keeping activations) and a \
             working set that grows by design (a KV cache) look the same",
            b(growth as u64),
            {
                let word = ["two", "three", "four", "five", "six"].get(six.wrapping_sub(2)).copied().unwrap_or("the");
                format!(
                    "{} {word} equal spans after its first quarter (the run: its events up to its last rise)",
                    if steady { "higher in each of" } else { "but not steadily: not higher in each of" }
                )
            },
        ),
    )
}

/// "once", "twice", "N times" (0: "0 times").
pub(super) fn rises(n: usize) -> String {
    match n {
        1 => "once".into(),
        2 => "twice".into(),
        n => format!("{n} times"),
    }
}

/// Whether the stacks of events `rows` hold the program's Python frames
/// (a snapshot's, not a recording's native ones): frames in which an
/// optimizer step would have shown.
pub(super) fn python_frames(events: &Events, rows: impl Iterator<Item = usize>, stacks: &crate::trace::Stacks) -> bool {
    let mut seen: ahash::AHashSet<u32> = ahash::AHashSet::new();
    for i in rows {
        let Some(&id) = events.stack.get(i) else { return false };
        if id != crate::trace::event::NO_STACK
            && seen.insert(id)
            && stacks.frames_of(id).any(crate::trace::Frame::is_python)
        {
            return true;
        }
    }
    false
}

/// The fewest rises and falls of live memory after which a floor that
/// held reads as no leak (as three complete iterations after the warm-up
/// do).
const MIN_SWINGS: usize = 3;

/// How often `level` rose by at least half the range of `span` (the run
/// after its first quarter, so that a set-up's climb does not set the
/// scale) and `noise` above where it last stood lowest, each time after
/// falling back as far below where it then stood highest: the run's
/// repetitions (a run cut at its last top ends on a rise), with a
/// hysteresis so that a layer's temporaries inside one pass do not count.
pub(super) fn swings(level: &[u64], span: &[u64], noise: u64) -> usize {
    let (Some(&lo), Some(&hi)) = (span.iter().min(), span.iter().max()) else { return 0 };
    let Some(&first) = level.first() else { return 0 };
    let step = ((hi - lo) / 2).max(noise).max(1);
    let (mut count, mut rising, mut low, mut high) = (0, true, first, first);
    for &l in level {
        if rising {
            low = low.min(l);
            if l >= low.saturating_add(step) {
                (rising, high, count) = (false, l, count + 1);
            }
        } else {
            high = high.max(l);
            if l.saturating_add(step) <= high {
                (rising, low) = (true, l);
            }
        }
    }
    count
}

/// Whether event `i` is one [`LiveBytes`] counts: a block allocated or
/// freed (successfully), or a process's exit.
pub(super) fn moves_live(events: &Events, i: usize, allocator_view: bool) -> bool {
    events.kind[i].is_some_and(|k| {
        k == EventKind::Exit
            || (events.ret[i] == 0
                && (k.creates_block() || k.releases_block())
                && crate::analysis::replay::tracks(k, allocator_view))
    })
}

/// The exact floor over each of `spans`, given as positions among a
/// series' events that move live memory (`series`, [`moves_live`];
/// `[start, end)`, non-empty, possibly overlapping), read off `level`
/// (its live bytes after each of them): by position, so that events
/// sharing a timestamp with a span's end stay out of it.
pub(super) fn floors_at(
    events: &Events,
    series: impl Iterator<Item = usize>,
    level: &[u64],
    spans: &[(usize, usize)],
) -> Vec<Floor> {
    // Per span: the least live bytes and where, first the state entering
    // its start, then after each of its events (the first least kept).
    let least: Vec<(u64, usize, bool, u64)> = spans
        .iter()
        .map(|&(s, e)| {
            let entering = if s == 0 { 0 } else { level[s - 1] };
            let mut best = (entering, s, true, entering);
            for (k, &l) in level.iter().enumerate().take(e).skip(s) {
                if l < best.0 {
                    (best.0, best.1, best.2) = (l, k, false);
                }
                best.3 = best.3.max(l);
            }
            best
        })
        .collect();
    // The events at the positions the floors name.
    let last = spans.iter().map(|s| s.1).max().unwrap_or(0);
    let mut wanted: Vec<usize> =
        spans.iter().flat_map(|s| [s.0, s.1, s.1.saturating_sub(1)]).chain(least.iter().map(|f| f.1)).collect();
    wanted.push(last.saturating_sub(1));
    wanted.sort_unstable();
    wanted.dedup();
    let mut row: AHashMap<usize, usize> = AHashMap::new();
    let mut next = wanted.iter().peekable();
    for (k, i) in series.enumerate() {
        while next.peek().is_some_and(|&&w| w == k) {
            row.insert(k, i);
            next.next();
        }
        if next.peek().is_none() {
            break;
        }
    }
    let ts = |k: usize| row.get(&k).map(|&i| events.ts_ns.at(i));
    // A span that ends with the series ends after its last event.
    let after_last = ts(last.saturating_sub(1)).unwrap_or(0) + 1;
    spans
        .iter()
        .zip(least)
        .map(|(&(s, e), (bytes, k, entering, peak))| {
            let i = row[&k];
            Floor {
                start_t_ns: ts(s).unwrap_or(0),
                end_t_ns: ts(e).filter(|&t| t != 0).unwrap_or(after_last),
                bytes,
                at_t_ns: events.ts_ns.at(i),
                after_rows: if entering { i } else { i + 1 },
                peak_bytes: peak,
            }
        })
        .collect()
}
