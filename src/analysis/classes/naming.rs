//! A fleet class's name and its one-line direction, from its centroid and
//! what fragscope's own verdicts said of its members.
//!
//! A class is named by the largest problem feature of its centroid above
//! +0.5 (as the batch's groups are, [`crate::analysis::cluster`]), but a
//! name that a verdict can confirm is given only where the members'
//! verdicts confirm it:
//! - "leaking": more than half of the members' leak verdicts are
//!   "leaking", and none is "not leaking";
//! - "capacity-bound": more than half ran out of memory, mostly capacity
//!   OOMs;
//! - "fragmentation-bound": more than half had fragmentation OOMs. (Not a
//!   high fragmentation level alone: in PyTorch's cache the score counts
//!   blocks kept on purpose, and the report itself says the level does not
//!   say memory will run out.)
//! - "allocator-policy OOMs": more than half had allocator-policy OOMs.
//!
//! Names the verdicts confirm come first, then "small-allocation storm"
//! (no verdict judges it: the feature alone names it). Where no name
//! holds, the class is named for what its members had: "healthy",
//! "OOMs in M of N", "leaking in M of N".

use serde::{Deserialize, Serialize};

use crate::analysis::cluster::{FEATURES, problem};
use crate::analysis::leak::Verdict;
use crate::analysis::oom::OomClass;
use crate::analysis::predict::Risk;

/// What fragscope's verdicts said of one sample.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Trouble {
    /// Its OOMs' most frequent class, if it had any.
    pub oom_class: Option<OomClass>,
    pub leak: Option<Verdict>,
    /// The fragmentation level at its peak.
    pub level: Option<Risk>,
}

/// The verdicts over a class's members, kept in the model file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Verdicts {
    pub members: usize,
    pub capacity_ooms: usize,
    pub fragmentation_ooms: usize,
    pub policy_ooms: usize,
    /// Members with OOMs of another or unknown class.
    pub other_ooms: usize,
    pub leaking: usize,
    pub not_leaking: usize,
    /// Fragmentation level medium or worse at the peak (said, not used to
    /// name a class).
    pub fragmented: usize,
}

impl Verdicts {
    pub fn of<'a>(members: impl IntoIterator<Item = &'a Trouble>) -> Verdicts {
        let mut v = Verdicts::default();
        for t in members {
            v.members += 1;
            match t.oom_class {
                Some(OomClass::Capacity) => v.capacity_ooms += 1,
                Some(OomClass::Fragmentation) => v.fragmentation_ooms += 1,
                Some(OomClass::AllocatorPolicy) => v.policy_ooms += 1,
                Some(OomClass::Unknown) => v.other_ooms += 1,
                None => {}
            }
            match t.leak {
                Some(Verdict::Leaking) => v.leaking += 1,
                Some(Verdict::NotLeaking) => v.not_leaking += 1,
                _ => {}
            }
            if t.level.is_some_and(|l| l >= Risk::Medium) {
                v.fragmented += 1;
            }
        }
        v
    }

    fn ooms(&self) -> usize {
        self.capacity_ooms + self.fragmentation_ooms + self.policy_ooms + self.other_ooms
    }

    fn most(&self, m: usize) -> bool {
        2 * m > self.members
    }

    /// Whether the verdicts allow `name`; None: no verdict judges it.
    pub fn confirm(&self, name: &str) -> Option<bool> {
        match name {
            "leaking" => Some(self.most(self.leaking) && self.not_leaking == 0),
            "capacity-bound" => Some(self.most(self.capacity_ooms)),
            "fragmentation-bound" => Some(self.most(self.fragmentation_ooms)),
            "allocator-policy OOMs" => Some(self.most(self.policy_ooms)),
            _ => None,
        }
    }

    /// The facts behind a direction: "12 of 20 ran out of memory, 3 leak".
    fn facts(&self) -> String {
        let n = self.members;
        let mut parts = Vec::new();
        if self.ooms() > 0 {
            parts.push(format!("{} of {n} ran out of memory", self.ooms()));
        }
        if self.leaking > 0 {
            parts.push(format!("{} of {n} leak", self.leaking));
        }
        if parts.is_empty() { format!("none of {n} ran out of memory or leaked") } else { parts.join(", ") }
    }
}

