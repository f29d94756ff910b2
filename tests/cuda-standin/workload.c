/* Workloads for fragscope's record tests. Each call's outcome is logged
 * as ground truth, one line per call after it returns:
 *     pid tid call ret addr size
 * (addr: the result of an allocation, 0 when it failed; the pointer
 * freed; memcpy's destination; the kernel function). Lines are buffered
 * per thread and appended to $GT_LOG at the end, so logging does not
 * perturb the timing of the calls. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct { unsigned x, y, z; } dim3;
typedef unsigned long long CUdeviceptr;

/* Resolved at start (linked) or after dlopen (mode dlopen). */
static int (*p_cudaMalloc)(void **, size_t);
static int (*p_cudaFree)(void *);
static int (*p_cudaMallocAsync)(void **, size_t, void *);
static int (*p_cudaFreeAsync)(void *, void *);
static int (*p_cudaMallocManaged)(void **, size_t, unsigned);
static int (*p_cudaMallocHost)(void **, size_t);
static int (*p_cudaHostAlloc)(void **, size_t, unsigned);
static int (*p_cudaFreeHost)(void *);
static int (*p_cudaMemcpy)(void *, const void *, size_t, int);
static int (*p_cudaMemcpyAsync)(void *, const void *, size_t, int, void *);
static int (*p_cudaLaunchKernel)(const void *, dim3, dim3, void **, size_t, void *);
static int (*p_cuMemAlloc_v2)(CUdeviceptr *, size_t);
static int (*p_cuMemFree_v2)(CUdeviceptr);
static int (*p_cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
static int (*p_cuMemAddressFree)(CUdeviceptr, size_t);
static int (*p_cuMemCreate)(unsigned long long *, size_t, const void *, unsigned long long);
static int (*p_cuMemRelease)(unsigned long long);
static int (*p_cuMemMap)(CUdeviceptr, size_t, size_t, unsigned long long, unsigned long long);
static int (*p_cuMemUnmap)(CUdeviceptr, size_t);

#ifndef DLOPEN_ONLY
int cudaMalloc(void **, size_t);
int cudaFree(void *);
int cudaMallocAsync(void **, size_t, void *);
int cudaFreeAsync(void *, void *);
int cudaMallocManaged(void **, size_t, unsigned);
int cudaMallocHost(void **, size_t);
int cudaHostAlloc(void **, size_t, unsigned);
int cudaFreeHost(void *);
int cudaMemcpy(void *, const void *, size_t, int);
int cudaMemcpyAsync(void *, const void *, size_t, int, void *);
int cudaLaunchKernel(const void *, dim3, dim3, void **, size_t, void *);
int cuMemAlloc_v2(CUdeviceptr *, size_t);
int cuMemFree_v2(CUdeviceptr);
int cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
int cuMemAddressFree(CUdeviceptr, size_t);
int cuMemCreate(unsigned long long *, size_t, const void *, unsigned long long);
int cuMemRelease(unsigned long long);
int cuMemMap(CUdeviceptr, size_t, size_t, unsigned long long, unsigned long long);
int cuMemUnmap(CUdeviceptr, size_t);

static void bind_linked(void)
{
	p_cudaMalloc = cudaMalloc; p_cudaFree = cudaFree;
	p_cudaMallocAsync = cudaMallocAsync; p_cudaFreeAsync = cudaFreeAsync;
	p_cudaMallocManaged = cudaMallocManaged; p_cudaMallocHost = cudaMallocHost;
	p_cudaHostAlloc = cudaHostAlloc; p_cudaFreeHost = cudaFreeHost;
	p_cudaMemcpy = cudaMemcpy; p_cudaMemcpyAsync = cudaMemcpyAsync;
	p_cudaLaunchKernel = cudaLaunchKernel;
	p_cuMemAlloc_v2 = cuMemAlloc_v2; p_cuMemFree_v2 = cuMemFree_v2;
	p_cuMemAddressReserve = cuMemAddressReserve; p_cuMemAddressFree = cuMemAddressFree;
	p_cuMemCreate = cuMemCreate; p_cuMemRelease = cuMemRelease;
	p_cuMemMap = cuMemMap; p_cuMemUnmap = cuMemUnmap;
}
#endif

/* ---- ground truth ---- */
struct log { char *buf; size_t len, cap; };
static __thread struct log tlog;

static void gt(const char *call, int ret, uint64_t addr, uint64_t size)
{
	char line[160];
	int n = snprintf(line, sizeof line, "%d %ld %s %d %llu %llu\n", getpid(), (long)syscall(SYS_gettid), call, ret,
			 (unsigned long long)addr, (unsigned long long)size);
	if (tlog.len + n > tlog.cap) {
		tlog.cap = tlog.cap ? tlog.cap * 2 : 1 << 16;
		tlog.buf = realloc(tlog.buf, tlog.cap);
	}
	memcpy(tlog.buf + tlog.len, line, n);
	tlog.len += n;
}

static void gt_flush(void)
{
	const char *path = getenv("GT_LOG");
	if (!path || !tlog.len)
		return;
	int fd = open(path, O_WRONLY | O_APPEND | O_CREAT, 0644);
	if (fd >= 0) {
		if (write(fd, tlog.buf, tlog.len) < 0)
			perror("GT_LOG");
		close(fd);
	}
	tlog.len = 0;
}

/* ---- calls, each logged ---- */
static void *c_malloc(size_t n) { void *p = 0; int r = p_cudaMalloc(&p, n); gt("cudaMalloc", r, r ? 0 : (uint64_t)p, n); return r ? 0 : p; }
static void c_free(void *p) { gt("cudaFree", p_cudaFree(p), (uint64_t)p, 0); }

/* The host stub nvcc would emit for `__global__ void add_kernel(float *,
 * float *)`: it carries the kernel's C++-mangled name. */
void kernel_stub(void) __asm__("_Z10add_kernelPfS_");
void kernel_stub(void) {}

static void single(void)
{
	void *live[64];
	int n = 0;
	for (int i = 0; i < 48; i++)
		live[n++] = c_malloc((size_t)(i % 7 + 1) * 1000 + 17 * i);
	for (int i = 0; i < n; i += 2)
		c_free(live[i]);
	void *stream = (void *)0x5100;
	void *p = 0;
	int r = p_cudaMallocAsync(&p, 1 << 20, stream);
	gt("cudaMallocAsync", r, r ? 0 : (uint64_t)p, 1 << 20);
	gt("cudaFreeAsync", p_cudaFreeAsync(p, stream), (uint64_t)p, 0);
	r = p_cudaMallocManaged(&p, 8192, 1);
	gt("cudaMallocManaged", r, r ? 0 : (uint64_t)p, 8192);
	void *h = 0;
	r = p_cudaMallocHost(&h, 4096);
	gt("cudaMallocHost", r, r ? 0 : (uint64_t)h, 4096);
	gt("cudaFreeHost", p_cudaFreeHost(h), (uint64_t)h, 0);
	r = p_cudaHostAlloc(&h, 100, 0);
	gt("cudaHostAlloc", r, r ? 0 : (uint64_t)h, 100);
	gt("cudaMemcpy", p_cudaMemcpy(live[1], h, 100, 1), (uint64_t)live[1], 100);
	gt("cudaMemcpyAsync", p_cudaMemcpyAsync(h, live[1], 64, 2, stream), (uint64_t)h, 64);
	gt("cudaMemcpy", p_cudaMemcpy(live[1], h, 100, 9), (uint64_t)live[1], 100); /* bad kind: error 1 */
	gt("cudaFreeHost", p_cudaFreeHost(h), (uint64_t)h, 0);
	dim3 grid = {4, 2, 1}, block = {128, 1, 1};
	gt("cudaLaunchKernel", p_cudaLaunchKernel((const void *)kernel_stub, grid, block, 0, 256, stream), (uint64_t)kernel_stub, 0);
	dim3 zero = {0, 1, 1};
	gt("cudaLaunchKernel", p_cudaLaunchKernel((const void *)kernel_stub, zero, block, 0, 0, 0), (uint64_t)kernel_stub, 0);
	/* The driver API called directly: recorded as driver calls. */
	CUdeviceptr d = 0;
	r = p_cuMemAlloc_v2(&d, 3000);
	gt("cuMemAlloc_v2", r, r ? 0 : d, 3000);
	gt("cuMemFree_v2", p_cuMemFree_v2(d), d, 0);
	/* Expandable-segment style VMM calls. */
	CUdeviceptr va = 0;
	unsigned long long handle = 0;
	r = p_cuMemAddressReserve(&va, 8 << 20, 0, 0, 0);
	gt("cuMemAddressReserve", r, r ? 0 : va, 8 << 20);
	r = p_cuMemCreate(&handle, 2 << 20, 0, 0);
	gt("cuMemCreate", r, 0, 2 << 20);
	gt("cuMemMap", p_cuMemMap(va, 2 << 20, 0, handle, 0), va, 2 << 20);
	gt("cuMemUnmap", p_cuMemUnmap(va, 2 << 20), va, 2 << 20);
	gt("cuMemRelease", p_cuMemRelease(handle), 0, 0);
	gt("cuMemAddressFree", p_cuMemAddressFree(va, 8 << 20), va, 8 << 20);
	/* Failures: an unknown pointer, a zero-size request. */
	c_free((void *)0x1234);
	c_malloc(0);
	c_free(0);
	for (int i = 1; i < n; i += 2)
		c_free(live[i]);
	c_free(p);
	/* Stay alive a moment, as real programs do, so the recorder can copy
	 * this process's memory map (kernel names). */
	usleep(300000);
}

struct worker { int iters; unsigned seed; };

static void *hammer(void *arg)
{
	struct worker *w = arg;
	void *mine[16] = {0};
	for (int i = 0; i < w->iters; i++) {
		int slot = rand_r(&w->seed) % 16;
		if (mine[slot]) {
			c_free(mine[slot]);
			mine[slot] = 0;
		} else {
			mine[slot] = c_malloc(512 + rand_r(&w->seed) % 65536);
		}
	}
	for (int i = 0; i < 16; i++)
		if (mine[i])
			c_free(mine[i]);
	gt_flush();
	return 0;
}

static void threads(int nthreads, int iters)
{
	pthread_t t[64];
	struct worker w[64];
	for (int i = 0; i < nthreads && i < 64; i++) {
		w[i].iters = iters;
		w[i].seed = 1234u + i;
		pthread_create(&t[i], 0, hammer, &w[i]);
	}
	for (int i = 0; i < nthreads && i < 64; i++)
		pthread_join(t[i], 0);
}

/* `procs N`: N short processes one after the other, each allocating two
 * blocks and one more it frees, then exiting with the two still held (the
 * driver frees them). The parent itself makes no CUDA call. */
static void procs(int n)
{
	for (int i = 0; i < n; i++) {
		pid_t child = fork();
		if (child == 0) {
			c_malloc(4096 * (i + 1));
			c_free(c_malloc(1000));
			c_malloc(1 << 20);
			gt_flush();
			_exit(0);
		}
		waitpid(child, 0, 0);
	}
}

static void forked(void)
{
	void *a = c_malloc(1 << 16), *b = c_malloc(1 << 12);
	gt_flush();
	pid_t child = fork();
	if (child == 0) {
		void *c = c_malloc(5000);
		void *d = c_malloc(7000);
		c_free(c);
		c_free(d);
		/* A grandchild, to check descendants are followed too. */
		gt_flush();
		pid_t g = fork();
		if (g == 0) {
			c_free(c_malloc(123));
			gt_flush();
			_exit(0);
		}
		waitpid(g, 0, 0);
		gt_flush();
		_exit(0);
	}
	waitpid(child, 0, 0);
	c_free(a);
	c_free(b);
}

static void oom(void)
{
	void *big[16];
	int n = 0;
	for (int i = 0; i < 16; i++) {
		void *p = c_malloc(300u << 20);
		if (p)
			big[n++] = p;
	}
	for (int i = 0; i < n; i++)
		c_free(big[i]);
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The benchmark loop: N malloc/free pairs, not logged. Prints
 * "pairs seconds cpu_seconds". */
static void loop(int pairs)
{
	double t0 = now_s();
	for (int i = 0; i < pairs; i++) {
		void *p = 0;
		p_cudaMalloc(&p, 4096);
		p_cudaFree(p);
	}
	double t1 = now_s();
	struct rusage ru;
	getrusage(RUSAGE_SELF, &ru);
	double cpu = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
	printf("%d %.6f %.6f\n", pairs, t1 - t0, cpu);
}

/* Allocates and frees for `seconds`, logging; for the interruption tests. */
static void longrun(double seconds)
{
	double end = now_s() + seconds;
	while (now_s() < end) {
		void *p = c_malloc(4096);
		c_free(p);
		usleep(1000);
		if (tlog.len > (1 << 15))
			gt_flush();
	}
}

static void bind_dlopen(const char *lib)
{
	void *h = dlopen(lib, RTLD_NOW | RTLD_GLOBAL);
	if (!h) {
		fprintf(stderr, "dlopen %s: %s\n", lib, dlerror());
		exit(2);
	}
	*(void **)&p_cudaMalloc = dlsym(h, "cudaMalloc");
	*(void **)&p_cudaFree = dlsym(h, "cudaFree");
	if (!p_cudaMalloc || !p_cudaFree) {
		fprintf(stderr, "dlsym: %s\n", dlerror());
		exit(2);
	}
}

#ifndef DLOPEN_ONLY
/* Kernels as nvcc's host code names them: registered with their mangled
 * device names, then launched through the host function (CUDA 12) and
 * through a handle cudaGetKernel made (CUDA 13). Prints the launch
 * addresses: "host 0x… handle 0x…". */
void __cudaRegisterFunction(void **, const char *, char *, const char *, int, void *, void *, void *, void *, int *);
int cudaGetKernel(void **, const void *);
int cudaLaunchKernel(const void *, dim3, dim3, void **, size_t, void *);
/* Three threads on three devices: the main thread on the default (0), one
 * after cudaSetDevice(2), one after making device 3's primary context
 * current through the driver. Each allocates once and frees. */
int cudaSetDevice(int);
int cudaMalloc(void **, size_t);
int cudaFree(void *);
int cuDevicePrimaryCtxRetain(void **, int);
int cuCtxSetCurrent(void *);
int cuMemAlloc_v2(unsigned long long *, size_t);
int cuMemFree_v2(unsigned long long);
static void *on_device_2(void *arg)
{
	(void)arg;
	void *p;
	if (cudaSetDevice(2) || cudaMalloc(&p, 2 << 20))
		exit(5);
	cudaFree(p);
	return NULL;
}
static void *on_device_3(void *arg)
{
	(void)arg;
	void *ctx;
	unsigned long long p;
	if (cuDevicePrimaryCtxRetain(&ctx, 3) || cuCtxSetCurrent(ctx) || cuMemAlloc_v2(&p, 3 << 20))
		exit(6);
	cuMemFree_v2(p);
	return NULL;
}
static void devices(void)
{
	void *p;
	if (cudaMalloc(&p, 1 << 20))
		exit(7);
	cudaFree(p);
	pthread_t a, b;
	pthread_create(&a, NULL, on_device_2, NULL);
	pthread_join(a, NULL);
	pthread_create(&b, NULL, on_device_3, NULL);
	pthread_join(b, NULL);
}

/* `ranks N`: N processes at once, as torchrun starts them, rank r on
 * device r holding (r + 1) MiB until all have allocated. */
static void ranks(int n)
{
	int ready[2];
	if (pipe(ready))
		exit(5);
	for (int r = 0; r < n; r++) {
		if (fork() == 0) {
			cudaSetDevice(r);
			void *p;
			if (cudaMalloc(&p, (size_t)(r + 1) << 20))
				_exit(7);
			/* Hold it until every rank has allocated. */
			char c = 1;
			if (write(ready[1], &c, 1) != 1)
				_exit(8);
			usleep(200 * 1000);
			cudaFree(p);
			_exit(0);
		}
	}
	for (int r = 0; r < n; r++)
		wait(NULL);
}

static void vec_add_stub(void) {}
static void softmax_stub(void) {}
static void kernels(void)
{
	__cudaRegisterFunction(NULL, (const char *)vec_add_stub, (char *)"_Z6vecAddPfS_S_i", "_Z6vecAddPfS_S_i", -1,
			       NULL, NULL, NULL, NULL, NULL);
	__cudaRegisterFunction(NULL, (const char *)softmax_stub, (char *)"_ZN5fused7softmaxILi4EEEvPKfPfi",
			       "_ZN5fused7softmaxILi4EEEvPKfPfi", -1, NULL, NULL, NULL, NULL, NULL);
	void *handle = NULL;
	if (cudaGetKernel(&handle, (const void *)softmax_stub))
		exit(4);
	/* A program runs on after registering its kernels (PyTorch does at
	 * import): the recorder reads the names from the live process. */
	usleep(300 * 1000);
	dim3 grid = {1, 1, 1}, block = {32, 1, 1};
	for (int i = 0; i < 3; i++)
		cudaLaunchKernel((const void *)vec_add_stub, grid, block, NULL, 0, NULL);
	for (int i = 0; i < 5; i++)
		cudaLaunchKernel(handle, grid, block, NULL, 0, NULL);
	printf("host %p handle %p\n", (void *)vec_add_stub, handle);
}
#endif

int main(int argc, char **argv)
{
	const char *mode = argc > 1 ? argv[1] : "single";
	if (!strcmp(mode, "dlopen")) {
		/* dlopen DELAY_MS LIBRARY */
		usleep(atoi(argv[2]) * 1000);
		bind_dlopen(argv[3]);
		for (int i = 0; i < 10; i++)
			c_free(c_malloc(1000 + i));
		gt_flush();
		return 0;
	}
#ifdef DLOPEN_ONLY
	fprintf(stderr, "this build only knows `dlopen`\n");
	return 2;
#else
	bind_linked();
	if (!strcmp(mode, "single"))
		single();
	else if (!strcmp(mode, "threads"))
		threads(atoi(argv[2]), atoi(argv[3]));
	else if (!strcmp(mode, "fork"))
		forked();
	else if (!strcmp(mode, "procs"))
		procs(atoi(argv[2]));
	else if (!strcmp(mode, "oom"))
		oom();
	else if (!strcmp(mode, "loop"))
		loop(atoi(argv[2]));
	else if (!strcmp(mode, "kernels"))
		kernels();
	else if (!strcmp(mode, "devices"))
		devices();
	else if (!strcmp(mode, "ranks"))
		ranks(atoi(argv[2]));
	else if (!strcmp(mode, "long"))
		longrun(atof(argv[2]));
	else if (!strcmp(mode, "wait")) {
		/* For --pid: wait for a line on stdin, then run `single`. */
		char line[8];
		if (!fgets(line, sizeof line, stdin))
			return 3;
		single();
	} else {
		fprintf(stderr, "unknown mode %s\n", mode);
		return 2;
	}
	gt_flush();
	return 0;
#endif
}
