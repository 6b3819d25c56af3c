"""A latent at a part boundary: the activity there becomes a variable that the whole tree's
relaxation moves on one energy (`docs/tree-pc.md`).

Put `Latent()` anywhere in a chain (`Sequential([..., fusedpc.Latent(), ...])`, a `Repeat`'s
block, a `Residual`'s branch, a GPT slot). The part before it predicts the latent,
$\\mu_b = f_b(z_{b-1})$; the latent $z_b$ feeds the parts after it. A step of a tree with
latents (`fusedpc.make_step(tree, ..., relaxation=...)`) minimises

$$F = \\sum_b \\tfrac12 \\Pi_b \\lVert z_b - \\mu_b \\rVert^2 + \\mathrm{loss}(\\mu_{top}, t)$$

(rows averaged) in the latents for T sweeps, each one forward walk and one backward walk of
the tree that does not learn, and then lets every part learn from the error at its output at
the relaxed latents. The part itself holds no parameters: in a walk without relaxation
(`predict`, a tree whose step relaxes nothing) it is the identity, so the forward readout of a
tree with latents is its feed-forward value.

How it works inside the step (the executor's side is `fusedpc.execution._tree_relaxation`):
the relaxation puts a `LatentSlot` (the latent as its feed-forward value `anchor` plus a
`shift`) at the latent's place in the state tree, so every composite, scanned `Repeat`s
included, hands each latent to its own part exactly as it hands weights. The latent's
forward then emits $z_b$ = anchor + shift and caches the prediction $\\mu_b$ it was given;
its backward receives $g_b = \\partial F / \\partial z_b$ from the parts above (their
pullback of their own errors), and

* in a sweep (`ctx.learning` False) returns its energy gradient
  $\\Pi_b (z_b - \\mu_b) + g_b$ in its new state (a `LatentPull`), and hands the part below
  the error $\\Pi_b (\\mu_b - z_b) = \\partial F / \\partial \\mu_b$;
* in the learning walk hands the part below that same error (times the row weights of a
  mask) and reports its energy (`LatentMetrics`).

Carrying the shift rather than $z_b$ keeps a latent whose prediction has not moved free of
rounding: $z_b - \\mu_b$ is then the shift itself, exactly.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from fusedpc.core._checks import positive_number
from fusedpc.core._context import StepContext
from fusedpc.core._metrics import AbstractMetrics, FiniteFlag
from fusedpc.core._part import AbstractPart, Core, ExportRecord, PyTree
from fusedpc.core._precision import widened


class LatentState(eqx.Module):
    """A `Latent`'s own state: nothing (the latent lives only inside a step)."""


class LatentSlot(eqx.Module):
    """What the relaxation puts at a latent's place in the state tree for one walk: the
    feed-forward value `anchor` $\\hat\\mu_b$ and the `shift` $\\delta_b$ (the latent is
    $z_b = \\hat\\mu_b + \\delta_b$, float32, the latent's own shape), and for the learning
    walk the row `weight` of a mask (`(rows..., 1)`, None without one) and the energy
    `trajectory` to report (None unless recorded). `pulled` (static): a learning walk that
    also hands back the latent's `LatentPull` (incremental relaxation)."""

    anchor: jax.Array
    shift: jax.Array
    weight: jax.Array | None = None
    trajectory: jax.Array | None = None
    pulled: bool = eqx.field(static=True, default=False)


class LatentPull(eqx.Module):
    """What a sweep's backward hands back at a latent's place: `anchor` (the feed-forward
    value), `gradient` $\\partial F / \\partial z_b$ per row (float32) and `energy`, the row
    mean of $\\tfrac12 \\Pi_b \\lVert z_b - \\mu_b \\rVert^2$ at the sweep's latents."""

    anchor: jax.Array
    gradient: jax.Array
    energy: jax.Array


class LatentCache(eqx.Module):
    """What a `Latent`'s backward reads: the prediction $\\mu_b$ it was given."""

    prediction: jax.Array


