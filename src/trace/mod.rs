//! The trace on disk (SPEC §2): the contract between producers (`synth`,
//! `record`, `import`) and the analyser. A trace is a directory of
//! `events-NNNNN.parquet` parts, each a complete Parquet file, plus
//! `trace.json` ([`TraceMeta`]). [`TraceWriter`] writes one (arrow +
//! parquet, zstd); [`Trace::open`] validates one and [`Trace::load_events`]
//! reads its parts (the same crates, the parts spread over the cores).
//!
//! The files: [`meta`] (`trace.json`), [`writer`], [`reader`] (the
//! parts), [`stacks`] (the stack tables), [`table`] (the Parquet layer),
//! [`event`] (the columns in memory); this module opens a trace.

pub mod checksum;
pub mod column;
pub mod details;
pub mod event;
pub mod kernel_names;
mod meta;
mod reader;
pub mod stacks;
pub mod symbols;
pub mod table;
mod writer;

pub use table::install_panic_hook;

use std::fs::{self};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};

pub(crate) use self::meta::parse_meta;
use self::reader::{PartError, check_part, scan};
use crate::trace::event::Events;
pub use meta::{FORMAT_VERSION, META_FILE, Source, TraceMeta};
pub use stacks::{Frame, STACKS_FILE, Stacks, USTACKS_FILE, UstackFrame, read_stacks, read_ustacks, write_ustacks};
pub(crate) use writer::is_part_name;
pub use writer::{TraceWriter, discard, events_schema, write_atomic, write_dir_atomic};

/// A validated trace directory, ready to load. (Default: an empty trace
/// of no directory, for tests that need one with a few fields set.)
#[derive(Clone, Debug, Default)]
pub struct Trace {
    pub dir: PathBuf,
    pub name: String,
    /// `None` when `trace.json` is missing (a recorder killed before it
    /// could write it); the parts are still analysed.
    pub meta: Option<TraceMeta>,
    pub parts: Vec<PathBuf>,
    /// Parts left out, with the reason (only ever the last one, unfinished).
    pub skipped: Vec<(PathBuf, String)>,
    /// Every part has the PyTorch columns (`requested_size`, `stack_id`,
    /// `device_free`, `stream`), and `requested_size` is not null in every
    /// row group (by the Parquet statistics): they are worth reading.
    pub pytorch_columns: bool,
    /// Recorded with `record --stacks`: every part has `ustack_id`, the
    /// trace has `ustacks.parquet` (and no `stacks.parquet`). Loading symbolises those stacks into
    /// [`Trace::stacks`].
    pub ustack_ids: bool,
    /// When the directory (or snapshot file) was last modified, read once
    /// at open: the date of a trace whose `trace.json` has no start time.
    pub modified: Option<std::time::SystemTime>,
    /// A recording where a process made calls on several GPUs
    /// (`details.devices`): loading reads the `device` column too, so each
    /// (process, device) is replayed on its own ([`Trace::units`]).
    pub device_column: bool,
    /// The replay units that are one device of a process: unit id → (pid,
    /// device). Empty when every unit is a whole process (or a snapshot's
    /// device).
    pub units: std::collections::BTreeMap<u32, (u32, i32)>,
    /// The stack table, for traces that have one: a snapshot's, or the
    /// symbolised stacks of `record --stacks` once the events are loaded.
    pub stacks: Option<Arc<Stacks>>,
    /// The rows the parts' footers say they hold, read when the parts are
    /// checked (0 for a file imported in memory): what loading will hold.
    pub rows: u64,
}

impl Trace {
    /// Whether `dir` looks like a trace directory (has parts or trace.json).
    pub fn is_trace_dir(dir: &Path) -> bool {
        dir.join(META_FILE).is_file()
            || fs::read_dir(dir)
                .map(|rd| rd.filter_map(|e| e.ok()).any(|e| is_part_name(&e.file_name().to_string_lossy())))
                .unwrap_or(false)
    }

