//! What is probed (SPEC §9) and how a raw probe record becomes an
//! [`Event`]. The BPF side (`bpf/record.bpf.c`) is generic: it saves the
//! six register arguments, two stack arguments where asked, the return
//! code and the value behind an output pointer, and tags the record with
//! the attach cookie — an index into [`PROBES`] plus flags. Everything the
//! arguments mean is decided here.

use super::skel::types::cookie_bits;
use crate::trace::event::{Cuda, Event, EventKind, Launch};

/// Which `--no-*` option turns a probe off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    Memory,
    Memcpy,
    Launch,
    /// PyTorch's caching allocator (`--no-torch`).
    Torch,
    /// A runtime function read for PyTorch's allocator (`--no-torch`
    /// too): `cudaMemGetInfo`, whose figure PyTorch's OOM carries.
    TorchRuntime,
}

/// How to read a call's arguments. `stream` is the index of the stream
/// argument, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// `(T **out, size_t size, …)`: the result is written through `out`.
    Alloc { stream: Option<usize> },
    /// `(ptr, …)`.
    Free { stream: Option<usize> },
    /// `(dst, src, count, kind, …)`.
    Memcpy { stream: Option<usize> },
    /// `cudaLaunchKernel(func, dim3 grid, dim3 block, args, sharedMem, stream)`.
    Launch,
    /// `(ptr, size, …)`: cuMemUnmap, cuMemAddressFree.
    Range,
    /// `cuMemCreate(handle *out, size, prop, flags)`.
    Create,
    /// `cuMemRelease(handle)`.
    Release,
    /// `cuMemMap(ptr, size, offset, handle, flags)`.
    Map,
    /// `__cudaRegisterFunction(module, hostFun, deviceFun, deviceName, …)`:
    /// a kernel's host function and its mangled device name.
    Register,
    /// `cudaGetKernel(cudaKernel_t *out, const void *hostFun)` and the like:
    /// the handle CUDA 13's launches pass instead of the host function.
    GetKernel,
    /// `cudaSetDevice(int device)`: the thread's device from now on.
    SetDevice,
    /// `cuDevicePrimaryCtxRetain(CUcontext *out, CUdevice dev)`: a
    /// context and its device.
    CtxRetain,
    /// `cuCtxSetCurrent(CUcontext)`, `cuCtxPushCurrent`: the thread's
    /// context, so its device, from now on.
    CtxSet,
    /// PyTorch's `NativeCachingAllocator::malloc(this, void** out, device,
    /// size, stream)`: a tensor's block ([`super::torch`]).
    TorchMalloc,
    /// A free of PyTorch's allocator, the pointer in argument `ptr`.
    TorchFree { ptr: usize },
    /// `cudaMemGetInfo(size_t *free, size_t *total)`: CUDA's free memory,
    /// which PyTorch reads when a request fails. Never an event: the BPF
    /// program keeps the figure with the allocator call in flight on the
    /// thread (`COOKIE_FREE_REPORT`), and its OOM carries it.
    MemInfo,
}

