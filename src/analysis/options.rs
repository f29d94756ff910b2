//! What the analysis of a trace is asked for: the options shared by every
//! trace of a run ([`Options`]) and how the trace is cut into timesteps
//! ([`StepSpec`]).

use std::str::FromStr;

use crate::analysis::metrics::MetricsConfig;
use crate::analysis::predict::PredictConfig;

/// How the trace is cut into timesteps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum StepSpec {
    /// About this many equal-duration steps (fewer for shorter traces).
    #[default]
    Auto,
    /// Steps of this many nanoseconds.
    Duration(u64),
    /// Steps of this many events.
    Events(u64),
}

impl FromStr for StepSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s == "auto" {
            return Ok(StepSpec::Auto);
        }
        if let Some(n) = s.strip_suffix("ev") {
            return match n.trim().parse::<u64>() {
                Ok(n) if n > 0 => Ok(StepSpec::Events(n)),
                _ => Err(format!("`{s}`: expected a positive event count such as 5000ev")),
            };
        }
        match humantime::parse_duration(s) {
            Ok(d) if d.as_nanos() > 0 => Ok(StepSpec::Duration(d.as_nanos().min(u64::MAX as u128) as u64)),
            _ => Err(format!("`{s}`: expected a duration (10ms, 1s, 500us) or an event count (5000ev)")),
        }
    }
}

impl std::fmt::Display for StepSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StepSpec::Auto => write!(f, "auto"),
            StepSpec::Duration(ns) => write!(f, "{}", humantime::format_duration(std::time::Duration::from_nanos(*ns))),
            StepSpec::Events(n) => write!(f, "{n}ev"),
        }
    }
}

/// Analysis options shared by every trace of a run.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub metrics: MetricsConfig,
    pub step: StepSpec,
    /// The reference method: recompute every metric from the sorted live
    /// set at each row (slow; the benchmark baseline).
    pub brute_force: bool,
    /// Device memory capacity for the OOM diagnosis; overrides the trace's.
    pub capacity: Option<u64>,
    pub predict: PredictConfig,
    /// Keep the block and segment lives the pictures draw
    /// ([`Analysis::layout`]); off for `--no-plots`.
    pub layout: bool,
    /// PyTorch snapshots: analyse only this device.
    pub device: Option<u32>,
    /// PyTorch snapshots: replay the requests through the allocator model
    /// under the default sweep of settings ([`whatif`]).
    pub whatif: bool,
    /// The what-if's scenarios (`--conf`, each a list of
    /// `PYTORCH_CUDA_ALLOC_CONF` entries); empty: the default sweep.
    pub confs: Vec<Vec<String>>,
    /// A fleet's class model (`--classes`): every trace and unit gets a
    /// class ([`crate::analysis::classes`]).
    pub classes: Option<std::sync::Arc<crate::analysis::classes::Model>>,
}
