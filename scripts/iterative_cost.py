"""The cost of iterative inference: step time as a function of T, and compile time and memory
at T = 8 against T = 64.

At config S (vocab 65, width 64, 4 heads, 2 blocks, seq 64, batch 16, every weight learning,
Adam 1e-3), every feed-forward an `IterativeNetwork` (`GPTConfig(learning_kind="iterative")`)
with T relaxation steps, beside the single-sweep exact step (`precision_weighted`) and the
backprop twin. Two measurements, each printing one JSON line per variant:

* `step`: every variant built in this process, then timed call by call in turn (one call of
  each per round, so that the machine's load falls on all alike); medians over the rounds.
* `compile`: the step program of each T traced, lowered and compiled in a fresh process without
  the compilation cache, the T values interleaved over rounds; medians, with the compiled
  program's temporary memory (`memory_analysis().temp_size_in_bytes`).

    python scripts/iterative_cost.py                       # both, T = 1 ... 64
    python scripts/iterative_cost.py --only step --steps-list 4,8,16 --rounds 50
    python scripts/iterative_cost.py --only compile --compile-steps 8,64 --compile-rounds 3
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


def _config(steps: int | None, rate: float):
    import fusedpc

    if steps is None:
        return fusedpc.GPTConfig(**CONFIG_S, learn="all")
    return fusedpc.GPTConfig(
        **CONFIG_S, learn="all", learning_kind="iterative",
        learning_kwargs={"inference_steps": steps, "inference_rate": rate},
    )


def _batches(n: int):
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(0, CONFIG_S["vocab_size"], (n, BATCH, CONFIG_S["max_len"]))
    targets = rng.integers(0, CONFIG_S["vocab_size"], (n, BATCH, CONFIG_S["max_len"]))
    return ids.astype(np.int32), targets.astype(np.int32)


def measure_steps(steps_list: list[int], rate: float, rounds: int, warmup: int) -> list[dict]:
    """Step times of the single-sweep part, each T and the twin, interleaved."""
    import equinox as eqx
    import jax
    import optax

    import fusedpc
    from fusedpc.transformer.reference import make_backprop_step

    optimiser = optax.adam(1e-3)
    ids, targets = _batches(4)
    batches = [(jax.device_put(ids[i]), jax.device_put(targets[i])) for i in range(4)]
    calls, first = {}, {}
    for name, steps in [("single_sweep", None), *[(f"iterative_T{t}", t) for t in steps_list]]:
        config = _config(steps, rate)
        part, reference = fusedpc.build_gpt(config, optimiser, jax.random.key(0))
        pipeline = fusedpc.FusedPipeline(part, config.error_fn)

        def call(i, pipeline=pipeline):
            out = pipeline.step(*batches[i % 4])
            jax.block_until_ready((out, pipeline.state))

        start = time.perf_counter()
        call(0)
        first[name] = time.perf_counter() - start
        calls[name] = call
    step = make_backprop_step(optimiser)
    holder = {"model": reference}
    holder["opt"] = optimiser.init(eqx.filter(reference, eqx.is_array))

    def twin(i):
        holder["model"], holder["opt"], loss = step(holder["model"], holder["opt"],
                                                    *batches[i % 4])
        jax.block_until_ready(loss)

    start = time.perf_counter()
    twin(0)
    first["backprop"] = time.perf_counter() - start
    calls["backprop"] = twin
    for i in range(warmup):
        for call in calls.values():
            call(i)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call(i)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    tokens = BATCH * CONFIG_S["max_len"]
    rows = []
    for name, median in medians.items():
        rows.append({
            "measure": "step", "variant": name, "step_ms": round(1e3 * median, 3),
            "step_ms_p25": round(1e3 * statistics.quantiles(times[name], n=4)[0], 3),
            "step_ms_p75": round(1e3 * statistics.quantiles(times[name], n=4)[2], 3),
            "tokens_per_s": round(tokens / median),
            "ratio_to_single_sweep": round(median / medians["single_sweep"], 3),
            "ratio_to_backprop": round(median / medians["backprop"], 3),
            "first_call_s": round(first[name], 3), "rounds": rounds,
            "inference_rate": rate, "load_avg_1m": round(os.getloadavg()[0], 2),
            "jax": jax.__version__,
        })
    return rows


def _compile_worker(steps: int, rate: float) -> dict:
    import jax
    import optax

    import fusedpc

    config = _config(steps, rate)
    part, _ = fusedpc.build_gpt(config, optax.adam(1e-3), jax.random.key(0))
    program = fusedpc.make_step(part, config.error_fn)
    carry = program.init(jax.random.key(0))
    ids, targets = _batches(1)
    start = time.perf_counter()
    lowered = jax.jit(program.step).trace(carry, ids[0], targets[0]).lower()
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    memory = compiled.memory_analysis()
    return {"measure": "compile", "inference_steps": steps,
            "trace_lower_s": round(traced - start, 3), "compile_s": round(done - traced, 3),
            "temp_bytes": None if memory is None else int(memory.temp_size_in_bytes),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__}


def measure_compiles(steps_list: list[int], rate: float, rounds: int) -> list[dict]:
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false", "JAX_PLATFORMS": "cpu"}
    rows: dict[int, list[dict]] = {t: [] for t in steps_list}
    for _ in range(rounds):
        for steps in steps_list:
            done = subprocess.run(
                [sys.executable, __file__, "--compile-worker", str(steps),
                 "--inference-rate", str(rate)],
                env=env, capture_output=True, text=True, check=True,
            )
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            rows[steps].append(row)
    base = statistics.median(r["compile_s"] for r in rows[steps_list[0]])
    summary = []
    for steps in steps_list:
        median = statistics.median(r["compile_s"] for r in rows[steps])
        summary.append({
            "summary": "compile", "inference_steps": steps, "compile_s_median": round(median, 3),
            "trace_lower_s_median": round(
                statistics.median(r["trace_lower_s"] for r in rows[steps]), 3),
            f"ratio_to_T{steps_list[0]}": round(median / base, 3),
            "temp_bytes": rows[steps][-1]["temp_bytes"], "rounds": rounds,
        })
    return summary


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("step", "compile"), default=None)
    parser.add_argument("--steps-list", type=_int_list, default=[1, 2, 4, 8, 16, 32, 64],
                        help="the T values of the step-time measurement")
    parser.add_argument("--compile-steps", type=_int_list, default=[8, 64],
                        help="the T values of the compile measurement (ratios to the first)")
    parser.add_argument("--inference-rate", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=60, help="timed rounds of the steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile-rounds", type=int, default=3)
    parser.add_argument("--compile-worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile_worker is not None:
        print(json.dumps(_compile_worker(args.compile_worker, args.inference_rate)))
        return
    if args.only in (None, "step"):
        for row in measure_steps(args.steps_list, args.inference_rate, args.rounds, args.warmup):
            print(json.dumps(row), flush=True)
    if args.only in (None, "compile"):
        for row in measure_compiles(args.compile_steps, args.inference_rate,
                                    args.compile_rounds):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
