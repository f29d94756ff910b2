//! Nsight Systems exports (`nsys profile --cuda-memory-usage=true`, then
//! `nsys export --type sqlite`, or `--type parquetdir`) as fragscope
//! traces.
//!
//! Read: table `CUDA_GPU_MEMORY_USAGE_EVENTS` (`start` ns, `globalPid`,
//! `deviceId`, `address`, `bytes`, `memKind`, `memoryOperationType`, the
//! memory-pool columns), with the names of `memKind` and
//! `memoryOperationType` taken from the export's own enum tables
//! (`ENUM_CUDA_MEM_KIND`, `ENUM_CUDA_DEV_MEM_EVENT_OPER`), never from
//! hard-coded numbers. Kept: device memory — `alloc`/`free`, and
//! allocations from a memory pool (`localMemoryPoolAddress` set:
//! `cudaMallocAsync`) as `alloc_async`/`free_async`; managed memory as
//! `alloc_managed`. Host memory (pageable, pinned) and the other kinds
//! are skipped and counted by name. `globalPid` is Nsight's serialised id:
//! the process id is bits 24–47. `bytes` is positive for deallocations
//! too; the operation type tells them apart.
//!
//! SQLite is read with `rusqlite` and its bundled SQLite, so no system
//! library is needed. A `parquetdir` export is a folder with one
//! `<TABLE>.parquet` file per table (`CUDA_GPU_MEMORY_USAGE_EVENTS.parquet`,
//! `ENUM_CUDA_MEM_KIND.parquet`, …): the same tables and columns, read with
//! the `parquet` crate; a folder holding `CUDA_GPU_MEMORY_USAGE_EVENTS.parquet` is taken
//! for one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use arrow_array::Array;
use rusqlite::{Connection, OpenFlags};

use crate::trace::details::{Details, NsysDetails};
use crate::trace::event::{Event, EventKind};
use crate::trace::table::Table;

pub type Sink<'s> = &'s mut dyn FnMut(Event) -> Result<()>;

const TABLE: &str = "CUDA_GPU_MEMORY_USAGE_EVENTS";
const KIND_ENUM: &str = "ENUM_CUDA_MEM_KIND";
const OPER_ENUM: &str = "ENUM_CUDA_DEV_MEM_EVENT_OPER";

/// Whether a file's first bytes are an SQLite database's header.
pub fn head_is_sqlite(head: &[u8]) -> bool {
    head.starts_with(b"SQLite format 3\0")
}

/// The id → name table of an enum, or an error naming what is missing.
fn names(db: &Connection, path: &Path, table: &str) -> Result<BTreeMap<i64, String>> {
    let mut st = db.prepare(&format!("SELECT id, name FROM {table}")).with_context(|| {
        format!("{}: no table {table} (the enum names of {TABLE}): not an Nsight Systems export?", path.display())
    })?;
    let rows = st.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, Option<String>>(1)?.unwrap_or_default())))?;
    rows.collect::<rusqlite::Result<BTreeMap<_, _>>>()
        .with_context(|| format!("{}: cannot read {table}", path.display()))
}

/// What a memory kind becomes: the allocation and free kinds, or None
/// (skipped). Told by the enum's name (`CUDA_MEMOPR_MEMORY_KIND_DEVICE`, …).
fn kinds_of(name: &str, pooled: bool) -> Option<(EventKind, EventKind)> {
    let n = name.to_ascii_uppercase();
    if n.ends_with("_MANAGED") || n.ends_with("_MANAGED_STATIC") {
        Some((EventKind::AllocManaged, EventKind::Free))
    } else if n.ends_with("_DEVICE") || n.ends_with("_DEVICE_STATIC") {
        Some(if pooled { (EventKind::AllocAsync, EventKind::FreeAsync) } else { (EventKind::Alloc, EventKind::Free) })
    } else {
        None
    }
}

/// What a conversion found, besides the events it emitted.
#[derive(Debug)]
pub struct Converted {
    pub meta: crate::trace::TraceMeta,
}

/// One row of `CUDA_GPU_MEMORY_USAGE_EVENTS`, the columns read.
#[derive(Clone, Copy, Debug)]
struct Row {
    start: i64,
    global_pid: i64,
    device: i64,
    address: i64,
    bytes: i64,
    mem_kind: i64,
    operation: i64,
    /// `localMemoryPoolAddress` is set.
    pooled: bool,
}

/// Turns rows, in time order, into events: the same for both export kinds.
struct Converter<'a> {
    path: &'a Path,
    mem_kinds: BTreeMap<i64, String>,
    opers: BTreeMap<i64, String>,
    alloc_op: i64,
    free_op: i64,
    d: NsysDetails,
    skipped: BTreeMap<String, u64>,
    devices: std::collections::BTreeSet<i32>,
    /// The kind of each live allocation: its free has the same family.
    live: BTreeMap<(u32, u64), EventKind>,
}

