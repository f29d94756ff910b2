//! How `whatif` judges its scenarios and names them: the notes a
//! scenario's settings need, which settings no real run has checked, the
//! recommendation, and the labels and configuration lines the reports
//! write.

use super::{Scenario, Settings};

/// Why settings replay otherwise than they read, or how far the model
/// was checked on them, if the reader must know (several notes joined).
pub(super) fn settings_note(s: &Settings, capacity_known: bool) -> Option<String> {
    let mut notes: Vec<String> = Vec::new();
    for e in &s.inert {
        let key = e.split(':').next().unwrap_or(e);
        if let Some(what) = crate::import::settings::inert(key) {
            notes.push(format!(
                "`{e}` changes {what}, neither where blocks go nor the bytes reserved: replayed as absent"
            ));
        }
    }
    if s.max_non_split_rounding.is_some() && s.max_split_size.is_none() {
        notes.push(
            "`max_non_split_rounding_mb` acts only on requests at or above `max_split_size_mb`, which is not set: \
             replayed as absent"
                .into(),
        );
    }
    if s.garbage_collection_threshold.is_some() && s.collects_garbage().is_none() {
        notes.push(
            "`garbage_collection_threshold` acts only under a per-process memory fraction below 1 \
             (`torch.cuda.set_per_process_memory_fraction`, which a trace does not show: none is assumed): PyTorch \
             collects garbage only then, so it replays as if unset"
                .into(),
        );
    }
    if s.per_process_memory_fraction.is_some() && !capacity_known {
        notes.push(
            "a per-process memory fraction needs the device's capacity (`--capacity`): without one it limits nothing \
             here"
                .into(),
        );
    }
    // The model was checked on real PyTorch 2.11 runs one setting at a
    // time (SPEC §10); these pairs follow the same code, unchecked.
    if unchecked_pair(s) {
        notes.push(
            "two or more of expandable segments, `max_split_size_mb` and `roundup_power2_divisions`: no real run has \
             checked the model on such a combination (it was checked on PyTorch 2.11 one setting at a time)"
                .into(),
        );
    }
    (!notes.is_empty()).then(|| notes.join("; "))
}

/// Whether settings combine two or more of expandable segments,
/// `max_split_size_mb` and `roundup_power2_divisions`: the model follows
/// the same code, but real runs checked it one setting at a time (SPEC
/// §10).
pub(super) fn unchecked_pair(s: &Settings) -> bool {
    // Garbage collection in force counts as one: the model was checked on
    // it alone (the varlen run under a memory fraction).
    let set = [
        s.expandable_segments,
        s.max_split_size.is_some(),
        s.roundup_power2_divisions.iter().any(|&d| d > 1),
        s.collects_garbage().is_some(),
    ];
    set.iter().filter(|&&x| x).count() >= 2
}

/// Where a recommended or advised scenario pairs settings that no real run
/// has checked: said beside it.
pub const UNCHECKED: &str = "a combination of settings no real run has checked the model on";

/// A lower peak reserved counts only beyond this share of the recorded
/// scenario's (and 2 MiB): smaller differences are noise of the model.
pub(super) const SIGNIFICANT: f64 = 0.01;

/// Whether a scenario's OOMs compare with the recorded ones: every
/// recorded OOM fell on a device whose capacity is known (elsewhere no
/// scenario can run out of memory).
pub(super) fn ooms_judged(rec: &Scenario, capacities: &[Option<u64>]) -> bool {
    rec.devices.iter().zip(capacities).all(|(d, c)| d.ooms == 0 || c.is_some())
}

/// Whether `s` reserves less than `rec` at the peak (by more than the
/// model's noise) while releasing its cache to make room more often: a
/// saving bought with device-wide synchronisations.
pub(super) fn saves_by_flushing(rec: &Scenario, s: &Scenario) -> bool {
    s.flushes > rec.flushes && s.peak_reserved_bytes + noise(rec.peak_reserved_bytes) < rec.peak_reserved_bytes
}

