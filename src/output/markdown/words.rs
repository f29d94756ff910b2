//! Phrases every part of the report uses: plurals, the sentence of an OOM
//! class, the names of the forecasters and their skill, the peak.

use crate::analysis::Analysis;
use crate::analysis::oom::OomClass;
use crate::analysis::predict::ForecasterKind;
use crate::units::bytes;

/// The peak live bytes for a reader: per device when a snapshot has
/// several (each device has its own memory), a sum labelled as one.
pub(crate) fn peak_live_text(a: &Analysis) -> String {
    if !a.has_history() {
        // One instant: what was live then, not a peak.
        // What was live at its end (a trace of a free or two starts
        // before them).
        let live: u64 = a.leaks.iter().map(|l| l.live_at_end_bytes).sum();
        return format!("live {} at the snapshot (its peak is not in it)", bytes(live));
    }
    match (a.allocator_view, a.peaks.iter().max_by_key(|p| p.bytes)) {
        (true, Some(top)) if a.peaks.len() > 1 => format!(
            "peak live {} on {} (the highest of {} devices; {} summed over them at one instant)",
            bytes(top.bytes),
            a.device_name(top.pid),
            a.peaks.len(),
            bytes(a.peak_live_total)
        ),
        // A recording of PyTorch's processes at their cudaMalloc calls:
        // "live" is what they held from CUDA, their caches whole.
        _ if !a.allocator_view && !a.pytorch_processes.is_empty() => format!(
            "peak live {} (held from CUDA: PyTorch's segments whole, the free blocks of its cache included)",
            bytes(a.peak_live_total)
        ),
        _ => format!("peak live {}", bytes(a.peak_live_total)),
    }
}

pub(crate) use crate::units::plural;

/// What the dominant OOM class means, in one sentence.
pub(crate) fn oom_sentence(class: OomClass) -> &'static str {
    match class {
        OomClass::Fragmentation => "enough memory was free, but no single free range could hold the request",
        OomClass::Capacity => "the requests exceeded the free device memory",
        OomClass::AllocatorPolicy => "a free range large enough existed, but the allocator did not use it",
        OomClass::Unknown => "the device capacity is unknown: pass --capacity to classify them",
    }
}

/// The forecaster, for the headline.
pub(crate) fn forecaster_phrase(f: ForecasterKind) -> &'static str {
    match f {
        ForecasterKind::Model => "the model",
        ForecasterKind::Persistence => "\"no change\" (persistence)",
        ForecasterKind::Seasonal => "the seasonal baseline (one iteration earlier)",
        ForecasterKind::Ridge => "the ridge baseline",
    }
}

/// The forecaster's confidence; where the score never moved at a
/// cross-validation origin (a trace that idles for most of its span), an
/// error of 0 is no evidence, and the phrase says so.
pub(crate) fn confidence_phrase(pr: &crate::analysis::predict::Prediction) -> String {
    if pr.flat_score() {
        "confidence not rated: the score did not move at any cross-validation origin, so the forecast rests on nothing"
            .to_string()
    } else {
        format!("confidence {:.2}", pr.confidence.unwrap_or(0.0))
    }
}

/// Whether the forecaster beats "no change", with its skill.
pub(crate) fn skill_phrase(pr: &crate::analysis::predict::Prediction) -> String {
    match (pr.forecaster, pr.skill) {
        (ForecasterKind::Persistence, _) => "nothing forecast better than no change".into(),
        // Less than 5 % better is within what another set of origins
        // could reverse: not claimed as a win.
        (_, Some(s)) if s >= 0.05 => format!("beats no change, skill {s:+.2}"),
        (_, Some(s)) if s > 0.0 => format!("about as good as no change, skill {s:+.2} (under 5 % better)"),
        (_, Some(s)) => format!("does not beat no change, skill {s:+.2}"),
        (_, None) => "not validated: too few steps to compare with no change".into(),
    }
}
