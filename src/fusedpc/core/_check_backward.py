"""A public checker: does a part's hand-written backward equal `jax.vjp` of its forward?"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core._checks import check_part
from fusedpc.core._context import StepContext

ROW_FLOOR = 1e-3
"""A row's error is measured against its own scale, or this fraction of the largest entry
for rows whose true input error is near zero (else float32 rounding there reads as failure)."""


VJP_FACTOR = 4.0
"""A row counts only its distance from the float64 reference beyond this many times the
largest distance of float32 `jax.vjp` in the same check: two correct float32 formulas of
one derivative round differently, by small factors, where cancellation limits both."""


class BackwardCheck(float):
    """What `check_backward` finds: a float, the worse of the overall and the per-row figure.

    Attributes:
        overall: $\\max(0, \\max_i |e_i - v_i| - \\kappa D) / \\max_i |v_i|$ over every
            entry, $v$ the reference (`row_error` says what $\\kappa D$ is).
        row_error: the worst row's distance from the reference beyond float32's own
            resolution, $\\max(0, \\max_j |e_{rj} - v_{rj}| - \\kappa D) / \\max(\\max_j
            |v_{rj}|, \\rho \\max_i |v_i|)$, with $D = \\max_{ij} |u_{ij} - v_{ij}|$ the
            largest distance of float32 `jax.vjp` ($u$) from the reference ($D = 0$ for a
            float32 reference), $\\kappa$ = `VJP_FACTOR`, $\\rho$ = `ROW_FLOOR` (rows: every
            leading axis flattened).
        worst_row: the index of that row (in the flattened leading axes).
        reference: `"float64"` (the forward's vjp in float64, the default) or `"float32"`
            (the forward did not run in float64: its float32 vjp, $u = v$).
        vjp_row_error: float32 `jax.vjp`'s own worst row, measured as `row_error` is without
            the subtraction (0 for a float32 reference).
    """

    overall: float
    row_error: float
    worst_row: int
    reference: str
    vjp_row_error: float

    def __new__(cls, overall: float, row_error: float, worst_row: int,
                reference: str = "float32", vjp_row_error: float = 0.0) -> BackwardCheck:
        check = super().__new__(cls, max(overall, row_error))
        check.overall, check.row_error, check.worst_row = overall, row_error, worst_row
        check.reference, check.vjp_row_error = reference, vjp_row_error
        return check

    def __repr__(self) -> str:
        return (
            f"BackwardCheck({float(self):.3g}: overall {self.overall:.3g}, worst row "
            f"{self.worst_row} {self.row_error:.3g}, against {self.reference})"
        )


def _compare(got: np.ndarray, want: np.ndarray, vjp32: np.ndarray | None = None,
             reference: str = "float32") -> BackwardCheck:
    """The overall and per-row relative errors of `got` against `want` (same shape); with
    `vjp32` (float32 `jax.vjp`, `want` then the float64 one) each row's distance counts only
    beyond float32 vjp's own on that row."""
    if want.size == 0:
        return BackwardCheck(0.0, 0.0, 0, reference)
    width = want.shape[-1] if want.ndim else 1
    rows, difference = want.reshape(-1, width), np.abs(got - want).reshape(-1, width)
    row_difference = difference.max(axis=-1)
    scale, worst = float(np.max(np.abs(rows))), float(np.max(row_difference))
    if scale == 0.0:  # a zero true error: exact agreement, or an infinitely wrong backward
        value = 0.0 if worst == 0.0 else float("inf")
        return BackwardCheck(value, value, int(np.argmax(row_difference)), reference)
    row_scale = np.maximum(np.abs(rows).max(axis=-1), ROW_FLOOR * scale)
    floor, vjp_rows = 0.0, 0.0
    if vjp32 is not None:
        vjp_difference = np.abs(vjp32 - want).reshape(-1, width).max(axis=-1)
        floor = VJP_FACTOR * float(np.max(vjp_difference))
        vjp_rows = float(np.max(vjp_difference / row_scale))
    per_row = np.maximum(row_difference - floor, 0.0) / row_scale
    worst_row = int(np.argmax(per_row))
    return BackwardCheck(max(worst - floor, 0.0) / scale, float(per_row[worst_row]), worst_row,
                         reference, vjp_rows)


def _float64() -> Any:
    """A context in which JAX makes float64 arrays: `jax.enable_x64(True)` from jax 0.8 on,
    `jax.experimental.enable_x64()` before."""
    enable = getattr(jax, "enable_x64", None)
    if enable is not None:
        return enable(True)
    from jax.experimental import enable_x64  # type: ignore[attr-defined]

    return enable_x64()


def _float64_vjp(core: Any, state: Any, x: Any, error: Any,
                 ctx: StepContext) -> np.ndarray | None:
    """The vjp of the forward at `x` in float64 (state, input and error widened), or None
    where the forward does not run in float64 (it mixes dtypes under strict promotion, say):
    the reference is then float32 `jax.vjp`."""

    def wide(a: Any) -> Any:
        if isinstance(a, jax.Array | np.ndarray) and jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.asarray(np.asarray(a, np.float64))
        return a

    try:
        with _float64():
            wide_state = jax.tree_util.tree_map(wide, state)
            _, vjp = jax.vjp(lambda inp: core.forward(wide_state, inp, ctx)[0], wide(x))
            (reference,) = vjp(wide(error))
            if jnp.result_type(reference) != jnp.float64:
                return None
            return np.asarray(reference, np.float64)
    except (TypeError, ValueError):  # a forward that cannot run in float64
        return None


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
    answer (a `BackwardCheck`, a float) is the worse of two figures: overall, the worst entry
    relative to the error's scale $\\max_i |v_i|$, and per row, each row's worst entry
    relative to that row's own scale (at least `ROW_FLOOR` of the largest), so that a
    backward wrong on one row whose true error is small is caught although the other rows
    dominate the overall norm. The reference $v$ is the vjp in float64 (the state, `x` and
    the error widened; `.reference` says `"float32"` for a forward that does not run in
    float64), and both figures count only the distance beyond `VJP_FACTOR` times the largest
    distance of float32 `jax.vjp` from it: where float32 cannot resolve a row (a true error
    near zero from cancellation), a correct float32 backward is not flagged, and a wrong one
    is. 0 when the backward is as close to the reference as float32 autodiff (an
    autodiff-backed part: exactly 0); against a float32 reference, about 1e-7 is float32
    rounding. `.overall`, `.row_error`, `.worst_row`, `.reference` and
    `.vjp_row_error` give the parts. `state` defaults to `part.init_state(key)`. Works on any
    part, frozen, learning or composite, and on your own formulas:
    `check_backward(fusedpc.Frozen(fwd, bwd, params), x)`.
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
    ctx = StepContext()
    y, cache = core.forward(state, x, ctx)
    if error is None:
        error = jax.random.normal(error_key, y.shape, y.dtype)
    input_error, _, _ = core.backward(state, cache, jnp.asarray(error, y.dtype), ctx)
    error = jnp.asarray(error, y.dtype)
    _, vjp = jax.vjp(lambda inp: core.forward(state, inp, ctx)[0], x)
    (reference,) = vjp(error)
    got, want = np.asarray(input_error, np.float64), np.asarray(reference, np.float64)
    if got.shape != want.shape:
        raise ValueError(
            f"check_backward: the backward returned an input error of shape {got.shape}, "
            f"expected {want.shape} (the input's shape)."
        )
    wide = _float64_vjp(core, state, x, error, ctx) if x.dtype == jnp.float32 else None
    if wide is None:
        return _compare(got, want)
    return _compare(got, wide, want, "float64")
