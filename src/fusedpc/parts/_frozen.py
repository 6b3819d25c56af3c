"""Frozen parts: a formula pair whose parameters live in the state and never learn."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ClassVar, cast

import equinox as eqx
import jax

from fusedpc.core._checks import expect_last_axis
from fusedpc.core._metrics import FiniteFlag
from fusedpc.core._norms import all_finite
from fusedpc.core._part import (
    AbstractPart,
    Core,
    ExportRecord,
    PyTree,
    display_path,
    replace_fields,
)


def run_forward(where: str, name: str, x: Any, forward: Callable[[], Any]) -> Any:
    """`forward()`, a frozen part's formula on the input `x`: a `TypeError` or `ValueError`
    from the user's formula comes back as a `ValueError` naming the part (`where`, its
    displayed path, and `name`) and the input's shape; one that already names the path passes
    unchanged."""
    try:
        return forward()
    except (TypeError, ValueError) as err:
        if str(err).startswith(where):
            raise
        raise ValueError(
            f"{where}: the forward of frozen part {name!r} failed on an input of shape "
            f"{tuple(x.shape)}: {err}"
        ) from err


def takes_context(function: Callable[..., Any]) -> bool:
    """Whether a formula takes the step context: it has a parameter named `ctx` (by name,
    so that a formula with a defaulted third parameter of its own is never handed one)."""
    try:
        return "ctx" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


class FrozenState(eqx.Module):
    """State of a frozen part: its parameters (arrays), carried unchanged through every step."""

    params: PyTree


class Frozen(AbstractPart):
    """A part that only translates errors, through a hand-derived backward.

    `forward(params, x) -> (y, cache)` and `backward(params, cache, error) -> input_error`,
    where `error` is the descent error $\\partial L/\\partial y$ and `input_error` must be
    $\\partial L/\\partial x = \\mathrm{vjp}(\\text{forward})(\\text{error})$; check that with
    `fusedpc.check_backward(part, x)`. A formula with a last parameter named `ctx`,
    `forward(params, x, ctx)` or `backward(params, cache, error, ctx)`, gets the step context
    (`fusedpc.core.StepContext`): compute through `ctx.matmul` and `ctx.to_compute` to follow
    the step's compute dtype. `params` is any pytree of arrays (or `None`); it is
    carried in the state, never captured in a closure. `in_width`, when given, is checked
    against the last axis of the input before anything is compiled.
    """

    forward_fn: Callable[..., tuple[Any, PyTree]] = eqx.field(static=True)
    backward_fn: Callable[..., Any] = eqx.field(static=True)
    params: PyTree
    in_width: int | None = eqx.field(static=True)
    name: str = eqx.field(static=True)

    defers_updates: ClassVar[bool] = True  # it has no optimiser step

    def __init__(
        self,
        forward: Callable[..., tuple[Any, PyTree]],
        backward: Callable[..., Any],
        params: PyTree = None,
        *,
        in_width: int | None = None,
        name: str | None = None,
    ):
        if isinstance(forward, AbstractPart) or isinstance(backward, AbstractPart):
            raise TypeError(
                "Frozen(forward, backward, params): forward and backward are formulas "
                "forward(params, x) -> (y, cache) and backward(params, cache, error) -> "
                "input error, got a part; a part already runs in a tree as it is (wrap an "
                "equinox module with fusedpc.frozen.from_module)."
            )
        if not callable(forward) or not callable(backward):
            raise TypeError(
                "Frozen(forward, backward, params): forward and backward must be callables, got "
                f"{type(forward).__name__} and {type(backward).__name__}."
            )
        self.forward_fn = forward
        self.backward_fn = backward
        self.params = params
        self.in_width = None if in_width is None else int(in_width)
        self.name = name or cast(str, getattr(forward, "__name__", "frozen"))

    def export_arrays(self, path: str = "") -> tuple[ExportRecord, ...]:
        """`(params,)` when the parameters are an `ExportRecord` (a frozen linear, LayerNorm or
        embedding), `()` without parameters; other parameters raise a `TypeError` naming
        `path`."""
        if self.params is None:
            return ()
        if isinstance(self.params, ExportRecord):
            return (self.params,)
        raise TypeError(
            f"{display_path(path)}: frozen part {self.name!r} cannot export its parameters: "
            f"they are a {type(self.params).__name__}, not an ExportRecord; hold them in a "
            "record such as fusedpc.parts.LinearParams(weight, bias)."
        )

    def init_state(self, key: jax.Array) -> FrozenState:
        del key
        return FrozenState(params=self.params)

    def compile(self, path: str) -> Core:
        where = display_path(path)
        forward_ctx, backward_ctx = takes_context(self.forward_fn), takes_context(self.backward_fn)

        def forward(state: FrozenState, x, ctx):
            if self.in_width is not None:
                expect_last_axis(path, x, self.in_width)
            extra = (ctx,) if forward_ctx else ()
            return run_forward(where, self.name, x,
                               lambda: self.forward_fn(state.params, x, *extra))

        def backward(state: FrozenState, cache, error, ctx):
            extra = (ctx,) if backward_ctx else ()
            input_error = self.backward_fn(state.params, cache, error, *extra)
            return input_error, state, FiniteFlag(finite=all_finite(input_error))

        def write_back(state: FrozenState) -> Frozen:
            return replace_fields(self, params=state.params)

        return Core(forward, backward, write_back)
