//! Nsight Systems exports (`nsys profile --cuda-memory-usage=true`, then
//! `nsys export --type sqlite`) as fragscope traces.
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
//! library is needed.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use rusqlite::{Connection, OpenFlags};

use crate::trace::details::{Details, NsysDetails};
use crate::trace::event::{Event, EventKind};

pub type Sink<'s> = &'s mut dyn FnMut(Event) -> Result<()>;

const TABLE: &str = "CUDA_GPU_MEMORY_USAGE_EVENTS";
const KIND_ENUM: &str = "ENUM_CUDA_MEM_KIND";
const OPER_ENUM: &str = "ENUM_CUDA_DEV_MEM_EVENT_OPER";

/// Whether `path` is an SQLite database (by its header).
pub fn looks_like_sqlite(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 16];
    path.is_file()
        && std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut head)).is_ok()
        && &head == b"SQLite format 3\0"
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

/// Reads the export and emits its device-memory events in time order.
pub fn convert_file(path: &Path, sink: Sink<'_>) -> Result<Converted> {
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
    let mem_kinds = names(&db, path, KIND_ENUM)?;
    let opers = names(&db, path, OPER_ENUM)?;
    let oper = |want: &str| opers.iter().find(|(_, n)| n.to_ascii_uppercase().ends_with(want)).map(|(&id, _)| id);
    let (Some(alloc_op), Some(free_op)) = (oper("_ALLOCATION"), oper("_DEALLOCATION")) else {
        bail!("{}: {OPER_ENUM} names no ALLOCATION and DEALLOCATION operations: {opers:?}", path.display());
    };
    let mut st = db
        .prepare(&format!(
            "SELECT start, globalPid, deviceId, address, bytes, memKind, memoryOperationType, \
             localMemoryPoolAddress IS NOT NULL FROM {TABLE} ORDER BY start, rowid"
        ))
        .with_context(|| format!("{}: {TABLE} lacks the columns of the published schema", path.display()))?;
    let mut rows = st.query([])?;
    let mut d = NsysDetails { nsys_export: path.display().to_string(), file_bytes, ..Default::default() };
    let mut skipped: BTreeMap<String, u64> = BTreeMap::new();
    let mut devices = std::collections::BTreeSet::new();
    // The kind of each live allocation: its free has the same family.
    let mut live: BTreeMap<(u32, u64), EventKind> = BTreeMap::new();
    while let Some(r) = rows.next().with_context(|| format!("{}: cannot read {TABLE}", path.display()))? {
        d.rows += 1;
        let get = |i: usize| r.get::<_, i64>(i).with_context(|| format!("{}: {TABLE} row {}", path.display(), d.rows));
        let (start, gpid, device, addr, bytes, kind, op) =
            (get(0)?, get(1)?, get(2)?, get(3)?, get(4)?, get(5)?, get(6)?);
        let pooled = r.get::<_, bool>(7).unwrap_or(false);
        let kind_name = mem_kinds.get(&kind).cloned().unwrap_or_else(|| format!("memKind {kind}"));
        let Some((alloc_kind, free_kind)) = kinds_of(&kind_name, pooled) else {
            *skipped.entry(kind_name).or_default() += 1;
            continue;
        };
        let pid = ((gpid as u64 >> 24) & 0xff_ffff) as u32;
        let (ts, addr, size) = (start.max(0) as u64, addr as u64, bytes.unsigned_abs());
        let event_kind = if op == alloc_op {
            live.insert((pid, addr), alloc_kind);
            alloc_kind
        } else if op == free_op {
            match live.remove(&(pid, addr)) {
                Some(EventKind::AllocAsync) => EventKind::FreeAsync,
                _ => free_kind,
            }
        } else {
            *skipped.entry(format!("operation {}", opers.get(&op).cloned().unwrap_or(op.to_string()))).or_default() +=
                1;
            continue;
        };
        d.pooled += u64::from(pooled && op == alloc_op);
        devices.insert(device as i32);
        let mut e = Event::new(ts, pid, event_kind, addr, size);
        e.device = Some(device as i32);
        sink(e)?;
        d.device_events += 1;
    }
    if d.device_events == 0 {
        bail!(
            "{}: {TABLE} has {} rows but no device-memory allocation or free (skipped: {skipped:?})",
            path.display(),
            d.rows
        );
    }
    d.skipped = skipped;
    d.devices = devices.into_iter().collect();
    let mut meta = crate::trace::TraceMeta::new(crate::trace::Source::NsightSystems);
    meta.details = Details::Nsys(Box::new(d));
    Ok(Converted { meta })
}

/// `fragscope import` of an Nsight Systems export: writes the trace.
pub fn import(path: &Path, out: &Path) -> Result<Converted> {
    let meta =
        super::import_file(path, out, crate::trace::Source::NsightSystems, |p, sink| Ok(convert_file(p, sink)?.meta))?;
    Ok(Converted { meta })
}
