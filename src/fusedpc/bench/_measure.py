"""Timing a variant's calls (wall clock and process CPU time), its kernels' time by kind
(`jax.profiler`), and its memory (peak RSS, the device's peak); the JSON row of a variant."""

from __future__ import annotations

import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from fusedpc.bench._args import (
    TREE_PC_VARIANTS,
    BenchArgs,
    base_variant,
    variant_inference_steps,
)
from fusedpc.bench._report import config_fields
from fusedpc.bench._setup import prepare_variant, variant_blocks_form


def maxrss_mb() -> float:
    """Peak resident set size of this process so far, in MB (Linux reports KiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024.0 if sys.platform != "darwin" else rss / (1024.0 * 1024.0)


def device_info() -> dict[str, Any]:
    """The row fields that say where a figure was taken: device, jax, flags, allocator."""
    import jax

    from fusedpc.training import host_memory_reused

    device = jax.devices()[0]
    return {
        "device": str(getattr(device, "device_kind", device.platform)),
        "platform": device.platform,
        "n_devices": jax.device_count(),
        "jax": jax.__version__,
        # what would make compile times incomparable: optimisation flags, a warm disk cache
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        # jax.config's flags are attributes made at runtime, unknown to its type stubs
        "compilation_cache": bool(jax.config.jax_compilation_cache_dir),  # type: ignore[attr-defined]
        "host_memory_reused": host_memory_reused(),
    }


def device_peak_mb() -> float | None:
    """The first device's peak bytes in use, in MB; `None` where the backend keeps none."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2**20


def time_calls(call: Callable[[int], Any], warmup: int, steps: int) -> dict[str, Any]:
    """Time `call(i)`, blocking on its results: the first call, `warmup` untimed calls, then
    `steps` timed calls.

    Wall-clock and process CPU time (all threads) are both recorded: on a shared machine the
    CPU time is the steadier figure.

    Args:
        call: runs call `i` and returns what to block on.
        warmup: untimed calls after the first.
        steps: timed calls.

    Returns:
        `first` and `first_cpu` (s, the first call), `times` and `cpu` (s, one per timed
        call), `sys_fraction` (the kernel's share of the timed CPU time) and `page_faults`
        (minor page faults per timed call).
    """
    import jax

    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(call(0))
    first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
    for i in range(warmup):
        jax.block_until_ready(call(1 + i))
    times, cpu = [], []
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    for i in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(call(1 + warmup + i))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    user, system = usage1.ru_utime - usage0.ru_utime, usage1.ru_stime - usage0.ru_stime
    return {
        "first": first,
        "first_cpu": first_cpu,
        "times": times,
        "cpu": cpu,
        "sys_fraction": system / max(user + system, 1e-12),
        "page_faults": (usage1.ru_minflt - usage0.ru_minflt) / steps,
    }


def profile(call: Callable[[int], Any], start: int, calls: int = 3) -> list[list]:
    """Trace `calls` calls with `jax.profiler`.

    Args:
        call: as for `time_calls`.
        start: the index of the first traced call.
        calls: how many calls to trace.

    Returns:
        The XLA kernels' time by kind (the fusion's name without its numeric suffix), as
        `[name, ms per call summed over the runtime's threads]`, the 15 largest first.
    """
    import collections
    import glob
    import re
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as where:
        jax.profiler.start_trace(where)
        for i in range(calls):
            jax.block_until_ready(call(start + i))
        jax.profiler.stop_trace()
        files = sorted(glob.glob(os.path.join(where, "**", "*.xplane.pb"), recursive=True))
        if not files:
            return []
        data = jax.profiler.ProfileData.from_file(files[-1])
    totals: collections.Counter = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if line.name == "python":
                continue  # the host (dispatch) thread
            for event in line.events:
                if event.name.startswith(("ThunkExecutor", "SlinkyThreadPool", "PjRt")):
                    continue  # containers and waits, not kernels
                totals[re.sub(r"\.\d+$", "", event.name)] += event.duration_ns
    return [[name, ns / 1e6 / calls] for name, ns in totals.most_common(15)]


def _quartiles(times: list[float]) -> tuple[float, float, float]:
    if len(times) == 1:
        return times[0], times[0], times[0]
    q = statistics.quantiles(times, n=4, method="inclusive")
    return q[0], statistics.median(times), q[2]


def timed_calls(args: BenchArgs, steps_per_call: int) -> int:
    """How many calls to time: `args.steps`, or enough `run` calls for that many steps
    (at least 5)."""
    if steps_per_call == 1:
        return args.steps
    return max(math.ceil(args.steps / steps_per_call), 5)


def _variant_note(args: BenchArgs, variant: str) -> dict[str, str]:
    """A row's `note`, where its figures mean something else than a step's."""
    if variant == "backprop" and args.learning != "all":
        return {"note": "the backprop twin trains every weight, whatever --learning says"}
    if base_variant(variant) == "infill":
        return {"note": "not a training step: one fill-in of the batch (inference_steps "
                "sweeps); gflops count a training step's products"}
    return {}


