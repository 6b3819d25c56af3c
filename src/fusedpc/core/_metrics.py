"""Metrics: the on-device pytree each part's backward returns, and the helpers that make it.

Every node is an `AbstractMetrics` (the open protocol: `finite`, `walk`, `rows`). A learning
part reports a `PartMetrics` (norms of its update, error and weights), a frozen part a
`FiniteFlag`, a composite a `Named` of its children and a `Repeat` a `Stacked`; a part of your
own may report a metrics class of its own, whose rows reach `pipeline.report()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

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
    flags = [jnp.reshape(jnp.asarray(m.finite), (-1,)) for m in metric_leaves(tree)]
    if not flags:
        return jnp.array(True)
    # one reduction over all flags (a reduction each would be a kernel each)
    return jnp.all(jnp.concatenate(flags))



def is_inexact(leaf: Any) -> bool:
    """Whether a leaf has a floating (or complex) dtype: the leaves norms and finite checks
    read (integer and key leaves are always finite)."""
    return bool(jnp.issubdtype(jnp.result_type(leaf), jnp.inexact))


def leaf_finite(leaf: Any) -> jax.Array:
    """Whether every entry of one leaf is finite (integer and key leaves always are)."""
    if is_inexact(leaf):
        return jnp.all(jnp.isfinite(leaf))
    return jnp.array(True)


# Sums of squares overflow float32 once entries reach ~1.8e19 (the square of one entry) or
# fewer entries sum past 3.4e38: the norms are then taken again from the entries scaled by
# 2^-100, exactly (a power of two), so that a norm is infinite only where the norm itself is
# beyond float32.
RESCALE_EXPONENT = 100


class Norms(NamedTuple):
    """Measured norms, one entry per slot (`Measured.norms`, `overflow_safe_norms`): a type
    of their own, so that they are never taken for the sums of squares of
    `Measured.totals`.

    Attributes:
        norms: the Frobenius norms, float32, taken without overflow: infinite only where the
            norm itself exceeds float32's largest value (~3.4e38), NaN where an entry is NaN.
    """

    norms: jax.Array


def overflow_safe_norms(squares: jax.Array, rescaled: Callable[[], jax.Array]) -> Norms:
    """The norms of sums of squares `squares` (a float32 vector), where a sum overflowed
    taken from `rescaled()`: the same sums with every entry multiplied by
    $2^{-100}$ (`RESCALE_EXPONENT`) before squaring. `rescaled` runs only on a step where a
    sum overflowed (`lax.cond`; under `vmap` both branches run, so it costs the sums a second
    time there). Where nothing overflowed the norms are `sqrt(squares)`, bit for bit."""
    squares = jnp.asarray(squares)
    overflowed = jnp.isinf(squares)
    again = jax.lax.cond(jnp.any(overflowed), rescaled, lambda: jnp.zeros_like(squares))
    scale = jnp.float32(2.0 ** RESCALE_EXPONENT)
    return Norms(jnp.where(overflowed, jnp.sqrt(again) * scale, jnp.sqrt(squares)))


def rescaled(x: jax.Array) -> jax.Array:
    """`x` in float32 times $2^{-100}$: the operand of `overflow_safe_norms`'s second sums."""
    return jnp.asarray(x).astype(jnp.float32) * jnp.float32(2.0 ** -RESCALE_EXPONENT)


def leaf_norm_finite(leaf: Any) -> jax.Array:
    """Whether one leaf's norm is finite: every entry finite and the norm within float32
    (taken without overflow: entries of 1e20 have a finite norm; a NaN or infinity anywhere,
    or a norm beyond ~3.4e38, reads as False)."""
    if is_inexact(leaf):
        return jnp.isfinite(tree_norm(leaf))
    return jnp.array(True)


def state_norms_finite(tree: PyTree) -> PyTree:
    """`leaf_norm_finite` of every leaf of `tree` (a tree of booleans of its structure), each
    norm taken as the step takes it (`Measured.add_each`, `Measured.norms`): the commit
    rule's judgement of the new state's leaves."""
    measured = Measured()
    slots = measured.add_each(tree)
    return sums_finite(slots, measured.norms().norms)


