/* Stand-in for the CUDA driver (libcuda.so.1) used by fragscope's record
 * tests: a first-fit device allocator over a fake address range, and the
 * virtual-memory calls PyTorch's expandable segments use. Not NVIDIA code;
 * only the signatures and return codes follow the CUDA driver API. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUstream;
typedef int CUresult;
enum { CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_OUT_OF_MEMORY = 2 };

#define BASE 0x7f0000000000ull
#define VA_BASE 0x7e0000000000ull
#define ALIGN 512ull
#define MAX_BLOCKS 65536

struct block { CUdeviceptr addr; size_t size; };
static struct block blocks[MAX_BLOCKS]; /* sorted by address */
static int nblocks;
static CUdeviceptr va_next = VA_BASE;
static size_t physical_used;
static CUmemGenericAllocationHandle next_handle = 1;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static size_t capacity(void)
{
	const char *c = getenv("STANDIN_CAPACITY");
	return c ? strtoull(c, NULL, 0) : (1ull << 30);
}

/* Exported for the stand-in runtime (cudaMallocManaged), not a CUDA name. */
CUresult standin_device_alloc(CUdeviceptr *dptr, size_t bytes)
{
	if (!dptr || bytes == 0)
		return CUDA_ERROR_INVALID_VALUE;
	size_t need = (bytes + ALIGN - 1) & ~(ALIGN - 1);
	pthread_mutex_lock(&lock);
	CUdeviceptr at = BASE;
	int i = 0;
	for (; i < nblocks; i++) {
		if (blocks[i].addr - at >= need)
			break;
		at = blocks[i].addr + blocks[i].size;
	}
	if (at + need > BASE + capacity() || nblocks == MAX_BLOCKS) {
		pthread_mutex_unlock(&lock);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	memmove(&blocks[i + 1], &blocks[i], (nblocks - i) * sizeof(blocks[0]));
	blocks[i].addr = at;
	blocks[i].size = need;
	nblocks++;
	pthread_mutex_unlock(&lock);
	*dptr = at;
	return CUDA_SUCCESS;
}

CUresult standin_device_free(CUdeviceptr dptr)
{
	pthread_mutex_lock(&lock);
	for (int i = 0; i < nblocks; i++) {
		if (blocks[i].addr == dptr) {
			memmove(&blocks[i], &blocks[i + 1], (nblocks - i - 1) * sizeof(blocks[0]));
			nblocks--;
			pthread_mutex_unlock(&lock);
			return CUDA_SUCCESS;
		}
	}
	pthread_mutex_unlock(&lock);
	return CUDA_ERROR_INVALID_VALUE;
}

/* Free device memory: the capacity less what the blocks and the physical
 * allocations of the virtual-memory calls hold. */
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
	if (!free_bytes || !total)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&lock);
	size_t used = physical_used;
	for (int i = 0; i < nblocks; i++)
		used += blocks[i].size;
	pthread_mutex_unlock(&lock);
	*total = capacity();
	*free_bytes = used < *total ? *total - used : 0;
	return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) { return standin_device_alloc(dptr, bytesize); }
CUresult cuMemFree_v2(CUdeviceptr dptr) { return standin_device_free(dptr); }
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s) { (void)s; return standin_device_alloc(dptr, bytesize); }
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) { (void)s; return standin_device_free(dptr); }

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags)
{
	(void)alignment; (void)addr; (void)flags;
	if (!ptr || size == 0)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&lock);
	*ptr = va_next;
	va_next += (size + (2ull << 20) - 1) & ~((2ull << 20) - 1);
	pthread_mutex_unlock(&lock);
	return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) { (void)ptr; (void)size; return CUDA_SUCCESS; }

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const void *prop, unsigned long long flags)
{
	(void)prop; (void)flags;
	if (!handle || size == 0)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&lock);
	if (physical_used + size > capacity()) {
		pthread_mutex_unlock(&lock);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	physical_used += size;
	*handle = next_handle++;
	pthread_mutex_unlock(&lock);
	return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) { return handle ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags)
{
	(void)offset; (void)flags;
	return ptr && size && handle ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) { return ptr && size ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

/* Contexts: one primary context per device, a heap object. */
typedef struct standin_ctx { int device; } *CUcontext;
static struct standin_ctx primary[8];
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, int dev)
{
	if (!pctx || dev < 0 || dev >= 8)
		return CUDA_ERROR_INVALID_VALUE;
	primary[dev].device = dev;
	*pctx = &primary[dev];
	return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext ctx) { return ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

