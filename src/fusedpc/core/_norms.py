"""Norms without overflow, and the reduction engine behind a step's report norms.

A step measures many arrays (every part's update, error and weights, every state leaf for the
commit rule). Kernels, not arithmetic, dominate a small step's compile and run time, so arrays
are measured together: small ones by one variadic reduction per shape or one segmented matrix
(`row_squares`, `segment_squares`), large ones each as a dot product with itself. Every norm
is taken without overflow (`overflow_safe_norms`). `Measured` (in `fusedpc.core._measured`)
decides what to measure; this module measures it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core._part import PyTree


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


