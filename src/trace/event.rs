//! Events: the vocabulary shared by every producer (`synth`, `record`,
//! `import`) and the analyser. One event is one row of a trace
//! (see [`crate::trace`]); in memory the analyser holds them column-wise in
//! [`Events`].

use std::collections::BTreeMap;
use std::fmt;

pub use super::column::Row;
use super::column::{Coded, Packed, Sparse};

/// CUDA's out-of-memory return code (`cudaErrorMemoryAllocation` = 2 in the
/// runtime, `CUDA_ERROR_OUT_OF_MEMORY` = 2 in the driver).
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;

macro_rules! kinds {
    ($($variant:ident => $name:literal),* $(,)?) => {
        /// What an event is. The names are the public `kind` column values.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u8)]
        pub enum EventKind { $($variant),* }

        impl EventKind {
            /// Every kind, in code order.
            pub const ALL: &'static [EventKind] = &[$(EventKind::$variant),*];

            /// The `kind` column value.
            pub fn name(self) -> &'static str {
                match self { $(EventKind::$variant => $name),* }
            }

            /// Parses a `kind` column value.
            pub fn from_name(name: &str) -> Option<EventKind> {
                match name { $($name => Some(EventKind::$variant),)* _ => None }
            }
        }
    };
}

kinds! {
    Alloc => "alloc",
    Free => "free",
    AllocAsync => "alloc_async",
    FreeAsync => "free_async",
    AllocManaged => "alloc_managed",
    AllocHost => "alloc_host",
    FreeHost => "free_host",
    BlockAlloc => "block_alloc",
    BlockFree => "block_free",
    BlockFreeRequested => "block_free_requested",
    SegmentAlloc => "segment_alloc",
    SegmentFree => "segment_free",
    SegmentMap => "segment_map",
    SegmentUnmap => "segment_unmap",
    Memcpy => "memcpy",
    MemcpyAsync => "memcpy_async",
    Launch => "launch",
    Oom => "oom",
    MemCreate => "mem_create",
    MemRelease => "mem_release",
    MemMap => "mem_map",
    MemUnmap => "mem_unmap",
    VaReserve => "va_reserve",
    VaFree => "va_free",
    Exit => "exit",
}

impl EventKind {
    /// A successful event of this kind creates a block in device memory
    /// (the device view of SPEC §3). Host allocations live in another
    /// address space and are not part of it.
    /// Physical memory mapped into a reserved range (`cuMemMap`, how
    /// PyTorch's expandable segments grow) counts as a device block too.
    pub fn is_device_alloc(self) -> bool {
        matches!(self, EventKind::Alloc | EventKind::AllocAsync | EventKind::AllocManaged | EventKind::MemMap)
    }

    /// A successful event of this kind releases a device block.
    pub fn is_device_free(self) -> bool {
        matches!(self, EventKind::Free | EventKind::FreeAsync | EventKind::MemUnmap)
    }

    /// A successful event of this kind creates a block in either view: a
    /// device allocation or a PyTorch allocator block.
    pub fn creates_block(self) -> bool {
        self.is_device_alloc() || self == EventKind::BlockAlloc
    }

    /// A successful event of this kind releases a block in either view.
    pub fn releases_block(self) -> bool {
        self.is_device_free() || self == EventKind::BlockFree
    }

    /// Any allocation request, device or host, whose failure is reported
    /// through `ret`.
    pub fn is_alloc_request(self) -> bool {
        self.is_device_alloc() || self == EventKind::AllocHost
    }

    /// A call of this kind that fails with CUDA's out-of-memory code is an
    /// OOM ([`Event::is_oom`]): device allocations and `cuMemCreate`.
    pub fn can_run_out_of_memory(self) -> bool {
        self.is_device_alloc() || self == EventKind::MemCreate
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One event, as producers build it before writing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub ts_ns: u64,
    pub duration_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub kind: EventKind,
    pub addr: u64,
    pub size: u64,
    pub ret: i32,
    pub device: Option<i32>,
    pub stream: Option<u64>,
    pub extra: Extra,
    /// What the eBPF recorder saw of the CUDA call; default elsewhere.
    pub cuda: Cuda,
}

/// Columns only PyTorch snapshots fill (SPEC §2, kind-specific columns);
/// `None` for other producers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extra {
    /// The size the program asked for (the block may be larger).
    pub requested: Option<u64>,
    /// Row of the trace's stack table (`stacks.parquet`).
    pub stack: Option<u32>,
    /// `oom` only: the device's free memory CUDA reported.
    pub device_free: Option<u64>,
}

