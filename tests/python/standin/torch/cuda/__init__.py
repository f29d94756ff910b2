import os

from . import memory  # noqa: F401


class OutOfMemoryError(RuntimeError):
    pass


def is_available():
    return os.environ.get("STANDIN_CUDA", "1") == "1"


_allocated = 0


def _allocate(nbytes):
    global _allocated
    from .. import _C

    budget = int(os.environ.get("STANDIN_BUDGET", str(1 << 30)))
    if _allocated + nbytes > budget:
        for fn in _C._observers:
            fn(0, nbytes, _allocated, budget - _allocated)
        raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")
    _allocated += nbytes
    return nbytes


def _free(nbytes):
    global _allocated
    _allocated -= nbytes
