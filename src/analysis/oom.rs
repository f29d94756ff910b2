//! OOM diagnosis (SPEC §5): for each failed allocation, was it capacity
//! (the request exceeded the free device memory), fragmentation (enough
//! memory was free, but no single free range could hold it) or the
//! allocator's policy (a free range was large enough)?
//!
//! Free device memory F: for `oom` events that carry it, that value; for
//! eBPF and synthetic traces, capacity − live bytes of every process at that
//! instant, when the capacity is known (`--capacity`, or `capacity_bytes`
//! in `trace.json`); otherwise unknown, and the class says so. Largest free
//! range M: the largest gap inside the process's arenas, or the free memory
//! outside every arena (F − all gaps) taken as one range — an upper bound,
//! so an OOM is called fragmentation only when even that could not help.

use serde::Serialize;

/// Why an allocation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OomClass {
    Capacity,
    Fragmentation,
    AllocatorPolicy,
    /// The free device memory is unknown (no capacity given).
    Unknown,
}

impl OomClass {
    pub fn name(self) -> &'static str {
        match self {
            OomClass::Capacity => "capacity",
            OomClass::Fragmentation => "fragmentation",
            OomClass::AllocatorPolicy => "allocator_policy",
            OomClass::Unknown => "unknown",
        }
    }

    /// The class named `name` ([`OomClass::name`]).
    pub fn from_name(name: &str) -> Option<OomClass> {
        [OomClass::Capacity, OomClass::Fragmentation, OomClass::AllocatorPolicy, OomClass::Unknown]
            .into_iter()
            .find(|c| c.name() == name)
    }

    /// Classifies a request of `requested` bytes.
    pub fn of(requested: u64, device_free: Option<u64>, largest_free: Option<u64>) -> OomClass {
        match (device_free, largest_free) {
            (Some(f), _) if requested > f => OomClass::Capacity,
            (Some(_), Some(m)) if requested > m => OomClass::Fragmentation,
            (Some(_), Some(_)) => OomClass::AllocatorPolicy,
            _ => OomClass::Unknown,
        }
    }
}

/// One failed allocation and the state it saw.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OomDiagnosis {
    pub t_ns: u64,
    pub pid: u32,
    pub requested: u64,
    /// Free memory: on a shared device its capacity less what every
    /// process held; under PyTorch's allocator CUDA's free memory plus the
    /// unused bytes of PyTorch's segments.
    pub device_free: Option<u64>,
    pub largest_free: Option<u64>,
    /// Under PyTorch's allocator: the free memory CUDA itself reported (the
    /// figure PyTorch's error message gives).
    pub cuda_free: Option<u64>,
    /// Retries of this request that failed too (device-level traces): a
    /// caching allocator such as PyTorch's releases its cache and asks
    /// again once (twice with `max_split_size_mb`). They are this OOM, not
    /// others ([`Retries`]).
    pub retries: u32,
    /// A device-level recording of a process that ran PyTorch's caching
    /// allocator: the request failed for PyTorch's cache, whose gaps the
    /// recorded segments do not show, so the class is unknown whatever
    /// the capacity.
    pub inside_pytorch_cache: bool,
    /// Largest gap inside the process's arenas.
    pub largest_gap: u64,
    pub live_bytes: u64,
    pub class: OomClass,
    /// The ten largest live blocks of the process, (address, size).
    pub top_blocks: Vec<(u64, u64)>,
    /// Where the failed request came from (traces with stacks).
    pub request_site: Option<String>,
    /// Live bytes by call site at that instant, largest first (traces
    /// with stacks).
    pub top_sites: Vec<crate::analysis::sites::SiteBytes>,
}

