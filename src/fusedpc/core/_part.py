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
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, TypeVar

import equinox as eqx
import jax

from fusedpc._deprecation import warn_deprecated

PyTree = Any
_M = TypeVar("_M", bound=eqx.Module)


class _CoreFields(NamedTuple):
    forward: Callable[..., tuple[Any, PyTree]]
    backward: Callable[..., tuple[Any, PyTree, PyTree]]
    write_back: Callable[[PyTree], AbstractPart]


class Core(_CoreFields):
    """A compiled part: three pure functions over explicit state and the step context.

    * `forward(state, x, ctx) -> (y, cache)`; the cache holds only what `backward` reads.
    * `backward(state, cache, error, ctx) -> (input_error, new_state, metrics)`. `error` is
      the descent error $\\partial L / \\partial y$ at the part's output (same shape as `y`);
      `input_error` is $\\partial L / \\partial x$ per row (not divided by the batch size).
      `metrics` is an `AbstractMetrics` of device arrays (`PartMetrics` for learning parts,
      `FiniteFlag` for frozen ones, `named(child=metrics, ...)` for composites, in forward
      order, or a metrics class of the part's own).
    * `write_back(state) -> part`: a new part tree holding `state`. The executor always hands it
      a fresh copy, so the returned tree never aliases buffers that a later step donates.

    `ctx` is the step's `StepContext` (compute dtype, error scale, report detail, norm
    collection, gradient hook, deferred-update sink); a composite hands it to its children.
    Functions written for release 0.3, `forward(state, x)` and `backward(state, cache,
    error)`, still run for one release (with a `DeprecationWarning`, and in float32 without
    the context's services); so does a call that omits `ctx` (given `StepContext()`).
    """

    __slots__ = ()

    def __new__(cls, forward: Callable[..., Any], backward: Callable[..., Any],
                write_back: Callable[[PyTree], AbstractPart]) -> Core:
        return super().__new__(cls, _taking_context(forward, 2, "forward"),
                               _taking_context(backward, 3, "backward"), write_back)


def _accepts(function: Callable[..., Any], n: int) -> bool | None:
    """Whether `function` accepts `n` positional arguments (None: it does not say)."""
    try:
        inspect.signature(function).bind(*([None] * n))
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): taken as it is
        return None
    return True


def _taking_context(function: Callable[..., Any], n: int, name: str) -> Callable[..., Any]:
    """`function` as a function of `n` arguments and the step context: a function of the
    `n` arguments only (release 0.3) is wrapped, with a deprecation warning, and a call that
    omits the context gets the plain one."""
    if getattr(function, "_fusedpc_takes_context", False):
        return function
    legacy = _accepts(function, n + 1) is False and _accepts(function, n) is True
    if legacy:
        warn_deprecated(
            f"Core.{name} takes {n} arguments, without the step context: write "
            f"{name}({_ARGUMENTS[name]}, ctx) and hand ctx to any child core; until then it "
            "runs in float32 without global clipping, deferred updates or the error scale",
            stacklevel=3)

    @functools.wraps(function)
    def with_context(*args: Any) -> Any:
        if len(args) == n:
            warn_deprecated(
                f"calling Core.{name} without the step context is deprecated: pass ctx "
                "(fusedpc.core.StepContext() outside a step)", stacklevel=2)
            args = (*args, _plain_context())
        if len(args) != n + 1:
            raise TypeError(f"Core.{name}: expected ({_ARGUMENTS[name]}, ctx), got "
                            f"{len(args)} arguments.")
        return function(*args[:n]) if legacy else function(*args)

    with_context._fusedpc_takes_context = True  # type: ignore[attr-defined]
    return with_context


_ARGUMENTS = {"forward": "state, x", "backward": "state, cache, error"}


def _plain_context() -> Any:
    from fusedpc.core._context import StepContext  # the context module imports this one

    return StepContext()


