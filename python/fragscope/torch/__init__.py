"""The OOM that explains itself: `watch()` turns PyTorch's memory history
on and attaches an out-of-memory observer. At each OOM (before PyTorch
raises it) the observer dumps a snapshot into `out_dir`
(`oom-PID-N.pickle`), runs `fragscope analyze` on it into
`out_dir/oom-PID-N/`, and prints the first screen to stderr: the verdict,
the memory needed, the budget and the replayed fix. Then the OOM goes on
as it would have.

    import fragscope.torch
    fragscope.torch.watch()            # or: python -m fragscope.torch train.py ARGS…

Rules: the OOM is never swallowed; an analysis that fails, or runs past
`timeout` seconds, prints why and the program goes on (the snapshot is
kept); a program that catches OOMs and goes on gets each analysed, up to
`limit` of them.

Only these parts of torch are used, so that any stand-in of them tests
this module: `torch.__version__`, `torch.cuda.is_available()`,
`torch.cuda.OutOfMemoryError`,
`torch.cuda.memory._record_memory_history(enabled=, context=, stacks=,
max_entries=)`, `torch.cuda.memory._dump_snapshot(path)`, and
`torch._C._cuda_attach_out_of_memory_observer(fn)`.
"""

import os
import subprocess
import sys

from .. import FragscopeError, binary

__all__ = ["watch", "dump", "Watcher", "TorchUnavailable"]


class TorchUnavailable(RuntimeError):
    """PyTorch is not installed, or sees no CUDA device."""


def _torch():
    try:
        import torch
    except ImportError as e:
        raise TorchUnavailable(f"PyTorch is not installed in this Python ({sys.executable}): {e}") from None
    if not torch.cuda.is_available():
        raise TorchUnavailable(
            f"PyTorch {getattr(torch, '__version__', '?')} sees no CUDA device (torch.cuda.is_available() is "
            "False): there is no GPU memory to watch"
        )
    return torch


def _say(line):
    try:
        print(line, file=sys.stderr, flush=True)
    except Exception:
        pass


def _bytes(n):
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


class Watcher:
    """The out-of-memory observer `watch()` attaches (callable as PyTorch
    calls it: device, requested bytes, bytes allocated on the device, bytes
    free on it)."""

    def __init__(self, torch, out_dir, limit, timeout, plots):
        self.torch = torch
        self.out_dir = os.fspath(out_dir)
        self.limit = limit
        self.timeout = timeout
        self.plots = plots
        self.seen = 0
        self.reports = []

    def __call__(self, device, alloc, device_allocated, device_free):
        try:
            self._explain(device, alloc, device_allocated, device_free)
        except BaseException as e:  # the observer must never take the program down
            _say(f"fragscope: the OOM could not be analysed: {e!r}")

    def _explain(self, device, alloc, device_allocated, device_free):
        self.seen += 1
        n = self.seen
        _say(
            f"fragscope: CUDA out of memory on device {device}: a request of {_bytes(alloc)}, "
            f"{_bytes(device_free)} free on the device, {_bytes(device_allocated)} allocated by this process"
        )
        if self.limit is not None and n > self.limit:
            _say(f"fragscope: OOM {n} not analysed: the limit of {self.limit} is reached (watch(limit=…))")
            return
        name = f"oom-{os.getpid()}-{n}"
        snapshot = os.path.join(self.out_dir, name + ".pickle")
        report = os.path.join(self.out_dir, name)
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            self.torch.cuda.memory._dump_snapshot(snapshot)
        except Exception as e:
            _say(f"fragscope: the snapshot could not be written to {snapshot}: {e}")
            return
        try:
            exe = binary()
        except FragscopeError as e:
            _say(f"fragscope: {e}; the snapshot is kept: {snapshot}")
            return
        args = [exe, "analyze", snapshot, "-o", report]
        if not self.plots:
            args.append("--no-plots")
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _say(
                f"fragscope: the analysis ran past {self.timeout} s and was stopped; the snapshot is kept: "
                f"{snapshot} (`fragscope analyze {snapshot} -o DIR` reads it later)"
            )
            return
        except OSError as e:
            _say(f"fragscope: {exe} could not be run: {e}; the snapshot is kept: {snapshot}")
            return
        if done.returncode not in (0, 3):
            why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            _say(f"fragscope: the analysis failed: {why}; the snapshot is kept: {snapshot}")
            return
        keys = ("verdict:", "memory:", "fix:", "settings not in force:")
        for line in done.stdout.splitlines():
            if line.strip().startswith(keys):
                _say("fragscope:   " + line.strip())
        _say(f"fragscope: report {os.path.join(report, 'report.md')} (snapshot {snapshot})")
        self.reports.append(report)


def watch(out_dir="fragscope-oom", max_entries=1_000_000, stacks="python", limit=5, timeout=300, plots=False):
    """Records PyTorch's memory history and explains every OOM (up to
    `limit`; None: all) into `out_dir`. Returns the observer, whose
    `reports` lists the report directories written. Raises
    TorchUnavailable without PyTorch or without CUDA.

    `stacks="python"` records Python frames only (PyTorch's cheapest mode
    that still names the call sites); "all" adds C++ frames. `plots=True`
    draws the PNGs too, which takes longer at the moment of the OOM."""
    torch = _torch()
    os.makedirs(out_dir, exist_ok=True)
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks=stacks, max_entries=max_entries)
    observer = Watcher(torch, out_dir, limit, timeout, plots)
    torch._C._cuda_attach_out_of_memory_observer(observer)
    return observer


def dump(path):
    """Writes a snapshot of the memory history now (as PyTorch's
    `_dump_snapshot`); returns its path."""
    torch = _torch()
    path = os.fspath(path)
    torch.cuda.memory._dump_snapshot(path)
    return path
