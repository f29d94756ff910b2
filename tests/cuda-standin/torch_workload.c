/* A program that allocates through the stand-in PyTorch allocator
 * (c10_cuda.cpp), for the record tests of the allocator probes. It prints
 * its own bookkeeping, one line per call, which the test compares with
 * the recording:
 *   alloc ADDR SIZE DEVICE   a tensor (SIZE as asked)
 *   free ADDR                its deleter, or raw_delete
 *   oom SIZE DEVICE FREE     the allocator threw out-of-memory, CUDA
 *                            having reported FREE bytes free
 * Run with STANDIN_CAPACITY small enough for the last phase to fail.
 * Modes: STEPS (default 3), `ranks N`, `wait`, `launches STEPS KEEP`,
 * `frag`, `rawoom` (see main and each mode's function). With
 * PYTORCH_NO_CUDA_MEMORY_CACHING set, each tensor is a cudaMalloc. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

int standin_torch_alloc(void **out, size_t size, int device);
void standin_torch_free(void *ptr);
void *standin_torch_raw_alloc(size_t size);
void standin_torch_raw_delete(void *ptr);
void standin_torch_empty_cache(void);
size_t standin_torch_oom_free(void);

#define N 64
static void *live[N];
static int nlive;

static int alloc(size_t size, int device)
{
	void *p = NULL;
	if (standin_torch_alloc(&p, size, device)) {
		printf("oom %zu %d %zu\n", size, device, standin_torch_oom_free());
		return 1;
	}
	printf("alloc %p %zu %d\n", p, size, device);
	live[nlive++] = p;
	return 0;
}

static void release(int i)
{
	printf("free %p\n", live[i]);
	standin_torch_free(live[i]);
	live[i] = live[--nlive];
}

int cudaSetDevice(int device);

/* Steps of a training loop on `device`: activations kept until the step
 * ends. */
static void train(int steps, int device)
{
	for (int s = 0; s < steps; s++) {
		for (int i = 0; i < 8; i++)
			alloc(1000 + 4096 * i, device);
		alloc(3u << 20, device);
		while (nlive > 0)
			release(nlive - 1);
	}
}

/* Kernels as nvcc's host code registers them with the runtime. */
void __cudaRegisterFunction(void **, const char *, char *, const char *, int, void *, void *, void *, void *, int *);
typedef struct {
	unsigned x, y, z;
} dim3;
int cudaLaunchKernel(const void *, dim3, dim3, void **, size_t, void *);
static void layer_stub(void) {}
static void norm_stub(void) {}
static void adam_stub(void) {}

/* `launches STEPS KEEP`: a training loop whose steps launch the same
 * kernels (two per layer over four layers, then the optimizer's) around
 * their tensors, keeping KEEP bytes more at each step's end (a leak when
 * KEEP > 0). Its iterations can be found only from the launches. */
static void launches(int steps, size_t keep)
{
	__cudaRegisterFunction(NULL, (const char *)layer_stub, (char *)"_Z5layerPfi", "_Z5layerPfi", -1, NULL, NULL,
			       NULL, NULL, NULL);
	__cudaRegisterFunction(NULL, (const char *)norm_stub, (char *)"_Z4normPf", "_Z4normPf", -1, NULL, NULL, NULL,
			       NULL, NULL);
	__cudaRegisterFunction(NULL, (const char *)adam_stub, (char *)"_Z4adamPfS_", "_Z4adamPfS_", -1, NULL, NULL,
			       NULL, NULL, NULL);
	/* The recorder reads the names from the live process. */
	usleep(300 * 1000);
	dim3 grid = {1, 1, 1}, block = {32, 1, 1};
	alloc(2u << 20, 0); /* weights */
	int kept = nlive;
	for (int s = 0; s < steps; s++) {
		for (int l = 0; l < 4; l++) {
			alloc(300000 + 4096 * l, 0);
			cudaLaunchKernel((const void *)layer_stub, grid, block, NULL, 0, NULL);
			cudaLaunchKernel((const void *)norm_stub, grid, block, NULL, 0, NULL);
		}
		cudaLaunchKernel((const void *)adam_stub, grid, block, NULL, 0, NULL);
		while (nlive > kept)
			release(nlive - 1);
		if (keep && nlive < N - 1) {
			alloc(keep, 0);
			kept = nlive;
		}
	}
	fflush(stdout);
}

