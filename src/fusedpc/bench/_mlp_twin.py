"""The digits-sized MLP the small-step scripts measure, and its bare twin: `jax.grad` of the
same squared error and an optax step, jitted with its state donated.

Used by `scripts/small_step_cost.py`, `scripts/flat_state_probe.py` and
`scripts/packed_state_probe.py` (scripts do not import each other).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import fusedpc
from fusedpc.bench._kernels import count_fusions

MLP_SIZES = [64, 128, 128, 10]
"""Input, two tanh hidden layers, output: the digits' size."""


def mlp_problem() -> tuple[jax.Array, jax.Array, fusedpc.PCNetwork]:
    """A batch of 64 rows `x` `(64, 64)`, one-hot targets `y` `(64, 10)` and the tanh
    `PCNetwork` of `MLP_SIZES`, all drawn from key 1."""
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (64, MLP_SIZES[0]))
    y = jax.nn.one_hot(jax.random.randint(keys[1], (64,), 0, MLP_SIZES[-1]), MLP_SIZES[-1])
    return x, y, fusedpc.PCNetwork(MLP_SIZES, "tanh", key=keys[2])


def mlp_squared_error(params: list[tuple[Any, Any]], x: jax.Array, y: jax.Array) -> jax.Array:
    """$\\frac12$ the row mean of $\\lVert h - y \\rVert^2$ for the MLP of `params` (one
    `(w, b)` per layer, `w` `(out, in)`; tanh between layers, none at the output)."""
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w.T + b
        if i < len(params) - 1:
            h = jnp.tanh(h)
    return 0.5 * jnp.mean(jnp.sum((h - y) ** 2, -1))


def twin_call(network: fusedpc.PCNetwork, optimiser: optax.GradientTransformation,
              x: jax.Array, y: jax.Array
              ) -> tuple[Callable[[], jax.Array], dict[str, int], Callable[[], Any]]:
    """The bare twin of `network` trained on `(x, y)`: `(call, kernels, params)`: one step
    (returns its loss), the kernels of its optimised program (`count_fusions`), and the
    current `(w, b)` list."""
    if network.weights is None or network.biases is None:
        raise ValueError("twin_call: network: expected a PCNetwork holding its weights and "
                         "biases (built with a key), got one without.")
    params = [(jnp.asarray(w), jnp.asarray(b)) for w, b in zip(network.weights, network.biases)]

    def step(carry, _x, _y):
        ps, opt_state = carry
        value, grads = jax.value_and_grad(mlp_squared_error)(ps, _x, _y)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes floats and int counts
            updates, opt_state = optimiser.update(grads, opt_state, ps)
        return (optax.apply_updates(ps, updates), opt_state), value

    jitted = jax.jit(step, donate_argnums=0)
    box = {"carry": (params, optimiser.init(params))}
    kernels = count_fusions(str(jitted.lower(box["carry"], x, y).compile().as_text()))

    def call() -> jax.Array:
        box["carry"], value = jitted(box["carry"], x, y)
        return value

    return call, kernels, lambda: box["carry"][0]
