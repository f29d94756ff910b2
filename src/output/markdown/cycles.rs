//! The report's Leaks and Iterations sections: each unit's leak verdict
//! with its floors and call sites, and the iterations found.

use std::fmt::Write as _;

use super::sections::no_history;
use super::words::plural;
use crate::analysis::Analysis;
use crate::units::bytes;

pub(crate) fn leaks_md(a: &Analysis) -> String {
    use crate::analysis::leak::{Method, Verdict};
    let mut md = String::from("\n## Leaks\n\n");
    let _ = writeln!(
        md,
        "| {} | verdict | from | floors compared | growth per iteration | growth rate | alive at end{} |\n|---|---|---|---|---|---|---|",
        a.unit(),
        if a.allocator_view { " (requested)" } else { "" }
    );
    for l in &a.leaks {
        let verdict = match l.verdict {
            Verdict::Leaking => "**leaking**",
            v => v.name(),
        };
        // By iterations, floors are compared from three after the warm-up.
        let compared = l.method != Method::Iterations || l.floors.len() > 3;
        let floors = if l.floors.is_empty() || !compared {
            "—".to_string()
        } else {
            format!("{} → {}", bytes(l.floor_early_bytes), bytes(l.floor_late_bytes))
        };
        let per = match l.growth_per_iteration_bytes {
            Some(g) if g >= 0 => bytes(g as u64),
            Some(g) => format!("−{}", bytes(g.unsigned_abs())),
            None => "—".into(),
        };
        let rate = l.rate().map_or("—".into(), |r| format!("{}/s", bytes(r as u64)));
        let from = match l.method {
            _ if !a.has_history() => "—",
            Method::Iterations => "iteration floors",
            Method::Windows => "quarters of its events (no iterations)",
        };
        let _ = writeln!(
            md,
            "| {} | {verdict} | {from} | {floors} | {per} | {rate} | {} in {}{} |",
            a.who(l.pid),
            // In the floors' unit: requested bytes under an allocator.
            bytes(l.live_at_end_requested_bytes.unwrap_or(l.live_at_end_bytes)),
            plural(l.live_at_end_blocks, "block", "blocks"),
            l.held_at_exit.map_or(String::new(), |(b, n)| format!(
                " (it exited holding {} in {}, which its exit released)",
                bytes(b),
                plural(n, "block", "blocks")
            ))
        );
    }
    md.push('\n');
    for l in &a.leaks {
        let _ = writeln!(md, "- {} {}: {}.", a.unit(), a.who(l.pid), l.reason);
    }
    for l in a.leaks.iter().filter(|l| l.method == Method::Iterations && l.floors.len() > 1) {
        let _ = writeln!(
            md,
            "\nFloors of {} {} — the least live bytes{} over the events of each complete iteration (exact, from the event stream):\n\n| iteration | starts at | floor | change |\n|---|---|---|---|",
            a.unit(),
            a.who(l.pid),
            if a.allocator_view { " (the bytes the program requested, whatever the allocator's rounding)" } else { "" }
        );
        let shown = 24;
        // An iteration that began with the trace (a snapshot recorded from
        // the program's start) holds the set-up too.
        use crate::analysis::iterations::IterationSource;
        let with_setup = a.iterations.iter().any(|it| {
            it.pid == l.pid
                && matches!(it.source, IterationSource::Annotations | IterationSource::CallSites)
                && it.boundaries_t_ns.first() == Some(&a.first_ts)
        });
        for (i, f) in l.floors.iter().enumerate().take(shown) {
            let change = match i {
                0 if with_setup => "warm-up (the set-up and the first step)".to_string(),
                0 => "warm-up".to_string(),
                _ => {
                    let d = f.bytes as i64 - l.floors[i - 1].bytes as i64;
                    if d >= 0 { format!("+{}", bytes(d as u64)) } else { format!("−{}", bytes(d.unsigned_abs())) }
                }
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {change} |",
                i + 1,
                a.time_text(f.start_t_ns.saturating_sub(a.first_ts) as f64 / 1e9),
                bytes(f.bytes)
            );
        }
        if l.floors.len() > shown {
            let _ = writeln!(md, "\n… and {} more (all in report.json, `leaks[].floors`).", l.floors.len() - shown);
        }
    }
    if let Some(l) = a.leaks.iter().find(|l| l.leaking) {
        let _ = writeln!(
            md,
            "\nBlocks alive at the end in {} {}, by size:\n\n| size | blocks | bytes |\n|---|---|---|",
            if a.allocator_view { "device" } else { "process" },
            a.who(l.pid)
        );
        for g in &l.by_size {
            let _ = writeln!(md, "| {} | {} | {} |", bytes(g.size), g.count, bytes(g.bytes));
        }
    }
    // Where the floor rose: a leak's growth, or (without iterations) a
    // steady rise that cannot be told from one.
    for l in a.leaks.iter().filter(|l| !l.top_sites.is_empty()) {
        let (what, floors) = match l.method {
            Method::Iterations => ("growth", "at the last iteration's floor than at the first after the warm-up"),
            Method::Windows => {
                ("rise", "at the last quarter's floor than at the second quarter's (of the run's events)")
            }
        };
        let _ = writeln!(
            md,
            "\nThe {what} of {} {} by call site{}: what each site held more {floors}, in the bytes the program asked for:\n\n| call site | bytes | blocks more |\n|---|---|---|",
            a.unit(),
            a.who(l.pid),
            if l.top_sites.len() >= 10 { " (the ten largest)" } else { "" }
        );
        for t in &l.top_sites {
            let more = if t.blocks == 0 { "0 (as many blocks, each larger)".to_string() } else { t.blocks.to_string() };
            let _ = writeln!(md, "| `{}` | {} | {more} |", t.site, bytes(t.bytes));
        }
    }
    for l in a.leaks.iter().filter(|l| !l.allocated_once.is_empty()) {
        // Without iterations to compare, a leak of one step is allocated
        // once too: the table cannot clear these blocks.
        let what = if l.verdict == Verdict::CannotTell {
            "usually state such as weights, gradients, optimizer moments or caches; with no iteration after the warm-up to compare, a leak of one step would look the same"
        } else {
            "state such as weights, gradients, optimizer moments or caches, not leaks"
        };
        let _ = writeln!(
            md,
            "\nAllocated once — before the trace began or in the warm-up (or only) iteration of {} {} — and alive at the end: {what}{}:\n\n| call site | bytes | blocks |\n|---|---|---|",
            a.unit(),
            a.who(l.pid),
            if a.allocator_view { " (in the bytes the program asked for)" } else { "" }
        );
        for t in &l.allocated_once {
            let grew = if l.top_sites.iter().any(|g| g.site == t.site) { " (this site grew too, above)" } else { "" };
            let _ = writeln!(md, "| `{}`{grew} | {} | {} |", t.site, bytes(t.bytes), t.blocks);
        }
    }
    md
}

