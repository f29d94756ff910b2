//! What the input stage hands the analysis.

use crate::trace::Trace;
use crate::trace::event::Events;

/// A loaded input: the trace, its events sorted by time (symbolised stacks
/// in `trace.stacks` where recorded), and how many rows were out of time
/// order in the files.
#[derive(Debug)]
pub struct Loaded {
    pub trace: Trace,
    pub events: Events,
    pub out_of_order: u64,
}