impl Shape {
    fn writes_out_ptr(self) -> bool {
        matches!(
            self,
            Shape::Alloc { .. }
                | Shape::Create
                | Shape::GetKernel
                | Shape::CtxRetain
                | Shape::TorchMalloc
                | Shape::MemInfo
        )
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Probe {
    pub symbol: &'static str,
    /// A driver (libcuda) function: not recorded when called from inside a
    /// probed runtime function, so one allocation is one event.
    pub driver: bool,
    pub kind: EventKind,
    pub shape: Shape,
    pub group: Group,
}

const fn rt(symbol: &'static str, kind: EventKind, shape: Shape, group: Group) -> Probe {
    Probe { symbol, driver: false, kind, shape, group }
}

const fn drv(symbol: &'static str, kind: EventKind, shape: Shape) -> Probe {
    Probe { symbol, driver: true, kind, shape, group: Group::Memory }
}

use EventKind as K;
use Group::{Launch as L, Memcpy as C, Memory as M};

const NO_STREAM: Option<usize> = None;

/// Every function the recorder probes, in both libraries (a library, or an
/// executable with the runtime linked in, gets the ones it defines). The
/// `_ptsz`/`_ptds` variants are what code built for per-thread default
/// streams calls.
pub const PROBES: &[Probe] = &[
    rt("cudaMalloc", K::Alloc, Shape::Alloc { stream: NO_STREAM }, M),
    rt("cudaFree", K::Free, Shape::Free { stream: NO_STREAM }, M),
    rt("cudaMallocAsync", K::AllocAsync, Shape::Alloc { stream: Some(2) }, M),
    rt("cudaMallocAsync_ptsz", K::AllocAsync, Shape::Alloc { stream: Some(2) }, M),
    rt("cudaFreeAsync", K::FreeAsync, Shape::Free { stream: Some(1) }, M),
    rt("cudaFreeAsync_ptsz", K::FreeAsync, Shape::Free { stream: Some(1) }, M),
    rt("cudaMallocManaged", K::AllocManaged, Shape::Alloc { stream: NO_STREAM }, M),
    rt("cudaMallocHost", K::AllocHost, Shape::Alloc { stream: NO_STREAM }, M),
    rt("cudaHostAlloc", K::AllocHost, Shape::Alloc { stream: NO_STREAM }, M),
    rt("cudaFreeHost", K::FreeHost, Shape::Free { stream: NO_STREAM }, M),
    rt("cudaMemcpy", K::Memcpy, Shape::Memcpy { stream: NO_STREAM }, C),
    rt("cudaMemcpy_ptds", K::Memcpy, Shape::Memcpy { stream: NO_STREAM }, C),
    rt("cudaMemcpyAsync", K::MemcpyAsync, Shape::Memcpy { stream: Some(4) }, C),
    rt("cudaMemcpyAsync_ptsz", K::MemcpyAsync, Shape::Memcpy { stream: Some(4) }, C),
    rt("cudaLaunchKernel", K::Launch, Shape::Launch, L),
    rt("cudaLaunchKernel_ptsz", K::Launch, Shape::Launch, L),
    // What names a launch (the `kind` is not used: these are not events).
    rt("__cudaRegisterFunction", K::Launch, Shape::Register, L),
    rt("__cudaGetKernel", K::Launch, Shape::GetKernel, L),
    rt("cudaGetKernel", K::Launch, Shape::GetKernel, L),
    rt("cudaGetFuncBySymbol", K::Launch, Shape::GetKernel, L),
    // Which device each thread works on (not events either).
    rt("cudaSetDevice", K::Alloc, Shape::SetDevice, M),
    drv("cuDevicePrimaryCtxRetain", K::Alloc, Shape::CtxRetain),
    drv("cuCtxSetCurrent", K::Alloc, Shape::CtxSet),
    drv("cuCtxPushCurrent_v2", K::Alloc, Shape::CtxSet),
    // The free memory PyTorch's OOM message gives (not an event either: it
    // goes into the OOM's `device_free`, in the BPF program).
    Probe { symbol: "cudaMemGetInfo", driver: false, kind: K::Oom, shape: Shape::MemInfo, group: Group::TorchRuntime },
    drv("cuMemAlloc_v2", K::Alloc, Shape::Alloc { stream: NO_STREAM }),
    drv("cuMemFree_v2", K::Free, Shape::Free { stream: NO_STREAM }),
    drv("cuMemAllocAsync", K::AllocAsync, Shape::Alloc { stream: Some(2) }),
    drv("cuMemAllocAsync_ptsz", K::AllocAsync, Shape::Alloc { stream: Some(2) }),
    drv("cuMemFreeAsync", K::FreeAsync, Shape::Free { stream: Some(1) }),
    drv("cuMemFreeAsync_ptsz", K::FreeAsync, Shape::Free { stream: Some(1) }),
    drv("cuMemCreate", K::MemCreate, Shape::Create),
    drv("cuMemRelease", K::MemRelease, Shape::Release),
    drv("cuMemMap", K::MemMap, Shape::Map),
    drv("cuMemUnmap", K::MemUnmap, Shape::Range),
    drv("cuMemAddressReserve", K::VaReserve, Shape::Alloc { stream: NO_STREAM }),
    drv("cuMemAddressFree", K::VaFree, Shape::Range),
    // PyTorch's allocator: found by demangled name, not by these labels
    // (src/record/torch.rs); the labels name them in trace.json.
    Probe { symbol: TORCH_MALLOC, driver: false, kind: K::BlockAlloc, shape: Shape::TorchMalloc, group: Group::Torch },
    Probe {
        symbol: "PyTorch allocator: free(void*)",
        driver: false,
        kind: K::BlockFree,
        shape: Shape::TorchFree { ptr: 0 },
        group: Group::Torch,
    },
    Probe {
        symbol: "PyTorch allocator: member free(void*)",
        driver: false,
        kind: K::BlockFree,
        shape: Shape::TorchFree { ptr: 1 },
        group: Group::Torch,
    },
];

/// The label of the allocator's malloc in [`PROBES`].
pub const TORCH_MALLOC: &str = "PyTorch allocator: malloc(void**, device, size, stream)";

/// The index in [`PROBES`] of the allocator probe of this role.
pub fn torch_probe(role: super::torch::Role) -> usize {
    PROBES
        .iter()
        .position(|p| match (role, p.shape) {
            (super::torch::Role::Malloc, Shape::TorchMalloc) => true,
            (super::torch::Role::Free { ptr }, Shape::TorchFree { ptr: q }) => ptr == q,
            _ => false,
        })
        .expect("every allocator role has a probe")
}

/// PyTorch's default rounding of a block (`round_size`: 512-byte multiples,
/// at least 512). The block it carves can be larger: the unsplit rest of a
/// cached block, or `roundup_power2_divisions`.
pub fn torch_block_size(requested: u64) -> u64 {
    requested.max(1).div_ceil(512) * 512
}

// The cookie's bits, from bpf/record.h through the skeleton.
const COOKIE_INDEX: u32 = cookie_bits::COOKIE_INDEX.0;
const COOKIE_DRIVER: u64 = cookie_bits::COOKIE_DRIVER.0 as u64;
const COOKIE_OUT_PTR: u64 = cookie_bits::COOKIE_OUT_PTR.0 as u64;
const COOKIE_STACK_ARGS: u64 = cookie_bits::COOKIE_STACK_ARGS.0 as u64;
const COOKIE_ALLOCATOR: u64 = cookie_bits::COOKIE_ALLOCATOR.0 as u64;
/// The cookie of the probes after each call to the allocator's malloc.
pub const COOKIE_LANDED: u64 = cookie_bits::COOKIE_LANDED.0 as u64;
const COOKIE_AT_ENTRY: u64 = cookie_bits::COOKIE_AT_ENTRY.0 as u64;
const COOKIE_UNRETURNED: u32 = cookie_bits::COOKIE_UNRETURNED.0;
/// The output pointer (or, with [`COOKIE_UNCACHED`], the size) is argument 2.
pub const COOKIE_OUT_ARG1: u64 = cookie_bits::COOKIE_OUT_ARG1.0 as u64;
/// A probe on a call instruction to the allocator's malloc, in place of its entry.
pub const COOKIE_CALL_SITE: u64 = cookie_bits::COOKIE_CALL_SITE.0 as u64;
/// A probe on a call that allocates without PyTorch's cache.
pub const COOKIE_UNCACHED: u64 = cookie_bits::COOKIE_UNCACHED.0 as u64;
/// A probe on a call to PyTorch's out-of-memory report.
pub const COOKIE_OOM_REPORT: u64 = cookie_bits::COOKIE_OOM_REPORT.0 as u64;
const COOKIE_FREE_REPORT: u64 = cookie_bits::COOKIE_FREE_REPORT.0 as u64;

/// The attach cookie of probe `index`.
pub fn cookie(index: usize) -> u64 {
    let p = &PROBES[index];
    let mut c = index as u64;
    if p.driver {
        c |= COOKIE_DRIVER;
    }
    if p.shape.writes_out_ptr() {
        c |= COOKIE_OUT_PTR;
    }
    if p.shape == Shape::Launch {
        // Written at entry: a return probe would cost a second trap per
        // launch (1 µs of the 1.7 a launch cost) for the return code alone.
        c |= COOKIE_STACK_ARGS | COOKIE_AT_ENTRY;
    }
    match p.shape {
        Shape::TorchMalloc => c |= COOKIE_ALLOCATOR | COOKIE_OUT_ARG1,
        Shape::TorchFree { .. } => c |= COOKIE_ALLOCATOR | COOKIE_AT_ENTRY,
        Shape::MemInfo => c |= COOKIE_FREE_REPORT,
        _ => {}
    }
    c
}

/// Whether probe `index` is written at its entry, with no return probe.
pub fn at_entry(index: usize) -> bool {
    cookie(index) & COOKIE_AT_ENTRY != 0
}

/// A record of the probes that follow each thread's device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceRecord {
    /// `cudaSetDevice`.
    Set {
        tid: u32,
        device: i32,
    },
    /// A context made for a device.
    Context {
        context: u64,
        device: i32,
    },
    /// A thread made a context current.
    Current {
        tid: u32,
        context: u64,
    },
    Failed,
}

/// Each thread's device, from the calls that set it, in the order each
/// thread made them (a thread's records reach the ring buffer in order).
/// A thread that set none works on device 0, as the CUDA runtime has it.
#[derive(Debug, Default)]
pub struct Devices {
    of_thread: std::collections::HashMap<u32, i32>,
    of_context: std::collections::HashMap<u64, i32>,
}

impl Devices {
    pub fn apply(&mut self, r: DeviceRecord) {
        match r {
            DeviceRecord::Set { tid, device } => {
                self.of_thread.insert(tid, device);
            }
            DeviceRecord::Context { context, device } => {
                self.of_context.insert(context, device);
            }
            DeviceRecord::Current { tid, context } => {
                if let Some(&d) = self.of_context.get(&context) {
                    self.of_thread.insert(tid, d);
                }
            }
            DeviceRecord::Failed => {}
        }
    }