def _slot_leaves(slots: PyTree) -> tuple[list[Any], Any]:
    return jax.tree_util.tree_flatten(slots, is_leaf=lambda x: x is None)


def sums_finite(slots: PyTree, totals: jax.Array, flags: jax.Array | None = None) -> PyTree:
    """For the slots `Measured.add_each` gave, whether each value in `totals` (a sum of
    squares, or a norm of `Measured.norms`) is finite (`None` slots, integer leaves, are):
    the tree of flags has the measured tree's structure. The flags are taken as one vector
    (`sums_finite_vector`, or `flags` when the caller has it already) and handed out as its
    entries."""
    leaves, structure = _slot_leaves(slots)
    if flags is None:
        flags = sums_finite_vector(slots, totals)
    return jax.tree_util.tree_unflatten(structure, [flags[i] for i in range(len(leaves))])


def sums_finite_vector(slots: PyTree, totals: jax.Array) -> jax.Array:
    """`sums_finite` as one boolean vector, an entry per slot in tree order (`None`: true)."""
    totals = jnp.asarray(totals)
    n = int(jnp.shape(totals)[0])
    index = np.asarray([n if s is None else int(s) for s in _slot_leaves(slots)[0]], np.int32)
    return jnp.isfinite(_with_zero(totals)[index])


def _with_zero(*vectors: jax.Array) -> jax.Array:
    """The `vectors` one after the other, then a 0: the entry a padded gather index points at
    (finite, and adding nothing to a sum). One concatenation."""
    return jnp.concatenate([*vectors, jnp.zeros((1,), vectors[0].dtype)])


_DETAILED: list[bool] = []


@contextlib.contextmanager
def detailed_reports(detailed: bool) -> Iterator[None]:
    """Trace the parts inside with (True) or without (False) their report norms.

    A step traced with `detailed_reports(False)` (`run`'s steps between reports) gets
    `learning_metrics` whose norms are NaN ("not measured") and whose `finite` flag is true:
    the step's commit rule then rests on the executor's own check of every state leaf's
    norm (`leaf_norm_finite`), the output, the input error and the loss."""
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


def dot_squares(leaves: list[jax.Array], keep: Sequence[int] | None = None
                ) -> list[jax.Array]:
    """$\\sum x^2$ (float32) of each array as the dot product $x \\cdot x$ (`keep[i]`
    leading axes of array `i` kept: one product per row, a batched dot; default none).

    A dot reads its operands as they are in memory, while an XLA:CPU reduction fuses their
    producers into its own kernel and computes them again: the step's report norms, taken by
    reductions, cost it a set of large kernels of their own (compile time) and the work of
    their producers twice (step time), and a sum's last bit depended on what its kernel had
    fused. Taken by dots, every sum is the same whatever the program around it. The dots run
    at `Precision.HIGHEST` (float32 products, not TF32 or bfloat16 passes, on every
    backend)."""
    keep = [0] * len(leaves) if keep is None else list(keep)
    sums = []
    for leaf, kept in zip(leaves, keep, strict=True):
        x = jnp.asarray(leaf).astype(jnp.float32)
        rows, rest = tuple(range(kept)), tuple(range(kept, x.ndim))
        sums.append(jax.lax.dot_general(
            x, x, ((rest, rest), (rows, rows)), precision=jax.lax.Precision.HIGHEST))
    return sums


SMALL_ROWS = 8192  # rows of at most this many entries are measured together


def row_squares(arrays: Sequence[jax.Array], keep: Sequence[int]
                ) -> tuple[jax.Array, list[int]]:
    """$\\sum x^2$ of every row of every array (`keep[i]` leading axes of array `i` are its
    rows; 0: the array is one row), as one float32 vector, and where each array's rows start
    in it.

    Arrays whose rows are small (at most `SMALL_ROWS` entries: biases, norms' scales, small
    matrices) are measured all together (`segment_squares`: copied into one matrix, a
    handful of kernels however many there are) and come first; the large ones each by its
    own dot product (`dot_squares`: read where they are, not copied)."""
    layout = RowSquares(arrays, keep)
    return layout.sums(), layout.first


