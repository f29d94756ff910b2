//! The trace on disk (SPEC §2): the contract between producers (`synth`,
//! `record`, `import`) and the analyser. A trace is a directory of
//! `events-NNNNN.parquet` parts, each a complete Parquet file, plus
//! `trace.json` ([`TraceMeta`]). [`TraceWriter`] writes one (arrow +
//! parquet, zstd); [`Trace::open`] validates one and [`Trace::load_events`]
//! reads its parts (the same crates, the parts spread over the cores).

pub mod checksum;
pub mod details;
pub mod event;
pub mod symbols;
pub mod table;

pub use table::install_panic_hook;
use table::guarded;

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use arrow_array::types::Int32Type;
use arrow_array::{ArrayRef, DictionaryArray, Int32Array, RecordBatch, StringArray, UInt32Array, UInt64Array};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ArrowReaderMetadata;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use serde::{Deserialize, Serialize};

use crate::trace::event::{Event, EventKind, Events, KindCounts};

/// Version of the on-disk format; bumped on incompatible changes.
pub const FORMAT_VERSION: u32 = 1;
pub const META_FILE: &str = "trace.json";

/// Where a trace came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    Ebpf,
    PytorchSnapshot,
    /// A PyTorch-profiler trace (`profile_memory=True`), imported.
    PytorchProfiler,
    /// An Nsight Systems SQLite export (`--cuda-memory-usage=true`), imported.
    NsightSystems,
    Synthetic,
    /// A `whatif` scenario: recorded requests placed by the allocator
    /// model under other settings.
    Simulated,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::Ebpf => "ebpf",
            Source::PytorchSnapshot => "pytorch-snapshot",
            Source::PytorchProfiler => "pytorch-profiler",
            Source::NsightSystems => "nsight-systems",
            Source::Synthetic => "synthetic",
            Source::Simulated => "simulated",
        }
    }
}

/// `trace.json`. Only `format_version` and `source` are required: every
/// other field may be missing (a trace written by another producer) and
/// then takes its default — empty text and lists, `null` for the optional
/// figures, 0 for counts, and no details. Unknown fields are ignored, so
/// older and newer producers stay readable.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceMeta {
    pub format_version: u32,
    /// The producer's version (default: empty).
    #[serde(default)]
    pub tool_version: String,
    pub source: Source,
    #[serde(default)]
    pub host: String,
    /// Wall-clock time of the first event, ns since the Unix epoch.
    #[serde(default)]
    pub start_wall_ns: Option<u64>,
    /// Add to `ts_ns` to get wall-clock ns since the epoch.
    #[serde(default)]
    pub mono_to_wall_offset_ns: Option<i64>,
    #[serde(default)]
    pub pids: Vec<u32>,
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default)]
    pub libraries: Vec<String>,
    #[serde(default)]
    pub event_counts: BTreeMap<String, u64>,
    #[serde(default)]
    pub lost_events: u64,
    /// Device memory capacity in bytes, when the producer knows it.
    #[serde(default)]
    pub capacity_bytes: Option<u64>,
    #[serde(default)]
    pub parts: u32,
    /// Producer-specific details.
    #[serde(default, serialize_with = "details::sorted")]
    pub details: details::Details,
}

impl TraceMeta {
    pub fn new(source: Source) -> TraceMeta {
        TraceMeta {
            format_version: FORMAT_VERSION,
            tool_version: env!("CARGO_PKG_VERSION").to_string(),
            source,
            host: fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default(),
            start_wall_ns: None,
            mono_to_wall_offset_ns: None,
            pids: Vec::new(),
            command: Vec::new(),
            libraries: Vec::new(),
            event_counts: BTreeMap::new(),
            lost_events: 0,
            capacity_bytes: None,
            parts: 0,
            details: details::Details::default(),
        }
    }
}

/// The Arrow schema of an events part: the public column contract.
pub fn events_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("ts_ns", DataType::UInt64, false),
        Field::new("duration_ns", DataType::UInt64, false),
        Field::new("pid", DataType::UInt32, false),
        Field::new("tid", DataType::UInt32, false),
        Field::new("kind", DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)), false),
        Field::new("addr", DataType::UInt64, false),
        Field::new("size", DataType::UInt64, false),
        Field::new("ret", DataType::Int32, false),
        Field::new("device", DataType::Int32, true),
        Field::new("stream", DataType::UInt64, true),
        Field::new("requested_size", DataType::UInt64, true),
        Field::new("stack_id", DataType::UInt32, true),
        Field::new("device_free", DataType::UInt64, true),
        // Recorded CUDA calls (`record`); null elsewhere.
        Field::new("call", DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)), true),
        Field::new("src", DataType::UInt64, true),
        Field::new("copy_kind", DataType::Int32, true),
        Field::new("handle", DataType::UInt64, true),
        Field::new("grid_x", DataType::UInt32, true),
        Field::new("grid_y", DataType::UInt32, true),
        Field::new("grid_z", DataType::UInt32, true),
        Field::new("block_x", DataType::UInt32, true),
        Field::new("block_y", DataType::UInt32, true),
        Field::new("block_z", DataType::UInt32, true),
        Field::new("shared_mem", DataType::UInt64, true),
        Field::new("ustack_id", DataType::UInt32, true),
    ]))
}

fn part_name(index: u32) -> String {
    format!("events-{index:05}.parquet")
}

/// Writes a trace directory part by part. Each part is a complete Parquet
/// file once its `rows_per_part` rows are in; `trace.json` is written last,
/// atomically, by [`TraceWriter::finish`].
pub struct TraceWriter {
    dir: PathBuf,
    meta: TraceMeta,
    rows_per_part: usize,
    buf: Vec<Event>,
    counts: KindCounts,
    pids: std::collections::BTreeSet<u32>,
    owner: Option<(u32, u32)>,
    zstd_level: i32,
    /// With [`TraceWriter::write_behind`]: the part being written on its
    /// own thread.
    behind: Option<Behind>,
}

