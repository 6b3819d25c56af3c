"""An RMSNorm whose scale learns locally.

Each row is scaled to unit root mean square, $\\hat n = x / r$ with
$r = \\sqrt{\\mathrm{mean}(x^2) + \\epsilon}$, and $y = \\gamma \\odot \\hat n + \\beta$. From the
error $E$ at its output the part learns $\\gamma$ (and $\\beta$, when it has one) from the row
means

$$\\bar G_\\gamma = \\mathrm{mean}_r\\, E_r \\odot \\hat n_r, \\qquad
\\bar G_\\beta = \\mathrm{mean}_r\\, E_r,$$

exactly the gradient of the loss averaged over rows, and hands back the frozen RMSNorm's input
error (`fusedpc.parts.frozen.rms_norm_input_error`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from fusedpc.core._checks import expect_last_axis
from fusedpc.core._part import AbstractPart, Core, PyTree, replace_fields
from fusedpc.parts.frozen import RMSNormParams, rms_norm_forward, rms_norm_input_error
from fusedpc.parts.learning._layer_norm import norm_affine_step
from fusedpc.parts.learning._local_update import resolve_learning


class RMSNormState(eqx.Module):
    """`params` ($\\gamma$ `weight` `(D,)`, $\\beta$ `bias` `(D,)` or None) and the optax
    `opt_state`."""

    params: RMSNormParams
    opt_state: PyTree


class LearningRMSNorm(AbstractPart):
    """An RMSNorm over the last axis whose scale $\\gamma$ (and shift $\\beta$, if given) learns
    locally through an optax `optimiser`.

    `weight` $\\gamma$ is `(D,)`; `bias` $\\beta$ is `(D,)` or None (no shift, the usual
    RMSNorm: the state then holds no bias and the optimiser sees none). With `optimiser=None`
    it behaves as a frozen RMSNorm. `fusedpc.transplant.from_rms_norm` builds one from an
    `eqx.nn.RMSNorm`.
    """

    defers_updates: ClassVar[bool] = True

    weight: jax.Array
    bias: jax.Array | None
    eps: float = eqx.field(static=True)
    optimiser: Any = eqx.field(static=True)
    opt_state: PyTree

    def __init__(
        self,
        weight: jax.Array,
        bias: jax.Array | None = None,
        optimiser: optax.GradientTransformation | None = None,
        *,
        eps: float = 1e-5,
        opt_state: PyTree = None,
    ):
        weight = jnp.asarray(weight, jnp.float32)
        if weight.ndim != 1:
            raise ValueError(
                f"LearningRMSNorm: weight must have shape (D,), got {weight.shape}."
            )
        if bias is not None:
            bias = jnp.asarray(bias, jnp.float32)
            if bias.shape != weight.shape:
                raise ValueError(
                    f"LearningRMSNorm: bias must have the weight's shape {weight.shape} (or be "
                    f"None), got {bias.shape}."
                )
        resolve_learning("LearningRMSNorm", optimiser, "precision_weighted", None, 1.0)
        self.weight = weight
        self.bias = bias
        self.eps = float(eps)
        self.optimiser = optimiser
        self.opt_state = opt_state

    def export_arrays(self, path: str = "") -> tuple[RMSNormParams]:
        """`(RMSNormParams(weight, bias),)`, the scale $\\gamma$ and the shift $\\beta$ (or
        None)."""
        del path
        return (RMSNormParams(self.weight, self.bias),)

    def init_state(self, key: jax.Array) -> RMSNormState:
        del key
        params = RMSNormParams(self.weight, self.bias)
        opt_state = self.opt_state
        if opt_state is None and self.optimiser is not None:
            opt_state = self.optimiser.init(params)
        return RMSNormState(params, opt_state)

    def compile(self, path: str) -> Core:
        width = self.weight.shape[0]
        eps = self.eps

        def forward(state: RMSNormState, x, ctx):
            expect_last_axis(path, x, width)
            return rms_norm_forward(state.params, x, eps, ctx.compute_dtype)

        def backward(state: RMSNormState, cache, error, ctx):
            input_error = rms_norm_input_error(state.params.weight, cache, error,
                                               ctx.compute_dtype)
            params, opt_state = norm_affine_step(
                self.optimiser, state.params, state.opt_state, error, cache.n_hat, ctx
            )
            metrics = ctx.learning_metrics(state.params, params, error, input_error, (width,))
            return input_error, RMSNormState(params, opt_state), metrics

        def write_back(state: RMSNormState) -> LearningRMSNorm:
            return replace_fields(
                self,
                weight=state.params.weight,
                bias=state.params.bias,
                opt_state=state.opt_state,
            )

        return Core(forward, backward, write_back)