class RowSquares:
    """The operands `row_squares` reduces, laid out once: the small arrays' rows copied into
    one matrix per block size (`segment_squares`), the large arrays as they are; `sums` takes
    every row's sum of squares from them, optionally of the operands scaled first (the same
    buffers read again: what `overflow_safe_norms` asks of a step whose sums overflowed)."""

    def __init__(self, arrays: Sequence[jax.Array], keep: Sequence[int]) -> None:
        keep = list(keep)
        rows = [int(np.prod(jnp.shape(x)[:k], dtype=np.int64)) for x, k in zip(arrays, keep)]
        small = [int(np.prod(jnp.shape(x)[k:], dtype=np.int64)) <= SMALL_ROWS
                 for x, k in zip(arrays, keep, strict=True)]
        self.first, at = [0] * len(arrays), 0
        for order in (True, False):
            for i, is_small in enumerate(small):
                if is_small == order:
                    self.first[i] = at
                    at += rows[i]
        self.segments = None
        if any(small):
            self.segments = _Segments([x for x, s in zip(arrays, small) if s],
                                      [k for k, s in zip(keep, small) if s])
        self.large = [(arrays[i], keep[i], rows[i]) for i, s in enumerate(small) if not s]

    def sums(self, widen: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
        """Every row's sum of squares, one float32 vector (of `widen(operand)` if given)."""
        pieces = [] if self.segments is None else [self.segments.sums(widen)]
        widen = widen or (lambda x: x)
        large = dot_squares([widen(x) for x, _, _ in self.large], [k for _, k, _ in self.large])
        for (_, _, rows), total in zip(self.large, large, strict=True):
            pieces.append(jnp.reshape(total, (rows,)))
        if not pieces:
            return jnp.zeros((0,), jnp.float32)
        return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)


_BLOCK_SIZES = (128, 2048, 32768, 524288, 8388608)
_MAX_BLOCKS = 256


def segment_squares(arrays: Sequence[jax.Array], keep: Sequence[int]) -> jax.Array:
    """$\\sum x^2$ of every row of every array (`keep[i]` leading axes of array `i` are its
    rows; 0: the array is one row), as one float32 vector: array 0's rows, then array 1's...

    The rows are cut into blocks of one of a few sizes (padded with zeros), the blocks of
    one size concatenated into one matrix and summed along its rows, and each row's block
    sums added by one gather: a handful of kernels for any number of arrays. XLA:CPU compiles
    a kernel for every reduction (several, split in a tree) and every scalar it writes, about
    6 to 40 ms each, and the step's norms were most of its kernels."""
    return _Segments(arrays, keep).sums()


