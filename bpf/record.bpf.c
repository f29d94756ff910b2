// SPDX-License-Identifier: MIT OR Apache-2.0
// fragscope record: uprobes on the CUDA runtime and driver (SPEC §9).
//
// One entry program and one return program serve every probed function.
// The attach cookie says which function it is (index into the recorder's
// probe table, src/record/probes.rs) and at which level (runtime or
// driver); what the arguments mean is decided in user space. Entry saves
// the raw arguments per thread; return adds the return code and, for
// functions that write their result through an output pointer, the value
// read through it, and submits one event to the ring buffer.
//
// Processes are followed through the scheduler's fork and exit hooks,
// attached as BTF-enabled tracepoints (tp_btf), which need no tracefs. The
// classic tracepoints below are a fallback for kernels that refuse tp_btf
// (the recorder then mounts tracefs itself when it is absent). When the
// last thread of a process that made a recorded call exits, an exit record
// is written: the driver frees whatever device memory it still held.
//
// Written without vmlinux.h: registers come from the user-space pt_regs
// definition, and the few kernel structs read are declared with
// preserve_access_index so libbpf relocates them (CO-RE) against the
// running kernel's BTF.

#include <stdbool.h>
#include <linux/types.h>
#include <linux/bpf.h>
#include <asm/ptrace.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include <bpf/usdt.bpf.h>

#include "record.h"

char LICENSE[] SEC("license") = "Dual MIT/GPL";

#define MAX_STACK_DEPTH 64

struct inflight {
	struct event ev;
	__u32 depth; // nested probed calls of the same level on this thread
	__u32 pad;
};

// Set by the recorder before load.
const volatile __u8 trace_all = 0;
const volatile __u8 want_stacks = 0;
const volatile __u64 wakeup_bytes = 1 << 20;

// Set by the recorder when it stops: calls entered from then on are not
// recorded, calls already entered still are when they return. So the end
// of a trace is a clean cut whatever order the probes are detached in.
volatile __u8 stopping = 0;

// Set by the first event that finds the backlog past wakeup_bytes and
// wakes the reader; cleared by the reader after each read. So a reader
// that falls behind is woken once, not by every event after (each wakeup
// is an interrupt the traced thread raises: on a virtual machine, an exit
// to the hypervisor).
volatile __u64 woken = 0;
// Wakeups for a backlog (the reader reports them in trace.json).
__u64 wakeups = 0;

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 16 << 20); // resized by the recorder
} events SEC(".maps");

// Processes being traced (tgid -> 1); children are added at fork.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, __u8);
} traced SEC(".maps");

// Entry -> return state, keyed by thread id | level << 32. LRU so that
// entries of threads that die inside a call cannot fill it; the exit
// tracepoint also removes them.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, struct inflight);
} inflight SEC(".maps");

// Ring-buffer reservations that failed: events lost, per CPU.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} lost SEC(".maps");

// Processes that have had an event: the first event of a new one wakes
// the reader at once, so it can copy the process's /proc/PID/maps (for
// symbolising launches) while the process still runs.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u8);
} seen SEC(".maps");

// Threads in a call that allocates without PyTorch's cache
// (COOKIE_UNCACHED) -> the size asked: the static probe after it skips it.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u64);
} uncached SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_STACK_TRACE);
	__uint(max_entries, 16384); // resized by the recorder
	__uint(key_size, sizeof(__u32));
	__uint(value_size, MAX_STACK_DEPTH * sizeof(__u64));
} stacks SEC(".maps");

// A ring-buffer reservation failed: one event lost.
static __always_inline void count_lost(void)
{
	__u32 zero = 0;
	__u64 *n = bpf_map_lookup_elem(&lost, &zero);
	if (n)
		(*n)++;
}

static __always_inline int is_traced(__u32 tgid)
{
	return trace_all || bpf_map_lookup_elem(&traced, &tgid) != NULL;
}

static __always_inline __u64 wake_flags(void)
{
	// Wake the reader only when a good part of the buffer is waiting, and
	// once until it has read; it also polls on a timer, so quiet periods
	// are drained too.
	if (woken || bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) < wakeup_bytes)
		return BPF_RB_NO_WAKEUP;
	// One thread wakes the reader, however many find the backlog at once.
	// (BPF_CMPXCHG: Linux 5.12, under the 5.15 the attach cookies need.)
	if (__sync_val_compare_and_swap(&woken, 0, 1) != 0)
		return BPF_RB_NO_WAKEUP;
	__sync_fetch_and_add(&wakeups, 1);
	return BPF_RB_FORCE_WAKEUP;
}

