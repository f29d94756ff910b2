//! `whatif.json` and `whatif.md`: the allocator model's fidelity to the
//! recording, each scenario's outcome, and the recommendation.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::json;

use crate::analysis::allocator::Settings;
use crate::analysis::whatif::{Fidelity, Outcome};
use crate::units::bytes;

/// One scenario over every device: sums of the devices' outcomes (each
/// device has its own memory), and the outcomes.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    pub name: String,
    pub conf: Vec<String>,
    pub peak_reserved_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub reserved_minus_allocated_at_peak: u64,
    pub segment_allocs: u64,
    pub ooms: u64,
    pub devices: Vec<Outcome>,
}

impl Scenario {
    pub fn of(name: &str, conf: &[String], devices: Vec<Outcome>) -> Scenario {
        let sum = |f: fn(&Outcome) -> u64| devices.iter().map(f).sum();
        Scenario {
            name: name.into(),
            conf: conf.to_vec(),
            peak_reserved_bytes: sum(|o| o.peak_reserved_bytes),
            peak_allocated_bytes: sum(|o| o.peak_allocated_bytes),
            reserved_minus_allocated_at_peak: sum(|o| o.reserved_minus_allocated_at_peak),
            segment_allocs: sum(|o| o.segment_allocs),
            ooms: sum(|o| o.ooms),
            devices,
        }
    }
}

/// A lower peak reserved counts only beyond this share of the recorded
/// scenario's (and 2 MiB): smaller differences are noise of the model.
const SIGNIFICANT: f64 = 0.01;

/// Everything `whatif` found.
#[derive(Clone, Debug)]
pub struct Report {
    pub input: String,
    pub recorded_settings: serde_json::Value,
    pub capacity: Option<u64>,
    pub fidelity: Vec<Fidelity>,
    pub scenarios: Vec<Scenario>,
    /// Index into `scenarios` of the recommended one (0: keep the
    /// recorded settings), and why.
    pub recommended: (usize, String),
}

impl Report {
    pub fn new(
        input: &Path,
        _recorded: &Settings,
        recorded_settings: serde_json::Value,
        capacity: Option<u64>,
        fidelity: Vec<Fidelity>,
        scenarios: Vec<Scenario>,
    ) -> Report {
        let recommended = recommend(&scenarios);
        Report { input: input.display().to_string(), recorded_settings, capacity, fidelity, scenarios, recommended }
    }

    /// Allocations placed where PyTorch placed them, over all devices.
    pub fn same_address(&self) -> (u64, u64) {
        let measured = self.fidelity.iter().filter(|f| f.not_measured.is_none());
        measured.fold((0, 0), |(s, n), f| (s + f.same_address, n + f.allocations))
    }

    fn recommendation_line(&self) -> String {
        let (i, _) = &self.recommended;
        if *i == 0 {
            "keep the current settings".into()
        } else {
            format!("PYTORCH_CUDA_ALLOC_CONF={}", self.scenarios[*i].conf.join(","))
        }
    }

    pub fn headline(&self) -> String {
        let (same, n) = self.same_address();
        let fidelity = if n == 0 {
            "fidelity not measured".to_string()
        } else {
            format!(
                "model placed {same} of {n} allocations where PyTorch did ({:.1} %)",
                100.0 * same as f64 / n as f64
            )
        };
        format!("{}: {fidelity}; recommendation: {} ({})", self.input, self.recommendation_line(), self.recommended.1)
    }

    pub fn json(&self) -> serde_json::Value {
        let scenario = |s: &Scenario| {
            let classes: serde_json::Map<String, serde_json::Value> = s
                .devices
                .iter()
                .flat_map(|o| o.oom_classes.iter())
                .fold(std::collections::BTreeMap::<String, u64>::new(), |mut m, (c, n)| {
                    *m.entry(c.clone()).or_default() += n;
                    m
                })
                .into_iter()
                .map(|(c, n)| (c, json!(n)))
                .collect();
            json!({
                "name": s.name,
                "conf": s.conf,
                "peak_reserved_bytes": s.peak_reserved_bytes,
                "peak_allocated_bytes": s.peak_allocated_bytes,
                "reserved_minus_allocated_at_peak": s.reserved_minus_allocated_at_peak,
                "segment_allocs": s.segment_allocs,
                "ooms": s.ooms,
                "oom_classes": classes,
                "devices": s.devices,
            })
        };
        let recorded = &self.scenarios[0];
        json!({
            "input": self.input,
            "allocator_settings": self.recorded_settings,
            "capacity_bytes": self.capacity,
            "model": "PyTorch CUDACachingAllocator (2.4-2.5 native allocator, no expandable segments); see src/analysis/allocator.rs",
            "fidelity": self.fidelity.iter().zip(&recorded.devices).map(|(f, o)| json!({
                "device": f.device,
                "allocations": f.allocations,
                "same_address": f.same_address,
                "same_block_size": f.same_size,
                "segments_requested": f.segments_requested,
                "segments_same_size": f.segments_same_size,
                "segments_only_recorded": f.segments_only_recorded,
                "segments_only_model": f.segments_only_model,
                "recorded_peak_reserved_bytes": f.recorded_peak_reserved,
                "simulated_peak_reserved_bytes": o.peak_reserved_bytes,
                "desynchronised_events": f.desynchronised,
                "first_mismatches": f.first_mismatches,
                "not_measured": f.not_measured,
            })).collect::<Vec<_>>(),
            "scenarios": self.scenarios.iter().map(scenario).collect::<Vec<_>>(),
            "recommendation": {"conf": self.recommendation_line(), "reason": self.recommended.1},
        })
    }

