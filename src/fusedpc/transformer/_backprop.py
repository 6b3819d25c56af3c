"""The backprop twin's training step: the mean cross-entropy of a reference `GPT`
(`fusedpc.transformer.reference`) and one compiled optimiser step on its gradient."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Float, Int

from fusedpc.core._precision import resolve_compute_dtype
from fusedpc.core.losses import softmax_cross_entropy

if TYPE_CHECKING:  # reference.py re-exports this module's functions
    from fusedpc.transformer.reference import GPT

Array = jax.Array
PyTree = Any


def cross_entropy(
    logits: Float[Array, "*positions vocab"],  # noqa: F722 - a jaxtyping shape
    targets: Int[Array, "*positions"],  # noqa: F722 - a jaxtyping shape
) -> Float[Array, ""]:  # noqa: F722 - a jaxtyping shape
    """Mean softmax cross-entropy over all positions.

    ``loss = mean_n [ logsumexp(z_n) - z_n[y_n] ]`` for logits ``z`` of shape ``(..., V)``
    and integer targets ``y`` of shape ``(...)``, computed in at least float32. The one
    implementation is the fused pipeline's, `fusedpc.core.losses.softmax_cross_entropy.loss`,
    so the backprop twin and the fused step report the same number.
    """
    if jnp.finfo(logits.dtype).bits < 32:
        logits = logits.astype(jnp.float32)
    return softmax_cross_entropy.loss(logits, targets)  # type: ignore[misc]  # it has a loss


_NORM_TYPES = (eqx.nn.LayerNorm, eqx.nn.RMSNorm)


def _layer_norm_spec(model: PyTree) -> PyTree:
    """Bool pytree matching ``model``: True at the affine parameters of every LayerNorm and
    RMSNorm."""

    def label(node):
        frozen = isinstance(node, _NORM_TYPES)
        return jax.tree.map(lambda _: frozen, node)

    return jax.tree.map(label, model, is_leaf=lambda x: isinstance(x, _NORM_TYPES))


def _is_none(x) -> bool:
    return x is None


def make_backprop_step(
    optimiser: optax.GradientTransformation,
    *,
    frozen_layer_norm: bool = False,
    compute_dtype: Any = None,
) -> Callable[[GPT, PyTree, Array, Array], tuple[GPT, PyTree, Array]]:
    """Build a compiled training step ``step(model, opt_state, ids, targets)``.

    One step computes ``loss = cross_entropy(model(ids), targets)`` and its gradient by
    backpropagation, transforms the gradient with `optimiser` and applies it, returning
    ``(model, opt_state, loss)``.

    `opt_state` is ``optimiser.init(eqx.filter(model, eqx.is_array))`` (in both modes).
    The buffers of the `model` and `opt_state` passed in are donated to the step, so they
    must not be used again afterwards; `ids` and `targets` (shape ``(B, T)``) are not
    donated.

    Any `GPT` works, whatever its ``norm``, ``positions`` and ``feed_forward``.

    With ``frozen_layer_norm=True`` every norm's affine parameter (``gamma`` and ``beta``
    of ``n1``, ``n2`` and ``norm_f``, LayerNorms or RMSNorms) is left exactly as it was,
    whatever the optimiser (including Adam with weight decay): its gradient is zeroed before the
    optimiser sees it, so moments and global-norm clipping ignore it, and its update is
    dropped, so the parameter is returned bit-for-bit unchanged.

    With ``compute_dtype="bfloat16"`` the forward runs on a bfloat16 copy of the model
    (LayerNorm statistics, attention scores, softmax and the loss in float32) and the
    gradient flows back through the cast to the float32 model, which the optimiser updates
    in float32: the mixed-precision twin of a fused step with the same ``compute_dtype``.
    """
    dtype = resolve_compute_dtype(compute_dtype, "make_backprop_step: compute_dtype")

    def cast(m):
        if dtype is None:
            return m
        return jax.tree.map(
            lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, m
        )

    @eqx.filter_jit(donate="all-except-first")
    def _step(batch, model, opt_state):
        ids, targets = batch

        def loss_fn(m):
            return cross_entropy(cast(m)(ids), targets)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        if frozen_layer_norm:
            spec = _layer_norm_spec(model)
            grads = jax.tree.map(
                lambda g, f: None if g is None else (jnp.zeros_like(g) if f else g),
                grads,
                spec,
                is_leaf=_is_none,
            )
        # Optax mixes Python floats with int32 step counts (Adam's bias correction), which
        # fails under `jax_numpy_dtype_promotion="strict"`; run it under standard promotion.
        with jax.numpy_dtype_promotion("standard"):
            params = eqx.filter(model, eqx.is_array)
            updates, opt_state = optimiser.update(grads, opt_state, params)
        if frozen_layer_norm:
            updates = jax.tree.map(lambda u, f: None if f else u, updates, spec, is_leaf=_is_none)
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    def step(model, opt_state, ids, targets):
        # Inputs travel in the first (non-donated) argument; model and opt_state are donated.
        return _step((ids, targets), model, opt_state)

    return step