/// Kind-specific columns of recorded CUDA calls (SPEC §2). Written to the
/// trace, not loaded by the analyser.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cuda {
    /// The CUDA function, e.g. `cudaMalloc` or `cuMemAlloc_v2`.
    pub call: Option<&'static str>,
    /// memcpy: the source address (`addr` is the destination).
    pub src: Option<u64>,
    /// memcpy: `cudaMemcpyKind` (0 host→host, 1 host→device, 2
    /// device→host, 3 device→device, 4 default).
    pub copy_kind: Option<i32>,
    /// `cuMemCreate` / `cuMemRelease` / `cuMemMap`: the physical
    /// allocation handle.
    pub handle: Option<u64>,
    pub launch: Option<Launch>,
    /// `record --stacks`: the user call stack's id in `ustacks.parquet`.
    pub ustack: Option<u32>,
    /// The return address at the call's entry: the code that called.
    pub caller: Option<u64>,
}

/// A kernel launch's configuration; `addr` holds the function address.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Launch {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem: u64,
}

impl Event {
    /// A successful event of `pid` (its main thread) with no optional
    /// fields: what tests and simple producers start from.
    pub fn new(ts_ns: u64, pid: u32, kind: EventKind, addr: u64, size: u64) -> Event {
        Event {
            ts_ns,
            duration_ns: 0,
            pid,
            tid: pid,
            kind,
            addr,
            size,
            ret: 0,
            device: None,
            stream: None,
            extra: Default::default(),
            cuda: Default::default(),
        }
    }

    /// A failed device allocation with CUDA's out-of-memory code, or an
    /// explicit `oom` event: the instants the OOM diagnosis looks at.
    pub fn is_oom(&self) -> bool {
        self.kind == EventKind::Oom || (self.kind.can_run_out_of_memory() && self.ret == CUDA_ERROR_OUT_OF_MEMORY)
    }
}

/// The columns the analyser replays, in time order. `kind` is `None` for a
/// kind name this version does not know (counted, then ignored). Most
/// columns are stored narrower than their values ([`crate::trace::column`]):
/// the time and the size in 4 bytes a row and the address in 4 or 5 (each
/// block of rows as offsets, or as lower halves with a code of the upper
/// half), the pid and the stream in 1 (a code), the return code and
/// `device_free` in a bit, where they took 8, 8, 8, 4, 8, 4 and 8.
#[derive(Clone, Debug, PartialEq)]
pub struct Events {
    pub ts_ns: Packed,
    pub pid: Coded<u32>,
    pub kind: Vec<Option<EventKind>>,
    pub addr: Packed,
    pub size: Packed,
    pub ret: Sparse<i32>,
    /// The PyTorch columns, loaded only for traces that have them (then as
    /// long as the others; empty otherwise). Nulls are `u64::MAX` /
    /// `u32::MAX`.
    pub requested: Vec<u64>,
    pub stack: Vec<u32>,
    pub device_free: Sparse<u64>,
    /// The CUDA stream, loaded with the PyTorch columns (0 for none):
    /// what the allocator model of `whatif` keys its pools by.
    pub stream: Coded<u64>,
    /// The device of each call, loaded only for recordings where a process
    /// used several GPUs (empty otherwise); [`NO_DEVICE`] for none.
    pub device: Vec<i32>,
}

impl Default for Events {
    fn default() -> Self {
        Events {
            ts_ns: Packed::default(),
            pid: Coded::default(),
            kind: Vec::new(),
            addr: Packed::default(),
            size: Packed::default(),
            ret: Sparse::new(0),
            requested: Vec::new(),
            stack: Vec::new(),
            device_free: Sparse::new(u64::MAX),
            stream: Coded::default(),
            device: Vec::new(),
        }
    }
}

/// The null of the `device` column in memory.
pub const NO_DEVICE: i32 = i32::MIN;

/// Events per kind, and rows whose kind this version does not know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KindCounts {
    counts: [u64; EventKind::ALL.len()],
    pub unknown: u64,
}

impl Default for KindCounts {
    fn default() -> Self {
        KindCounts { counts: [0; EventKind::ALL.len()], unknown: 0 }
    }
}

impl KindCounts {
    /// Counts one row (None: a kind this version does not know).
    pub fn add(&mut self, kind: Option<EventKind>) {
        match kind {
            Some(k) => self.counts[k as usize] += 1,
            None => self.unknown += 1,
        }
    }