class LatentMetrics(AbstractMetrics):
    """What a `Latent` reports about a step: its `energy`, the row mean of
    $\\tfrac12 \\Pi_b \\lVert z_b - \\mu_b \\rVert^2$ after the relaxation (0 in a walk
    without one: the latent is then its prediction), whether that is `finite`, and with
    `Relaxation(record_energy=True)` its `energy_trajectory` `(T + 1,)`: before each sweep,
    then after the last (per block in a `Repeat`)."""

    energy: jax.Array
    finite: jax.Array
    energy_trajectory: jax.Array | None = None


def _row_energy(eps: jax.Array, precision: float) -> jax.Array:
    """$\\tfrac12 \\Pi \\lVert \\varepsilon \\rVert^2$ summed over features, averaged over rows."""
    rows = max(1, math.prod(eps.shape[:-1]))
    return 0.5 * precision * jnp.sum(jnp.square(eps)) / rows


class Latent(AbstractPart):
    """A latent activity at this point of the tree, relaxed with every other latent on the
    tree's one energy (module docstring; `docs/tree-pc.md`).

    Args:
        precision: $\\Pi_b > 0$, the weight of this latent's prediction error in the energy
            (1.0 by default; the loss at the output has weight 1).

    The identity wherever the step does not relax (`predict`, `as_module`): the tree's
    forward readout is its feed-forward value.
    """

    defers_updates: ClassVar[bool] = True

    precision: float = eqx.field(static=True)

    def __init__(self, precision: float = 1.0):
        self.precision = positive_number(precision, "Latent: precision")

    def init_state(self, key: jax.Array) -> LatentState:
        del key
        return LatentState()

    def export_arrays(self, path: str = "") -> tuple[ExportRecord, ...]:
        """No parameters: no records."""
        del path
        return ()

    def compile(self, path: str) -> Core:
        del path
        precision = self.precision

        def forward(state: PyTree, x, ctx: StepContext):
            if isinstance(state, LatentSlot):
                return ctx.to_compute(state.anchor + state.shift), LatentCache(x)
            return x, LatentCache(x)

        def backward(state: PyTree, cache: LatentCache, error, ctx: StepContext):
            prediction = widened(cache.prediction)
            if not isinstance(state, LatentSlot):
                if ctx.learning:  # no relaxation: the identity, as in the forward
                    zero = jnp.zeros((), jnp.float32)
                    return error, LatentState(), LatentMetrics(zero, jnp.isfinite(zero))
                # a sweep's first walk: the latent is its prediction, its error 0
                pull = LatentPull(prediction, widened(error), jnp.zeros((), jnp.float32))
                return jnp.zeros_like(cache.prediction), pull, _flag(pull.gradient)
            eps = (state.anchor - prediction) + state.shift  # z - mu, the shift where mu held
            energy = _row_energy(eps, precision)
            down = -precision * eps
            if not ctx.learning or state.pulled:
                pull = LatentPull(state.anchor, precision * eps + widened(error), energy)
                if not ctx.learning:
                    return ctx.to_compute(down), pull, _flag(pull.gradient)
                return ctx.to_compute(down), pull, LatentMetrics(energy, jnp.isfinite(energy))
            if state.weight is not None:
                down = down * state.weight
            trajectory = state.trajectory
            if trajectory is not None:  # the sweeps' energies, then this walk's
                trajectory = jnp.concatenate([trajectory, energy[None]])
            metrics = LatentMetrics(energy, jnp.isfinite(energy), trajectory)
            return ctx.to_compute(down), LatentState(), metrics

        def write_back(state: PyTree) -> Latent:
            del state
            return self

        return Core(forward, backward, write_back)


def _flag(x: jax.Array) -> FiniteFlag:
    return FiniteFlag(jnp.all(jnp.isfinite(x)))


def is_latent_state(x: Any) -> bool:
    """Whether `x` is a latent's place in a state tree (its own state or a slot)."""
    return isinstance(x, LatentState | LatentSlot)


def is_latent_pull(x: Any) -> bool:
    """Whether `x` is what a sweep's backward hands back at a latent's place."""
    return isinstance(x, LatentPull)


__all__ = [
    "Latent",
    "LatentCache",
    "LatentMetrics",
    "LatentPull",
    "LatentSlot",
    "LatentState",
    "is_latent_pull",
    "is_latent_state",
]
