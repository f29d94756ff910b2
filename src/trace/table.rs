//! Parquet tables through arrow-rs: the typed columns fragscope writes
//! (`metrics.parquet`, the batch summary's parts) and reads back, and the
//! tolerant column conversions every reader of other producers' files
//! needs.
//!
//! The `parquet` crate already wrote the trace parts; since 2026-11-25 it
//! also reads everything (polars did, and compiled for 40 % of a fresh
//! build). Readers accept what other producers write: any integer width or
//! signedness where every value fits, text as plain, large or view
//! strings or as a dictionary of them.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use arrow_array::cast::AsArray;
use arrow_array::types::*;
use arrow_array::{Array, ArrayRef, ArrowPrimitiveType, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use parquet::file::reader::ChunkReader;

/// An integer type a column can be read as.
pub trait Integer: arrow_array::ArrowNativeTypeOp + std::fmt::Display {
    type Arrow: ArrowPrimitiveType<Native = Self>;
    const NAME: &'static str;
    fn from_i64(v: i64) -> Option<Self>;
    fn from_u64(v: u64) -> Option<Self>;
}

macro_rules! integer {
    ($t:ty, $arrow:ty) => {
        impl Integer for $t {
            type Arrow = $arrow;
            const NAME: &'static str = stringify!($t);
            fn from_i64(v: i64) -> Option<Self> {
                <$t>::try_from(v).ok()
            }
            fn from_u64(v: u64) -> Option<Self> {
                <$t>::try_from(v).ok()
            }
        }
    };
}
integer!(u64, UInt64Type);
integer!(u32, UInt32Type);
integer!(i64, Int64Type);
integer!(i32, Int32Type);

/// Writes the values of an integer column into `out` (as long as the
/// column), converting from any integer type where each value fits; nulls
/// become `null`, or are an error when `null` is `None`.
pub fn fill_integers<T: Integer>(array: &dyn Array, out: &mut [T], null: Option<T>, column: &str) -> Result<()> {
    debug_assert_eq!(array.len(), out.len());
    if array.null_count() > 0 && null.is_none() {
        bail!("column `{column}` has {} null values; it must not be null", array.null_count());
    }
    if array.data_type() == &T::Arrow::DATA_TYPE && array.null_count() == 0 {
        out.copy_from_slice(&array.as_primitive::<T::Arrow>().values()[..]);
        return Ok(());
    }
    fn convert<A: ArrowPrimitiveType, T: Integer>(
        array: &dyn Array,
        out: &mut [T],
        null: Option<T>,
        column: &str,
        to: impl Fn(A::Native) -> Option<T>,
    ) -> Result<()>
    where
        A::Native: std::fmt::Display,
    {
        let a = array.as_primitive::<A>();
        for (i, slot) in out.iter_mut().enumerate() {
            *slot = if a.is_null(i) {
                null.expect("checked above")
            } else {
                let v = a.value(i);
                match to(v) {
                    Some(x) => x,
                    None => bail!("column `{column}`: the value {v} does not fit {}", T::NAME),
                }
            };
        }
        Ok(())
    }
    match array.data_type() {
        DataType::Int8 => convert::<Int8Type, T>(array, out, null, column, |v| T::from_i64(v.into())),
        DataType::Int16 => convert::<Int16Type, T>(array, out, null, column, |v| T::from_i64(v.into())),
        DataType::Int32 => convert::<Int32Type, T>(array, out, null, column, |v| T::from_i64(v.into())),
        DataType::Int64 => convert::<Int64Type, T>(array, out, null, column, T::from_i64),
        DataType::UInt8 => convert::<UInt8Type, T>(array, out, null, column, |v| T::from_u64(v.into())),
        DataType::UInt16 => convert::<UInt16Type, T>(array, out, null, column, |v| T::from_u64(v.into())),
        DataType::UInt32 => convert::<UInt32Type, T>(array, out, null, column, |v| T::from_u64(v.into())),
        DataType::UInt64 => convert::<UInt64Type, T>(array, out, null, column, T::from_u64),
        other => bail!("column `{column}` is {other}, not an integer"),
    }
}

/// The values of an integer column, nulls as `None`.
pub fn integers<T: Integer + Default>(array: &dyn Array, column: &str) -> Result<Vec<Option<T>>> {
    let mut out = vec![T::default(); array.len()];
    fill_integers(array, &mut out, Some(T::default()), column)?;
    Ok(out.into_iter().enumerate().map(|(i, v)| array.is_valid(i).then_some(v)).collect())
}

/// The text of each row of a plain, large, view or dictionary string
/// column, through `f` (called once per distinct value of a dictionary).
pub fn map_texts<T: Clone>(array: &dyn Array, column: &str, f: impl Fn(&str) -> T) -> Result<Vec<Option<T>>> {
    let rows = |it: &mut dyn Iterator<Item = Option<&str>>| it.map(|v| v.map(&f)).collect();
    Ok(match array.data_type() {
        DataType::Utf8 => rows(&mut array.as_string::<i32>().iter()),
        DataType::LargeUtf8 => rows(&mut array.as_string::<i64>().iter()),
        DataType::Utf8View => rows(&mut array.as_string_view().iter()),
        DataType::Dictionary(..) => {
            let dict = array.as_any_dictionary();
            let values = map_texts(dict.values().as_ref(), column, f)?;
            let keys = dict.normalized_keys();
            (0..array.len())
                .map(|i| if array.is_valid(i) { values.get(keys[i]).cloned().flatten() } else { None })
                .collect()
        }
        other => bail!("column `{column}` is {other}, not text"),
    })
}

/// A whole Parquet file in memory, column by column (for the small tables:
/// metrics, summaries, stack tables, Nsight exports; the trace loader
/// streams its parts instead).
pub struct Table {
    shown: String,
    batch: RecordBatch,
}

impl Table {
    /// Reads a Parquet file; errors name it.
    pub fn open(path: &Path) -> Result<Table> {
        let shown = path.display().to_string();
        let file = std::fs::File::open(path).with_context(|| format!("cannot open {shown}"))?;
        Table::read(file, shown)
    }

    /// Reads Parquet bytes; `shown` names them in errors.
    pub fn from_bytes(bytes: Vec<u8>, shown: impl Into<String>) -> Result<Table> {
        Table::read(bytes::Bytes::from(bytes), shown.into())
    }

    fn read<R: ChunkReader + 'static>(reader: R, shown: String) -> Result<Table> {
        let batch = guarded(|| {
            let builder = ParquetRecordBatchReaderBuilder::try_new(reader)?;
            let schema = builder.schema().clone();
            let batches = builder.with_batch_size(1 << 16).build()?.collect::<Result<Vec<_>, _>>()?;
            Ok(arrow_select::concat::concat_batches(&schema, &batches)?)
        })
        .with_context(|| format!("{shown}: not a readable Parquet file"))?;
        Ok(Table { shown, batch })
    }

    /// A table of record batches already in memory; `shown` names it.
    pub fn from_batch(batch: RecordBatch, shown: impl Into<String>) -> Table {
        Table { shown: shown.into(), batch }
    }

    pub fn height(&self) -> usize {
        self.batch.num_rows()
    }

    pub fn has(&self, name: &str) -> bool {
        self.batch.column_by_name(name).is_some()
    }

    /// The names of the columns, in order.
    pub fn names(&self) -> Vec<String> {
        self.batch.schema().fields().iter().map(|f| f.name().clone()).collect()
    }

    pub fn column(&self, name: &str) -> Result<&ArrayRef> {
        self.batch.column_by_name(name).with_context(|| format!("{}: no column `{name}`", self.shown))
    }

    pub fn null_count(&self, name: &str) -> Result<usize> {
        Ok(self.column(name)?.null_count())
    }

    /// An integer column, nulls as `None`.
    pub fn ints<T: Integer + Default>(&self, name: &str) -> Result<Vec<Option<T>>> {
        integers(self.column(name)?.as_ref(), name).with_context(|| self.shown.clone())
    }

    /// A numeric column (floating point or integer) as `f64`, nulls as `None`.
    pub fn floats(&self, name: &str) -> Result<Vec<Option<f64>>> {
        let c = self.column(name)?;
        Ok(match c.data_type() {
            DataType::Float64 => c.as_primitive::<Float64Type>().iter().collect(),
            DataType::Float32 => c.as_primitive::<Float32Type>().iter().map(|v| v.map(f64::from)).collect(),
            t if t.is_signed_integer() => self.ints::<i64>(name)?.into_iter().map(|v| v.map(|v| v as f64)).collect(),
            t if t.is_integer() => self.ints::<u64>(name)?.into_iter().map(|v| v.map(|v| v as f64)).collect(),
            other => bail!("{}: column `{name}` is {other}, not a number", self.shown),
        })
    }

    /// A text column, nulls as `None`.
    pub fn texts(&self, name: &str) -> Result<Vec<Option<String>>> {
        map_texts(self.column(name)?.as_ref(), name, str::to_string).with_context(|| self.shown.clone())
    }

    /// A boolean column, nulls as `None`.
    pub fn bools(&self, name: &str) -> Result<Vec<Option<bool>>> {
        let c = self.column(name)?;
        match c.data_type() {
            DataType::Boolean => Ok(c.as_boolean().iter().collect()),
            other => bail!("{}: column `{name}` is {other}, not a boolean", self.shown),
        }
    }

    /// Any column of numbers, booleans or text as text, nulls as `None`
    /// (to print or compare whole rows).
    pub fn cells(&self, name: &str) -> Result<Vec<Option<String>>> {
        fn text<T: ToString>(v: Vec<Option<T>>) -> Vec<Option<String>> {
            v.into_iter().map(|v| v.map(|v| v.to_string())).collect()
        }
        Ok(match self.column(name)?.data_type() {
            t if t.is_signed_integer() => text(self.ints::<i64>(name)?),
            t if t.is_integer() => text(self.ints::<u64>(name)?),
            t if t.is_floating() => text(self.floats(name)?),
            DataType::Boolean => text(self.bools(name)?),
            _ => self.texts(name)?,
        })
    }

    /// The table as one Arrow record batch.
    pub fn batch(&self) -> &RecordBatch {
        &self.batch
    }
}

