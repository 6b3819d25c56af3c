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


def check_mask(mask: Any, name: str, batched: bool = False) -> None:
    """A row mask is an array of booleans or real numbers; host values are finite and >= 0
    and give some row a weight (each step's, for `run`'s `masks`: `batched`). Device masks
    are checked inside the step (`fusedpc.execution.MaskCheck`)."""
    check_array(mask, name)
    if jnp.issubdtype(mask.dtype, jnp.complexfloating):
        raise TypeError(
            f"{name}: expected booleans or real numbers (row weights), got dtype {mask.dtype}; "
            f"pass the weights' real part if that is what you mean."
        )
    if isinstance(mask, jax.Array) or np.asarray(mask).size == 0:
        return  # shapes are checked at trace time; device values inside the step
    with np.errstate(over="ignore"):  # as the step reads it: in float32
        host = np.asarray(mask).astype(np.float32)
    steps = host.reshape(host.shape[0], -1) if batched and host.ndim > 1 else host.reshape(1, -1)
    for step, weights in enumerate(steps):
        problem = mask_problem(
            bool(np.isfinite(weights).all()),
            float(np.min(np.where(np.isfinite(weights), weights, 0.0))),
            float(np.sum(weights, dtype=np.float32)),
        )
        if problem is not None:
            where = f"{name}[{step}]" if batched else name
            raise ValueError(f"{where}: {problem}")


def mask_problem(finite: bool, low: float, total: float) -> str | None:
    """What is wrong with a row mask, from whether its weights are all finite, its smallest
    finite weight and its sum (None: nothing). The host check and the in-program one
    (`MaskCheck.message`) say the same."""
    if not finite:
        return ("row weights must be finite and >= 0 (0 for padding rows), got a NaN or an "
                "infinity.")
    if low < 0:
        return f"row weights must be finite and >= 0 (0 for padding rows), got {low!r}."
    if not total > 0:
        return ("the mask has no weight (every row is 0), so the step has nothing to learn "
                "from; give at least one row a weight > 0.")
    if not np.isfinite(total):
        return f"the row weights sum to {total!r}, beyond float32; scale them down."
    return None


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


def check_same_state(current: Any, state: Any) -> None:
    """`state` has the tree structure, and every leaf the shape and dtype, of `current`
    (`FusedPipeline.set_state`); the message names the first leaf that differs."""
    expected = jax.tree_util.tree_structure(current)
    actual = jax.tree_util.tree_structure(state)
    if expected != actual:  # type: ignore[operator]  # PyTreeDef's stub lacks __ne__
        raise ValueError(
            f"set_state: the state's tree structure differs from this pipeline's.\n"
            f"expected: {expected}\nactual:   {actual}"
        )
    for (path, old), new in zip(
        jax.tree_util.tree_leaves_with_path(current), jax.tree_util.tree_leaves(state)
    ):
        if jnp.shape(old) != jnp.shape(new) or jnp.result_type(old) != jnp.result_type(new):
            raise ValueError(
                f"set_state: leaf {jax.tree_util.keystr(path)} expected "
                f"{jnp.result_type(old)}{list(jnp.shape(old))}, got "
                f"{jnp.result_type(new)}{list(jnp.shape(new))}."
            )
