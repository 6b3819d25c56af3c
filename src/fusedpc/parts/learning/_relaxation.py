"""The relaxation of an `IterativeNetwork`'s step: the prediction errors and the energy as
functions of the hidden shifts (`EnergyTerms`), the $T$ steps of one `lax.scan`, the weight
gradients at the relaxed values and the report (`RelaxationMetrics`). The notation and the
maths are those of `fusedpc.parts.learning._iterative`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from fusedpc.core._context import StepContext
from fusedpc.core._metrics import PartMetrics
from fusedpc.core._precision import widened
from fusedpc.parts._activations import Activation
from fusedpc.parts.learning._learning import LearningNetworkState, NetworkCache, NetworkParams


class RelaxationMetrics(PartMetrics):
    """What an `IterativeNetwork` reports about one step: the learning part's norms
    (`PartMetrics`) and the energy $F$ (mean over rows) before the relaxation
    (`energy_before`, the feed-forward state with the output clamped) and after it
    (`energy_after`), and with `record_energy=True` its trajectory `energy_trajectory`
    `(T + 1,)` (before each step, then after the last). NaN on steps traced without report
    norms (`run`'s report cadence)."""

    energy_before: jax.Array | None = None
    energy_after: jax.Array | None = None
    energy_trajectory: jax.Array | None = None

    def rows(self, path: str) -> list[dict[str, Any]]:
        """The learning row (`PartMetrics.rows`) with `energy_before`, `energy_after` and,
        when recorded, `energy_trajectory` (a list of T + 1 floats)."""
        (row,) = super().rows(path)
        row["energy_before"] = float(cast(jax.Array, self.energy_before))
        row["energy_after"] = float(cast(jax.Array, self.energy_after))
        if self.energy_trajectory is not None:
            row["energy_trajectory"] = [float(v) for v in jnp.asarray(self.energy_trajectory)]
        return [row]


class Relaxed(NamedTuple):
    """What the relaxation of one step gives: the hidden `shifts` $\\delta_1 \\dots
    \\delta_{L-1}$ after it, the `final` errors $e_1 \\dots e_L$ at those shifts, the `child`
    errors each weight learns from (the final ones; under Z-IL those read when they were
    final) and the energy `trajectory` `(T + 1,)` (None without `record_energy`)."""

    shifts: tuple[jax.Array, ...]
    final: list[jax.Array]
    child: list[jax.Array]
    trajectory: jax.Array | None


@dataclasses.dataclass(frozen=True)
class EnergyTerms:
    """The prediction errors, the energy and its gradient as functions of the hidden shifts,
    for one step (module docstring): the `rule`'s configuration, the step context `ctx`, the
    output clamp $\\delta_L$ `(R, out)`, the `weights` $W_l$, the `precisions` $\\pi_1 \\dots
    \\pi_L$ and the feed-forward values $\\hat a_0 \\dots \\hat a_{L-1}$ (`a_hat`) and $\\hat z_1
    \\dots \\hat z_{L-1}$ (`z_hat`), in float32."""

    rule: Relaxation
    ctx: StepContext
    clamp: jax.Array
    weights: tuple[jax.Array, ...]
    precisions: tuple[jax.Array, ...]
    a_hat: list[jax.Array]
    z_hat: list[jax.Array]

    @property
    def n_rows(self) -> int:
        """$R$, the rows of the step."""
        return self.clamp.shape[0]

    def errors(self, shifts: tuple[jax.Array, ...]) -> list[jax.Array]:
        """$e_l = \\pi_l (\\Delta\\mu_l - \\delta_l)$, $l = 1 \\dots L$, for the hidden shifts
        $\\delta_1 \\dots \\delta_{L-1}$ ($\\delta_L$ the clamp; $\\Delta\\mu_l = 0$ for $l = 1$
        and under fixed prediction)."""
        acts, w, ctx = self.rule.acts, self.weights, self.ctx
        n_mats = len(acts)
        out = []
        for l in range(1, n_mats + 1):
            delta = shifts[l - 1] if l < n_mats else self.clamp
            if l == 1 or self.rule.fixed:
                moved = -delta
            else:
                a = acts[l - 1].value(self.z_hat[l - 2] + shifts[l - 2])
                moved = widened(ctx.matmul(a - self.a_hat[l - 1], w[l - 1].T)) - delta
            out.append(self.precisions[l - 1] * moved)
        return out

    def energy(self, errs: list[jax.Array]) -> jax.Array:
        """$F = \\tfrac{1}{R} \\sum_l \\tfrac{1}{2} \\lVert e_l \\rVert^2 / \\pi_l$."""
        total = sum(0.5 * jnp.sum(e * e / pi) for e, pi in zip(errs, self.precisions))
        return cast(jax.Array, total / self.n_rows)  # L >= 1 terms: an array

    def shift_gradients(self, shifts: tuple[jax.Array, ...],
                        errs: list[jax.Array]) -> tuple[jax.Array, ...]:
        """$\\partial F_r / \\partial \\delta_l = g_l'(\\hat z_l + \\delta_l) \\odot (e_{l+1} W_l)
        - e_l$ for every hidden layer ($g_l'(\\hat z_l)$ under fixed prediction)."""
        acts, w, ctx = self.rule.acts, self.weights, self.ctx
        grads = []
        for l in range(1, len(acts)):
            z = self.z_hat[l - 1] if self.rule.fixed else self.z_hat[l - 1] + shifts[l - 1]
            back = widened(ctx.matmul(errs[l], w[l]))
            grads.append(acts[l].first(z) * back - errs[l - 1])
        return tuple(grads)


@dataclasses.dataclass(frozen=True)
class Relaxation:
    """The static configuration of an `IterativeNetwork`'s step (no arrays: the state brings
    them) and its backward: the network's `sizes`, `acts` $g_0 \\dots g_{L-1}$, the relaxation
    settings (`steps` $T$, `rate` $\\gamma$, `z_il`, `fixed` prediction, the
    `inference_optimiser`, `record` the energy) and the weights' optax `optimiser`."""

    sizes: tuple[int, ...]
    acts: tuple[Activation, ...]
    input_is_identity: bool
    steps: int
    rate: float
    z_il: bool
    fixed: bool
    inference_optimiser: Any
    record: bool
    optimiser: Any

    def capture_time(self, l: int) -> int:
        """When Z-IL reads $W_l$'s gradient: at step $L - 1 - l$, before step $L - l$ moves
        layer $l$ (a time >= `steps` is the state after the last step)."""
        return len(self.acts) - 1 - l

    def backward(self, state: LearningNetworkState, cache: NetworkCache, error: jax.Array,
                 ctx: StepContext) -> tuple[jax.Array, LearningNetworkState, RelaxationMetrics]:
        """The learning step (`Core.backward`): the relaxation with the output clamped by
        the error $E$ `(..., out)`, the weight step from its errors, the input error
        $g_0'(x) \\odot (e_1 W_0)$ `(..., in)` and the `RelaxationMetrics`."""
        lead = error.shape[:-1]
        # A row mask scales every error by s (error_scale): the relaxation, which is not
        # linear in the error, runs on the real rows' own; what it learns from and hands
        # on is scaled back, so the masked step is the real rows' step.
        scale = ctx.error_scale
        clamp = -widened(error.reshape(-1, self.sizes[-1]))  # delta_L: the output clamp
        if scale is not None:
            clamp = clamp / scale
        terms = EnergyTerms(
            self, ctx, clamp, state.params.weights, state.precisions,
            [widened(a) for a in cache.activations],  # a_0 .. a_{L-1}
            [widened(z) for z in cache.pre_activations],  # z_1 .. z_{L-1}
        )
        relaxed = self.relax(terms)
        child = relaxed.child
        if scale is not None:
            child = [c * scale for c in child]
        gradients = self.weight_gradients(terms, relaxed.shifts, child, state.params.biases)
        first = relaxed.final[0]
        input_error = ctx.matmul(first if scale is None else first * scale, terms.weights[0])
        if not self.input_is_identity:
            input_error = self.acts[0].first(cast(jax.Array, cache.x)) * input_error
        params, opt_state = state.params, state.opt_state
        if self.optimiser is not None:
            params, opt_state = ctx.optimiser_step(self.optimiser, params, gradients,
                                                   opt_state)
        new_state = LearningNetworkState(params, state.precisions, opt_state, None)
        input_error = input_error.reshape(*lead, self.sizes[0])
        base = ctx.learning_metrics(state.params, params, error, input_error, self.sizes)
        return input_error, new_state, relaxation_metrics(base, terms, relaxed, scale)

    def relax(self, terms: EnergyTerms) -> Relaxed:
        """The $T$ relaxation steps from zero shifts (none where $T = 0$ or nothing is
        hidden), the final errors, the child errors and the energy trajectory."""
        n_mats = len(self.acts)
        n_hidden = n_mats - 1
        shifts = tuple(jnp.zeros_like(z) for z in terms.z_hat)
        relaxing = bool(self.steps and n_hidden)  # else nothing moves: no loop at all
        # the weights whose gradient Z-IL reads inside the loop (the others: after it)
        inner = ([l for l in range(n_mats) if self.capture_time(l) < self.steps]
                 if self.z_il and relaxing else [])
        captured = tuple(jnp.zeros_like(terms.clamp if l == n_hidden else terms.z_hat[l])
                         for l in inner)
        trajectory = None
        if relaxing:
            shifts, captured, energies = self.scan(terms, shifts, inner, captured)
            final = terms.errors(shifts)
            if self.record:
                trajectory = jnp.concatenate([cast(jax.Array, energies), terms.energy(final)[None]])
        else:
            final = terms.errors(shifts)
            if self.record:
                trajectory = jnp.full((self.steps + 1,), terms.energy(final))
        child = list(final)
        for l, c in zip(inner, captured):
            child[l] = c
        return Relaxed(shifts, final, child, trajectory)

    def scan(self, terms: EnergyTerms, shifts: tuple[jax.Array, ...], inner: list[int],
             captured: tuple[jax.Array, ...]
             ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], jax.Array | None]:
        """The relaxation loop, one `lax.scan` over $t = 0 \\dots T - 1$: every shift
        steps $\\delta_l \\leftarrow \\delta_l - \\gamma\\, \\partial F_r / \\partial \\delta_l$ (or
        through the inference optimiser); under Z-IL only layer $l$, at $t = L - 1 - l$, and
        the errors of the `inner` weights are `captured` at their capture times. Returns the
        shifts, the captured errors and the energy before each step (None unrecorded)."""
        n_mats, rate = len(self.acts), self.rate
        optimiser = self.inference_optimiser
        opt_init = optimiser.init(shifts) if optimiser is not None else None

        def relax(carry, t):
            shifts, opt_s, captured = carry
            errs = terms.errors(shifts)
            grads = terms.shift_gradients(shifts, errs)
            if self.z_il:
                shifts = tuple(
                    jnp.where(t == n_mats - 1 - l, d - rate * g, d)
                    for l, (d, g) in enumerate(zip(shifts, grads), start=1)
                )
                captured = tuple(
                    jnp.where(t == self.capture_time(l), errs[l], c)
                    for l, c in zip(inner, captured)
                )
            elif optimiser is not None:
                with jax.numpy_dtype_promotion("standard"):
                    updates, opt_s = optimiser.update(grads, opt_s, shifts)
                shifts = optax.apply_updates(shifts, updates)
            else:
                shifts = tuple(d - rate * g for d, g in zip(shifts, grads))
            return (shifts, opt_s, captured), (terms.energy(errs) if self.record else None)

        (shifts, _, captured), energies = jax.lax.scan(
            relax, (shifts, opt_init, captured), jnp.arange(self.steps)
        )
        return shifts, captured, energies

    def weight_gradients(self, terms: EnergyTerms, shifts: tuple[jax.Array, ...],
                         child: list[jax.Array],
                         biases: tuple[jax.Array | None, ...]) -> NetworkParams:
        """$\\bar G_l = \\tfrac{1}{R}\\, e_{l+1}^\\top a_l$ and $\\bar g_l = \\tfrac{1}{R}
        \\sum_r e_{l+1}$ from the `child` errors, with $a_l = g_l(\\hat z_l + \\delta_l)$
        ($\\hat a_l$ for the input, under fixed prediction and under Z-IL)."""
        n_mats, n_rows = len(self.acts), terms.n_rows
        grads_w: list[Any] = [None] * n_mats
        grads_b: list[Any] = [None] * n_mats
        for l in range(n_mats):
            if l == 0 or self.fixed or self.z_il:
                parent = terms.a_hat[l]
            else:
                parent = widened(self.acts[l].value(terms.z_hat[l - 1] + shifts[l - 1]))
            grads_w[l] = terms.ctx.weight_gradient(child[l], parent) / n_rows
            if biases[l] is not None:
                grads_b[l] = jnp.sum(child[l], axis=0) / n_rows
        return NetworkParams(tuple(grads_w), tuple(grads_b))