/// Typed columns to write as one Parquet table. Every column is nullable,
/// as in the files polars wrote before.
#[derive(Default)]
pub struct Columns {
    fields: Vec<Field>,
    arrays: Vec<ArrayRef>,
}

impl Columns {
    pub fn new() -> Columns {
        Columns::default()
    }

    /// Adds a column (`UInt32Array::from(vec)`, `StringArray::from(…)`, …).
    pub fn push(&mut self, name: impl Into<String>, array: impl Array + 'static) -> &mut Columns {
        self.fields.push(Field::new(name, array.data_type().clone(), true));
        self.arrays.push(Arc::new(array));
        self
    }

    pub fn batch(&self) -> Result<RecordBatch> {
        Ok(RecordBatch::try_new(Arc::new(Schema::new(self.fields.clone())), self.arrays.clone())?)
    }

    /// The table as zstd-compressed Parquet.
    pub fn to_parquet(&self) -> Result<Vec<u8>> {
        let batch = self.batch()?;
        let props = WriterProperties::builder().set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?)).build();
        let mut buf = Vec::new();
        let mut writer = ArrowWriter::try_new(&mut buf, batch.schema(), Some(props))?;
        writer.write(&batch)?;
        writer.close()?;
        Ok(buf)
    }

    /// Writes the table to `path` through a temporary file, so that a
    /// failure never leaves a partial file under the final name.
    pub fn write(&self, path: &Path) -> Result<()> {
        let bytes = self.to_parquet().with_context(|| format!("cannot write {}", path.display()))?;
        crate::trace::write_atomic(path, &bytes)
    }
}

