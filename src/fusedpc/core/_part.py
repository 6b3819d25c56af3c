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
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax

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




