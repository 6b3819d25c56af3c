"""The local weight step shared by every learning part: an optax optimiser, the synaptic-
uncertainty rule, or nothing (weights frozen, beliefs still run).

Learning kinds, their settings and their validation live here so that the network, the
embedding and any future learning part accept exactly the same keywords.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fusedpc.core._gradients import hook_gradients

LEARNING_KINDS = ("precision_weighted", "standard", "synaptic_uncertainty")
SYNAPTIC_DEFAULTS = {
    "window": None,
    "prior_variance": 1.0,
    "prior_mean": 0.0,
    "learning_rate": 1.0,
    "increment_scale": 1.0,
}


class SynapticSettings(NamedTuple):
    """Settings of `synaptic_uncertainty` (see `synaptic_step`)."""

    window: float
    prior_variance: float
    prior_mean: float
    learning_rate: float
    increment_scale: float


def resolve_learning(
    owner: str,
    optimiser: Any,
    learning_kind: str,
    learning_kwargs: dict | None,
    weight_reuse: float,
) -> SynapticSettings | None:
    """Validate the learning keywords at construction; return the synaptic settings if any."""
    if learning_kind not in LEARNING_KINDS:
        raise ValueError(
            f"{owner}: unknown learning_kind {learning_kind!r}; choose one of {LEARNING_KINDS}."
        )
    if optimiser is not None and not isinstance(optimiser, optax.GradientTransformation):
        raise TypeError(
            f"{owner}: optimiser must be an optax.GradientTransformation (e.g. optax.adam(1e-3)) "
            f"or None to freeze the weights, got {type(optimiser).__name__}."
        )
    if not weight_reuse > 0:
        raise ValueError(f"{owner}: weight_reuse must be > 0, got {weight_reuse!r}.")
    if learning_kind != "synaptic_uncertainty":
        if learning_kwargs:
            raise ValueError(
                f"{owner}: learning_kwargs apply only to learning_kind='synaptic_uncertainty', "
                f"got {sorted(learning_kwargs)} with learning_kind={learning_kind!r}."
            )
        return None
    if optimiser is not None:
        raise ValueError(
            f"{owner}: learning_kind='synaptic_uncertainty' is its own update rule and takes no "
            "optimiser; pass optimiser=None and set learning_kwargs['learning_rate'] instead."
        )
    kwargs = dict(learning_kwargs or {})
    unknown = sorted(set(kwargs) - set(SYNAPTIC_DEFAULTS))
    if unknown:
        raise ValueError(
            f"{owner}: unknown learning_kwargs {unknown}; allowed: {sorted(SYNAPTIC_DEFAULTS)}."
        )
    settings = {**SYNAPTIC_DEFAULTS, **kwargs}
    if settings["window"] is None:
        raise ValueError(
            f"{owner}: learning_kind='synaptic_uncertainty' needs learning_kwargs['window'] "
            "(the memory window in steps, >= 1)."
        )
    if not settings["window"] >= 1:
        raise ValueError(
            f"{owner}: learning_kwargs['window'] must be >= 1, got {settings['window']!r}."
        )
    for name in ("prior_variance", "learning_rate", "increment_scale"):
        if not settings[name] > 0:
            raise ValueError(
                f"{owner}: learning_kwargs[{name!r}] must be > 0, got {settings[name]!r}."
            )
    return SynapticSettings(**{k: float(v) for k, v in settings.items()})


def synaptic_step(
    settings: SynapticSettings,
    weight: jax.Array,
    gradient: jax.Array,
    extra_precision: jax.Array,
    increment: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One synaptic-uncertainty step for one parameter array.

    Each weight holds a gaussian belief with precision $\\pi_w = \\max(\\Delta\\pi + 1/\\sigma_p^2,
    10^{-30})$, where $\\Delta\\pi$ (`extra_precision`) is the precision accumulated above the
    prior. With $\\alpha$ = `learning_rate`, $\\sigma_p^2$ = `prior_variance`, $\\mu_p$ =
    `prior_mean`, $N$ = `window`, $c$ = `increment_scale`, $\\bar G$ = `gradient` (the row-mean
    descent gradient) and $H$ = `increment` (batch-mean importance of the child times the
    batch-mean squared activation of the parent):

    $$W \\leftarrow W - \\alpha \\bar G / \\pi_w + (\\mu_p - W)/(\\sigma_p^2 N \\pi_w), \\qquad
    \\Delta\\pi \\leftarrow \\Delta\\pi + c H - \\Delta\\pi / N.$$

    At $\\Delta\\pi = 0$ this is SGD at rate $\\alpha\\sigma_p^2$ plus a reversion $(\\mu_p - W)/N$;
    under a constant $H$ the precision settles at $1/\\sigma_p^2 + N c H$.
    """
    precision = jnp.maximum(extra_precision + 1.0 / settings.prior_variance, 1e-30)
    new_weight = (
        weight
        - settings.learning_rate * gradient / precision
        + (settings.prior_mean - weight) / (settings.prior_variance * settings.window * precision)
    )
    new_extra = (
        extra_precision
        + settings.increment_scale * increment
        - extra_precision / settings.window
    )
    return new_weight, new_extra


def optax_step(optimiser, params, gradients, opt_state):
    """`updates, s' = opt.update(G, s, params)`; `params + updates` (descent gradients).

    Runs under standard dtype promotion: optax mixes Python floats with integer step counts,
    which a caller's strict promotion setting would otherwise reject.
    """
    gradients = hook_gradients(gradients)  # global clipping, when the executor asks for it
    with jax.numpy_dtype_promotion("standard"):
        try:
            updates, opt_state = optimiser.update(gradients, opt_state, params)
        except TypeError as err:
            if "keyword-only argument" not in str(err) or "'value'" not in str(err):
                raise
            raise TypeError(
                "optimiser: this optax optimiser needs the loss value at each update "
                f"({err}); optax.contrib.reduce_on_plateau and optax.lbfgs are such. A "
                "part's local learning step has no loss of its own to pass, so they cannot "
                "run here: use a schedule (fusedpc.training.learning_rate_schedule) instead "
                "of reduce_on_plateau, and a first-order optimiser instead of lbfgs."
            ) from None
    return optax.apply_updates(params, updates), opt_state
