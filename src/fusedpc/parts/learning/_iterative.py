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
(the step context's `error_scale`), so a padded step is the step on the real rows alone.
"""

from __future__ import annotations

from typing import Any, ClassVar

import equinox as eqx
import jax
import numpy as np
import optax

from fusedpc.core._checks import positive_number
from fusedpc.core._part import AbstractPart, Core, LinearParams, PyTree, replace_fields
from fusedpc.parts.learning._learning import (
    LearningNetworkState,
    network_params,
    prediction_sweep,
)
from fusedpc.parts.learning._local_update import resolve_learning
from fusedpc.parts.learning._network import PCNetwork, network_records
from fusedpc.parts.learning._relaxation import Relaxation
from fusedpc.parts.learning._relaxation import RelaxationMetrics as RelaxationMetrics

SCHEDULES = ("simultaneous", "z_il")
RELAXATION_SETTINGS = (
    "inference_steps", "inference_rate", "schedule", "fixed_prediction", "inference_optimiser",
    "record_energy",
)
"""The keywords of `IterativeNetwork` that set its relaxation (all but `optimiser`)."""


def _check_steps(value: Any) -> int:
    """`inference_steps` as an int (a Python or NumPy integer, not a bool), >= 0."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer) \
            or value < 0:
        raise ValueError(
            f"IterativeNetwork: inference_steps must be an integer >= 0, got {value!r} (0 "
            "relaxes nothing: only the last weight matrix learns)."
        )
    return int(value)


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

    defers_updates: ClassVar[bool] = True

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
        rate = positive_number(inference_rate, "IterativeNetwork: inference_rate")
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
        sweep = prediction_sweep(net, path)
        rule = Relaxation(
            sizes=tuple(net.sizes),
            acts=tuple(net.layer_activation(l) for l in range(net.n_matrices)),
            input_is_identity=net.input_activation == "identity",
            steps=self.inference_steps,
            rate=self.inference_rate,
            z_il=self.schedule == "z_il",
            fixed=self.fixed_prediction,
            inference_optimiser=self.inference_optimiser,
            record=self.record_energy,
            optimiser=self.optimiser,
        )

        def forward(state: LearningNetworkState, x, ctx):
            return sweep(state.params, x, ctx)

        def write_back(state: LearningNetworkState) -> IterativeNetwork:
            network = replace_fields(
                net, weights=state.params.weights, biases=state.params.biases
            )
            return replace_fields(self, network=network, opt_state=state.opt_state)

        return Core(forward, rule.backward, write_back)


__all__ = ["RELAXATION_SETTINGS", "SCHEDULES", "IterativeNetwork", "RelaxationMetrics"]
