"""Ready-made frozen parts, each a forward formula with its hand-derived backward.

Every backward here is checked against `jax.vjp` of its forward by the test suite (and can be
checked by users with `fusedpc.check_backward`). Shapes: inputs are `(..., features)`; every
leading axis is a row.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from fusedpc.core._checks import lookup_rows
from fusedpc.core._context import StepContext
from fusedpc.core._part import ExportRecord, LayerNormParams, LinearParams, TableParams
from fusedpc.core._precision import to_compute, widened
from fusedpc.parts._activations import get_activation
from fusedpc.parts._frozen import Frozen
from fusedpc.parts._gated import GatedFeedForward

__all__ = [
    "activation",
    "embedding",
    "gelu",
    "layer_norm",
    "linear",
    "relu",
    "rms_norm",
    "scale",
    "softmax",
    "swiglu",
    "tanh",
]


def _linear_forward(params: LinearParams, x, ctx: StepContext):
    y = ctx.matmul(x, params.weight.T)
    if params.bias is not None:
        y = y + ctx.to_compute(params.bias)
    return y, None


def _linear_backward(params: LinearParams, cache, error, ctx: StepContext):
    del cache
    return ctx.matmul(error, params.weight)


def linear(
    linear_or_weight: eqx.nn.Linear | jax.Array, bias: jax.Array | None = None
) -> Frozen:
    """A frozen affine map $y = x W^\\top + b$ (the layout of `eqx.nn.Linear`).

    Backward: $\\partial L/\\partial x = E W$ (the bias passes nothing back).
    Accepts an `eqx.nn.Linear` or a weight of shape `(out, in)` with an optional bias `(out,)`.
    Its parameters are a `LinearParams(weight, bias)`, which is also what it exports.
    """
    if isinstance(linear_or_weight, eqx.nn.Linear):
        weight = linear_or_weight.weight
        bias = linear_or_weight.bias
    else:
        weight = jnp.asarray(linear_or_weight)
    if weight.ndim != 2:
        raise ValueError(f"linear: weight must have shape (out, in), got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}"
        )
    return Frozen(
        _linear_forward,
        _linear_backward,
        LinearParams(weight, bias),
        in_width=weight.shape[1],
        name="linear",
    )


@functools.cache
def _activation_formulas(name: str):
    # One function pair per name, so that equal parts have equal (static) structure.
    act = get_activation(name, "frozen.activation")

    def forward(params, x):
        del params
        return act.value(x), x

    def backward(params, x, error):
        del params
        return error * act.first(x)

    forward.__name__ = name
    return forward, backward


def activation(name: str) -> Frozen:
    """A frozen elementwise activation by name (identity, relu, tanh, sigmoid, gelu, elu, silu).

    Backward: $\\partial L/\\partial x = E \\odot g'(x)$ with the closed-form $g'$.
    """
    forward, backward = _activation_formulas(name)
    return Frozen(forward, backward, None, name=name)


def gelu() -> Frozen:
    """GELU in the tanh form that `jax.nn.gelu` uses by default; see `_activations` for $g'$."""
    return activation("gelu")


def relu() -> Frozen:
    """$y = \\max(x, 0)$; backward $E \\odot [x > 0]$."""
    return activation("relu")


def _scale_formulas(multiplier: float):
    def scale_forward(params, x, ctx: StepContext):
        del params
        return ctx.to_compute(x * multiplier), None

    def scale_backward(params, cache, error, ctx: StepContext):
        del params, cache
        return ctx.to_compute(error * multiplier)

    return scale_forward, scale_backward


def scale(multiplier: float) -> Frozen:
    """$y = a x$ for a fixed number $a$ (`multiplier`); backward $E a$.

    The multipliers of a parameterisation (μPC's $1/\\sqrt{D}$, $1/\\sqrt{N L}$, $1/N$, see
    `fusedpc.residual_pc_network`) are this part after a learning layer: the layer then
    learns exactly as `jax.grad` of $a f(x)$ would have it. The multiplier is static
    configuration (no state, nothing to export), so blocks with equal multipliers stack in a
    `Repeat`.
    """
    value = float(multiplier) if isinstance(multiplier, int | float) else math.nan
    if isinstance(multiplier, bool) or not math.isfinite(value) or value == 0:
        raise ValueError(f"frozen.scale: multiplier must be a finite, non-zero number, got "
                         f"{multiplier!r}.")
    forward, backward = _scale_formulas(value)
    return Frozen(forward, backward, None, name="scale")


