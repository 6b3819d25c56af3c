"""The error at the output, row by row: a row mask's weights, the "active" normalisation, and
padding a short batch to full rows."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core._part import PyTree


def copy_tree(tree: PyTree) -> PyTree:
    """A fresh copy of every array leaf (so donation of the original never reaches it)."""
    return jax.tree_util.tree_map(
        lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array | np.ndarray) else a, tree
    )


def normalise_active(error: jax.Array) -> jax.Array:
    """Scale $E$ by rows / active rows; a row is active when any entry is non-zero.

    $E \\leftarrow E \\cdot R / \\max(A, 1)$, with $R$ rows (all leading axes flattened) and $A$ the
    rows with a non-zero entry: zero rows are taken for padding. Opt-in only
    (`error_normalisation="active"`): a real row whose error is exactly zero (a ReLU or binary
    head that fits it, a saturated sigmoid) is mistaken for padding, and a padding row whose
    target was set to the prediction keeps a rounding of error inside a fused step. Say
    padding with a row mask instead (`step(carry, x, target, mask)`).
    """
    rows = error.reshape(-1, error.shape[-1])
    active = jnp.sum(jnp.any(rows != 0, axis=-1).astype(error.dtype))
    return error * (rows.shape[0] / jnp.maximum(active, 1.0))


def apply_row_mask(error: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The error of a masked step and the row weights: $E_r \\leftarrow E_r\\, w_r R / \\sum w$.

    Every part takes row means, so the step then follows exactly the gradient of the masked
    mean loss $\\sum_r w_r \\ell_r / \\sum_r w_r$ over the $R$ rows; a row of weight 0
    contributes nothing (its error is set to 0, whatever it was). `mask` has the output's
    shape without its last axis (booleans, or non-negative weights)."""
    if tuple(jnp.shape(mask)) != tuple(error.shape[:-1]):
        raise ValueError(
            f"mask: expected shape {tuple(error.shape[:-1])} (the output's shape without its "
            f"last axis: one weight per row), got {tuple(jnp.shape(mask))}."
        )
    if not (
        jnp.issubdtype(jnp.result_type(mask), jnp.number)
        or jnp.issubdtype(jnp.result_type(mask), jnp.bool_)
    ):
        raise TypeError(f"mask: expected booleans or numbers, got dtype {jnp.result_type(mask)}.")
    weights = jnp.asarray(mask).astype(error.dtype)
    rows = weights.size
    scale = weights * (rows / jnp.sum(weights))
    return jnp.where((weights > 0)[..., None], error * scale[..., None], 0.0), weights


def pad_rows(
    rows: int, *arrays: Any, axis: int = 0
) -> tuple[Any, ...]:
    """Pad a short batch to `rows` rows and say which rows are real.

    `pad_rows(64, x, target)` returns `(x, target, mask)`: each array extended along `axis`
    with zeros to `rows` entries, and a boolean `mask` of shape `(rows,)` (True for the real
    rows) to pass as `step(x, target, mask=mask)`. For a GPT batch `(B, T)` the mask is
    `(B, T)`-shaped: broadcast it with `np.broadcast_to(mask[:, None], (rows, T))`.
    Host (numpy) arrays in, numpy arrays out: a last partial batch keeps the step's shapes,
    so it compiles nothing new.
    """
    if not arrays:
        raise ValueError("pad_rows: pass at least one array to pad.")
    length = int(np.shape(arrays[0])[axis])
    if isinstance(rows, bool) or not isinstance(rows, int | np.integer) or rows < length:
        raise ValueError(
            f"rows: expected an integer >= the batch's {length} rows (axis {axis}), got {rows!r}."
        )
    padded = []
    for i, array in enumerate(arrays):
        host = np.asarray(array)
        if host.shape[axis] != length:
            raise ValueError(
                f"arrays[{i}]: expected {length} rows on axis {axis} (as arrays[0]), got shape "
                f"{host.shape}."
            )
        widths = [(0, 0)] * host.ndim
        widths[axis] = (0, rows - length)
        padded.append(np.pad(host, widths))
    mask = np.arange(rows) < length
    return (*padded, mask)
