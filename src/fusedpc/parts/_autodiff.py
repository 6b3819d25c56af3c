"""Frozen parts whose backward is the vector-Jacobian product of their own forward.

Any function `fn(params, x) -> y` or equinox module becomes a frozen part without a
hand-derived formula: the forward runs `jax.vjp` of that one call with respect to the input
and keeps the pullback (its residuals) in the cache; the backward applies it to the error.
The product is local to the part, exactly like a hand-derived backward: no graph ever spans
two parts, and the parameters get no gradient (they are frozen).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp

from fusedpc.core._checks import expect_last_axis
from fusedpc.core._metrics import FiniteFlag
from fusedpc.core._norms import all_finite
from fusedpc.core._part import (
    AbstractPart,
    Core,
    ExportRecord,
    LayerNormParams,
    LinearParams,
    PyTree,
    TableParams,
    display_path,
    replace_fields,
)
from fusedpc.parts._frozen import FrozenState, run_forward


class AutodiffCache(eqx.Module):
    """What the backward of an `AutodiffFrozen` part reads: `pullback`, the function that
    `jax.vjp` returned for the forward at this input (a pytree whose leaves are the vjp's
    residuals, the intermediate values the product needs), or None for an integer input,
    which has no input error."""

    pullback: Callable | None


def _is_integer(x: Any) -> bool:
    return not jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _map_rows(call: Callable[[Any], Any], x: jax.Array, example_ndim: int) -> Any:
    """`call` on one example, `jax.vmap`ped over every leading axis of `x` (the last
    `example_ndim` axes are one example)."""
    lead = x.shape[: x.ndim - example_ndim]
    rows = x.reshape((-1,) + x.shape[x.ndim - example_ndim :])
    y = jax.vmap(call)(rows)
    if not isinstance(y, jax.Array):
        return y  # refused by the output check, which names the part
    return y.reshape(lead + y.shape[1:])


class AutodiffFrozen(AbstractPart):
    """A frozen part whose backward is `jax.vjp` of its own forward with respect to the input.

    Build one with `fusedpc.frozen.from_function(fn, params)` or
    `fusedpc.frozen.from_module(module)`. Forward: $y = f(\\theta, x)$ with $\\theta$ the
    parameters (`params`, carried in a `FrozenState` like every frozen part's, never in a
    closure). Backward: $\\partial L/\\partial x = E\\,\\partial f/\\partial x$, the
    vector-Jacobian product of that one call at the error $E$, so `fusedpc.check_backward`
    holds by construction. The cache (`AutodiffCache`) holds the vjp's residuals: the backward
    does not re-run the forward, and the cache is as large as what autodiff keeps (for a linear
    map that is the weight itself, which a hand-derived backward reads from the state instead;
    see "Writing your own part" in `docs/architecture.md`). The parameters get no gradient.

    Inputs are `(..., features)` (every leading axis a row) or integer ids `(...)` (every axis
    a row); the output must be `(..., out)` with the input's rows. Integer inputs have no input
    error: the backward returns None, as `frozen.embedding`'s does.

    Static configuration: `fn` (a function part's `fn(params, x)`, None for a module),
    `skeleton` (a module part's non-array rest, None for a function), `per_row`, `in_width`,
    `name`. Two parts stack in a `Repeat` when these are equivalent (`fusedpc.parts.equivalent`:
    the same function object, or one made by the same code from equal captured values; a
    module's skeleton compares with `==`, which compares the functions inside it by identity)
    and their arrays have the same shapes.
    """

    defers_updates: ClassVar[bool] = True

    fn: Callable[[PyTree, Any], Any] | None = eqx.field(static=True)
    params: PyTree
    skeleton: Any = eqx.field(static=True)
    per_row: bool = eqx.field(static=True)
    in_width: int | None = eqx.field(static=True)
    name: str = eqx.field(static=True)

    @property
    def module(self) -> eqx.Module:
        """The equinox module rebuilt from the current parameters (a part from
        `from_module`; a `write_back`'s result holds the state's arrays)."""
        if self.skeleton is None:
            raise TypeError(
                f"frozen part {self.name!r} was built from a function "
                "(fusedpc.frozen.from_function), not from a module; its parameters are .params."
            )
        return cast(eqx.Module, eqx.combine(self.params, self.skeleton))

    def _apply(self, params: PyTree, x: Any) -> Any:
        if self.skeleton is None:
            fn = cast(Callable[[PyTree, Any], Any], self.fn)

            def call(example):
                return fn(params, example)
        else:
            call = cast(Callable[[Any], Any], eqx.combine(params, self.skeleton))
        if not self.per_row:
            return call(x)
        return _map_rows(call, x, 0 if _is_integer(x) else 1)

    def _check_output(self, where: str, x: jax.Array, y: Any) -> None:
        rows = x.shape if _is_integer(x) else x.shape[:-1]
        shape = getattr(y, "shape", None)
        if not isinstance(y, jax.Array) or shape is None or len(shape) != len(rows) + 1:
            got = f"shape {tuple(shape)}" if shape is not None else type(y).__name__
            hint = (
                "each row must map to one vector (features,)"
                if self.per_row
                else "pass per_row=True if it works on one example"
            )
            raise ValueError(
                f"{where}: frozen part {self.name!r} must return one array (..., out) with the "
                f"input's rows {rows}, got {got} for an input of shape {tuple(x.shape)}; "
                f"{hint}."
            )
        if tuple(shape[:-1]) != tuple(rows):
            raise ValueError(
                f"{where}: frozen part {self.name!r} must keep the input's rows {rows}, got an "
                f"output of shape {tuple(shape)} for an input of shape {tuple(x.shape)}."
            )

    def export_arrays(self, path: str = "") -> tuple[ExportRecord, ...]:
        """`()` without parameters; `(params,)` when they are an `ExportRecord`; the record of
        an `eqx.nn.Linear`, `eqx.nn.LayerNorm` or `eqx.nn.Embedding` module. Anything else
        raises a `TypeError` naming `path`."""
        if not jax.tree_util.tree_leaves(self.params):
            return ()
        if isinstance(self.params, ExportRecord):
            return (self.params,)
        if self.skeleton is not None:
            module = self.module
            if isinstance(module, eqx.nn.Linear):
                return (LinearParams(module.weight, module.bias),)
            if isinstance(module, eqx.nn.LayerNorm):
                return (LayerNormParams(module.weight, module.bias),)
            if isinstance(module, eqx.nn.Embedding):
                return (TableParams(module.weight),)
        raise TypeError(
            f"{display_path(path)}: frozen part {self.name!r} cannot export its parameters: "
            f"they are a {type(self.params).__name__}, not an ExportRecord or an "
            "eqx.nn.Linear, LayerNorm or Embedding."
        )

    def init_state(self, key: jax.Array) -> FrozenState:
        del key
        return FrozenState(params=self.params)

    def compile(self, path: str) -> Core:
        where = display_path(path)

        def forward(state: FrozenState, x, ctx):
            if jnp.ndim(x) < 1 and not _is_integer(x):
                raise ValueError(
                    f"{where}: expected an input of shape (..., features), got shape "
                    f"{tuple(jnp.shape(x))}."
                )
            if self.in_width is not None and not _is_integer(x):
                expect_last_axis(path, x, self.in_width)

            def apply(inp):
                return self._apply(state.params, inp)

            y, pullback = run_forward(
                where, self.name, x,
                lambda: (apply(x), None) if _is_integer(x) else jax.vjp(apply, x),
            )
            self._check_output(where, x, y)
            return y, AutodiffCache(pullback)

        def backward(state: FrozenState, cache: AutodiffCache, error, ctx):
            input_error = None if cache.pullback is None else cache.pullback(error)[0]
            return input_error, state, FiniteFlag(finite=all_finite(input_error))

        def write_back(state: FrozenState) -> AutodiffFrozen:
            return replace_fields(self, params=state.params)

        return Core(forward, backward, write_back)


def _check_per_row(per_row: Any, where: str) -> bool:
    if not isinstance(per_row, bool):
        raise TypeError(f"{where}: per_row must be True or False, got {per_row!r}.")
    return per_row


def _check_in_width(in_width: Any, where: str) -> int | None:
    if in_width is None:
        return None
    if isinstance(in_width, bool) or not isinstance(in_width, int) or in_width < 1:
        raise ValueError(f"{where}: in_width must be a positive int or None, got {in_width!r}.")
    return in_width


def from_function(
    fn: Callable[[PyTree, Any], jax.Array],
    params: PyTree = None,
    *,
    per_row: bool = False,
    in_width: int | None = None,
    name: str | None = None,
) -> AutodiffFrozen:
    """A frozen part $y = f(\\theta, x)$ from `fn(params, x) -> y`, its backward `jax.vjp`.

    **Arguments:**

    - `fn`: `fn(params, x)`, with `x` `(..., in)` (or, with `per_row=True`, one row `(in,)`)
      returning `(..., out)` (one row: `(out,)`). Build it once: equal parts hold the same
      function object (or one made by the same code from equal captured values, see
      `fusedpc.parts.equivalent`), which is what lets a `Repeat` stack them; a new lambda per
      block makes every block different.
    - `params`: a pytree of arrays, or None; it is the part's state (`FrozenState.params`)
      and gets no gradient.
    - `per_row`: False (default; `fn` takes the whole batch) or True (`fn` takes one row and
      is `jax.vmap`ped over every leading axis).
    - `in_width`: when given, checked against the input's last axis before anything runs.
    - `name`: the part's name in messages (default: `fn.__name__`).

    The backward is $\\partial L/\\partial x = E\\,\\partial f/\\partial x$, the `jax.vjp` of
    this one call, whose residuals the cache holds (`AutodiffCache`). Integer inputs (ids)
    have no input error: the backward returns None. For the memory and time a hand-derived
    backward saves, see "Writing your own part" in `docs/architecture.md`.
    """
    where = "frozen.from_function"
    if not callable(fn) or isinstance(fn, AbstractPart):
        raise TypeError(f"{where}(fn, params): fn must be a function, got {type(fn).__name__}.")
    for leaf_path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not eqx.is_array(leaf):
            raise TypeError(
                f"{where}: params must be a pytree of arrays; leaf "
                f"params{jax.tree_util.keystr(leaf_path)} is a {type(leaf).__name__} "
                f"({leaf!r}). Make it an array, or capture it in fn as configuration."
            )
    return AutodiffFrozen(
        fn=fn,
        params=params,
        skeleton=None,
        per_row=_check_per_row(per_row, where),
        in_width=_check_in_width(in_width, where),
        name=name or cast(str, getattr(fn, "__name__", "function")),
    )


def from_module(
    module: eqx.Module,
    *,
    per_row: bool = True,
    in_width: int | None = None,
    name: str | None = None,
) -> AutodiffFrozen:
    """A frozen part that runs an equinox module, its backward `jax.vjp` of the module's call.

    **Arguments:**

    - `module`: any `eqx.Module` called as `module(x)`. Its arrays
      (`eqx.partition(module, eqx.is_array)`) are the part's state and get no gradient; the
      rest (shapes, activation functions, `eps`) is static configuration. A module without
      arrays (`eqx.nn.Lambda(jax.nn.gelu)`) is fine. For a call that needs more (a key, a
      state), wrap it with `from_function`.
    - `per_row`: True (default; equinox's convention, `eqx.nn.Linear` takes one example
      `(in,)`): the module is `jax.vmap`ped over every leading axis (for integer ids, over
      every axis: `eqx.nn.Embedding` takes one id) and each row must map to a vector `(out,)`.
      False: the module takes the whole `(..., in)` batch itself (one call, no vmap).
    - `in_width`: when given, checked against the input's last axis before anything runs.
    - `name`: the part's name in messages (default: the module's class name).

    The part's `.module` is the module rebuilt from its parameters; `pipeline.merge()` and
    `write_back` return the part holding the current state. Two parts stack in a `Repeat` when
    their modules have equal static rest (`==`: the same shapes and settings, and the same
    function objects inside) and arrays of the same shapes; build activation functions and
    lambdas once, outside a block factory. The backward is
    $\\partial L/\\partial x = E\\,\\partial f/\\partial x$ through `jax.vjp`, whose residuals
    the cache holds (`AutodiffCache`); integer inputs return None.
    """
    where = "frozen.from_module"
    if not isinstance(module, eqx.Module) or isinstance(module, AbstractPart):
        raise TypeError(
            f"{where}(module): expected an equinox module (eqx.Module), got "
            f"{type(module).__name__}"
            + (
                "; it is already a part."
                if isinstance(module, AbstractPart)
                else ". Wrap a plain function with frozen.from_function(fn, params)."
            )
        )
    if not callable(module):
        raise TypeError(f"{where}(module): {type(module).__name__} has no __call__.")
    params, skeleton = eqx.partition(module, eqx.is_array)
    return AutodiffFrozen(
        fn=None,
        params=params,
        skeleton=skeleton,
        per_row=_check_per_row(per_row, where),
        in_width=_check_in_width(in_width, where),
        name=name or type(module).__name__,
    )


__all__ = ["AutodiffCache", "AutodiffFrozen", "from_function", "from_module"]