// The flags to submit a process's event with: wake the reader at once for
// its first event (so it copies the process's maps while it runs), else
// as wake_flags says.
static __always_inline __u64 submit_flags(__u32 tgid)
{
	if (bpf_map_lookup_elem(&seen, &tgid))
		return wake_flags();
	__u8 one = 1;
	bpf_map_update_elem(&seen, &tgid, &one, BPF_ANY);
	return BPF_RB_FORCE_WAKEUP;
}

// The in-flight state's key: the thread, and the level of the call (the
// runtime, the driver, PyTorch's allocator), so that a call of one level
// made inside another's is recorded on its own.
// Key tid | 3 << 32 holds the free memory cudaMemGetInfo last reported on
// a thread with no allocator call in flight (FREE_SLOT): the out-of-memory
// report that follows takes it.
#define FREE_SLOT(tid) ((tid) | (3ull << 32))

static __always_inline __u64 level_key(__u32 tid, __u32 cookie)
{
	if (cookie & COOKIE_ALLOCATOR)
		return tid | (2ull << 32);
	return tid | ((cookie & COOKIE_DRIVER) ? (1ull << 32) : 0);
}

// A zeroed event stamped now, reserved in the ring buffer (NULL, counted
// as lost, when it is full).
static __always_inline struct event *new_event(void)
{
	struct event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		count_lost();
		return NULL;
	}
	__builtin_memset(e, 0, sizeof(*e));
	e->ts = bpf_ktime_get_ns();
	return e;
}

// An allocator call that never returned (it threw: out of memory) is
// written when the thread's next allocator call begins, or when it exits.
static __always_inline void submit_unreturned(struct inflight *st)
{
	struct event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		count_lost();
		return;
	}
	__builtin_memcpy(e, &st->ev, sizeof(*e));
	e->dur = 0;
	e->ret = -1;
	e->result = 0;
	e->cookie = (enum cookie_bits)(e->cookie | COOKIE_UNRETURNED);
	// At once (the process may be dying of it), and the process counted
	// as seen, so that its exit is written too.
	submit_flags(e->pid);
	bpf_ringbuf_submit(e, BPF_RB_FORCE_WAKEUP);
}

// Writes the allocator call still in flight on thread `tid`, if any, as one
// that never returned, and forgets it; says whether there was one.
static __always_inline int flush_unreturned(__u32 tid)
{
	__u64 key = tid | (2ull << 32);
	struct inflight *st = bpf_map_lookup_elem(&inflight, &key);
	if (!st)
		return 0;
	submit_unreturned(st);
	bpf_map_delete_elem(&inflight, &key);
	return 1;
}

// PyTorch reports an out-of-memory (reportOutOfMemoryToProfiler(size,
// allocated, reserved, device), after asking CUDA for the free memory and
// before it throws). An allocator call in flight on the thread (one seen
// from its call) is written as the one that failed; else (an allocation
// seen by the static probe only) the report's size and device are, with
// the free memory kept for it.
static __always_inline int oom_report(struct pt_regs *ctx, __u32 tgid, __u32 tid, __u32 cookie)
{
	if (stopping)
		return 0;
	__u64 skey = FREE_SLOT(tid);
	if (flush_unreturned(tid)) {
		bpf_map_delete_elem(&inflight, &skey);
		return 0;
	}
	struct inflight st = {};
	st.ev.ts = bpf_ktime_get_ns();
	// c10::Device in one register: its type, then its index.
	st.ev.args[2] = (PT_REGS_PARM4(ctx) >> 8) & 0xff;
	st.ev.args[3] = PT_REGS_PARM1(ctx);
	st.ev.caller = PT_REGS_IP(ctx) + 5;
	st.ev.pid = tgid;
	st.ev.tid = tid;
	st.ev.cookie = (enum cookie_bits)(cookie & ~COOKIE_OOM_REPORT);
	st.ev.stack_id = want_stacks ? bpf_get_stackid(ctx, &stacks, BPF_F_USER_STACK) : -1;
	struct inflight *slot = bpf_map_lookup_elem(&inflight, &skey);
	if (slot) {
		st.ev.stack[0] = slot->ev.stack[0];
		st.ev.stack[1] = 1;
		bpf_map_delete_elem(&inflight, &skey);
	}
	submit_unreturned(&st);
	return 0;
}

