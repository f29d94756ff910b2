//! fragscope's integration tests, in one binary (each test binary links
//! the whole library, so eight of them cost minutes of linking): the command line end
//! to end, batches and compare, what `analyze` reports, plots, property
//! tests, PyTorch snapshots, and `record` against ground truth.

mod common;

mod batch;
mod browser;
mod classes;
mod cli;
mod compare;
mod compressed;
mod diagnosis;
mod docs;
mod export;
mod html;
mod nsys;
mod outcomes;
mod plots;
mod profiler;
mod properties;
mod python;
mod record;
mod snapshots;
mod stages;
mod verdicts;
mod view;