    pub fn markdown(&self) -> String {
        let mut md = format!("# fragscope whatif: {}\n\n", self.input);
        let _ = writeln!(md, "**Recommendation: `{}`** — {}.\n", self.recommendation_line(), self.recommended.1);
        md.push_str("## Fidelity: the model against the recording\n\n");
        md.push_str("Under the snapshot's own settings, from the state before the first trace entry, the model chose a block for every allocation; the recorded choice was then applied.\n\n");
        md.push_str("| device | allocations | at PyTorch's address | same block size | segments asked (same size) | segments only PyTorch / only model | peak reserved recorded → simulated |\n|---|---|---|---|---|---|---|\n");
        for (f, o) in self.fidelity.iter().zip(&self.scenarios[0].devices) {
            if let Some(why) = &f.not_measured {
                let _ = writeln!(md, "| {} | — | not measured: {why} | | | | |", f.device);
                continue;
            }
            let pct = |x: u64| if f.allocations == 0 { 100.0 } else { 100.0 * x as f64 / f.allocations as f64 };
            let _ = writeln!(
                md,
                "| {} | {} | {} ({:.1} %) | {} ({:.1} %) | {} ({}) | {} / {} | {} → {} |",
                f.device,
                f.allocations,
                f.same_address,
                pct(f.same_address),
                f.same_size,
                pct(f.same_size),
                f.segments_requested,
                f.segments_same_size,
                f.segments_only_recorded,
                f.segments_only_model,
                bytes(f.recorded_peak_reserved),
                bytes(o.peak_reserved_bytes)
            );
        }
        let mismatches: Vec<_> =
            self.fidelity.iter().flat_map(|f| f.first_mismatches.iter().map(move |m| (f.device, m))).collect();
        if !mismatches.is_empty() {
            md.push_str("\nFirst mismatches (all in whatif.json):\n\n| device | allocation | requested | recorded | model | why |\n|---|---|---|---|---|---|\n");
            for (d, m) in mismatches.iter().take(10) {
                let _ = writeln!(
                    md,
                    "| {d} | #{} | {} | {:#x} ({}) | {} | {} |",
                    m.allocation,
                    bytes(m.requested),
                    m.recorded_addr,
                    bytes(m.recorded_size),
                    m.model_addr.map_or("new segment".into(), |a| format!("{a:#x}")),
                    m.why
                );
            }
        }
        md.push_str("\n## Scenarios\n\n");
        let _ = writeln!(
            md,
            "{}\n",
            match self.capacity {
                Some(c) => {
                    let start: u64 = self.fidelity.iter().map(|f| f.initial_reserved).max().unwrap_or(0);
                    let mut t = format!(
                        "Capacity {} per device: a segment beyond it is refused after the cache is released, and the request fails.",
                        bytes(c)
                    );
                    if start > c {
                        let _ = write!(
                            t,
                            " The state before the first trace entry already reserves {} (more than the capacity): scenarios only refuse new segments.",
                            bytes(start)
                        );
                    }
                    t
                }
                None => "No capacity given (`--capacity`): nothing runs out of memory, so the scenarios differ only in the memory they reserve.".into(),
            }
        );
        md.push_str("| scenario | peak reserved | peak allocated | reserved − allocated at peak | segments allocated | OOMs |\n|---|---|---|---|---|---|\n");
        for s in &self.scenarios {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} |",
                if s.conf.is_empty() { "recorded settings".into() } else { format!("`{}`", s.conf.join(",")) },
                bytes(s.peak_reserved_bytes),
                bytes(s.peak_allocated_bytes),
                bytes(s.reserved_minus_allocated_at_peak),
                s.segment_allocs,
                s.ooms
            );
        }
        md.push_str("\nNot modelled yet: `expandable_segments` (scenarios with it are not run), CUDA graph pools, pending `record_stream` events. Every scenario starts from the recorded state before the first trace entry.\n");
        md
    }
}

/// The scenario with the fewest OOMs, then the lowest peak reserved; the
/// recorded settings unless another is better by more than noise.
fn recommend(scenarios: &[Scenario]) -> (usize, String) {
    let Some(rec) = scenarios.first() else { return (0, "no scenario ran".into()) };
    let best = (1..scenarios.len()).min_by_key(|&i| (scenarios[i].ooms, scenarios[i].peak_reserved_bytes));
    let Some(b) = best else { return (0, "no other scenario ran".into()) };
    let s = &scenarios[b];
    if s.ooms < rec.ooms {
        return (
            b,
            format!("{} OOM(s) instead of {}, peak reserved {}", s.ooms, rec.ooms, bytes(s.peak_reserved_bytes)),
        );
    }
    let margin = ((rec.peak_reserved_bytes as f64 * SIGNIFICANT) as u64).max(2 << 20);
    if s.ooms == rec.ooms && s.peak_reserved_bytes + margin < rec.peak_reserved_bytes {
        return (
            b,
            format!(
                "peak reserved {} instead of {} ({} less), same OOMs ({})",
                bytes(s.peak_reserved_bytes),
                bytes(rec.peak_reserved_bytes),
                bytes(rec.peak_reserved_bytes - s.peak_reserved_bytes),
                s.ooms
            ),
        );
    }
    (
        0,
        format!(
            "no scenario has fewer OOMs ({}) or a peak reserved lower by more than 1 % than the recorded settings' {}",
            rec.ooms,
            bytes(rec.peak_reserved_bytes)
        ),
    )
}