    pub fn get(&self, kind: EventKind) -> u64 {
        self.counts[kind as usize]
    }

    /// The kinds that occur, with their counts, in code order.
    pub fn present(&self) -> impl Iterator<Item = (EventKind, u64)> + '_ {
        EventKind::ALL.iter().map(|&k| (k, self.get(k))).filter(|&(_, n)| n > 0)
    }

    /// As `trace.json` `event_counts` has them: by kind name.
    pub fn by_name(&self) -> BTreeMap<String, u64> {
        self.present().map(|(k, n)| (k.name().to_string(), n)).collect()
    }
}

/// The null of the `stack` column in memory.
pub const NO_STACK: u32 = u32::MAX;

impl Events {
    pub fn len(&self) -> usize {
        self.ts_ns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ts_ns.is_empty()
    }

    pub fn push(&mut self, e: &Event) {
        self.ts_ns.push(e.ts_ns);
        self.pid.push(e.pid);
        self.kind.push(Some(e.kind));
        self.addr.push(e.addr);
        self.size.push(e.size);
        self.ret.push(e.ret);
        // A stream counts as a PyTorch column too: a trace that starts with
        // a segment event of stream 5 (no extras) must not read as stream 0.
        if e.extra != Extra::default() || e.stream.is_some_and(|s| s != 0) || self.has_extra() {
            let n = self.ts_ns.len() - 1;
            self.requested.resize(n, u64::MAX);
            self.stack.resize(n, NO_STACK);
            self.device_free.resize(n);
            self.stream.resize(n, 0);
            self.requested.push(e.extra.requested.unwrap_or(u64::MAX));
            self.stack.push(e.extra.stack.unwrap_or(NO_STACK));
            self.device_free.push(e.extra.device_free.unwrap_or(u64::MAX));
            self.stream.push(e.stream.unwrap_or(0));
        }
    }

    /// Whether the PyTorch columns are present.
    pub fn has_extra(&self) -> bool {
        !self.requested.is_empty()
    }

    /// The size the program asked for at row `i`, where the trace has one
    /// (a snapshot's block sizes carry the allocator's rounding).
    pub fn requested_at(&self, i: usize) -> Option<u64> {
        self.requested.get(i).copied().filter(|&r| r != u64::MAX && r > 0)
    }

    /// Row `i` as an [`Event`] (fields the analyser does not load are zero).
    pub fn get(&self, i: usize) -> Option<Event> {
        Some(Event {
            ts_ns: self.ts_ns.at(i),
            duration_ns: 0,
            pid: self.pid[i],
            tid: 0,
            kind: self.kind[i]?,
            addr: self.addr.at(i),
            size: self.size.at(i),
            ret: self.ret[i],
            device: None,
            stream: self.stream.get(i),
            cuda: Cuda::default(),
            extra: Extra {
                requested: self.requested.get(i).copied().filter(|&v| v != u64::MAX),
                stack: self.stack.get(i).copied().filter(|&v| v != NO_STACK),
                device_free: self.device_free.get(i).filter(|&v| v != u64::MAX),
            },
        })
    }

    /// Keeps the rows for which `keep(self, row)` holds, in order.
    pub fn retain(&mut self, keep: impl Fn(&Events, usize) -> bool) {
        if self.len() <= u32::MAX as usize {
            let rows: Vec<u32> = (0..self.len() as u32).filter(|&i| keep(self, i as usize)).collect();
            self.take_rows(&rows);
        } else {
            let rows: Vec<usize> = (0..self.len()).filter(|&i| keep(self, i)).collect();
            self.take_rows(&rows);
        }
    }

    /// Counts rows whose timestamp is smaller than the row before, then
    /// sorts stably by timestamp (so equal timestamps keep file order).
    /// Returns the count of out-of-order rows.
    pub fn sort_by_time(&mut self) -> u64 {
        let (out_of_order, _) = self.ts_ns.iter().fold((0u64, 0u64), |(n, before), t| (n + u64::from(t < before), t));
        if out_of_order == 0 {
            return 0;
        }
        // Row numbers in 4 bytes while they fit (a sort's order is as long
        // as the trace).
        if self.len() <= u32::MAX as usize {
            let mut order: Vec<u32> = (0..self.len() as u32).collect();
            order.sort_by_key(|&i| self.ts_ns.at(i as usize));
            self.take_rows(&order);
        } else {
            let mut order: Vec<usize> = (0..self.len()).collect();
            order.sort_by_key(|&i| self.ts_ns.at(i));
            self.take_rows(&order);
        }
        out_of_order
    }