/// Panics to keep quiet about: while a [`guarded`] read runs, the panic
/// hook [`install_panic_hook`] sets prints nothing (the panic becomes an
/// error naming the file instead). Counted, since reads run on several
/// threads in a batch.
static QUIET_PANICS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Installs a panic hook that stays silent during `guarded` reads and
/// prints as usual otherwise. `main` calls it once.
pub fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if QUIET_PANICS.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            default(info);
        }
    }));
}

/// Runs a Parquet read, turning a panic into an error: polars' footer
/// reader panicked on some corrupt files (found by the corruption property
/// test); the `parquet` crate is kept under the same guard.
pub(crate) fn guarded<T>(read: impl FnOnce() -> Result<T>) -> Result<T> {
    use std::sync::atomic::Ordering;
    QUIET_PANICS.fetch_add(1, Ordering::SeqCst);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(read));
    QUIET_PANICS.fetch_sub(1, Ordering::SeqCst);
    result.unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown".into());
        bail!("the Parquet reader gave up on a corrupt file ({what})")
    })
}

#[cfg(test)]
mod tests {
    use arrow_array::{DictionaryArray, Int8Array, Int32Array, StringArray, UInt64Array};

    use super::*;

    #[test]
    fn integers_of_any_width_convert_where_they_fit() {
        let mut out = [0u32; 3];
        fill_integers(&Int32Array::from(vec![1, 2, 3]), &mut out, None, "pid").unwrap();
        assert_eq!(out, [1, 2, 3]);
        let err = fill_integers(&Int32Array::from(vec![1, -5, 3]), &mut out, None, "pid").unwrap_err();
        assert_eq!(err.to_string(), "column `pid`: the value -5 does not fit u32");
        let err = fill_integers(&UInt64Array::from(vec![1, 1 << 40, 3]), &mut out, None, "pid").unwrap_err();
        assert!(err.to_string().contains("1099511627776 does not fit u32"), "{err}");
        let nulls = Int8Array::from(vec![Some(1), None, Some(-1)]);
        let err = fill_integers(&nulls, &mut [0i32; 3], None, "ret").unwrap_err();
        assert_eq!(err.to_string(), "column `ret` has 1 null values; it must not be null");
        let mut out = [0i32; 3];
        fill_integers(&nulls, &mut out, Some(7), "ret").unwrap();
        assert_eq!(out, [1, 7, -1]);
        assert_eq!(integers::<i64>(&nulls, "ret").unwrap(), vec![Some(1), None, Some(-1)]);
        let err = fill_integers(&StringArray::from(vec!["a", "b", "c"]), &mut [0u64; 3], None, "addr").unwrap_err();
        assert_eq!(err.to_string(), "column `addr` is Utf8, not an integer");
    }