def relaxation_metrics(base: PartMetrics, terms: EnergyTerms, relaxed: Relaxed,
                        scale: jax.Array | None) -> RelaxationMetrics:
    """The learning report `base` with the energies: before the relaxation $\\tfrac{1}{R}
    \\sum_r \\tfrac{1}{2} \\pi_L \\lVert \\delta_L \\rVert^2$, after it and its trajectory, each
    times the row mask's `scale` (the mean over the real rows); NaN on a step without
    report norms."""
    trajectory = relaxed.trajectory
    if terms.ctx.detailed:
        clamp = terms.clamp
        before = 0.5 * jnp.sum(terms.precisions[-1] * clamp * clamp) / terms.n_rows
        after = terms.energy(relaxed.final) if trajectory is None else trajectory[-1]
        if scale is not None:  # the mean over the real rows
            before, after = before * scale, after * scale
            if trajectory is not None:
                trajectory = trajectory * scale
    else:
        before = after = jnp.full((), jnp.nan, jnp.float32)
        if trajectory is not None:
            trajectory = jnp.full_like(trajectory, jnp.nan)
    return RelaxationMetrics(
        update_norm=base.update_norm,
        error_norm=base.error_norm,
        weight_norm=base.weight_norm,
        finite=base.finite,
        layer_sizes=base.layer_sizes,
        energy_before=before,
        energy_after=after,
        energy_trajectory=trajectory,
    )


__all__ = ["EnergyTerms", "Relaxation", "RelaxationMetrics", "Relaxed", "relaxation_metrics"]
