"""Calls NVIDIA's real libcudart (the nvidia-cuda-runtime-cu12 wheel) through
ctypes and logs each call's outcome as ground truth, in the workload's
format: pid tid call ret addr size. Without a GPU driver every call fails
(cudaErrorInsufficientDriver, 35), which is still a real call through the
real library."""
import ctypes
import os
import sys
import threading

import nvidia.cuda_runtime

lib_dir = os.path.join(list(nvidia.cuda_runtime.__path__)[0], "lib")
rt = ctypes.CDLL(os.path.join(lib_dir, "libcudart.so.12"))
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
rt.cudaFree.argtypes = [ctypes.c_void_p]
rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

lines = []
tid = threading.get_native_id()
pid = os.getpid()


def log(call, ret, addr, size):
    lines.append(f"{pid} {tid} {call} {ret} {addr} {size}\n")


ptrs = []
for size in (1 << 20, 4096, 123):
    p = ctypes.c_void_p(0)
    r = rt.cudaMalloc(ctypes.byref(p), size)
    log("cudaMalloc", r, (p.value or 0) if r == 0 else 0, size)
    ptrs.append(p.value or 0)
for p in ptrs:
    log("cudaFree", rt.cudaFree(p), p, 0)
buf = ctypes.create_string_buffer(64)
addr = ctypes.addressof(buf)
log("cudaMemcpy", rt.cudaMemcpy(addr, addr, 64, 1), addr, 64)
with open(sys.argv[1], "a") as f:
    f.writelines(lines)
