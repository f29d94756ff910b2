//! Samples of an analysed trace, and its classes under a model.
//!
//! A trace gives one sample per unit (a process, or a process on one GPU,
//! as its report names them: the replay's units). A trace of one unit
//! gives that unit with the trace's own features (the same figures as its
//! summary row). A summary dataset holds one row per trace: each row is
//! then a sample.

use serde::Serialize;

use super::{Assignment, Model, Sample, Trouble};
use crate::analysis::oom::OomClass;
use crate::analysis::result::Analysis;
use crate::analysis::summary::{Summary, at_peaks, features_of};

/// A trace's class and its units'.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TraceClass {
    #[serde(flatten)]
    pub trace: Assignment,
    /// Each unit's class, where the trace has more than one unit.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub units: Vec<UnitClass>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UnitClass {
    pub unit: u32,
    #[serde(flatten)]
    pub class: Assignment,
}

/// The units of a trace, in order.
fn units(a: &Analysis) -> Vec<u32> {
    let mut u: Vec<u32> = a.peaks.iter().map(|p| p.pid).collect();
    u.sort_unstable();
    u.dedup();
    u
}

/// What the verdicts said of a trace as a whole (its summary's figures).
pub fn trouble_of_summary(s: &Summary) -> Trouble {
    Trouble {
        oom_class: (s.ooms > 0).then(|| s.oom_classes.first().map_or(OomClass::Unknown, |c| c.0)),
        leak: s.leak_verdict,
        level: s.risk,
    }
}

/// What the verdicts said of one unit.
fn trouble_of_unit(a: &Analysis, pid: u32) -> Trouble {
    Trouble {
        // The most frequent, as a trace's summary takes it.
        oom_class: crate::analysis::decision::oom_classes_of(a, Some(pid)).first().map(|c| c.0),
        leak: a.leaks.iter().find(|l| l.pid == pid).map(|l| l.verdict),
        level: at_peaks(a).iter().find(|p| p.pid == pid).map(|p| p.level),
    }
}

/// The samples of an analysed trace: one per unit.
pub fn samples_of(a: &Analysis) -> Vec<Sample> {
    let units = units(a);
    if units.len() <= 1 {
        let s = Summary::of(a);
        return vec![Sample {
            trace: a.trace.name.clone(),
            unit: units.first().copied(),
            features: s.features,
            trouble: trouble_of_summary(&s),
        }];
    }
    units
        .into_iter()
        .map(|u| Sample {
            trace: a.trace.name.clone(),
            unit: Some(u),
            features: features_of(a, Some(u)),
            trouble: trouble_of_unit(a, u),
        })
        .collect()
}

impl TraceClass {
    /// The class in a line: "leaking (confidence 0.97): Leak: …", and the
    /// units' classes where they are several.
    pub fn line(&self, who: &dyn Fn(u32) -> String) -> String {
        let t = &self.trace;
        let mut s = match (&t.direction, &t.why) {
            (Some(d), _) => format!("{} (confidence {:.2}): {d}", t.name, t.confidence),
            (None, Some(why)) => format!("{}: {why}", t.name),
            (None, None) => t.name.clone(),
        };
        if !self.units.is_empty() {
            let units: Vec<String> = self.units.iter().map(|u| format!("{} {}", who(u.unit), u.class.name)).collect();
            s.push_str(&format!(" Units: {}.", units.join("; ")));
        }
        s
    }
}

/// The class of a trace (from its features as a whole) and of each of its
/// units.
pub fn classify(model: &Model, a: &Analysis) -> TraceClass {
    let units = units(a);
    let mut rows = vec![features_of(a, None)];
    if units.len() > 1 {
        rows.extend(units.iter().map(|&u| features_of(a, Some(u))));
    }
    let mut got = model.classify(&rows).into_iter();
    let trace = got.next().unwrap_or_else(|| Assignment {
        name: super::model::UNCLASSIFIED.to_string(),
        confidence: 0.0,
        classifier: model.classifier.clone(),
        model_id: model.model_id.clone(),
        direction: None,
        why: Some("no features".to_string()),
    });
    let units = if units.len() > 1 {
        units.into_iter().zip(got).map(|(unit, class)| UnitClass { unit, class }).collect()
    } else {
        Vec::new()
    };
    TraceClass { trace, units }
}