/// The write-behind state: whether it is on, and the part in flight. One
/// part at most: two wrote the 220 MB benchmark snapshot's trace 7 %
/// faster, but with 20 % more peak RSS (above twice the file's size, the
/// import's memory target).
struct Behind {
    pending: Option<(PathBuf, std::thread::JoinHandle<Result<()>>)>,
    /// A part failed: no later part or `finish` may pretend otherwise.
    failed: bool,
}

/// A writer dropped on an error path still waits for its part, so that no
/// thread goes on writing into a directory its producer has given up.
impl Drop for Behind {
    fn drop(&mut self) {
        let _ = self.wait();
    }
}

impl Behind {
    /// Waits for the part in flight, with its error if it failed.
    fn wait(&mut self) -> Result<()> {
        let Some((path, handle)) = self.pending.take() else { return Ok(()) };
        let r = match handle.join() {
            Ok(r) => r.with_context(|| format!("cannot write {}", path.display())),
            Err(_) => Err(anyhow::anyhow!("the thread writing {} panicked", path.display())),
        };
        self.failed |= r.is_err();
        r
    }

    /// An error if a part waited for earlier failed.
    fn check(&self) -> Result<()> {
        if self.failed {
            bail!("an earlier part of this trace could not be written");
        }
        Ok(())
    }
}

impl TraceWriter {
    /// Creates `dir` (and parents). Refuses a directory that already holds
    /// a trace, so a second run never mixes parts of two recordings.
    pub fn create(dir: &Path, meta: TraceMeta, rows_per_part: usize) -> Result<TraceWriter> {
        fs::create_dir_all(dir).with_context(|| format!("cannot create trace directory {}", dir.display()))?;
        let occupied = fs::read_dir(dir)
            .with_context(|| format!("cannot read {}", dir.display()))?
            .filter_map(|e| e.ok())
            .any(|e| is_part_name(&e.file_name().to_string_lossy()) || e.file_name() == META_FILE);
        if occupied {
            bail!("{} already holds a trace; remove it or choose another output directory", dir.display());
        }
        Ok(TraceWriter {
            dir: dir.to_path_buf(),
            meta,
            rows_per_part: rows_per_part.max(1),
            buf: Vec::with_capacity(rows_per_part.clamp(1, 1 << 20)),
            counts: KindCounts::default(),
            pids: Default::default(),
            owner: None,
            zstd_level: 3,
            behind: None,
        })
    }

    /// Writes each part on a thread of its own while the producer goes on
    /// filling the next one (one part in flight, so one more part's rows
    /// in memory). A part's error comes back from the next
    /// [`TraceWriter::push`] that completes a part, or from
    /// [`TraceWriter::finish`]. For producers that are CPU-bound and not
    /// the recorder (whose parts must be on disk when `flush_part`
    /// returns): `import` writes the parts of the 220 MB benchmark
    /// snapshot in the shadow of its conversion (BENCHMARKS.md).
    pub fn write_behind(&mut self) {
        self.behind.get_or_insert(Behind { pending: None, failed: false });
    }

    /// Gives the directory and every file written from now on to `uid:gid`
    /// (the invoking user of a recorder run through sudo).
    pub fn set_owner(&mut self, uid: u32, gid: u32) -> Result<()> {
        self.owner = Some((uid, gid));
        self.chown(&self.dir.clone())
    }

    /// Gives a file the producer wrote beside the parts to the owner set
    /// with [`TraceWriter::set_owner`], if any.
    pub fn chown(&self, path: &Path) -> Result<()> {
        give(path, self.owner)
    }

    /// zstd level of the parts (default 3). The recorder uses 1: its CPU
    /// time is taken from the machine the traced program runs on.
    pub fn set_zstd_level(&mut self, level: i32) {
        self.zstd_level = level;
    }

    /// The trace directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Rows pushed but not yet written as a part.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Mutable metadata, for producers that fill it as they go.
    pub fn meta_mut(&mut self) -> &mut TraceMeta {
        &mut self.meta
    }

    /// Writes the stack table (`stacks.parquet`) the events' `stack_id`
    /// refers to.
    pub fn write_stacks(&self, stacks: &Stacks) -> Result<()> {
        let path = self.dir.join(STACKS_FILE);
        write_stacks(&path, stacks).with_context(|| format!("cannot write {}", path.display()))
    }

    pub fn push(&mut self, e: Event) -> Result<()> {
        self.counts.add(Some(e.kind));
        self.pids.insert(e.pid);
        self.buf.push(e);
        if self.buf.len() >= self.rows_per_part {
            self.flush_part()?;
        }
        Ok(())
    }

    /// Writes the buffered rows as the next complete part.
    pub fn flush_part(&mut self) -> Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let path = self.dir.join(part_name(self.meta.parts));
        match &mut self.behind {
            Some(behind) => {
                behind.check()?;
                behind.wait()?;
                let capacity = self.buf.capacity();
                let rows = std::mem::replace(&mut self.buf, Vec::with_capacity(capacity));
                let (level, owner, at) = (self.zstd_level, self.owner, path.clone());
                let handle = std::thread::Builder::new()
                    .name("fragscope-part".into())
                    .spawn(move || write_part(&at, &rows, level).and_then(|()| give(&at, owner)))
                    .context("cannot start a thread to write a trace part")?;
                behind.pending = Some((path, handle));
            }
            None => {
                write_part(&path, &self.buf, self.zstd_level)
                    .with_context(|| format!("cannot write {}", path.display()))?;
                self.chown(&path)?;
                self.buf.clear();
            }
        }
        self.meta.parts += 1;
        Ok(())
    }

    /// Replaces the producer-specific details of `trace.json`.
    pub fn set_details(&mut self, details: details::Details) {
        self.meta.details = details;
    }

    /// Gives up: removes the parts written so far (and the directory when
    /// nothing else is in it), so no half trace is left behind.
    pub fn abandon(mut self) {
        if let Some(behind) = &mut self.behind {
            let _ = behind.wait();
        }
        for i in 0..self.meta.parts {
            let part = self.dir.join(part_name(i));
            let _ = fs::remove_file(part.with_extension("parquet.tmp"));
            let _ = fs::remove_file(part);
        }
        let _ = fs::remove_file(self.dir.join(STACKS_FILE));
        let _ = fs::remove_file(self.dir.join(META_FILE));
        let _ = fs::remove_dir(&self.dir);
    }

    /// Flushes the last part and writes `trace.json`. A writer that writes
    /// behind abandons the trace when this fails (its producer can make it
    /// again); the recorder's parts are kept, as they hold recorded data.
    pub fn finish(mut self) -> Result<TraceMeta> {
        match self.complete() {
            Ok(()) => Ok(self.meta),
            Err(e) => {
                if self.behind.is_some() {
                    self.abandon();
                }
                Err(e)
            }
        }
    }

    fn complete(&mut self) -> Result<()> {
        self.flush_part()?;
        if let Some(behind) = &mut self.behind {
            behind.wait()?;
            behind.check()?;
        }
        self.meta.event_counts = self.counts.by_name();
        self.meta.pids = self.pids.iter().copied().collect();
        let json = serde_json::to_vec_pretty(&self.meta)?;
        write_atomic(&self.dir.join(META_FILE), &json)?;
        self.chown(&self.dir.join(META_FILE))
    }
}

