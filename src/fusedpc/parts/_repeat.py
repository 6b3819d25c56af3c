"""Repeat: N structurally identical blocks with stacked state, run by `lax.scan` so that the
compiled program (and its compile time) does not grow with N."""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core._checks import check_part
from fusedpc.core._context import StepContext
from fusedpc.core._gradients import DeferredUpdate
from fusedpc.core._measured import Measured, resolve_pending
from fusedpc.core._metrics import Stacked, stack_metrics
from fusedpc.core._part import AbstractPart, Core, PyTree, display_path, join_path, replace_fields


class RepeatState(eqx.Module):
    """State of a `Repeat`: the blocks' states stacked leafwise on a leading axis of size N."""

    blocks: PyTree


class RepeatCache(eqx.Module):
    """What a `Repeat`'s backward reads: the blocks' caches, stacked on a leading axis of size
    N when scanned, a tuple of N caches when unrolled."""

    blocks: PyTree


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _describe(x: Any) -> str:
    if _is_array(x):
        return f"{jnp.result_type(x)}{list(jnp.shape(x))}"
    return repr(x)


_EQUIVALENCE_DEPTH = 64


def equivalent(a: Any, b: Any) -> bool:
    """Whether two static values (functions, optimisers, settings) are interchangeable: the
    same object, equal plain values, or functions built by the same code from equivalent
    captured values.

    So two `optax.adam(1e-3)` made separately are equivalent (the same functions of the same
    settings), `optax.adam(1e-3)` and `optax.adam(2e-3)` are not, and neither are two lambdas
    written on different lines. Conservative: a value it cannot look inside (an object with
    the default, identity equality) is equivalent only to itself; captured arrays are compared
    by value; containers and `functools.partial` element by element.
    """
    return _equivalent(a, b, _EQUIVALENCE_DEPTH)


def _equivalent(a: Any, b: Any, depth: int) -> bool:
    if a is b:
        return True
    if depth <= 0 or type(a) is not type(b):
        return False
    if isinstance(a, types.FunctionType):
        return (
            a.__code__ is b.__code__
            and a.__globals__ is b.__globals__
            and _equivalent(a.__defaults__, b.__defaults__, depth - 1)
            and _equivalent(a.__kwdefaults__, b.__kwdefaults__, depth - 1)
            and _equivalent(_cells(a), _cells(b), depth - 1)
        )
    if isinstance(a, functools.partial):
        return (
            _equivalent(a.func, b.func, depth - 1)
            and _equivalent(a.args, b.args, depth - 1)
            and _equivalent(a.keywords, b.keywords, depth - 1)
        )
    if isinstance(a, types.MethodType):
        return _equivalent(a.__func__, b.__func__, depth - 1) and _equivalent(
            a.__self__, b.__self__, depth - 1
        )
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(
            _equivalent(x, y, depth - 1) for x, y in zip(a, b)
        )
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equivalent(a[k], b[k], depth - 1) for k in a)
    if _is_array(a):
        if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
            return False
        return (
            jnp.shape(a) == jnp.shape(b)
            and jnp.result_type(a) == jnp.result_type(b)
            and bool(np.array_equal(np.asarray(a), np.asarray(b)))
        )
    try:
        return bool(a == b)
    except Exception:  # values without a boolean equality count as different
        return False


def _cells(function: types.FunctionType) -> tuple:
    """The values a function captured (an empty cell reads as a marker of its own)."""
    values = []
    for cell in function.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            values.append(_EMPTY_CELL)
    return tuple(values)


_EMPTY_CELL = object()


