"""Boundary checks a part makes at trace time or on host arrays: widths, ranks, ids, parts.

Each raises an error that names the part path, the expected and the actual value.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core._part import AbstractPart, display_path


def expect_last_axis(path: str, x: Any, width: int, what: str = "input") -> None:
    """Raise a `ValueError` naming the part when `x`'s last axis is not `width`."""
    shape = tuple(jnp.shape(x))
    if len(shape) < 1 or shape[-1] != width:
        hint = (
            f"The batch must have {width} features."
            if not path
            else f"The part before it (or the batch) must provide {width} features."
        )
        raise ValueError(
            f"{display_path(path)}: expected {what} of shape (..., {width}), got shape {shape}. "
            + hint
        )


def expect_rank(path: str, x: Any, rank: int, layout: str, what: str = "input") -> None:
    shape = tuple(jnp.shape(x))
    if len(shape) != rank:
        raise ValueError(
            f"{display_path(path)}: expected {what} of rank {rank} {layout}, got shape {shape} "
            f"(rank {len(shape)})."
        )


def positive_number(value: Any, what: str) -> float:
    """`value` as a float: a Python or NumPy real number (not a bool), finite and > 0; else a
    `ValueError` that says `what` it is (e.g. `"Latent: precision"`) and the value given."""
    number = float(value) if isinstance(value, numbers.Real) else math.nan
    if isinstance(value, bool | np.bool_) or not (math.isfinite(number) and number > 0):
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}.")
    return number


def check_part(part: object, path: str) -> AbstractPart:
    """Raise a `TypeError` naming `path` when `part` is not a part."""
    if not isinstance(part, AbstractPart):
        raise TypeError(
            f"{display_path(path)}: expected a part (a subclass of fusedpc.AbstractPart), got "
            f"{type(part).__name__}. Wrap an equinox module with "
            "fusedpc.frozen.from_module(module) or a function with "
            "fusedpc.frozen.from_function(fn, params) (their backward by autodiff), write a "
            "backward for fusedpc.Frozen(forward, backward, params), or make an equinox layer "
            "learn with fusedpc.transplant."
        )
    return part


def check_ids(ids: Any, vocab: int, path: str, what: str = "token ids") -> None:
    """Host-side check of ids: integer dtype and inside `[0, vocab)`.

    Host arrays (numpy, lists) are checked for the price of a min and a max. The executor
    hands device arrays over as a `jax.ShapeDtypeStruct` (dtype checked, values not) unless
    it was built with `check_device_ids=True`, which costs a device-to-host read per step.
    """
    if not hasattr(ids, "dtype"):  # lists and other host sequences
        ids = np.asarray(ids)
    dtype = ids.dtype
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(
            f"{display_path(path)}: expected integer {what}, got dtype {dtype}; convert with "
            ".astype(np.int32)."
        )
    if isinstance(ids, jax.ShapeDtypeStruct):
        return
    arr = np.asarray(ids) if not isinstance(ids, jax.Array) else ids
    if arr.size == 0:
        return
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(
            f"{display_path(path)}: {what} must lie in [0, {vocab}), got {bad}."
        )


class IdRangeCheck(eqx.Module):
    """An in-program check that integer ids lie in `[0, bound)`, made inside the compiled step.

    The executor refuses (does not commit) a step whose check fails, without a host round
    trip; the host reads the check only to explain a refused step. `low`/`high` are the
    smallest and largest id seen (int32 scalars), `ok` whether both lie in range.

    Attributes:
        ok, low, high: device scalars.
        bound: the exclusive upper end of the range (the vocabulary or the output width).
        path: the part (or the root, `""`) whose input the ids are.
        what: `"token ids"` or `"class ids"`.
        argument: the argument that carried them (`"x"`, `"target"`); the pipeline names
            `run`'s stacked arguments `"xs"`/`"targets"`.
    """

    ok: jax.Array
    low: jax.Array
    high: jax.Array
    bound: int = eqx.field(static=True)
    path: str = eqx.field(static=True)
    what: str = eqx.field(static=True, default="token ids")
    argument: str = eqx.field(static=True, default="x")

    def message(self, argument: str | None = None) -> str:
        """The host-side explanation of a failed check (reads `low` and `high`)."""
        low, high = int(np.asarray(self.low)), int(np.asarray(self.high))
        bad = low if low < 0 else high
        return (
            f"{argument or self.argument}: {self.what} must lie in [0, {self.bound}) (part "
            f"{display_path(self.path)!r}), got {bad}."
        )


def id_range_check(
    ids: jax.Array, bound: int, path: str, what: str = "token ids", argument: str = "x"
) -> IdRangeCheck:
    """The `IdRangeCheck` of integer `ids` against `[0, bound)` (a min and a max on device)."""
    ids = jnp.asarray(ids)
    low = jnp.min(ids).astype(jnp.int32)
    high = jnp.max(ids).astype(jnp.int32)
    return IdRangeCheck((low >= 0) & (high < bound), low, high, int(bound), path, what, argument)


def lookup_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """`table[ids]` with NaN rows for ids outside `[0, V)` (negative ones included).

    A plain gather would clamp large ids or wrap negative ones onto real rows without a word;
    NaN rows make an out-of-range id visible in any output computed from it (a `predict` on
    device ids, say) at no host round trip."""
    valid = (ids >= 0) & (ids < table.shape[0])
    rows = jnp.take(table, jnp.where(valid, ids, 0), axis=0)
    return jnp.where(valid[..., None], rows, jnp.asarray(jnp.nan, table.dtype))
