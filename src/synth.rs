//! Synthetic traces (`fragscope synth`): realistic workloads for tests,
//! benchmarks and demos. Addresses come from a simulated best-fit device
//! allocator ([`Heap`]) over a fixed capacity, so fragmentation *emerges*
//! from the workload instead of being drawn at random; a request that fits
//! nowhere becomes a failed `alloc` with CUDA's out-of-memory code.
//!
//! Every pattern is a story told in iterations (training steps); the number
//! of iterations grows with `--events` up to a cap and each iteration is
//! padded with kernel launches and short-lived temporaries, so the story is
//! the same at 20 thousand and at 10 million events. Output is deterministic
//! for a given seed. `trace.json` `details.iteration_starts` holds the true
//! start of every iteration written (the time of its first event), per
//! process, so tests can check iteration detection exactly.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::Result;
use clap::ValueEnum;
use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg64Mcg;

use crate::trace::details::{Details, SynthDetails};
use crate::trace::event::{CUDA_ERROR_OUT_OF_MEMORY, Event, EventKind};
use crate::trace::{Source, TraceMeta, TraceWriter};

const KIB: u64 = 1 << 10;
/// Layers of the simulated model (training, multi) and the activations each
/// saves for backward: thousands of live tensors, as in large-model training.
const LAYERS: usize = 80;
const ACTIVATIONS_PER_LAYER: usize = 12;
const MIB: u64 = 1 << 20;
/// A kernel each iteration of the steady, leak, filling and fragmenting
/// patterns launches once, at its peak (training has its optimizer kernel).
const STEP_KERNEL: u64 = 0x5555_6000;

/// The workloads `synth` can generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    /// Persistent weights, per-step activations freed in reverse order,
    /// temporaries, optimizer state and gradients.
    Training,
    /// Interleaved lifetimes of mixed sizes: pinned small blocks shred the
    /// space between growing large requests, ending in OOMs although the
    /// total free memory would suffice.
    Fragmenting,
    /// A steady workload plus a slow growth of never-freed blocks.
    Leak,
    /// Healthy: equal-sized buffers allocated and freed in stack order.
    Steady,
    /// Four processes (ranks) each running the training loop on a quarter
    /// of the capacity, synchronised every step.
    Multi,
    /// Memory fills up with live data until requests fail: capacity OOMs.
    Filling,
}

impl Pattern {
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Training => "training",
            Pattern::Fragmenting => "fragmenting",
            Pattern::Leak => "leak",
            Pattern::Steady => "steady",
            Pattern::Multi => "multi",
            Pattern::Filling => "filling",
        }
    }
}

/// What to generate.
#[derive(Clone, Copy, Debug)]
pub struct SynthConfig {
    pub pattern: Pattern,
    pub events: u64,
    pub seed: u64,
    /// Device memory of each simulated GPU, bytes.
    pub capacity: u64,
    /// Rows per Parquet part.
    pub rows_per_part: usize,
}