def _same_static(a: Any, b: Any) -> bool:
    return equivalent(a, b)


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """The first place where two part trees differ in class, structure, static configuration,
    or leaf shape/dtype, described in words; None when they are interchangeable."""
    here = where or "<block>"
    if type(a) is not type(b):
        return f"{here}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, eqx.Module):
        for field in dataclasses.fields(a):
            va, vb = getattr(a, field.name, None), getattr(b, field.name, None)
            sub = f"{where}.{field.name}"
            if field.metadata.get("static", False):
                if not _same_static(va, vb):
                    return (
                        f"{sub}: static configuration {va!r} vs {vb!r} (blocks share one "
                        "compiled program; build shared functions and optimisers once, outside "
                        "the factory)"
                    )
            else:
                found = first_difference(va, vb, sub)
                if found:
                    return found
        return None
    if _is_array(a):
        if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            return f"{here}: {_describe(a)} vs {_describe(b)}"
        return None
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            return f"{here}: {len(a)} entries vs {len(b)}"
        for i, (sa, sb) in enumerate(zip(a, b)):
            found = first_difference(sa, sb, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{here}: keys {list(a)} vs {list(b)}"
        for name in a:
            found = first_difference(a[name], b[name], f"{where}[{name!r}]")
            if found:
                return found
        return None
    # PyTreeDef compares by structure; its type stub does not declare it
    if jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):  # type: ignore[operator]
        return f"{here}: structure {jax.tree_util.tree_structure(a)} vs " + str(
            jax.tree_util.tree_structure(b)
        )
    leaves = jax.tree_util.tree_leaves(a)
    if leaves == [a]:  # a leaf that is not an array: a Python value
        return None if _same_static(a, b) else f"{here}: value {a!r} vs {b!r}"
    for la, lb in zip(leaves, jax.tree_util.tree_leaves(b)):
        found = first_difference(la, lb, f"{where}<leaf>")
        if found:
            return found
    return None


def _stack(trees: Sequence[PyTree]) -> PyTree:
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


def _slice(tree: PyTree, i: int) -> PyTree:
    return jax.tree_util.tree_map(lambda a: jax.lax.index_in_dim(a, i, keepdims=False), tree)


def stacks_updates(block: AbstractPart) -> bool:
    """Whether an unrolled `Repeat` of `block` may run its parts' optimiser steps once over
    the stacked blocks (`_apply_stacked`): only when every part in the block declares
    `defers_updates` (it reads what its optimiser step returns only to build its new state
    and report it). Any other part anywhere in the block keeps every block's step its own
    (the same numbers, one kernel per block)."""
    if not type(block).defers_updates:
        return False
    return all(stacks_updates(child) for _, child in block.children())


Path = tuple[Any, ...]


