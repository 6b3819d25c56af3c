"""The scale the executor put on the output error of the step being traced.

With a row mask, the executor hands the tree $E_r w_r R / \\sum_r w_r$ rather than $E_r$
(`fusedpc.execution.apply_row_mask`), so that every part's row mean runs over the real rows.
Every part whose step is linear in the error it receives (frozen parts, the single-sweep
learning parts) then takes exactly the step of the masked loss. A part whose step is not linear
in its error (iterative inference relaxes on it) reads the scalar $s = R / \\sum_r w_r$ here.
It undoes the scale before its non-linear work and applies it to what it hands on and learns
from. For a boolean mask every error in the tree is then $s$ times that of the real rows
alone, so such a part steps exactly as on the real rows alone.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

_SCALE: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "fusedpc_error_scale", default=None
)


@contextlib.contextmanager
def error_scaled_by(scale: jax.Array) -> Iterator[None]:
    """Trace the parts inside with the output error scaled by `scale` (a scalar, traced)."""
    token = _SCALE.set(jnp.asarray(scale, jnp.float32))
    try:
        yield
    finally:
        _SCALE.reset(token)


def error_scale() -> jax.Array | None:
    """The scalar $s$ by which the executor scaled the output error of the step being traced
    (with a row mask: $R / \\sum_r w_r$, or 1 where no row is real), or None when it did
    not scale it."""
    scale = _SCALE.get()
    if scale is None:
        return None
    return jnp.where(jnp.isfinite(scale) & (scale > 0), scale, jnp.ones_like(scale))


__all__ = ["error_scale", "error_scaled_by"]