impl<'a> Converter<'a> {
    fn new(
        path: &'a Path,
        file_bytes: u64,
        mem_kinds: BTreeMap<i64, String>,
        opers: BTreeMap<i64, String>,
    ) -> Result<Converter<'a>> {
        let oper = |want: &str| opers.iter().find(|(_, n)| n.to_ascii_uppercase().ends_with(want)).map(|(&id, _)| id);
        let (Some(alloc_op), Some(free_op)) = (oper("_ALLOCATION"), oper("_DEALLOCATION")) else {
            bail!("{}: {OPER_ENUM} names no ALLOCATION and DEALLOCATION operations: {opers:?}", path.display());
        };
        Ok(Converter {
            path,
            mem_kinds,
            opers,
            alloc_op,
            free_op,
            d: NsysDetails { nsys_export: path.display().to_string(), file_bytes, ..Default::default() },
            skipped: BTreeMap::new(),
            devices: Default::default(),
            live: BTreeMap::new(),
        })
    }

    fn row(&mut self, r: Row, sink: Sink<'_>) -> Result<()> {
        self.d.rows += 1;
        let kind_name = self.mem_kinds.get(&r.mem_kind).cloned().unwrap_or_else(|| format!("memKind {}", r.mem_kind));
        let Some((alloc_kind, free_kind)) = kinds_of(&kind_name, r.pooled) else {
            *self.skipped.entry(kind_name).or_default() += 1;
            return Ok(());
        };
        let pid = ((r.global_pid as u64 >> 24) & 0xff_ffff) as u32;
        let (ts, addr, size) = (r.start.max(0) as u64, r.address as u64, r.bytes.unsigned_abs());
        let event_kind = if r.operation == self.alloc_op {
            self.live.insert((pid, addr), alloc_kind);
            alloc_kind
        } else if r.operation == self.free_op {
            match self.live.remove(&(pid, addr)) {
                Some(EventKind::AllocAsync) => EventKind::FreeAsync,
                _ => free_kind,
            }
        } else {
            let name = self.opers.get(&r.operation).cloned().unwrap_or(r.operation.to_string());
            *self.skipped.entry(format!("operation {name}")).or_default() += 1;
            return Ok(());
        };
        self.d.pooled += u64::from(r.pooled && r.operation == self.alloc_op);
        self.devices.insert(r.device as i32);
        let mut e = Event::new(ts, pid, event_kind, addr, size);
        e.device = Some(r.device as i32);
        sink(e)?;
        self.d.device_events += 1;
        Ok(())
    }

    fn finish(self) -> Result<Converted> {
        let mut d = self.d;
        if d.device_events == 0 {
            bail!(
                "{}: {TABLE} has {} rows but no device-memory allocation or free (skipped: {:?})",
                self.path.display(),
                d.rows,
                self.skipped
            );
        }
        d.skipped = self.skipped;
        d.devices = self.devices.into_iter().collect();
        let mut meta = crate::trace::TraceMeta::new(crate::trace::Source::NsightSystems);
        meta.details = Details::Nsys(Box::new(d));
        Ok(Converted { meta })
    }
}

/// Reads the export (an SQLite file, or a `parquetdir` folder) and emits
/// its device-memory events in time order.
pub fn convert_file(path: &Path, sink: Sink<'_>) -> Result<Converted> {
    if path.is_dir() {
        return convert_parquetdir(path, sink);
    }
    let file_bytes = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?.len();
    let db = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .with_context(|| format!("{}: cannot open as SQLite", path.display()))?;
    let has_table: bool = db
        .query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1", [TABLE], |r| {
            r.get::<_, i64>(0)
        })
        .map(|n| n > 0)
        .with_context(|| format!("{}: not a readable SQLite database", path.display()))?;
    if !has_table {
        bail!(
            "{}: no table {TABLE}: record with `nsys profile --cuda-memory-usage=true` and export with `nsys export --type sqlite`",
            path.display()
        );
    }
    let mut c = Converter::new(path, file_bytes, names(&db, path, KIND_ENUM)?, names(&db, path, OPER_ENUM)?)?;
    let mut st = db
        .prepare(&format!(
            "SELECT start, globalPid, deviceId, address, bytes, memKind, memoryOperationType, \
             localMemoryPoolAddress IS NOT NULL FROM {TABLE} ORDER BY start, rowid"
        ))
        .with_context(|| format!("{}: {TABLE} lacks the columns of the published schema", path.display()))?;
    let mut rows = st.query([])?;
    let mut n = 0u64;
    while let Some(r) = rows.next().with_context(|| format!("{}: cannot read {TABLE}", path.display()))? {
        n += 1;
        let get = |i: usize| r.get::<_, i64>(i).with_context(|| format!("{}: {TABLE} row {n}", path.display()));
        let row = Row {
            start: get(0)?,
            global_pid: get(1)?,
            device: get(2)?,
            address: get(3)?,
            bytes: get(4)?,
            mem_kind: get(5)?,
            operation: get(6)?,
            pooled: r.get::<_, bool>(7).unwrap_or(false),
        };
        c.row(row, sink)?;
    }
    c.finish()
}

