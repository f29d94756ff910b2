/* A stand-in for NVIDIA's NVML (libnvidia-ml.so.1): the few functions
 * `fragscope record` asks the driver, answering from the environment:
 *   STANDIN_NVML = "TOTAL:USED[,TOTAL:USED...]"  one device each (bytes)
 * The processes using device 0 are those whose name starts with
 * "workload" (the stand-in CUDA workloads), each using 1 MiB: the driver
 * knows which processes hold a context, and these do.
 * Without STANDIN_NVML, nvmlInit_v2 fails as on a machine whose driver is
 * not loaded (NVML_ERROR_DRIVER_NOT_LOADED). Signatures as in nvml.h. */
#include <ctype.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
enum { NVML_SUCCESS = 0, NVML_ERROR_INVALID_ARGUMENT = 2, NVML_ERROR_INSUFFICIENT_SIZE = 7,
       NVML_ERROR_DRIVER_NOT_LOADED = 9 };

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

#define MAX_DEVICES 16
static unsigned long long totals[MAX_DEVICES], useds[MAX_DEVICES];
static unsigned int count;

nvmlReturn_t nvmlInit_v2(void) {
    const char *spec = getenv("STANDIN_NVML");
    if (!spec || !*spec) return NVML_ERROR_DRIVER_NOT_LOADED;
    count = 0;
    const char *p = spec;
    while (*p && count < MAX_DEVICES) {
        char *end;
        totals[count] = strtoull(p, &end, 10);
        useds[count] = *end == ':' ? strtoull(end + 1, &end, 10) : 0;
        count++;
        p = *end == ',' ? end + 1 : end;
        if (*end != ',') break;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return nvmlInit_v2(); }
nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }
const char *nvmlErrorString(nvmlReturn_t r) { return r == NVML_ERROR_DRIVER_NOT_LOADED ? "Driver Not Loaded" : "stand-in error"; }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) {
    *n = count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
    if (i >= count) return NVML_ERROR_INVALID_ARGUMENT;
    *d = (nvmlDevice_t)(unsigned long)(i + 1);
    return NVML_SUCCESS;
}

static int index_of(nvmlDevice_t d) { return (int)(unsigned long)d - 1; }

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    int i = index_of(d);
    if (i < 0 || (unsigned)i >= count) return NVML_ERROR_INVALID_ARGUMENT;
    m->total = totals[i];
    m->reserved = 0;
    m->used = useds[i];
    m->free = totals[i] - useds[i];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
    snprintf(name, length, "Stand-in GPU %d", index_of(d));
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *n, nvmlProcessInfo_t *infos) {
    unsigned int found = 0;
    if (index_of(d) == 0) {
        DIR *proc = opendir("/proc");
        struct dirent *e;
        while (proc && (e = readdir(proc))) {
            if (!isdigit((unsigned char)e->d_name[0])) continue;
            char path[300], comm[32] = {0};
            snprintf(path, sizeof path, "/proc/%s/comm", e->d_name);
            FILE *f = fopen(path, "r");
            if (!f) continue;
            if (fgets(comm, sizeof comm, f) && strncmp(comm, "workload", 8) == 0) {
                if (infos && found < *n) {
                    infos[found].pid = (unsigned)atoi(e->d_name);
                    infos[found].usedGpuMemory = 1 << 20;
                    infos[found].gpuInstanceId = infos[found].computeInstanceId = 0xFFFFFFFF;
                }
                found++;
            }
            fclose(f);
        }
        if (proc) closedir(proc);
    }
    if (!infos || found > *n) {
        *n = found;
        return found == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *n = found;
    return NVML_SUCCESS;
}
