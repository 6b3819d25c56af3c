"""The optimisers a run (`fusedpc train`) or a benchmark (`fusedpc bench`) may name: one table
for both, so that the same name always means the same optax transformation."""

from __future__ import annotations

import math

import optax

__all__ = [
    "DEFAULT_WEIGHT_DECAY",
    "LR_SCHEDULES",
    "OPTIMISERS",
    "learning_rate_schedule",
    "make_optimiser",
]

LR_SCHEDULES = ("constant", "cosine")
"""The learning-rate schedules `learning_rate_schedule` accepts (after the warm-up)."""

OPTIMISERS = ("adam", "adamw", "sgd")
"""The optimiser names `make_optimiser` accepts."""

DEFAULT_WEIGHT_DECAY = 1e-4
"""`optax.adamw`'s own default, and `TrainConfig.weight_decay`'s."""


def learning_rate_schedule(
    peak: float,
    warmup_steps: int = 0,
    schedule: str = "constant",
    decay_steps: int = 0,
    final_fraction: float = 0.1,
) -> float | optax.Schedule:
    """The rate per optimiser step: a linear warm-up from 0 to `peak` over `warmup_steps`,
    then `"constant"` (`peak`) or `"cosine"` decay to `final_fraction * peak` at step
    `decay_steps` (counted from the start, warm-up included), constant after it.

    $\\eta_t = \\eta\\, t / w$ for $t < w$; cosine: $\\eta_t = \\eta\\,(f + (1 - f)\\,
    \\tfrac12 (1 + \\cos(\\pi (t - w) / (D - w))))$ for $w \\le t \\le D$.

    Returns `peak` itself (a float) for a constant rate without warm-up, so that such a run
    builds the very optimiser it always did. `t` is the optimiser's own count: the steps it
    was applied, which are the committed steps of a run (a step the guard refused does not
    advance it)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {schedule!r}.")
    if schedule == "constant" and warmup_steps == 0:
        return peak
    if schedule == "constant":
        return optax.join_schedules(
            [optax.linear_schedule(0.0, peak, warmup_steps), optax.constant_schedule(peak)],
            [warmup_steps],
        )
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"lr_decay_steps ({decay_steps}) must exceed warmup_steps ({warmup_steps}) for the "
            "cosine schedule."
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        end_value=peak * final_fraction,
    )


def make_optimiser(
    name: str,
    learning_rate: float | optax.Schedule,
    weight_decay: float = DEFAULT_WEIGHT_DECAY,
) -> optax.GradientTransformation:
    """The optax optimiser called `name` at rate `learning_rate`.

    * `"adam"`: `optax.adam(learning_rate)`;
    * `"adamw"`: `optax.adamw(learning_rate, weight_decay=weight_decay)`, Adam with the
      decoupled decay $\\theta \\leftarrow \\theta - \\eta \\lambda \\theta$ added to each
      update ($\\eta$ = `learning_rate`, $\\lambda$ = `weight_decay`);
    * `"sgd"`: `optax.sgd(learning_rate)`, $\\theta \\leftarrow \\theta - \\eta g$.

    Args:
        name: one of `OPTIMISERS`.
        learning_rate: $\\eta > 0$, or an optax schedule (`learning_rate_schedule`).
        weight_decay: $\\lambda \\ge 0$; used by `"adamw"` only.

    Returns:
        The `optax.GradientTransformation`.

    Raises:
        ValueError: for an unknown `name`, a non-positive `learning_rate` or a negative
            `weight_decay`.
    """
    if name not in OPTIMISERS:
        raise ValueError(f"optimiser must be one of {OPTIMISERS}, got {name!r}.")
    if not callable(learning_rate) and not (
        learning_rate > 0 and math.isfinite(learning_rate)
    ):
        raise ValueError(f"learning_rate must be a positive number, got {learning_rate!r}.")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}.")
    if name == "adam":
        return optax.adam(learning_rate)
    if name == "adamw":
        return optax.adamw(learning_rate, weight_decay=weight_decay)
    return optax.sgd(learning_rate)
