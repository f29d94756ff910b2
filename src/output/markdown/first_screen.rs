//! The first lines of `report.md` and of `analyze`'s stdout: the verdict,
//! the memory the job needs against its budget, and the fix
//! ([`crate::analysis::decision`]).

use crate::analysis::decision::{Budget, Decision, Fix, Memory, Verdict};
use crate::units::{bytes, plural};

/// The verdict in a few words: "failed: 15 OOMs (fragmentation)".
pub fn verdict_line(d: &Decision) -> String {
    match &d.verdict {
        Verdict::Failed { ooms, classes } => {
            let classes: Vec<String> = match classes.as_slice() {
                [(c, _)] => vec![c.clone()],
                many => many.iter().map(|(c, n)| format!("{n} {c}")).collect(),
            };
            format!("failed: {} ({})", plural(*ooms, "OOM", "OOMs"), classes.join(", "))
        }
        Verdict::Leaking { per_step_bytes, passes_budget_at_step } => {
            let mut t = match per_step_bytes {
                Some(g) => format!("leaking {} per step", bytes(*g)),
                None => "leaking".to_string(),
            };
            if let Some(s) = passes_budget_at_step {
                t.push_str(&format!(": passes the budget at step ~{s}"));
            }
            t
        }
        Verdict::FitsFlushing { releases, at_least, oversize, gc } => {
            let mut how: Vec<String> = Vec::new();
            if *releases > 0 {
                how.push(format!(
                    "releasing its cache {}{}",
                    if *at_least { "at least " } else { "" },
                    plural(*releases, "time", "times")
                ));
            }
            if *oversize > 0 {
                how.push(format!(
                    "releasing its cached blocks above `max_split_size_mb` {}",
                    plural(*oversize, "time", "times")
                ));
            }
            if *gc > 0 {
                how.push(format!("with garbage collection releasing cached blocks {}", plural(*gc, "time", "times")));
            }
            format!("fits, {}", how.join(", "))
        }
        Verdict::Healthy { needs_bytes, at_most } => {
            let needs = format!("healthy: needs {}{}", if *at_most { "at most " } else { "" }, bytes(*needs_bytes));
            match d.memory.as_slice() {
                [Memory { budget: Some(b), .. }] => format!("{needs} of {}", budget_text(b)),
                _ => format!("{needs} (the budget is not known)"),
            }
        }
        Verdict::Unknown { why } => format!("unknown: {why}"),
    }
}

fn budget_text(b: &Budget) -> String {
    if b.lo_bytes == b.hi_bytes { bytes(b.lo_bytes) } else { format!("{}–{}", bytes(b.lo_bytes), bytes(b.hi_bytes)) }
}

/// One unit's memory line.
fn memory_line(m: &Memory, several: bool, who: &dyn Fn(u32) -> String) -> String {
    let mut parts: Vec<String> = Vec::new();
    if m.carried_in {
        parts.push(
            "at most what follows (the cache was largely built before the trace began, by requests it does not hold)"
                .to_string(),
        );
    }
    if let Some(n) = &m.recorded {
        match n.fits_from_bytes {
            Some(f) if f < n.no_flush_from_bytes => parts.push(format!(
                "needs {} to fit under its settings ({} there), {} to never release its cache",
                bytes(f),
                plural(n.flushes_at_fits_from, "cache release", "cache releases"),
                bytes(n.no_flush_from_bytes)
            )),
            Some(_) => parts.push(format!("needs {} under its settings", bytes(n.no_flush_from_bytes))),
            None => parts.push(format!("needs {} to never release its cache", bytes(n.no_flush_from_bytes))),
        }
    }
    if let Some((label, n)) = &m.best
        && let Some(f) = n.fits_from_bytes
    {
        let needs = if m.recorded.is_none() { "needs " } else { "" };
        parts.push(format!("{needs}{} under {label} ({} without releases)", bytes(f), bytes(n.no_flush_from_bytes)));
    }
    parts.push(match &m.budget {
        Some(b) => format!("budget {} (from {})", budget_text(b), b.source),
        None => "budget not known (give `--capacity`)".to_string(),
    });
    parts.push(format!("peak allocated {}", bytes(m.peak_allocated_bytes)));
    if let Some(note) = &m.note {
        parts.push(format!("note: {note}"));
    }
    let who = if several { format!("{}: ", who(m.unit)) } else { String::new() };
    format!("{who}{}", parts.join("; "))
}