def _tanh_forward(params, x):
    del params
    y = jnp.tanh(x)
    return y, y


def _tanh_backward(params, y, error):
    del params
    return error * (1.0 - y * y)


def tanh() -> Frozen:
    """$y = \\tanh x$; backward $E \\odot (1 - y^2)$ (reads the cached output)."""
    return Frozen(_tanh_forward, _tanh_backward, None, name="tanh")


def _softmax_forward(params, x):
    del params
    y = jax.nn.softmax(x, axis=-1)
    return y, y


def _softmax_backward(params, y, error):
    del params
    return y * (error - jnp.sum(error * y, axis=-1, keepdims=True))


def softmax() -> Frozen:
    """Softmax over the last axis; backward $y \\odot (E - \\langle E, y \\rangle)$ per row."""
    return Frozen(_softmax_forward, _softmax_backward, None, name="softmax")


class LayerNormCache(eqx.Module):
    """What a LayerNorm's backward reads: `n_hat` $\\hat n$ `(..., D)` and `inv_std` $1/s$
    `(..., 1)`."""

    n_hat: jax.Array
    inv_std: jax.Array


def layer_norm_forward(params: LayerNormParams, x, eps: float, dtype: Any = None):
    """Per row: $m$ = mean, $s = \\sqrt{\\mathrm{var} + \\epsilon}$ (biased variance),
    $\\hat n = (x - m)/s$, $y = \\gamma \\hat n + \\beta$ (`params.weight` $\\gamma$ and
    `params.bias` $\\beta$, each `(D,)` or None; `eps` $\\epsilon$ a Python float).
    Returns `(y, LayerNormCache(n_hat, 1/s))`. The statistics are taken in float32 whatever
    the compute dtype; `y` and $\\hat n$ are held in it."""
    x = widened(x)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    inv_std = jax.lax.rsqrt(var + eps)
    n_hat = centred * inv_std
    y = n_hat
    if params.weight is not None:
        y = y * params.weight
    if params.bias is not None:
        y = y + params.bias
    return to_compute(y, dtype), LayerNormCache(to_compute(n_hat, dtype), inv_std)


def layer_norm_input_error(weight, cache: LayerNormCache, error, dtype: Any = None):
    """$e_s = E \\odot \\gamma$; $\\partial L/\\partial x = (e_s - \\overline{e_s}
    - \\hat n\\, \\overline{e_s \\odot \\hat n}) / s$ (bars: means over the features)."""
    n_hat, inv_std = widened(cache.n_hat), cache.inv_std
    error = widened(error)
    scaled = error if weight is None else error * weight
    mean_e = jnp.mean(scaled, axis=-1, keepdims=True)
    mean_en = jnp.mean(scaled * n_hat, axis=-1, keepdims=True)
    return to_compute((scaled - mean_e - n_hat * mean_en) * inv_std, dtype)


@functools.cache
def _layer_norm_formulas(eps: float):
    # One function pair per eps, so that equal LayerNorms have equal (static) structure and
    # stack in a `Repeat`; eps is static configuration, not a state leaf.
    def forward(params: LayerNormParams, x, ctx: StepContext):
        return layer_norm_forward(params, x, eps, ctx.compute_dtype)

    def backward(params: LayerNormParams, cache, error, ctx: StepContext):
        return layer_norm_input_error(params.weight, cache, error, ctx.compute_dtype)

    forward.__name__ = "layer_norm"
    return forward, backward


