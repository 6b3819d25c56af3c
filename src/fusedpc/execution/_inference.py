"""Inference without learning: relax a tree's latents to a target and read them out
(`StepProgram.infer`; `docs/pc-depth.md`, "Generative latents").

The relaxation is the step's own (`fusedpc.Relaxation`: its sweeps, rate or optimiser,
tolerance), run from the feed-forward latents with the weights held: nothing learns, the
state is not changed. What comes back is each latent's relaxed value and the tree's output
*at* the relaxed latents (the prediction of the top segment from the top latent), so a latent
placed first in the tree, whose prediction is the input $x$ (its prior mean, at the latent's
precision), is an unclamped input: given part of an output (a target with NaN where nothing
is observed, error function `"observed_squared"`), the relaxation infers the input, and the
output at the relaxed latents fills in the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from fusedpc.core._context import StepContext
from fusedpc.core._part import PyTree
from fusedpc.execution._tree_relaxation import TreeRelaxation, with_slots
from fusedpc.parts._latent import LatentSlot


class Inference(eqx.Module):
    """What `StepProgram.infer` returns.

    Attributes:
        output: the tree's output at the relaxed latents `(rows..., features)`, float32.
        latents: every latent's relaxed value $z_b$, in tree order (a latent in a `Repeat`
            stacked over its blocks, `(blocks, rows..., features)`).
        energy_before: the energy $F$ at the feed-forward latents (the loss).
        energy_after: $F$ at the relaxed latents.
        steps: the sweeps run.
        energy_trajectory: $F$ before every sweep, then after the last `(T + 1,)` (with
            `Relaxation(record_energy=True)`, else None).
    """

    output: Any
    latents: list[jax.Array]
    energy_before: jax.Array
    energy_after: jax.Array
    steps: jax.Array
    energy_trajectory: jax.Array | None = None


def infer(relaxing: TreeRelaxation, state: PyTree, x: Any, target: Any,
          ctx: StepContext) -> Inference:
    """The relaxation of `relaxing` at `state` towards `target`, nothing learning (an
    incremental relaxation relaxes here without its weight steps)."""
    plain = dataclasses.replace(relaxing, settings=dataclasses.replace(
        relaxing.settings, incremental=False, backprop_distance=False))
    relaxed = plain.relax(state, x, target, ctx)
    slots = [LatentSlot(a, d) for a, d in zip(relaxed.anchors, relaxed.shifts)]
    sweep_ctx = ctx.for_inner_trace().replace(learning=False, detailed=False)
    top, pulls, loss = plain._walk(with_slots(state, slots), x, target, sweep_ctx)
    after = sum((jnp.sum(p.energy) for p in pulls), jnp.zeros((), jnp.float32)) + loss
    trajectory = None
    if relaxed.trajectory is not None:
        trajectory = jnp.concatenate([relaxed.trajectory, after[None]])
    latents = [a + d for a, d in zip(relaxed.anchors, relaxed.shifts)]
    return Inference(top, latents, relaxed.energy_before, after, relaxed.steps, trajectory)


__all__ = ["Inference", "infer"]
