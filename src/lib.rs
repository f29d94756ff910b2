//! fragscope: GPU memory fragmentation from allocation traces.
//!
//! The data flow is the architecture, one folder per stage, every import
//! pointing down:
//!
//! ```text
//! cli                      the clap types → each command's options
//! batch, whatif, classes   the drivers of `analyze` (one trace or many), `whatif` and `classes`
//! output                   reports, pictures, summaries, compare, export
//! analysis                 replay → metrics, iterations, forecasts, OOMs, leaks, what-if
//! input                    the one way in: classify a path once, load or convert it
//! allocator                the model of PyTorch's caching allocator (what-if, and
//!                          PyTorch's block sizes in a recording of its allocator)
//! import, record, synth    producers: other tools' files, eBPF, synthetic workloads
//! trace                    the trace on disk: events, trace.json, Parquet tables
//! store, units, exit, heap object storage, number formatting, exit codes, freed memory
//! ```

pub mod allocator;
pub mod analysis;
pub mod batch;
pub mod classes;
pub mod cli;
pub mod exit;
pub(crate) mod heap;
pub(crate) mod import;
pub mod input;
pub mod output;
#[cfg(feature = "record")]
pub(crate) mod record;
pub mod store;
pub(crate) mod synth;
pub mod trace;
pub(crate) mod units;
pub(crate) mod whatif;