/// Tells, for a process that ran PyTorch's caching allocator, a failed
/// device allocation that retries the previous one, or one that the
/// allocator then served, from a new OOM. When `cudaMalloc` fails, PyTorch
/// releases its cached segments and asks again once: a recording then
/// holds two failed calls for one request, or a failed call and a
/// successful one for a request that did not fail at all. A call is that
/// second ask when it is the same size as the process's previous failure
/// and the process allocated nothing on the device in between (frees, the
/// cache's release, and host allocations may come between); the failure
/// after a retry is a new request. Only for the processes (replay units)
/// known to run that allocator ([`crate::trace::symbols::pytorch_processes`]):
/// a plain program may call `cudaMalloc` in a loop, each failure a
/// request of its own.
///
/// With `max_split_size_mb` in the process's recorded settings
/// ([`PytorchUnits`]), PyTorch first frees only its cached blocks above
/// that size and asks, then releases the whole cache and asks a third
/// time: up to two failed calls follow the first.
///
/// Not recognised: expandable segments' `cuMemCreate`.
#[derive(Debug, Default)]
pub struct Retries {
    /// The units whose allocator asks again, and how many times.
    retrying: PytorchUnits,
    /// Per unit: the size of its last failure, the asks still to come, and
    /// whether the next one waits for a free (a third ask follows the
    /// cache's release), while nothing succeeded.
    pending: ahash::AHashMap<u32, (u64, u8, bool)>,
}

/// The units (and pids) of a device-level recording that ran PyTorch's
/// caching allocator, with how many times it asks again for a segment
/// CUDA refused: once after releasing its cache, or twice with
/// `max_split_size_mb` (first only its cached blocks above that size).
pub type PytorchUnits = std::collections::HashMap<u32, u8>;

/// What a device allocation call is, for [`Retries`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ask {
    /// A request of its own (or a process not known to retry).
    New,
    /// A failed retry of the previous failure: the same OOM.
    Retry,
    /// The successful retry of the previous failure: that failure was no
    /// OOM, the allocator served the request after releasing its cache.
    Recovered,
}

impl Retries {
    pub fn of(retrying: PytorchUnits) -> Retries {
        Retries { retrying, pending: Default::default() }
    }

    /// Notes a device allocation call of `unit` (`failed`: it ran out of
    /// memory).
    pub fn ask(&mut self, unit: u32, size: u64, failed: bool) -> Ask {
        let Some(&again) = self.retrying.get(&unit) else { return Ask::New };
        match (self.pending.remove(&unit), failed) {
            (Some((s, left, false)), true) if s == size => {
                if left > 1 {
                    self.pending.insert(unit, (size, left - 1, true));
                }
                Ask::Retry
            }
            (Some((s, _, false)), false) if s == size => Ask::Recovered,
            (_, true) => {
                if again > 0 {
                    self.pending.insert(unit, (size, again, false));
                }
                Ask::New
            }
            (_, false) => Ask::New,
        }
    }

    /// Notes one event of `unit` (its kind, size and return code): a device
    /// allocation is an ask ([`Retries::ask`]), a device free may precede
    /// a third ask ([`Retries::freed`]); anything else is [`Ask::New`].
    pub fn see(&mut self, kind: crate::trace::event::EventKind, unit: u32, size: u64, ret: i32) -> Ask {
        if kind.is_device_free() && ret == 0 {
            self.freed(unit);
        }
        if kind.is_device_alloc() {
            self.ask(unit, size, ret == crate::trace::event::CUDA_ERROR_OUT_OF_MEMORY)
        } else {
            Ask::New
        }
    }

    /// Notes a device free of `unit`: with `max_split_size_mb`, PyTorch
    /// asks a third time only after releasing its whole cache, so a third
    /// call with no free before it is the program's own (when the first
    /// release found no block above that size, PyTorch asks only twice).
    pub fn freed(&mut self, unit: u32) {
        if let Some(p) = self.pending.get_mut(&unit) {
            p.2 = false;
        }
    }
}

/// The failed request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub t_ns: u64,
    pub pid: u32,
    pub size: u64,
}

/// What the device held when the request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Processes sharing a device (eBPF, synthetic): the device's capacity
    /// when known, and the live bytes and arena gaps summed over every
    /// process.
    Shared { capacity: Option<u64>, live_total: u64, gaps_total: u64 },
    /// PyTorch's allocator on a device of its own, with CUDA's free memory
    /// when the snapshot recorded it. Free is that plus what the segments
    /// hold unused; the CUDA free memory counts as one range (cudaMalloc
    /// maps it contiguously).
    Allocator { cuda_free: Option<u64> },
}

