"""Metrics: the on-device pytree each part's backward returns, and the helpers that make it.

Every node is an `AbstractMetrics` (the open protocol: `finite`, `walk`, `rows`). A learning
part reports a `PartMetrics` (norms of its update, error and weights), a frozen part a
`FiniteFlag`, a composite a `Named` of its children and a `Repeat` a `Stacked`; a part of your
own may report a metrics class of its own, whose rows reach `pipeline.report()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core._part import PyTree, display_path, join_path


class AbstractMetrics(eqx.Module):
    """Base of what a part's backward reports: the open metrics protocol.

    A metrics node is either a **leaf** (one part's report) or a **container** of other
    nodes (a composite's children). Every node answers three questions:

    * `finite` (a boolean array, on the device inside the step): whether the part's update and
      emitted error were finite. The executor reads it to name the first non-finite part.
    * `walk(path) -> Iterator[(path, leaf)]`: the leaves under this node, in forward order,
      with their paths. A leaf yields `(path, self)` (the default); a container yields its
      children's leaves with their paths joined (`join_path(path, name)`).
    * `rows(path) -> list[dict]` (host side, on values already read back): the report rows of
      a leaf. The default is one row `{"part": path, field: value, ...}` over the leaf's own
      fields (0-d arrays as Python scalars, others as nested lists), so a class of your own
      with an `energy` field reports `{"part": ..., "energy": ..., "finite": ...}` without
      further code. `PartMetrics` gives the standard learning row, `FiniteFlag` none.

    Subclass it for a part of your own: declare `finite` and your fields, and return an
    instance from `backward`; `pipeline.report()` then lists its rows in forward order.
    """

    # `finite` is declared by each subclass (a field of a leaf, a property of a container)
    # rather than here: a field declared on this base would come first in every subclass's
    # positional constructor. This read-only declaration is for the type checker only.
    if TYPE_CHECKING:

        @property
        def finite(self) -> jax.Array: ...

    def walk(self, path: str = "") -> Iterator[tuple[str, AbstractMetrics]]:
        """The leaf metrics under this node with their paths, in forward order."""
        yield path, self

    def rows(self, path: str) -> list[dict[str, Any]]:
        """This leaf's report rows (host values); the default is one row of its fields."""
        row: dict[str, Any] = {"part": display_path(path)}
        for field in dataclasses.fields(self):
            row[field.name] = _host_value(getattr(self, field.name))
        return [row]


def _host_value(value: Any) -> Any:
    """A report value: a 0-d array as a Python scalar, an array as nested lists."""
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        host = np.asarray(value)
        return host.item() if host.ndim == 0 else host.tolist()
    if isinstance(value, tuple):
        return [_host_value(v) for v in value]
    return value


class PartMetrics(AbstractMetrics):
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

    def rows(self, path: str) -> list[dict[str, Any]]:
        """One row: `part`, `layer_sizes`, `update_norm`, `error_norm`, `weight_norm`,
        `update_ratio` (update / weight norm, NaN for zero weights) and `finite`."""
        update, weight = float(self.update_norm), float(self.weight_norm)
        return [
            {
                "part": display_path(path),
                "layer_sizes": list(self.layer_sizes),
                "update_norm": update,
                "error_norm": float(self.error_norm),
                "weight_norm": weight,
                "update_ratio": update / weight if weight > 0 else float("nan"),
                "finite": bool(self.finite),
            }
        ]


class FiniteFlag(AbstractMetrics):
    """A frozen part's only metric: whether the error it emitted is finite (no report row)."""

    finite: jax.Array

    def rows(self, path: str) -> list[dict[str, Any]]:
        del path
        return []


class Named(AbstractMetrics):
    """Metrics of a composite's children, in the composite's own (forward) order.

    A plain dict would do, except that JAX sorts dict keys when it flattens them; the report
    lists parts in forward order and finds the first non-finite part in backward order, so
    composites return `named(child=metrics, ...)` instead. `finite` is every child's.
    """

    names: tuple[str, ...] = eqx.field(static=True)
    children: tuple[PyTree, ...]

    @property
    def finite(self) -> jax.Array:
        return metrics_finite(self)

    def walk(self, path: str = "") -> Iterator[tuple[str, AbstractMetrics]]:
        for name, child in zip(self.names, self.children):
            yield from iter_metrics(child, join_path(path, name))


def named(**children: PyTree) -> Named:
    """`named(n1=m1, attention=m2)`: children's metrics keyed by name, order kept."""
    return Named(tuple(children), tuple(children.values()))


class Stacked(AbstractMetrics):
    """Metrics of N repeated blocks, stacked on a leading axis; the report names each block
    `[i]`. `finite` is every block's."""

    blocks: PyTree

    @property
    def finite(self) -> jax.Array:
        return metrics_finite(self)

    def walk(self, path: str = "") -> Iterator[tuple[str, AbstractMetrics]]:
        leaves = jax.tree_util.tree_leaves(self.blocks)
        if not leaves:
            return
        for i in range(leaves[0].shape[0]):
            block = jax.tree_util.tree_map(lambda a, i=i: a[i], self.blocks)
            yield from iter_metrics(block, f"{path}[{i}]")


def metric_leaves(tree: PyTree) -> list[AbstractMetrics]:
    """Every leaf metrics node of a metrics tree, for use on the device: the children of a
    `Named` and the blocks of a `Stacked` are walked as pytrees, so stacked blocks stay
    stacked (one array per field, no per-block slicing as in `iter_metrics`)."""

    def is_leaf(node: Any) -> bool:
        return isinstance(node, AbstractMetrics) and not isinstance(node, Named | Stacked)

    return [n for n in jax.tree_util.tree_leaves(tree, is_leaf=is_leaf) if is_leaf(n)]


def metrics_finite(tree: PyTree) -> jax.Array:
    """One boolean: every leaf's `finite` flag (stacked flags included) is true."""
    flags = [jnp.all(jnp.asarray(m.finite)) for m in metric_leaves(tree)]
    if not flags:
        return jnp.array(True)
    return jnp.stack(flags).all()



def is_inexact(leaf: Any) -> bool:
    """Whether a leaf has a floating (or complex) dtype: the leaves norms and finite checks
    read (integer and key leaves are always finite)."""
    return bool(jnp.issubdtype(jnp.result_type(leaf), jnp.inexact))


def leaf_finite(leaf: Any) -> jax.Array:
    """Whether every entry of one leaf is finite (integer and key leaves always are)."""
    if is_inexact(leaf):
        return jnp.all(jnp.isfinite(leaf))
    return jnp.array(True)


def leaf_norm_finite(leaf: Any) -> jax.Array:
    """Whether one leaf's norm is finite: every entry finite and the sum of squares within
    float32 (a NaN or infinity anywhere, or magnitudes whose norm overflows, read as False).
    The commit rule checks every state leaf this way, all at once (`state_norms_finite`)."""
    if is_inexact(leaf):
        return jnp.isfinite(jnp.sum(jnp.square(jnp.asarray(leaf).astype(jnp.float32))))
    return jnp.array(True)


def state_norms_finite(tree: PyTree) -> PyTree:
    """`leaf_norm_finite` of every leaf of `tree` (a tree of booleans of its structure), the
    sums of squares of the leaves of one shape taken by one reduction (`sums_of_squares`)."""
    leaves, structure = jax.tree_util.tree_flatten(tree)
    inexact = [i for i, leaf in enumerate(leaves) if is_inexact(leaf)]
    sums = sums_of_squares([leaves[i] for i in inexact])
    flags: list[jax.Array] = [jnp.array(True)] * len(leaves)
    for i, total in zip(inexact, sums, strict=True):
        flags[i] = jnp.isfinite(total)
    return jax.tree_util.tree_unflatten(structure, flags)


_DETAILED: list[bool] = []


@contextlib.contextmanager
def detailed_reports(detailed: bool) -> Iterator[None]:
    """Trace the parts inside with (True) or without (False) their report norms.

    A step traced with `detailed_reports(False)` (`run`'s steps between reports) gets
    `learning_metrics` whose norms are NaN ("not measured") and whose `finite` flag is true:
    the step's commit rule then rests on the executor's own check of every state leaf's
    norm (`state_norms_finite`), the output, the input error and the loss."""
    _DETAILED.append(bool(detailed))
    try:
        yield
    finally:
        _DETAILED.pop()


def reports_detailed() -> bool:
    """Whether the step being traced computes its parts' report norms (True outside any
    `detailed_reports`)."""
    return _DETAILED[-1] if _DETAILED else True


def all_finite(tree: PyTree) -> jax.Array:
    """One boolean: every inexact leaf of `tree` is finite (integer leaves always are)."""
    leaves = [leaf_finite(leaf) for leaf in inexact_leaves(tree)]
    if not leaves:
        return jnp.array(True)
    return jnp.stack(leaves).all()


def sums_of_squares(leaves: list[jax.Array]) -> list[jax.Array]:
    """$\\sum x^2$ (float32) of each array, with the arrays of one shape summed by one
    variadic reduction (one kernel for all of them rather than one each: the step's compile
    time grows with its kernels)."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, leaf in enumerate(leaves):
        by_shape.setdefault(tuple(jnp.shape(leaf)), []).append(i)
    sums: list[Any] = [None] * len(leaves)
    for shape, members in by_shape.items():
        squares = tuple(jnp.square(jnp.asarray(leaves[i]).astype(jnp.float32)) for i in members)
        if not shape:
            reduced: tuple[jax.Array, ...] = squares
        else:
            reduced = tuple(jax.lax.reduce(
                squares, tuple(jnp.float32(0) for _ in members),
                lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True)),
                tuple(range(len(shape))),
            ))
        for i, total in zip(members, reduced, strict=True):
            sums[i] = total
    return sums


def inexact_leaves(tree: PyTree) -> list[jax.Array]:
    """The leaves of `tree` with a floating (or complex) dtype."""
    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if is_inexact(leaf)]


def tree_norm(tree: PyTree) -> jax.Array:
    """Frobenius norm over every inexact leaf of a pytree (0 for an empty tree)."""
    return tree_norms(tree)[0]


def tree_norms(*trees: PyTree) -> list[jax.Array]:
    """`[tree_norm(t) for t in trees]`, their leaves' sums of squares taken together (one
    reduction per shape over all the trees)."""
    leaves = [inexact_leaves(t) for t in trees]
    sums = sums_of_squares([leaf for group in leaves for leaf in group])
    norms, start = [], 0
    for group in leaves:
        part = sums[start:start + len(group)]
        start += len(group)
        norms.append(jnp.sqrt(sum(part[1:], part[0])) if part else jnp.zeros((), jnp.float32))
    return norms


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
    if not reports_detailed():
        unmeasured = jnp.full((), jnp.nan, jnp.float32)
        return PartMetrics(
            update_norm=unmeasured,
            error_norm=unmeasured,
            weight_norm=unmeasured,
            finite=jnp.array(True),
            layer_sizes=tuple(int(s) for s in layer_sizes),
        )
    update = jax.tree_util.tree_map(lambda n, o: n - o, new_params, old_params)
    update_norm, weight_norm, error_norm, input_error_norm = tree_norms(
        update, new_params, error, input_error)
    finite = jnp.isfinite(update_norm) & jnp.isfinite(weight_norm)
    if input_error is not None:
        finite = finite & jnp.isfinite(input_error_norm)
    return PartMetrics(
        update_norm=update_norm,
        error_norm=error_norm,
        weight_norm=weight_norm,
        finite=finite,
        layer_sizes=tuple(int(s) for s in layer_sizes),
    )


def iter_metrics(tree: PyTree, prefix: str = "") -> Iterator[tuple[str, AbstractMetrics]]:
    """Walk a metrics tree in forward order, yielding `(path, leaf)` for every leaf metrics.

    Any `AbstractMetrics` walks itself (`walk`); plain dicts (in insertion order), lists and
    tuples of metrics are walked as containers too; anything else (`None`) holds no metrics.
    """
    if isinstance(tree, AbstractMetrics):
        yield from tree.walk(prefix)
    elif isinstance(tree, dict):
        for name, sub in tree.items():
            yield from iter_metrics(sub, join_path(prefix, str(name)))
    elif isinstance(tree, list | tuple):
        for i, sub in enumerate(tree):
            yield from iter_metrics(sub, f"{prefix}[{i}]")


def report_rows(metrics: PyTree) -> list[dict[str, Any]]:
    """The report rows of a metrics tree (host values, one step), in forward order.

    Every leaf contributes its `rows(path)`: a learning part's `PartMetrics` one row with
    `part` (its path), `layer_sizes`, `update_norm`, `error_norm`, `weight_norm`,
    `update_ratio` (update / weight norm) and `finite`; a frozen part's `FiniteFlag` none; a
    metrics class of your own its own row (`part` and its fields, unless it overrides `rows`).
    """
    return [row for path, m in iter_metrics(metrics) for row in m.rows(path)]
