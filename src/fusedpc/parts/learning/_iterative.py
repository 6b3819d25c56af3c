"""Iterative-inference predictive coding: the hidden activities relax on an energy for T steps,
then the weights take a local step from the relaxed errors.

Notation (see `docs/iterative.md`): layers $0 \\dots L$ of a `PCNetwork`, input $x$ fixed,
feed-forward values $\\hat z_l$ (pre-activations) and $\\hat a_l = g_l(\\hat z_l)$ from the
prediction sweep, rows $r = 1 \\dots R$. The relaxation moves every hidden activity by a
*shift* $\\delta_l$ from its feed-forward value, $z_l = \\hat z_l + \\delta_l$; the output is
clamped to the observation $\\hat y - E$ ($\\delta_L = -E$, with $E$ the descent error handed
in, at the logits of a categorical or binary head). The prediction of layer $l$ moves by

$$\\Delta\\mu_l = \\big(g_{l-1}(\\hat z_{l-1} + \\delta_{l-1}) - \\hat a_{l-1}\\big) W_{l-1}^\\top
\\quad (\\Delta\\mu_1 = 0:\\ \\text{the input is fixed}),$$

and the precision-weighted prediction error, in the descent sign of the rest of the library
(positive: the prediction is above the activity), is

$$e_l = \\pi_l (\\mu_l - z_l) = \\pi_l (\\Delta\\mu_l - \\delta_l), \\qquad l = 1 \\dots L.$$

Carrying the shifts rather than the activities keeps the errors free of the cancellation of
two nearly equal numbers: where nothing has moved, $\\Delta\\mu_l$ is exactly zero. The energy
is $F = \\tfrac{1}{R} \\sum_r \\sum_{l=1}^{L} \\tfrac{1}{2} \\lVert e_l \\rVert^2 / \\pi_l$, the
mean over rows of $\\sum_l \\tfrac{1}{2} \\pi_l \\lVert z_l - \\mu_l \\rVert^2$.

**Relaxation** ($T$ = `inference_steps`, $\\gamma$ = `inference_rate`), each row on its own, each
layer from its own error and the next layer's:

$$\\frac{\\partial F_r}{\\partial \\delta_l}
= -e_l + g_l'(\\hat z_l + \\delta_l) \\odot (e_{l+1} W_l), \\qquad
\\delta_l \\leftarrow \\delta_l - \\gamma\\, \\partial F_r / \\partial \\delta_l$$

(or an optax optimiser over the shifts, `inference_optimiser`). With `fixed_prediction=True`
the predictions and derivatives stay at their feed-forward values ($\\Delta\\mu_l = 0$,
$g_l'(\\hat z_l)$): the errors then obey $e_l \\leftarrow (1 - \\pi_l\\gamma) e_l + \\pi_l\\gamma\\,
g_l'(\\hat z_l) \\odot (e_{l+1} W_l)$ and converge to the backprop deltas for
$0 < \\pi_l\\gamma < 2$. `schedule="z_il"` moves layer $l$ only at step $L - l$ and reads each
weight's gradient at the moment its child error is final: at $\\gamma = 1/\\pi_l$ (the default
precisions and $\\gamma = 1$) one step is then exactly a backprop step.

**Weight step.** $\\bar G_l = \\mathrm{mean}_r\\, e_{l+1} \\otimes a_l$,
$\\bar g_l = \\mathrm{mean}_r\\, e_{l+1}$ at the relaxed values
($a_l = g_l(\\hat z_l + \\delta_l)$; $\\hat a_l$ under fixed prediction or Z-IL), through any
optax optimiser. **Input error** (per row): $g_0'(x) \\odot (e_1 W_0)$, the relaxed
input-layer error.

The $T$ steps are one `lax.scan` inside the backward: the compiled program and its memory do
not grow with $T$. Under a row mask the relaxation runs on the real rows' own errors
(`fusedpc.core.error_scale`), so a padded step is the step on the real rows alone.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fusedpc.core._error_scale import error_scale
from fusedpc.core._metrics import PartMetrics, learning_metrics, reports_detailed
from fusedpc.core._part import AbstractPart, Core, LinearParams, PyTree, replace_fields
from fusedpc.core._precision import matmul, weight_gradient, widened
from fusedpc.parts.learning._learning import (
    LearningNetworkState,
    NetworkCache,
    NetworkParams,
    network_params,
    network_records,
    prediction_sweep,
)
from fusedpc.parts.learning._local_update import optax_step, resolve_learning
from fusedpc.parts.learning._network import PCNetwork

SCHEDULES = ("simultaneous", "z_il")
RELAXATION_SETTINGS = (
    "inference_steps", "inference_rate", "schedule", "fixed_prediction", "inference_optimiser",
    "record_energy",
)
"""The keywords of `IterativeNetwork` that set its relaxation (all but `optimiser`)."""


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


def _check_steps(value: Any) -> int:
    """`inference_steps` as an int (a Python or NumPy integer, not a bool), >= 0."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer) \
            or value < 0:
        raise ValueError(
            f"IterativeNetwork: inference_steps must be an integer >= 0, got {value!r} (0 "
            "relaxes nothing: only the last weight matrix learns)."
        )
    return int(value)


