"""A public checker: does a part's hand-written backward equal `jax.vjp` of its forward?"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core._checks import check_part


def check_backward(
    part: Any,
    x: Any,
    *,
    error: Any = None,
    key: jax.Array | None = None,
    state: Any = None,
) -> float:
    """Compare a part's backward with `jax.vjp` of its forward; return the worst relative error.

    The error at the output is `error` (default: standard normal, drawn from `key`). Returns
    $\\max_i |e_i - v_i| / \\max_i |v_i|$, where $e$ is the part's input error and $v$ the
    vector-Jacobian product of its forward at `x`: the worst entry's error relative to the
    error's scale (0 when they agree exactly; about 1e-7 is float32 rounding). `state`
    defaults to `part.init_state(key)`. Works on any part, frozen, learning or composite, and on
    your own formulas: `check_backward(fusedpc.Frozen(fwd, bwd, params), x)`.
    """
    part = check_part(part, "check_backward(part)")
    key = jax.random.key(0) if key is None else key
    init_key, error_key = jax.random.split(key)
    core = part.compile("")
    state = part.init_state(init_key) if state is None else state
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise TypeError(
            f"check_backward: x must be floating point to differentiate the forward, got "
            f"{x.dtype}; parts that take integer ids have no input error to check."
        )
    y, cache = core.forward(state, x)
    if error is None:
        error = jax.random.normal(error_key, y.shape, y.dtype)
    input_error, _, _ = core.backward(state, cache, jnp.asarray(error, y.dtype))
    _, vjp = jax.vjp(lambda inp: core.forward(state, inp)[0], x)
    (reference,) = vjp(jnp.asarray(error, y.dtype))
    got, want = np.asarray(input_error, np.float64), np.asarray(reference, np.float64)
    if got.shape != want.shape:
        raise ValueError(
            f"check_backward: the backward returned an input error of shape {got.shape}, "
            f"expected {want.shape} (the input's shape)."
        )
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    worst = float(np.max(np.abs(got - want))) if want.size else 0.0
    if scale == 0.0:
        return 0.0 if worst == 0.0 else float("inf")
    return worst / scale
