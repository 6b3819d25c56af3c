"""The part contract: a part declares its state and compiles to a `Core` of pure functions.

A part is an `eqx.Module` holding configuration (static) and, where it has them, the arrays
it starts from. The executor only ever talks to a part through two methods:

* `init_state(key) -> State`: a named pytree (one `eqx.Module` per part type);
* `compile(path) -> Core`: pure functions over that state.

`path` is the part's position in the tree (`"blocks[3].attention.wo"`); it appears in every
error message a part raises and is the same name that the report uses for the part's metrics
(the metrics tree mirrors the state tree, so there is one naming system).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

PyTree = Any


class Core(NamedTuple):
    """A compiled part: three pure functions over explicit state.

    * `forward(state, x) -> (y, cache)`; the cache holds only what `backward` reads.
    * `backward(state, cache, error) -> (input_error, new_state, metrics)`. `error` is the
      descent error $\\partial L / \\partial y$ at the part's output (same shape as `y`);
      `input_error` is $\\partial L / \\partial x$ per row (not divided by the batch size).
      `metrics` is a pytree of device arrays (`PartMetrics` for learning parts, `FiniteFlag`
      for frozen ones, `named(child=metrics, ...)` for composites, in forward order).
    * `write_back(state) -> part`: a new part tree holding `state`. The executor always hands it
      a fresh copy, so the returned tree never aliases buffers that a later step donates.
    """

    forward: Callable[[PyTree, Any], tuple[Any, PyTree]]
    backward: Callable[[PyTree, PyTree, Any], tuple[Any, PyTree, PyTree]]
    write_back: Callable[[PyTree], AbstractPart]


class AbstractPart(eqx.Module):
    """Base of every part. Subclass it, implement `init_state` and `compile`, and the part runs
    fused inside any tree: the executor never names a concrete part type."""

    @abc.abstractmethod
    def init_state(self, key: jax.Array) -> PyTree:
        """Return the part's initial state (a named pytree of arrays)."""

    @abc.abstractmethod
    def compile(self, path: str) -> Core:
        """Return the part's `Core`; `path` names the part in errors and reports."""

    def validate_input(self, x: Any, path: str) -> None:  # noqa: B027 - optional hook
        """Optional host-side check of a batch before anything is compiled or donated.

        Parts whose inputs carry constraints that shapes cannot express (token ids inside the
        vocabulary, say) override this. The default accepts everything.
        """


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


def join_path(path: str, name: str) -> str:
    """`join_path("blocks[3]", "attention")` is `"blocks[3].attention"`; indices attach bare."""
    if not path:
        return name
    if name.startswith("["):
        return path + name
    return f"{path}.{name}"


def display_path(path: str) -> str:
    return path if path else "<root>"


def replace_fields(module: eqx.Module, **changes: Any) -> eqx.Module:
    """A copy of `module` with some fields replaced, without re-running its `__init__`."""
    names = {f.name for f in dataclasses.fields(module)}
    unknown = set(changes) - names
    if unknown:
        raise TypeError(f"{type(module).__name__} has no fields {sorted(unknown)}")
    new = object.__new__(type(module))
    for f in dataclasses.fields(module):
        object.__setattr__(new, f.name, changes.get(f.name, getattr(module, f.name)))
    return new


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
