"""Checks of a host batch at the executor's boundary, before anything is compiled or donated.

Shapes are checked once per batch signature, on the one trace the compiled step needs (the
parts raise, at trace time, errors that name their path); what a trace cannot see — that a
batch is an array at all, that it has rows, the values of token ids and class ids — is checked
here on the host. Each error names the argument, the expected and the actual value.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core import losses as _losses


def check_array(value: Any, name: str) -> None:
    """Refuse non-arrays (lists, tuples, scalars) and arrays of non-numbers (objects, strings)
    at the boundary with an error naming them and their dtype."""
    if not isinstance(value, jax.Array | np.ndarray):
        raise TypeError(
            f"{name}: expected an array (numpy or jax), got {type(value).__name__}; convert it "
            f"with np.asarray({name})."
        )
    if not (jnp.issubdtype(value.dtype, jnp.number) or jnp.issubdtype(value.dtype, jnp.bool_)):
        raise TypeError(
            f"{name}: expected an array of numbers, got dtype {value.dtype} (shape "
            f"{tuple(value.shape)}); convert it to integers or floats first."
        )


def check_non_empty(value: Any, name: str) -> None:
    """Refuse a batch with no rows: rank 0, or any axis of length 0."""
    shape = tuple(np.shape(value))
    if not shape or 0 in shape:
        raise ValueError(
            f"{name}: expected a non-empty batch, got shape {shape}. Every axis (steps, rows, "
            "sequence, features) must have length >= 1."
        )


def check_batch_rank(x: Any, name: str, batched: bool) -> None:
    """A batch has a row axis before the features (and a step axis first for `run`)."""
    min_rank = 3 if batched else 2
    if np.ndim(x) < min_rank:
        layout = "(steps, rows, ...)" if batched else "(rows, ...)"
        raise ValueError(
            f"{name}: expected a batch of shape {layout} (rank >= {min_rank}: a row axis "
            f"before the features), got shape {tuple(np.shape(x))}; add a leading axis "
            f"with x[None] for a single row."
        )


def check_same_steps(xs: Any, targets: Any, name: str = "targets") -> None:
    """`run`'s inputs and targets (or masks) have the same number of steps on axis 0."""
    if np.ndim(targets) == 0 or jnp.shape(xs)[0] != jnp.shape(targets)[0]:
        steps = jnp.shape(targets)[0] if np.ndim(targets) else "none (rank 0)"
        raise ValueError(
            f"run: xs and {name} must have the same number of steps on axis 0, "
            f"got {jnp.shape(xs)[0]} and {steps}."
        )


def check_mask(mask: Any, name: str) -> None:
    """A row mask is an array of booleans or numbers; host values are finite and >= 0."""
    check_array(mask, name)
    if isinstance(mask, jax.Array) or np.asarray(mask).size == 0:
        return  # shapes are checked at trace time; device values are not read back
    host = np.asarray(mask, dtype=np.float64)
    if not np.all(np.isfinite(host)) or np.any(host < 0):
        bad = host[~(np.isfinite(host) & (host >= 0))].reshape(-1)[0]
        raise ValueError(
            f"{name}: row weights must be finite and >= 0 (0 for padding rows), got {bad!r}."
        )


def mask_signature(mask: Any) -> tuple | None:
    """The part of a program's signature that a mask adds (None without one)."""
    if mask is None:
        return None
    return (tuple(jnp.shape(mask)), str(jnp.result_type(mask)))


def signature(x: Any, target: Any, batched: bool) -> tuple:
    """What a compiled program depends on: shapes and dtypes (values never)."""
    return (
        batched,
        tuple(jnp.shape(x)),
        str(jnp.result_type(x)),
        tuple(jnp.shape(target)),
        str(jnp.result_type(target)),
    )


def check_class_ids(
    error_fn: _losses.ErrorFunction,
    target: Any,
    width: int,
    name: str,
    check_device: bool,
) -> None:
    """Integer targets of a class-id error function must lie in `[0, width)`.

    Out-of-range ids would otherwise become all-zero one-hot rows without a word. Host
    arrays are checked always, device arrays only with `check_device` (reading them back
    costs a device-to-host transfer)."""
    if not error_fn.class_ids:
        return
    if not jnp.issubdtype(jnp.result_type(target), jnp.integer):
        return
    if isinstance(target, jax.Array) and not check_device:
        return
    low, high = int(target.min()), int(target.max())
    if low < 0 or high >= width:
        raise ValueError(
            f"{name}: class ids must lie in [0, {width}) (the output's last axis, for "
            f"error_fn {error_fn.name!r}), got {low if low < 0 else high}."
        )