/// Generates a trace into `dir`.
pub fn synth(cfg: &SynthConfig, dir: &Path) -> Result<TraceMeta> {
    let mut meta = TraceMeta::new(Source::Synthetic);
    meta.capacity_bytes = Some(cfg.capacity);
    meta.command = vec!["fragscope".into(), "synth".into(), "--pattern".into(), cfg.pattern.name().into()];
    meta.details = Details::Synthetic(SynthDetails {
        pattern: cfg.pattern.name().into(),
        seed: cfg.seed,
        events: cfg.events,
        iteration_starts: None,
    });
    let mut writer = TraceWriter::create(dir, meta, cfg.rows_per_part)?;
    writer.write_behind();
    let mut rng = Pcg64Mcg::seed_from_u64(cfg.seed);
    let nprocs = if cfg.pattern == Pattern::Multi { 4 } else { 1 };
    let capacity = cfg.capacity / nprocs;
    // Iterations: one per ~2000 events, at least 12, at most 3000; the
    // fragmenting story needs its 400 steps whatever the length.
    let iterations = match cfg.pattern {
        Pattern::Fragmenting => 400,
        _ => (cfg.events / 2000).clamp(12, 3000) as usize,
    };
    let budget = cfg.events.div_ceil(iterations as u64 * nprocs).max(1) as usize;
    let mut procs: Vec<Proc> =
        (0..nprocs).map(|i| Proc::new(cfg.pattern, 4100 + i as u32 * 17, capacity, iterations, &mut rng)).collect();
    let mut written = 0u64;
    let mut clock = 1_000_000_000u64;
    let mut round: Vec<Event> = Vec::new();
    // The true iteration starts (the time of each iteration's first event),
    // per process, for tests of iteration detection.
    let mut starts: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    let mut last_written = 0u64;
    'outer: for it in 0.. {
        round.clear();
        let mut round_end = clock;
        for p in procs.iter_mut() {
            let first = round.len();
            let mut em = Emitter { events: &mut round, ts: clock, pid: p.pid, rng: &mut rng };
            p.iteration(it, budget, &mut em);
            round_end = round_end.max(em.ts);
            if let Some(e) = round.get(first) {
                starts.entry(p.pid).or_default().push(e.ts_ns);
            }
        }
        round.sort_by_key(|e| e.ts_ns);
        for e in round.drain(..) {
            if written == cfg.events {
                break 'outer;
            }
            last_written = e.ts_ns;
            writer.push(e)?;
            written += 1;
        }
        clock = round_end + 1000;
    }
    for list in starts.values_mut() {
        list.retain(|&t| t <= last_written);
    }
    if let Details::Synthetic(d) = &mut writer.meta_mut().details {
        d.iteration_starts = Some(starts.into_iter().map(|(pid, s)| (pid.to_string(), s)).collect());
    }
    writer.finish()
}

/// A best-fit allocator over `[base, base + capacity)`: the smallest free
/// range that fits, split at its start; frees coalesce with neighbours.
/// Requests up to 1 MiB round up to 512 B, larger ones to 2 MiB.
#[derive(Debug)]
pub struct Heap {
    by_addr: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
}

impl Heap {
    pub fn new(base: u64, capacity: u64) -> Heap {
        let mut h = Heap { by_addr: BTreeMap::new(), by_size: BTreeSet::new() };
        h.insert_free(base, capacity);
        h
    }

    pub fn round(size: u64) -> u64 {
        if size <= MIB { size.max(1).next_multiple_of(512) } else { size.next_multiple_of(2 * MIB) }
    }

    fn insert_free(&mut self, addr: u64, size: u64) {
        self.by_addr.insert(addr, size);
        self.by_size.insert((size, addr));
    }

    fn remove_free(&mut self, addr: u64, size: u64) {
        self.by_addr.remove(&addr);
        self.by_size.remove(&(size, addr));
    }

    /// Address of a block of `size` bytes (already rounded), or None.
    pub fn alloc(&mut self, size: u64) -> Option<u64> {
        let &(free, addr) = self.by_size.range((size, 0)..).next()?;
        self.remove_free(addr, free);
        if free > size {
            self.insert_free(addr + size, free - size);
        }
        Some(addr)
    }

    pub fn free(&mut self, mut addr: u64, mut size: u64) {
        if let Some((&pa, &ps)) = self.by_addr.range(..addr).next_back()
            && pa + ps == addr
        {
            self.remove_free(pa, ps);
            addr = pa;
            size += ps;
        }
        if let Some(&ns) = self.by_addr.get(&(addr + size)) {
            self.remove_free(addr + size, ns);
            size += ns;
        }
        self.insert_free(addr, size);
    }
}

/// Collects one iteration's events with the process's clock.
struct Emitter<'a> {
    events: &'a mut Vec<Event>,
    ts: u64,
    pid: u32,
    rng: &'a mut Pcg64Mcg,
}

