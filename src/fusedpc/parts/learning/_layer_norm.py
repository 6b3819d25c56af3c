"""A LayerNorm whose affine learns locally, and the local step of a norm's affine.

`LearningLayerNorm` normalises each row, $\\hat n = (x - m)/s$, and learns its affine
$y = \\gamma \\odot \\hat n + \\beta$ locally:
$\\bar G_\\gamma = \\mathrm{mean}_r\\, E_r \\odot \\hat n_r$,
$\\bar G_\\beta = \\mathrm{mean}_r\\, E_r$; its input error is the frozen LayerNorm's.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
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


def set_affine_norm(part: Any, owner: str, weight: jax.Array, bias: jax.Array | None,
                    eps: float, optimiser: Any, opt_state: Any) -> None:
    """A norm-with-affine part's fields, set in its `__init__` (the optimiser checked)."""
    resolve_learning(owner, optimiser, "precision_weighted", None, 1.0)
    part.weight, part.bias, part.eps = weight, bias, float(eps)
    part.optimiser, part.opt_state = optimiser, opt_state


def affine_norm_state(part: Any, params_type: type, state_type: type) -> Any:
    """The state of a norm whose affine learns (`LearningLayerNorm`, `LearningRMSNorm`): its
    affine as `params_type(weight, bias)` and its optimiser's state (drawn when not given)."""
    params = params_type(part.weight, part.bias)
    opt_state = part.opt_state
    if opt_state is None and part.optimiser is not None:
        opt_state = part.optimiser.init(params)
    return state_type(params, opt_state)


def affine_norm_core(part: Any, path: str, normalise: Callable[..., Any],
                     input_error_of: Callable[..., Any], state_type: type) -> Core:
    """The core of a norm whose affine learns: `normalise(params, x, eps, dtype)` forward,
    `input_error_of(weight, cache, error, dtype)` for the input error (the frozen norm's),
    and the affine's local step (`norm_affine_step`)."""
    width, eps = part.weight.shape[0], part.eps

    def forward(state, x, ctx: StepContext):
        expect_last_axis(path, x, width)
        return normalise(state.params, x, eps, ctx.compute_dtype)

    def backward(state, cache, error, ctx: StepContext):
        input_error = input_error_of(state.params.weight, cache, error, ctx.compute_dtype)
        params, opt_state = norm_affine_step(
            part.optimiser, state.params, state.opt_state, error, cache.n_hat, ctx
        )
        metrics = ctx.learning_metrics(state.params, params, error, input_error, (width,))
        return input_error, state_type(params, opt_state), metrics

    def write_back(state):
        return replace_fields(part, weight=state.params.weight, bias=state.params.bias,
                              opt_state=state.opt_state)

    return Core(forward, backward, write_back)


class AffineNorm(AbstractPart):
    """Base of the norms whose affine learns (`LearningLayerNorm`, `LearningRMSNorm`): the
    export, the state and the core, from the subclass's record and state types and its
    frozen formulas (`_normalise(params, x, eps, dtype)`, `_input_error_of(weight, cache,
    error, dtype)`)."""

    defers_updates: ClassVar[bool] = True
    params_type: ClassVar[type]
    state_type: ClassVar[type]
    _normalise: ClassVar[Callable[..., Any]]
    _input_error_of: ClassVar[Callable[..., Any]]

    weight: jax.Array
    bias: jax.Array | None  # None: no shift (an RMSNorm's may have none)
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
        weight, bias = self.checked(weight, bias)
        set_affine_norm(self, type(self).__name__, weight, bias, eps, optimiser, opt_state)

    @staticmethod
    @abc.abstractmethod
    def checked(weight: jax.Array, bias: Any) -> tuple[jax.Array, jax.Array | None]:
        """`(weight, bias)` as float32 arrays, checked (an error naming the part)."""

    def export_arrays(self, path: str = "") -> tuple[Any, ...]:
        """`(params_type(weight, bias),)`: the affine $(\\gamma, \\beta)$."""
        del path
        return (self.params_type(self.weight, self.bias),)

    def init_state(self, key: jax.Array) -> Any:
        del key
        return affine_norm_state(self, self.params_type, self.state_type)

    def compile(self, path: str) -> Core:
        formulas = type(self)
        return affine_norm_core(self, path, formulas._normalise, formulas._input_error_of,
                                self.state_type)


class LayerNormState(eqx.Module):
    """`params` ($\\gamma$ `weight`, $\\beta$ `bias`, each `(D,)`) and the optax `opt_state`."""

    params: LayerNormParams
    opt_state: PyTree


class LearningLayerNorm(AffineNorm):
    """A LayerNorm over the last axis whose affine $(\\gamma, \\beta)$ learns locally.

    With `optimiser=None` it behaves as a frozen LayerNorm.
    """

    params_type: ClassVar[type] = LayerNormParams
    state_type: ClassVar[type] = LayerNormState
    _normalise = staticmethod(layer_norm_forward)
    _input_error_of = staticmethod(layer_norm_input_error)

    @staticmethod
    def checked(weight: jax.Array, bias: Any) -> tuple[jax.Array, jax.Array]:
        weight = jnp.asarray(weight, jnp.float32)
        bias = None if bias is None else jnp.asarray(bias, jnp.float32)
        if weight.ndim != 1 or bias is None or bias.shape != weight.shape:
            raise ValueError(
                f"LearningLayerNorm: weight and bias must both have shape (D,), got "
                f"{weight.shape} and {None if bias is None else bias.shape}."
            )
        return weight, bias


__all__ = ["AffineNorm", "LayerNormState", "LearningLayerNorm", "affine_norm_core",
           "affine_norm_state", "norm_affine_step", "set_affine_norm"]