/// The model's noise around a peak of `bytes` ([`SIGNIFICANT`]).
pub(super) fn noise(bytes: u64) -> u64 {
    ((bytes as f64 * SIGNIFICANT) as u64).max(2 << 20)
}

/// The scenario with the fewest OOMs, then the lowest peak reserved; the
/// recorded settings unless another is better by more than noise. Without
/// a capacity no scenario can run out of memory, so a recording's OOMs
/// cannot be compared with them.
pub(super) fn recommend(
    scenarios: &[Scenario],
    recorded: &[String],
    capacities: &[Option<u64>],
    unreproduced: Option<&str>,
    untestable: Option<&str>,
) -> (usize, String) {
    let Some(rec) = scenarios.first() else { return (0, "no scenario ran".into()) };
    if let Some(why) = untestable {
        return (0, why.to_string());
    }
    // OOMs compare where every recorded one fell on a device whose capacity
    // is known: elsewhere no scenario can run out of memory.
    let capacity_known = capacities.iter().all(Option::is_some);
    if !ooms_judged(rec, capacities) && rec.ooms > 0 {
        return (
            0,
            format!(
                "the recording's {} OOM(s) cannot be compared with the scenarios: without a capacity (`--capacity`) no scenario can run out of memory",
                rec.ooms
            ),
        );
    }
    if let Some(why) = unreproduced {
        return (
            0,
            format!(
                "the replay does not reproduce the recorded OOMs ({why}), so it cannot say which setting avoids them"
            ),
        );
    }
    // Between scenarios exactly as good, the milder setting: the fewest
    // entries, then the largest `max_split_size_mb` (it splits fewer blocks).
    let milder = |i: usize| {
        let conf = &scenarios[i].conf;
        let split = conf
            .iter()
            .filter_map(|e| e.strip_prefix("max_split_size_mb:").and_then(|v| v.trim().parse::<u64>().ok()))
            .max()
            .unwrap_or(u64::MAX);
        (conf.iter().filter(|e| !is_default(e)).count(), std::cmp::Reverse(split))
    };
    // A setting that reserves less only by releasing its cache more often
    // (a `cudaFree` each time, which synchronizes the device) buys the
    // saving with stalls: it is no candidate unless it removes OOMs.
    let eligible = |i: &usize| scenarios[*i].ooms < rec.ooms || scenarios[*i].flushes <= rec.flushes;
    let flushing = scenarios[1..].iter().any(|s| s.ooms >= rec.ooms && saves_by_flushing(rec, s));
    let unless_flushing = if flushing { " without releasing its cache more often" } else { "" };
    let best = (1..scenarios.len())
        .filter(eligible)
        .min_by_key(|&i| (scenarios[i].ooms, scenarios[i].peak_reserved_bytes, milder(i)));
    let Some(mut b) = best else {
        return (
            0,
            if scenarios.len() > 1 {
                "every other scenario releases its cache more often without removing an OOM (a `cudaFree` each \
                 time, which synchronizes the device)"
                    .into()
            } else {
                "no other scenario ran".into()
            },
        );
    };
    // Between scenarios as good (the same OOMs, peak reserved within the
    // model's noise), one whose settings real runs checked wins over a
    // pair that none did.
    if scenarios[b].unchecked_pair {
        let close = |s: &Scenario| {
            s.ooms == scenarios[b].ooms
                && s.peak_reserved_bytes <= scenarios[b].peak_reserved_bytes + noise(scenarios[b].peak_reserved_bytes)
        };
        if let Some(c) = (1..scenarios.len())
            .filter(|&i| !scenarios[i].unchecked_pair && close(&scenarios[i]))
            .min_by_key(|&i| scenarios[i].peak_reserved_bytes)
        {
            b = c;
        }
    }
    let s = &scenarios[b];
    if s.ooms < rec.ooms {
        let ooms = crate::units::plural(s.ooms, "OOM", "OOMs");
        return (b, format!("{ooms} instead of {}, peak reserved {}", rec.ooms, s.reserved()));
    }
    let margin = noise(rec.peak_reserved_bytes);
    let lower = s.ooms == rec.ooms && s.peak_reserved_bytes + margin < rec.peak_reserved_bytes;
    // With OOMs that nothing removes, a setting that only reserves less
    // is a secondary saving, never the recommendation.
    if rec.ooms > 0 {
        return (
            0,
            format!(
                "no scenario has fewer OOMs than the recorded settings' {}{}",
                rec.ooms,
                if lower {
                    format!(
                        "; {} reserves {} less at the peak, a secondary saving that does not remove them",
                        scenario_label(recorded, &s.conf),
                        crate::units::bytes(rec.peak_reserved_bytes - s.peak_reserved_bytes)
                    )
                } else {
                    String::new()
                }
            ),
        );
    }
    if lower {
        return (
            b,
            format!(
                "peak reserved {} instead of {} ({} less), {}",
                s.reserved(),
                crate::units::bytes(rec.peak_reserved_bytes),
                crate::units::bytes(rec.peak_reserved_bytes - s.peak_reserved_bytes),
                if capacity_known {
                    format!("same OOMs ({})", s.ooms)
                } else {
                    "OOMs not judged without a capacity".to_string()
                }
            ),
        );
    }
    if !capacity_known {
        // Without a capacity OOMs are not judged: only the memory reserved.
        return (
            0,
            format!(
                "no scenario reserves less than the recorded settings' {} by more than 1 % at the peak{unless_flushing} \
                 (OOMs are not judged {})",
                rec.reserved(),
                if capacities.iter().any(Option::is_some) {
                    "on a device without a capacity"
                } else {
                    "without a capacity"
                }
            ),
        );
    }
    (
        0,
        format!(
            "no scenario has fewer OOMs ({}) or a peak reserved lower by more than 1 % than the recorded settings' \
             {}{unless_flushing}",
            rec.ooms,
            rec.reserved()
        ),
    )
}

