"""What the pipeline's host side does around each call of a compiled program: the garbage
collector paused while a program is traced and first run, trees held as leaves (`_Flat`), the
metrics' structure carried in the program's outputs (`_Traced`), and `run`'s report flags."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@contextlib.contextmanager
def collection_paused(pause: bool = True) -> Iterator[None]:
    """Python's cyclic garbage collector held off inside (when `pause`), as it was after.

    Tracing and lowering a GPT's step makes hundreds of thousands of Python objects, enough
    to start a full collection over everything the process holds (JAX's own caches
    included) in the middle of the first step: about a fifth of the trace's time at config
    S. The pipeline pauses it while it traces a program and during the first call of each
    (which lowers and compiles it); the garbage made meanwhile is collected afterwards as
    usual."""
    if not pause or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def report_flags(steps: int, report_every: int | None, report_at: Any) -> Any:
    """`run`'s per-step report flags (`None`: every step reports), checked."""
    if report_every is not None and report_at is not None:
        raise ValueError("run: give report_every or report_at, not both.")
    if report_every is not None:
        if isinstance(report_every, bool) or not isinstance(report_every, int | np.integer) \
                or report_every < 1:
            raise ValueError(f"report_every: expected an int >= 1, got {report_every!r}.")
        if report_every == 1:
            return None
        flags = (np.arange(steps) + 1) % int(report_every) == 0
    elif report_at is not None:
        flags = np.asarray(report_at)
        if flags.shape != (steps,) or flags.dtype != bool:
            raise ValueError(
                f"report_at: expected {steps} booleans (one per step of xs), got an array "
                f"of shape {flags.shape} and dtype {flags.dtype}."
            )
        flags = flags.copy()
    else:
        return None
    flags[-1] = True  # the last step always reports: report() reads it
    return flags


@jax.tree_util.register_pytree_node_class
class Traced:
    """A step program's metrics as leaves, with their structure and one step's output shape
    as the node's static data: what the trace of a new batch signature reads off the
    program's outputs (`jax.jit(...).trace(...).out_info`), and what every call returns
    (the static data come back unchanged, for free)."""

    __slots__ = ("leaves", "structure", "output")

    def __init__(self, leaves: list, structure: Any, output: jax.ShapeDtypeStruct):
        self.leaves, self.structure, self.output = list(leaves), structure, output

    def tree_flatten(self) -> tuple[tuple, tuple]:
        return tuple(self.leaves), (self.structure, self.output)

    @classmethod
    def tree_unflatten(cls, static: tuple, leaves: tuple) -> Traced:
        return cls(list(leaves), *static)


@jax.tree_util.register_pytree_node_class
class WithOutputShape:
    """A step's metrics with the step's output shape as static data: what `run`'s scan body
    hands out, so that the shape of one step's output survives `keep_outputs=False` (the
    scan stacks `metrics`; the static data pass through unchanged)."""

    __slots__ = ("metrics", "output")

    def __init__(self, metrics: Any, output: jax.ShapeDtypeStruct):
        self.metrics, self.output = metrics, output

    def tree_flatten(self) -> tuple[tuple, jax.ShapeDtypeStruct]:
        return (self.metrics,), self.output

    @classmethod
    def tree_unflatten(cls, output: jax.ShapeDtypeStruct, children: tuple) -> WithOutputShape:
        return cls(children[0], output)


def shape_of(output: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(output), jnp.result_type(output))


class Flat:
    """A pytree held as its treedef and leaves, rebuilt into the tree only when read (and
    then once: `tree` is kept until the leaves are replaced)."""

    __slots__ = ("structure", "leaves", "_tree")

    def __init__(self, structure: Any, leaves: list):
        self.structure = structure
        self.leaves = list(leaves)
        self._tree: Any = None

    @classmethod
    def of(cls, tree: Any) -> Flat:
        leaves, structure = jax.tree_util.tree_flatten(tree)
        flat = cls(structure, leaves)
        flat._tree = tree
        return flat

    def rebuild(self, leaves: list) -> Any:
        """This structure with other leaves (tracers, inside a trace)."""
        return jax.tree_util.tree_unflatten(self.structure, leaves)

    def replaced(self, leaves: list) -> Flat:
        return Flat(self.structure, leaves)

    @property
    def tree(self) -> Any:
        if self._tree is None:
            self._tree = jax.tree_util.tree_unflatten(self.structure, self.leaves)
        return self._tree
