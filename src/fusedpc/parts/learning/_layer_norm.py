"""A LayerNorm whose affine learns locally, and the local step of a norm's affine.

`LearningLayerNorm` normalises each row, $\\hat n = (x - m)/s$, and learns its affine
$y = \\gamma \\odot \\hat n + \\beta$ locally:
$\\bar G_\\gamma = \\mathrm{mean}_r\\, E_r \\odot \\hat n_r$,
$\\bar G_\\beta = \\mathrm{mean}_r\\, E_r$; its input error is the frozen LayerNorm's.
"""

from __future__ import annotations

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from fusedpc.core._checks import expect_last_axis
from fusedpc.core._context import StepContext
from fusedpc.core._part import AbstractPart, Core, LayerNormParams, PyTree, replace_fields
from fusedpc.core._precision import widened
from fusedpc.parts.frozen import layer_norm_forward, layer_norm_input_error
from fusedpc.parts.learning._local_update import resolve_learning


def _row_mean(rows: jax.Array) -> jax.Array:
    """The mean over the rows of `(R, D)` float32 `rows`, as the product $\\frac{1}{R}
    \\mathbf{1}^\\top$ `rows` (float32 products, `Precision.HIGHEST`): a product reads its
    operand as written, while an XLA:CPU reduction fuses its producers and rounds by the
    kernel it lands in, so its last bit changed with the program around it (a step with or
    without its report norms)."""
    weights = jnp.full((rows.shape[0],), 1.0 / rows.shape[0], jnp.float32)
    return jnp.dot(weights, rows, precision=jax.lax.Precision.HIGHEST)


def norm_affine_step(
    optimiser: Any, params: Any, opt_state: Any, error: jax.Array, n_hat: jax.Array,
    ctx: StepContext,
) -> tuple[Any, Any]:
    """The local step of a norm's affine $y = \\gamma \\odot \\hat n + \\beta$ (a LayerNorm's
    or an RMSNorm's): the row means $\\bar G_\\gamma = \\mathrm{mean}_r E_r \\odot \\hat n_r$ and
    $\\bar G_\\beta = \\mathrm{mean}_r E_r$ (in float32; $\\beta$'s only where `params.bias` is
    not None) through `optimiser` (None: no step). `params` is a record with `weight` and
    `bias` fields, rebuilt with `params.__class__`. Returns `(params, opt_state)`."""
    width = params.weight.shape[0]
    rows_e = widened(error).reshape(-1, width)
    rows_n = widened(n_hat).reshape(-1, width)
    gradients = type(params)(
        weight=_row_mean(rows_e * rows_n),
        bias=None if params.bias is None else _row_mean(rows_e),
    )
    if optimiser is None:
        return params, opt_state
    return ctx.optimiser_step(optimiser, params, gradients, opt_state)


class LayerNormState(eqx.Module):
    """`params` ($\\gamma$ `weight`, $\\beta$ `bias`, each `(D,)`) and the optax `opt_state`."""

    params: LayerNormParams
    opt_state: PyTree


class LearningLayerNorm(AbstractPart):
    """A LayerNorm over the last axis whose affine $(\\gamma, \\beta)$ learns locally.

    With `optimiser=None` it behaves as a frozen LayerNorm.
    """

    defers_updates: ClassVar[bool] = True

    weight: jax.Array
    bias: jax.Array
    eps: float = eqx.field(static=True)
    optimiser: Any = eqx.field(static=True)
    opt_state: PyTree

    def __init__(
        self,
        weight: jax.Array,
        bias: jax.Array,
        optimiser: optax.GradientTransformation | None = None,
        *,
        eps: float = 1e-5,
        opt_state: PyTree = None,
    ):
        weight = jnp.asarray(weight, jnp.float32)
        bias = jnp.asarray(bias, jnp.float32)
        if weight.ndim != 1 or bias.shape != weight.shape:
            raise ValueError(
                f"LearningLayerNorm: weight and bias must both have shape (D,), got "
                f"{weight.shape} and {bias.shape}."
            )
        resolve_learning("LearningLayerNorm", optimiser, "precision_weighted", None, 1.0)
        self.weight = weight
        self.bias = bias
        self.eps = float(eps)
        self.optimiser = optimiser
        self.opt_state = opt_state

    def export_arrays(self, path: str = "") -> tuple[LayerNormParams]:
        """`(LayerNormParams(weight, bias),)`, the affine $(\\gamma, \\beta)$."""
        del path
        return (LayerNormParams(self.weight, self.bias),)

    def init_state(self, key: jax.Array) -> LayerNormState:
        del key
        params = LayerNormParams(self.weight, self.bias)
        opt_state = self.opt_state
        if opt_state is None and self.optimiser is not None:
            opt_state = self.optimiser.init(params)
        return LayerNormState(params, opt_state)

    def compile(self, path: str) -> Core:
        width = self.weight.shape[0]
        eps = self.eps

        def forward(state: LayerNormState, x, ctx):
            expect_last_axis(path, x, width)
            return layer_norm_forward(state.params, x, eps, ctx.compute_dtype)

        def backward(state: LayerNormState, cache, error, ctx):
            input_error = layer_norm_input_error(state.params.weight, cache, error,
                                                 ctx.compute_dtype)
            params, opt_state = norm_affine_step(
                self.optimiser, state.params, state.opt_state, error, cache.n_hat, ctx
            )
            metrics = ctx.learning_metrics(state.params, params, error, input_error, (width,))
            return input_error, LayerNormState(params, opt_state), metrics

        def write_back(state: LayerNormState) -> LearningLayerNorm:
            return replace_fields(
                self,
                weight=state.params.weight,
                bias=state.params.bias,
                opt_state=state.opt_state,
            )

        return Core(forward, backward, write_back)


__all__ = ["LayerNormState", "LearningLayerNorm", "norm_affine_step"]