    /// Replaces every column by its `rows`, in that order (the PyTorch
    /// columns only when present); a row may be taken more than once.
    pub fn take_rows<R: Row>(&mut self, rows: &[R]) {
        fn take<T: Copy, R: Row>(v: &mut Vec<T>, rows: &[R]) {
            if !v.is_empty() {
                *v = rows.iter().map(|&i| v[i.index()]).collect();
            }
        }
        self.ts_ns = self.ts_ns.take_rows(rows);
        if !self.pid.is_empty() {
            self.pid = self.pid.take_rows(rows);
        }
        take(&mut self.kind, rows);
        self.addr = self.addr.take_rows(rows);
        self.size = self.size.take_rows(rows);
        if !self.ret.is_empty() {
            self.ret = self.ret.take_rows(rows);
        }
        take(&mut self.requested, rows);
        take(&mut self.stack, rows);
        if !self.device_free.is_empty() {
            self.device_free = self.device_free.take_rows(rows);
        }
        if !self.stream.is_empty() {
            self.stream = self.stream.take_rows(rows);
        }
        take(&mut self.device, rows);
    }
}

/// A block alive during a [`LiveSet`] walk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveBlock {
    pub size: u64,
    /// [`NO_STACK`] when the trace has none.
    pub stack: u32,
    /// The row that allocated it.
    pub row: usize,
}

/// The blocks alive while walking time-sorted events row by row, in either
/// view, keyed by (pid, address). Not the replay (no arenas, gaps or
/// anomalies): what attributes live bytes to call stacks (flamegraphs, call
/// sites). An allocation at a live address replaces the block there.
#[derive(Clone, Debug, Default)]
pub struct LiveSet {
    pub blocks: ahash::AHashMap<(u32, u64), LiveBlock>,
}

impl LiveSet {
    /// Applies row `i`; returns its pid and the change of that pid's live
    /// bytes when the row allocated or freed a block.
    pub fn apply(&mut self, ev: &Events, i: usize) -> Option<(u32, i64)> {
        let kind = ev.kind[i]?;
        if ev.ret[i] != 0 {
            return None;
        }
        let key = (ev.pid[i], ev.addr.at(i));
        if kind.creates_block() && ev.size.at(i) > 0 {
            let stack = ev.stack.get(i).copied().unwrap_or(NO_STACK);
            let old = self.blocks.insert(key, LiveBlock { size: ev.size.at(i), stack, row: i });
            Some((key.0, ev.size.at(i) as i64 - old.map_or(0, |b| b.size as i64)))
        } else if kind.releases_block() {
            self.blocks.remove(&key).map(|b| (key.0, -(b.size as i64)))
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_names_round_trip() {
        for &k in EventKind::ALL {
            assert_eq!(EventKind::from_name(k.name()), Some(k));
        }
        assert_eq!(EventKind::ALL.len(), 25);
        assert_eq!(EventKind::from_name("cudaMalloc"), None);
    }

    #[test]
    fn a_stream_before_the_first_extras_is_kept() {
        // A snapshot's trace may start with `segment_map` on stream 5 (no
        // requested size, no stack) before the first allocation.
        let mut ev = Events::default();
        let mut e = Event::new(1, 0, EventKind::SegmentMap, 0x1000, 2 << 20);
        e.stream = Some(5);
        ev.push(&e);
        let mut a = Event::new(2, 0, EventKind::BlockAlloc, 0x1000, 512);
        a.stream = Some(7);
        a.extra.requested = Some(100);
        ev.push(&a);
        assert_eq!(ev.stream, vec![5, 7]);
        assert_eq!(ev.get(0).unwrap().stream, Some(5));
    }

    #[test]
    fn sorting_counts_and_keeps_ties_in_order() {
        let mut ev = Events::default();
        for (ts, addr) in [(5, 1), (3, 2), (3, 3), (9, 4), (1, 5)] {
            ev.push(&Event {
                ts_ns: ts,
                duration_ns: 0,
                pid: 1,
                tid: 1,
                kind: EventKind::Alloc,
                addr,
                size: 1,
                ret: 0,
                device: None,
                stream: None,
                extra: Extra::default(),
                cuda: Default::default(),
            });
        }
        assert_eq!(ev.sort_by_time(), 2);
        assert_eq!(ev.ts_ns, vec![1, 3, 3, 5, 9]);
        assert_eq!(ev.addr, vec![5, 2, 3, 1, 4]);
    }
}
