//! A checksum over each Parquet file fragscope writes, kept in the file's
//! own footer, so that damage after the write (a failing disk, a copy cut
//! short and patched up, a bit flipped in transit) is an error instead of
//! an analysis of wrong numbers.
//!
//! Why not Parquet's own page checksums: the `parquet` crate writes none
//! (its page writer leaves `crc` unset), and zstd decodes some damaged
//! pages without an error — a part with 100 bytes zeroed in its first
//! column was analysed to the end, with different scores.
//!
//! What it covers: every byte from the start of the file to the end of
//! the last row group (the magic, each page header and each page). The
//! page index and the footer come after; the footer is checked by parsing
//! it, as before. The footer's key-value metadata holds
//! `fragscope.data_crc32` = `"<bytes> <crc32 in hex>"`. A file without the
//! key (written before this, or by another tool) is read unchecked, and so
//! is one whose entry does not fit it (not written by the `parquet` crate,
//! or its row groups do not end at `<bytes>`): a tool that rewrites a
//! part may copy the footer's entries along (pyarrow 26 does not).
//! Cost: CRC-32 runs at several GB/s (`crc32fast`), a few milliseconds per
//! 10 M-event trace when it is written and again when it is opened.

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;

use parquet::arrow::ArrowWriter;
use parquet::file::metadata::{KeyValue, ParquetMetaData};

/// The footer key.
pub const KEY: &str = "fragscope.data_crc32";

/// A writer that counts and checksums the bytes on their way through.
pub struct Summed<W> {
    inner: W,
    hasher: crc32fast::Hasher,
    len: u64,
}

impl<W> Summed<W> {
    pub fn new(inner: W) -> Summed<W> {
        Summed { inner, hasher: crc32fast::Hasher::new(), len: 0 }
    }

    pub fn into_inner(self) -> W {
        self.inner
    }

    fn value(&self) -> String {
        format!("{} {:08x}", self.len, self.hasher.clone().finalize())
    }
}

impl<W: Write> Write for Summed<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes the buffered rows as the last row group and records the checksum
/// of everything written so far in the footer-to-be. Call it right before
/// closing the writer; no row may be written after it.
pub fn seal<W: Write + Send>(writer: &mut ArrowWriter<Summed<W>>) -> parquet::errors::Result<()> {
    writer.flush()?;
    // The writer buffers below its row groups: push those bytes through
    // `Summed` before reading its sum.
    writer.sync()?;
    let value = writer.inner().value();
    writer.append_key_value_metadata(KeyValue::new(KEY.to_string(), value));
    Ok(())
}

/// Checks `path` against the checksum in its footer `md`, when it has one.
/// The error says what is wrong, without the path (callers add it).
pub fn verify(path: &Path, md: &ParquetMetaData) -> Result<(), String> {
    let Some(value) = md
        .file_metadata()
        .key_value_metadata()
        .and_then(|kv| kv.iter().find(|kv| kv.key == KEY))
        .and_then(|kv| kv.value.as_deref())
    else {
        return Ok(());
    };
    let malformed = || format!("its footer's `{KEY}` entry is malformed ({value:?})");
    let (len, crc) = value.split_once(' ').ok_or_else(malformed)?;
    let len: u64 = len.parse().map_err(|_| malformed())?;
    let expected = u32::from_str_radix(crc, 16).map_err(|_| malformed())?;
    // A tool that rewrites a part (to filter rows, say) may copy the
    // footer's entries along: the entry then describes another file. It is
    // checked only where it fits this one: written by the `parquet` crate,
    // and covering exactly the row groups the footer lists.
    let data_end = md
        .row_groups()
        .iter()
        .flat_map(|rg| rg.columns())
        .map(|c| {
            let (start, n) = c.byte_range();
            start.saturating_add(n)
        })
        .max()
        .unwrap_or(4);
    let ours = md.file_metadata().created_by().is_some_and(|c| c.starts_with("parquet-rs"));
    if !ours || len != data_end {
        tracing::warn!(
            "{}: its `{KEY}` entry does not describe this file (rewritten by another tool?): read unchecked",
            path.display()
        );
        return Ok(());
    }
    let file = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut taken = file.take(len);
    let mut buf = vec![0u8; 1 << 18];
    let mut read = 0u64;
    loop {
        let n = taken.read(&mut buf).map_err(|e| format!("cannot read: {e}"))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        read += n as u64;
    }
    if read < len {
        return Err(format!("damaged: its footer says {len} bytes of data were written, the file has {read}"));
    }
    let actual = hasher.finalize();
    if actual != expected {
        return Err(format!(
            "damaged after it was written: its data's checksum is {actual:08x}, its footer recorded {expected:08x} \
             (a disk or copy error; the events in it cannot be trusted)"
        ));
    }
    Ok(())
}

/// Writes one record batch as a complete Parquet file: under a temporary
/// name, through a buffer (the writer emits many small pieces: page
/// headers, pages), renamed into place once its footer is written. The
/// footer holds the data's checksum ([`seal`]).
pub(crate) fn write_batch(
    path: &Path,
    batch: &arrow_array::RecordBatch,
    props: parquet::file::properties::WriterProperties,
) -> anyhow::Result<()> {
    write_batches(path, batch.schema(), props, std::iter::once(Ok(batch.clone())))
}

/// Writes `batches` (each of `schema`) as one Parquet file at `path`,
/// through `<path>.parquet.tmp` and a rename, with the checksum in its
/// footer. Rows go to the same row groups as one batch of them all would:
/// a producer can build its columns a slice at a time, and reuse the
/// memory of one slice for the next.
pub(crate) fn write_batches(
    path: &Path,
    schema: arrow_schema::SchemaRef,
    props: parquet::file::properties::WriterProperties,
    batches: impl IntoIterator<Item = anyhow::Result<arrow_array::RecordBatch>>,
) -> anyhow::Result<()> {
    let tmp = path.with_extension("parquet.tmp");
    let written = (|| -> anyhow::Result<()> {
        let file = std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        let mut writer = ArrowWriter::try_new(Summed::new(file), schema, Some(props))?;
        for batch in batches {
            writer.write(&batch?)?;
        }
        seal(&mut writer)?;
        writer.into_inner()?.into_inner().into_inner().map_err(|e| e.into_error())?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    })();
    if written.is_err() {
        // No half-written file left behind under the temporary name.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summed_counts_and_checksums_what_passes() {
        let mut s = Summed::new(Vec::new());
        s.write_all(b"hello ").unwrap();
        s.write_all(b"world").unwrap();
        assert_eq!(s.value(), format!("11 {:08x}", crc32fast::hash(b"hello world")));
        assert_eq!(s.into_inner(), b"hello world");
    }
}