/// The key of a `KEY:VALUE` entry.
pub(super) fn entry_key(entry: &str) -> &str {
    entry.split(':').next().unwrap_or_default().trim()
}

/// The recorded entries a scenario keeps: those whose key it does not set.
pub fn kept_entries<'a>(recorded: &'a [String], conf: &[String]) -> Vec<&'a String> {
    recorded.iter().filter(|e| !conf.iter().any(|c| entry_key(c) == entry_key(e))).collect()
}

/// The recorded entries a scenario leaves out (`KEY:default`).
pub(super) fn dropped_entries<'a>(recorded: &'a [String], conf: &[String]) -> Vec<&'a String> {
    recorded.iter().filter(|r| conf.iter().any(|e| is_default(e) && entry_key(e) == entry_key(r))).collect()
}

/// Whether an entry is `KEY:default`: the recorded settings without that
/// key.
pub fn is_default(entry: &str) -> bool {
    entry.split_once(':').is_some_and(|(_, v)| v.trim() == "default")
}

/// A scenario's settings as its row names them: what it sets, and the
/// recorded settings it keeps (a scenario changes the recorded settings,
/// so `roundup_power2_divisions:4` on a run with `max_split_size_mb:64`
/// is both).
pub fn scenario_label(recorded: &[String], conf: &[String]) -> String {
    let kept: Vec<&str> = kept_entries(recorded, conf).into_iter().map(String::as_str).collect();
    if is_recorded(recorded, conf) {
        // The sweep's entry is what the recording already ran with.
        return format!("`{}` (the recorded settings)", recorded.join(","));
    }
    let set: Vec<&str> = conf.iter().map(String::as_str).filter(|e| !is_default(e)).collect();
    let dropped: Vec<&str> = dropped_entries(recorded, conf).into_iter().map(String::as_str).collect();
    let mut label = match (set.is_empty(), kept.is_empty()) {
        (true, true) => "PyTorch's defaults".to_string(),
        (true, false) => format!("recorded `{}`", kept.join(",")),
        (false, true) => format!("`{}`", set.join(",")),
        (false, false) => format!("`{}` + recorded `{}`", set.join(","), kept.join(",")),
    };
    if !dropped.is_empty() {
        label.push_str(&format!(", without recorded `{}`", dropped.join(",")));
    }
    label
}