def layer_norm(
    layer_norm_module: eqx.nn.LayerNorm | None = None,
    *,
    width: int | None = None,
    eps: float = 1e-5,
) -> Frozen:
    """A LayerNorm over the last axis whose affine $(\\gamma, \\beta)$ stays fixed.

    From an `eqx.nn.LayerNorm` (its `weight`, `bias`, `eps`), or `layer_norm(width=D)` for
    $\\gamma = 1, \\beta = 0$ (no affine arrays). Its parameters are a
    `LayerNormParams(weight, bias)`; `eps` is static (part of the formula, not of the state).
    For a LayerNorm whose affine learns, use `fusedpc.transplant.from_layer_norm`.
    """
    if layer_norm_module is not None:
        shape = layer_norm_module.shape
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if len(shape) != 1:
            raise ValueError(f"layer_norm: only a LayerNorm over the last axis, got shape {shape}")
        width = shape[0]
        params = LayerNormParams(layer_norm_module.weight, layer_norm_module.bias)
        eps = layer_norm_module.eps
    elif width is not None:
        params = LayerNormParams(None, None)
    else:
        raise TypeError("layer_norm: pass an eqx.nn.LayerNorm or width=...")
    forward, backward = _layer_norm_formulas(float(eps))
    return Frozen(forward, backward, params, in_width=width, name="layer_norm")


def _embedding_forward(params: TableParams, ids, ctx: StepContext):
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"expected integer ids, got dtype {ids.dtype}")
    return ctx.to_compute(lookup_rows(params.table, ids)), None


def _embedding_backward(params, cache, error):
    del params, cache, error
    return None


def embedding(embedding_or_table: eqx.nn.Embedding | jax.Array) -> Frozen:
    """A frozen lookup table: integer ids `(...)` in, rows `(..., D)` of the `(V, D)` table out.

    Ids carry no error, so the backward returns `None`. Its parameters are a
    `TableParams(table)`. For a table that learns, use `fusedpc.transplant.from_embedding`.
    """
    if isinstance(embedding_or_table, eqx.nn.Embedding):
        table = embedding_or_table.weight
    else:
        table = jnp.asarray(embedding_or_table)
    if table.ndim != 2:
        raise ValueError(f"embedding: table must have shape (vocab, width), got {table.shape}")
    return Frozen(
        _embedding_forward, _embedding_backward, TableParams(table), name="embedding"
    )


class RMSNormParams(ExportRecord):
    """An RMSNorm's scale $y = \\gamma \\odot \\hat n + \\beta$: `weight` $\\gamma$ and
    `bias` $\\beta$, each `(D,)` (None for no such term; `eqx.nn.RMSNorm(use_weight=...,
    use_bias=...)`). The parameters of the frozen and the learning RMSNorm (`eps` is static
    configuration of the part) and its export record."""

    weight: jax.Array | None
    bias: jax.Array | None


class RMSNormCache(eqx.Module):
    """What an RMSNorm's backward reads: `n_hat` $\\hat n$ `(..., D)` and `inv_rms` $1/r$
    `(..., 1)`."""

    n_hat: jax.Array
    inv_rms: jax.Array


def rms_norm_forward(params: RMSNormParams, x, eps: float, dtype: Any = None):
    """Per row: $r = \\sqrt{\\mathrm{mean}(x^2) + \\epsilon}$, $\\hat n = x / r$,
    $y = \\gamma \\hat n + \\beta$ (`params.weight` $\\gamma$ and `params.bias` $\\beta$, each
    `(D,)` or None; `eps` $\\epsilon$ a Python float). Returns `(y, RMSNormCache(n_hat, 1/r))`.
    As for the LayerNorm, the statistics are taken in float32 whatever the compute dtype and
    `y`, $\\hat n$ are held in it."""
    x = widened(x)
    inv_rms = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    n_hat = x * inv_rms
    y = n_hat
    if params.weight is not None:
        y = y * params.weight
    if params.bias is not None:
        y = y + params.bias
    return to_compute(y, dtype), RMSNormCache(to_compute(n_hat, dtype), inv_rms)