impl Emitter<'_> {
    fn emit(&mut self, kind: EventKind, addr: u64, size: u64, ret: i32) {
        let duration = self.rng.random_range(800..6000);
        self.ts += self.rng.random_range(200..3000);
        self.events.push(Event {
            ts_ns: self.ts,
            duration_ns: duration,
            pid: self.pid,
            tid: self.pid,
            kind,
            addr,
            size,
            ret,
            device: Some(0),
            stream: (kind == EventKind::Launch || kind == EventKind::MemcpyAsync).then_some(0x5000),
            extra: Default::default(),
            cuda: Default::default(),
        });
        self.ts += duration;
    }
}

/// A simulated process: its heap, its live blocks by role, and its pattern.
struct Proc {
    pattern: Pattern,
    pid: u32,
    heap: Heap,
    capacity: u64,
    iterations: usize,
    /// Persistent blocks (weights, optimizer state, pinned, leaked).
    persistent: Vec<(u64, u64)>,
    weights: Vec<u64>,
    optimizer_ready: bool,
    /// Blocks from earlier iterations freed later (interleaved lifetimes).
    carry: Vec<(u64, u64, usize)>,
}

impl Proc {
    fn new(pattern: Pattern, pid: u32, capacity: u64, iterations: usize, rng: &mut Pcg64Mcg) -> Proc {
        // Typical CUDA device addresses; each process has its own space.
        let base = 0x7f00_0000_0000u64;
        let weights = match pattern {
            Pattern::Training | Pattern::Multi => {
                let scale = capacity as f64 / (80u64 << 30) as f64;
                // An 80-layer model: 9 parameter tensors per layer.
                (0..LAYERS * 9)
                    .map(|i| {
                        if i % 9 >= 7 {
                            rng.random_range(KIB..256 * KIB) // biases, norms
                        } else {
                            ((rng.random_range(1.0f64..24.0)) * MIB as f64 * scale) as u64
                        }
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        Proc {
            pattern,
            pid,
            heap: Heap::new(base, capacity),
            capacity,
            iterations,
            persistent: Vec::new(),
            weights,
            optimizer_ready: false,
            carry: Vec::new(),
        }
    }

    fn alloc(&mut self, em: &mut Emitter, size: u64) -> Option<(u64, u64)> {
        let rounded = Heap::round(size);
        match self.heap.alloc(rounded) {
            Some(addr) => {
                em.emit(EventKind::Alloc, addr, rounded, 0);
                Some((addr, rounded))
            }
            None => {
                em.emit(EventKind::Alloc, 0, rounded, CUDA_ERROR_OUT_OF_MEMORY);
                None
            }
        }
    }

    fn free(&mut self, em: &mut Emitter, block: (u64, u64)) {
        self.heap.free(block.0, block.1);
        em.emit(EventKind::Free, block.0, 0, 0);
    }

    /// Kernel launches, copies and short-lived temporaries until the
    /// iteration has used `budget` events.
    fn pad(&mut self, em: &mut Emitter, start: usize, budget: usize) {
        while em.events.len() < start + budget {
            match em.rng.random_range(0..10) {
                0..=5 => {
                    // Kernels of their own, apart from the patterns' ones.
                    let function = 0x5556_0000 + em.rng.random_range(0..64u64) * 0x100;
                    em.emit(EventKind::Launch, function, 0, 0);
                }
                6 => {
                    let size = em.rng.random_range(KIB..4 * MIB);
                    em.emit(EventKind::MemcpyAsync, 0, size, 0);
                }
                _ => {
                    let size = em.rng.random_range(512..2 * MIB);
                    if let Some(b) = self.alloc(em, size) {
                        em.emit(EventKind::Launch, 0x5555_0000, 0, 0);
                        self.free(em, b);
                    }
                }
            }
        }
    }

    fn iteration(&mut self, it: usize, budget: usize, em: &mut Emitter) {
        let start = em.events.len();
        let progress = (it as f64 / self.iterations as f64).min(1.0);
        match self.pattern {
            Pattern::Training | Pattern::Multi => self.training_step(em),
            Pattern::Fragmenting => self.fragmenting_step(it, progress, em),
            Pattern::Leak => {
                // Leak about 1.5 % of capacity over the run, in 1–4 MiB
                // blocks, at the start of each iteration (a cache entry per
                // batch that is never evicted).
                let per_iter = (self.capacity as f64 * 0.015 / self.iterations as f64 / (2.5 * MIB as f64)).max(1.0);
                for _ in 0..per_iter.round() as usize {
                    let size = em.rng.random_range(MIB..4 * MIB);
                    if let Some(b) = self.alloc(em, size) {
                        self.persistent.push(b);
                    }
                }
                self.steady_step(em, 24);
            }
            Pattern::Steady => self.steady_step(em, 32),
            Pattern::Filling => {
                // Live data grows until nothing fits: 1.5 × capacity over the
                // run, beside a working set three times each step's growth.
                let chunk = (self.capacity as f64 * 1.5 / self.iterations as f64) as u64;
                let size = chunk.max(2 * MIB);
                if let Some(b) = self.alloc(em, size) {
                    self.persistent.push(b);
                }
                let buffer = 64 * MIB.min(self.capacity / 256).max(MIB / 64);
                self.steady_step(em, (3 * size).div_ceil(buffer).max(4) as usize);
            }
        }
        self.pad(em, start, budget);
    }

    /// Equal-sized buffers allocated and freed in stack order: packs well.
    fn steady_step(&mut self, em: &mut Emitter, n: usize) {
        let size = 64 * MIB.min(self.capacity / 256).max(MIB / 64);
        let mut stack = Vec::with_capacity(n);
        for _ in 0..n {
            if let Some(b) = self.alloc(em, size) {
                stack.push(b);
            }
            em.emit(EventKind::Launch, 0x5555_1000, 0, 0);
        }
        // Once per iteration, at its peak (a loss or reduction kernel).
        em.emit(EventKind::Launch, STEP_KERNEL, 0, 0);
        while let Some(b) = stack.pop() {
            self.free(em, b);
        }
    }

    fn training_step(&mut self, em: &mut Emitter) {
        if self.persistent.is_empty() {
            for w in self.weights.clone() {
                if let Some(b) = self.alloc(em, w) {
                    self.persistent.push(b);
                }
                em.emit(EventKind::Memcpy, 0, w, 0);
            }
        }
        let scale = self.capacity as f64 / (80u64 << 30) as f64;
        // Forward: per layer activations kept for backward, temporaries freed.
        let mut activations = Vec::new();
        for _layer in 0..LAYERS {
            for _ in 0..ACTIVATIONS_PER_LAYER {
                let size = (em.rng.random_range(4.0f64..40.0) * MIB as f64 * scale) as u64;
                if let Some(b) = self.alloc(em, size) {
                    activations.push(b);
                }
                em.emit(EventKind::Launch, 0x5555_2000, 0, 0);
            }
            let tmp = em.rng.random_range(256 * KIB..3 * MIB);
            if let Some(b) = self.alloc(em, tmp) {
                em.emit(EventKind::Launch, 0x5555_2100, 0, 0);
                self.free(em, b);
            }
        }
        // Backward: gradients appear, activations go in reverse order.
        let mut grads = Vec::new();
        let weights = self.weights.clone();
        let per_layer = weights.len().div_ceil(LAYERS);
        for (layer, chunk) in weights.chunks(per_layer).enumerate().rev() {
            for &w in chunk {
                if let Some(b) = self.alloc(em, w) {
                    grads.push(b);
                }
            }
            for _ in 0..ACTIVATIONS_PER_LAYER {
                if let Some(b) = activations.pop() {
                    em.emit(EventKind::Launch, 0x5555_3000 + layer as u64, 0, 0);
                    self.free(em, b);
                }
            }
        }
        while let Some(b) = activations.pop() {
            self.free(em, b);
        }
        // Optimizer: Adam moments allocated once, after the first backward.
        if !self.optimizer_ready {
            for w in weights.iter().chain(weights.iter()) {
                if let Some(b) = self.alloc(em, *w) {
                    self.persistent.push(b);
                }
            }
            self.optimizer_ready = true;
        }
        em.emit(EventKind::Launch, 0x5555_4000, 0, 0);
        for b in grads {
            self.free(em, b);
        }
    }

    /// Buffers of mixed sizes with random, interleaved lifetimes (think
    /// variable-length batches and caches) keep about 60 % of the capacity
    /// live, scattered over the address space, with small blocks pinned
    /// between them; request sizes grow from 1/120 to 1/20 of the capacity.
    /// The free 40 % stays split into holes smaller than the late requests,
    /// which fail although the total free memory would hold them.
    fn fragmenting_step(&mut self, it: usize, progress: f64, em: &mut Emitter) {
        let capacity = self.capacity as f64;
        let target = capacity / 120.0 * (1.0 + 5.0 * progress);
        let mut live: u64 =
            self.carry.iter().map(|c| c.1).sum::<u64>() + self.persistent.iter().map(|p| p.1).sum::<u64>();
        for n in 0..8 {
            let size = (target * em.rng.random_range(0.5..1.5)) as u64;
            if n > 0 && (live + size) as f64 > 0.6 * capacity {
                break;
            }
            let got = self.alloc(em, size);
            em.emit(EventKind::Launch, 0x5555_5000, 0, 0);
            if let Some(b) = got {
                live += b.1;
                let lifetime = it + em.rng.random_range(1..8);
                self.carry.push((b.0, b.1, lifetime));
            }
            // A small block right after: most are temporary, a few stay.
            let small = em.rng.random_range(MIB..24 * MIB);
            if let Some(b) = self.alloc(em, small) {
                if em.rng.random_bool(0.15) {
                    self.persistent.push(b);
                } else {
                    self.carry.push((b.0, b.1, it + em.rng.random_range(1..4)));
                }
            }
        }
        // Once per iteration, at its peak (a loss or reduction kernel).
        em.emit(EventKind::Launch, STEP_KERNEL, 0, 0);
        // Expired buffers go, in the order they happen to be found.
        let mut i = 0;
        while i < self.carry.len() {
            if self.carry[i].2 <= it {
                let (addr, size, _) = self.carry.swap_remove(i);
                self.free(em, (addr, size));
            } else {
                i += 1;
            }
        }
    }
}

/// `fragscope synth`: writes the trace and says what it wrote.
pub fn run(cfg: &SynthConfig, output: &Path) -> Result<()> {
    anyhow::ensure!(cfg.capacity >= 64 << 20, "--capacity must be at least 64MiB");
    let meta = synth(cfg, output)?;
    let total: u64 = meta.event_counts.values().sum();
    println!(
        "{}: {} events ({} pattern, seed {}) in {} part{}",
        output.display(),
        total,
        cfg.pattern.name(),
        cfg.seed,
        meta.parts,
        if meta.parts == 1 { "" } else { "s" }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_is_best_fit_and_coalesces() {
        let mut h = Heap::new(0, 100 * MIB);
        let a = h.alloc(10 * MIB).unwrap();
        let b = h.alloc(2 * MIB).unwrap();
        let c = h.alloc(20 * MIB).unwrap();
        let _d = h.alloc(MIB).unwrap();
        assert_eq!((a, b, c), (0, 10 * MIB, 12 * MIB));
        h.free(b, 2 * MIB);
        h.free(a, 10 * MIB);
        // Best fit: a 4 MiB request takes the 12 MiB hole, not the big tail.
        assert_eq!(h.alloc(4 * MIB), Some(0));
        h.free(c, 20 * MIB);
        // 8 MiB + 20 MiB coalesced: 28 MiB fits exactly at 4 MiB.
        assert_eq!(h.alloc(28 * MIB), Some(4 * MIB));
        assert_eq!(h.alloc(200 * MIB), None);
    }

    #[test]
    fn rounding() {
        assert_eq!(Heap::round(1), 512);
        assert_eq!(Heap::round(513), 1024);
        assert_eq!(Heap::round(MIB), MIB);
        assert_eq!(Heap::round(MIB + 1), 2 * MIB);
        assert_eq!(Heap::round(5 * MIB), 6 * MIB);
    }
}
