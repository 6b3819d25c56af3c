"""Measurements that are not a timed training step: the float32 matmul peak (the machine's
reachable GFLOP/s) and the compiled memory of the fused step with and without donation."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from fusedpc.bench._args import BenchArgs
from fusedpc.bench._measure import device_info
from fusedpc.bench._report import config_fields
from fusedpc.bench._setup import Setup, variant_blocks_form


def memory_stats(compiled) -> dict[str, float] | None:
    """A compiled program's memory (`Compiled.memory_analysis()`), in MB.

    Args:
        compiled: a `jax.stages.Compiled`.

    Returns:
        `argument_mb`, `output_mb`, `alias_mb`, `temp_mb`, `total_mb` = arguments + outputs
        + temporaries - aliased (what one call allocates) and XLA's own liveness-based
        `xla_peak_mb` where reported (else `None`); `None` where the backend reports nothing.
    """
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    fields = ("argument", "output", "alias", "temp")
    out = {f"{f}_mb": getattr(stats, f"{f}_size_in_bytes") / 2**20 for f in fields}
    out["total_mb"] = out["argument_mb"] + out["output_mb"] + out["temp_mb"] - out["alias_mb"]
    peak = getattr(stats, "peak_memory_in_bytes", None)
    out["xla_peak_mb"] = None if peak is None else peak / 2**20
    return out


def measure_donation(args: BenchArgs, n_blocks: int) -> dict[str, Any]:
    """Compiled memory of the fused step (as the `fused` variant) with its carry donated and
    without: `jax.jit(pipeline.program.step, donate_argnums=0)` against
    `jax.jit(pipeline.program.step)`, both lowered at `pipeline.carry`; returns the
    `donation` row."""
    import jax

    setup = Setup(args, n_blocks)
    pipeline = setup.pipeline("fused")
    ids, targets = setup.batch(0)
    step, carry = pipeline.program.step, pipeline.carry
    donated = jax.jit(step, donate_argnums=0).lower(carry, ids, targets).compile()
    kept = jax.jit(step).lower(carry, ids, targets).compile()
    with_donation, without = memory_stats(donated), memory_stats(kept)
    state_mb = sum(
        leaf.nbytes for leaf in jax.tree_util.tree_leaves(pipeline.state)
        if hasattr(leaf, "nbytes")
    ) / 2**20
    return {
        "variant": "donation",
        "state_mb": state_mb,
        "donated": with_donation,
        "not_donated": without,
        "donated_peak_mb": None if with_donation is None else with_donation["total_mb"],
        "not_donated_peak_mb": None if without is None else without["total_mb"],
        "blocks_form": variant_blocks_form("fused", n_blocks),
        **device_info(),
        **config_fields(args, n_blocks),
    }


def measure_peak(args: BenchArgs) -> dict[str, Any]:
    """The best float32 matmul rate over `args.peak_sizes` (median of several repetitions
    each); returns the `peak` row (GFLOP/s, wall clock and per CPU second)."""
    import jax
    import jax.numpy as jnp

    results, results_cpu = {}, {}
    for n in args.peak_sizes:
        a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32)
        matmul = jax.jit(jnp.matmul)
        jax.block_until_ready(matmul(a, b))
        reps = max(3, min(20, int(2e10 / (2 * n**3))))
        times, cpu = [], []
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(matmul(a, b))
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        results[str(n)] = 2 * n**3 / statistics.median(times) / 1e9
        results_cpu[str(n)] = 2 * n**3 / statistics.median(cpu) / 1e9
    best = max(results, key=results.__getitem__)
    return {
        "variant": "peak",
        "peak_gflops": results[best],
        "peak_gflops_cpu": max(results_cpu.values()),
        "peak_size": int(best),
        "by_size_gflops": results,
        "by_size_gflops_cpu": results_cpu,
        "load_avg_1m": os.getloadavg()[0],
        **device_info(),
    }
