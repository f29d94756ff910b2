"""A stand-in for PyTorch with exactly the surface fragscope.torch uses
(tests only): `__version__`, `cuda.is_available()`,
`cuda.OutOfMemoryError`, `cuda.memory._record_memory_history`,
`cuda.memory._dump_snapshot`, `_C._cuda_attach_out_of_memory_observer`,
and `empty(nbytes)` to allocate against a budget: a request past it calls
the observers, as PyTorch's allocator does, then raises.

Environment: STANDIN_CUDA=0 (no device), STANDIN_BUDGET (bytes),
STANDIN_SNAPSHOT (the real snapshot `_dump_snapshot` writes)."""

__version__ = "2.11.0+standin"

from . import _C, cuda  # noqa: E402


def empty(nbytes, device="cuda"):
    return cuda._allocate(int(nbytes))