static __always_inline int entry(struct pt_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	if (!is_traced(tgid))
		return 0;
	__u32 cookie = (__u32)bpf_get_attach_cookie(ctx);
	__u64 key = level_key(tid, cookie);
	if (cookie & COOKIE_UNCACHED) {
		// Both read, then one kept: the verifier refuses a computed
		// offset into the context.
		__u64 first = PT_REGS_PARM1(ctx), second = PT_REGS_PARM2(ctx);
		asm volatile("" : "+r"(first), "+r"(second));
		__u64 size = (cookie & COOKIE_OUT_ARG1) ? second : first;
		bpf_map_update_elem(&uncached, &tid, &size, BPF_ANY);
		return 0;
	}
	if (cookie & COOKIE_OOM_REPORT)
		return oom_report(ctx, tgid, tid, cookie);
	if (cookie & COOKIE_DRIVER) {
		// A driver call made by the runtime is part of that runtime call.
		__u64 rt_key = tid;
		if (bpf_map_lookup_elem(&inflight, &rt_key))
			return 0;
	}
	struct inflight *cur = (cookie & COOKIE_AT_ENTRY) ? NULL : bpf_map_lookup_elem(&inflight, &key);
	if (cur) {
		// The allocator's probed functions do not call each other (the
		// recorder leaves out those that do): an allocation still in
		// flight on this thread never returned.
		// (Counted after the stop too: the nested call's return must not
		// take the outer call's state.)
		if (!(cookie & COOKIE_ALLOCATOR)) {
			cur->depth++;
			return 0;
		}
		if (stopping)
			return 0;
		submit_unreturned(cur);
		bpf_map_delete_elem(&inflight, &key);
	}
	if (stopping)
		return 0;
	struct inflight st = {};
	st.ev.ts = bpf_ktime_get_ns();
	st.ev.args[0] = PT_REGS_PARM1(ctx);
	st.ev.args[1] = PT_REGS_PARM2(ctx);
	st.ev.args[2] = PT_REGS_PARM3(ctx);
	st.ev.args[3] = PT_REGS_PARM4(ctx);
	st.ev.args[4] = PT_REGS_PARM5(ctx);
#ifdef __TARGET_ARCH_x86
	st.ev.args[5] = ctx->r9;
	// At entry the stack pointer is at the return address: the caller,
	// which names the library that asked without a whole stack. On a
	// call instruction (5 bytes), the return address is the next one.
	if (cookie & COOKIE_CALL_SITE)
		st.ev.caller = PT_REGS_IP(ctx) + 5;
	else
		bpf_probe_read_user(&st.ev.caller, sizeof(st.ev.caller), (void *)PT_REGS_SP(ctx));
	if (cookie & COOKIE_STACK_ARGS) {
		// At entry the stack pointer is at the return address.
		bpf_probe_read_user(&st.ev.stack, sizeof(st.ev.stack), (void *)(PT_REGS_SP(ctx) + 8));
	}
#elif defined(__TARGET_ARCH_arm64)
	// The link register holds the return address at entry.
	st.ev.caller = PT_REGS_RET(ctx);
#endif
	st.ev.pid = tgid;
	st.ev.tid = tid;
	st.ev.cookie = (enum cookie_bits)cookie;
	st.ev.stack_id = want_stacks ? bpf_get_stackid(ctx, &stacks, BPF_F_USER_STACK) : -1;
	if (cookie & COOKIE_AT_ENTRY) {
		// Nothing to wait for: a free's argument says it all (and a
		// return probe would stop a C++ exception's unwinding); a launch's
		// return code is not worth a second trap per launch.
		struct event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
		if (!e) {
			count_lost();
			return 0;
		}
		__builtin_memcpy(e, &st.ev, sizeof(*e));
		bpf_ringbuf_submit(e, submit_flags(tgid));
		return 0;
	}
	bpf_map_update_elem(&inflight, &key, &st, BPF_ANY);
	return 0;
}

