"""What one step measures: every report norm and commit-rule norm, gathered while the step
is traced (`Measured`, carried by the step context) and taken together at its end
(`resolve_pending`), each array once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core._norms import (
    Norms,
    RowSquares,
    _with_zero,
    gather_sums,
    inexact_leaves,
    is_inexact,
    overflow_safe_norms,
    rescaled,
    sums_finite,
)
from fusedpc.core._part import PyTree


def state_norms_finite(tree: PyTree) -> PyTree:
    """`leaf_norm_finite` of every leaf of `tree` (a tree of booleans of its structure), each
    norm taken as the step takes it (`Measured.add_each`, `Measured.norms`): the commit
    rule's judgement of the new state's leaves."""
    measured = Measured()
    slots = measured.add_each(tree)
    return sums_finite(slots, measured.norms().norms)


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