def _paths_of(tree: PyTree, leaves: Sequence[Any]) -> list[Path | None]:
    """The tree path at which each of `leaves` sits in `tree` (the very object), or None."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [next((path for path, x in flat if x is leaf), None) for leaf in leaves]


def _leaf_at(tree: PyTree, path: Path) -> Any:
    """The leaf of `tree` at `path` (a path of `tree_flatten_with_path`)."""
    return dict(jax.tree_util.tree_flatten_with_path(tree)[0])[path]


def _stacked_operand(pieces: Sequence[PyTree], olds: Sequence[PyTree],
                     stacked_old: PyTree) -> PyTree:
    """`pieces` (one tree per block) stacked leafwise; a leaf that every block read from
    one path of its old state (its slice of the stacked state) is the stacked array at that
    path itself, not a stack of its slices."""
    columns = [jax.tree_util.tree_leaves(piece) for piece in pieces]
    at = [_paths_of(old, leaves) for old, leaves in zip(olds, columns, strict=True)]
    stacked = []
    for j in range(len(columns[0])):
        paths = {at[i][j] for i in range(len(pieces))}
        path = paths.pop() if len(paths) == 1 else None
        if path is not None:
            stacked.append(_leaf_at(stacked_old, path))
        else:
            stacked.append(jnp.stack([column[j] for column in columns]))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(pieces[0]), stacked)


def _apply_stacked(records: list[DeferredUpdate], old_states: Sequence[PyTree],
                   stacked_old: PyTree, new_states: Sequence[PyTree]) -> PyTree:
    """The blocks' new states stacked, with the optimiser steps their parts deferred (the
    context's deferred-update sink) applied once over the stacked blocks: call $c$ of every
    block runs as one `jax.vmap` of its optimiser over the blocks' stacked gradients,
    parameters and optimiser states, so that XLA updates every block in one kernel per shape
    and writes the stacked state directly, as a scan body would, instead of one kernel per
    block and shape followed by a concatenation. Each block's update is the same arithmetic
    as its own step (the optimiser runs per block under `vmap`).

    Where each step's results go is read by structure: the tree paths at which block $i$'s
    new state holds the stand-ins of its step $c$, the same paths in every block (the blocks
    are structurally identical); the stacked results are put at those paths."""
    n = len(new_states)
    if len(records) % n:
        raise AssertionError(  # blocks are structurally identical: a bug if this happens
            f"Repeat: {len(records)} optimiser steps recorded over {n} blocks.")
    per_block = len(records) // n
    # traced from the last block to the first
    calls = [records[(n - 1 - i) * per_block:(n - i) * per_block] for i in range(n)]
    results: dict[Path, Any] = {}  # a path of the stacked new state -> its stacked value
    for c in range(per_block):
        steps = [calls[i][c] for i in range(n)]
        if all(step.optimiser is steps[0].optimiser for step in steps):
            stacked = jax.vmap(steps[0].apply)(
                _stacked_operand([step.params for step in steps], old_states, stacked_old),
                jax.tree_util.tree_map(lambda *g: jnp.stack(g),
                                       *[step.gradients for step in steps]),
                _stacked_operand([step.opt_state for step in steps], old_states, stacked_old),
            )
        else:  # not one optimiser object: each block's own step, stacked as before
            stacked = _stack([step.apply(step.params, step.gradients, step.opt_state)
                              for step in steps])
        _place(results, steps, jax.tree_util.tree_leaves(stacked), new_states)
    flat, structure = jax.tree_util.tree_flatten_with_path(new_states[0])
    columns = [jax.tree_util.tree_leaves(state) for state in new_states]
    leaves = [results[path] if path in results else jnp.stack([col[j] for col in columns])
              for j, (path, _) in enumerate(flat)]
    return jax.tree_util.tree_unflatten(structure, leaves)


def _place(results: dict[Path, Any], steps: Sequence[DeferredUpdate], values: list[Any],
           new_states: Sequence[PyTree]) -> None:
    """Put the stacked `values` of one deferred call (`steps`, one per block) at the paths of
    the new state that hold its stand-ins, which must be one path for every block."""
    stand_ins = [jax.tree_util.tree_leaves((step.new_params, step.new_state)) for step in steps]
    for j, value in enumerate(values):
        if not isinstance(stand_ins[0][j], jax.Array):  # not an array of the state
            continue
        paths = {_paths_of(state, [leaves[j]])[0]
                 for state, leaves in zip(new_states, stand_ins, strict=True)}
        path = paths.pop() if len(paths) == 1 else None
        if path is None:
            raise AssertionError(  # a stand-in not in the new state would read as zeros
                "Repeat: a part used its optimiser's result outside its new state, or the "
                "blocks put it in different places; deferred optimiser steps cannot serve it "
                "(declare defers_updates = False on that part's class).")
        results[path] = value


class Repeat(AbstractPart):
    """N structurally identical blocks applied in order, $x_{i+1} = \\mathrm{block}_i(x_i)$.

    The blocks' states are stacked leafwise (leading axis N, `RepeatState.blocks`); one compiled
    block runs inside a `lax.scan` forward (its caches stacked) and a reverse `lax.scan` backward
    (`reverse=True`), so the traced program does not grow with N. Backward:
    $E_i = \\mathrm{block}_i^\\top(E_{i+1})$ from $E_N$ = the error at the output, each block
    learning from its own error. The metrics are the blocks' metrics stacked and wrapped in
    `Stacked`, so the report names each block (`blocks[3].attention.wo` for a Repeat called
    `blocks`). A block must keep its input's shape and dtype.

    Blocks are structurally identical when they have the same class, pytree structure, static
    configuration (functions and optimisers compared with `equivalent`: the same object, or
    made by the same code from equal settings, so two `optax.adam(1e-3)` made separately
    count as one) and array shapes/dtypes; they differ only in array values. With `unroll=True` the
    blocks run in a Python loop instead (the same state layout and results; a program that grows
    with N, for comparison and benchmarks).

    Build from N blocks, `Repeat([b0, b1, ...])`, or from a factory,
    `Repeat.from_factory(factory, n, key)` with `factory(key) -> block`.
    """

    defers_updates: ClassVar[bool] = True

    blocks: tuple[AbstractPart, ...]
    unroll: bool = eqx.field(static=True)

    def __init__(self, blocks: Sequence[AbstractPart], *, unroll: bool = False):
        blocks = tuple(blocks)
        if not blocks:
            raise ValueError("Repeat: needs at least one block, got none.")
        for i, block in enumerate(blocks):
            check_part(block, f"Repeat.blocks[{i}]")
        for i, block in enumerate(blocks[1:], start=1):
            found = first_difference(blocks[0], block)
            if found:
                raise ValueError(
                    f"Repeat: block {i} is not structurally identical to block 0; first "
                    f"difference at {found}. Repeated blocks may differ only in array values."
                )
        # Equivalent static values (two `optax.adam(1e-3)`, say) become block 0's own, so
        # that every block has one tree structure, as the stacked state and the scan need.
        structure = jax.tree_util.tree_structure(blocks[0])
        blocks = (blocks[0],) + tuple(
            jax.tree_util.tree_unflatten(structure, jax.tree_util.tree_leaves(block))
            for block in blocks[1:]
        )
        self.blocks = blocks
        self.unroll = bool(unroll)

    @classmethod
    def from_factory(
        cls,
        factory: Callable[[jax.Array], AbstractPart],
        n: int,
        key: jax.Array,
        *,
        unroll: bool = False,
    ) -> Repeat:
        """`n` blocks, `factory(key_i)` for `n` keys split from `key`."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Repeat.from_factory: n must be an int >= 1, got {n!r}.")
        return cls([factory(k) for k in jax.random.split(key, n)], unroll=unroll)

    def children(self) -> tuple[tuple[str, AbstractPart], ...]:
        return tuple((f"[{i}]", block) for i, block in enumerate(self.blocks))

    def replace_children(self, children: Sequence[AbstractPart]) -> Repeat:
        return replace_fields(self, blocks=tuple(children))

    def unrolled(self) -> Repeat:
        """This Repeat with its blocks run in a Python loop (same state layout)."""
        return replace_fields(self, unroll=True)

    def init_state(self, key: jax.Array) -> RepeatState:
        keys = jax.random.split(key, len(self.blocks))
        states = [block.init_state(k) for block, k in zip(self.blocks, keys)]
        first = jax.tree_util.tree_map(jnp.asarray, states[0])
        for i, state in enumerate(states[1:], start=1):
            found = first_difference(first, jax.tree_util.tree_map(jnp.asarray, state))
            if found:
                raise ValueError(
                    f"Repeat: block {i}'s initial state differs in structure from block 0's at "
                    f"{found}; the states must stack on a leading axis."
                )
        return RepeatState(blocks=_stack(states))

    def validate_input(self, x: Any, path: str) -> None:
        self.blocks[0].validate_input(x, join_path(path, "[0]"))

    def input_checks(self, x: Any, path: str) -> tuple[Any, ...]:
        return self.blocks[0].input_checks(x, join_path(path, "[0]"))

    def compile(self, path: str) -> Core:
        if self.unroll:
            names = [join_path(path, f"[{i}]") for i in range(len(self.blocks))]
            cores = [block.compile(name) for block, name in zip(self.blocks, names)]
            forward, backward = _unrolled(cores, names, stacks_updates(self.blocks[0]))
        else:
            name = join_path(path, "[*]")
            forward, backward = _scanned(self.blocks[0].compile(name), name)

        def write_back(state: RepeatState) -> Repeat:
            # Each block writes back onto itself (compiling is only building closures).
            blocks = tuple(
                block.compile(join_path(path, f"[{i}]")).write_back(_slice(state.blocks, i))
                for i, block in enumerate(self.blocks)
            )
            return replace_fields(self, blocks=blocks)

        return Core(forward, backward, write_back)


