use super::checksum::{write_batch, write_batches};
use super::meta::*;
use super::stacks::*;
use super::writer::*;
use super::*;
use crate::trace::event::{Event, EventKind};
use anyhow::Result;
use arrow_array::{ArrayRef, Int32Array, RecordBatch, StringArray, UInt64Array};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ArrowReaderMetadata;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use std::fs::{self, File};
use std::path::Path;
use std::sync::Arc;

fn some_events(n: u64) -> Vec<Event> {
    (0..n)
        .map(|i| {
            let kind = if i % 2 == 0 { EventKind::Alloc } else { EventKind::Free };
            Event::new(1_000 + i * 10, 7 + (i % 3) as u32, kind, 0x7f00_0000_0000 + (i / 2) * 4096, 512 * (i % 5 + 1))
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
fn opening_a_trace_counts_the_rows_its_parts_announce() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("t");
    write(&dir, &some_events(4_321), false).unwrap();
    let t = Trace::open(&dir).unwrap();
    assert_eq!((t.parts.len(), t.rows), (5, 4_321), "what loading will hold, before it loads");
}

#[test]
fn a_part_written_a_slice_at_a_time_holds_the_rows_of_one_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let n = 2 * PART_SLICE + 123;
    let mut events = some_events(n as u64);
    // Calls that differ from slice to slice: each slice's dictionary has
    // its own names, in its own order.
    let names = ["cudaMalloc", "cudaFree", "cuMemAlloc_v2"];
    for (i, e) in events.iter_mut().enumerate() {
        e.cuda.call = (i % 7 != 0).then_some(names[(i / PART_SLICE + i % 2) % names.len()]);
        e.extra.requested = (i % 3 == 0).then_some(i as u64);
    }
    let path = tmp.path().join(part_name(0));
    write_part(&path, &events, 1).unwrap();
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(File::open(&path).unwrap())
        .unwrap()
        .build()
        .unwrap();
    let batches: Vec<RecordBatch> = reader.map(|b| b.unwrap()).collect();
    let read = arrow_select::concat::concat_batches(&events_schema(), &batches).unwrap();
    assert_eq!(read, part_batch(&events).unwrap());
    let meta = ArrowReaderMetadata::load(&File::open(&path).unwrap(), Default::default()).unwrap();
    assert_eq!(meta.metadata().num_row_groups(), 1, "one row group, as one batch of the rows makes");
}

#[test]
fn a_part_that_fails_midway_leaves_no_file() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(part_name(0));
    let events = some_events(10);
    let batches = [part_batch(&events), Err(anyhow::anyhow!("no more rows"))];
    let err = write_batches(&path, events_schema(), WriterProperties::default(), batches).unwrap_err();
    assert!(format!("{err:#}").contains("no more rows"), "{err:#}");
    let left: Vec<_> = fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "left behind: {left:?}");
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
    let props =
        WriterProperties::builder().set_statistics_enabled(parquet::file::properties::EnabledStatistics::None).build();
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

/// The recorded process of a series, which the recording's maps are keyed
/// by: a unit's process; the one process of a probed recording's view,
/// whose series is named by its device; else the series id itself.
#[test]
fn a_series_maps_to_its_recorded_process() {
    let mut t =
        Trace { dir: "t".into(), name: "t".into(), meta: Some(TraceMeta::new(Source::Ebpf)), ..Trace::default() };
    assert_eq!(t.process_of(4242), 4242);
    t.units.insert(1 << 30, (4242, 3));
    assert_eq!(t.process_of(1 << 30), 4242);
    let join = details::Join { pids: vec![777], probed: true, ..Default::default() };
    t.units.clear();
    t.meta.as_mut().unwrap().details = details::Details::Snapshot(Box::new(details::SnapshotDetails {
        join: Some(join.clone()),
        ..Default::default()
    }));
    assert_eq!(t.process_of(0), 777, "the probed view's device 0 is process 777's");
    // A snapshot joined with a recording, not probed: its devices are not
    // the recording's processes.
    let joined = details::Join { probed: false, ..join };
    t.meta.as_mut().unwrap().details =
        details::Details::Snapshot(Box::new(details::SnapshotDetails { join: Some(joined), ..Default::default() }));
    assert_eq!(t.process_of(0), 0);
}

