//! Reading parts: the schema every part must have ([`REQUIRED`]), the
//! check of a part's footer and columns ([`check_part`]), and the scan that
//! decodes the parts on every core into [`Events`] columns ([`scan`]).

use super::checksum;
use super::table::guarded;
use crate::trace::event::{EventKind, Events};
use anyhow::{Context, Result, bail};
use arrow_schema::DataType;
use parquet::arrow::arrow_reader::ArrowReaderMetadata;
use std::fs::File;
use std::path::{Path, PathBuf};

/// A column the analyser needs, and the Arrow types it accepts.
pub(super) struct Required {
    pub(super) name: &'static str,
    pub(super) what: &'static str,
    pub(super) ok: fn(&DataType) -> bool,
}

pub(super) fn is_integer(t: &DataType) -> bool {
    t.is_integer()
}

pub(super) fn is_text(t: &DataType) -> bool {
    match t {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => true,
        DataType::Dictionary(k, v) => k.is_integer() && is_text(v),
        _ => false,
    }
}

pub(super) const REQUIRED: &[Required] = &[
    Required { name: "ts_ns", what: "an integer (UInt64)", ok: is_integer },
    Required { name: "pid", what: "an integer (UInt32)", ok: is_integer },
    Required { name: "kind", what: "a string (Utf8 or dictionary)", ok: is_text },
    Required { name: "addr", what: "an integer (UInt64)", ok: is_integer },
    Required { name: "size", what: "an integer (UInt64)", ok: is_integer },
    Required { name: "ret", what: "an integer (Int32)", ok: is_integer },
];

pub(super) enum PartError {
    Footer(String),
    Schema(String),
    /// Its data does not match its checksum: an error even for the last
    /// part, which an interrupted recorder leaves without a footer, never
    /// with a wrong checksum.
    Damaged(String),
}

/// The optional columns a part has.
#[derive(Clone, Copy)]
pub(super) struct Optional {
    /// `requested_size`, `stack_id`, `device_free`, `stream`.
    pub(super) pytorch: bool,
    /// Whether `requested_size` may hold a value: false only when the
    /// Parquet statistics of every row group say it is all null (as
    /// `synth` and the recorder write it), so that the four PyTorch
    /// columns need not be read at all (at 10 M events they are 330 MB of
    /// fresh memory, then dropped).
    pub(super) requested: bool,
    /// `ustack_id` (`record --stacks`).
    pub(super) ustack: bool,
    /// The rows its footer says it holds.
    pub(super) rows: u64,
}

/// Checks a part; returns the optional columns it has.
pub(super) fn check_part(path: &Path) -> std::result::Result<Optional, PartError> {
    // Only a regular file is a part (a FIFO would block the open), and a
    // part that cannot be opened is no interrupted write.
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => {}
        Ok(_) => return Err(PartError::Damaged("not a regular file".into())),
        Err(e) => return Err(PartError::Damaged(format!("cannot read: {e}"))),
    }
    let file = File::open(path).map_err(|e| PartError::Damaged(format!("cannot open: {e}")))?;
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
    Ok(Optional {
        pytorch: PYTORCH_COLUMNS.iter().all(|c| integer(c)),
        requested,
        ustack: integer("ustack_id"),
        rows: u64::try_from(meta.file_metadata().num_rows()).unwrap_or(0),
    })
}

pub(super) const PYTORCH_COLUMNS: [&str; 4] = ["requested_size", "stack_id", "device_free", "stream"];