    #[test]
    fn text_of_every_string_encoding() {
        let plain = StringArray::from(vec![Some("alloc"), None, Some("free")]);
        let dict: DictionaryArray<Int8Type> = vec![Some("alloc"), None, Some("free")].into_iter().collect();
        for a in [&plain as &dyn Array, &dict] {
            assert_eq!(map_texts(a, "kind", str::len).unwrap(), vec![Some(5), None, Some(4)]);
        }
        assert!(map_texts(&Int32Array::from(vec![1]), "kind", str::len).is_err());
    }

    #[test]
    fn written_columns_read_back() {
        let mut c = Columns::new();
        c.push("a", arrow_array::UInt32Array::from(vec![1, 2]))
            .push("b", arrow_array::Float64Array::from(vec![Some(0.5), None]))
            .push("c", StringArray::from(vec![None, Some("x")]))
            .push("d", arrow_array::BooleanArray::from(vec![true, false]));
        let t = Table::from_bytes(c.to_parquet().unwrap(), "t").unwrap();
        assert_eq!(t.height(), 2);
        assert_eq!(t.names(), ["a", "b", "c", "d"]);
        assert_eq!(t.ints::<u64>("a").unwrap(), [Some(1), Some(2)]);
        assert_eq!(t.floats("a").unwrap(), [Some(1.0), Some(2.0)]);
        assert_eq!(t.floats("b").unwrap(), [Some(0.5), None]);
        assert_eq!(t.texts("c").unwrap(), [None, Some("x".to_string())]);
        assert_eq!(t.bools("d").unwrap(), [Some(true), Some(false)]);
        assert_eq!(t.column("e").unwrap_err().to_string(), "t: no column `e`");
        let err = Table::from_bytes(b"PAR1 not really".to_vec(), "bad.parquet").err().unwrap();
        assert!(format!("{err:#}").starts_with("bad.parquet: not a readable Parquet file"), "{err:#}");
    }
}
