// SPDX-License-Identifier: MIT OR Apache-2.0
// What the recorder's BPF programs and its user side share, defined here
// only: the ring-buffer record and the attach cookie's bits. record.bpf.c
// includes this file; the user side (src/record/probes.rs) reads both
// through the types libbpf-cargo generates from the object's BTF
// (`types::event`, `types::cookie_bits`).

#ifndef FRAGSCOPE_RECORD_H
#define FRAGSCOPE_RECORD_H

#include <linux/types.h>

// The attach cookie: bits 0..15 are the index into the probe table, the
// others are flags. An exit record carries COOKIE_EXIT, which no probe's
// cookie has.
enum cookie_bits {
	COOKIE_NONE = 0,
	COOKIE_INDEX = 0xffff,        // mask of the probe index
	COOKIE_DRIVER = 1u << 16,     // a driver-level (cu*) function
	COOKIE_OUT_PTR = 1u << 17,    // read the u64 behind argument 1 at return
	COOKIE_STACK_ARGS = 1u << 18, // read two stack arguments at entry
	COOKIE_EXIT = 1u << 19,       // the last thread of a process exited
	// PyTorch's caching allocator (src/record/torch.rs). Its functions
	// throw on out-of-memory, and a uretprobe's trampoline in the stack
	// would stop the C++ unwinder: so no return probes there.
	COOKIE_ALLOCATOR = 1u << 20,  // an allocator call: state of its own level
	COOKIE_LANDED = 1u << 21,     // a probe after a call to it: it returned
	COOKIE_AT_ENTRY = 1u << 22,   // written at entry, no return probe (a free, a launch)
	COOKIE_UNRETURNED = 1u << 23, // written for a call that never returned (threw)
	COOKIE_OUT_ARG1 = 1u << 24,   // the output pointer is argument 2 (after `this`)
	// cudaMemGetInfo: its free memory goes to the allocation in flight on
	// the thread (PyTorch asks as a request fails), not to the ring buffer.
	COOKIE_FREE_REPORT = 1u << 25,
	// Where PyTorch's static probe's own arguments stand for malloc's
	// entry (src/record/torch.rs, StaticArgs): a probe on a call
	// instruction to malloc, in place of its entry;
	COOKIE_CALL_SITE = 1u << 26,
	// on a call that allocates without the cache (the static probe that
	// follows skips that allocation; argument 2 holds the size with
	// COOKIE_OUT_ARG1, else argument 1);
	COOKIE_UNCACHED = 1u << 27,
	// on a call to reportOutOfMemoryToProfiler(size, ..., device): an
	// allocation that is failing.
	COOKIE_OOM_REPORT = 1u << 28,
};

// One record in the ring buffer.
struct event {
	__u64 ts;       // entry, CLOCK_MONOTONIC ns
	__u64 dur;      // return - entry
	__u64 args[6];  // the six register arguments
	__u64 stack[2]; // first two stack arguments (COOKIE_STACK_ARGS); for an
	                // allocator call: the free memory CUDA reported during it
	                // and 1 (COOKIE_FREE_REPORT)
	__u64 result;   // *(u64 *)args[0] (or args[1]) at return (COOKIE_OUT_PTR)
	__u32 pid;
	__u32 tid;
	__s32 ret;
	enum cookie_bits cookie;
	__s32 stack_id; // user stack (want_stacks), else -1
	__u32 pad;
	__u64 caller;   // the return address at entry: who called (x86-64)
};

#endif