def variant_row(
    args: BenchArgs,
    variant: str,
    n_blocks: int,
    timing: dict[str, Any],
    steps_per_call: int,
    rss: tuple[float, float],
    kernels: list | None,
) -> dict[str, Any]:
    """The JSON row of one measured variant.

    Args:
        args: the bench's settings.
        variant: the variant's name.
        n_blocks: the number of GPT blocks.
        timing: `time_calls`'s result.
        steps_per_call: training steps per timed call.
        rss: the process's maximum RSS (MB) before and after the variant.
        kernels: `profile`'s result, or `None` without `--profile`.

    Returns:
        The row: per-step times (median `step_ms`, quartiles, CPU `step_cpu_ms`), the first
        call (`compile_s` = `first_call_s`, `compile_only_s` less one steady call), memory,
        `gflops` from `fusedpc.transformer.reference.count_flops`, and the settings.
    """
    from fusedpc.transformer.reference import count_flops

    p25, median, p75 = (t / steps_per_call for t in _quartiles(timing["times"]))
    cpu = statistics.median(timing["cpu"]) / steps_per_call
    flops = count_flops(
        args.vocab, args.width, args.n_heads, n_blocks, args.ff_width, args.max_len, args.batch
    )
    tokens = args.batch * args.max_len
    note = _variant_note(args, variant)
    row = {
        "variant": variant,
        "step_ms": median * 1e3,
        "step_ms_p25": p25 * 1e3,
        "step_ms_p75": p75 * 1e3,
        "tokens_per_s": tokens / median,
        "compile_s": timing["first"],
        "first_call_s": timing["first"],
        "compile_only_s": max(timing["first"] - median * steps_per_call, 0.0),
        "compile_cpu_s": timing["first_cpu"],
        "step_cpu_ms": cpu * 1e3,
        "sys_fraction": timing["sys_fraction"],
        "page_faults_per_call": timing["page_faults"],
        "load_avg_1m": os.getloadavg()[0],
        "peak_mb": rss[1],
        "rss_growth_mb": rss[1] - rss[0],
        "device_peak_mb": device_peak_mb(),
        "gflops": flops / median / 1e9,
        "gflops_cpu": flops / cpu / 1e9,
        "flops_per_step": flops,
        "timed_steps": len(timing["times"]) * steps_per_call,
        "steps_per_call": steps_per_call,
        **(
            {"blocks_form": variant_blocks_form(variant, n_blocks)}
            if variant.startswith("fused") else {}
        ),
        **(
            {"inference_steps": steps, "inference_rate": args.inference_rate}
            if (steps := variant_inference_steps(variant, args.inference_steps)) is not None
            else {}
        ),
        **(
            {"inference_tolerance": args.inference_tolerance,
             "incremental_inference": args.incremental_inference}
            if base_variant(variant) in TREE_PC_VARIANTS else {}
        ),
        **device_info(),
        **config_fields(args, n_blocks),
        **note,
    }
    if kernels is not None:
        row["profile_ms_per_call"] = kernels
    return row


def measure_variant(args: BenchArgs, variant: str, n_blocks: int) -> dict[str, Any]:
    """Build, warm and time one variant in this process; returns its JSON row."""
    rss_before = maxrss_mb()
    call, steps_per_call = prepare_variant(args, variant, n_blocks)
    calls = timed_calls(args, steps_per_call)
    timing = time_calls(call, args.warmup, calls)
    kernels = profile(call, 1 + args.warmup + calls) if args.profile else None
    rss = (rss_before, maxrss_mb())
    return variant_row(args, variant, n_blocks, timing, steps_per_call, rss, kernels)


def measure_interleaved(
    args: BenchArgs, variants: list[str], n_blocks: int
) -> list[dict[str, Any]]:
    """All `variants` in this process, their timed calls taken in turn (one call of each per
    round), so that a load that comes and goes on a shared machine hits them alike.

    Each variant is built and its first call (compilation) timed on its own first; `peak_mb`
    is the growth of the maximum RSS over that phase.

    Returns:
        One row per variant, in the order of `variants`.
    """
    import jax

    prepared, firsts, rss = {}, {}, {}
    for variant in variants:
        before = maxrss_mb()
        call, steps_per_call = prepare_variant(args, variant, n_blocks)
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(call(0))
        firsts[variant] = (time.perf_counter() - t0, time.process_time() - c0)
        for i in range(args.warmup):
            jax.block_until_ready(call(1 + i))
        prepared[variant] = (call, steps_per_call)
        rss[variant] = (before, maxrss_mb())
    rounds = max(timed_calls(args, spc) for _, spc in prepared.values())
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        for variant, (call, steps_per_call) in prepared.items():
            if r >= timed_calls(args, steps_per_call):
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(call(1 + args.warmup + r))
            times[variant].append(time.perf_counter() - t0)
            cpu[variant].append(time.process_time() - c0)
    rows = []
    for variant, (call, steps_per_call) in prepared.items():
        timing = {
            "first": firsts[variant][0],
            "first_cpu": firsts[variant][1],
            "times": times[variant],
            "cpu": cpu[variant],
            "sys_fraction": None,
            "page_faults": None,
        }
        kernels = profile(call, 1 + args.warmup + rounds) if args.profile else None
        growth = rss[variant][1] - rss[variant][0]
        row = variant_row(args, variant, n_blocks, timing, steps_per_call, (0.0, growth), kernels)
        row["peak_method"] = "rss_growth_interleaved"
        rows.append(row)
    return rows