/// The class's name from its centroid (z-scores, [`FEATURES`] order) and
/// its members' verdicts.
pub fn name(centroid: &[f64], v: &Verdicts) -> String {
    let mut candidates: Vec<(usize, &'static str)> = (0..FEATURES.len())
        .filter(|&j| centroid.get(j).is_some_and(|&z| z > 0.5))
        .filter_map(|j| problem(j).map(|p| (j, p)))
        .filter(|(_, p)| v.confirm(p) != Some(false))
        .collect();
    // Confirmed names first, each group by its z-score.
    candidates.sort_by(|a, b| {
        let confirmed = |p: &str| v.confirm(p).is_some();
        confirmed(b.1).cmp(&confirmed(a.1)).then(centroid[b.0].total_cmp(&centroid[a.0]))
    });
    if let Some((_, p)) = candidates.first() {
        return p.to_string();
    }
    let n = v.members;
    if v.ooms() > 0 {
        format!("OOMs in {} of {n}", v.ooms())
    } else if v.leaking > 0 {
        format!("leaking in {} of {n}", v.leaking)
    } else {
        "healthy".to_string()
    }
}

/// The one-line direction to optimise for a class named `name` (without a
/// "(2)" suffix), with the verdicts behind it.
pub fn direction(name: &str, v: &Verdicts) -> String {
    let n = v.members;
    let base = name.split(" (").next().unwrap_or(name);
    match base {
        "fragmentation-bound" => format!(
            "Fragmentation: {} of {n} ran out of memory with enough free in total; change the allocator setting each \
             report's what-if names.",
            v.fragmentation_ooms
        ),
        "capacity-bound" => format!(
            "Capacity: {} of {n} ran out of memory with too little free in total; use less memory (smaller batches, \
             activation checkpointing) or a larger GPU.",
            v.capacity_ooms
        ),
        "leaking" => {
            format!("Leak: {} of {n} grow from step to step; free what each report's leak section names.", v.leaking)
        }
        "small-allocation storm" => {
            format!("Many small or mixed-size allocations: reuse or batch buffers ({}).", v.facts())
        }
        "allocator-policy OOMs" => format!(
            "Allocator limits: {} of {n} failed on the allocator's own limits; review PYTORCH_CUDA_ALLOC_CONF.",
            v.policy_ooms
        ),
        "healthy" => format!("Nothing to change: {}.", v.facts()),
        _ if base.starts_with("OOMs in") => {
            format!("Read the OOM section of each member's report: {}.", v.facts())
        }
        _ if base.starts_with("leaking in") => {
            format!("Read the leak section of each leaking member's report: {}.", v.facts())
        }
        _ => user_direction(v),
    }
}

/// The direction of a class the user named: what its members' verdicts
/// said (the name is the user's, whatever it says).
pub fn user_direction(v: &Verdicts) -> String {
    format!("A class you named: {}.", v.facts())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn z(pairs: &[(&str, f64)]) -> Vec<f64> {
        let mut c = vec![0.0; FEATURES.len()];
        for (f, v) in pairs {
            c[FEATURES.iter().position(|x| x == f).unwrap()] = *v;
        }
        c
    }

    fn members(t: Trouble, n: usize) -> Verdicts {
        Verdicts::of(&vec![t; n])
    }

    #[test]
    fn a_name_a_verdict_denies_is_not_given() {
        let leaking = Trouble { leak: Some(Verdict::Leaking), ..Trouble::default() };
        let not = Trouble { leak: Some(Verdict::NotLeaking), ..Trouble::default() };
        let high_leak = z(&[("leak_rate", 2.0), ("small_alloc_ratio", 1.0)]);
        assert_eq!(name(&high_leak, &members(leaking, 5)), "leaking");
        // One member judged "not leaking" keeps the class from that name.
        let mut mixed = vec![leaking; 4];
        mixed.push(not);
        assert_eq!(name(&high_leak, &Verdicts::of(&mixed)), "small-allocation storm");
        assert_eq!(name(&z(&[("leak_rate", 2.0)]), &Verdicts::of(&mixed)), "leaking in 4 of 5");
        // A confirmed name comes before a feature-only one with a higher z.
        let storm_first = z(&[("leak_rate", 0.8), ("small_alloc_ratio", 1.8)]);
        assert_eq!(name(&storm_first, &members(leaking, 5)), "leaking");
        // Fragmentation features without fragmentation in the members.
        let healthy = members(Trouble { level: Some(Risk::Low), ..Trouble::default() }, 6);
        assert_eq!(name(&z(&[("large_gap_ratio", 1.4)]), &healthy), "healthy");
        // A high level alone does not confirm it: fragmentation OOMs do.
        let fragmented = members(Trouble { level: Some(Risk::High), ..Trouble::default() }, 6);
        assert_eq!(name(&z(&[("large_gap_ratio", 1.4)]), &fragmented), "healthy");
        let failed = members(Trouble { oom_class: Some(OomClass::Fragmentation), ..Trouble::default() }, 6);
        assert_eq!(name(&z(&[("large_gap_ratio", 1.4)]), &failed), "fragmentation-bound");
        let cap = members(Trouble { oom_class: Some(OomClass::Capacity), ..Trouble::default() }, 3);
        assert_eq!(name(&z(&[("capacity_oom_share", 2.0)]), &cap), "capacity-bound");
        assert!(direction("capacity-bound", &cap).starts_with("Capacity: 3 of 3"));
        assert_eq!(direction("healthy", &healthy), "Nothing to change: none of 6 ran out of memory or leaked.");
    }
}
