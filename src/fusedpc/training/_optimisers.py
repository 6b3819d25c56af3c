"""The optimisers a run (`fusedpc train`) or a benchmark (`fusedpc bench`) may name: one table
for both, so that the same name always means the same optax transformation."""

from __future__ import annotations

import math

import optax

__all__ = ["DEFAULT_WEIGHT_DECAY", "OPTIMISERS", "make_optimiser"]

OPTIMISERS = ("adam", "adamw", "sgd")
"""The optimiser names `make_optimiser` accepts."""

DEFAULT_WEIGHT_DECAY = 1e-4
"""`optax.adamw`'s own default, and `TrainConfig.weight_decay`'s."""


def make_optimiser(
    name: str, learning_rate: float, weight_decay: float = DEFAULT_WEIGHT_DECAY
) -> optax.GradientTransformation:
    """The optax optimiser called `name` at rate `learning_rate`.

    * `"adam"`: `optax.adam(learning_rate)`;
    * `"adamw"`: `optax.adamw(learning_rate, weight_decay=weight_decay)`, Adam with the
      decoupled decay $\\theta \\leftarrow \\theta - \\eta \\lambda \\theta$ added to each
      update ($\\eta$ = `learning_rate`, $\\lambda$ = `weight_decay`);
    * `"sgd"`: `optax.sgd(learning_rate)`, $\\theta \\leftarrow \\theta - \\eta g$.

    Args:
        name: one of `OPTIMISERS`.
        learning_rate: $\\eta > 0$.
        weight_decay: $\\lambda \\ge 0$; used by `"adamw"` only.

    Returns:
        The `optax.GradientTransformation`.

    Raises:
        ValueError: for an unknown `name`, a non-positive `learning_rate` or a negative
            `weight_decay`.
    """
    if name not in OPTIMISERS:
        raise ValueError(f"optimiser must be one of {OPTIMISERS}, got {name!r}.")
    if not (learning_rate > 0 and math.isfinite(learning_rate)):
        raise ValueError(f"learning_rate must be a positive number, got {learning_rate!r}.")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}.")
    if name == "adam":
        return optax.adam(learning_rate)
    if name == "adamw":
        return optax.adamw(learning_rate, weight_decay=weight_decay)
    return optax.sgd(learning_rate)