    /// Checks the directory, `trace.json`, and the footer and schema of
    /// every part. A last part without a valid footer is skipped with a
    /// warning (an interrupted recorder leaves one); any other bad part is
    /// an error naming it.
    pub fn open(dir: &Path) -> Result<Trace> {
        let md = fs::metadata(dir).with_context(|| format!("{}: no such trace", dir.display()))?;
        if !md.is_dir() {
            bail!(
                "{} is not a trace directory (expected a directory of events-NNNNN.parquet parts), and its \
                 content is none of the files fragscope imports: a PyTorch memory snapshot (a pickle of protocol 2 to 5, \
                 starting with the PROTO opcode 0x80), a PyTorch-profiler JSON trace or an Nsight Systems SQLite export, \
                 each also compressed with gzip or zstd",
                dir.display()
            );
        }
        let meta_path = dir.join(META_FILE);
        let meta = match fs::read(&meta_path) {
            Ok(bytes) => Some(parse_meta(&meta_path, &bytes)?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                return Err(e).with_context(|| format!("cannot read {}", meta_path.display()));
            }
        };
        let mut parts: Vec<PathBuf> = fs::read_dir(dir)
            .with_context(|| format!("cannot read {}", dir.display()))?
            .filter_map(|e| e.ok())
            .filter(|e| is_part_name(&e.file_name().to_string_lossy()))
            .map(|e| e.path())
            .collect();
        let number = |p: &PathBuf| {
            p.file_name()
                .and_then(|n| n.to_str()?.strip_prefix("events-")?.strip_suffix(".parquet")?.parse::<u64>().ok())
        };
        parts.sort_by_key(|p| number(p));
        if parts.is_empty() {
            bail!("{}: no events-NNNNN.parquet parts: not a trace, or an empty one", dir.display());
        }
        let name = |p: &PathBuf| p.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned());
        if let Some(odd) = parts.iter().find(|p| number(p).is_none()) {
            bail!("{}: {}: a part number too large to be one", dir.display(), name(odd));
        }
        if let Some(w) = parts.windows(2).find(|w| number(&w[0]) == number(&w[1])) {
            bail!("{}: {} and {} are the same part number twice", dir.display(), name(&w[0]), name(&w[1]));
        }
        // The parts are numbered from 0 without a gap, as many as
        // trace.json says: a missing one is lost data, not a shorter trace.
        if let Some(at) = (0..parts.len()).find(|&i| number(&parts[i]) != Some(i as u64)) {
            bail!(
                "{}: {} is missing (the parts are numbered from 0 without a gap; {} is next): part of the \
                 trace is lost",
                dir.display(),
                writer::part_name(at as u32),
                name(&parts[at])
            );
        }
        if let Some(m) = meta.as_ref().filter(|m| m.parts as usize > parts.len()) {
            bail!(
                "{}: trace.json says {} parts, the folder holds {} (events-00000 to {}): part of the trace is lost",
                dir.display(),
                m.parts,
                parts.len(),
                writer::part_name(parts.len() as u32 - 1)
            );
        }
        let mut skipped = Vec::new();
        let last = parts.len() - 1;
        let mut good = Vec::with_capacity(parts.len());
        let mut pytorch_columns = true;
        let mut requested = false;
        let mut ustack_column = true;
        let mut rows = 0u64;
        for (i, part) in parts.into_iter().enumerate() {
            match check_part(&part) {
                Ok(has) => {
                    rows = rows.saturating_add(has.rows);
                    pytorch_columns &= has.pytorch;
                    requested |= has.requested;
                    ustack_column &= has.ustack;
                    good.push(part)
                }
                Err(PartError::Footer(why)) if i == last => {
                    tracing::warn!(
                        "skipping {}: {why} (an interrupted recording leaves such a last part)",
                        part.display()
                    );
                    skipped.push((part, why));
                }
                Err(PartError::Footer(why)) => {
                    bail!("{}: not a valid Parquet file: {why}", part.display())
                }
                Err(PartError::Schema(why) | PartError::Damaged(why)) => bail!("{}: {why}", part.display()),
            }
        }
        if good.is_empty() {
            bail!("{}: no readable events part (the only part is unfinished)", dir.display());
        }
        let name = dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| dir.display().to_string());
        let stacks_path = dir.join(STACKS_FILE);
        let stacks = if stacks_path.is_file() { Some(Arc::new(read_stacks(&stacks_path)?)) } else { None };
        let ustack_ids = ustack_column && stacks.is_none() && dir.join(USTACKS_FILE).is_file();
        let modified = md.modified().ok();
        let device_column =
            meta.as_ref().and_then(|m| m.details.record()).is_some_and(|d| d.devices.values().any(|v| v.len() > 1));
        Ok(Trace {
            dir: dir.to_path_buf(),
            name,
            meta,
            parts: good,
            skipped,
            pytorch_columns: pytorch_columns && requested,
            ustack_ids,
            device_column,
            units: Default::default(),
            modified,
            stacks,
            rows,
        })
    }

    /// How a report names replay unit `id`: the number (a pid, or a
    /// snapshot's device), or "PID on GPU N" for a unit of [`Trace::units`].
    pub fn unit_label(&self, id: u32) -> String {
        unit_label(&self.units, id)
    }

    pub fn source(&self) -> Option<Source> {
        self.meta.as_ref().map(|m| m.source)
    }

    /// The recorded process of series `id`: its unit's process
    /// ([`Trace::units`]), the one process of a probed recording's
    /// allocator view (whose series is named by its device), or `id`
    /// itself. What the recording's maps are keyed by.
    pub fn process_of(&self, id: u32) -> u32 {
        if let Some(&(pid, _)) = self.units.get(&id) {
            return pid;
        }
        let probed = self.meta.as_ref().and_then(|m| m.details.snapshot()).and_then(|d| d.join.as_ref());
        match probed {
            Some(j) if j.probed && j.pids.len() == 1 => j.pids[0],
            _ => id,
        }
    }

    /// Reads the replay columns of every part (in parallel), maps
    /// `kind` to [`EventKind`] and sorts by time. Returns the events and the
    /// number of rows that were out of time order.
    pub fn load_events(&mut self) -> Result<(Events, u64)> {
        // Errors name the part at fault.
        let mut events = scan(&self.parts, self.rows, self.pytorch_columns, self.ustack_ids, self.device_column)?;
        let out_of_order = events.sort_by_time();
        if self.ustack_ids {
            let path = self.dir.join(USTACKS_FILE);
            let frames = read_ustacks(&path)?;
            let started = std::time::Instant::now();
            let table = symbols::stack_table(&self.dir, &frames, &events.pid, &mut events.stack);
            tracing::debug!(
                "{}: {} recorded stacks symbolised in {:.3} s",
                self.name,
                table.stacks.len(),
                started.elapsed().as_secs_f64()
            );
            self.stacks = Some(Arc::new(table));
        }
        Ok((events, out_of_order))
    }
}

/// [`Trace::unit_label`] from the units alone.
pub fn unit_label(units: &std::collections::BTreeMap<u32, (u32, i32)>, id: u32) -> String {
    match units.get(&id) {
        Some((pid, device)) => format!("{pid} on GPU {device}"),
        None => id.to_string(),
    }
}

#[cfg(test)]
mod tests;