def _check_block(x, y, name: str) -> None:
    """Trace-time check that a block kept its input's shape and dtype."""
    shape, dtype = getattr(y, "shape", None), getattr(y, "dtype", None)
    if shape != jnp.shape(x) or dtype != jnp.result_type(x):
        raise ValueError(
            f"{display_path(name)}: a repeated block must keep its input's shape "
            f"and dtype; input {_describe(x)}, output {dtype}{list(shape or ())}."
        )


def _unrolled(cores: Sequence[Core], names: Sequence[str], stacked_updates: bool):
    """The forward and backward of a `Repeat` whose blocks run in a Python loop."""
    n = len(cores)

    def forward(state: RepeatState, x, ctx: StepContext):
        caches = []
        for i, core in enumerate(cores):
            y, cache = core.forward(_slice(state.blocks, i), x, ctx)
            _check_block(x, y, names[i])
            x = y
            caches.append(cache)
        return x, RepeatCache(tuple(caches))

    def backward(state: RepeatState, cache: RepeatCache, error, ctx: StepContext):
        new_states, metrics = [None] * n, [None] * n
        old_states = [_slice(state.blocks, i) for i in range(n)]
        measured = ctx.measured
        # Inside a step (its norms measured together, which read the stand-ins of a
        # deferred step as rows of the stacked result), the blocks' optimiser steps run
        # once over the stack.
        records: list[DeferredUpdate] | None = None
        if measured is not None and stacked_updates:
            records = []
            ctx = ctx.replace(deferred=records)
        for i in reversed(range(n)):
            error, new_states[i], metrics[i] = cores[i].backward(
                old_states[i], cache.blocks[i], error, ctx
            )
        if records:
            stacked = _apply_stacked(records, old_states, state.blocks, new_states)
        else:
            stacked = _stack(new_states)
        if measured is not None:  # the blocks' norms: one sum per row of the stack
            measured.rows_of(old_states, state.blocks)
            measured.rows_of(new_states, stacked)
        return error, RepeatState(blocks=stacked), Stacked(stack_metrics(metrics))

    return forward, backward