/// Decodes `parts` in parallel and hands each part's columns to `consume`
/// on the calling thread, in part order: the one ordered stream of a
/// trace's events. At most `ahead` parts are decoded and not yet consumed
/// (workers wait for the consumer beyond that), so memory holds a few
/// parts, whatever the trace's length. The first error in part order is
/// returned, naming its part; no part after it is handed on (up to
/// `ahead` of them may have been decoded already).
pub(super) fn for_each_part(
    parts: &[PathBuf],
    names: &[&str],
    pytorch_columns: bool,
    ustack_ids: bool,
    ahead: usize,
    mut consume: impl FnMut(usize, PartColumns) -> Result<()>,
) -> Result<()> {
    use std::collections::BTreeMap;
    use std::sync::{Condvar, Mutex};

    struct Queue {
        /// The next part a worker takes.
        next: usize,
        /// Parts before this one have been handed on.
        consumed: usize,
        done: BTreeMap<usize, Result<PartColumns>>,
        /// The consumer failed: workers stop taking parts.
        stop: bool,
    }
    let ahead = ahead.max(1);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(parts.len()).max(1);
    let queue = Mutex::new(Queue { next: 0, consumed: 0, done: BTreeMap::new(), stop: false });
    let changed = Condvar::new();
    let lock = || queue.lock().unwrap_or_else(|p| p.into_inner());
    let work = || {
        loop {
            let i = {
                let mut q = lock();
                while !q.stop && q.next < parts.len() && q.next >= q.consumed.saturating_add(ahead) {
                    q = changed.wait(q).unwrap_or_else(|p| p.into_inner());
                }
                if q.stop || q.next >= parts.len() {
                    return;
                }
                q.next += 1;
                q.next - 1
            };
            let part = &parts[i];
            let read = guarded(|| decode_part(part, names, pytorch_columns, ustack_ids))
                .with_context(|| format!("{}: cannot read events", part.display()));
            lock().done.insert(i, read);
            changed.notify_all();
        }
    };
    /// Stops the workers when the consumer is done, fails or panics (a
    /// worker waiting for room would otherwise wait forever).
    struct Stop<'a>(&'a Mutex<Queue>, &'a Condvar);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.lock().unwrap_or_else(|p| p.into_inner()).stop = true;
            self.1.notify_all();
        }
    }
    std::thread::scope(|s| {
        // Made first: a thread that cannot be started must stop the others.
        let _stop = Stop(&queue, &changed);
        for _ in 0..threads {
            s.spawn(work);
        }
        for k in 0..parts.len() {
            let read = {
                let mut q = lock();
                loop {
                    if let Some(read) = q.done.remove(&k) {
                        q.consumed = k + 1;
                        break read;
                    }
                    q = changed.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            changed.notify_all();
            read.and_then(|columns| consume(k, columns))?;
        }
        Ok(())
    })
}

/// The parts' columns read into [`Events`], in part order (see
/// [`for_each_part`]). `rows` is what the footers announce: the columns
/// are reserved for that many once, so a long trace is never held twice
/// (per part and joined) nor grown by doubling. A footer that claims more
/// than memory can reserve costs nothing: the columns then grow with the
/// rows actually decoded.
pub(super) fn scan(
    parts: &[PathBuf],
    rows: u64,
    pytorch_columns: bool,
    ustack_ids: bool,
    device: bool,
) -> Result<Events> {
    let started = std::time::Instant::now();
    let mut names = vec!["ts_ns", "pid", "kind", "addr", "size", "ret"];
    if device {
        names.push("device");
    }
    if pytorch_columns {
        names.extend(PYTORCH_COLUMNS);
    }
    if ustack_ids {
        names.push("ustack_id");
    }
    if parts.is_empty() {
        bail!("a trace without parts");
    }
    let mut all = Events::default();
    let rows = usize::try_from(rows).unwrap_or(usize::MAX);
    if reserve(&mut all, rows, pytorch_columns, ustack_ids, device).is_err() {
        tracing::debug!("the footers' {rows} rows cannot be reserved at once: the columns grow as they are read");
        all = Events::default();
    }
    // Two parts ahead of the consumer for each core: the decoders never
    // wait for the copy, and memory holds a handful of parts.
    let ahead = 2 * std::thread::available_parallelism().map_or(1, |n| n.get());
    for_each_part(parts, &names, pytorch_columns, ustack_ids, ahead, |_, c| {
        c.append_to(&mut all);
        Ok(())
    })?;
    let mut events = all;
    tracing::debug!("parts decoded in {:.3} s", started.elapsed().as_secs_f64());
    if pytorch_columns && events.requested.iter().all(|&r| r == u64::MAX) {
        // Columns present but empty (synth writes nulls): not a PyTorch trace.
        events.requested = Vec::new();
        events.device_free = crate::trace::column::Sparse::new(u64::MAX);
        events.stream = Default::default();
        if !ustack_ids {
            events.stack = Vec::new();
        }
    }
    Ok(events)
}

/// The event columns of one part (the optional ones empty when not read).
#[derive(Default)]
pub(super) struct PartColumns {
    pub(super) ts_ns: Vec<u64>,
    pub(super) pid: Vec<u32>,
    pub(super) kind: Vec<Option<EventKind>>,
    pub(super) addr: Vec<u64>,
    pub(super) size: Vec<u64>,
    pub(super) ret: Vec<i32>,
    pub(super) requested: Vec<u64>,
    pub(super) stack: Vec<u32>,
    pub(super) device_free: Vec<u64>,
    pub(super) stream: Vec<u64>,
    pub(super) device: Vec<i32>,
}

impl PartColumns {
    /// Appends its rows to `all`.
    fn append_to(&self, all: &mut Events) {
        all.ts_ns.extend_from_slice(&self.ts_ns);
        all.pid.extend_from_slice(&self.pid);
        all.kind.extend_from_slice(&self.kind);
        all.addr.extend_from_slice(&self.addr);
        all.size.extend_from_slice(&self.size);
        all.ret.extend_from_slice(&self.ret);
        all.requested.extend_from_slice(&self.requested);
        all.stack.extend_from_slice(&self.stack);
        all.device_free.extend_from_slice(&self.device_free);
        all.stream.extend_from_slice(&self.stream);
        all.device.extend_from_slice(&self.device);
    }

    /// Room for `rows` rows in the columns that will be read.
    fn reserve(&mut self, rows: usize, pytorch: bool, ustack_ids: bool, device: bool) {
        fn room<T>(v: &mut Vec<T>, rows: usize) {
            let _ = v.try_reserve_exact(rows);
        }
        room(&mut self.ts_ns, rows);
        room(&mut self.pid, rows);
        room(&mut self.kind, rows);
        room(&mut self.addr, rows);
        room(&mut self.size, rows);
        room(&mut self.ret, rows);
        if pytorch {
            room(&mut self.requested, rows);
            room(&mut self.device_free, rows);
            room(&mut self.stream, rows);
        }
        if pytorch || ustack_ids {
            room(&mut self.stack, rows);
        }
        if device {
            room(&mut self.device, rows);
        }
    }
}

/// Room for `rows` rows in the columns of `all` that will be read: none of
/// them then grows by doubling.
fn reserve(
    all: &mut Events,
    rows: usize,
    pytorch: bool,
    ustack_ids: bool,
    device: bool,
) -> std::result::Result<(), std::collections::TryReserveError> {
    all.ts_ns.try_reserve_exact(rows)?;
    all.pid.try_reserve_exact(rows)?;
    all.kind.try_reserve_exact(rows)?;
    all.addr.try_reserve_exact(rows)?;
    all.size.try_reserve_exact(rows)?;
    all.ret.try_reserve_exact(rows)?;
    if pytorch {
        all.requested.try_reserve_exact(rows)?;
        all.device_free.try_reserve_exact(rows)?;
        all.stream.try_reserve_exact(rows)?;
    }
    if pytorch || ustack_ids {
        all.stack.try_reserve_exact(rows)?;
    }
    if device {
        all.device.try_reserve_exact(rows)?;
    }
    Ok(())
}

/// Appends the values of an integer column to `out` (see
/// [`crate::trace::table::fill_integers`]).
pub(super) fn append<T: crate::trace::table::Integer + Default>(
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
pub(super) fn decode_part(part: &Path, names: &[&str], pytorch_columns: bool, ustack_ids: bool) -> Result<PartColumns> {
    use parquet::arrow::ProjectionMask;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    let file = File::open(part).context("cannot open it")?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).context("not a valid Parquet file")?;
    let mask = ProjectionMask::columns(builder.parquet_schema(), names.iter().copied());
    // The footer's rows, reserved where memory allows (a part's columns
    // then never grow by doubling); they grow as decoded otherwise.
    let rows = usize::try_from(builder.metadata().file_metadata().num_rows()).unwrap_or(0);
    let reader = builder.with_projection(mask).with_batch_size(1 << 16).build()?;
    let no_stack = crate::trace::event::NO_STACK;
    let mut c = PartColumns::default();
    c.reserve(rows, pytorch_columns, ustack_ids, names.contains(&"device"));
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
        if let Some(d) = batch.column_by_name("device") {
            append(d.as_ref(), &mut c.device, Some(crate::trace::event::NO_DEVICE), "device")?;
        }
        if ustack_ids {
            // Recorded stack ids, per process; load_events turns them into
            // indices of the symbolised stack table.
            append(col("ustack_id")?, &mut c.stack, Some(no_stack), "ustack_id")?;
        }
    }
    Ok(c)
}