/// The failing process at that instant: its live bytes, arena span and
/// largest gap, and its live blocks (address, size).
#[derive(Clone, Copy, Debug)]
pub struct Process<'a> {
    pub live_bytes: u64,
    pub span_bytes: u64,
    pub largest_gap: u64,
    pub live_blocks: &'a [(u64, u64)],
}

/// Diagnoses a failed request.
pub fn diagnose(request: Request, device: Device, process: Process<'_>) -> OomDiagnosis {
    let (capacity, live_total, gaps_total) = match device {
        Device::Shared { capacity, live_total, gaps_total } => (capacity, live_total, gaps_total),
        Device::Allocator { cuda_free: Some(free) } => (
            Some(free.saturating_add(process.span_bytes)),
            process.live_bytes,
            process.span_bytes.saturating_sub(process.live_bytes),
        ),
        Device::Allocator { cuda_free: None } => (None, process.live_bytes, 0),
    };
    let cuda_free = match device {
        Device::Allocator { cuda_free } => cuda_free,
        Device::Shared { .. } => None,
    };
    let Request { t_ns, pid, size: requested } = request;
    let (largest_gap, live_blocks) = (process.largest_gap, process.live_blocks);
    let device_free = capacity.map(|c| c.saturating_sub(live_total));
    let largest_free = device_free.map(|f| largest_gap.max(f.saturating_sub(gaps_total)));
    let mut top: Vec<(u64, u64)> = live_blocks.to_vec();
    top.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    top.truncate(10);
    OomDiagnosis {
        t_ns,
        pid,
        requested,
        device_free,
        largest_free,
        cuda_free,
        retries: 0,
        inside_pytorch_cache: false,
        largest_gap,
        live_bytes: live_blocks.iter().map(|b| b.1).sum(),
        class: OomClass::of(requested, device_free, largest_free),
        top_blocks: top,
        request_site: None,
        top_sites: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// PyTorch's allocator asks once more after releasing its cache: the
    /// call right after a failure of the same size, with nothing allocated
    /// on the device between, is that second ask; the failure after a
    /// failed retry is a new request. A unit not known to run that
    /// allocator gets no pairing.
    #[test]
    fn a_second_ask_is_the_next_call_of_the_same_size_with_nothing_allocated_between() {
        let mut r = Retries::of([(1, 1)].into_iter().collect());
        assert_eq!(r.ask(1, GIB, true), Ask::New);
        assert_eq!(r.ask(1, GIB, true), Ask::Retry);
        assert_eq!(r.ask(1, GIB, true), Ask::New, "a new request");
        assert_eq!(r.ask(1, GIB, true), Ask::Retry, "and its retry");
        // Served after the cache was released: that failure was no OOM.
        assert_eq!(r.ask(1, GIB, true), Ask::New);
        assert_eq!(r.ask(1, GIB, false), Ask::Recovered);
        // A success of another size in between, or another size: new.
        assert_eq!(r.ask(1, GIB, true), Ask::New);
        assert_eq!(r.ask(1, GIB / 2, false), Ask::New);
        assert_eq!(r.ask(1, GIB, true), Ask::New);
        assert_eq!(r.ask(1, 2 * GIB, true), Ask::New);
        // Another unit: each failure its own.
        assert_eq!((r.ask(2, GIB, true), r.ask(2, GIB, true)), (Ask::New, Ask::New));
    }

    /// With `max_split_size_mb`, PyTorch asks a third time (after releasing
    /// first its oversize cached blocks, then the whole cache); the fourth
    /// failure is a new request. A third ask that is served takes the OOM
    /// back as a second one does.
    #[test]
    fn with_max_split_size_mb_a_third_ask_is_the_same_request() {
        let mut r = Retries::of([(1, 2)].into_iter().collect());
        assert_eq!(r.ask(1, GIB, true), Ask::New);
        assert_eq!(r.ask(1, GIB, true), Ask::Retry);
        r.freed(1);
        assert_eq!(r.ask(1, GIB, true), Ask::Retry);
        assert_eq!(r.ask(1, GIB, true), Ask::New, "a new request");
        assert_eq!(r.ask(1, GIB, true), Ask::Retry);
        r.freed(1);
        assert_eq!(r.ask(1, GIB, false), Ask::Recovered, "served at the third ask");
        // Only two asks when the first release found no block above the
        // size: a call after them with nothing freed between is the
        // program's own, served or not.
        assert_eq!(r.ask(1, GIB, true), Ask::New);
        assert_eq!(r.ask(1, GIB, true), Ask::Retry);
        assert_eq!(r.ask(1, GIB, false), Ask::New, "the program's own call, served");
        assert_eq!(r.ask(1, GIB, true), Ask::New);
        assert_eq!(r.ask(1, GIB, true), Ask::Retry);
        assert_eq!(r.ask(1, GIB, true), Ask::New, "the program's own call, failed: a new request");
        assert_eq!(r.ask(1, GIB / 2, true), Ask::New, "another size: a new request");
    }

    #[test]
    fn classes() {
        assert_eq!(OomClass::of(5 * GIB, Some(4 * GIB), Some(4 * GIB)), OomClass::Capacity);
        assert_eq!(OomClass::of(3 * GIB, Some(4 * GIB), Some(2 * GIB)), OomClass::Fragmentation);
        assert_eq!(OomClass::of(GIB, Some(4 * GIB), Some(2 * GIB)), OomClass::AllocatorPolicy);
        assert_eq!(OomClass::of(GIB, None, None), OomClass::Unknown);
    }

    #[test]
    fn free_space_outside_the_arenas_counts_as_one_range() {
        // 10 GiB device, 6 GiB live, 3 GiB of gaps (largest 1 GiB) → 1 GiB
        // free outside the arenas; a 1.5 GiB request is fragmentation.
        let blocks = [(0, 2 * GIB), (3 * GIB, 4 * GIB)];
        let request = |size| Request { t_ns: 7, pid: 1, size };
        let process = Process { live_bytes: 6 * GIB, span_bytes: 9 * GIB, largest_gap: GIB, live_blocks: &blocks };
        let shared = |capacity| Device::Shared { capacity, live_total: 6 * GIB, gaps_total: 3 * GIB };
        let d = diagnose(request(3 * GIB / 2), shared(Some(10 * GIB)), process);
        assert_eq!(d.device_free, Some(4 * GIB));
        assert_eq!(d.largest_free, Some(GIB));
        assert_eq!(d.class, OomClass::Fragmentation);
        assert_eq!(d.top_blocks[0], (3 * GIB, 4 * GIB));
        // Without a capacity nothing can be said.
        let d = diagnose(request(GIB), shared(None), process);
        assert_eq!((d.class, d.device_free), (OomClass::Unknown, None));
    }

    #[test]
    fn an_allocator_device_is_free_cuda_memory_plus_unused_segments() {
        // 6 GiB live in 9 GiB of segments (largest gap 1 GiB), CUDA has
        // 0.5 GiB free: 3.5 GiB free, at most 1 GiB in one range.
        let blocks = [(0, 6 * GIB)];
        let process = Process { live_bytes: 6 * GIB, span_bytes: 9 * GIB, largest_gap: GIB, live_blocks: &blocks };
        let request = Request { t_ns: 7, pid: 0, size: 2 * GIB };
        let d = diagnose(request, Device::Allocator { cuda_free: Some(GIB / 2) }, process);
        assert_eq!((d.device_free, d.largest_free), (Some(7 * GIB / 2), Some(GIB)));
        assert_eq!(d.class, OomClass::Fragmentation);
        let d = diagnose(request, Device::Allocator { cuda_free: None }, process);
        assert_eq!((d.class, d.device_free), (OomClass::Unknown, None));
    }
}