class AbstractPart(eqx.Module):
    """Base of every part. Subclass it, implement `init_state` and `compile`, and the part runs
    fused inside any tree: the executor never names a concrete part type.

    A part declares what it supports as class attributes:

    * `defers_updates` (default False): the part reads what `ctx.optimiser_step` returns only
      to put it in its new state and its report (never to compute an error or a value it
      hands on), and calls no optimiser otherwise. An unrolled `fusedpc.Repeat` whose blocks
      hold only such parts runs their optimiser steps once over the stacked blocks (one
      kernel per shape instead of one per block); any other part keeps each block's step its
      own (the same numbers). A composite declares it for itself; `Repeat` asks every part
      of the block.
    """

    defers_updates: ClassVar[bool] = False

    @abc.abstractmethod
    def init_state(self, key: jax.Array) -> PyTree:
        """Return the part's initial state (a named pytree of arrays)."""

    @abc.abstractmethod
    def compile(self, path: str) -> Core:
        """Return the part's `Core`; `path` names the part in errors and reports."""

    def __call__(self, x: Any, *, key: jax.Array | None = None) -> Any:
        """The forward as an equinox-style layer, `(..., in) -> (..., out)`: the shortcut for
        `fusedpc.as_module(self)(x)`, so a trained tree (`pipeline.merge()`) runs inside
        ordinary equinox code for inference. A part whose state is drawn from the PRNG key
        at `init_state` raises a `ValueError` instead of running on random weights: use
        `fusedpc.as_module(part, key=...)`. `key` here is accepted and ignored, as
        `eqx.nn.Sequential` passes one to every layer; it never draws the state. Inference
        only (no cache, no learning step)."""
        from fusedpc.core._module import as_module  # the module imports this one

        del key
        return as_module(self)(x)

    def validate_input(self, x: Any, path: str) -> None:  # noqa: B027 - optional hook
        """Optional host-side check of a batch before anything is compiled or donated.

        Parts whose inputs carry constraints that shapes cannot express (token ids inside the
        vocabulary, say) override this. The default accepts everything.
        """

    def input_checks(self, x: Any, path: str) -> tuple[Any, ...]:
        """Optional in-program checks of the input's values, traced inside the step.

        The device-side twin of `validate_input`: return `IdRangeCheck`s (from
        `fusedpc.core.id_range_check`) for constraints that shapes cannot express; the
        executor refuses a step whose check fails, names the part and, under
        `nonfinite="raise"`, raises at the next call naming the argument, the value and the
        range. Composites forward the call to the part that receives their input. The
        default checks nothing.
        """
        del x, path
        return ()

    def children(self) -> tuple[tuple[str, AbstractPart], ...]:
        """The direct child parts as `(name, part)` pairs, in forward order.

        `name` is what `compile` joins onto its own path for that child (`"parts[1]"`,
        `"branch"`, `"[3]"`), so `join_path(path, name)` is the child's path in errors and
        reports. A composite overrides this together with `replace_children`; the default,
        `()`, declares a leaf. Tools that rebuild a tree (the unfused baseline, exports) walk it
        through these two methods only, never through field names.
        """
        return ()

    def replace_children(self, children: Sequence[AbstractPart]) -> AbstractPart:
        """A copy of this part with its children replaced, in the order of `children()`.

        Its own configuration is kept and its `__init__` not re-run. A leaf accepts only `()`.
        """
        if tuple(children):
            raise TypeError(
                f"{type(self).__name__} declares no children (children() is empty) but was "
                f"given {len(tuple(children))}; a composite overrides children() and "
                "replace_children() together."
            )
        return self

    def unrolled(self) -> AbstractPart:
        """This part with any loop over its children written out (a `Repeat` that scans its
        blocks returns one that unrolls them: the same state layout and results, a program
        that grows with the number of blocks). The default returns the part itself."""
        return self

    def export_arrays(self, path: str = "") -> tuple[ExportRecord, ...]:
        """The part's current parameters as standard records, in forward order.

        Records are small named modules of arrays that another library can read without
        knowing the part type: `fusedpc.parts.LinearParams(weight (out, in), bias (out,) |
        None)` per affine map, `LayerNormParams(weight (D,), bias (D,))` per LayerNorm,
        `TableParams(table (V, D))` per lookup table. Parameter-free parts return `()`;
        a chain returns its children's records in order. `fusedpc.transformer.to_reference`
        reads every slot through this method, so a part type of your own exports by
        implementing it. The default raises a `TypeError` naming `path`.
        """
        raise TypeError(
            f"{display_path(path)}: {type(self).__name__} cannot export its arrays; implement "
            f"{type(self).__name__}.export_arrays(path) returning records such as "
            "fusedpc.parts.LinearParams."
        )


class ExportRecord(eqx.Module):
    """Base of the standard parameter records that `AbstractPart.export_arrays` returns.

    A record is a named module of arrays with a fixed meaning (`LinearParams`,
    `LayerNormParams`, `TableParams`); subclass it for a record of your own. Records used to
    be dicts; `record["weight"]` (deprecated in 0.3) is refused since 0.4.0 with a
    `TypeError` that names the field to read (`record.weight`).
    """

    def __getitem__(self, name: str) -> Any:
        fields = [f.name for f in dataclasses.fields(self)]
        raise TypeError(
            f"{type(self).__name__}[{name!r}]: the parameters are a named module; indexing was "
            f"removed in 0.4.0. Read {type(self).__name__}.{name if name in fields else fields[0]}"
            f" (fields: {', '.join(fields)})."
        )


class LinearParams(ExportRecord):
    """An affine map $y = x W^\\top + b$ in the layout of `eqx.nn.Linear`: `weight` `(out, in)`,
    `bias` `(out,)` or None. A frozen linear's parameters and the export record of any affine
    map (`AbstractPart.export_arrays`)."""

    weight: jax.Array
    bias: jax.Array | None


class LayerNormParams(ExportRecord):
    """A LayerNorm's affine $y = \\gamma \\odot \\hat n + \\beta$: `weight` $\\gamma$ and `bias`
    $\\beta$, each `(D,)` (None for a LayerNorm without that affine term). The parameters of the
    learning and the frozen LayerNorm (their `eps` is static configuration of the part) and its
    export record."""

    weight: jax.Array | None
    bias: jax.Array | None


class TableParams(ExportRecord):
    """A lookup table `(V, D)`, the layout of `eqx.nn.Embedding.weight`: a frozen embedding's
    parameters and the export record of any table."""

    table: jax.Array


def join_path(path: str, name: str) -> str:
    """`join_path("blocks[3]", "attention")` is `"blocks[3].attention"`; indices attach bare."""
    if not path:
        return name
    if name.startswith("["):
        return path + name
    return f"{path}.{name}"


def display_path(path: str) -> str:
    return path if path else "<root>"


def replace_fields(module: _M, **changes: Any) -> _M:
    """A copy of `module` with some fields replaced, without re-running its `__init__`."""
    names = {f.name for f in dataclasses.fields(module)}
    unknown = set(changes) - names
    if unknown:
        raise TypeError(f"{type(module).__name__} has no fields {sorted(unknown)}")
    new = object.__new__(type(module))
    for f in dataclasses.fields(module):
        object.__setattr__(new, f.name, changes.get(f.name, getattr(module, f.name)))
    return new
