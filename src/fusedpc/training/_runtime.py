"""Process-level runtime settings of a run: the compilation cache, joining a multi-process
run, emulated CPU devices and Ctrl-C handling."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from fusedpc.execution._sharding import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    initialize_distributed,
)

PLATFORMS = ("cpu", "gpu", "tpu")
"""The platforms `fusedpc train --device` accepts."""

_INSTALL_HINTS = {
    "gpu": 'pip install -U "jax[cuda12]" (NVIDIA; see JAX\'s installation guide for ROCm)',
    "tpu": 'pip install -U "jax[tpu]"',
    "cpu": "pip install -U jax",
}


def select_platform(platform: str | None) -> None:
    """Run on `platform` (`"cpu"`, `"gpu"`, `"tpu"`), or JAX's choice for None, and check
    that it is there: a missing backend is a `ValueError` saying what to install.

    Must run before JAX starts its backends (the CLI calls it right after parsing)."""
    if platform is not None:
        if platform not in PLATFORMS:
            raise ValueError(f"--device: expected one of {PLATFORMS}, got {platform!r}.")
        jax.config.update("jax_platforms", "cuda,rocm" if platform == "gpu" else platform)
    try:
        jax.devices()
    except RuntimeError as err:
        wanted = platform or os.environ.get("JAX_PLATFORMS") or "the default platform"
        hint = _INSTALL_HINTS.get(str(platform), "check JAX_PLATFORMS and your jax install")
        detail = " ".join(str(err).split())[:160]
        raise ValueError(
            f"--device {wanted}: JAX has no such backend here ({detail}); install it with "
            f"{hint}, or run on --device cpu."
        ) from None


def device_info() -> dict[str, Any]:
    """What the run runs on: platform, device kind and count, processes, jax and jaxlib."""
    import jaxlib

    devices = jax.devices()
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "processes": jax.process_count(),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "unknown"),
    }


class StopRequest:
    """Turns the first Ctrl-C (SIGINT) or SIGTERM (what `kill`, a scheduler's time limit or a
    container's stop sends) into a request to stop after the current call; a second one
    interrupts at once. Installed only in the main thread."""

    SIGNALS = tuple(
        s for s in (signal.SIGINT, getattr(signal, "SIGTERM", None)) if s is not None
    )

    def __init__(self, on_request: Callable[[], None] | None = None):
        self.requested = False
        self.aborted = False
        self._on_request = on_request
        # the handlers this one replaced, as `signal.signal` returns them
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        self.signal_name: str | None = None

    def _handle(self, signum, frame):
        if self.requested:
            self.aborted = True
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        if self._on_request is not None:
            self._on_request()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc):
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}
        return False


def default_cache_dir() -> str:
    """`$FUSEDPC_CACHE`, else `$XDG_CACHE_HOME/fusedpc/jax`, else `~/.cache/fusedpc/jax`."""
    if os.environ.get("FUSEDPC_CACHE"):
        return os.environ["FUSEDPC_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fusedpc", "jax")


def enable_compile_cache(path: str | os.PathLike | None = None) -> str | None:
    """Keep compiled programs on disk (JAX's persistent compilation cache) so that a later run
    of the same model skips compiling (tens of seconds on a CPU). Returns the folder used.

    `path=None` uses `default_cache_dir()`, unless JAX already has a cache folder configured
    (e.g. `JAX_COMPILATION_CACHE_DIR`), which is then kept; `"none"` changes nothing. A folder
    that cannot be created is skipped silently: the cache only saves time. Compiled programs
    are the same with or without it, so results do not change.
    """
    if path is not None and os.fspath(path) == "none":
        return None
    # jax.config's flags are attributes made at runtime, unknown to its type stubs
    if path is None and jax.config.jax_compilation_cache_dir:  # type: ignore[attr-defined]
        return jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    folder = os.fspath(path) if path is not None else default_cache_dir()
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()  # take the folder into use even if JAX compiled before
    return folder


PROCESS_VARIABLES = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
"""The variables a multi-process run on one machine sets (read by `initialize_distributed`)."""


def join_processes() -> None:
    """Join a multi-process run: `fusedpc.initialize_distributed()`, which reads its settings.

    On a cluster (Slurm, Open MPI, TPU pods) JAX reads the processes from the environment.
    Elsewhere, e.g. several processes on one machine, set all three of `FUSEDPC_COORDINATOR`
    (`host:port` of process 0), `FUSEDPC_NUM_PROCESSES` and `FUSEDPC_PROCESS_ID`.

    Raises:
        ValueError: some but not all of `PROCESS_VARIABLES` are set, or a count is not an
            integer; the message, prefixed with `--distributed:`, names them.
    """
    try:
        initialize_distributed()
    except ValueError as err:
        raise ValueError(f"--distributed: {err}") from None


def emulate_cpu_devices(n: int) -> None:
    """Make the CPU platform show `n` devices (`jax.config.update("jax_num_cpu_devices", n)`).

    Before JAX starts its backends (the first array or `jax.devices()`) it sets the count, an
    earlier count replaced; `XLA_FLAGS` is left alone (the option takes precedence over its
    `--xla_force_host_platform_device_count`). Afterwards the count can no longer change, so it
    only checks: at least `n` CPU devices is fine, fewer is a `RuntimeError` saying what to do.

    Args:
        n: the number of CPU devices, >= 1.

    Raises:
        ValueError: `n` < 1.
        RuntimeError: JAX has already started with fewer than `n` CPU devices.
    """
    n = int(n)
    if n < 1:
        raise ValueError(f"emulate_cpu_devices: n must be >= 1, got {n}.")
    try:
        jax.config.update("jax_num_cpu_devices", n)
        return
    except RuntimeError:  # JAX refuses a new count once its backends have started
        pass
    have = len(jax.devices("cpu"))
    if have < n:
        raise RuntimeError(
            f"emulate_cpu_devices({n}): JAX has already started with {have} CPU device(s), "
            f"and the count cannot change afterwards. Call it before any JAX array is made "
            f"(e.g. right after `import fusedpc`), or start Python with "
            f"JAX_NUM_CPU_DEVICES={n}."
        )