#[test]
fn details_with_a_producers_field_must_read_as_that_producers() {
    let tmp = tempfile::tempdir().unwrap();
    let mut meta = TraceMeta::new(Source::Ebpf);
    meta.details = details::Details::Record(details::RecordDetails {
        reader: Some(details::ReaderStats { reads: 3, behind: 1, wakeups: 0 }),
        ..Default::default()
    });
    let good = serde_json::to_value(&meta).unwrap();
    let path = tmp.path().join(META_FILE);
    let read = |v: &serde_json::Value| parse_meta(&path, &serde_json::to_vec(v).unwrap());
    assert_eq!(read(&good).unwrap().details, meta.details);
    // One field of the wrong type: an error naming the file and the field,
    // not a foreign `details` that drops what a recording says.
    let mut bad = good.clone();
    bad["details"]["reader"]["reads"] = "many".into();
    let err = format!("{:#}", read(&bad).unwrap_err());
    for want in [path.to_str().unwrap(), "a recording's", "undecodable_records", "details.reader.reads", "\"many\""] {
        assert!(err.contains(want), "{want:?} not in {err}");
    }
    let mut bad = good.clone();
    bad["details"]["undecodable_records"] = (-1).into();
    let err = format!("{:#}", read(&bad).unwrap_err());
    assert!(err.contains("details.undecodable_records: invalid value"), "{err}");
    // The same details in a trace of another source are another
    // producer's: kept as they are.
    let mut foreign = bad.clone();
    foreign["source"] = "synthetic".into();
    assert_eq!(read(&foreign).unwrap().details, details::Details::Other(bad["details"].clone()));
    // Another producer's details, and none, are kept as they are.
    for other in [serde_json::json!({"scenario": "x", "reader": "free text"}), serde_json::Value::Null] {
        let mut v = good.clone();
        v["details"] = other.clone();
        assert_eq!(read(&v).unwrap().details, details::Details::Other(other));
    }
}

/// The parts come to the consumer in their order, however many are
/// decoded ahead; the rows read are the rows written.
#[test]
fn parts_are_handed_on_in_order_a_few_ahead() {
    let tmp = tempfile::tempdir().unwrap();
    let events = some_events(23_456);
    write(tmp.path(), &events, false).unwrap();
    let trace = Trace::open(tmp.path()).unwrap();
    assert_eq!(trace.parts.len(), 24);
    let names = ["ts_ns", "pid", "kind", "addr", "size", "ret"];
    let mut seen = Vec::new();
    let mut ts = Vec::new();
    reader::for_each_part(&trace.parts, &names, false, false, 1, |k, c| {
        seen.push(k);
        ts.extend(c.ts_ns);
        Ok(())
    })
    .unwrap();
    assert_eq!(seen, (0..24).collect::<Vec<_>>());
    assert_eq!(ts, events.iter().map(|e| e.ts_ns).collect::<Vec<_>>());
    let mut trace = trace;
    let (loaded, out_of_order) = trace.load_events().unwrap();
    assert_eq!((loaded.len(), out_of_order), (events.len(), 0));
    assert_eq!(loaded.addr, events.iter().map(|e| e.addr).collect::<Vec<_>>());
}

/// A damaged part in the middle is the error, named; the consumer's own
/// error stops the stream where it failed.
#[test]
fn the_first_part_at_fault_stops_the_stream() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), &some_events(9_000), false).unwrap();
    let trace = Trace::open(tmp.path()).unwrap();
    let names = ["ts_ns", "pid", "kind", "addr", "size", "ret"];
    // Part 5 replaced by garbage after the trace was opened.
    fs::write(&trace.parts[5], b"PAR1 not a parquet file PAR1").unwrap();
    let mut seen = Vec::new();
    let err = reader::for_each_part(&trace.parts, &names, false, false, 2, |k, _| {
        seen.push(k);
        Ok(())
    })
    .unwrap_err();
    assert_eq!(seen, vec![0, 1, 2, 3, 4]);
    assert!(format!("{err:#}").contains(&part_name(5)), "{err:#}");
    let mut seen = Vec::new();
    let err = reader::for_each_part(&trace.parts, &names, false, false, 2, |k, _| {
        seen.push(k);
        if k == 2 { anyhow::bail!("consumer gave up") } else { Ok(()) }
    })
    .unwrap_err();
    assert_eq!((seen, err.to_string()), (vec![0, 1, 2], "consumer gave up".to_string()));
}