/// Gives `path` to `uid:gid` (see [`TraceWriter::set_owner`]), if an
/// owner is set.
fn give(path: &Path, owner: Option<(u32, u32)>) -> Result<()> {
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .with_context(|| format!("cannot give {} to uid {uid}", path.display()))?;
    }
    Ok(())
}

fn write_part(path: &Path, rows: &[Event], zstd_level: i32) -> Result<()> {
    // Dictionary encoding only where values repeat by design (kind, call):
    // interning every timestamp and address cost the recorder a third of
    // its CPU time and bought nothing zstd does not already do.
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(zstd_level)?))
        .set_dictionary_enabled(false)
        .set_column_dictionary_enabled("kind".into(), true)
        .set_column_dictionary_enabled("call".into(), true);
    write_batch(path, &part_batch(rows)?, props.build())
}

/// The rows of a part as one record batch of [`events_schema`].
fn part_batch(rows: &[Event]) -> Result<RecordBatch> {
    let dictionary: Arc<StringArray> = Arc::new(EventKind::ALL.iter().map(|k| Some(k.name())).collect());
    let keys = Int32Array::from_iter_values(rows.iter().map(|e| e.kind as i32));
    let kind = DictionaryArray::<Int32Type>::try_new(keys, dictionary)?;
    let mut columns: Vec<ArrayRef> = vec![
        Arc::new(UInt64Array::from_iter_values(rows.iter().map(|e| e.ts_ns))),
        Arc::new(UInt64Array::from_iter_values(rows.iter().map(|e| e.duration_ns))),
        Arc::new(UInt32Array::from_iter_values(rows.iter().map(|e| e.pid))),
        Arc::new(UInt32Array::from_iter_values(rows.iter().map(|e| e.tid))),
        Arc::new(kind),
        Arc::new(UInt64Array::from_iter_values(rows.iter().map(|e| e.addr))),
        Arc::new(UInt64Array::from_iter_values(rows.iter().map(|e| e.size))),
        Arc::new(Int32Array::from_iter_values(rows.iter().map(|e| e.ret))),
        Arc::new(Int32Array::from_iter(rows.iter().map(|e| e.device))),
        Arc::new(UInt64Array::from_iter(rows.iter().map(|e| e.stream))),
        Arc::new(UInt64Array::from_iter(rows.iter().map(|e| e.extra.requested))),
        Arc::new(UInt32Array::from_iter(rows.iter().map(|e| e.extra.stack))),
        Arc::new(UInt64Array::from_iter(rows.iter().map(|e| e.extra.device_free))),
        call_column(rows)?,
        Arc::new(UInt64Array::from_iter(rows.iter().map(|e| e.cuda.src))),
        Arc::new(Int32Array::from_iter(rows.iter().map(|e| e.cuda.copy_kind))),
        Arc::new(UInt64Array::from_iter(rows.iter().map(|e| e.cuda.handle))),
    ];
    let launch = |f: fn(&crate::trace::event::Launch) -> u32| -> ArrayRef {
        Arc::new(UInt32Array::from_iter(rows.iter().map(|e| e.cuda.launch.as_ref().map(f))))
    };
    columns.extend([
        launch(|l| l.grid[0]),
        launch(|l| l.grid[1]),
        launch(|l| l.grid[2]),
        launch(|l| l.block[0]),
        launch(|l| l.block[1]),
        launch(|l| l.block[2]),
    ]);
    columns.push(Arc::new(UInt64Array::from_iter(rows.iter().map(|e| e.cuda.launch.map(|l| l.shared_mem)))));
    columns.push(Arc::new(UInt32Array::from_iter(rows.iter().map(|e| e.cuda.ustack))));
    Ok(RecordBatch::try_new(events_schema(), columns)?)
}

/// Writes one record batch as a complete Parquet file: under a temporary
/// name, through a buffer (the writer emits many small pieces: page
/// headers, pages), renamed into place once its footer is written. The
/// footer holds the data's checksum ([`checksum`]).
fn write_batch(path: &Path, batch: &RecordBatch, props: WriterProperties) -> Result<()> {
    let tmp = path.with_extension("parquet.tmp");
    let file = std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
    let mut writer = ArrowWriter::try_new(checksum::Summed::new(file), batch.schema(), Some(props))?;
    writer.write(batch)?;
    checksum::seal(&mut writer)?;
    writer.into_inner()?.into_inner().into_inner().map_err(|e| e.into_error())?;
    fs::rename(&tmp, path)?;
    Ok(())
}

/// The `call` column: a dictionary of the distinct function names, found by
/// pointer (they are `&'static str`s from one table) rather than hashed per
/// row.
fn call_column(rows: &[Event]) -> Result<ArrayRef> {
    let mut names: Vec<&'static str> = Vec::new();
    let mut last: Option<(&'static str, i32)> = None;
    let keys = Int32Array::from_iter(rows.iter().map(|e| {
        let name = e.cuda.call?;
        if let Some((n, k)) = last
            && std::ptr::eq(n, name)
        {
            return Some(k);
        }
        let k = match names.iter().position(|n| std::ptr::eq(*n, name) || *n == name) {
            Some(k) => k,
            None => {
                names.push(name);
                names.len() - 1
            }
        } as i32;
        last = Some((name, k));
        Some(k)
    }));
    let values: Arc<StringArray> = Arc::new(names.iter().map(|n| Some(*n)).collect());
    Ok(Arc::new(DictionaryArray::<Int32Type>::try_new(keys, values)?))
}

/// File name of the user call stacks `record --stacks` captured.
pub const USTACKS_FILE: &str = "ustacks.parquet";

/// One frame of a recorded user stack: the stack `stack_id` (the events'
/// `ustack_id`) as process `pid` saw it, `depth` 0 innermost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UstackFrame {
    pub stack_id: u32,
    pub pid: u32,
    pub depth: u32,
    pub addr: u64,
}

