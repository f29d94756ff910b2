// Stand-in for PyTorch's libc10_cuda.so, for fragscope's record tests of the
// allocator probes (issue 40). The functions the recorder probes have the
// mangled names of PyTorch's (2.3 and later) and, as in PyTorch's wheels,
// are local symbols: in .symtab, not exported. A small caching allocator
// carves blocks out of 2 MiB segments it gets from the stand-in runtime's
// cudaMalloc, and throws on out-of-memory as PyTorch does, so the unwinding
// through the probed frames is tested too. Not PyTorch code.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <map>
#include <mutex>
#include <stdexcept>

// PyTorch's static probe on an allocation (USDT `pytorch:malloc`, since
// 2.2): in `allocate`, after `malloc` returned, behind a semaphore that a
// tracer raises. The recorder puts its probe there rather than after the
// call (a `nop` costs one trap; the instruction after a call is stepped
// out of line, about ten times slower in a virtual machine).
// STANDIN_NO_SDT builds the allocator of a PyTorch before 2.2, without it.
#ifndef STANDIN_NO_SDT
#define _SDT_HAS_SEMAPHORES 1
#include <sys/sdt.h>
__attribute__((section(".probes"), visibility("hidden"))) volatile unsigned short pytorch_malloc_semaphore;
#endif

// Where PyTorch reports an out-of-memory to its profiler, in libc10.so
// (here c10.cpp), called through the PLT as PyTorch's allocator does.
namespace c10 {
struct Device {
	signed char type; // DeviceType: CUDA is 1
	signed char index;
};
void reportOutOfMemoryToProfiler(long alloc_size, unsigned long total_allocated, unsigned long total_reserved,
				 Device device);
} // namespace c10

extern "C" int cudaMalloc(void **devPtr, size_t size);
extern "C" int cudaFree(void *devPtr);
extern "C" int cudaMemGetInfo(size_t *free_bytes, size_t *total);

struct CUstream_st;

#define LOCAL __attribute__((visibility("hidden"), noinline))
#define EXPORT extern "C" __attribute__((visibility("default")))

namespace c10 {
namespace cuda {
namespace CUDACachingAllocator {
namespace Native {

struct OutOfMemoryError : std::runtime_error {
	OutOfMemoryError(size_t n, size_t device_free)
	    : std::runtime_error("CUDA out of memory"), size(n), device_free(device_free) {}
	size_t size;
	size_t device_free; // what CUDA reported free, as PyTorch's message says
};

class NativeCachingAllocator {
      public:
	LOCAL void malloc(void **devPtr, signed char device, unsigned long size, CUstream_st *stream);
	// A tensor's allocation, as PyTorch's `allocate` (DataPtr) makes it.
	LOCAL void *allocate(unsigned long size, signed char device);
	LOCAL void free(void *ptr);
	// free's body, inlined where PyTorch inlines it (local_raw_delete).
	inline __attribute__((always_inline)) void free_block(void *ptr);
	LOCAL void raw_delete(void *ptr);
	LOCAL void *raw_alloc(unsigned long size);
	void empty_cache();