    /// The device thread `tid` works on now.
    pub fn of(&self, tid: u32) -> i32 {
        self.of_thread.get(&tid).copied().unwrap_or(0)
    }
}

/// The device of each live PyTorch block, by process and address: a free
/// names only the pointer.
#[derive(Debug, Default)]
pub struct TorchBlocks {
    live: std::collections::HashMap<(u32, u64), i32>,
}

impl TorchBlocks {
    /// Notes a block's allocation, or gives a free the device of its block.
    pub fn apply(&mut self, e: &mut Event) {
        match e.kind {
            K::BlockAlloc => {
                self.live.insert((e.pid, e.addr), e.device.unwrap_or(0));
            }
            K::BlockFree => e.device = self.live.remove(&(e.pid, e.addr)),
            // Its blocks went with it (and its pid may come back).
            K::Exit => self.live.retain(|&(pid, _), _| pid != e.pid),
            _ => {}
        }
    }
}

/// A record of the probes that name kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelRecord {
    /// A kernel registered: its host function, and where its mangled
    /// device name lies in the process's memory.
    Function { pid: u32, host: u64, name_at: u64 },
    /// The handle a launch passes for a host function (CUDA 13).
    Handle { pid: u32, handle: u64, host: u64 },
    /// A lookup that failed: nothing to name.
    Failed,
}

