"""The local weight step shared by every learning part: an optax optimiser, the synaptic-
uncertainty rule, or nothing (weights frozen, beliefs still run).

Learning kinds, their settings and their validation live here so that the network, the
embedding and any future learning part accept exactly the same keywords.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fusedpc.parts.learning._rules import RULES, SynapticUncertainty

LEARNING_KINDS = tuple(RULES)
# the synaptic settings and their defaults, as the rule declares them (None: required)
SYNAPTIC_DEFAULTS = {
    f.name: None if f.default is dataclasses.MISSING else f.default
    for f in dataclasses.fields(SynapticUncertainty)
}


class RateMultiplierState(NamedTuple):
    """The state of `scale_by_rate_multiplier`: `multiplier`, a float32 scalar (stacked to
    `(N,)` under a `Repeat` of N blocks)."""

    multiplier: jax.Array


class RateMultiplier(optax.GradientTransformation):
    """What `scale_by_rate_multiplier` returns: an optax transformation, marked so that the
    `synaptic_uncertainty` kind (which takes no optimiser) accepts it to scale its own
    updates."""

    __slots__ = ()


def scale_by_rate_multiplier(initial: float = 1.0) -> RateMultiplier:
    """Multiply every update by the multiplier in the state ($u \\leftarrow m u$), which
    starts at `initial` and changes only when it is set from outside the step
    (`fusedpc.training.set_rate_multipliers`). Chained after an optimiser it is the
    optimiser at rate $m\\eta$; given alone to a `synaptic_uncertainty` part it runs that
    rule at rate $m\\alpha$ (its gradient term scaled; its reversion to the prior and its
    precisions not)."""
    if not (initial > 0 and math.isfinite(initial)):
        raise ValueError(f"initial: expected a positive number, got {initial!r}.")

    def init(params):
        del params
        return RateMultiplierState(jnp.asarray(initial, jnp.float32))

    def update(updates, state, params=None):
        del params
        m = state.multiplier
        scaled = jax.tree_util.tree_map(lambda u: u * m.astype(u.dtype), updates)
        return scaled, state

    return RateMultiplier(init, update)


def scaled_synaptic_gradient(optimiser: Any, gradient: Any, opt_state: Any) -> tuple[Any, Any]:
    """The gradient the synaptic rule steps on, with a rate multiplier applied ($m\\bar G$),
    or `gradient` itself without one (`optimiser` None). The rule then runs at rate
    $m\\alpha$: only its gradient term is scaled, not its reversion to the prior or its
    precisions, so a multiplier moves where the weights settle (see `synaptic_step`). At
    $m = 1$ the gradient is unchanged bit for bit."""
    if optimiser is None:
        return gradient, opt_state
    return optimiser.update(gradient, opt_state)


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
    if optimiser is not None and not isinstance(optimiser, RateMultiplier):
        raise ValueError(
            f"{owner}: learning_kind='synaptic_uncertainty' is its own update rule and takes no "
            "optimiser; pass optimiser=None and set learning_kwargs['learning_rate'] instead "
            "(or fusedpc.training.scale_by_rate_multiplier(), which scales its steps)."
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