/// Whether a sweep's entries are what the recording already ran with.
pub fn is_recorded(recorded: &[String], conf: &[String]) -> bool {
    !conf.is_empty() && conf.iter().all(|e| recorded.contains(e))
}

/// A `conf_line` for Markdown: each setting line or Python call in code,
/// a sentence (the defaults) as it is.
pub fn conf_md(line: &str) -> String {
    if line.starts_with("PYTORCH_CUDA_ALLOC_CONF") || line.starts_with("torch.") {
        line.split(" and ").map(|p| format!("`{p}`")).collect::<Vec<_>>().join(" and ")
    } else {
        line.to_string()
    }
}

/// What a scenario leaves below a capacity, when it is under 1 % of it:
/// a setting that removes the OOMs with that little to spare says so (the
/// replay is exact only for the requests the trace holds). On one device
/// only: the peaks of several are summed.
pub fn tight_margin(capacity: Option<u64>, s: &Scenario) -> Option<String> {
    let c = capacity.filter(|_| s.devices.len() == 1)?;
    let spare = c.saturating_sub(s.peak_reserved_bytes);
    ((spare as f64) < c as f64 * SIGNIFICANT).then(|| {
        format!(
            "only {} below the capacity: a margin that a small change in the program could take",
            crate::units::bytes(spare)
        )
    })
}

/// The `PYTORCH_CUDA_ALLOC_CONF` line of a scenario's entries: the
/// recorded settings stay, unless the scenario sets the key.
pub fn conf_line(recorded: &[String], conf: &[String]) -> String {
    if conf.is_empty() {
        return "PyTorch's caching allocator with its default settings".into();
    }
    let key = |e: &String| entry_key(e).to_string();
    // The fraction is a Python call, not an environment entry.
    let fraction = "per_process_memory_fraction";
    // `KEY:default` leaves the key out: PyTorch's default.
    let mut line: Vec<&String> =
        kept_entries(recorded, conf).into_iter().chain(conf).filter(|e| !is_default(e)).collect();
    // A recorded `garbage_collection_threshold` does nothing without a
    // memory fraction below 1 ([`Settings::collects_garbage`]): not
    // advised again.
    let collects = line.iter().any(|e| {
        key(e) == fraction && e.split_once(':').and_then(|(_, f)| f.trim().parse::<f64>().ok()).is_some_and(|f| f < 1.0)
    });
    if !collects {
        line.retain(|e| key(e) != "garbage_collection_threshold" || conf.contains(e));
    }
    if line.is_empty() {
        return "PyTorch's default settings (no PYTORCH_CUDA_ALLOC_CONF)".into();
    }
    let env: Vec<&str> = line.iter().filter(|e| key(e) != fraction).map(|e| e.as_str()).collect();
    let call = line
        .iter()
        .find(|e| key(e) == fraction)
        .and_then(|e| e.split_once(':'))
        .map(|(_, f)| format!("torch.cuda.set_per_process_memory_fraction({})", f.trim()));
    match (env.is_empty(), call) {
        (false, Some(call)) => format!("PYTORCH_CUDA_ALLOC_CONF={} and {call}", env.join(",")),
        (true, Some(call)) => call,
        (_, None) => format!("PYTORCH_CUDA_ALLOC_CONF={}", env.join(",")),
    }
}
