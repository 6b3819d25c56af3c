"""Where a small step's time goes: the fused step of two small models beside a bare
`jax.grad` + optax twin, with the guard and the reports switched off in turn.

Models: `mlp`, the PC MLP 64-128-128-10 (tanh) at batch 64 (the digits' size), a
`LearningNetwork` with Adam 1e-3, its twin `jax.grad` of the same MLP's squared error + the
same Adam; `gpt`, pyhgf's benchmark configuration (vocab 64, width 64, 4 heads, 2 blocks,
32 tokens, batch 16, every weight learning, Adam 1e-3), its twin the reference GPT's
`make_backprop_step`. Variants, each one compiled step with its state donated:

* `fused`: the default step (guard on: the commit rule and its finite checks; reports on);
* `fused_no_reports`: `step(..., detailed=False)`: the report norms not computed;
* `fused_no_guard`: `nonfinite="ignore"`: the state committed without the finite checks;
* `fused_bare`: both off;
* `fused_flat_moments`: the default step with the optimiser `optax.flatten(optax.adam(1e-3))`:
  each part's Adam moments stored as one flat vector (the same updates; its guard reads one
  vector per moment instead of one leaf per weight);
* `twin`: the bare `jax.grad` + optax step.

This is a measurement, not a set of modes to use: `fused_no_guard` commits a NaN step.
Every round times each variant in turn (`--calls` calls, medians over `--rounds`); each row
also says the kernels (fusions) of the optimised program and how many are distinct.

    python scripts/small_step_cost.py                       # both models, 30 rounds
    python scripts/small_step_cost.py --models mlp --rounds 5 --calls 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import optax

import fusedpc
from fusedpc.bench._kernels import count_fusions
from fusedpc.bench._mlp_twin import MLP_SIZES as MLP_SIZES  # read by its tests
from fusedpc.bench._mlp_twin import mlp_problem, twin_call
from fusedpc.transformer.reference import make_backprop_step

GPT_FIELDS = {"width": 64, "n_heads": 4, "n_blocks": 2, "ff_width": 256, "max_len": 32}


ADAM = optax.adam(1e-3)
FLAT_ADAM = optax.flatten(ADAM)
"""Adam with its moments stored flat (`fused_flat_moments`)."""


def _kernels(jitted, *args) -> dict[str, int]:
    return count_fusions(jitted.lower(*args).compile().as_text())


def _fused(tree, error_fn, x, y, *, detailed: bool, guard: bool) -> tuple[Callable, dict]:
    program = fusedpc.make_step(tree, error_fn, nonfinite="skip" if guard else "ignore")
    step = jax.jit(lambda c, a, b: program.step(c, a, b, detailed=detailed), donate_argnums=0)
    state = {"carry": program.init(jax.random.key(0))}
    kernels = _kernels(step, state["carry"], x, y)

    def call() -> Any:
        state["carry"], out = step(state["carry"], x, y)
        return out.metrics.loss

    return call, kernels


def mlp_variants() -> dict[str, tuple[Callable, dict]]:
    x, y, network = mlp_problem()

    def tree(optimiser=ADAM):
        return fusedpc.LearningNetwork(network, optimiser)

    out = {name: _fused(tree(), None, x, y, detailed=d, guard=g)
           for name, d, g in (("fused", True, True), ("fused_no_reports", False, True),
                              ("fused_no_guard", True, False), ("fused_bare", False, False))}
    out["fused_flat_moments"] = _fused(tree(FLAT_ADAM), None, x, y, detailed=True, guard=True)
    out["twin"] = twin_call(network, optax.adam(1e-3), x, y)[:2]
    return out


def gpt_variants() -> dict[str, tuple[Callable, dict]]:
    config = fusedpc.GPTConfig(vocab_size=64, **GPT_FIELDS, learn="all")
    ids = jax.random.randint(jax.random.key(2), (16, 33), 0, 64)
    x, y = ids[:, :-1], ids[:, 1:]

    def tree(optimiser=ADAM):
        return fusedpc.build_gpt(config, optimiser, jax.random.key(0))[0]

    out = {name: _fused(tree(), config.error_fn, x, y, detailed=d, guard=g)
           for name, d, g in (("fused", True, True), ("fused_no_reports", False, True),
                              ("fused_no_guard", True, False), ("fused_bare", False, False))}
    out["fused_flat_moments"] = _fused(tree(FLAT_ADAM), config.error_fn, x, y, detailed=True,
                                       guard=True)
    _, model = fusedpc.build_gpt(config, None, jax.random.key(0))
    optimiser = optax.adam(1e-3)
    twin = jax.jit(make_backprop_step(optimiser), donate_argnums=(0, 1))
    state = {"model": model, "opt": optimiser.init(eqx.filter(model, eqx.is_array))}
    kernels = _kernels(twin, state["model"], state["opt"], x, y)

    def call():
        state["model"], state["opt"], value = twin(state["model"], state["opt"], x, y)
        return value

    out["twin"] = (call, kernels)
    return out


def measure(variants: dict[str, tuple[Callable, dict]], rounds: int, calls: int) -> dict:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for call, _ in variants.values():  # compile and warm up
        jax.block_until_ready(call())
    for _ in range(rounds):
        for name, (call, _) in variants.items():
            start = time.perf_counter()
            for _ in range(calls):
                value = call()
            jax.block_until_ready(value)
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args(argv)
    rows = []
    builders = {"mlp": mlp_variants, "gpt": gpt_variants}
    for model in (m.strip() for m in args.models.split(",") if m.strip()):
        variants = builders[model]()
        medians = measure(variants, args.rounds, args.calls)
        for name, (_, kernels) in variants.items():
            row = {"model": model, "variant": name, "step_ms": round(1e3 * medians[name], 4),
                   "vs_twin": round(medians[name] / medians["twin"], 3), **kernels,
                   "rounds": args.rounds, "calls": args.calls}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
