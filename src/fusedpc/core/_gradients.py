"""What the step does to the gradients a part hands to its optimiser, and the optimiser step
itself (`optimiser_step`), as the step context carries them.

A part that learns through an optax optimiser forms its gradient in its backward walk and
calls `ctx.optimiser_step(optimiser, params, gradients, opt_state)` (the step context's
method, which calls `optimiser_step` here). Through the context the executor then acts on
every such gradient at once:

* `GradientHook(squares=[])` collects $\\lVert g \\rVert^2$ of each (float32), so that the
  executor forms the global norm over every part;
* `GradientHook(clip_norm=n, max_norm=c)` clips each as `optax.clip_by_global_norm(c)` clips
  a whole gradient tree of global norm `n`: $g \\leftarrow g$ when $n < c$, else $g / n
  \\cdot c$;
* a deferred-update sink (`StepContext.deferred`, a list) records the step instead of
  applying it (`DeferredUpdate`) and hands back stand-ins for the new parameters and state:
  an unrolled `Repeat` then applies its blocks' optimisers once over the stacked blocks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True, eq=False)
class GradientHook:
    """What the step asks of every optimiser step's gradients (see the module docstring).

    Attributes:
        squares: a list to which each optimiser step appends $\\lVert g \\rVert^2$ of its
            gradients (float32), or None.
        clip_norm: the global norm to clip by (a traced scalar), or None.
        max_norm: the bound `c` of the clipping (with `clip_norm`).
    """

    squares: list[jax.Array] | None = None
    clip_norm: jax.Array | None = None
    max_norm: float | None = None

    @property
    def collecting(self) -> bool:
        """Whether gradient squares are collected (a part that scans its children then
        collects theirs inside the scan body and adds the sum: `add_square`)."""
        return self.squares is not None

    def add_square(self, square: jax.Array) -> None:
        """Add a squared gradient norm to the collection (no-op without one)."""
        if self.squares is not None:
            self.squares.append(jnp.asarray(square, jnp.float32))

    def collecting_into(self, squares: list[jax.Array]) -> GradientHook:
        """This hook with its squared norms appended to `squares` (a trace's own list)."""
        return dataclasses.replace(self, squares=squares)

    def without_squares(self) -> GradientHook:
        """This hook for a trace of its own (a scan body): the clipping kept, no collection
        (values of an inner trace cannot join the outer trace's list)."""
        return dataclasses.replace(self, squares=None)

    def __call__(self, gradients: Any) -> Any:
        """The gradients as the optimiser gets them: their squared norm collected, clipped
        by the global norm where asked."""
        leaves = [g for g in jax.tree_util.tree_leaves(gradients) if g is not None]
        if self.squares is not None and leaves:
            squares = [jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves]
            self.add_square(jnp.sum(jnp.stack(squares)))
        if self.clip_norm is None:
            return gradients
        norm, max_norm = self.clip_norm, float(self.max_norm)  # type: ignore[arg-type]

        def clipped(g):
            # optax.clip_by_global_norm's own formula: t unchanged below the bound, else
            # t / norm * max_norm
            n = norm.astype(g.dtype)
            return jnp.where(norm < max_norm, g, g / n * jnp.asarray(max_norm, g.dtype))

        return jax.tree_util.tree_map(clipped, gradients)


@dataclasses.dataclass(frozen=True, eq=False)
class DeferredUpdate:
    """One optimiser step recorded in a deferred-update sink: what the step was asked
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


def optimiser_step(optimiser: Any, params: Any, gradients: Any, opt_state: Any,
                   hook: GradientHook | None = None,
                   deferred: list[DeferredUpdate] | None = None) -> tuple[Any, Any]:
    """`updates, s' = opt.update(G, s, params)`; `params + updates` (descent gradients), with
    the gradients handed through `hook` first. With a `deferred` sink the step is recorded
    there instead and stand-ins are returned (zeros of the new parameters' and state's shapes
    and dtypes: an optax update keeps its state's structure, and `apply_updates` the
    parameters'), which the sink's owner replaces."""
    if hook is not None:
        gradients = hook(gradients)
    if deferred is None:
        return apply_optax(optimiser, params, gradients, opt_state)

    def stand_in(x):
        return jnp.zeros(jnp.shape(x), jnp.result_type(x)) if _is_array(x) else x

    record = DeferredUpdate(optimiser, functools.partial(apply_optax, optimiser),
                            params, gradients, opt_state,
                            jax.tree_util.tree_map(stand_in, params),
                            jax.tree_util.tree_map(stand_in, opt_state))
    deferred.append(record)
    return record.new_params, record.new_state


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def apply_optax(optimiser: Any, params: Any, gradients: Any, opt_state: Any) -> tuple[Any, Any]:
    """The optimiser's update applied to `params`, never deferred.

    Runs under standard dtype promotion: optax mixes Python floats with integer step counts,
    which a caller's strict promotion setting would otherwise reject."""
    with jax.numpy_dtype_promotion("standard"):
        try:
            updates, opt_state = optimiser.update(gradients, opt_state, params)
        except TypeError as err:
            if "keyword-only argument" not in str(err) or "'value'" not in str(err):
                raise
            raise TypeError(
                "optimiser: this optax optimiser needs the loss value at each update "
                f"({err}); optax.contrib.reduce_on_plateau and optax.lbfgs are such. A "
                "part's local learning step has no loss of its own to pass, so they cannot "
                "run here: use a schedule (fusedpc.training.learning_rate_schedule) instead "
                "of reduce_on_plateau, and a first-order optimiser instead of lbfgs."
            ) from None
    return optax.apply_updates(params, updates), opt_state


__all__ = ["DeferredUpdate", "GradientHook", "apply_optax", "optimiser_step"]