/// Writes `ustacks.parquet` (complete, or not at all).
pub fn write_ustacks(path: &Path, frames: &[UstackFrame]) -> Result<()> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("stack_id", DataType::UInt32, false),
        Field::new("pid", DataType::UInt32, false),
        Field::new("depth", DataType::UInt32, false),
        Field::new("addr", DataType::UInt64, false),
    ]));
    let columns: Vec<ArrayRef> = vec![
        Arc::new(UInt32Array::from_iter_values(frames.iter().map(|f| f.stack_id))),
        Arc::new(UInt32Array::from_iter_values(frames.iter().map(|f| f.pid))),
        Arc::new(UInt32Array::from_iter_values(frames.iter().map(|f| f.depth))),
        Arc::new(UInt64Array::from_iter_values(frames.iter().map(|f| f.addr))),
    ];
    let batch = RecordBatch::try_new(schema, columns)?;
    write_batch(path, &batch, WriterProperties::default()).with_context(|| format!("cannot write {}", path.display()))
}

/// Reads `ustacks.parquet`.
pub fn read_ustacks(path: &Path) -> Result<Vec<UstackFrame>> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let md = ArrowReaderMetadata::load(&file, Default::default())
        .with_context(|| format!("{}: not a valid Parquet file", path.display()))?;
    checksum::verify(path, md.metadata()).map_err(|why| anyhow::anyhow!("{}: {why}", path.display()))?;
    drop(file);
    let table = crate::trace::table::Table::open(path)?;
    let (id, pid) = (table.ints::<u32>("stack_id")?, table.ints::<u32>("pid")?);
    let (depth, addr) = (table.ints::<u32>("depth")?, table.ints::<u64>("addr")?);
    Ok((0..table.height())
        .filter_map(|i| Some(UstackFrame { stack_id: id[i]?, pid: pid[i]?, depth: depth[i]?, addr: addr[i]? }))
        .collect())
}

/// File name of the stack table.
pub const STACKS_FILE: &str = "stacks.parquet";

/// One frame of a call stack, as PyTorch records it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frame {
    pub filename: String,
    pub line: i64,
    pub name: String,
}

/// The stack table of a trace: distinct frames, and stacks as lists of
/// frame indices, innermost frame first. On disk (`stacks.parquet`) one row
/// per (stack, depth): `stack_id, depth, filename, line, name`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stacks {
    pub frames: Vec<Frame>,
    pub stacks: Vec<Vec<u32>>,
}

impl Stacks {
    /// Frames of stack `id`, innermost first (empty for an unknown id).
    pub fn frames_of(&self, id: u32) -> impl Iterator<Item = &Frame> {
        self.stacks.get(id as usize).into_iter().flatten().filter_map(|&f| self.frames.get(f as usize))
    }
}

fn write_stacks(path: &Path, stacks: &Stacks) -> Result<()> {
    let rows = stacks.stacks.iter().enumerate().flat_map(|(id, s)| s.iter().enumerate().map(move |(d, &f)| (id, d, f)));
    let rows: Vec<(usize, usize, u32)> = rows.collect();
    let frame = |f: u32| &stacks.frames[f as usize];
    let schema = Arc::new(Schema::new(vec![
        Field::new("stack_id", DataType::UInt32, false),
        Field::new("depth", DataType::UInt32, false),
        Field::new("filename", DataType::Utf8, false),
        Field::new("line", DataType::Int64, false),
        Field::new("name", DataType::Utf8, false),
    ]));
    let columns: Vec<ArrayRef> = vec![
        Arc::new(UInt32Array::from_iter_values(rows.iter().map(|r| r.0 as u32))),
        Arc::new(UInt32Array::from_iter_values(rows.iter().map(|r| r.1 as u32))),
        Arc::new(StringArray::from_iter_values(rows.iter().map(|r| frame(r.2).filename.as_str()))),
        Arc::new(arrow_array::Int64Array::from_iter_values(rows.iter().map(|r| frame(r.2).line))),
        Arc::new(StringArray::from_iter_values(rows.iter().map(|r| frame(r.2).name.as_str()))),
    ];
    let batch = RecordBatch::try_new(schema, columns)?;
    let props = WriterProperties::builder().set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?)).build();
    write_batch(path, &batch, props)
}

/// Reads `stacks.parquet` back into a [`Stacks`].
pub fn read_stacks(path: &Path) -> Result<Stacks> {
    use arrow_array::Array;
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Int64Type, UInt32Type};
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let builder = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .with_context(|| format!("{}: not a valid Parquet file", path.display()))?;
    checksum::verify(path, builder.metadata()).map_err(|why| anyhow::anyhow!("{}: {why}", path.display()))?;
    let reader = builder.build().with_context(|| format!("{}: not a valid Parquet file", path.display()))?;
    let mut out = Stacks::default();
    let mut index: ahash::AHashMap<Frame, u32> = ahash::AHashMap::new();
    for batch in reader {
        let batch = batch.with_context(|| format!("{}: cannot read", path.display()))?;
        let column = |name: &str| {
            batch.column_by_name(name).cloned().with_context(|| format!("{}: no `{name}` column", path.display()))
        };
        let (id, line) = (column("stack_id")?, column("line")?);
        let (filename, name) = (column("filename")?, column("name")?);
        let bad = || anyhow::anyhow!("{}: a column has an unexpected type", path.display());
        let id = id.as_primitive_opt::<UInt32Type>().ok_or_else(bad)?;
        let line = line.as_primitive_opt::<Int64Type>().ok_or_else(bad)?;
        let filename = filename.as_string_opt::<i32>().ok_or_else(bad)?;
        let name = name.as_string_opt::<i32>().ok_or_else(bad)?;
        for i in 0..batch.num_rows() {
            if id.is_null(i) {
                bail!("{}: null stack_id in row {i}", path.display());
            }
            let frame =
                Frame { filename: filename.value(i).to_string(), line: line.value(i), name: name.value(i).to_string() };
            let next = out.frames.len() as u32;
            let f = *index.entry(frame.clone()).or_insert_with(|| {
                out.frames.push(frame);
                next
            });
            let sid = id.value(i) as usize;
            if sid > 50_000_000 {
                bail!("{}: stack_id {sid} is implausibly large", path.display());
            }
            if out.stacks.len() <= sid {
                out.stacks.resize(sid + 1, Vec::new());
            }
            out.stacks[sid].push(f);
        }
    }
    Ok(out)
}

