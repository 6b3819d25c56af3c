"""Metrics: the on-device pytree each part's backward returns, and the helpers that make it.

A learning part reports a `PartMetrics` (norms of its update, error and weights), a frozen
part a `FiniteFlag`, a composite a `Named` of its children and a `Repeat` a `Stacked`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from fusedpc.core._part import PyTree, display_path, join_path


class PartMetrics(eqx.Module):
    """What a learning part reports about one step (device arrays, read by `report()`).

    `update_norm` is $\\lVert \\Delta\\theta \\rVert_F$ over all its parameters, `error_norm`
    $\\lVert E \\rVert_F$ of the error at its output, `weight_norm` $\\lVert \\theta \\rVert_F$
    after the step, `finite` whether the update and the emitted input error are finite.
    """

    update_norm: jax.Array
    error_norm: jax.Array
    weight_norm: jax.Array
    finite: jax.Array
    layer_sizes: tuple[int, ...] = eqx.field(static=True, default=())


class FiniteFlag(eqx.Module):
    """A frozen part's only metric: whether the error it emitted is finite."""

    finite: jax.Array


class Named(eqx.Module):
    """Metrics of a composite's children, in the composite's own (forward) order.

    A plain dict would do, except that JAX sorts dict keys when it flattens them; the report
    lists parts in forward order and finds the first non-finite part in backward order, so
    composites return `named(child=metrics, ...)` instead.
    """

    names: tuple[str, ...] = eqx.field(static=True)
    children: tuple[PyTree, ...]


def named(**children: PyTree) -> Named:
    """`named(n1=m1, attention=m2)`: children's metrics keyed by name, order kept."""
    return Named(tuple(children), tuple(children.values()))


class Stacked(eqx.Module):
    """Metrics of N repeated blocks, stacked on a leading axis; the report names each block."""

    blocks: PyTree


def leaf_finite(leaf: Any) -> jax.Array:
    """Whether every entry of one leaf is finite (integer and key leaves always are)."""
    if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
        return jnp.all(jnp.isfinite(leaf))
    return jnp.array(True)


def all_finite(tree: PyTree) -> jax.Array:
    """One boolean: every inexact leaf of `tree` is finite (integer leaves always are)."""
    leaves = [
        leaf_finite(leaf)
        for leaf in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
    ]
    if not leaves:
        return jnp.array(True)
    return jnp.stack(leaves).all()


def tree_norm(tree: PyTree) -> jax.Array:
    """Frobenius norm over every inexact leaf of a pytree (0 for an empty tree)."""
    squares = [
        jnp.sum(jnp.square(leaf.astype(jnp.float32)))
        for leaf in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
    ]
    if not squares:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(sum(squares[1:], squares[0]))


def learning_metrics(
    old_params: PyTree,
    new_params: PyTree,
    error: jax.Array,
    input_error: Any,
    layer_sizes: tuple[int, ...],
) -> PartMetrics:
    """The standard report of a learning part: norms of the update, error and weights.

    `finite` is read off norms the report needs anyway (a NaN or infinity anywhere makes its
    norm non-finite) rather than a separate pass over every array: the flag only *names* the
    part in reports; whether a step is committed is decided by the executor's own check of
    the whole new state. (A norm above ~1e19 overflows float32 and also reads as non-finite.)
    """
    update = jax.tree_util.tree_map(lambda n, o: n - o, new_params, old_params)
    update_norm = tree_norm(update)
    weight_norm = tree_norm(new_params)
    finite = jnp.isfinite(update_norm) & jnp.isfinite(weight_norm)
    if input_error is not None:
        finite = finite & jnp.isfinite(tree_norm(input_error))
    return PartMetrics(
        update_norm=update_norm,
        error_norm=tree_norm(error),
        weight_norm=weight_norm,
        finite=finite,
        layer_sizes=tuple(int(s) for s in layer_sizes),
    )


def iter_metrics(tree: PyTree, prefix: str = "") -> Iterator[tuple[str, PyTree]]:
    """Walk a metrics tree in forward order, yielding `(path, PartMetrics | FiniteFlag)`."""
    if isinstance(tree, PartMetrics | FiniteFlag):
        yield prefix, tree
    elif isinstance(tree, Stacked):
        leaves = jax.tree_util.tree_leaves(tree.blocks)
        if not leaves:
            return
        n = leaves[0].shape[0]
        for i in range(n):
            block = jax.tree_util.tree_map(lambda a, i=i: a[i], tree.blocks)
            yield from iter_metrics(block, f"{prefix}[{i}]")
    elif isinstance(tree, Named):
        for name, sub in zip(tree.names, tree.children):
            yield from iter_metrics(sub, join_path(prefix, name))
    elif isinstance(tree, dict):
        for name, sub in tree.items():
            yield from iter_metrics(sub, join_path(prefix, str(name)))
    elif isinstance(tree, list | tuple):
        for i, sub in enumerate(tree):
            yield from iter_metrics(sub, f"{prefix}[{i}]")


def report_rows(metrics: PyTree) -> list[dict[str, Any]]:
    """One row per learning part of a metrics tree (host values, one step), in forward order.

    Each row: `part` (its path), `layer_sizes`, `update_norm`, `error_norm`, `weight_norm`,
    `update_ratio` (update / weight norm) and `finite`.
    """
    rows = []
    for path, m in iter_metrics(metrics):
        if not isinstance(m, PartMetrics):
            continue
        update, weight = float(m.update_norm), float(m.weight_norm)
        rows.append(
            {
                "part": display_path(path),
                "layer_sizes": list(m.layer_sizes),
                "update_norm": update,
                "error_norm": float(m.error_norm),
                "weight_norm": weight,
                "update_ratio": update / weight if weight > 0 else float("nan"),
                "finite": bool(m.finite),
            }
        )
    return rows
