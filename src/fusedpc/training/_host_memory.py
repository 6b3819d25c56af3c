"""Keep the host memory XLA:CPU frees between steps, instead of handing it back to the kernel.

XLA's CPU runtime allocates each call's temporaries and outputs with the C library's `malloc`
and frees them when the call ends. With glibc's defaults, every block above the mmap
threshold (at most 32 MiB, and every large block a worker thread allocates in its own arena)
is a fresh `mmap` that is unmapped again on `free`: the next step maps it anew, and the
kernel zero-fills every page on first touch. For a step with large temporaries those page
faults and zero-fills are a sizeable share of the step's CPU time, every step (measured in
docs/performance.md).

`reuse_host_memory()` sets glibc's allocator (through `mallopt`, the same settings as the
`MALLOC_*` environment variables) so that freed blocks stay in the process and the next
step reuses them: one arena for all threads, no `mmap` for large blocks, and the heap top
neither trimmed nor released. The process keeps its peak host memory instead of returning it
between steps; nothing else changes (results are bit for bit the same).

It is a trade-off (measured in docs/performance.md): a step with large temporaries gains
(the page faults and zero-fills are gone), a small step loses (the threads of its many
small kernels then contend for the one arena). `host_memory_choice` decides from
the estimated size of a step's temporaries, so `fusedpc train` and `fusedpc bench` apply it
only to large steps by default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

# (mallopt parameter, environment variable read at process start, value)
_SETTINGS = (
    # every thread allocates from the main (brk) heap: a thread arena serves a block larger
    # than its 64 MiB heap with a fresh mmap whatever M_MMAP_MAX says, and unmaps it on free
    (_M_ARENA_MAX, "MALLOC_ARENA_MAX", 1),
    (_M_MMAP_MAX, "MALLOC_MMAP_MAX_", 0),  # no block is served by its own mmap
    (_M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", 2**31 - 1),  # never give the heap top back
    (_M_TOP_PAD, "MALLOC_TOP_PAD_", 64 << 20),  # grow the heap in 64 MiB steps
)

def reuse_host_memory() -> bool:
    """Make the C allocator keep freed host memory for reuse; returns whether it was applied.

    Call it once, as early as possible: threads that allocated before it keep their own
    arenas, and XLA's threads may share one of those (importing numpy starts such threads),
    so in a running process it is effective but not guaranteed to catch every block. The
    sure way is to start the process with `host_memory_env()` in its environment (glibc
    reads it at start-up), which is what `fusedpc bench` does for its measuring processes.
    Applies on Linux with glibc only; elsewhere (macOS, musl) it does nothing and returns
    False. Calling it again returns the first call's result.

    Trade-off: host memory freed after a step is not returned to the operating system
    while the process runs, so the resident size stays at its peak.
    """
    return _set_allocator()


@functools.cache
def _set_allocator() -> bool:
    """The `mallopt` calls, made once per process (the allocator's settings are the
    process's own state): whether they were applied."""
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
    return all(mallopt(param, value) == 1 for param, _, value in _SETTINGS)


def host_memory_env() -> dict[str, str]:
    """`reuse_host_memory()`'s settings as the environment variables glibc reads when a
    process starts: add them to a child process's environment (or export them in a shell)."""
    return {name: str(value) for _, name, value in _SETTINGS}


def host_memory_reused() -> bool:
    """Whether `reuse_host_memory()` was applied in this process, or the process started
    with `host_memory_env()` in its environment."""
    if _set_allocator.cache_info().currsize and _set_allocator():
        return True
    return sys.platform.startswith("linux") and all(
        os.environ.get(name) == value for name, value in host_memory_env().items()
    )


# `host_memory_choice("auto", ...)` reuses host memory from this estimate on: it lies between
# the small benchmark step, where the one shared arena costs more than it saves, and the
# large one, where the saved page faults pay (measured in docs/performance.md).
REUSE_ABOVE_BYTES = 128 * 2**20

HOST_MEMORY_MODES = ("auto", "reuse", "system")


def gpt_step_temporaries(
    *, batch: int, seq: int, width: int, heads: int, blocks: int, ff_width: int
) -> int:
    """A rough size in bytes of one GPT training step's temporaries (float32): per block,
    about three arrays the size of the attention weights `(B, H, T, T)`, three of the
    feed-forward's hidden layer `(B, T, F)` and a dozen of the width `(B, T, D)`."""
    rows = batch * seq
    return 4 * blocks * rows * (3 * heads * seq + 3 * ff_width + 12 * width)


def host_memory_choice(mode: str, temporaries_bytes: int) -> bool:
    """Apply `reuse_host_memory()` per `mode` and return whether it is in effect.

    `"reuse"` always applies it, `"system"` never, `"auto"` when `temporaries_bytes` (e.g.
    `gpt_step_temporaries(...)`) is at least `REUSE_ABOVE_BYTES`.
    """
    if wants_host_memory_reuse(mode, temporaries_bytes):
        return reuse_host_memory()
    return host_memory_reused()


def wants_host_memory_reuse(mode: str, temporaries_bytes: int) -> bool:
    """The decision of `host_memory_choice`, without applying it."""
    if mode not in HOST_MEMORY_MODES:
        raise ValueError(f"host memory mode must be one of {HOST_MEMORY_MODES}, got {mode!r}.")
    return mode == "reuse" or (mode == "auto" and temporaries_bytes >= REUSE_ABOVE_BYTES)
