"""A public checker: does a part's hand-written backward equal `jax.vjp` of its forward?"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core._checks import check_part

ROW_FLOOR = 1e-3
"""A row's error is measured against its own scale, or this fraction of the largest entry
for rows whose true input error is near zero (else float32 rounding there reads as failure)."""


class BackwardCheck(float):
    """What `check_backward` finds: a float, the worse of the overall and the per-row figure.

    Attributes:
        overall: $\\max_i |e_i - v_i| / \\max_i |v_i|$ over every entry.
        row_error: the worst row's $\\max_j |e_{rj} - v_{rj}| / \\max(\\max_j |v_{rj}|,
            \\rho \\max_i |v_i|)$, $\\rho$ = `ROW_FLOOR` (rows: every leading axis flattened).
        worst_row: the index of that row (in the flattened leading axes).
    """

    overall: float
    row_error: float
    worst_row: int

    def __new__(cls, overall: float, row_error: float, worst_row: int) -> BackwardCheck:
        check = super().__new__(cls, max(overall, row_error))
        check.overall, check.row_error, check.worst_row = overall, row_error, worst_row
        return check

    def __repr__(self) -> str:
        return (
            f"BackwardCheck({float(self):.3g}: overall {self.overall:.3g}, worst row "
            f"{self.worst_row} {self.row_error:.3g})"
        )


def _compare(got: np.ndarray, want: np.ndarray) -> BackwardCheck:
    """The overall and per-row relative errors of `got` against `want` (same shape)."""
    if want.size == 0:
        return BackwardCheck(0.0, 0.0, 0)
    width = want.shape[-1] if want.ndim else 1
    rows, difference = want.reshape(-1, width), np.abs(got - want).reshape(-1, width)
    row_difference = difference.max(axis=-1)
    scale, worst = float(np.max(np.abs(rows))), float(np.max(row_difference))
    if scale == 0.0:  # a zero true error: exact agreement, or an infinitely wrong backward
        value = 0.0 if worst == 0.0 else float("inf")
        return BackwardCheck(value, value, int(np.argmax(row_difference)))
    per_row = row_difference / np.maximum(np.abs(rows).max(axis=-1), ROW_FLOOR * scale)
    worst_row = int(np.argmax(per_row))
    return BackwardCheck(worst / scale, float(per_row[worst_row]), worst_row)


def check_backward(
    part: Any,
    x: Any,
    *,
    error: Any = None,
    key: jax.Array | None = None,
    state: Any = None,
) -> BackwardCheck:
    """Compare a part's backward with `jax.vjp` of its forward; return the worst relative error.

    The error at the output is `error` (default: standard normal, drawn from `key`). With $e$
    the part's input error and $v$ the vector-Jacobian product of its forward at `x`, the
    answer (a `BackwardCheck`, a float) is the worse of two figures: overall,
    $\\max_i |e_i - v_i| / \\max_i |v_i|$ (the worst entry relative to the error's scale), and
    per row, each row's worst entry relative to that row's own scale (at least `ROW_FLOOR` of
    the largest), so that a backward wrong on one row whose true error is small is caught
    although the other rows dominate the overall norm. 0 when they agree exactly; about 1e-7
    is float32 rounding. `.overall`, `.row_error` and `.worst_row` give the parts. `state`
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
    return _compare(got, want)