/// Whether `dir` is an Nsight Systems `parquetdir` export (`nsys export
/// --type parquetdir`: one `<TABLE>.parquet` file per table) holding the
/// memory-usage table.
pub fn looks_like_parquetdir(dir: &Path) -> bool {
    dir.is_dir() && dir.join(format!("{TABLE}.parquet")).is_file()
}

/// A table of a `parquetdir` export and its file's path, or an error
/// naming the missing file.
fn parquet_table(dir: &Path, table: &str, what: &str) -> Result<(Table, PathBuf)> {
    let path = dir.join(format!("{table}.parquet"));
    if !path.is_file() {
        bail!("{}: no {table}.parquet ({what}): not a complete `nsys export --type parquetdir`?", dir.display());
    }
    Ok((Table::open(&path)?, path))
}

/// An integer column of a `parquetdir` table, nulls as `None`.
fn int_column(df: &Table, path: &Path, name: &str) -> Result<Vec<Option<i64>>> {
    if !df.has(name) {
        bail!("{}: no column {name} (the published schema of {TABLE} has it)", path.display());
    }
    df.ints::<i64>(name)
}

/// The id → name table of an enum in a `parquetdir` export.
fn parquet_names(dir: &Path, table: &str) -> Result<BTreeMap<i64, String>> {
    let (df, path) = parquet_table(dir, table, &format!("the enum names of {TABLE}"))?;
    let ids = int_column(&df, &path, "id")?;
    let names = df.texts("name").with_context(|| format!("{}: no text column name", path.display()))?;
    Ok(ids.into_iter().zip(names).filter_map(|(id, name)| Some((id?, name.unwrap_or_default()))).collect())
}

/// A `parquetdir` export: the table is read whole (Parquet has no row
/// order to stream by time) and sorted stably by `start`, as the SQLite
/// reader's `ORDER BY start, rowid` does.
fn convert_parquetdir(dir: &Path, sink: Sink<'_>) -> Result<Converted> {
    let (df, path) =
        parquet_table(dir, TABLE, "the memory-usage events; record with `nsys profile --cuda-memory-usage=true`")?;
    let file_bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    let mut c = Converter::new(dir, file_bytes, parquet_names(dir, KIND_ENUM)?, parquet_names(dir, OPER_ENUM)?)?;
    let col = |name: &str| int_column(&df, &path, name);
    let (start, gpid, device, address, bytes, kind, op) = (
        col("start")?,
        col("globalPid")?,
        col("deviceId")?,
        col("address")?,
        col("bytes")?,
        col("memKind")?,
        col("memoryOperationType")?,
    );
    // Required, as the SQLite reader's query requires it: the published
    // schema has it, and without it pooled allocations would pass for
    // plain ones.
    let pooled: Vec<bool> = df
        .column("localMemoryPoolAddress")
        .map_err(|_| {
            anyhow::anyhow!(
                "{}: no column localMemoryPoolAddress (the published schema of {TABLE} has it)",
                path.display()
            )
        })
        .map(|c| (0..c.len()).map(|i| c.is_valid(i)).collect())?;
    let mut order: Vec<usize> = (0..df.height()).collect();
    order.sort_by_key(|&i| start[i]);
    for i in order {
        let need = |v: &[Option<i64>], name: &str| {
            v[i].with_context(|| format!("{}: row {} has no {name}", path.display(), i + 1))
        };
        let row = Row {
            start: need(&start, "start")?,
            global_pid: need(&gpid, "globalPid")?,
            device: need(&device, "deviceId")?,
            address: need(&address, "address")?,
            bytes: need(&bytes, "bytes")?,
            mem_kind: need(&kind, "memKind")?,
            operation: need(&op, "memoryOperationType")?,
            pooled: pooled[i],
        };
        c.row(row, sink)?;
    }
    c.finish()
}

/// `fragscope import` of an Nsight Systems export: writes the trace.
/// `origin`: the compressed file `path` was decompressed from, if any.
pub fn import(path: &Path, out: &Path, origin: Option<&crate::trace::details::CompressedOrigin>) -> Result<Converted> {
    let meta = super::import_file(path, out, crate::trace::Source::NsightSystems, origin, |p, sink| {
        Ok(convert_file(p, sink)?.meta)
    })?;
    Ok(Converted { meta })
}
