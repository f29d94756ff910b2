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

pub(super) fn scan(parts: &[PathBuf], pytorch_columns: bool, ustack_ids: bool, device: bool) -> Result<Events> {
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
        device: join(&mut columns, |c| &mut c.device),
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
pub(super) fn join<T: Copy>(parts: &mut [PartColumns], column: impl Fn(&mut PartColumns) -> &mut Vec<T>) -> Vec<T> {
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