def _check_rate(value: Any) -> float:
    """`inference_rate` as a float (a Python or NumPy real number, not a bool), finite, > 0."""
    rate = float(value) if isinstance(value, numbers.Real) else math.nan
    if isinstance(value, bool | np.bool_) or not (math.isfinite(rate) and rate > 0):
        raise ValueError(
            f"IterativeNetwork: inference_rate must be a finite number > 0, got {value!r}."
        )
    return rate


class IterativeNetwork(AbstractPart):
    """A `PCNetwork` that learns by iterative inference: its hidden activities relax for
    `inference_steps` steps on the energy of its precision-weighted prediction errors, with the
    output clamped by the error handed in, then its weights step from the relaxed errors.

    Args:
        network: the `PCNetwork` (architecture, weights, precisions; the precisions stay fixed).
        optimiser: any optax transformation, fed the row-mean energy gradient of the weights;
            `None` freezes the weights (the relaxation still runs and hands its error on).
        inference_steps: $T \\ge 0$, the relaxation steps (a `lax.scan` inside the step; a
            Python or NumPy integer). $T = 0$ relaxes nothing: the hidden activities stay at
            their predictions, so their errors are 0, only the last weight matrix learns (from
            the clamped output) and the input error is 0.
        inference_rate: $\\gamma > 0$, the step size of the relaxation's gradient descent.
        schedule: `"simultaneous"` (default: every hidden layer moves at every step, the weights
            learn from the errors after the last) or `"z_il"` (layer $l$ moves only at step
            $L - l$, each weight learns from its child error when that is final; needs
            `inference_steps` >= the number of hidden layers; at `inference_rate` $= 1/\\pi$
            one step is a backprop step).
        fixed_prediction: hold the predictions and activation derivatives at their
            feed-forward values during the relaxation (the errors then converge to the
            backprop deltas).
        inference_optimiser: an optax transformation over the shifts instead of plain
            gradient descent at `inference_rate` (a fresh optimiser state every step);
            not with `schedule="z_il"`.
        record_energy: also report the energy before every relaxation step
            (`RelaxationMetrics.energy_trajectory`).
    """

    network: PCNetwork
    optimiser: Any = eqx.field(static=True)
    inference_steps: int = eqx.field(static=True)
    inference_rate: float = eqx.field(static=True)
    schedule: str = eqx.field(static=True)
    fixed_prediction: bool = eqx.field(static=True)
    inference_optimiser: Any = eqx.field(static=True)
    record_energy: bool = eqx.field(static=True)
    opt_state: PyTree

    def __init__(
        self,
        network: PCNetwork,
        optimiser: optax.GradientTransformation | None = None,
        *,
        inference_steps: int = 8,
        inference_rate: float = 0.1,
        schedule: str = "simultaneous",
        fixed_prediction: bool = False,
        inference_optimiser: optax.GradientTransformation | None = None,
        record_energy: bool = False,
        opt_state: PyTree = None,
    ):
        if not isinstance(network, PCNetwork):
            raise TypeError(
                f"IterativeNetwork: network must be a PCNetwork, got {type(network).__name__}."
            )
        resolve_learning("IterativeNetwork", optimiser, "precision_weighted", None, 1.0)
        steps = _check_steps(inference_steps)
        rate = _check_rate(inference_rate)
        if schedule not in SCHEDULES:
            raise ValueError(
                f"IterativeNetwork: unknown schedule {schedule!r}; choose one of {SCHEDULES}."
            )
        if inference_optimiser is not None and not isinstance(
            inference_optimiser, optax.GradientTransformation
        ):
            raise TypeError(
                "IterativeNetwork: inference_optimiser must be an optax.GradientTransformation "
                f"or None, got {type(inference_optimiser).__name__}."
            )
        n_hidden = len(network.sizes) - 2
        if schedule == "z_il":
            if inference_optimiser is not None:
                raise ValueError(
                    "IterativeNetwork: schedule='z_il' takes plain gradient steps at "
                    "inference_rate; pass inference_optimiser=None."
                )
            if steps < n_hidden:
                raise ValueError(
                    f"IterativeNetwork: schedule='z_il' moves one hidden layer per step, so "
                    f"inference_steps must be >= the {n_hidden} hidden layers of sizes "
                    f"{list(network.sizes)}, got {steps}."
                )
        self.network = network
        self.optimiser = optimiser
        self.inference_steps = steps
        self.inference_rate = rate
        self.schedule = schedule
        self.fixed_prediction = bool(fixed_prediction)
        self.inference_optimiser = inference_optimiser
        self.record_energy = bool(record_energy)
        self.opt_state = opt_state

    def export_arrays(self, path: str = "") -> tuple[LinearParams, ...]:
        """One `LinearParams(weights[l], biases[l])` per matrix, input side first."""
        return network_records("IterativeNetwork", self.network, path)

    def init_state(self, key: jax.Array) -> LearningNetworkState:
        net = self.network
        params = network_params(net, key)
        opt_state = self.opt_state
        if opt_state is None and self.optimiser is not None:
            opt_state = self.optimiser.init(params)
        return LearningNetworkState(params, tuple(net.precisions), opt_state, None)

    def compile(self, path: str) -> Core:
        net = self.network
        n_mats = net.n_matrices
        n_hidden = n_mats - 1
        acts = [net.layer_activation(l) for l in range(n_mats)]
        input_is_identity = net.input_activation == "identity"
        steps, rate = self.inference_steps, self.inference_rate
        z_il, fixed = self.schedule == "z_il", self.fixed_prediction
        inference_optimiser = self.inference_optimiser
        record = self.record_energy
        # Z-IL reads W_l's gradient at time L - 1 - l (before step L - l moves layer l); a
        # time >= steps is the state after the last step.
        capture_time = [n_mats - 1 - l for l in range(n_mats)]
        sweep = prediction_sweep(net, path)

        def forward(state: LearningNetworkState, x):
            return sweep(state.params, x)

        def backward(state: LearningNetworkState, cache: NetworkCache, error):
            lead = error.shape[:-1]
            # A row mask scales every error by s (error_scale): the relaxation, which is not
            # linear in the error, runs on the real rows' own; what it learns from and hands
            # on is scaled back, so the masked step is the real rows' step.
            scale = error_scale()
            clamp = -widened(error.reshape(-1, net.sizes[-1]))  # delta_L: the output clamp
            if scale is not None:
                clamp = clamp / scale
            n_rows = clamp.shape[0]
            w, b = state.params.weights, state.params.biases
            pis = state.precisions  # pi_1 .. pi_L
            a_hat = [widened(a) for a in cache.activations]  # a_0 .. a_{L-1}
            z_hat = [widened(z) for z in cache.pre_activations]  # z_1 .. z_{L-1}

            def errors(shifts):
                """e_1 .. e_L for the hidden shifts delta_1 .. delta_{L-1}."""
                out = []
                for l in range(1, n_mats + 1):
                    delta = shifts[l - 1] if l < n_mats else clamp
                    if l == 1 or fixed:
                        moved = -delta
                    else:
                        a = acts[l - 1].value(z_hat[l - 2] + shifts[l - 2])
                        moved = widened(matmul(a - a_hat[l - 1], w[l - 1].T)) - delta
                    out.append(pis[l - 1] * moved)
                return out

            def energy(errs):
                return sum(
                    0.5 * jnp.sum(e * e / pi) for e, pi in zip(errs, pis)
                ) / n_rows

            def shift_gradients(shifts, errs):
                grads = []
                for l in range(1, n_mats):
                    z = z_hat[l - 1] if fixed else z_hat[l - 1] + shifts[l - 1]
                    back = widened(matmul(errs[l], w[l]))
                    grads.append(acts[l].first(z) * back - errs[l - 1])
                return tuple(grads)

            shifts = tuple(jnp.zeros_like(z) for z in z_hat)
            relaxing = bool(steps and n_hidden)  # else nothing moves: no loop at all
            # the weights whose gradient Z-IL reads inside the loop (the others: after it)
            inner = ([l for l in range(n_mats) if capture_time[l] < steps]
                     if z_il and relaxing else [])
            captured = tuple(jnp.zeros_like(clamp if l == n_hidden else z_hat[l])
                             for l in inner)
            trajectory = None
            if relaxing:
                opt_init = (inference_optimiser.init(shifts)
                            if inference_optimiser is not None else None)

                def relax(carry, t):
                    shifts, opt_s, captured = carry
                    errs = errors(shifts)
                    grads = shift_gradients(shifts, errs)
                    if z_il:
                        shifts = tuple(
                            jnp.where(t == n_mats - 1 - l, d - rate * g, d)
                            for l, (d, g) in enumerate(zip(shifts, grads), start=1)
                        )
                        captured = tuple(
                            jnp.where(t == capture_time[l], errs[l], c)
                            for l, c in zip(inner, captured)
                        )
                    elif inference_optimiser is not None:
                        with jax.numpy_dtype_promotion("standard"):
                            updates, opt_s = inference_optimiser.update(grads, opt_s, shifts)
                        shifts = optax.apply_updates(shifts, updates)
                    else:
                        shifts = tuple(d - rate * g for d, g in zip(shifts, grads))
                    return (shifts, opt_s, captured), (energy(errs) if record else None)

                (shifts, _, captured), energies = jax.lax.scan(
                    relax, (shifts, opt_init, captured), jnp.arange(steps)
                )
                final = errors(shifts)
                if record:
                    trajectory = jnp.concatenate([energies, energy(final)[None]])
            else:
                final = errors(shifts)
                if record:
                    trajectory = jnp.full((steps + 1,), energy(final))
            child = list(final)
            for l, c in zip(inner, captured):
                child[l] = c
            if scale is not None:
                child = [c * scale for c in child]

            grads_w: list[Any] = [None] * n_mats
            grads_b: list[Any] = [None] * n_mats
            for l in range(n_mats):
                if l == 0 or fixed or z_il:
                    parent = a_hat[l]
                else:
                    parent = widened(acts[l].value(z_hat[l - 1] + shifts[l - 1]))
                grads_w[l] = weight_gradient(child[l], parent) / n_rows
                if b[l] is not None:
                    grads_b[l] = jnp.sum(child[l], axis=0) / n_rows
            input_error = matmul(final[0] if scale is None else final[0] * scale, w[0])
            if not input_is_identity:
                input_error = acts[0].first(cast(jax.Array, cache.x)) * input_error
            params, opt_state = state.params, state.opt_state
            if self.optimiser is not None:
                gradients = NetworkParams(tuple(grads_w), tuple(grads_b))
                params, opt_state = optax_step(self.optimiser, params, gradients, opt_state)
            new_state = LearningNetworkState(params, state.precisions, opt_state, None)
            input_error = input_error.reshape(*lead, net.sizes[0])
            base = learning_metrics(
                state.params, params, error, input_error, net.sizes, measure_later=True)
            if reports_detailed():
                before = 0.5 * jnp.sum(pis[-1] * clamp * clamp) / n_rows
                after = energy(final) if trajectory is None else trajectory[-1]
                if scale is not None:  # the mean over the real rows
                    before, after = before * scale, after * scale
                    if trajectory is not None:
                        trajectory = trajectory * scale
            else:
                before = after = jnp.full((), jnp.nan, jnp.float32)
                if trajectory is not None:
                    trajectory = jnp.full_like(trajectory, jnp.nan)
            metrics = RelaxationMetrics(
                update_norm=base.update_norm,
                error_norm=base.error_norm,
                weight_norm=base.weight_norm,
                finite=base.finite,
                layer_sizes=base.layer_sizes,
                energy_before=before,
                energy_after=after,
                energy_trajectory=trajectory,
            )
            return input_error, new_state, metrics

        def write_back(state: LearningNetworkState) -> IterativeNetwork:
            network = replace_fields(
                net, weights=state.params.weights, biases=state.params.biases
            )
            return replace_fields(self, network=network, opt_state=state.opt_state)

        return Core(forward, backward, write_back)


__all__ = ["RELAXATION_SETTINGS", "SCHEDULES", "IterativeNetwork", "RelaxationMetrics"]
