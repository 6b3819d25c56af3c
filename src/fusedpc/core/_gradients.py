"""Trace-time hooks on the gradients that learning parts hand to their optimisers.

Every fusedpc learning part that learns through an optax optimiser forms its gradient in its
backward walk and applies its optimiser there (`optax_step`). Two hooks, active while a step
is traced, let the executor act on all of those gradients at once without a change to the
part contract:

* `collect_gradient_squares()`: each optax step traced inside appends $\\lVert g \\rVert^2$ of its
  gradients (float32), so that the executor can form the global norm over every part;
* `clip_gradients(norm, max_norm)`: each optax step traced inside clips its gradients as
  `optax.clip_by_global_norm(max_norm)` would clip the whole gradient tree of global norm
  `norm`: $g \\leftarrow g$ when $\\lVert g \\rVert < $ `max_norm`, else $g / \\lVert g \\rVert
  \\cdot$ `max_norm`.

A part that runs its blocks inside `lax.scan` (`fusedpc.Repeat`) collects its blocks' squares
inside the scan body and reports their sum outside it (`add_gradient_square`), since values
traced in a scan body cannot leave it otherwise; a part of your own that scans over learning
parts does the same.

A third, `deferred_updates()`, lets an unrolled `Repeat` apply its blocks' optimisers once
over the stacked blocks instead of once per block: inside it, each optax step records its
gradients and hands back stand-ins for the new parameters and optimiser state, which the
`Repeat` replaces by rows of the stacked update (`DeferredUpdate`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from fusedpc.core._metrics import _current_trace

_SQUARES: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "fusedpc_gradient_squares", default=None
)
_CLIP: contextvars.ContextVar[tuple[Any, float] | None] = contextvars.ContextVar(
    "fusedpc_gradient_clip", default=None
)


@contextlib.contextmanager
def collect_gradient_squares() -> Iterator[list]:
    """Collect, at trace time, the squared gradient norm of every optax step inside."""
    squares: list = []
    token = _SQUARES.set(squares)
    try:
        yield squares
    finally:
        _SQUARES.reset(token)


def collecting_gradient_squares() -> bool:
    """Whether a `collect_gradient_squares` is active (a scanning part then reports)."""
    return _SQUARES.get() is not None


def add_gradient_square(square: jax.Array) -> None:
    """Report a squared gradient norm to the active collection (no-op without one)."""
    squares = _SQUARES.get()
    if squares is not None:
        squares.append(jnp.asarray(square, jnp.float32))


@contextlib.contextmanager
def clip_gradients(norm: jax.Array, max_norm: float) -> Iterator[None]:
    """Clip, at trace time, the gradients of every optax step inside by the global `norm`."""
    token = _CLIP.set((norm, float(max_norm)))
    try:
        yield
    finally:
        _CLIP.reset(token)


@dataclasses.dataclass(frozen=True)
class DeferredUpdate:
    """One optax step recorded by `deferred_updates`: what the step was asked
    (`apply(params, gradients, opt_state) -> (new_params, new_state)`, the optimiser's update
    applied to `params`; `optimiser` tells which steps may run together) and the stand-ins it
    handed back for the new parameters and state (zeros of the new values' shapes and dtypes,
    which must be replaced before the step's values are read)."""

    optimiser: Any
    apply: Callable[[Any, Any, Any], tuple[Any, Any]]
    params: Any
    gradients: Any
    opt_state: Any
    new_params: Any
    new_state: Any


_DEFERRING: list[tuple[list[DeferredUpdate], Any]] = []  # (records, the trace they belong to)


@contextlib.contextmanager
def deferred_updates() -> Iterator[list[DeferredUpdate]]:
    """Record, instead of applying, the optax steps traced inside (in this trace only: a step
    traced inside a `lax.scan` body or a `lax.cond` branch is applied as usual). Each gets a
    `DeferredUpdate` in the yielded list, in the order they were traced; the caller must
    compute every recorded step and put the results where the stand-ins went."""
    records: list[DeferredUpdate] = []
    _DEFERRING.append((records, _current_trace()))
    try:
        yield records
    finally:
        _DEFERRING.pop()


def deferring() -> list[DeferredUpdate] | None:
    """The active `deferred_updates` records, or `None` (none active, or another trace)."""
    if not _DEFERRING:
        return None
    records, trace = _DEFERRING[-1]
    return records if trace is _current_trace() else None


def hook_gradients(gradients: Any) -> Any:
    """What an optax step calls on its gradients: reports their squared norm to an active
    collection and clips them under an active `clip_gradients`."""
    leaves = [g for g in jax.tree_util.tree_leaves(gradients) if g is not None]
    if _SQUARES.get() is not None and leaves:
        squares = [jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves]
        add_gradient_square(jnp.sum(jnp.stack(squares)))
    clip = _CLIP.get()
    if clip is None:
        return gradients
    norm, max_norm = clip

    def clipped(g):
        # optax.clip_by_global_norm's own formula: t unchanged below the bound, else
        # t / norm * max_norm
        n = norm.astype(g.dtype)
        return jnp.where(norm < max_norm, g, g / n * jnp.asarray(max_norm, g.dtype))

    return jax.tree_util.tree_map(clipped, gradients)


__all__ = [
    "DeferredUpdate",
    "add_gradient_square",
    "clip_gradients",
    "collect_gradient_squares",
    "collecting_gradient_squares",
    "deferred_updates",
    "deferring",
    "hook_gradients",
]
