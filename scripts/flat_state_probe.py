"""What a flat state layout would save a small step: the digits-sized MLP's training step in
bare JAX, with and without a commit guard like fusedpc's, its optimiser state per leaf (as
optax and fusedpc keep it) or in one flat buffer per kind (parameters, first and second
moments).

A measurement to size a redesign, not fusedpc code: every variant is plain `jax.grad` of the
same MLP's squared error and the same Adam (b1 0.9, b2 0.999, eps 1e-8, rate 1e-3), jitted
with its state donated, timed interleaved (medians of `--rounds` rounds of `--calls` calls):

* `per_leaf`: `optax.adam` over the parameter tree: the twin of scripts/small_step_cost.py;
* `per_leaf_guarded`: the same, then a sum of squares of every new state leaf, one flag
  (every sum finite, and the loss), and the new state kept only where it holds (one select
  per leaf): the shape of fusedpc's commit rule;
* `per_leaf_sums_only`, `per_leaf_selects_only`: the guard's two halves apart (the flag's
  sums, read into the loss, nothing selected; the selects, on the loss's flag alone);
* `flat`: the parameters, and each Adam moment, as one flat vector (`ravel_pytree`); Adam as
  three elementwise kernels over the vectors;
* `flat_guarded`: `flat` with the guard, its per-leaf sums taken as one segment sum over the
  flat squares, and one select per vector;
* `flat_guarded_whole`: the same with one sum of squares per vector (no per-leaf sums: a
  per-leaf flag, to name the part, would be computed only for a refused step);
* `flat_inside_guarded`: the state **stored per leaf** (as fusedpc stores it), concatenated
  into the flat vectors inside the step, `flat_guarded_whole`'s Adam and guard there, and
  split back into leaves: whether the storage layout has to change at all.

Each row also gives the kernels (fusions) of the optimised program.

    python scripts/flat_state_probe.py                   # 30 rounds of 100 calls
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from fusedpc.bench._kernels import count_fusions
from fusedpc.bench._mlp_twin import MLP_SIZES as SIZES
from fusedpc.bench._mlp_twin import mlp_squared_error

B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 1e-3


def _problem():
    keys = jax.random.split(jax.random.key(1), 2 + len(SIZES))
    x = jax.random.normal(keys[0], (64, SIZES[0]))
    y = jax.nn.one_hot(jax.random.randint(keys[1], (64,), 0, SIZES[-1]), SIZES[-1])
    params = [(jax.random.normal(k, (o, i)) / np.sqrt(i), jnp.zeros(o))
              for k, i, o in zip(keys[2:], SIZES[:-1], SIZES[1:], strict=False)]
    return x, y, params


def _commit(ok, new, old):
    return jax.tree_util.tree_map(lambda n, o: jnp.where(ok, n, o), new, old)


def per_leaf(guarded: str | None):
    optimiser = optax.adam(LR, B1, B2, EPS)

    def step(carry, x, y):
        params, opt_state = carry
        value, grads = jax.value_and_grad(mlp_squared_error)(params, x, y)
        with jax.numpy_dtype_promotion("standard"):
            updates, new_opt = optimiser.update(grads, opt_state, params)
        new = (optax.apply_updates(params, updates), new_opt)
        if guarded in ("both", "sums"):
            sums = [jnp.sum(jnp.square(leaf)) for leaf in jax.tree_util.tree_leaves(new)
                    if jnp.issubdtype(leaf.dtype, jnp.floating)]
            ok = jnp.isfinite(jnp.stack(sums)).all() & jnp.isfinite(value)
            if guarded == "sums":  # the flag read, nothing selected
                return new, jnp.where(ok, value, jnp.nan)
            new = _commit(ok, new, carry)
        elif guarded == "selects":  # the selects alone, on the loss's flag
            new = _commit(jnp.isfinite(value), new, carry)
        return new, value

    def init(params):
        return params, optimiser.init(params)

    return step, init


def flat(guarded: str | None, params_tree):
    _, unravel = ravel_pytree(params_tree)
    sizes = [leaf.size for leaf in jax.tree_util.tree_leaves(params_tree)]
    segments = jnp.asarray(np.repeat(np.arange(len(sizes)), sizes))

    def step(carry, x, y):
        theta, mu, nu, count = carry
        value, grads = jax.value_and_grad(lambda t: mlp_squared_error(unravel(t), x, y))(theta)
        count = count + 1
        mu = B1 * mu + (1 - B1) * grads
        nu = B2 * nu + (1 - B2) * grads * grads
        c = count.astype(jnp.float32)
        step_ = mu / (1 - B1 ** c) / (jnp.sqrt(nu / (1 - B2 ** c)) + EPS)
        new = (theta - LR * step_, mu, nu, count)
        if guarded == "segments":
            squares = jnp.stack([jnp.square(a) for a in new[:3]])  # (3, P)
            sums = jax.ops.segment_sum(squares.T, segments, num_segments=len(sizes))
            ok = jnp.isfinite(sums).all() & jnp.isfinite(value)
            new = _commit(ok, new, carry)
        elif guarded == "whole":
            sums = jnp.stack([jnp.sum(jnp.square(a)) for a in new[:3]])
            ok = jnp.isfinite(sums).all() & jnp.isfinite(value)
            new = _commit(ok, new, carry)
        return new, value

    def init(params):
        theta = ravel_pytree(params)[0]
        return theta, jnp.zeros_like(theta), jnp.zeros_like(theta), jnp.zeros((), jnp.int32)

    return step, init


def flat_inside(params_tree):
    """`flat("whole")`'s step over a state stored per leaf: `(params, mu, nu, count)`, the
    moments trees like the parameters, raveled on the way in and unraveled on the way out."""
    flat_step, _ = flat("whole", params_tree)
    _, unravel = ravel_pytree(params_tree)

    def step(carry, x, y):
        params, mu, nu, count = carry
        raveled = tuple(ravel_pytree(tree)[0] for tree in (params, mu, nu))
        (theta, mu_f, nu_f, count), value = flat_step((*raveled, count), x, y)
        return (unravel(theta), unravel(mu_f), unravel(nu_f), count), value

    def init(params):
        def zeros():  # two trees of their own buffers: the step donates both
            return jax.tree_util.tree_map(jnp.zeros_like, params)

        return params, zeros(), zeros(), jnp.zeros((), jnp.int32)

    return step, init


def variants() -> dict[str, tuple[Callable[[], Any], int]]:
    x, y, params = _problem()
    out = {}
    made = {"per_leaf": per_leaf(None), "per_leaf_guarded": per_leaf("both"),
            "per_leaf_sums_only": per_leaf("sums"), "per_leaf_selects_only": per_leaf("selects"),
            "flat": flat(None, params), "flat_guarded": flat("segments", params),
            "flat_guarded_whole": flat("whole", params),
            "flat_inside_guarded": flat_inside(params)}
    for name, (step, init) in made.items():
        jitted = jax.jit(step, donate_argnums=0)
        state = {"carry": init(jax.tree_util.tree_map(jnp.copy, params))}
        kernels = count_fusions(jitted.lower(state["carry"], x, y).compile().as_text())

        def call(jitted=jitted, state=state):
            state["carry"], value = jitted(state["carry"], x, y)
            return value

        out[name] = (call, kernels)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        parser.error(f"--rounds and --calls: expected integers >= 1, got {args.rounds} and "
                     f"{args.calls}")
    made = variants()
    losses = {name: float(call()) for name, (call, _) in made.items()}
    times: dict[str, list[float]] = {name: [] for name in made}
    for _ in range(args.rounds):
        for name, (call, _) in made.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                value = call()
            jax.block_until_ready(value)
            times[name].append((time.perf_counter() - start) / args.calls * 1e3)
    base = statistics.median(times["per_leaf"])
    for name, (_, kernels) in made.items():
        ms = statistics.median(times[name])
        print(json.dumps({"variant": name, "step_ms": round(ms, 4),
                          "over_per_leaf": round(ms / base, 3), "first_loss": losses[name],
                          **kernels}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
