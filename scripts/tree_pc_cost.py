"""The cost of predictive coding over the whole tree: step time of the fully-PC GPT as a
function of T, beside the single-sweep exact step and the backprop twin, and compile time and
memory at T = 8 against T = 64.

At config S (vocab 65, width 64, 4 heads, 2 blocks, seq 64, batch 16, every weight learning,
Adam 1e-3): `tree_pc_T<T>` is `GPTConfig(latents="all")` (a latent after every slot) relaxed
for T sweeps at `--inference-rate` (`fusedpc.Relaxation`), `tree_pc_fixed_T<T>` the same under
fixed prediction (sweeps are backward walks only), `tree_pc_blocks_T<T>` a latent after the
embedding and every block, `tree_pc_adaptive_T<T>` adaptive inference at a tolerance never
met (a `lax.while_loop` that runs all T sweeps: its cost beside the scan's),
`tree_pc_incremental_T<T>` incremental PC (the weights step at every sweep). Each
measurement prints one JSON line per variant:

* `step`: every variant built in this process, then timed call by call in turn (one call of
  each per round, so that the machine's load falls on all alike); medians over the rounds.
* `compile`: the step program of each T traced, lowered and compiled in a fresh process
  without the compilation cache, the T values interleaved over rounds; medians, with the
  compiled program's temporary memory.

    python scripts/tree_pc_cost.py                         # both
    python scripts/tree_pc_cost.py --only step --steps-list 4,8,16 --rounds 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIG_S = {"vocab_size": 65, "width": 64, "n_heads": 4, "n_blocks": 2, "ff_width": 256,
            "max_len": 64}
BATCH = 16


def _variant(name: str, rate: float):
    """`(GPTConfig, Relaxation or None)` of a variant name."""
    import fusedpc

    if name == "single_sweep":
        return fusedpc.GPTConfig(**CONFIG_S, learn="all"), None
    kind, steps = name.rsplit("_T", 1)
    latents = "blocks" if kind == "tree_pc_blocks" else "all"
    # `tree_pc_adaptive`: a tolerance that is never met, so the while loop runs all T sweeps
    relaxation = fusedpc.Relaxation(steps=int(steps), rate=rate,
                                    fixed_prediction=kind == "tree_pc_fixed",
                                    tolerance=1e-30 if kind == "tree_pc_adaptive" else None,
                                    incremental=kind == "tree_pc_incremental")
    return fusedpc.GPTConfig(**CONFIG_S, learn="all", latents=latents), relaxation


def _batches(n: int):
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (n, BATCH, CONFIG_S["max_len"])
    ids = rng.integers(0, CONFIG_S["vocab_size"], shape).astype(np.int32)
    return ids, rng.integers(0, CONFIG_S["vocab_size"], shape).astype(np.int32)


def _timed_calls(names: list[str], rate: float) -> tuple[dict, dict]:
    """One call per variant (and the twin) that steps its own state; their first-call times."""
    import equinox as eqx
    import jax
    import optax

    import fusedpc
    from fusedpc.transformer.reference import make_backprop_step

    optimiser = optax.adam(1e-3)
    ids, targets = _batches(4)
    batches = [(jax.device_put(ids[i]), jax.device_put(targets[i])) for i in range(4)]
    calls, first = {}, {}
    reference = None
    for name in names:
        config, relaxation = _variant(name, rate)
        part, reference = fusedpc.build_gpt(config, optimiser, jax.random.key(0))
        pipeline = fusedpc.FusedPipeline(part, config.error_fn, relaxation=relaxation)

        def call(i, pipeline=pipeline):
            out = pipeline.step(*batches[i % 4])
            jax.block_until_ready((out, pipeline.state))

        start = time.perf_counter()
        call(0)
        first[name], calls[name] = time.perf_counter() - start, call
    step = make_backprop_step(optimiser)
    holder = {"model": reference, "opt": optimiser.init(eqx.filter(reference, eqx.is_array))}

    def twin(i):
        holder["model"], holder["opt"], loss = step(holder["model"], holder["opt"],
                                                    *batches[i % 4])
        jax.block_until_ready(loss)

    start = time.perf_counter()
    twin(0)
    first["backprop"], calls["backprop"] = time.perf_counter() - start, twin
    return calls, first


def measure_steps(names: list[str], rate: float, rounds: int, warmup: int) -> list[dict]:
    """Step times of every variant, the single sweep and the twin, interleaved."""
    import jax

    calls, first = _timed_calls(["single_sweep", *names], rate)
    for i in range(warmup):
        for call in calls.values():
            call(i)
    times: dict[str, list[float]] = {name: [] for name in calls}
    load_before = os.getloadavg()[0]
    for i in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call(i)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    tokens = BATCH * CONFIG_S["max_len"]
    return [{
        "measure": "step", "variant": name, "step_ms": round(1e3 * median, 3),
        "step_ms_p25": round(1e3 * statistics.quantiles(times[name], n=4)[0], 3),
        "step_ms_p75": round(1e3 * statistics.quantiles(times[name], n=4)[2], 3),
        "tokens_per_s": round(tokens / median),
        "ratio_to_single_sweep": round(median / medians["single_sweep"], 3),
        "ratio_to_backprop": round(median / medians["backprop"], 3),
        "first_call_s": round(first[name], 3), "rounds": rounds, "inference_rate": rate,
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "jax": jax.__version__,
    } for name, median in medians.items()]


def _compile_worker(name: str, rate: float) -> dict:
    import jax
    import optax

    import fusedpc

    config, relaxation = _variant(name, rate)
    part, _ = fusedpc.build_gpt(config, optax.adam(1e-3), jax.random.key(0))
    program = fusedpc.make_step(part, config.error_fn, relaxation=relaxation)
    carry = program.init(jax.random.key(0))
    ids, targets = _batches(1)
    start = time.perf_counter()
    lowered = jax.jit(program.step).trace(carry, ids[0], targets[0]).lower()
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    memory = compiled.memory_analysis()
    return {"measure": "compile", "variant": name, "trace_lower_s": round(traced - start, 3),
            "compile_s": round(done - traced, 3),
            "temp_bytes": None if memory is None else int(memory.temp_size_in_bytes),
            "jax": jax.__version__}


def measure_compiles(names: list[str], rate: float, rounds: int) -> list[dict]:
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false", "JAX_PLATFORMS": "cpu"}
    rows: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            done = subprocess.run(
                [sys.executable, __file__, "--compile-worker", name,
                 "--inference-rate", str(rate)],
                env=env, capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            rows[name].append(row)
    base = statistics.median(r["compile_s"] for r in rows[names[0]])
    return [{
        "summary": "compile", "variant": name,
        "compile_s_median": round(statistics.median(r["compile_s"] for r in rows[name]), 3),
        f"ratio_to_{names[0]}": round(
            statistics.median(r["compile_s"] for r in rows[name]) / base, 3),
        "temp_bytes": rows[name][-1]["temp_bytes"], "rounds": rounds,
    } for name in names]


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("step", "compile"), default=None)
    parser.add_argument("--variants", type=_names, default=_names(
        "tree_pc_T1,tree_pc_T4,tree_pc_T8,tree_pc_T16,tree_pc_fixed_T8,tree_pc_blocks_T8,"
        "tree_pc_adaptive_T8,tree_pc_incremental_T8"),
        help="the variants timed beside the single sweep and the twin")
    parser.add_argument("--compile-variants", type=_names,
                        default=_names("tree_pc_T8,tree_pc_T64"),
                        help="the variants compiled (ratios to the first)")
    parser.add_argument("--inference-rate", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds of the steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile-rounds", type=int, default=3)
    parser.add_argument("--compile-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile_worker is not None:
        print(json.dumps(_compile_worker(args.compile_worker, args.inference_rate)))
        return
    if args.only in (None, "step"):
        for row in measure_steps(args.variants, args.inference_rate, args.rounds, args.warmup):
            print(json.dumps(row), flush=True)
    if args.only in (None, "compile"):
        for row in measure_compiles(args.compile_variants, args.inference_rate,
                                    args.compile_rounds):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
