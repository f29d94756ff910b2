//! Writing a trace ([`TraceWriter`]): rows buffered into
//! `events-NNNNN.parquet` parts, each a complete Parquet file (arrow +
//! parquet, zstd), written behind the producer on a thread of its own, and
//! `trace.json` last.

use super::checksum::write_batches;
use super::details;
use super::meta::{META_FILE, TraceMeta};
use super::stacks::{STACKS_FILE, Stacks, write_stacks};
use crate::trace::event::{Event, EventKind, KindCounts};
use anyhow::{Context, Result, bail};
use arrow_array::types::Int32Type;
use arrow_array::{ArrayRef, DictionaryArray, Int32Array, RecordBatch, StringArray, UInt32Array, UInt64Array};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use std::fs::{self};
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
        Field::new("caller", DataType::UInt64, true),
    ]))
}

pub(super) fn part_name(index: u32) -> String {
    format!("events-{index:05}.parquet")
}

/// Writes a trace directory part by part. Each part is a complete Parquet
/// file once its `rows_per_part` rows are in; `trace.json` is written last,
/// atomically, by [`TraceWriter::finish`].
pub struct TraceWriter {
    pub(super) dir: PathBuf,
    pub(super) meta: TraceMeta,
    pub(super) rows_per_part: usize,
    pub(super) buf: Vec<Event>,
    pub(super) counts: KindCounts,
    pub(super) pids: std::collections::BTreeSet<u32>,
    pub(super) owner: Option<(u32, u32)>,
    pub(super) zstd_level: i32,
    /// With [`TraceWriter::write_behind`]: the part being written on its
    /// own thread.
    pub(super) behind: Option<Behind>,
}

/// The write-behind state: whether it is on, and the part in flight. One
/// part at most: two wrote the 220 MB benchmark snapshot's trace 7 %
/// faster, but with 20 % more peak RSS (above twice the file's size, the
/// import's memory target).
pub(super) struct Behind {
    pub(super) pending: Option<(PathBuf, std::thread::JoinHandle<Result<()>>)>,
    /// A part failed: no later part or `finish` may pretend otherwise.
    pub(super) failed: bool,
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
    pub(super) fn wait(&mut self) -> Result<()> {
        let Some((path, handle)) = self.pending.take() else { return Ok(()) };
        let r = match handle.join() {
            Ok(r) => r.with_context(|| format!("cannot write {}", path.display())),
            Err(_) => Err(anyhow::anyhow!("the thread writing {} panicked", path.display())),
        };
        self.failed |= r.is_err();
        r
    }

    /// An error if a part waited for earlier failed.
    pub(super) fn check(&self) -> Result<()> {
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
        // In time order within the part: a recording gets its events as
        // calls return (a call made inside another returns first), and a
        // call that never returned when its thread's next call begins.
        // Stable: rows of the same time keep their order.
        if !self.buf.is_sorted_by_key(|e| e.ts_ns) {
            self.buf.sort_by_key(|e| e.ts_ns);
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

    pub(super) fn complete(&mut self) -> Result<()> {
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
pub(super) fn give(path: &Path, owner: Option<(u32, u32)>) -> Result<()> {
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .with_context(|| format!("cannot give {} to uid {uid}", path.display()))?;
    }
    Ok(())
}

pub(super) fn write_part(path: &Path, rows: &[Event], zstd_level: i32) -> Result<()> {
    // Dictionary encoding only where values repeat by design (kind, call):
    // interning every timestamp and address cost the recorder a third of
    // its CPU time and bought nothing zstd does not already do.
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(zstd_level)?))
        .set_dictionary_enabled(false)
        .set_column_dictionary_enabled("kind".into(), true)
        .set_column_dictionary_enabled("call".into(), true);
    // A slice at a time: the columns of a whole part (tens of MiB) would
    // be fresh pages from the kernel, zeroed, for every part; a slice's fit
    // in the memory the allocator kept from the slice before.
    write_batches(path, events_schema(), props.build(), rows.chunks(PART_SLICE).map(part_batch))
}

/// Rows per record batch of a part (see [`write_part`]).
pub(super) const PART_SLICE: usize = 8192;

/// The rows of a part as one record batch of [`events_schema`].
pub(super) fn part_batch(rows: &[Event]) -> Result<RecordBatch> {
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
    columns.push(Arc::new(UInt64Array::from_iter(rows.iter().map(|e| e.cuda.caller))));
    Ok(RecordBatch::try_new(events_schema(), columns)?)
}

/// The `call` column: a dictionary of the distinct function names, found by
/// pointer (they are `&'static str`s from one table) rather than hashed per
/// row.
pub(super) fn call_column(rows: &[Event]) -> Result<ArrayRef> {
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

/// Writes `bytes` to `path` through a temporary file and a rename, so the
/// file is either absent or complete.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_file_name(format!(
        ".{}.tmp",
        path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    ));
    // A failed write (a full disk) leaves neither the file nor its
    // temporary.
    let written = fs::write(&tmp, bytes)
        .with_context(|| format!("cannot write {}", path.display()))
        .and_then(|()| fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display())));
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

/// Undoes a run that failed while writing into `dir`: removes the files
/// `names` it writes (a name that is a folder is left), and `dir` itself
/// when the run `created` it and it is empty.
pub fn discard(dir: &Path, names: &[&str], created: bool) {
    for name in names {
        let _ = fs::remove_file(dir.join(name));
    }
    if created {
        let _ = fs::remove_dir(dir);
    }
}

/// Fills the folder `path` through a sibling staging folder and a rename,
/// so the folder is either the old one or the new one, complete: `fill`
/// writes into the staging folder (which it must create), which is removed
/// if anything fails. An old folder is moved aside before the new one
/// takes its name, then removed.
pub fn write_dir_atomic<T>(path: &Path, fill: impl FnOnce(&Path) -> Result<T>) -> Result<T> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let (staging, old) = (path.with_file_name(format!(".{name}.partial")), path.with_file_name(format!(".{name}.old")));
    let remove = |dir: &Path| -> Result<()> {
        match fs::remove_dir_all(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(e).with_context(|| format!("cannot remove {}", dir.display()))
            }
            _ => Ok(()),
        }
    };
    remove(&staging)?;
    let written = fill(&staging).and_then(|value| {
        remove(&old)?;
        if path.exists() {
            fs::rename(path, &old).with_context(|| format!("cannot move the old {} aside", path.display()))?;
        }
        fs::rename(&staging, path).with_context(|| format!("cannot write {}", path.display()))?;
        remove(&old)?;
        Ok(value)
    });
    if written.is_err() {
        let _ = fs::remove_dir_all(&staging);
    }
    written
}

/// Whether `name` is a part's file name, `events-NNNNN.parquet`.
pub(crate) fn is_part_name(name: &str) -> bool {
    name.strip_prefix("events-")
        .and_then(|r| r.strip_suffix(".parquet"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}