/// The first screen of `report.md`.
/// `who` names a unit (a device, or a recording's process on a GPU).
pub fn first_screen_md(d: &Decision, who: &dyn Fn(u32) -> String) -> String {
    let mut md = format!("**Verdict: {}**\n\n", verdict_line(d));
    let several = d.memory.len() > 1;
    for m in &d.memory {
        md.push_str(&format!("**Memory:** {}.\n", memory_line(m, several, who)));
    }
    for c in &d.capacity.contradictions {
        md.push_str(&format!("**The capacity given contradicts the recording:** {c}.\n"));
    }
    if !d.memory.is_empty() {
        md.push_str(&format!(
            "(From the recorded requests, by replaying them through PyTorch's allocator at each budget; it leaves out \
             {}. The budget is what PyTorch's allocator may reserve.)\n",
            crate::output::whatif::EXCLUDES
        ));
        md.push('\n');
    }
    md.push_str(&format!("**The fix:** {}\n\n", fix_text(d)));
    md
}

fn fix_text(d: &Decision) -> String {
    match &d.fix {
        Fix::Setting { conf, why, needed } => {
            let needs: Vec<String> = needed
                .iter()
                .filter_map(|n| n.fits_from_bytes.map(|f| (f, n)))
                .map(|(f, n)| format!("fits from {}, never releases from {}", bytes(f), bytes(n.no_flush_from_bytes)))
                .collect();
            let mut t = if needs.is_empty() {
                format!("`{conf}` — {why}")
            } else {
                format!("`{conf}` — {why}; it {}", needs.join("; "))
            };
            // A budget known only as an interval: the what-if replayed at
            // its low end; say whether the figures hold across it.
            if let (Some(lo), Some(hi)) = (d.capacity.lo_bytes, d.capacity.hi_bytes)
                && hi > lo
            {
                if !needed.is_empty() && needed.iter().all(|n| n.no_flush_from_bytes <= lo) {
                    t.push_str(&format!(
                        " (it never reaches the budget's low end, so this holds anywhere in {}–{})",
                        bytes(lo),
                        bytes(hi)
                    ));
                } else {
                    t.push_str(&format!(
                        " (replayed at the budget's low end, {}; the budget may be up to {})",
                        bytes(lo),
                        bytes(hi)
                    ));
                }
            }
            t.push('.');
            t
        }
        Fix::Sites { why, sites } if !sites.is_empty() => {
            let list: Vec<String> = sites.iter().map(|s| format!("`{}` {}", s.site, bytes(s.bytes))).collect();
            format!(
                "{why}. The call sites holding the most at the peak of allocated memory, where the program can \
                 change: {}.",
                list.join(", ")
            )
        }
        Fix::Sites { why, .. } | Fix::None { why } => format!("{why}."),
    }
}

/// The first lines of stdout.
pub fn first_screen_stdout(d: &Decision, who: &dyn Fn(u32) -> String) -> String {
    let mut t = format!("  verdict: {}\n", verdict_line(d));
    let several = d.memory.len() > 1;
    for m in &d.memory {
        t.push_str(&format!("  memory: {}\n", memory_line(m, several, who)));
    }
    t.push_str(&format!("  fix: {}\n", fix_text(d)));
    t
}

/// The settings check's lines for stdout.
pub fn settings_stdout(c: &crate::analysis::settings_check::SettingsCheck) -> String {
    settings_sentences(c).iter().map(|s| format!("  settings not in force: {s}\n")).collect()
}

/// One sentence per setting asked for and not used
/// ([`crate::analysis::settings_check`]): the first screen's "Settings" line.
pub fn settings_sentences(c: &crate::analysis::settings_check::SettingsCheck) -> Vec<String> {
    c.differences
        .iter()
        .map(|d| {
            let asked = if d.asked_in.starts_with('`') {
                format!("{} asked for `{}:{}`", d.asked_in, d.key, d.asked)
            } else {
                format!("{} asks for `{}:{}`", d.asked_in, d.key, d.asked)
            };
            format!(
                "{asked}, but the allocator ran with `{}:{}`, as {}: {}. {}.",
                d.key, d.used, d.evidence, d.reason, d.advice
            )
        })
        .collect()
}
