"""Hand-derived frozen parts against autodiff-backed ones (`fusedpc.frozen.from_module`).

Prints JSON lines:

* `"kind": "cache"`, one per part: the bytes of the cache its forward keeps for the backward
  (the leaves of the cache pytree), hand-derived (`frozen.linear`, `frozen.gelu`,
  `frozen.layer_norm`) and autodiff-backed (`from_module` of `eqx.nn.Linear`,
  `eqx.nn.Lambda(jax.nn.gelu)`, `eqx.nn.LayerNorm`), at the bench's rows and widths;
* `"kind": "step"`, one per variant: the median `FusedPipeline.step` time of a frozen
  `Sequential` (linear, GELU, LayerNorm, linear) built from either kind, over interleaved
  rounds (each round times every variant once, so drift hits both alike), its first step
  (trace and compile included) and the compiled step's scratch memory
  (`memory_analysis().temp_size_in_bytes`: inside one fused program XLA keeps only what
  the backward needs, so this is the figure a single step pays, where the cache bytes are
  what a stacked cache, a `Repeat`'s scan, holds per block).

    python scripts/autodiff_part_bench.py
    python scripts/autodiff_part_bench.py --rows 1024 --width 256 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import fusedpc
from fusedpc import frozen


def cache_bytes(part: fusedpc.AbstractPart, x: jax.Array) -> int:
    """Bytes of the leaves of the cache that `part`'s forward returns for `x` (shapes only;
    nothing runs)."""
    core = part.compile("")
    _, cache = jax.eval_shape(core.forward, part.init_state(jax.random.key(0)), x)
    return sum(
        int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
        for leaf in jax.tree_util.tree_leaves(cache)
    )


def _modules(width: int, hidden: int) -> dict[str, eqx.Module]:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "linear_in": eqx.nn.Linear(width, hidden, key=k1),
        "gelu": eqx.nn.Lambda(jax.nn.gelu),
        "layer_norm": eqx.nn.LayerNorm(hidden),
        "linear_out": eqx.nn.Linear(hidden, width, key=k2),
    }


def _hand_derived(modules: dict[str, eqx.Module]) -> list[fusedpc.AbstractPart]:
    return [
        frozen.linear(modules["linear_in"]),
        frozen.gelu(),
        frozen.layer_norm(modules["layer_norm"]),
        frozen.linear(modules["linear_out"]),
    ]


def _autodiff(modules: dict[str, eqx.Module]) -> list[fusedpc.AbstractPart]:
    return [frozen.from_module(modules[name]) for name in modules]


def _time_steps(pipeline: fusedpc.FusedPipeline, x, target, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        pipeline.step(x, target)
    jax.block_until_ready(pipeline.state)
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="steps timed per round")
    args = parser.parse_args(argv)

    device = jax.devices()[0].device_kind
    modules = _modules(args.width, args.hidden)
    x = jax.random.normal(jax.random.key(1), (args.rows, args.width), jnp.float32)
    hidden = jax.random.normal(jax.random.key(2), (args.rows, args.hidden), jnp.float32)
    inputs = {"linear_in": x, "gelu": hidden, "layer_norm": hidden, "linear_out": hidden}
    for (name, hand), auto in zip(
        zip(modules, _hand_derived(modules), strict=True), _autodiff(modules), strict=True
    ):
        print(json.dumps({
            "kind": "cache", "part": name, "rows": args.rows,
            "hand_derived_bytes": cache_bytes(hand, inputs[name]),
            "from_module_bytes": cache_bytes(auto, inputs[name]),
        }))

    target = jnp.zeros_like(x)
    pipelines, compile_s, temp_bytes = {}, {}, {}
    for variant, parts in (
        ("hand_derived", _hand_derived(modules)), ("from_module", _autodiff(modules))
    ):
        pipeline = fusedpc.FusedPipeline(fusedpc.Sequential(parts))
        start = time.perf_counter()
        pipeline.step(x, target)
        jax.block_until_ready(pipeline.state)
        compile_s[variant] = time.perf_counter() - start
        memory = pipeline.compiled_step(x, target).memory_analysis()
        temp_bytes[variant] = None if memory is None else int(memory.temp_size_in_bytes)
        pipelines[variant] = pipeline
    times: dict[str, list[float]] = {variant: [] for variant in pipelines}
    for _ in range(args.rounds):
        for variant, pipeline in pipelines.items():
            times[variant].append(_time_steps(pipeline, x, target, args.steps))
    for variant, measured in times.items():
        print(json.dumps({
            "kind": "step", "variant": variant, "rows": args.rows, "width": args.width,
            "hidden": args.hidden, "step_ms_median": round(1e3 * statistics.median(measured), 3),
            "step_ms_min": round(1e3 * min(measured), 3), "rounds": args.rounds,
            "steps_per_round": args.steps, "first_step_s": round(compile_s[variant], 3),
            "step_temp_bytes": temp_bytes[variant],
            "device": device, "jax": jax.__version__,
        }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
