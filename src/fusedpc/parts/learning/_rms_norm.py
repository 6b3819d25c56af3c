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

from fusedpc.core._part import PyTree
from fusedpc.parts.frozen import RMSNormParams, rms_norm_forward, rms_norm_input_error
from fusedpc.parts.learning._layer_norm import (
    AffineNorm,
)


class RMSNormState(eqx.Module):
    """`params` ($\\gamma$ `weight` `(D,)`, $\\beta$ `bias` `(D,)` or None) and the optax
    `opt_state`."""

    params: RMSNormParams
    opt_state: PyTree


class LearningRMSNorm(AffineNorm):
    """An RMSNorm over the last axis whose scale $\\gamma$ (and shift $\\beta$, if given) learns
    locally through an optax `optimiser`.

    `weight` $\\gamma$ is `(D,)`; `bias` $\\beta$ is `(D,)` or None (no shift, the usual
    RMSNorm: the state then holds no bias and the optimiser sees none). With `optimiser=None`
    it behaves as a frozen RMSNorm. `fusedpc.transplant.from_rms_norm` builds one from an
    `eqx.nn.RMSNorm`.
    """

    params_type: ClassVar[type] = RMSNormParams
    state_type: ClassVar[type] = RMSNormState
    _normalise = staticmethod(rms_norm_forward)
    _input_error_of = staticmethod(rms_norm_input_error)

    @staticmethod
    def checked(weight: jax.Array, bias: Any) -> tuple[jax.Array, jax.Array | None]:
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
        return weight, bias


