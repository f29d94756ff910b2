//! Invariants on random traces: the incremental replay equals a brute-force
//! recomputation at every instant, live bytes never go negative, and a trace
//! written and read back is identical.

use fragscope::analysis::metrics::{MetricsConfig, from_scratch};
use fragscope::analysis::replay::{Footprint, Replay};
use fragscope::trace::event::{Event, EventKind, Events};
use fragscope::trace::{Source, Trace, TraceMeta, TraceWriter};
use proptest::prelude::*;

/// Random alloc/free streams over two distant address windows and two
/// processes, with small sizes and close addresses so that overlaps, double
/// frees and unknown frees happen often.
fn ops() -> impl Strategy<Value = Vec<(bool, u32, u64, u64)>> {
    prop::collection::vec((any::<bool>(), 1u32..3, 0u64..96, 1u64..6), 1..160)
}

fn to_events(ops: &[(bool, u32, u64, u64)]) -> Vec<Event> {
    ops.iter()
        .enumerate()
        .map(|(i, &(is_alloc, pid, slot, units))| {
            // Two windows 1 TiB apart: two footprint regions at least.
            let window = if slot % 2 == 0 { 0x7f00_0000_0000 } else { 0x7f00_0000_0000 + (1 << 40) };
            let addr = window + (slot / 2) * 0x800;
            Event {
                ts_ns: i as u64 * 10,
                duration_ns: 0,
                pid,
                tid: pid,
                kind: if is_alloc { EventKind::Alloc } else { EventKind::Free },
                addr,
                size: if is_alloc { units * 0x500 } else { 0 },
                ret: 0,
                device: None,
                stream: None,
                extra: Default::default(),
                cuda: Default::default(),
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn incremental_metrics_equal_brute_force(ops in ops(), min_gap in prop::sample::select(vec![0u64, 1024, 4096])) {
        let list = to_events(&ops);
        let mut events = Events::default();
        list.iter().for_each(|e| events.push(e));
        let fp = Footprint::build(&events);
        let cfg = MetricsConfig { min_gap, ..MetricsConfig::default() };
        let mut replay = Replay::new(cfg, &fp);
        for e in &list {
            replay.apply(e);
            for pid in 1..3 {
                let fast = replay.metrics(pid);
                let blocks = replay.live_blocks(pid);
                let slow = from_scratch(&blocks, fp.regions(pid), &cfg);
                // Integers exactly; ratios up to float rounding.
                prop_assert_eq!(fast.live_bytes, slow.live_bytes);
                prop_assert_eq!(fast.live_blocks, slow.live_blocks);
                prop_assert_eq!(fast.gap_count, slow.gap_count);
                prop_assert_eq!(fast.largest_gap, slow.largest_gap);
                prop_assert_eq!(fast.span_bytes, slow.span_bytes);
                for (a, b) in [
                    (fast.external_fragmentation, slow.external_fragmentation),
                    (fast.kernel_unusable_index, slow.kernel_unusable_index),
                    (fast.small_alloc_ratio, slow.small_alloc_ratio),
                    (fast.size_cv, slow.size_cv),
                    (fast.large_gap_ratio, slow.large_gap_ratio),
                    (fast.utilization, slow.utilization),
                    (fast.score, slow.score),
                ] {
                    prop_assert!((a - b).abs() < 1e-9, "{a} vs {b}");
                }
                // Live blocks never overlap and live bytes are their sum.
                let sum: u64 = blocks.iter().map(|b| b.1).sum();
                prop_assert_eq!(sum, fast.live_bytes);
                prop_assert!(blocks.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0));
            }
        }
    }

    #[test]
    fn trace_round_trips(ops in ops(), rows_per_part in 1usize..50) {
        let list = to_events(&ops);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t");
        let mut w = TraceWriter::create(&path, TraceMeta::new(Source::Synthetic), rows_per_part).unwrap();
        for e in &list {
            w.push(*e).unwrap();
        }
        let meta = w.finish().unwrap();
        prop_assert_eq!(meta.parts as usize, list.len().div_ceil(rows_per_part));
        let mut trace = Trace::open(&path).unwrap();
        prop_assert_eq!(trace.meta.as_ref(), Some(&meta));
        let (loaded, out_of_order) = trace.load_events().unwrap();
        prop_assert_eq!(out_of_order, 0);
        let mut expected = Events::default();
        list.iter().for_each(|e| expected.push(e));
        prop_assert_eq!(loaded, expected);
    }
}

/// A naive model of the device view: a plain list of live blocks with the
/// same rules (an overlapping allocation evicts what it overlaps).
#[derive(Default)]
struct Model {
    live: std::collections::BTreeMap<(u32, u64), u64>,
    first_alloc: std::collections::HashMap<(u32, u64), u64>,
    overlap: u64,
    double_free: u64,
    unknown_free: u64,
}

impl Model {
    fn apply(&mut self, e: &Event) {
        match e.kind {
            EventKind::Alloc => {
                let end = e.addr + e.size;
                let hit: Vec<(u32, u64)> = self
                    .live
                    .iter()
                    .filter(|((pid, a), s)| *pid == e.pid && *a < end && *a + **s > e.addr)
                    .map(|(k, _)| *k)
                    .collect();
                self.overlap += u64::from(!hit.is_empty());
                for k in hit {
                    self.live.remove(&k);
                }
                self.live.insert((e.pid, e.addr), e.size);
                self.first_alloc.entry((e.pid, e.addr)).or_insert(e.ts_ns);
            }
            EventKind::Free => {
                if self.live.remove(&(e.pid, e.addr)).is_none() {
                    match self.first_alloc.get(&(e.pid, e.addr)) {
                        Some(&t) if t < e.ts_ns => self.double_free += 1,
                        _ => self.unknown_free += 1,
                    }
                }
            }
            _ => {}
        }
    }

    fn blocks(&self, pid: u32) -> Vec<(u64, u64)> {
        self.live.iter().filter(|((p, _), _)| *p == pid).map(|((_, a), s)| (*a, *s)).collect()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Rows only every `every` events, so blocks wait as pending and many
    /// die there: live set, metrics and anomalies still match the model.
    #[test]
    fn sparse_rows_match_a_naive_model(ops in ops(), every in 1usize..40) {
        let list = to_events(&ops);
        let mut events = Events::default();
        list.iter().for_each(|e| events.push(e));
        let fp = Footprint::build(&events);
        let cfg = MetricsConfig::default();
        let mut replay = Replay::new(cfg, &fp);
        let mut model = Model::default();
        for (i, e) in list.iter().enumerate() {
            replay.apply(e);
            model.apply(e);
            if i % every == every - 1 || i == list.len() - 1 {
                for pid in 1..3 {
                    let blocks = model.blocks(pid);
                    prop_assert_eq!(replay.live_blocks(pid), blocks.clone());
                    let fast = replay.metrics(pid);
                    let slow = from_scratch(&blocks, fp.regions(pid), &cfg);
                    prop_assert_eq!((fast.gap_count, fast.largest_gap, fast.span_bytes, fast.live_bytes),
                        (slow.gap_count, slow.largest_gap, slow.span_bytes, slow.live_bytes));
                    prop_assert!((fast.score - slow.score).abs() < 1e-9);
                }
            }
        }
        let a = replay.finish();
        prop_assert_eq!((a.overlap, a.double_free, a.unknown_free), (model.overlap, model.double_free, model.unknown_free));
    }
}

/// Allocator-view operations on four segment slots 1 MiB apart: cudaMalloc
/// segments, expandable ones grown and shrunk by mapping pages, and blocks
/// at random addresses (inside segments, outside them, overlapping).
#[derive(Clone, Debug)]
enum AllocOp {
    Segment { slot: u64, pages: u64 },
    SegmentFree { slot: u64 },
    Map { slot: u64, pages: u64 },
    Unmap { slot: u64, pages: u64 },
    Block { at: u64, units: u64 },
    Free { pick: usize },
}

fn alloc_ops() -> impl Strategy<Value = Vec<AllocOp>> {
    let op = prop_oneof![
        (0u64..4, 1u64..40).prop_map(|(slot, pages)| AllocOp::Segment { slot, pages }),
        (0u64..4).prop_map(|slot| AllocOp::SegmentFree { slot }),
        (0u64..4, 1u64..20).prop_map(|(slot, pages)| AllocOp::Map { slot, pages }),
        (0u64..4, 1u64..20).prop_map(|(slot, pages)| AllocOp::Unmap { slot, pages }),
        (0u64..1024, 1u64..64).prop_map(|(at, units)| AllocOp::Block { at, units }),
        (0u64..1024, 1u64..64).prop_map(|(at, units)| AllocOp::Block { at, units }),
        any::<usize>().prop_map(|pick| AllocOp::Free { pick }),
    ];
    prop::collection::vec(op, 1..200)
}

const SLOT: u64 = 1 << 20;
const PAGE: u64 = 4096;
const BASE: u64 = 0x7f00_0000_0000;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// The allocator view's incremental gaps, span and Σ(free range)² equal
    /// a recomputation from a naive model's segments and blocks after every
    /// event.
    #[test]
    fn allocator_view_equals_brute_force(ops in alloc_ops(), min_gap in prop::sample::select(vec![0u64, 1024])) {
        use std::collections::BTreeMap;
        let cfg = MetricsConfig { min_gap, ..MetricsConfig::default() };
        // The model: slot → (start, end, expandable); blocks by address.
        let mut segs: BTreeMap<u64, (u64, u64, bool)> = BTreeMap::new();
        let mut blocks: BTreeMap<u64, u64> = BTreeMap::new();
        let mut events = Vec::new();
        let mut ts = 0;
        let mut ev = |kind: EventKind, addr: u64, size: u64| {
            ts += 1;
            Event { ts_ns: ts, duration_ns: 0, pid: 0, tid: 0, kind, addr, size, ret: 0, device: Some(0), stream: Some(0),
                extra: fragscope::trace::event::Extra { requested: Some(size / 2 + 1), stack: None, device_free: None },
                cuda: Default::default() }
        };
        let mut list = Vec::new();
        for op in &ops {
            match *op {
                AllocOp::Segment { slot, pages } if !segs.contains_key(&slot) => {
                    let s = BASE + slot * SLOT;
                    segs.insert(slot, (s, s + pages * PAGE, false));
                    list.push(ev(EventKind::SegmentAlloc, s, pages * PAGE));
                }
                AllocOp::SegmentFree { slot } if segs.get(&slot).is_some_and(|x| !x.2) => {
                    let (s, e, _) = segs.remove(&slot).unwrap();
                    blocks.retain(|&a, _| !(s..e).contains(&a));
                    list.push(ev(EventKind::SegmentFree, s, e - s));
                }
                AllocOp::Map { slot, pages } => {
                    let s = BASE + slot * SLOT;
                    match segs.get_mut(&slot) {
                        None => {
                            segs.insert(slot, (s, s + pages * PAGE, true));
                            list.push(ev(EventKind::SegmentMap, s, pages * PAGE));
                        }
                        Some(x) if x.2 && x.1 + pages * PAGE <= s + SLOT - PAGE => {
                            let at = x.1;
                            x.1 += pages * PAGE;
                            list.push(ev(EventKind::SegmentMap, at, pages * PAGE));
                        }
                        _ => {}
                    }
                }
                AllocOp::Unmap { slot, pages } => {
                    if let Some(x) = segs.get_mut(&slot)
                        && x.2
                    {
                        let len = (pages * PAGE).min(x.1 - x.0);
                        let at = x.1 - len;
                        blocks.retain(|&a, _| !(at..x.1).contains(&a));
                        x.1 = at;
                        if x.1 == x.0 {
                            segs.remove(&slot);
                        }
                        list.push(ev(EventKind::SegmentUnmap, at, len));
                    }
                }
                AllocOp::Block { at, units } => {
                    let addr = BASE + at * 4096 + (at % 3) * 512;
                    let size = units * 1536;
                    let end = addr + size;
                    blocks.retain(|&a, &mut s| a + s <= addr || a >= end);
                    blocks.insert(addr, size);
                    list.push(ev(EventKind::BlockAlloc, addr, size));
                }
                AllocOp::Free { pick } if !blocks.is_empty() => {
                    let addr = *blocks.keys().nth(pick % blocks.len()).unwrap();
                    blocks.remove(&addr);
                    list.push(ev(EventKind::BlockFree, addr, 0));
                }
                _ => {}
            }
            let seg_list: Vec<(u64, u64)> = segs.values().map(|x| (x.0, x.1)).collect();
            let block_list: Vec<(u64, u64)> = blocks.iter().map(|(&a, &s)| (a, s)).collect();
            events.push((list.len(), seg_list, block_list));
        }
        let mut all = Events::default();
        list.iter().for_each(|e| all.push(e));
        let fp = Footprint::build(&all);
        let mut replay = Replay::allocator(cfg, &fp);
        let mut applied = 0;
        for (upto, seg_list, block_list) in &events {
            while applied < *upto {
                replay.apply(&list[applied]);
                applied += 1;
            }
            if applied == 0 {
                continue;
            }
            prop_assert_eq!(replay.live_blocks(0), block_list.clone());
            let fast = replay.metrics(0);
            let figures = replay.allocator_figures(0).unwrap();
            let (slow, free_sq) = fragscope::analysis::metrics::from_scratch_allocator(block_list, seg_list, &cfg);
            prop_assert_eq!((fast.gap_count, fast.largest_gap, fast.span_bytes, fast.live_bytes),
                (slow.gap_count, slow.largest_gap, slow.span_bytes, slow.live_bytes));
            prop_assert!((fast.score - slow.score).abs() < 1e-9, "{} vs {}", fast.score, slow.score);
            let span = slow.span_bytes as f64;
            let pt = if span == 0.0 { 0.0 } else { free_sq as f64 / (span * span) };
            prop_assert!((figures.pytorch_fragmentation - pt).abs() < 1e-12);
            let requested: u64 = block_list.iter().map(|b| b.1 / 2 + 1).sum();
            prop_assert_eq!(figures.requested_bytes, requested);
        }
    }
}

/// Damaged trace directories: `analyze` must end with 0 (it could read
/// what was left) or 1 with a message naming the trace, never a panic or a
/// signal, and an error must leave no report behind.
mod corruption {
    use std::fs;
    use std::path::{Path, PathBuf};
    use std::sync::OnceLock;

    use fragscope::trace::event::{CUDA_ERROR_OUT_OF_MEMORY, Event, EventKind};
    use std::sync::Arc;

    use arrow_array::cast::AsArray;
    use arrow_array::types::UInt64Type;
    use arrow_array::{ArrayRef, Float64Array, RecordBatch, StringArray, UInt32Array, UInt64Array};
    use arrow_schema::{Field, Schema};
    use fragscope::trace::table::Table;
    use fragscope::trace::{Source, TraceMeta, TraceWriter};
    use parquet::arrow::ArrowWriter;
    use proptest::prelude::*;

    /// Three parts of mixed events (allocations, frees, an OOM, launches)
    /// and a trace.json, written once.
    fn base() -> &'static Path {
        static DIR: OnceLock<PathBuf> = OnceLock::new();
        DIR.get_or_init(|| {
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("corruption-base");
            let _ = fs::remove_dir_all(&dir);
            let mut meta = TraceMeta::new(Source::Ebpf);
            meta.capacity_bytes = Some(1 << 30);
            let mut w = TraceWriter::create(&dir, meta, 150).unwrap();
            for i in 0..420u64 {
                let (kind, addr, size, ret) = match i % 7 {
                    0..=2 => (EventKind::Alloc, 0x7f00_0000_0000 + (i % 40) * 0x10_0000, 0x8_0000 + i * 512, 0),
                    3 | 4 => (EventKind::Free, 0x7f00_0000_0000 + ((i + 20) % 40) * 0x10_0000, 0, 0),
                    5 if i % 5 == 0 => (EventKind::Alloc, 0, 1 << 29, CUDA_ERROR_OUT_OF_MEMORY),
                    _ => (EventKind::Launch, 0x4000, 0, 0),
                };
                let pid = 1 + (i % 3) as u32;
                w.push(Event {
                    ts_ns: 1_000 + i * 997,
                    duration_ns: 5,
                    pid,
                    tid: pid,
                    kind,
                    addr,
                    size,
                    ret,
                    device: None,
                    stream: None,
                    extra: Default::default(),
                    cuda: Default::default(),
                })
                .unwrap();
            }
            w.finish().unwrap();
            dir
        })
    }

    const COLUMNS: &[&str] = &["ts_ns", "pid", "kind", "addr", "size", "ret", "duration_ns"];

    #[derive(Clone, Debug)]
    enum Damage {
        /// Flip bits at these fractions of one file (a part or trace.json).
        FlipBits(usize, Vec<(f64, u8)>),
        Truncate(usize, f64),
        /// A column rewritten as floats or as text.
        ColumnType(usize, usize, bool),
        /// Every k-th value of a column null.
        Nulls(usize, usize, usize),
        /// Sizes, addresses and times at the end of their range.
        Absurd(usize),
        /// Rows in a shuffled order, or every row twice.
        Shuffle(usize, u64),
        Duplicate(usize),
        /// trace.json replaced by one of several broken ones.
        Json(usize),
        /// Something that is not a part where parts live.
        Stray(usize),
    }

    fn damage() -> impl Strategy<Value = Damage> {
        prop_oneof![
            (0usize..4, prop::collection::vec((0.0f64..1.0, 0u8..8), 1..6)).prop_map(|(f, b)| Damage::FlipBits(f, b)),
            (0usize..4, 0.0f64..1.0).prop_map(|(f, k)| Damage::Truncate(f, k)),
            (0usize..3, 0..COLUMNS.len(), any::<bool>()).prop_map(|(p, c, t)| Damage::ColumnType(p, c, t)),
            (0usize..3, 0..COLUMNS.len(), 1usize..5).prop_map(|(p, c, k)| Damage::Nulls(p, c, k)),
            (0usize..3).prop_map(Damage::Absurd),
            (0usize..3, any::<u64>()).prop_map(|(p, s)| Damage::Shuffle(p, s)),
            (0usize..3).prop_map(Damage::Duplicate),
            (0usize..JSONS.len()).prop_map(Damage::Json),
            (0usize..STRAYS).prop_map(Damage::Stray),
        ]
    }

    const JSONS: &[&str] = &[
        "",
        "{",
        "[]",
        "null",
        r#"{"format_version": 1}"#,
        r#"{"source": "ebpf"}"#,
        r#"{"format_version": 99, "source": "ebpf"}"#,
        r#"{"format_version": "one", "source": "ebpf"}"#,
        r#"{"format_version": 1, "source": "martian"}"#,
        r#"{"format_version": 1, "source": "ebpf", "pids": "all", "lost_events": -3}"#,
        r#"{"format_version": 1, "source": "ebpf", "capacity_bytes": 18446744073709551615}"#,
        r#"{"format_version": 1, "source": "pytorch-snapshot", "details": {"totals": 5}}"#,
        "\u{feff}\u{0}\u{1}garbage",
    ];
    const STRAYS: usize = 6;

    fn files(dir: &Path) -> Vec<PathBuf> {
        let mut parts: Vec<PathBuf> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("events-"))
            .collect();
        parts.sort();
        parts.push(dir.join("trace.json"));
        parts
    }

    /// Rewrites a part through `f`; a part an earlier damage already made
    /// unreadable, or a change that does not apply to it, is left as it is.
    fn rewrite(part: &Path, f: impl FnOnce(RecordBatch) -> Option<RecordBatch>) {
        let Some(batch) = Table::open(part).ok().map(|t| t.batch().clone()).and_then(f) else {
            return;
        };
        let mut w = ArrowWriter::try_new(fs::File::create(part).unwrap(), batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
    }

    /// `batch` with column `name` replaced by `column` (its type may differ).
    fn with_column(batch: &RecordBatch, name: &str, column: ArrayRef) -> Option<RecordBatch> {
        let i = batch.schema().index_of(name).ok()?;
        let mut fields: Vec<Field> = batch.schema().fields().iter().map(|f| f.as_ref().clone()).collect();
        fields[i] = Field::new(name, column.data_type().clone(), true);
        let mut columns = batch.columns().to_vec();
        columns[i] = column;
        RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).ok()
    }

    /// The rows of `batch` at `rows` (a null index gives a null row).
    fn take_rows(batch: &RecordBatch, rows: Vec<Option<u32>>) -> Option<RecordBatch> {
        arrow_select::take::take_record_batch(batch, &UInt32Array::from(rows)).ok()
    }

    fn apply(dir: &Path, d: &Damage) {
        let files = files(dir);
        let part = |i: usize| &files[i % (files.len() - 1)];
        match d {
            Damage::FlipBits(f, at) => {
                let path = &files[f % files.len()];
                let mut b = fs::read(path).unwrap_or_default();
                if b.is_empty() {
                    return; // an earlier damage left nothing to flip
                }
                for &(frac, bit) in at {
                    let i = ((b.len() as f64 * frac) as usize).min(b.len() - 1);
                    b[i] ^= 1 << bit;
                }
                fs::write(path, b).unwrap();
            }
            Damage::Truncate(f, keep) => {
                let path = &files[f % files.len()];
                let b = fs::read(path).unwrap_or_default();
                if b.is_empty() {
                    return;
                }
                fs::write(path, &b[..(b.len() as f64 * keep) as usize]).unwrap();
            }
            Damage::ColumnType(p, c, text) => rewrite(part(*p), |batch| {
                let name = COLUMNS[*c];
                let table = Table::from_batch(batch.clone(), "part");
                let column: ArrayRef = if *text {
                    Arc::new(StringArray::from(table.cells(name).ok()?))
                } else {
                    Arc::new(Float64Array::from(table.floats(name).ok()?))
                };
                with_column(&batch, name, column)
            }),
            Damage::Nulls(p, c, k) => rewrite(part(*p), |batch| {
                let name = COLUMNS[*c];
                let column = batch.column_by_name(name)?;
                let keep: Vec<Option<u32>> =
                    (0..batch.num_rows() as u32).map(|i| (i as usize % k != 0).then_some(i)).collect();
                let nulled = arrow_select::take::take(column.as_ref(), &UInt32Array::from(keep), None).ok()?;
                with_column(&batch, name, nulled)
            }),
            Damage::Absurd(p) => rewrite(part(*p), |mut batch| {
                for (name, v) in [("size", u64::MAX), ("addr", u64::MAX - 7), ("ts_ns", u64::MAX)] {
                    let column = batch.column_by_name(name)?.as_primitive_opt::<UInt64Type>()?;
                    let values: UInt64Array =
                        column.iter().enumerate().map(|(i, x)| if i % 3 == 0 { Some(v) } else { x }).collect();
                    batch = with_column(&batch, name, Arc::new(values))?;
                }
                Some(batch)
            }),
            Damage::Shuffle(p, seed) => rewrite(part(*p), |batch| {
                let n = batch.num_rows() as u64;
                if n == 0 {
                    return Some(batch);
                }
                let idx =
                    (0..n).map(|i| Some(((i.wrapping_mul(seed | 1).wrapping_add(*seed >> 7)) % n) as u32)).collect();
                take_rows(&batch, idx)
            }),
            Damage::Duplicate(p) => rewrite(part(*p), |batch| {
                let n = batch.num_rows() as u32;
                take_rows(&batch, (0..n).chain(0..n).map(Some).collect())
            }),
            Damage::Json(j) => fs::write(dir.join("trace.json"), JSONS[*j]).unwrap(),
            Damage::Stray(k) => match k {
                0 => fs::write(dir.join("events-00007.parquet"), b"").unwrap(),
                1 => {
                    let _ = fs::create_dir(dir.join("events-00008.parquet"));
                }
                2 => fs::write(dir.join("events-00009.parquet"), b"PAR1 not really PAR1").unwrap(),
                3 => fs::write(dir.join("events-abc.parquet"), b"x").unwrap(),
                4 => fs::write(dir.join("stacks.parquet"), b"PAR1").unwrap(),
                _ => {
                    let _ = fs::create_dir(dir.join("maps"));
                    fs::write(dir.join("maps").join("1"), [0xff, 0xfe, 0x00]).unwrap();
                }
            },
        }
    }

    proptest! {
        // A fixed seed: CI runs the same 64 damaged traces every time (a
        // failure there is a finding to keep, not a roll of the dice).
        // FRAGSCOPE_CORRUPTION_SEED=N explores other ones locally.
        #![proptest_config(ProptestConfig {
            cases: 64,
            max_shrink_iters: 64,
            rng_seed: proptest::test_runner::RngSeed::Fixed(
                std::env::var("FRAGSCOPE_CORRUPTION_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(20261123),
            ),
            ..ProptestConfig::default()
        })]

        #[test]
        fn analyze_fails_cleanly_on_damaged_traces(damages in prop::collection::vec(damage(), 1..3), plots in any::<bool>()) {
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path().join("damaged-trace");
            fs::create_dir(&dir).unwrap();
            for f in files(base()) {
                fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
            }
            for d in &damages {
                apply(&dir, d);
            }
            let out = tmp.path().join("out");
            let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_fragscope"));
            cmd.arg("analyze").arg(&dir).arg("-o").arg(&out);
            if plots { cmd.args(["--size", "200x100"]); } else { cmd.arg("--no-plots"); }
            let o = cmd.output().unwrap();
            let stderr = String::from_utf8_lossy(&o.stderr);
            prop_assert!(!stderr.contains("panicked"), "{damages:?}: {stderr}");
            let code = o.status.code();
            prop_assert!(matches!(code, Some(0) | Some(1)), "{damages:?}: exit {code:?}: {stderr}");
            if code == Some(1) {
                prop_assert!(stderr.contains(&*dir.to_string_lossy()), "{damages:?}: the error names no file: {stderr}");
                prop_assert!(!out.join("report.md").exists(), "{damages:?}: a failed analysis left a report");
            } else {
                prop_assert!(out.join("report.md").is_file() && out.join("metrics.parquet").is_file());
            }
        }
    }
}