      private:
	struct Segment {
		size_t size;
		std::map<uintptr_t, size_t> free; // offset ranges not in use
		size_t used = 0;
	};
	bool carve(size_t size, uintptr_t *out);
	void release_unused();
	std::mutex lock_;
	std::map<uintptr_t, Segment> segments_;  // base -> segment
	std::map<uintptr_t, size_t> live_;       // block -> size
};

static NativeCachingAllocator allocator;
static const size_t kSegment = 2u << 20;

static size_t round_size(size_t n) { return n < 512 ? 512 : (n + 511) / 512 * 512; }

bool NativeCachingAllocator::carve(size_t size, uintptr_t *out)
{
	for (auto &[base, seg] : segments_) {
		for (auto it = seg.free.begin(); it != seg.free.end(); ++it) {
			if (it->second < size)
				continue;
			uintptr_t at = it->first;
			size_t rest = it->second - size;
			seg.free.erase(it);
			if (rest)
				seg.free[at + size] = rest;
			seg.used += size;
			*out = at;
			return true;
		}
	}
	return false;
}

void NativeCachingAllocator::malloc(void **devPtr, signed char device, unsigned long size, CUstream_st *stream)
{
	(void)device;
	(void)stream;
	std::lock_guard<std::mutex> g(lock_);
	size_t n = round_size(size);
	uintptr_t at = 0;
	if (!carve(n, &at)) {
		size_t seg = n <= kSegment ? kSegment : (n + kSegment - 1) / kSegment * kSegment;
		void *p = nullptr;
		if (cudaMalloc(&p, seg) != 0) {
			// Release the cached segments no block uses, then try again.
			release_unused();
			if (cudaMalloc(&p, seg) != 0) {
				// As PyTorch does for its error message and its
				// history's `oom` entry.
				size_t device_free = 0, device_total = 0;
				cudaMemGetInfo(&device_free, &device_total);
				size_t reserved = 0;
				for (auto &sg : segments_)
					reserved += sg.second.size;
				c10::reportOutOfMemoryToProfiler((long)n, 0, reserved, c10::Device{1, device});
				throw OutOfMemoryError(size, device_free);
			}
		}
		Segment s;
		s.size = seg;
		s.free[(uintptr_t)p] = seg;
		segments_[(uintptr_t)p] = s;
		carve(n, &at);
	}
	live_[at] = n;
	*devPtr = (void *)at;
}

// PYTORCH_NO_CUDA_MEMORY_CACHING: each tensor is a cudaMalloc of its own,
// freed by uncached_delete. PyTorch's static probe follows it too.
static bool force_uncached()
{
	static const bool force = getenv("PYTORCH_NO_CUDA_MEMORY_CACHING") != nullptr;
	return force;
}

LOCAL void *uncached_allocate(unsigned long size)
{
	void *p = nullptr;
	if (cudaMalloc(&p, size) != 0) {
		size_t device_free = 0, device_total = 0;
		cudaMemGetInfo(&device_free, &device_total);
		throw OutOfMemoryError(size, device_free);
	}
	return p;
}

LOCAL void uncached_delete(void *ptr) { cudaFree(ptr); }

void *NativeCachingAllocator::allocate(unsigned long size, signed char device)
{
	void *devPtr = nullptr;
	// PyTorch calls uncached_allocate (2.8, 2.14, 2.15) or inlines its
	// cudaMalloc (2.2 to 2.7, 2.9 to 2.13): both, by STANDIN_UNCACHED_INLINE.
	if (force_uncached() && getenv("STANDIN_UNCACHED_INLINE")) {
		if (cudaMalloc(&devPtr, size) != 0)
			throw OutOfMemoryError(size, 0);
	} else if (force_uncached())
		devPtr = uncached_allocate(size);
	else if (size != 0) {
		malloc(&devPtr, device, size, nullptr);
#ifdef STANDIN_NO_SDT
		// As in PyTorch 1.13 to 2.1, the instruction after the call reads
		// what the call wrote (one the kernel steps out of line), and a
		// jump comes soon after (record probes the jump).
		if (devPtr == nullptr)
			throw std::invalid_argument("no pointer");
#endif
	}
#ifndef STANDIN_NO_SDT
	if (size && pytorch_malloc_semaphore)
		STAP_PROBE4(pytorch, malloc, devPtr, device, size, 0);
#endif
	return devPtr;
}

void NativeCachingAllocator::free(void *ptr) { free_block(ptr); }

void NativeCachingAllocator::free_block(void *ptr)
{
	std::lock_guard<std::mutex> g(lock_);
	auto b = live_.find((uintptr_t)ptr);
	if (b == live_.end())
		throw std::invalid_argument("invalid device pointer");
	auto seg = std::prev(segments_.upper_bound(b->first));
	seg->second.free[b->first] = b->second;
	seg->second.used -= b->second;
	// Coalesce with the free neighbours.
	auto &f = seg->second.free;
	auto it = f.find(b->first);
	if (auto next = std::next(it); next != f.end() && it->first + it->second == next->first) {
		it->second += next->second;
		f.erase(next);
	}
	if (it != f.begin()) {
		auto prev = std::prev(it);
		if (prev->first + prev->second == it->first) {
			prev->second += it->second;
			f.erase(it);
		}
	}
	live_.erase(b);
}

// As in PyTorch 2.6, raw_delete goes through free: the recorder must
// count such a free once.
void NativeCachingAllocator::raw_delete(void *ptr) { free(ptr); }

void *NativeCachingAllocator::raw_alloc(unsigned long size)
{
	void *p = nullptr;
	malloc(&p, 0, size, nullptr);
	return p;
}

void NativeCachingAllocator::empty_cache()
{
	std::lock_guard<std::mutex> g(lock_);
	release_unused();
}

// The cached segments no block uses go back to the runtime (lock held).
void NativeCachingAllocator::release_unused()
{
	for (auto it = segments_.begin(); it != segments_.end();) {
		if (it->second.used == 0) {
			cudaFree((void *)it->first);
			it = segments_.erase(it);
		} else {
			++it;
		}
	}
}

// A tensor's deleter: as in PyTorch 2.1 and later, it frees without
// calling free().
LOCAL void local_raw_delete(void *ptr)
{
	allocator.free_block(ptr);
}

} // namespace Native
} // namespace CUDACachingAllocator
} // namespace cuda
} // namespace c10

using c10::cuda::CUDACachingAllocator::Native::allocator;
using c10::cuda::CUDACachingAllocator::Native::OutOfMemoryError;

static size_t last_oom_free;

// What the stand-in workload calls: a tensor's allocation (0, or 2 when the
// allocator threw OutOfMemoryError), its deleter, and the raw interface.
EXPORT int standin_torch_alloc(void **out, size_t size, int device)
{
	try {
		*out = allocator.allocate(size, (signed char)device);
		return 0;
	} catch (const OutOfMemoryError &e) {
		*out = nullptr;
		last_oom_free = e.device_free;
		return 2;
	}
}
// The free memory CUDA reported at the last out-of-memory.
EXPORT size_t standin_torch_oom_free() { return last_oom_free; }
EXPORT void standin_torch_free(void *ptr)
{
	// The deleter allocate gave the tensor.
	if (c10::cuda::CUDACachingAllocator::Native::force_uncached())
		c10::cuda::CUDACachingAllocator::Native::uncached_delete(ptr);
	else
		c10::cuda::CUDACachingAllocator::Native::local_raw_delete(ptr);
}
EXPORT void *standin_torch_raw_alloc(size_t size) { return allocator.raw_alloc(size); }
// The raw interface, with its out-of-memory caught (0, or 2).
EXPORT int standin_torch_raw_alloc_caught(void **out, size_t size)
{
	try {
		*out = allocator.raw_alloc(size);
		return 0;
	} catch (const OutOfMemoryError &e) {
		*out = nullptr;
		last_oom_free = e.device_free;
		return 2;
	}
}
EXPORT void standin_torch_raw_delete(void *ptr) { allocator.raw_delete(ptr); }
EXPORT void standin_torch_empty_cache() { allocator.empty_cache(); }