static __always_inline int ret(struct pt_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)pid_tgid;
	__u32 cookie = (__u32)bpf_get_attach_cookie(ctx);
	__u64 key = level_key(tid, cookie);
	struct inflight *st = bpf_map_lookup_elem(&inflight, &key);
	if (!st)
		return 0;
	if (st->depth > 0) {
		st->depth--;
		return 0;
	}
	if (cookie & COOKIE_FREE_REPORT) {
		// cudaMemGetInfo inside an allocator call: PyTorch reading the
		// free memory for its out-of-memory error. The first figure is
		// kept with that call (a handler that catches the error and asks
		// again finds it set), and written with it when it never returns.
		__u64 akey = tid | (2ull << 32), free = 0;
		struct inflight *m = bpf_map_lookup_elem(&inflight, &akey);
		if ((__s32)PT_REGS_RC(ctx) == 0 && !bpf_probe_read_user(&free, sizeof(free), (void *)st->ev.args[0])) {
			if (m && !m->ev.stack[1]) {
				m->ev.stack[0] = free;
				m->ev.stack[1] = 1;
			} else if (!m) {
				// No allocator call in flight (its allocation is read
				// from PyTorch's static probe): kept for the report.
				struct inflight slot = {};
				__u64 skey = FREE_SLOT(tid);
				slot.ev.stack[0] = free;
				slot.ev.stack[1] = 1;
				bpf_map_update_elem(&inflight, &skey, &slot, BPF_ANY);
			}
		}
		bpf_map_delete_elem(&inflight, &key);
		return 0;
	}
	if ((cookie & COOKIE_LANDED) && (st->ev.cookie & COOKIE_OUT_PTR)) {
		// A probe after a call (or on a jump soon after it) that finds no
		// pointer written was not reached by that call's return (PyTorch's
		// malloc writes one whenever it returns): the call stays in
		// flight, and is written as never returned (an out-of-memory).
		__u64 out = 0;
		const void *slot = (void *)st->ev.args[(st->ev.cookie & COOKIE_OUT_ARG1) ? 1 : 0];
		if (bpf_probe_read_user(&out, sizeof(out), slot) || out == 0)
			return 0;
	}
	struct event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		count_lost();
		bpf_map_delete_elem(&inflight, &key);
		return 0;
	}
	__builtin_memcpy(e, &st->ev, sizeof(*e));
	e->dur = bpf_ktime_get_ns() - e->ts;
	// After a call that returns nothing (a landing probe), the register
	// holds no return code.
	e->ret = (cookie & COOKIE_LANDED) ? 0 : (__s32)PT_REGS_RC(ctx);
	e->result = 0;
	if (e->cookie & COOKIE_OUT_PTR)
		bpf_probe_read_user(&e->result, sizeof(e->result),
				    (void *)e->args[(e->cookie & COOKIE_OUT_ARG1) ? 1 : 0]);
	bpf_map_delete_elem(&inflight, &key);
	bpf_ringbuf_submit(e, submit_flags(pid_tgid >> 32));
	return 0;
}

// Classic uprobes (one link per function) and, on kernels that have them
// (6.6+), multi-uprobes: one link per file, detached with one RCU grace
// period instead of one per function.
SEC("uprobe")
int on_entry(struct pt_regs *ctx) { return entry(ctx); }
SEC("uretprobe")
int on_return(struct pt_regs *ctx) { return ret(ctx); }
SEC("uprobe.multi")
int on_entry_multi(struct pt_regs *ctx) { return entry(ctx); }
SEC("uretprobe.multi")
int on_return_multi(struct pt_regs *ctx) { return ret(ctx); }
// Plain uprobes at the instruction after each call to an allocator
// function (COOKIE_LANDED): its return, seen without a trampoline.
SEC("uprobe")
int on_landed(struct pt_regs *ctx) { return ret(ctx); }
SEC("uprobe.multi")
int on_landed_multi(struct pt_regs *ctx) { return ret(ctx); }