def _scanned(core: Core, name: str):
    """The forward and backward of a `Repeat` whose blocks run in a `lax.scan`: the blocks
    are traced in the scan body, a trace of its own, so they get `ctx.for_inner_trace()`
    with a norm collection and gradient collection of the body's own, resolved there and
    handed out of the scan."""

    def forward(state: RepeatState, x, ctx: StepContext):
        inner = ctx.for_inner_trace()

        def step(h, block_state):
            y, cache = core.forward(block_state, h, inner)
            _check_block(h, y, name)
            return y, cache

        y, caches = jax.lax.scan(step, x, state.blocks)
        return y, RepeatCache(caches)

    def backward(state: RepeatState, cache: RepeatCache, error, ctx: StepContext):
        collecting, measuring = ctx.collecting_gradient_squares, ctx.measured is not None

        def step(e, block):
            block_state, block_cache = block
            inner = ctx.for_inner_trace()
            squares: list[jax.Array] = []
            if inner.gradients is not None and collecting:  # summed in the body, reported
                inner = inner.replace(gradients=inner.gradients.collecting_into(squares))
            if measuring:  # a block's report norms are measured in the body
                inner = inner.replace(measured=Measured())
            e, new_state, block_metrics = core.backward(block_state, block_cache, e, inner)
            if inner.measured is not None:
                block_metrics = resolve_pending(block_metrics, inner.measured)
            return e, (new_state, block_metrics, sum(squares, jnp.zeros((), jnp.float32)))

        error, (new_states, metrics, squares) = jax.lax.scan(
            step, error, (state.blocks, cache.blocks), reverse=True
        )
        if collecting:
            ctx.gradients.add_square(jnp.sum(squares))  # type: ignore[union-attr]
        if ctx.measured is not None:  # the commit rule's check: one sum per block
            ctx.measured.stacked_rows(new_states)
        return error, RepeatState(blocks=new_states), Stacked(metrics)

    return forward, backward