/// One record as the BPF programs write it: `struct event` of
/// bpf/record.h, as the skeleton generates it.
pub type Raw = super::skel::types::event;

impl Raw {
    /// Reads a record from the ring buffer; `None` when it is too short.
    pub fn parse(b: &[u8]) -> Option<Raw> {
        if b.len() < std::mem::size_of::<Raw>() {
            return None;
        }
        // SAFETY: `Raw` is `#[repr(C)]` and made of integers only (the
        // cookie is a transparent u32), so every bit pattern is a value;
        // the length was checked and read_unaligned needs no alignment.
        Some(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<Raw>()) })
    }

    /// What this record says of a kernel's name, for the probes that name
    /// launches rather than record events.
    pub fn kernel(&self) -> Option<KernelRecord> {
        if self.cookie.0 & cookie_bits::COOKIE_EXIT.0 != 0 {
            return None;
        }
        let p = PROBES.get((self.cookie.0 & COOKIE_INDEX) as usize)?;
        match p.shape {
            Shape::Register => {
                Some(KernelRecord::Function { pid: self.pid, host: self.args[1], name_at: self.args[2] })
            }
            Shape::GetKernel if self.ret == 0 && self.result != 0 => {
                Some(KernelRecord::Handle { pid: self.pid, handle: self.result, host: self.args[1] })
            }
            Shape::GetKernel => Some(KernelRecord::Failed),
            _ => None,
        }
    }

    /// What this record says of a thread's device, for the probes that
    /// follow devices rather than record events. Failed calls change
    /// nothing.
    pub fn device(&self) -> Option<DeviceRecord> {
        if self.cookie.0 & cookie_bits::COOKIE_EXIT.0 != 0 {
            return None;
        }
        let p = PROBES.get((self.cookie.0 & COOKIE_INDEX) as usize)?;
        let ok = self.ret == 0;
        match p.shape {
            Shape::SetDevice => Some(if ok {
                DeviceRecord::Set { tid: self.tid, device: self.args[0] as i32 }
            } else {
                DeviceRecord::Failed
            }),
            Shape::CtxRetain => Some(if ok {
                DeviceRecord::Context { context: self.result, device: self.args[1] as i32 }
            } else {
                DeviceRecord::Failed
            }),
            Shape::CtxSet => Some(if ok {
                DeviceRecord::Current { tid: self.tid, context: self.args[0] }
            } else {
                DeviceRecord::Failed
            }),
            _ => None,
        }
    }

    /// The event this record describes; `None` for a cookie that names no
    /// probe (never written by this recorder).
    pub fn decode(&self) -> Option<Event> {
        if self.cookie.0 & cookie_bits::COOKIE_EXIT.0 != 0 {
            return Some(self.event(K::Exit, 0, 0, None, Cuda::default()));
        }
        let p = PROBES.get((self.cookie.0 & COOKIE_INDEX) as usize)?;
        let a = &self.args;
        let ok = self.ret == 0;
        let ustack = u32::try_from(self.stack_id).ok();
        let caller = (self.caller != 0).then_some(self.caller);
        let mut cuda = Cuda { call: Some(p.symbol), ustack, caller, ..Cuda::default() };
        let (addr, size, stream) = match p.shape {
            // A failed call's output is not an allocation.
            Shape::Alloc { stream } => (if ok { self.result } else { 0 }, a[1], stream),
            Shape::Free { stream } => (a[0], 0, stream),
            Shape::Memcpy { stream } => {
                cuda.src = Some(a[1]);
                cuda.copy_kind = Some(a[3] as i32);
                (a[0], a[2], stream)
            }
            Shape::Launch => {
                // dim3 is 12 bytes, passed in two registers: (x | y << 32), z.
                let lo = |v: u64| v as u32;
                let hi = |v: u64| (v >> 32) as u32;
                cuda.launch = Some(Launch {
                    grid: [lo(a[1]), hi(a[1]), lo(a[2])],
                    block: [lo(a[3]), hi(a[3]), lo(a[4])],
                    shared_mem: self.stack[0],
                });
                return Some(self.event(p.kind, a[0], 0, Some(self.stack[1]), cuda));
            }
            Shape::Range => (a[0], a[1], None),
            Shape::Create => {
                cuda.handle = ok.then_some(self.result);
                (0, a[1], None)
            }
            Shape::Release => {
                cuda.handle = Some(a[0]);
                (0, 0, None)
            }
            Shape::Map => {
                cuda.handle = Some(a[3]);
                (a[0], a[1], None)
            }
            Shape::TorchMalloc => {
                // A call that threw never returned: PyTorch's out-of-memory.
                let (kind, addr) =
                    if self.cookie.0 & COOKIE_UNRETURNED != 0 { (K::Oom, 0) } else { (K::BlockAlloc, self.result) };
                // As a snapshot has them: an OOM's size is the request.
                let size = if kind == K::Oom { a[3] } else { torch_block_size(a[3]) };
                let mut e = self.event(kind, addr, size, Some(a[4]), cuda);
                if kind == K::BlockAlloc {
                    // Stamped when malloc returned, as a snapshot's `alloc`:
                    // the segment it may have had to get comes first.
                    e.ts_ns = self.ts.saturating_add(self.dur);
                }
                // `device` is a signed char (an int before 2.3): its low byte.
                e.device = Some(a[2] as u8 as i8 as i32);
                e.extra.requested = Some(a[3]);
                // The free memory CUDA reported to it as it failed: the
                // figure of PyTorch's error message.
                if kind == K::Oom && self.stack[1] == 1 {
                    e.extra.device_free = Some(self.stack[0]);
                }
                e.ret = 0;
                return Some(e);
            }
            Shape::TorchFree { ptr } => (a[ptr], 0, None),
            Shape::Register
            | Shape::GetKernel
            | Shape::SetDevice
            | Shape::CtxRetain
            | Shape::CtxSet
            | Shape::MemInfo => return None,
        };
        Some(self.event(p.kind, addr, size, stream.map(|i| a[i]), cuda))
    }

    fn event(&self, kind: EventKind, addr: u64, size: u64, stream: Option<u64>, cuda: Cuda) -> Event {
        Event {
            ts_ns: self.ts,
            duration_ns: self.dur,
            pid: self.pid,
            tid: self.tid,
            kind,
            addr,
            size,
            ret: self.ret,
            device: None,
            stream,
            extra: Default::default(),
            cuda,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(symbol: &str, args: [u64; 6], result: u64, ret: i32) -> Raw {
        let index = PROBES.iter().position(|p| p.symbol == symbol).unwrap();
        Raw {
            ts: 10,
            dur: 5,
            args,
            result,
            pid: 7,
            tid: 8,
            ret,
            cookie: cookie_bits(cookie(index) as u32),
            ..Raw::default()
        }
    }

    #[test]
    fn parse_reads_the_c_layout() {
        // The layout of struct event: 11 u64, 6 u32-sized fields, the caller.
        const RAW_SIZE: usize = 8 * 11 + 4 * 6 + 8;
        assert_eq!(std::mem::size_of::<Raw>(), RAW_SIZE);
        let mut b = vec![0u8; RAW_SIZE];
        for i in 0..11 {
            b[i * 8..i * 8 + 8].copy_from_slice(&(i as u64 + 1).to_ne_bytes());
        }
        for (i, v) in [70u32, 80, (-2i32) as u32, 3, (-1i32) as u32].iter().enumerate() {
            b[88 + i * 4..92 + i * 4].copy_from_slice(&v.to_ne_bytes());
        }
        let r = Raw::parse(&b).unwrap();
        assert_eq!((r.ts, r.dur, r.args[5], r.stack, r.result), (1, 2, 8, [9, 10], 11));
        assert_eq!((r.pid, r.tid, r.ret, r.cookie.0, r.stack_id), (70, 80, -2, 3, -1));
        assert!(Raw::parse(&b[..RAW_SIZE - 1]).is_none());
    }

    #[test]
    fn allocations_take_the_result_only_when_they_succeed() {
        let e = raw("cudaMalloc", [0x1000, 4096, 0, 0, 0, 0], 0x7f00_0000_0000, 0).decode().unwrap();
        assert_eq!(
            (e.kind, e.addr, e.size, e.ret, e.cuda.call),
            (K::Alloc, 0x7f00_0000_0000, 4096, 0, Some("cudaMalloc"))
        );
        let e = raw("cudaMalloc", [0x1000, 4096, 0, 0, 0, 0], 0xdead, 2).decode().unwrap();
        assert_eq!((e.addr, e.size, e.ret), (0, 4096, 2));
        assert!(e.is_oom());
        let e = raw("cuMemAllocAsync", [0x1000, 64, 0x55, 0, 0, 0], 0x42, 0).decode().unwrap();
        assert_eq!((e.kind, e.addr, e.stream), (K::AllocAsync, 0x42, Some(0x55)));
    }

    #[test]
    fn memcpy_launch_and_vmm_fields() {
        let e = raw("cudaMemcpyAsync", [0xd, 0x5, 100, 1, 0x77, 0], 0, 0).decode().unwrap();
        assert_eq!((e.addr, e.size, e.cuda.src, e.cuda.copy_kind, e.stream), (0xd, 100, Some(5), Some(1), Some(0x77)));
        let mut r = raw("cudaLaunchKernel", [0xf00, 4 | 2 << 32, 1, 128 | 1 << 32, 1, 0], 0, 0);
        r.stack = [256, 0x99];
        let e = r.decode().unwrap();
        let l = e.cuda.launch.unwrap();
        assert_eq!((e.addr, l.grid, l.block, l.shared_mem, e.stream), (0xf00, [4, 2, 1], [128, 1, 1], 256, Some(0x99)));
        let e = raw("cuMemMap", [0xa000, 2 << 20, 0, 9, 0, 0], 0, 0).decode().unwrap();
        assert_eq!((e.kind, e.addr, e.size, e.cuda.handle), (K::MemMap, 0xa000, 2 << 20, Some(9)));
        let e = raw("cuMemCreate", [0x1000, 2 << 20, 0, 0, 0, 0], 9, 0).decode().unwrap();
        assert_eq!((e.kind, e.addr, e.size, e.cuda.handle), (K::MemCreate, 0, 2 << 20, Some(9)));
    }

    #[test]
    fn exit_records_become_exit_events() {
        let r = Raw { ts: 99, pid: 7, tid: 7, cookie: cookie_bits::COOKIE_EXIT, stack_id: -1, ..Raw::default() };
        let e = r.decode().unwrap();
        assert_eq!(
            (e.kind, e.ts_ns, e.pid, e.addr, e.size, e.cuda.call, e.cuda.ustack),
            (K::Exit, 99, 7, 0, 0, None, None)
        );
        assert!(!e.is_oom());
    }

    #[test]
    fn cookies_carry_the_flags_the_bpf_side_reads() {
        let at = |s: &str| cookie(PROBES.iter().position(|p| p.symbol == s).unwrap());
        assert_eq!(at("cudaMalloc") & (COOKIE_DRIVER | COOKIE_OUT_PTR | COOKIE_STACK_ARGS), COOKIE_OUT_PTR);
        assert_eq!(at("cuMemFree_v2") & (COOKIE_DRIVER | COOKIE_OUT_PTR), COOKIE_DRIVER);
        assert_ne!(at("cudaLaunchKernel") & COOKIE_STACK_ARGS, 0);
        assert!(PROBES.len() < COOKIE_INDEX as usize);
        assert!((0..PROBES.len()).all(|i| cookie(i) as u32 & cookie_bits::COOKIE_EXIT.0 == 0));
        // cudaMemGetInfo: its free memory read at return and kept with the
        // allocation in flight, at the runtime's level.
        let info = at("cudaMemGetInfo");
        assert_eq!(info & (COOKIE_FREE_REPORT | COOKIE_OUT_PTR), COOKIE_FREE_REPORT | COOKIE_OUT_PTR);
        assert_eq!(info & (COOKIE_ALLOCATOR | COOKIE_STACK_ARGS | COOKIE_DRIVER | COOKIE_AT_ENTRY), 0);
    }

    /// An allocation that never returned is an OOM with the free memory
    /// the BPF program kept with it (`stack`: the figure, and 1), or none;
    /// one that returned is a block, whatever `stack` holds.
    #[test]
    fn an_oom_carries_the_free_memory_kept_with_its_call() {
        let args = [0x5000, 0x7ff0_0000_1000, 0, 6 << 20, 0, 0];
        let mut r = raw(TORCH_MALLOC, args, 0x7f00_0000_0000, 0);
        r.stack = [2 << 20, 1];
        let block = r.decode().unwrap();
        assert_eq!((block.kind, block.extra.device_free), (K::BlockAlloc, None));
        r.cookie.0 |= COOKIE_UNRETURNED;
        let oom = r.decode().unwrap();
        assert_eq!((oom.kind, oom.size, oom.extra.device_free), (K::Oom, 6 << 20, Some(2 << 20)));
        r.stack = [0, 0];
        assert_eq!(r.decode().unwrap().extra.device_free, None);
        // cudaMemGetInfo itself is never an event.
        assert!(raw("cudaMemGetInfo", [0x10, 0x18, 0, 0, 0, 0], 1 << 30, 0).decode().is_none());
    }
}
