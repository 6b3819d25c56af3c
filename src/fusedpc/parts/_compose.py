"""Composition: a sequential chain and a residual junction, built from their children's Cores."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax

from fusedpc.core._checks import check_part
from fusedpc.core._metrics import named
from fusedpc.core._part import (
    AbstractPart,
    Core,
    ExportRecord,
    PyTree,
    display_path,
    join_path,
    replace_fields,
)


class SequentialState(eqx.Module):
    """State of a `Sequential`: the children's states, `parts[i]` for child `i`."""

    parts: tuple[PyTree, ...]


class SequentialCache(eqx.Module):
    """What a `Sequential`'s backward reads: the children's caches, `parts[i]` for child `i`."""

    parts: tuple[PyTree, ...]


class Sequential(AbstractPart):
    """A chain: forward in order, backward in reverse.

    Metrics and paths name the children `parts[i]`.
    """

    defers_updates: ClassVar[bool] = True

    parts: tuple[AbstractPart, ...]

    def __init__(self, parts: Iterable[AbstractPart]):
        parts = tuple(parts)
        if not parts:
            raise ValueError("Sequential: needs at least one part, got none.")
        for i, part in enumerate(parts):
            check_part(part, f"Sequential.parts[{i}]")
        self.parts = parts

    def validate_input(self, x: Any, path: str) -> None:
        """The chain's input is its first part's input."""
        self.parts[0].validate_input(x, join_path(path, "parts[0]"))

    def input_checks(self, x: Any, path: str) -> tuple[Any, ...]:
        return self.parts[0].input_checks(x, join_path(path, "parts[0]"))

    def children(self) -> tuple[tuple[str, AbstractPart], ...]:
        return tuple((f"parts[{i}]", part) for i, part in enumerate(self.parts))

    def replace_children(self, children: Sequence[AbstractPart]) -> Sequential:
        children = tuple(children)
        if len(children) != len(self.parts):
            raise ValueError(
                f"Sequential.replace_children: expected {len(self.parts)} parts, got "
                f"{len(children)}."
            )
        return replace_fields(self, parts=children)

    def export_arrays(self, path: str = "") -> tuple[ExportRecord, ...]:
        """The children's records, in order (a frozen linear, GELU, linear gives two)."""
        return tuple(
            record
            for name, part in self.children()
            for record in part.export_arrays(join_path(path, name))
        )

    def init_state(self, key: jax.Array) -> SequentialState:
        keys = jax.random.split(key, len(self.parts))
        return SequentialState(tuple(p.init_state(k) for p, k in zip(self.parts, keys)))

    def compile(self, path: str) -> Core:
        names = [join_path(path, f"parts[{i}]") for i in range(len(self.parts))]
        cores = [check_part(p, n).compile(n) for p, n in zip(self.parts, names)]

        def forward(state: SequentialState, x, ctx):
            caches = []
            for core, sub in zip(cores, state.parts):
                x, cache = core.forward(sub, x, ctx)
                caches.append(cache)
            return x, SequentialCache(tuple(caches))

        def backward(state: SequentialState, cache: SequentialCache, error, ctx):
            new_states = [None] * len(cores)
            metrics = [None] * len(cores)
            for i in reversed(range(len(cores))):
                error, new_states[i], metrics[i] = cores[i].backward(
                    state.parts[i], cache.parts[i], error, ctx
                )
            return error, SequentialState(tuple(new_states)), named(parts=tuple(metrics))

        def write_back(state: SequentialState) -> Sequential:
            children = tuple(c.write_back(s) for c, s in zip(cores, state.parts))
            return replace_fields(self, parts=children)

        return Core(forward, backward, write_back)


class ResidualState(eqx.Module):
    """State of a `Residual`: the branch's state."""

    branch: PyTree


class Residual(AbstractPart):
    """A residual junction $y = x + \\mathrm{branch}(x)$.

    Backward: the error $E$ goes both ways, straight through and through the branch, and the
    two messages add: $\\partial L/\\partial x = E + \\mathrm{branch}^\\top(E)$.
    """

    defers_updates: ClassVar[bool] = True

    branch: AbstractPart

    def __init__(self, branch: AbstractPart):
        self.branch = check_part(branch, "Residual.branch")

    def validate_input(self, x: Any, path: str) -> None:
        self.branch.validate_input(x, join_path(path, "branch"))

    def input_checks(self, x: Any, path: str) -> tuple[Any, ...]:
        return self.branch.input_checks(x, join_path(path, "branch"))

    def children(self) -> tuple[tuple[str, AbstractPart], ...]:
        return (("branch", self.branch),)

    def replace_children(self, children: Sequence[AbstractPart]) -> Residual:
        (branch,) = children
        return replace_fields(self, branch=branch)

    def init_state(self, key: jax.Array) -> ResidualState:
        return ResidualState(self.branch.init_state(key))

    def compile(self, path: str) -> Core:
        name = join_path(path, "branch")
        core = check_part(self.branch, name).compile(name)

        def forward(state: ResidualState, x, ctx):
            y, cache = core.forward(state.branch, x, ctx)
            if y.shape != x.shape:
                raise ValueError(
                    f"{display_path(name)}: a residual branch must keep its input's shape; "
                    f"expected output shape {tuple(x.shape)}, got {tuple(y.shape)}."
                )
            return x + y, cache

        def backward(state: ResidualState, cache, error, ctx):
            branch_error, new_branch, metrics = core.backward(state.branch, cache, error, ctx)
            return error + branch_error, ResidualState(new_branch), named(branch=metrics)

        def write_back(state: ResidualState) -> Residual:
            return replace_fields(self, branch=core.write_back(state.branch))

        return Core(forward, backward, write_back)
