// Stand-in for PyTorch's libc10.so: the one function of it the recorder
// probes calls to, where PyTorch's allocator reports an out-of-memory to
// its profiler (c10/core/Allocator.cpp). Not PyTorch code.
namespace c10 {
struct Device {
	signed char type;
	signed char index;
};
__attribute__((visibility("default"), noinline)) void
reportOutOfMemoryToProfiler(long alloc_size, unsigned long total_allocated, unsigned long total_reserved, Device device)
{
	(void)alloc_size;
	(void)total_allocated;
	(void)total_reserved;
	(void)device;
	__asm__ volatile("" ::: "memory");
}
} // namespace c10
