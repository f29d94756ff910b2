//! The stack tables beside the parts: a snapshot's frames
//! (`stacks.parquet`, [`Stacks`]) and the raw user stacks of
//! `record --stacks` (`ustacks.parquet`, [`UstackFrame`]).

use super::checksum::{self, write_batch};
use anyhow::{Context, Result, bail};
use arrow_array::{ArrayRef, RecordBatch, StringArray, UInt32Array, UInt64Array};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::arrow_reader::ArrowReaderMetadata;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

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

impl Frame {
    /// A frame of the program's Python code (a snapshot's), not a native
    /// one (a recording's).
    pub fn is_python(&self) -> bool {
        self.filename.ends_with(".py")
    }
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

pub(super) fn write_stacks(path: &Path, stacks: &Stacks) -> Result<()> {
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
