#!/usr/bin/env bash
# Builds the stand-in CUDA runtime and driver and the workloads into $1:
#   lib64/libcuda.so.1, lib64/libcudart.so.12 (versioned symbols, as NVIDIA's)
#   workload          linked against them (rpath $ORIGIN/lib64)
#   workload-static   the runtime and driver linked into the executable
#   workload-dlopen   not linked; dlopens the runtime (mode `dlopen`)
#   nvml/libnvidia-ml.so.1   the driver's NVML, answering from $STANDIN_NVML
#   lib64/libc10_cuda.so, torch-workload   PyTorch's caching allocator (issue 40),
#                     lib64/libc10.so where it reports an out-of-memory
#   nosdt/lib64/libc10_cuda.so, nosdt/torch-workload   the same without its
#                     static probe (USDT), as PyTorch before 2.2
#   cet/lib64/*, cet/torch-workload   the runtime, driver and allocator built
#                     for Intel CET (-fcf-protection, the default of Ubuntu's
#                     GCC): each function begins with endbr64 (x86-64 only);
#                     cet/nosdt/ the same without the static probe
set -euo pipefail
src="$(cd "$(dirname "$0")" && pwd)"
out="$1"
mkdir -p "$out/lib64"
cc=${CC:-gcc}
flags=(-O2 -g -Wall -fno-omit-frame-pointer)
cet=("${flags[@]}" -fcf-protection=full)
# Built without Intel CET even where the compiler enables it by default
# (Ubuntu's and Fedora's GCC): the plain build has no `endbr64`, the cet/
# build below has it everywhere.
if echo 'int main(void){return 0;}' | $cc -fcf-protection=none -x c -o /dev/null - 2>/dev/null; then
  flags+=(-fcf-protection=none)
fi
$cc "${flags[@]}" -fPIC -shared -Wl,-soname,libcuda.so.1 -o "$out/lib64/libcuda.so.1" "$src/cuda.c" -lpthread
$cc "${flags[@]}" -fPIC -shared -Wl,-soname,libcudart.so.12 -Wl,--version-script="$src/cudart.map" \
  -o "$out/lib64/libcudart.so.12" "$src/cudart.c" -L"$out/lib64" -l:libcuda.so.1 -Wl,-rpath,'$ORIGIN'
$cc "${flags[@]}" -o "$out/workload" "$src/workload.c" -L"$out/lib64" -l:libcudart.so.12 -l:libcuda.so.1 \
  -Wl,-rpath,'$ORIGIN/lib64' -ldl -lpthread
$cc "${flags[@]}" -o "$out/workload-static" "$src/workload.c" "$src/cudart.c" "$src/cuda.c" -ldl -lpthread
$cc "${flags[@]}" -Wno-unused-function -DDLOPEN_ONLY -o "$out/workload-dlopen" "$src/workload.c" -ldl -lpthread
mkdir -p "$out/nvml"
$cc "${flags[@]}" -fPIC -shared -Wl,-soname,libnvidia-ml.so.1 -o "$out/nvml/libnvidia-ml.so.1" "$src/nvml.c"
# PyTorch's static probe in the stand-in allocator needs <sys/sdt.h>.
echo '#include <sys/sdt.h>' | ${CXX:-g++} -E -x c++ - >/dev/null 2>&1 \
  || { echo "tests/cuda-standin: <sys/sdt.h> is missing: install systemtap-sdt-dev (scripts/install-deps does)" >&2; exit 77; }
# PyTorch's caching allocator, as libc10_cuda.so (its probed functions are
# local symbols, as in PyTorch's wheels), and a program that uses it.
${CXX:-g++} "${flags[@]}" -std=c++17 -fPIC -shared -Wl,-soname,libc10.so -o "$out/lib64/libc10.so" "$src/c10.cpp"
${CXX:-g++} "${flags[@]}" -std=c++17 -fPIC -shared -fvisibility=hidden -Wl,-soname,libc10_cuda.so \
  -o "$out/lib64/libc10_cuda.so" "$src/c10_cuda.cpp" -L"$out/lib64" -l:libcudart.so.12 -l:libc10.so -Wl,-rpath,'$ORIGIN'