// PyTorch's static probe after an allocation (USDT pytorch:malloc, since
// 2.2: the pointer, the device, the size, the stream's id), where it stands
// for malloc's entry and return (src/record/torch.rs, StaticArgs): one
// trap per tensor. Written as a probe after the call would write it.
SEC("usdt")
int on_static_malloc(struct pt_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	if (!is_traced(tgid) || stopping)
		return 0;
	long ptr = 0, device = 0, size = 0, stream = 0;
	bpf_usdt_arg(ctx, 0, &ptr);
	bpf_usdt_arg(ctx, 1, &device);
	bpf_usdt_arg(ctx, 2, &size);
	bpf_usdt_arg(ctx, 3, &stream);
	// An allocator call still in flight on the thread (a raw_alloc's:
	// allocate and raw_alloc do not nest) never returned: it threw. Written
	// now, as malloc's entry would have, so that it is not taken for the
	// next out-of-memory's.
	flush_unreturned(tid);
	__u64 *asked = bpf_map_lookup_elem(&uncached, &tid);
	if (asked) {
		// A tensor allocated without the cache: a segment of its own.
		__u64 was = *asked;
		bpf_map_delete_elem(&uncached, &tid);
		if (was == (__u64)size)
			return 0;
	}
	struct event *e = new_event();
	if (!e)
		return 0;
	e->args[2] = device;
	e->args[3] = size;
	e->args[4] = stream;
	e->result = ptr;
	e->pid = tgid;
	e->tid = tid;
	e->cookie = (enum cookie_bits)bpf_usdt_cookie(ctx);
	e->stack_id = want_stacks ? bpf_get_stackid(ctx, &stacks, BPF_F_USER_STACK) : -1;
	e->caller = PT_REGS_IP(ctx);
	bpf_ringbuf_submit(e, submit_flags(tgid));
	return 0;
}

// Kernel structs, relocated by field name (CO-RE).
struct signal_struct {
	struct {
		int counter;
	} live; // threads of the group not yet exited
} __attribute__((preserve_access_index));

struct task_struct {
	int pid;
	int tgid;
	struct signal_struct *signal;
} __attribute__((preserve_access_index));

struct trace_event_raw_sched_process_fork {
	int child_pid;
} __attribute__((preserve_access_index));

// A traced process forked: its child is traced too.
static __always_inline int follow_fork(__u32 child)
{
	if (trace_all)
		return 0;
	__u32 parent = bpf_get_current_pid_tgid() >> 32;
	if (!bpf_map_lookup_elem(&traced, &parent))
		return 0;
	__u8 one = 1;
	bpf_map_update_elem(&traced, &child, &one, BPF_ANY);
	return 0;
}

// A thread exits (in its own context): drop its in-flight state; when it
// is the last of a process that made a recorded call, write an exit record.
static __always_inline int note_exit(struct task_struct *task)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	__u64 key = tid;
	bpf_map_delete_elem(&inflight, &key);
	key = tid | (1ull << 32);
	bpf_map_delete_elem(&inflight, &key);
	key = FREE_SLOT(tid);
	bpf_map_delete_elem(&inflight, &key);
	bpf_map_delete_elem(&uncached, &tid);
	// An allocation that never returned: the thread died of its exception.
	flush_unreturned(tid);
	if (tid != tgid)
		bpf_map_delete_elem(&traced, &tid);
	// do_exit decrements signal->live before this hook runs.
	if (BPF_CORE_READ(task, signal, live.counter) != 0)
		return 0;
	bpf_map_delete_elem(&traced, &tgid);
	if (stopping || !bpf_map_lookup_elem(&seen, &tgid))
		return 0;
	bpf_map_delete_elem(&seen, &tgid);
	struct event *e = new_event();
	if (!e)
		return 0;
	e->pid = tgid;
	e->tid = tid;
	e->cookie = COOKIE_EXIT;
	e->stack_id = -1;
	bpf_ringbuf_submit(e, wake_flags());
	return 0;
}

// BTF-enabled tracepoints: attached by BTF id, no tracefs needed.
SEC("tp_btf/sched_process_fork")
int BPF_PROG(on_fork_btf, struct task_struct *parent, struct task_struct *child)
{
	// A new thread shares its parent's tgid: nothing to add.
	if (BPF_CORE_READ(child, tgid) != BPF_CORE_READ(child, pid))
		return 0;
	return follow_fork(BPF_CORE_READ(child, pid));
}

SEC("tp_btf/sched_process_exit")
int BPF_PROG(on_exit_btf, struct task_struct *task)
{
	return note_exit(task);
}

// Classic tracepoints: the fallback (their ids are read from tracefs).
SEC("tracepoint/sched/sched_process_fork")
int on_fork(struct trace_event_raw_sched_process_fork *ctx)
{
	// For a new thread this is its tid, which is harmless (the filter
	// looks up tgids) and removed when the thread exits.
	return follow_fork(BPF_CORE_READ(ctx, child_pid));
}

SEC("tracepoint/sched/sched_process_exit")
int on_exit(void *ctx)
{
	return note_exit((struct task_struct *)bpf_get_current_task());
}
