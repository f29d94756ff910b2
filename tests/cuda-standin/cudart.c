/* Stand-in for the CUDA runtime (libcudart.so.12) used by fragscope's
 * record tests. Device allocations go through the stand-in driver's
 * cuMemAlloc_v2, as the real runtime's go through libcuda, so the tests
 * check that one allocation is recorded once. Not NVIDIA code. */
#include <stdint.h>
#include <stdlib.h>

typedef int cudaError_t;
typedef void *cudaStream_t;
typedef struct { unsigned x, y, z; } dim3;
typedef unsigned long long CUdeviceptr;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2, cudaErrorInvalidDeviceFunction = 98 };

int cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
int cuMemFree_v2(CUdeviceptr dptr);
int cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, void *stream);
int cuMemFreeAsync(CUdeviceptr dptr, void *stream);
int standin_device_alloc(CUdeviceptr *dptr, size_t bytes);
int cuMemGetInfo_v2(size_t *free_bytes, size_t *total);

static cudaError_t from_driver(int r) { return r == 0 ? cudaSuccess : r == 2 ? cudaErrorMemoryAllocation : cudaErrorInvalidValue; }

cudaError_t cudaMalloc(void **devPtr, size_t size)
{
	CUdeviceptr p = 0;
	int r = cuMemAlloc_v2(&p, size);
	if (devPtr)
		*devPtr = r == 0 ? (void *)p : NULL;
	return from_driver(r);
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) { return from_driver(cuMemGetInfo_v2(free_bytes, total)); }

cudaError_t cudaFree(void *devPtr) { return devPtr ? from_driver(cuMemFree_v2((CUdeviceptr)devPtr)) : cudaSuccess; }

cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t stream)
{
	CUdeviceptr p = 0;
	int r = cuMemAllocAsync(&p, size, stream);
	if (devPtr)
		*devPtr = r == 0 ? (void *)p : NULL;
	return from_driver(r);
}

cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t stream) { return from_driver(cuMemFreeAsync((CUdeviceptr)devPtr, stream)); }

cudaError_t cudaMallocManaged(void **devPtr, size_t size, unsigned flags)
{
	(void)flags;
	CUdeviceptr p = 0;
	int r = standin_device_alloc(&p, size); /* not a probed driver call */
	if (devPtr)
		*devPtr = r == 0 ? (void *)p : NULL;
	return from_driver(r);
}

cudaError_t cudaHostAlloc(void **pHost, size_t size, unsigned flags)
{
	(void)flags;
	if (!pHost)
		return cudaErrorInvalidValue;
	*pHost = malloc(size);
	return *pHost ? cudaSuccess : cudaErrorMemoryAllocation;
}

/* Calls the exported cudaHostAlloc, so its probe fires inside this one:
 * the recorder must report the outer call only. */
cudaError_t cudaMallocHost(void **ptr, size_t size) { return cudaHostAlloc(ptr, size, 0); }
cudaError_t cudaFreeHost(void *ptr) { free(ptr); return cudaSuccess; }

cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, int kind)
{
	(void)dst; (void)src; (void)count;
	return kind >= 0 && kind <= 4 ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, cudaStream_t stream)
{
	(void)stream;
	return cudaMemcpy(dst, src, count, kind);
}

/* The thread's device (the stand-in has devices 0 to 7, all alike). */
cudaError_t cudaSetDevice(int device) { return device >= 0 && device < 8 ? cudaSuccess : cudaErrorInvalidValue; }

/* What nvcc's host code calls before any launch: each kernel's host
 * function registered with its mangled device name. */
void __cudaRegisterFunction(void **module, const char *hostFun, char *deviceFun, const char *deviceName,
			    int threadLimit, void *tid, void *bid, void *bDim, void *gDim, int *wSize)
{
	(void)module; (void)hostFun; (void)deviceFun; (void)deviceName; (void)threadLimit;
	(void)tid; (void)bid; (void)bDim; (void)gDim; (void)wSize;
}

/* CUDA 13's launches pass a handle made for the host function, an object
 * in the heap, not the host function itself. */
struct kernel_handle { const void *host; };

static cudaError_t get_kernel(void **kernel, const void *hostFun)
{
	if (!kernel || !hostFun)
		return cudaErrorInvalidDeviceFunction;
	struct kernel_handle *h = malloc(sizeof *h);
	h->host = hostFun;
	*kernel = h;
	return cudaSuccess;
}

cudaError_t __cudaGetKernel(void **kernel, const void *hostFun) { return get_kernel(kernel, hostFun); }
cudaError_t cudaGetKernel(void **kernel, const void *hostFun) { return get_kernel(kernel, hostFun); }

cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args, size_t sharedMem, cudaStream_t stream)
{
	(void)args; (void)sharedMem; (void)stream;
	if (!func || !gridDim.x || !blockDim.x)
		return cudaErrorInvalidDeviceFunction;
	return cudaSuccess;
}