$cc "${flags[@]}" -o "$out/torch-workload" "$src/torch_workload.c" -L"$out/lib64" -l:libc10_cuda.so -l:libcudart.so.12 \
  -Wl,-rpath,'$ORIGIN/lib64'
mkdir -p "$out/nosdt/lib64"
cp "$out/lib64/libcuda.so.1" "$out/lib64/libcudart.so.12" "$out/lib64/libc10.so" "$out/nosdt/lib64/"
${CXX:-g++} "${flags[@]}" -DSTANDIN_NO_SDT -std=c++17 -fPIC -shared -fvisibility=hidden -Wl,-soname,libc10_cuda.so \
  -o "$out/nosdt/lib64/libc10_cuda.so" "$src/c10_cuda.cpp" -L"$out/nosdt/lib64" -l:libcudart.so.12 -l:libc10.so \
  -Wl,-rpath,'$ORIGIN'
$cc "${flags[@]}" -o "$out/nosdt/torch-workload" "$src/torch_workload.c" -L"$out/nosdt/lib64" -l:libc10_cuda.so \
  -l:libcudart.so.12 -Wl,-rpath,'$ORIGIN/lib64'
# The same built for Intel CET: every function begins with `endbr64`, which
# a uprobe would step out of line (src/record/elf.rs, entry_probe_at).
if [ "$(uname -m)" = x86_64 ] && echo 'int main(void){return 0;}' | $cc "${cet[@]}" -x c -o /dev/null - 2>/dev/null; then
  mkdir -p "$out/cet/lib64"
  $cc "${cet[@]}" -fPIC -shared -Wl,-soname,libcuda.so.1 -o "$out/cet/lib64/libcuda.so.1" "$src/cuda.c" -lpthread
  $cc "${cet[@]}" -fPIC -shared -Wl,-soname,libcudart.so.12 -Wl,--version-script="$src/cudart.map" \
    -o "$out/cet/lib64/libcudart.so.12" "$src/cudart.c" -L"$out/cet/lib64" -l:libcuda.so.1 -Wl,-rpath,'$ORIGIN'
  ${CXX:-g++} "${cet[@]}" -std=c++17 -fPIC -shared -Wl,-soname,libc10.so -o "$out/cet/lib64/libc10.so" "$src/c10.cpp"
  ${CXX:-g++} "${cet[@]}" -std=c++17 -fPIC -shared -fvisibility=hidden -Wl,-soname,libc10_cuda.so \
    -o "$out/cet/lib64/libc10_cuda.so" "$src/c10_cuda.cpp" -L"$out/cet/lib64" -l:libcudart.so.12 -l:libc10.so \
    -Wl,-rpath,'$ORIGIN'
  $cc "${cet[@]}" -o "$out/cet/torch-workload" "$src/torch_workload.c" -L"$out/cet/lib64" -l:libc10_cuda.so \
    -l:libcudart.so.12 -Wl,-rpath,'$ORIGIN/lib64'
  mkdir -p "$out/cet/nosdt/lib64"
  cp "$out/cet/lib64/libcuda.so.1" "$out/cet/lib64/libcudart.so.12" "$out/cet/lib64/libc10.so" "$out/cet/nosdt/lib64/"
  ${CXX:-g++} "${cet[@]}" -DSTANDIN_NO_SDT -std=c++17 -fPIC -shared -fvisibility=hidden -Wl,-soname,libc10_cuda.so \
    -o "$out/cet/nosdt/lib64/libc10_cuda.so" "$src/c10_cuda.cpp" -L"$out/cet/nosdt/lib64" -l:libcudart.so.12 \
    -l:libc10.so -Wl,-rpath,'$ORIGIN'
  $cc "${cet[@]}" -o "$out/cet/nosdt/torch-workload" "$src/torch_workload.c" -L"$out/cet/nosdt/lib64" \
    -l:libc10_cuda.so -l:libcudart.so.12 -Wl,-rpath,'$ORIGIN/lib64'
fi
