"""Keep the host memory XLA:CPU frees between steps, instead of handing it back to the kernel.

XLA's CPU runtime allocates each call's temporaries and outputs with the C library's `malloc`
and frees them when the call ends. With glibc's defaults, every block above the mmap
threshold (at most 32 MiB, and every large block a worker thread allocates in its own arena)
is a fresh `mmap` that is unmapped again on `free`: the next step maps it anew, and the
kernel zero-fills every page on first touch. At config M of the benchmark that is about
125,000 page faults, 500 MB of fresh pages and 15 to 20 % of the step's CPU time, every step.

`reuse_host_memory()` sets glibc's allocator (through `mallopt`, the same settings as the
`MALLOC_*` environment variables) so that freed blocks stay in the process and the next
step reuses them: one arena for all threads, no `mmap` for large blocks, and the heap top
neither trimmed nor released. The process keeps its peak host memory instead of returning
it between steps; nothing else changes (results are bit for bit the same).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_SETTINGS = (
    (_M_ARENA_MAX, 1),  # every thread allocates from the main (brk) heap
    (_M_MMAP_MAX, 0),  # no block is served by its own mmap
    (_M_TRIM_THRESHOLD, 2**31 - 1),  # never give the heap top back
    (_M_TOP_PAD, 64 << 20),  # grow the heap in 64 MiB steps
)

_applied: bool | None = None


def reuse_host_memory() -> bool:
    """Make the C allocator keep freed host memory for reuse; returns whether it was applied.

    Call it once, early: before the first jax computation, so that XLA's worker threads
    allocate from the shared heap from the start (threads that already allocated keep their
    own arenas). `fusedpc train` and `fusedpc bench` call it; call it yourself in scripts and
    notebooks that train on CPU. Applies on Linux with glibc only; elsewhere (macOS, musl)
    it does nothing and returns False. Calling it again returns the first call's result.

    Trade-off: host memory freed after a step is not returned to the operating system
    while the process runs, so the resident size stays at its peak.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc: no mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _applied = all(mallopt(param, value) == 1 for param, value in _SETTINGS)
    return _applied


def host_memory_reused() -> bool:
    """Whether `reuse_host_memory()` has been applied in this process."""
    return bool(_applied)