/// Writes `bytes` to `path` through a temporary file and a rename, so the
/// file is either absent or complete.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_file_name(format!(
        ".{}.tmp",
        path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    ));
    fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

pub(crate) fn is_part_name(name: &str) -> bool {
    name.strip_prefix("events-")
        .and_then(|r| r.strip_suffix(".parquet"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A column the analyser needs, and the Arrow types it accepts.
struct Required {
    name: &'static str,
    what: &'static str,
    ok: fn(&DataType) -> bool,
}

fn is_integer(t: &DataType) -> bool {
    t.is_integer()
}

fn is_text(t: &DataType) -> bool {
    match t {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => true,
        DataType::Dictionary(k, v) => k.is_integer() && is_text(v),
        _ => false,
    }
}

const REQUIRED: &[Required] = &[
    Required { name: "ts_ns", what: "an integer (UInt64)", ok: is_integer },
    Required { name: "pid", what: "an integer (UInt32)", ok: is_integer },
    Required { name: "kind", what: "a string (Utf8 or dictionary)", ok: is_text },
    Required { name: "addr", what: "an integer (UInt64)", ok: is_integer },
    Required { name: "size", what: "an integer (UInt64)", ok: is_integer },
    Required { name: "ret", what: "an integer (Int32)", ok: is_integer },
];

/// A validated trace directory, ready to load.
#[derive(Clone, Debug)]
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
    /// The stack table, for traces that have one: a snapshot's, or the
    /// symbolised stacks of `record --stacks` once the events are loaded.
    pub stacks: Option<Arc<Stacks>>,
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
                 starting with the PROTO opcode 0x80), a PyTorch-profiler JSON trace or an Nsight Systems SQLite export",
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
        parts.sort();
        if parts.is_empty() {
            bail!("{}: no events-NNNNN.parquet parts: not a trace, or an empty one", dir.display());
        }
        let mut skipped = Vec::new();
        let last = parts.len() - 1;
        let mut good = Vec::with_capacity(parts.len());
        let mut pytorch_columns = true;
        let mut requested = false;
        let mut ustack_column = true;
        for (i, part) in parts.into_iter().enumerate() {
            match check_part(&part) {
                Ok(has) => {
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
        Ok(Trace {
            dir: dir.to_path_buf(),
            name,
            meta,
            parts: good,
            skipped,
            pytorch_columns: pytorch_columns && requested,
            ustack_ids,
            modified,
            stacks,
        })
    }

    pub fn source(&self) -> Option<Source> {
        self.meta.as_ref().map(|m| m.source)
    }

    /// Reads the replay columns of every part (in parallel), maps
    /// `kind` to [`EventKind`] and sorts by time. Returns the events and the
    /// number of rows that were out of time order.
    pub fn load_events(&mut self) -> Result<(Events, u64)> {
        // Errors name the part at fault.
        let mut events = scan(&self.parts, self.pytorch_columns, self.ustack_ids)?;
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

fn parse_meta(path: &Path, bytes: &[u8]) -> Result<TraceMeta> {
    let meta: TraceMeta =
        serde_json::from_slice(bytes).with_context(|| format!("{}: not a valid trace.json", path.display()))?;
    if meta.format_version > FORMAT_VERSION {
        bail!(
            "{}: trace format version {} is newer than this fragscope understands ({}); upgrade fragscope",
            path.display(),
            meta.format_version,
            FORMAT_VERSION
        );
    }
    Ok(meta)
}

enum PartError {
    Footer(String),
    Schema(String),
    /// Its data does not match its checksum: an error even for the last
    /// part, which an interrupted recorder leaves without a footer, never
    /// with a wrong checksum.
    Damaged(String),
}

/// The optional columns a part has.
#[derive(Clone, Copy)]
struct Optional {
    /// `requested_size`, `stack_id`, `device_free`, `stream`.
    pytorch: bool,
    /// Whether `requested_size` may hold a value: false only when the
    /// Parquet statistics of every row group say it is all null (as
    /// `synth` and the recorder write it), so that the four PyTorch
    /// columns need not be read at all (at 10 M events they are 330 MB of
    /// fresh memory, then dropped).
    requested: bool,
    /// `ustack_id` (`record --stacks`).
    ustack: bool,
}

/// Checks a part; returns the optional columns it has.
fn check_part(path: &Path) -> std::result::Result<Optional, PartError> {
    let file = File::open(path).map_err(|e| PartError::Footer(format!("cannot open: {e}")))?;
    let md = ArrowReaderMetadata::load(&file, Default::default()).map_err(|e| PartError::Footer(e.to_string()))?;
    checksum::verify(path, md.metadata()).map_err(PartError::Damaged)?;
    let schema = md.schema();
    for req in REQUIRED {
        match schema.field_with_name(req.name) {
            Err(_) => {
                return Err(PartError::Schema(format!(
                    "missing required column `{}` (a trace needs ts_ns, pid, kind, addr, size, ret)",
                    req.name
                )));
            }
            Ok(f) if !(req.ok)(f.data_type()) => {
                return Err(PartError::Schema(format!(
                    "column `{}` has type {}, expected {}",
                    req.name,
                    f.data_type(),
                    req.what
                )));
            }
            Ok(_) => {}
        }
    }
    let integer = |c: &str| schema.field_with_name(c).is_ok_and(|f| f.data_type().is_integer());
    let meta = md.metadata();
    let requested = match meta
        .file_metadata()
        .schema_descr()
        .columns()
        .iter()
        .position(|c| c.path().string() == PYTORCH_COLUMNS[0])
    {
        Some(i) => meta.row_groups().iter().any(|rg| {
            let nulls = rg.column(i).statistics().and_then(|s| s.null_count_opt());
            nulls.is_none_or(|n| (n as i64) < rg.num_rows())
        }),
        None => false,
    };
    Ok(Optional { pytorch: PYTORCH_COLUMNS.iter().all(|c| integer(c)), requested, ustack: integer("ustack_id") })
}

const PYTORCH_COLUMNS: [&str; 4] = ["requested_size", "stack_id", "device_free", "stream"];

fn scan(parts: &[PathBuf], pytorch_columns: bool, ustack_ids: bool) -> Result<Events> {
    let started = std::time::Instant::now();
    let mut names = vec!["ts_ns", "pid", "kind", "addr", "size", "ret"];
    if pytorch_columns {
        names.extend(PYTORCH_COLUMNS);
    }
    if ustack_ids {
        names.push("ustack_id");
    }
    // The parts spread over the cores, each decoded into columns of its
    // own that grow with the rows actually decoded (never allocated from
    // the row count a footer claims), then joined in part order.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(parts.len()).max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done = std::sync::Mutex::new(Vec::with_capacity(parts.len()));
    let work = || {
        while let Some(part) = parts.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
            let read = guarded(|| decode_part(part, &names, pytorch_columns, ustack_ids))
                .with_context(|| format!("{}: cannot read events", part.display()));
            done.lock().unwrap_or_else(|p| p.into_inner()).push((part, read));
        }
    };
    if threads == 1 {
        work();
    } else {
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(work);
            }
        });
    }
    let mut done = done.into_inner().unwrap_or_else(|p| p.into_inner());
    // Part order; the first part at fault, whatever the order the threads met them.
    done.sort_by_key(|d| d.0);
    let mut columns = Vec::with_capacity(done.len());
    for (_, read) in done {
        columns.push(read?);
    }
    if columns.is_empty() {
        bail!("a trace without parts");
    }
    let mut events = Events {
        ts_ns: join(&mut columns, |c| &mut c.ts_ns),
        pid: join(&mut columns, |c| &mut c.pid),
        kind: join(&mut columns, |c| &mut c.kind),
        addr: join(&mut columns, |c| &mut c.addr),
        size: join(&mut columns, |c| &mut c.size),
        ret: join(&mut columns, |c| &mut c.ret),
        requested: join(&mut columns, |c| &mut c.requested),
        stack: join(&mut columns, |c| &mut c.stack),
        device_free: join(&mut columns, |c| &mut c.device_free),
        stream: join(&mut columns, |c| &mut c.stream),
        ..Events::default()
    };
    tracing::debug!("parts decoded in {:.3} s", started.elapsed().as_secs_f64());
    if pytorch_columns && events.requested.iter().all(|&r| r == u64::MAX) {
        // Columns present but empty (synth writes nulls): not a PyTorch trace.
        events.requested.clear();
        events.device_free.clear();
        events.stream.clear();
        if !ustack_ids {
            events.stack.clear();
        }
    }
    Ok(events)
}

/// One column of every part, joined in order (moved, not copied, when
/// there is one part); each part's copy is freed as soon as it is joined.
fn join<T: Copy>(parts: &mut [PartColumns], column: impl Fn(&mut PartColumns) -> &mut Vec<T>) -> Vec<T> {
    if let [one] = parts {
        return std::mem::take(column(one));
    }
    let mut out = Vec::with_capacity(parts.iter_mut().map(|p| column(p).len()).sum());
    for p in parts {
        out.extend_from_slice(&std::mem::take(column(p)));
    }
    out
}

/// The event columns of one part (the optional ones empty when not read).
#[derive(Default)]
struct PartColumns {
    ts_ns: Vec<u64>,
    pid: Vec<u32>,
    kind: Vec<Option<EventKind>>,
    addr: Vec<u64>,
    size: Vec<u64>,
    ret: Vec<i32>,
    requested: Vec<u64>,
    stack: Vec<u32>,
    device_free: Vec<u64>,
    stream: Vec<u64>,
}

/// Appends the values of an integer column to `out` (see
/// [`crate::trace::table::fill_integers`]).
fn append<T: crate::trace::table::Integer + Default>(
    array: &dyn arrow_array::Array,
    out: &mut Vec<T>,
    null: Option<T>,
    column: &str,
) -> Result<()> {
    let start = out.len();
    out.resize(start + array.len(), T::default());
    crate::trace::table::fill_integers(array, &mut out[start..], null, column)
}

/// Decodes one part's columns, converting integers that another producer
/// wrote narrower or signed where every value fits.
fn decode_part(part: &Path, names: &[&str], pytorch_columns: bool, ustack_ids: bool) -> Result<PartColumns> {
    use parquet::arrow::ProjectionMask;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    let file = File::open(part).context("cannot open it")?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).context("not a valid Parquet file")?;
    let mask = ProjectionMask::columns(builder.parquet_schema(), names.iter().copied());
    let reader = builder.with_projection(mask).with_batch_size(1 << 16).build()?;
    let no_stack = crate::trace::event::NO_STACK;
    let mut c = PartColumns::default();
    for batch in reader {
        let batch = batch?;
        let col =
            |name: &str| batch.column_by_name(name).map(|c| c.as_ref()).with_context(|| format!("no column `{name}`"));
        append(col("ts_ns")?, &mut c.ts_ns, None, "ts_ns")?;
        append(col("pid")?, &mut c.pid, None, "pid")?;
        let kinds = crate::trace::table::map_texts(col("kind")?, "kind", EventKind::from_name)?;
        c.kind.extend(kinds.into_iter().map(Option::flatten));
        append(col("addr")?, &mut c.addr, None, "addr")?;
        append(col("size")?, &mut c.size, None, "size")?;
        append(col("ret")?, &mut c.ret, None, "ret")?;
        if pytorch_columns {
            append(col("requested_size")?, &mut c.requested, Some(u64::MAX), "requested_size")?;
            if !ustack_ids {
                append(col("stack_id")?, &mut c.stack, Some(no_stack), "stack_id")?;
            }
            append(col("device_free")?, &mut c.device_free, Some(u64::MAX), "device_free")?;
            append(col("stream")?, &mut c.stream, Some(0), "stream")?;
        }
        if ustack_ids {
            // Recorded stack ids, per process; load_events turns them into
            // indices of the symbolised stack table.
            append(col("ustack_id")?, &mut c.stack, Some(no_stack), "ustack_id")?;
        }
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn some_events(n: u64) -> Vec<Event> {
        (0..n)
            .map(|i| {
                let kind = if i % 2 == 0 { EventKind::Alloc } else { EventKind::Free };
                Event::new(
                    1_000 + i * 10,
                    7 + (i % 3) as u32,
                    kind,
                    0x7f00_0000_0000 + (i / 2) * 4096,
                    512 * (i % 5 + 1),
                )
            })
            .collect()
    }

    fn write(dir: &Path, events: &[Event], behind: bool) -> Result<TraceMeta> {
        let mut w = TraceWriter::create(dir, TraceMeta::new(Source::Synthetic), 1000)?;
        if behind {
            w.write_behind();
        }
        for e in events {
            w.push(*e)?;
        }
        w.finish()
    }

    /// Writes `batch` as another producer would: a plain ArrowWriter, no
    /// temporary name, no checksum of ours.
    fn write_foreign(path: &Path, batch: &RecordBatch, props: Option<WriterProperties>) {
        let mut w = ArrowWriter::try_new(File::create(path).unwrap(), batch.schema(), props).unwrap();
        w.write(batch).unwrap();
        w.close().unwrap();
    }

    #[test]
    fn write_behind_writes_the_trace_a_plain_writer_writes() {
        let tmp = tempfile::tempdir().unwrap();
        let events = some_events(4_321);
        let (a, b) = (tmp.path().join("plain"), tmp.path().join("behind"));
        let (ma, mb) = (write(&a, &events, false).unwrap(), write(&b, &events, true).unwrap());
        assert_eq!((ma.parts, &ma.event_counts, &ma.pids), (5, &mb.event_counts, &mb.pids));
        assert_eq!(mb.parts, 5);
        for i in 0..5 {
            let name = part_name(i);
            assert_eq!(fs::read(a.join(&name)).unwrap(), fs::read(b.join(&name)).unwrap(), "{name}");
        }
    }

    #[test]
    fn all_null_pytorch_columns_are_not_read() {
        let tmp = tempfile::tempdir().unwrap();
        let mut events = some_events(3_000);
        let plain = tmp.path().join("plain");
        write(&plain, &events, false).unwrap();
        let mut t = Trace::open(&plain).unwrap();
        assert!(!t.pytorch_columns);
        assert!(t.load_events().unwrap().0.requested.is_empty());
        // One requested size in the last part is enough to read them all.
        events[2_999].extra.requested = Some(4096);
        let one = tmp.path().join("one");
        write(&one, &events, false).unwrap();
        let mut t = Trace::open(&one).unwrap();
        assert!(t.pytorch_columns);
        let (loaded, _) = t.load_events().unwrap();
        assert_eq!(loaded.requested.len(), 3_000);
        assert_eq!(loaded.requested.iter().filter(|&&r| r != u64::MAX).count(), 1);
        // A part without statistics may hold values: it is read.
        let bare = tmp.path().join("bare");
        fs::create_dir(&bare).unwrap();
        let props = WriterProperties::builder()
            .set_statistics_enabled(parquet::file::properties::EnabledStatistics::None)
            .build();
        write_batch(&bare.join(part_name(0)), &part_batch(&events).unwrap(), props).unwrap();
        let mut t = Trace::open(&bare).unwrap();
        assert!(t.pytorch_columns);
        assert_eq!(t.load_events().unwrap().0.requested.iter().filter(|&&r| r != u64::MAX).count(), 1);
    }

    #[test]
    fn a_part_that_fails_behind_fails_the_trace() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("t");
        let mut w = TraceWriter::create(&dir, TraceMeta::new(Source::Synthetic), 100).unwrap();
        w.write_behind();
        // The second part cannot be renamed into place: a directory has
        // its name.
        fs::create_dir(dir.join(part_name(1))).unwrap();
        let mut events = some_events(1_000).into_iter();
        let err = events.try_for_each(|e| w.push(e)).expect_err("part 1 cannot be written");
        assert!(format!("{err:#}").contains(&part_name(1)), "{err:#}");
        // A producer that goes on anyway is refused again, and finish
        // cleans up behind itself: no part, no trace.json.
        let again = events.try_for_each(|e| w.push(e)).expect_err("an earlier part failed");
        assert!(format!("{again:#}").contains("earlier part"), "{again:#}");
        let last = w.finish().expect_err("an earlier part failed");
        assert!(format!("{last:#}").contains("earlier part"), "{last:#}");
        assert!(!dir.join(part_name(0)).exists(), "part 0 left behind");
        assert!(!dir.join(META_FILE).exists());
    }

    /// Every Parquet file the writer makes carries its data's checksum,
    /// and a flipped bit anywhere in the data is an error naming the file.
    #[test]
    fn damaged_data_is_caught_by_the_checksum() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("t");
        write(&dir, &some_events(1_500), false).unwrap();
        let stacks = Stacks {
            frames: vec![Frame { filename: "train.py".into(), line: 3, name: "step".into() }],
            stacks: vec![vec![0, 0]],
        };
        write_stacks(&dir.join(STACKS_FILE), &stacks).unwrap();
        assert!(Trace::open(&dir).is_ok());
        for (name, rows) in [(part_name(0), 1_000), (part_name(1), 500), (STACKS_FILE.to_string(), 2)] {
            let path = dir.join(&name);
            let good = fs::read(&path).unwrap();
            let file = File::open(&path).unwrap();
            let md = ArrowReaderMetadata::load(&file, Default::default()).unwrap();
            assert_eq!(md.metadata().file_metadata().num_rows(), rows);
            let covered = md.metadata().row_groups()[0].columns().last().map(|c| {
                let (start, n) = c.byte_range();
                start + n
            });
            let covered = covered.unwrap() as usize;
            let entry =
                md.metadata().file_metadata().key_value_metadata().unwrap().iter().find(|kv| kv.key == checksum::KEY);
            assert!(entry.unwrap().value.as_ref().unwrap().starts_with(&format!("{covered} ")), "{name}");
            for at in [4, covered / 2, covered - 1] {
                let mut bad = good.clone();
                bad[at] ^= 0x10;
                fs::write(&path, &bad).unwrap();
                let err = format!("{:#}", Trace::open(&dir).expect_err("damaged data must be refused"));
                assert!(err.contains(&name) && err.contains("damaged after it was written"), "{name} @ {at}: {err}");
            }
            fs::write(&path, &good).unwrap();
        }
        assert!(Trace::open(&dir).is_ok());
    }

    /// A tool that rewrites a part may copy its footer's entries along: the
    /// copied checksum describes another file and must not refuse this one.
    #[test]
    fn a_checksum_copied_into_a_rewritten_file_is_ignored() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("t");
        let events = some_events(1_000);
        write(&dir, &events, false).unwrap();
        let path = dir.join(part_name(0));
        let md = ArrowReaderMetadata::load(&File::open(&path).unwrap(), Default::default()).unwrap();
        let copied = md.metadata().file_metadata().key_value_metadata().unwrap().clone();
        assert!(copied.iter().any(|kv| kv.key == checksum::KEY));
        // Fewer rows, the entries copied: by another writer, and by the
        // `parquet` crate.
        for created_by in ["parquet-cpp-arrow version 18.1.0", "parquet-rs version 60.1.0"] {
            let props = WriterProperties::builder()
                .set_created_by(created_by.into())
                .set_key_value_metadata(Some(copied.clone()))
                .build();
            write_foreign(&path, &part_batch(&events[..600]).unwrap(), Some(props));
            let mut t = Trace::open(&dir).unwrap_or_else(|e| panic!("{created_by}: {e:#}"));
            assert_eq!(t.load_events().unwrap().0.len(), 600, "{created_by}");
        }
    }

    /// A part rewritten by another tool, with narrower or signed integers
    /// and `kind` as plain text, loads beside the writer's own parts; a
    /// value that does not fit is an error naming the part.
    #[test]
    fn parts_of_other_producers_stack_with_ours() {
        use arrow_array::Int64Array;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("t");
        let events = some_events(1_500);
        write(&dir, &events, false).unwrap();
        let (want, _) = Trace::open(&dir).unwrap().load_events().unwrap();
        let rewrite = |pid0: i32| {
            let rows = &events[1_000..];
            let columns: Vec<(&str, ArrayRef)> = vec![
                ("ts_ns", Arc::new(Int64Array::from_iter_values(rows.iter().map(|e| e.ts_ns as i64)))),
                (
                    "pid",
                    Arc::new(Int32Array::from_iter_values(
                        rows.iter().enumerate().map(|(i, e)| if i == 0 { pid0 } else { e.pid as i32 }),
                    )),
                ),
                ("kind", Arc::new(StringArray::from_iter_values(rows.iter().map(|e| e.kind.name())))),
                ("addr", Arc::new(UInt64Array::from_iter_values(rows.iter().map(|e| e.addr)))),
                ("size", Arc::new(UInt64Array::from_iter_values(rows.iter().map(|e| e.size)))),
                ("ret", Arc::new(Int32Array::from_iter_values(rows.iter().map(|_| 0)))),
            ];
            write_foreign(&dir.join(part_name(1)), &RecordBatch::try_from_iter(columns).unwrap(), None);
        };
        rewrite(events[1_000].pid as i32);
        let (got, _) = Trace::open(&dir).unwrap().load_events().unwrap();
        assert_eq!((&got.ts_ns, &got.pid, &got.addr, &got.size), (&want.ts_ns, &want.pid, &want.addr, &want.size));
        assert_eq!(got.kind, want.kind);
        rewrite(-1);
        let err = format!("{:#}", Trace::open(&dir).unwrap().load_events().expect_err("pid -1 does not fit"));
        assert!(err.contains(&part_name(1)), "{err}");
        assert!(err.ends_with("column `pid`: the value -1 does not fit u32"), "{err}");
    }

    /// pyarrow writes Snappy by default, Spark and DuckDB other codecs:
    /// parts in each of Parquet's codecs load to the same events.
    #[test]
    fn parts_in_every_codec_load_alike() {
        use parquet::basic::{BrotliLevel, GzipLevel};
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("t");
        write(&dir, &some_events(1_500), false).unwrap();
        let (want, _) = Trace::open(&dir).unwrap().load_events().unwrap();
        let part = dir.join(part_name(0));
        let batch = crate::trace::table::Table::open(&part).unwrap().batch().clone();
        for codec in [
            Compression::UNCOMPRESSED,
            Compression::SNAPPY,
            Compression::GZIP(GzipLevel::default()),
            Compression::LZ4,
            Compression::LZ4_RAW,
            Compression::BROTLI(BrotliLevel::default()),
            Compression::ZSTD(ZstdLevel::default()),
        ] {
            write_foreign(&part, &batch, Some(WriterProperties::builder().set_compression(codec).build()));
            let (got, _) = Trace::open(&dir).unwrap().load_events().unwrap_or_else(|e| panic!("{codec}: {e:#}"));
            assert_eq!((&got.ts_ns, &got.pid, &got.addr, &got.size), (&want.ts_ns, &want.pid, &want.addr, &want.size));
            assert_eq!((&got.kind, &got.ret), (&want.kind, &want.ret), "{codec}");
        }
    }

    #[test]
    fn part_names() {
        assert!(is_part_name("events-00000.parquet"));
        assert!(is_part_name("events-12.parquet"));
        assert!(!is_part_name("events-.parquet"));
        assert!(!is_part_name("events-0a.parquet"));
        assert!(!is_part_name("events-00000.parquet.tmp"));
    }
}
