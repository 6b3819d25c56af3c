"""Metrics: the on-device pytree each part's backward returns, and the helpers that make it.

Every node is an `AbstractMetrics` (the open protocol: `finite`, `walk`, `rows`). A learning
part reports a `PartMetrics` (norms of its update, error and weights), a frozen part a
`FiniteFlag`, a composite a `Named` of its children and a `Repeat` a `Stacked`; a part of your
own may report a metrics class of its own, whose rows reach `pipeline.report()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core._part import PyTree, display_path, join_path


class AbstractMetrics(eqx.Module):
    """Base of what a part's backward reports: the open metrics protocol.

    A metrics node is either a **leaf** (one part's report) or a **container** of other
    nodes (a composite's children). Every node answers four questions:

    * `finite` (a boolean array, on the device inside the step): whether the part's update and
      emitted error were finite. The executor reads it to name the first non-finite part.
    * `update_ratios()` (on the device): the part's update / weight norm ratio, which the
      `max_update_ratio` guard bounds; None (the default) for a part without one.
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

    def update_ratios(self) -> jax.Array | None:
        """The update / weight norm ratio of the part (on the device, inside the step; any
        shape, a `Stacked` block's stacked), which `max_update_ratio` bounds; None (the
        default) for a part that takes no update the guard should bound. A part with zero
        weights counts as infinite when it moved and as 0 when it did not."""
        return None

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

    def update_ratios(self) -> jax.Array:
        """`update_norm / weight_norm` (infinite where the weights are 0 and moved, 0 where
        they did not)."""
        update, weight = self.update_norm, self.weight_norm
        safe = jnp.where(weight > 0, weight, 1.0)
        return jnp.where(weight > 0, update / safe, jnp.where(update > 0, jnp.inf, 0.0))

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
    flags = [jnp.reshape(jnp.asarray(m.finite), (-1,)) for m in metric_leaves(tree)]
    if not flags:
        return jnp.array(True)
    # one reduction over all flags (a reduction each would be a kernel each)
    return jnp.all(jnp.concatenate(flags))



def stack_metrics(trees: Sequence[PyTree]) -> PyTree:
    """The metrics of N blocks stacked leafwise (a leading axis N), host (NumPy) leaves kept
    on the host: the pending norms' slots stay known while the step is traced."""

    def stack(*leaves: Any) -> Any:
        if all(isinstance(x, np.ndarray | np.generic) for x in leaves):
            return np.stack(leaves)
        return jnp.stack(leaves)

    return jax.tree_util.tree_map(stack, *trees)


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