def rms_norm_input_error(weight, cache: RMSNormCache, error, dtype: Any = None):
    """$e_s = E \\odot \\gamma$; $\\partial L/\\partial x = (e_s - \\hat n\\,
    \\overline{e_s \\odot \\hat n}) / r$ (the bar: the mean over the features). From
    $\\partial r / \\partial x_j = x_j / (D r)$: the LayerNorm's formula without its centring
    term."""
    n_hat = widened(cache.n_hat)
    error = widened(error)
    scaled = error if weight is None else error * weight
    mean_en = jnp.mean(scaled * n_hat, axis=-1, keepdims=True)
    return to_compute((scaled - n_hat * mean_en) * cache.inv_rms, dtype)


@functools.cache
def _rms_norm_formulas(eps: float):
    # One function pair per eps, as for the LayerNorm: equal RMSNorms stack in a `Repeat`.
    def forward(params: RMSNormParams, x, ctx: StepContext):
        return rms_norm_forward(params, x, eps, ctx.compute_dtype)

    def backward(params: RMSNormParams, cache, error, ctx: StepContext):
        return rms_norm_input_error(params.weight, cache, error, ctx.compute_dtype)

    forward.__name__ = "rms_norm"
    return forward, backward


def _norm_width(module, where: str) -> int:
    shape = module.shape
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if len(shape) != 1:
        raise ValueError(f"{where}: only a norm over the last axis, got shape {shape}.")
    return int(shape[0])


def rms_norm(
    rms_norm_module: eqx.nn.RMSNorm | None = None,
    *,
    width: int | None = None,
    eps: float = 1e-5,
) -> Frozen:
    """An RMSNorm over the last axis whose scale $\\gamma$ (and shift $\\beta$, if any) stays
    fixed: $y = \\gamma \\odot x / \\sqrt{\\mathrm{mean}(x^2) + \\epsilon} + \\beta$.

    From an `eqx.nn.RMSNorm` (its `weight`, `bias` and `eps`; `use_weight=False` or
    `use_bias=False` leave that term out), or `rms_norm(width=D)` for $\\gamma = 1$ and no
    $\\beta$. Backward (`rms_norm_input_error`): $\\partial L/\\partial x = (e_s - \\hat n\\,
    \\overline{e_s \\odot \\hat n}) / r$ with $e_s = E \\odot \\gamma$. Its parameters are an
    `RMSNormParams(weight, bias)`, which is also what it exports; `eps` is static. For an
    RMSNorm whose scale learns, use `fusedpc.transplant.from_rms_norm`.
    """
    if rms_norm_module is not None:
        if not isinstance(rms_norm_module, eqx.nn.RMSNorm):
            raise TypeError(
                f"rms_norm: expected an eqx.nn.RMSNorm, got {type(rms_norm_module).__name__}."
            )
        width = _norm_width(rms_norm_module, "rms_norm")
        params = RMSNormParams(rms_norm_module.weight, rms_norm_module.bias)
        eps = rms_norm_module.eps
    elif width is not None:
        params = RMSNormParams(None, None)
    else:
        raise TypeError("rms_norm: pass an eqx.nn.RMSNorm or width=...")
    forward, backward = _rms_norm_formulas(float(eps))
    return Frozen(forward, backward, params, in_width=width, name="rms_norm")


def swiglu(
    gate: eqx.nn.Linear | jax.Array,
    up: eqx.nn.Linear | jax.Array,
    down: eqx.nn.Linear | jax.Array,
) -> GatedFeedForward:
    """A frozen SwiGLU feed-forward $y = \\mathrm{down}(\\mathrm{silu}(\\mathrm{gate}(x))
    \\odot \\mathrm{up}(x))$: a `GatedFeedForward` whose three slots are frozen linears.

    Each of `gate` `(F, D)`, `up` `(F, D)` and `down` `(D, F)` is an `eqx.nn.Linear` (with or
    without a bias) or a weight array (no bias). For one whose weights learn, use
    `fusedpc.transplant.from_swiglu`.
    """
    return GatedFeedForward(linear(gate), linear(up), linear(down))