int cudaMemGetInfo(size_t *free_bytes, size_t *total);

/* `frag`, with STANDIN_CAPACITY=64MiB: a 50 MiB tensor, then 6 of 1.5 MiB
 * (each in a 2 MiB segment of its own, a 0.5 MiB tail cached beside it)
 * leave 2 MiB on the device; then one of 4 MiB. The cache's 3 MiB free and
 * the device's 2 MiB would hold it, but no one piece does: a fragmentation
 * OOM, which the cache alone (3 MiB) would call one of capacity. Then, as
 * a handler would, it frees the large tensor, empties the cache and asks
 * CUDA for its free memory (52 MiB now, not what PyTorch saw), and goes on
 * allocating. */
static void frag(void)
{
	alloc(50u << 20, 0);
	for (int i = 0; i < 6; i++)
		alloc(3u << 19, 0);
	if (alloc(4u << 20, 0)) {
		release(0);
		standin_torch_empty_cache();
		size_t free_bytes = 0, total = 0;
		cudaMemGetInfo(&free_bytes, &total);
		alloc(1000, 0);
	}
	while (nlive > 0)
		release(nlive - 1);
	fflush(stdout);
}

int standin_torch_raw_alloc_caught(void **out, size_t size);

/* `rawoom`: the raw interface (cuBLAS's workspaces) until the allocator
 * gives up, then everything freed through it. */
static void rawoom(void)
{
	void *got[N];
	int n = 0;
	while (n < N) {
		void *p = NULL;
		if (standin_torch_raw_alloc_caught(&p, 6u << 20)) {
			printf("oom %u 0 %zu\n", 6u << 20, standin_torch_oom_free());
			break;
		}
		printf("alloc %p %u 0\n", p, 6u << 20);
		got[n++] = p;
	}
	while (n > 0) {
		printf("free %p\n", got[--n]);
		standin_torch_raw_delete(got[n]);
	}
	fflush(stdout);
}

int main(int argc, char **argv)
{
	if (argc > 1 && !strcmp(argv[1], "rawoom")) {
		rawoom();
		return 0;
	}
	if (argc > 1 && !strcmp(argv[1], "frag")) {
		frag();
		return 0;
	}
	if (argc > 3 && !strcmp(argv[1], "launches")) {
		launches(atoi(argv[2]), (size_t)atol(argv[3]));
		return 0;
	}
	if (argc > 2 && !strcmp(argv[1], "ranks")) {
		/* `ranks N`: N processes, rank r training on device r. */
		int n = atoi(argv[2]);
		for (int r = 0; r < n; r++) {
			if (fork() == 0) {
				cudaSetDevice(r);
				train(2, r);
				fflush(stdout);
				_exit(0);
			}
		}
		for (int r = 0; r < n; r++)
			wait(NULL);
		return 0;
	}
	if (argc > 1 && !strcmp(argv[1], "wait")) {
		/* `wait`: weights allocated, then a line on stdin (the recorder
		 * attaches with --pid meanwhile), then steps that free and reuse. */
		alloc(1u << 20, 0);
		alloc(5000, 0);
		fflush(stdout);
		char line[8];
		if (!fgets(line, sizeof line, stdin))
			return 3;
		train(2, 0);
		fflush(stdout);
		return 0;
	}
	int steps = argc > 1 ? atoi(argv[1]) : 3;
	train(steps, 0);
	/* The raw interface (cuBLAS workspaces go through it). */
	void *w = standin_torch_raw_alloc(100000);
	printf("alloc %p %d 0\n", w, 100000);
	printf("free %p\n", w);
	standin_torch_raw_delete(w);
	/* Grow until the allocator gives up. */
	while (nlive < N - 1 && alloc(6u << 20, 0) == 0)
		;
	while (nlive > 0)
		release(nlive - 1);
	standin_torch_empty_cache();
	fflush(stdout);
	return 0;
}
