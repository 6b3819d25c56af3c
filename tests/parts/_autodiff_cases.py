"""Conformance cases for the autodiff-backed frozen parts (`frozen.from_module`,
`frozen.from_function`), in the form of `helpers.CONFORMANCE_CASES`: name -> factory
returning `(part, example_input)`."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from helpers import Case, normal

from fusedpc.frozen import from_function, from_module


def sine_of_linear(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """$y = a \\odot \\sin(x W^\\top)$ on a whole batch `(..., in) -> (..., out)`."""
    return params["a"] * jnp.sin(x @ params["w"].T)


def _mlp() -> eqx.nn.MLP:
    return eqx.nn.MLP(4, 3, 5, depth=2, activation=jax.nn.tanh, key=jax.random.key(60))


CASES: dict[str, Case] = {
    "from_module_linear": lambda: (
        from_module(eqx.nn.Linear(4, 3, key=jax.random.key(61))),
        normal(130, (2, 3, 4)),
    ),
    "from_module_mlp": lambda: (from_module(_mlp()), normal(131, (6, 4))),
    "from_function": lambda: (
        from_function(
            sine_of_linear, {"a": 1.0 + 0.3 * normal(62, (3,)), "w": normal(63, (3, 4))}
        ),
        normal(132, (6, 4)),
    ),
}