class _Segments:
    """`segment_squares`' matrices (one per block size) and each row's blocks in them."""

    def __init__(self, arrays: Sequence[jax.Array], keep: Sequence[int]) -> None:
        classes: dict[int, list[jax.Array]] = {}
        placed: list[tuple[int, int, int]] = []  # per row: (block size, first block, blocks)
        for x, k in zip(arrays, keep, strict=True):
            shape = jnp.shape(x)
            rows = int(np.prod(shape[:k], dtype=np.int64))
            n = int(np.prod(shape[k:], dtype=np.int64))
            size = next((b for b in _BLOCK_SIZES if n <= b * _MAX_BLOCKS), None)
            if size is None:
                size = -(-n // _MAX_BLOCKS)
            blocks = max(1, -(-n // size))
            pieces = classes.setdefault(size, [])
            start = sum(jnp.shape(p)[0] for p in pieces)
            flat = jnp.reshape(x, (rows, n))
            if blocks * size != n:
                flat = jnp.pad(flat, ((0, 0), (0, blocks * size - n)))
            pieces.append(jnp.reshape(flat, (rows * blocks, size)))
            placed.extend((size, start + r * blocks, blocks) for r in range(rows))
        offsets, self.matrices, total = {}, [], 0
        for size, pieces in classes.items():
            matrix = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
            offsets[size] = total
            total += jnp.shape(matrix)[0]
            self.matrices.append(matrix)
        self.index = None
        if placed:
            widest = max(blocks for _, _, blocks in placed)
            # `total`: the zero after the end
            self.index = np.full((len(placed), widest), total, np.int32)
            for row, (size, first, blocks) in enumerate(placed):
                self.index[row, :blocks] = offsets[size] + first + np.arange(blocks)

    def sums(self, widen: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
        if self.index is None:
            return jnp.zeros((0,), jnp.float32)
        matrices = self.matrices if widen is None else [widen(m) for m in self.matrices]
        block_sums = _with_zero(*[jnp.sum(m * m, axis=1) for m in matrices])
        return jnp.sum(block_sums[self.index], axis=1)


def gather_sums(values: jax.Array, groups: Sequence[Sequence[int]]) -> jax.Array:
    """`[sum(values[i] for i in group) for group in groups]` as one float32 vector (one
    gather, one reduction; an empty group sums to 0)."""
    if not groups:
        return jnp.zeros((0,), jnp.float32)
    widest = max(1, max(len(g) for g in groups))
    n = int(jnp.shape(values)[0])
    index = np.full((len(groups), widest), n, np.int32)
    for row, group in enumerate(groups):
        index[row, :len(group)] = group
    return jnp.sum(_with_zero(values)[index], axis=1)


def inexact_leaves(tree: PyTree) -> list[jax.Array]:
    """The leaves of `tree` with a floating (or complex) dtype."""
    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if is_inexact(leaf)]


def tree_norm(tree: PyTree) -> jax.Array:
    """Frobenius norm over every inexact leaf of a pytree (0 for an empty tree)."""
    return tree_norms(tree)[0]


def tree_norms(*trees: PyTree) -> list[jax.Array]:
    """`[tree_norm(t) for t in trees]`, their leaves' sums of squares taken together (one
    reduction per shape over all the trees), without overflow (`overflow_safe_norms`)."""
    groups = [inexact_leaves(t) for t in trees]
    if not trees:
        return []

    def totals(widen: Callable[[Any], jax.Array]) -> jax.Array:
        sums = sums_of_squares([widen(leaf) for group in groups for leaf in group])
        per_tree, start = [], 0
        for group in groups:
            part = sums[start:start + len(group)]
            start += len(group)
            per_tree.append(sum(part[1:], part[0]) if part else jnp.zeros((), jnp.float32))
        return jnp.stack(per_tree)

    norms = overflow_safe_norms(totals(lambda x: x), lambda: totals(rescaled)).norms
    return [norms[i] for i in range(len(trees))]


def learning_metrics(
    old_params: PyTree,
    new_params: PyTree,
    error: jax.Array,
    input_error: Any,
    layer_sizes: tuple[int, ...],
    *,
    measure_later: bool = False,
) -> PartMetrics:
    """The standard report of a learning part: norms of the update, error and weights.

    `finite` is read off norms the report needs anyway (a NaN or infinity anywhere makes its
    norm non-finite) rather than a separate pass over every array: the flag only *names* the
    part in reports; whether a step is committed is decided by the executor's own check of
    the whole new state. (A norm above ~1e19 overflows float32 and also reads as non-finite.)

    With `measure_later=True`, inside a step's `measured_together` (the executor's step), the
    norms and the flag are `PendingNorm`/`PendingFinite` nodes that the step measures
    together with every other part's at its end (`resolve_pending`): read them only from the
    step's output, not inside the backward. Elsewhere it measures them at once, as without it.
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
    measured = measuring() if measure_later else None
    if measured is not None:
        update, weight = measured.add_difference(new_params, old_params), measured.add(new_params)
        checked = [update, weight]
        if input_error is not None:
            checked.append(measured.add(input_error))
        return PartMetrics(
            update_norm=PendingNorm(np.int32(update)),  # type: ignore[arg-type]
            error_norm=PendingNorm(np.int32(measured.add(error))),  # type: ignore[arg-type]
            weight_norm=PendingNorm(np.int32(weight)),  # type: ignore[arg-type]
            finite=PendingFinite(np.asarray(checked, np.int32)),  # type: ignore[arg-type]
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


class PendingNorm(eqx.Module):
    """A report norm not yet measured: the square root of the sum of squares that the step's
    `measured_together` gathers under `slot` (an int32 NumPy value, stacked with its part's
    metrics like any leaf: `stack_metrics` keeps it on the host). `resolve_pending` puts the
    norm in its place."""

    slot: Any


class PendingFinite(eqx.Module):
    """A part's `finite` flag not yet read: whether the sums of squares under every one of
    `slots` (int32 NumPy values, last axis) are finite."""

    slots: Any


def stack_metrics(trees: Sequence[PyTree]) -> PyTree:
    """The metrics of N blocks stacked leafwise (a leading axis N), host (NumPy) leaves kept
    on the host: the pending norms' slots stay known while the step is traced."""

    def stack(*leaves: Any) -> Any:
        if all(isinstance(x, np.ndarray | np.generic) for x in leaves):
            return np.stack(leaves)
        return jnp.stack(leaves)

    return jax.tree_util.tree_map(stack, *trees)


def _is_pending(node: Any) -> bool:
    return isinstance(node, PendingNorm | PendingFinite)


def _key(leaf: Any) -> int:
    return id(leaf)


class Measured:
    """The sums of squares that one step's reports and commit rule need, gathered while the
    step is traced and taken together at its end (`measured_together`).

    Each registration (`add`, `add_difference`) is one *slot*: the sum of squares of a tree's
    leaves, or of the difference of two trees. At the end (`totals`) every array is measured
    once (`row_squares`: the small ones together, the large ones each as a dot product with
    itself) and every slot's total is one entry of a vector: an array registered twice (a
    part's error is the next part's input error; a part's new weights are state leaves the
    commit rule checks) is measured once, and arrays that are rows of a stacked array
    (`rows_of`: an unrolled `Repeat`'s blocks; `stacked_rows`: a scanned one's) are measured
    on the stacked array as it was written, one sum per row."""

    def __init__(self) -> None:
        self._slots: list[list[tuple[Any, ...]]] = []
        self._rows: dict[int, tuple[Any, int]] = {}
        self._stacks: dict[int, int] = {}  # array id -> leading axes that are its rows
        self._held: list[Any] = []  # keeps every keyed object alive, so ids stay unique

    def add(self, tree: PyTree) -> int:
        """A slot for $\\sum x^2$ over the inexact leaves of `tree`."""
        leaves = inexact_leaves(tree)
        self._held.extend(leaves)
        self._slots.append([("square", leaf) for leaf in leaves])
        return len(self._slots) - 1

    def add_difference(self, new: PyTree, old: PyTree) -> int:
        """A slot for $\\sum (n - o)^2$ over the leaves of two trees of one structure."""
        pairs = [
            (n, o) for n, o in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(old),
                                   strict=True) if is_inexact(n)
        ]
        self._held.extend(x for pair in pairs for x in pair)
        self._slots.append([("difference", n, o) for n, o in pairs])
        return len(self._slots) - 1

    def add_each(self, tree: PyTree) -> PyTree:
        """A slot per leaf of `tree` (a tree of slots, `None` for integer leaves)."""
        return jax.tree_util.tree_map(
            lambda leaf: self.add(leaf) if is_inexact(leaf) else None, tree)

    def rows_of(self, pieces: Sequence[PyTree], stacked: PyTree) -> None:
        """Record that leaf `j` of `pieces[i]` equals row `i` of leaf `j` of `stacked`."""
        columns = jax.tree_util.tree_leaves(stacked)
        for i, piece in enumerate(pieces):
            for leaf, whole in zip(jax.tree_util.tree_leaves(piece), columns, strict=True):
                self._held.extend((leaf, whole))
                self._rows[_key(leaf)] = (whole, i)

    def stacked_rows(self, stacked: PyTree, axes: int = 1) -> None:
        """Record that every leaf of `stacked` is a stack of rows on its `axes` leading axes
        (a scanned `Repeat`'s blocks): it is measured one sum per row, each row by the rule a
        row of its size gets, so that how an array is measured does not depend on how many
        rows are stacked."""
        for leaf in jax.tree_util.tree_leaves(stacked):
            self._held.append(leaf)
            self._stacks[_key(leaf)] = max(axes, self._stacks.get(_key(leaf), 0))

    def _locate(self, leaf: Any) -> tuple[Any, tuple[int, ...]]:
        """The outermost stacked array `leaf` is a row (of a row...) of, and the row index."""
        index: tuple[int, ...] = ()
        while _key(leaf) in self._rows:
            leaf, i = self._rows[_key(leaf)]
            index = (i, *index)
        return leaf, index

    def totals(self) -> jax.Array:
        """Every slot's sum of squares, one float32 vector in slot order (it overflows for
        entries from ~1.8e19: `norms` takes the norms without overflow)."""
        layout, rows = self._layout()
        return gather_sums(layout.sums(), rows)

    def norms(self) -> Norms:
        """Every slot's norm, in slot order: the sums of squares of `totals`, a sum that
        overflowed taken again from the same operands rescaled (`overflow_safe_norms`). The
        second sums read the buffers the first read (`RowSquares`), so that they, run only on
        a step whose sums overflowed, make XLA keep nothing in memory the first did not."""
        layout, rows = self._layout()
        return overflow_safe_norms(gather_sums(layout.sums(), rows),
                                   lambda: gather_sums(layout.sums(rescaled), rows))

    def _layout(self) -> tuple[RowSquares, list[list[int]]]:
        """The arrays laid out for their row sums, and each slot's rows among them."""
        plan = self._plan()
        layout = RowSquares(plan.arrays(), plan.kept)
        return layout, plan.slot_rows(layout.first)

    def _plan(self) -> _Plan:
        """What `totals` measures: each array once (keyed by identity; a difference of two
        arrays is one), how many of its leading axes are rows, and each slot's terms."""
        # what to reduce: (kind, arrays...) keyed by the arrays' identity, with how many
        # leading (row) axes to keep
        wanted: dict[tuple, list] = {}
        terms: list[list[tuple[tuple, tuple[int, ...]]]] = []
        for slot in self._slots:
            resolved = []
            for term in slot:
                if term[0] == "square":
                    base, index = self._locate(term[1])
                    key: tuple = ("square", _key(base))
                    operands: tuple = (base,)
                else:
                    (new, at), (old, at_old) = self._locate(term[1]), self._locate(term[2])
                    if at != at_old or jnp.shape(new) != jnp.shape(old):
                        new, old, at = term[1], term[2], ()  # not rows of one layout
                    key, operands, index = ("difference", _key(new), _key(old)), (new, old), at
                entry = wanted.setdefault(key, [operands, self._stacks.get(key[1], 0)])
                entry[1] = max(entry[1], len(index))
                resolved.append((key, index))
            terms.append(resolved)
        return _Plan(wanted, terms)


class _Plan:
    """A `Measured`'s arrays and slots, laid out for `row_squares` (see `Measured._plan`)."""

    def __init__(self, wanted: dict[tuple, list], terms: list) -> None:
        self.wanted, self.terms = wanted, terms
        self.keys = list(wanted)
        self.kept = [wanted[k][1] for k in self.keys]

    def arrays(self) -> list[jax.Array]:
        """The arrays to measure, in float32 (a difference taken of its two operands)."""
        arrays = []
        for key in self.keys:
            operands = self.wanted[key][0]
            x = jnp.asarray(operands[0]).astype(jnp.float32)
            if key[0] == "difference":
                x = x - jnp.asarray(operands[1]).astype(jnp.float32)
            arrays.append(x)
        return arrays

    def slot_rows(self, first: Sequence[int]) -> list[list[int]]:
        """Each slot's rows in a vector of every array's row sums, array `i`'s rows starting
        at `first[i]`."""
        first_row = dict(zip(self.keys, first, strict=True))
        slot_rows = []
        for resolved in self.terms:
            rows: list[int] = []
            for key, index in resolved:
                lead = jnp.shape(self.wanted[key][0][0])[:self.wanted[key][1]]
                numbered = np.arange(int(np.prod(lead, dtype=np.int64))).reshape(lead)
                picked = numbered[index] if index else numbered
                rows.extend(int(r) for r in first_row[key] + np.asarray(picked).reshape(-1))
            slot_rows.append(rows)
        return slot_rows


_MEASURING: list[tuple[Measured, Any]] = []  # (collection, the trace it gathers in)


def _current_trace() -> Any:
    """The trace values are being staged into now (a `lax.scan` body or a `lax.cond` branch
    has its own), or `None` where this jax does not say."""
    try:
        from jax._src import core as jax_core

        return jax_core.trace_ctx.trace
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions
        return None


@contextlib.contextmanager
def measured_together() -> Iterator[Measured]:
    """Trace the parts inside with their report norms gathered (`learning_metrics(...,
    measure_later=True)` hands back `PendingNorm`/`PendingFinite` nodes), to be measured all
    at once by `resolve_pending`, each array once (`Measured`). Measured part by part, by
    reductions, each part's norms were kernels of their own that computed their operands'
    producers a second time.

    Values gathered here must be resolved in this trace. Inside another one (a `lax.scan`
    body, a `lax.cond` branch) `measuring()` gives `None` and the parts measure at once; a
    part that traces its children in a scan body may open its own `measured_together` there
    and resolve it before the body returns (`Repeat` does)."""
    measured = Measured()
    _MEASURING.append((measured, _current_trace()))
    try:
        yield measured
    finally:
        _MEASURING.pop()


def measuring() -> Measured | None:
    """The active `measured_together` collection, or `None`: none outside one, and none in
    another trace than the one it was opened in (inside a `lax.scan` body or a `lax.cond`
    branch of a part of your own that did not open its own), where a part's norms are then
    measured at once, as without a collection."""
    if not _MEASURING:
        return None
    measured, trace = _MEASURING[-1]
    return measured if trace is _current_trace() else None


def resolve_pending(tree: PyTree, measured: Measured,
                    norms: Norms | jax.Array | None = None) -> PyTree:
    """`tree` with every `PendingNorm` and `PendingFinite` replaced by its value, read off
    `norms` (`measured.norms()` when not given; a plain vector is read as the sums of squares
    of `measured.totals()`, as in release 0.3): a norm is its slot's norm, a flag whether
    every one of its slots' norms is finite.

    All norms are taken as one vector (one gather) and all flags as another, and every node
    gets its entries of them: a kernel per value would cost the step's compile more than the
    values' arithmetic."""
    nodes = [n for n in jax.tree_util.tree_leaves(tree, is_leaf=_is_pending) if _is_pending(n)]
    if not nodes:
        return tree
    if norms is None:
        norms = measured.norms()
    elif not isinstance(norms, Norms):  # sums of squares, taken as they are
        sums = jnp.asarray(norms)
        norms = Norms(jnp.sqrt(sums))
    values_of = jnp.asarray(norms.norms)
    n_norms = int(jnp.shape(values_of)[0])
    extended = _with_zero(values_of)  # [n_norms]: a finite 0, for padded rows
    known = [n for n in nodes if isinstance(n.slot if isinstance(n, PendingNorm) else n.slots,
                                            np.ndarray | np.generic)]
    norm_rows = [np.asarray(n.slot, np.int32).reshape(-1) for n in known
                 if isinstance(n, PendingNorm)]
    flag_rows = [np.asarray(n.slots, np.int32) for n in known if isinstance(n, PendingFinite)]
    picked = flags = jnp.zeros((0,), jnp.float32)
    if norm_rows:
        picked = extended[np.concatenate(norm_rows)]
    if flag_rows:
        width = max(1, max(r.shape[-1] for r in flag_rows))
        index = np.concatenate([
            np.pad(r.reshape(-1, r.shape[-1]), ((0, 0), (0, width - r.shape[-1])),
                   constant_values=n_norms) for r in flag_rows])
        flags = jnp.all(jnp.isfinite(extended[index]), axis=-1)
    values: dict[int, jax.Array] = {}
    at_norm = at_flag = 0
    for node in known:
        if isinstance(node, PendingNorm):
            shape = np.shape(node.slot)
            size = int(np.prod(shape, dtype=np.int64))
            values[id(node)] = jnp.reshape(picked[at_norm:at_norm + size], shape)
            at_norm += size
        else:
            shape = np.shape(node.slots)[:-1]
            size = int(np.prod(shape, dtype=np.int64))
            values[id(node)] = jnp.reshape(flags[at_flag:at_flag + size], shape)
            at_flag += size

    def resolve(node: Any) -> Any:
        if not _is_pending(node):
            return node
        if id(node) in values:
            return values[id(node)]
        # slots that are arrays of the trace (stacked by a scan): gathered as they are
        if isinstance(node, PendingNorm):
            return values_of[node.slot]
        return jnp.all(jnp.isfinite(values_of[node.slots]), axis=-1)

    return jax.tree_util.tree_map(resolve, tree, is_leaf=_is_pending)


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
