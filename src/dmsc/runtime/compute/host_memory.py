"""Host memory a process frees is kept for its next allocation, not handed back to the kernel.

A training step on the CPU allocates the same large temporaries at every step (activations,
their gradients, the flattened gradient, a codec's buffers). With glibc's defaults a block of
128 KiB or more is its own ``mmap``, returned to the kernel when freed, and each of its pages
faults in again, zeroed, at the next step's first touch; blocks freed by other threads than the
main one (a worker computes on its gRPC handler threads) live in per-thread heaps that are
unmapped once empty. On this project's 2-core machine a fresh 4 MB tensor's product took
0.93 ms on a handler thread against 0.30 ms once the memory was kept (64 MB: 47 against 7.8 ms;
an int8 decode of 1M elements 10.4 ms against 0.9 ms), and the cost model's counted passes over
memory (:mod:`dmsc.netmodel.codec_work`) hold only for the second.

So every process that computes (a stage worker, ``dmsc calibrate``'s measurements) calls
:func:`keep_freed_memory` first: one heap for all threads (``M_ARENA_MAX``), blocks up to
:data:`KEEP_BYTES` from that heap (``M_MMAP_THRESHOLD``), and up to :data:`KEEP_BYTES` of free
memory at its top kept (``M_TRIM_THRESHOLD``). The price is memory: a process keeps its peak
(less what it freed past :data:`KEEP_BYTES`) instead of shrinking between steps. PyTorch's CPU
guides reach for jemalloc or tcmalloc for the same reason; glibc's own parameters need no
library beyond the C one. Elsewhere than glibc nothing changes, nor where the environment says
``DMSC_ALLOCATOR=default`` (the local launcher's workers have ``dmsc up``'s environment): memory
handed back between steps, at the faults' price. Side by side
(``benchmarks/parallel_modes.py --only dp2-ring --dp 2``, alternated 3 times) dmsc's dp = 2 step
took 76.6-88.6 ms kept, 84.6-102.2 ms with the defaults, faster kept in each pair.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
KEEP_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Set glibc's allocator to keep freed memory (module docstring); False where the C
    library is not glibc, ``DMSC_ALLOCATOR=default`` is set, or glibc refused a parameter.
    Call it before the process starts threads: a thread that already has a heap keeps it."""
    if platform.libc_ver()[0] != "glibc" or os.environ.get("DMSC_ALLOCATOR") == "default":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, KEEP_BYTES), (M_TRIM_THRESHOLD, KEEP_BYTES))
    return all(mallopt(param, value) == 1 for param, value in settings)