pub(crate) fn iterations_md(a: &Analysis) -> String {
    let mut md = String::from("\n## Iterations\n\n");
    let unplaced = a.trace.meta.as_ref().map_or(0, |m| m.details.unplaced_annotations());
    if a.iterations.is_empty() {
        let annotations = a.trace.meta.as_ref().map_or(&[][..], |m| m.details.annotations());
        let names: std::collections::BTreeSet<&str> =
            annotations.iter().map(|x| x.name.split('#').next().unwrap_or(&x.name)).collect();
        let marks = if unplaced > 0 {
            format!(
                "{} with wall-clock times, which cannot be placed among trace entries that have none (time is entry \
                 order),",
                plural(unplaced as u64, "profiler annotation", "profiler annotations")
            )
        } else if annotations.is_empty() {
            "no profiler annotations".to_string()
        } else {
            let shown: Vec<String> = names.iter().take(4).map(|n| format!("`{n}`")).collect();
            // A range is a START and an END: count the ranges.
            let starts = annotations.iter().filter(|x| x.stage == "START").count();
            let n = if starts > 0 { starts } else { annotations.len() };
            let steps = annotations.iter().any(crate::analysis::iterations::marks_step);
            format!(
                "{n} profiler annotation{} ({}{}), {}",
                if n == 1 { "" } else { "s" },
                shown.join(", "),
                if names.len() > 4 { ", …" } else { "" },
                if steps {
                    // Their steps all began before the trace's first entry
                    // (`iterations::detect` leaves those out).
                    "whose steps all began before the trace's first entry (the memory history began later, or kept \
                     only its last entries),"
                } else {
                    "none of them a `ProfilerStep#` range or an `Optimizer.step#` end,"
                }
            )
        };
        if let Some(why) = no_history(a) {
            let _ = writeln!(md, "None: {why}.");
            return md;
        }
        // A recording's allocator view finds its steps from the kernel
        // launches, and has no Python frames.
        let recorded = a.trace.source() == Some(crate::trace::Source::Ebpf);
        if a.allocator_view && recorded {
            let launches = a.counts_by_kind.get(crate::trace::event::EventKind::Launch);
            let why = if launches == 0 {
                "the recording has no kernel launches (`record --no-launch`, or a runtime whose launches were not \
                 probed), and a recording's steps are found from its launch sequence"
                    .to_string()
            } else {
                format!(
                    "its {launches} kernel launches do not repeat as steps do (a kernel that comes back at near-constant \
                     spacing, its launches between repeating)"
                )
            };
            let _ = writeln!(
                md,
                "None found: {why}; the tensors' allocation sequence is not used (layers repeat as regularly as \
                 iterations). Leak verdicts fall back to comparing quarters of the trace's events, and say so."
            );
            return md;
        }
        if a.allocator_view {
            let _ = writeln!(
                md,
                "None found: {marks} and no optimizer step in the call stacks (a snapshot's layers repeat as regularly as \
                 iterations, so its allocation sequence is not used). Leak verdicts fall back to comparing quarters of the \
                 trace's events, and say so."
            );
            return md;
        }
        let _ = writeln!(
            md,
            "None found: {marks} and no period in the allocation sequence (a period needs five repetitions that give \
             their memory back). Leak verdicts fall back to comparing quarters of the trace's events, and say so."
        );
        return md;
    }
    let _ = writeln!(
        md,
        "| {} | iterations | complete | period | warm-up ends | found from |\n|---|---|---|---|---|---|",
        a.unit()
    );
    for it in &a.iterations {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} |",
            a.who(it.pid),
            it.count,
            it.complete,
            it.period_s.map_or("—".into(), |p| a.time_text(p)),
            it.warmup_end_t_ns.map_or("—".into(), |t| a.time_text(t.saturating_sub(a.first_ts) as f64 / 1e9)),
            it.source.name()
        );
    }
    if unplaced > 0 {
        let _ = writeln!(
            md,
            "\nThe snapshot's {} with wall-clock times cannot be placed among trace entries that have none (time is \
             entry order): the iterations above are not from them.",
            plural(unplaced as u64, "profiler annotation", "profiler annotations")
        );
    }
    for it in a.iterations.iter().filter(|it| it.before_trace > 0) {
        let _ = writeln!(
            md,
            "\n{}: the annotations also name {} that began before the trace's first entry (the memory history began \
             later, or kept only its last entries while the annotations, far fewer, reach further back). The trace \
             does not hold them whole, so they are not counted.",
            a.device_name(it.pid),
            plural(it.before_trace as u64, "step", "steps"),
        );
    }
    if a.iterations.iter().all(|it| it.complete < 4) {
        let most = a.iterations.iter().map(|it| it.complete).max().unwrap_or(0);
        let count = match (most, a.iterations.len()) {
            (0, _) => "none".to_string(),
            (n, 1) => n.to_string(),
            (n, _) => format!("at most {n}"),
        };
        let _ = writeln!(
            md,
            "\nFewer than four complete iterations ({count}): the first is taken as warm-up, and fewer than three \
             after it cannot show a leak or a trend across iterations."
        );
    }
    md
}
