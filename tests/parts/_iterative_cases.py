"""Conformance cases of the iterative-inference part (`IterativeNetwork`).

`CASES` maps a name to a factory returning `(part, example_input)`, like
`helpers.CONFORMANCE_CASES`. The conformance suite checks the error each part hands on
against `jax.vjp` of its forward, so the cases are the part's exact regimes: the Z-IL schedule
(one step is a backprop step), and a network without a hidden layer (nothing to relax). A
categorical head is left out as for `LearningNetwork`: its error is at the logits, not at the
probabilities the forward returns.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax
from helpers import normal

import fusedpc
from fusedpc import IterativeNetwork, PCNetwork

Case = Callable[[], tuple[fusedpc.AbstractPart, jax.Array]]


def _network(sizes, activation="tanh", head="gaussian", seed=80) -> PCNetwork:
    return PCNetwork(sizes, activation, head, key=jax.random.key(seed))


CASES: dict[str, Case] = {
    "iterative_z_il": lambda: (
        IterativeNetwork(_network([4, 6, 5, 3]), optax.adam(1e-2), schedule="z_il",
                         inference_rate=1.0, inference_steps=2, record_energy=True),
        normal(140, (2, 3, 4)),
    ),
    "iterative_z_il_fixed_prediction": lambda: (
        IterativeNetwork(_network([4, 6, 5], "gelu", seed=81),
                         optax.sgd(0.1), schedule="z_il", inference_rate=1.0,
                         inference_steps=3, fixed_prediction=True),
        normal(141, (5, 4)),
    ),
    "iterative_single_matrix": lambda: (
        IterativeNetwork(_network([4, 3], seed=82), optax.sgd(0.1), inference_steps=3),
        normal(142, (5, 4)),
    ),
}
