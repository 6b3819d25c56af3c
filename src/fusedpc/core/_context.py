"""The step context: what a step tells every part it traces, passed as an argument.

The executor builds one `StepContext` per traced step and hands it to the root part's
`forward(state, x, ctx)` and `backward(state, cache, error, ctx)`; a composite hands it on to
its children, and a part that traces its children in a trace of its own (a `lax.scan` body, a
`lax.cond` branch) hands them `ctx.for_inner_trace()`. Nothing else carries the step's
settings: there is no global state to set or forget.

It holds the compute dtype, the scale a row mask put on the output error, whether the step
computes its report norms, the step's norm collection (`Measured`), the hook on optimiser
gradients (global clipping) and the sink for deferred optimiser steps (a `Repeat`'s stacked
step). A part reads them through its methods, which do the right thing for every setting:

* precision: `ctx.to_compute(x)`, `ctx.matmul(a, b)`, `ctx.matmul_accumulate(a, b)`,
  `ctx.einsum(spec, a, b)`, `ctx.weight_gradient(e, a)`;
* learning: `ctx.optimiser_step(optimiser, params, gradients, opt_state)`;
* reporting: `ctx.learning_metrics(old, new, error, input_error, layer_sizes)`.

`StepContext()` is the plain context (float32, report norms measured at once, no clipping):
what `check_backward`, `as_module` and a hand-run core use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc._deprecation import warn_deprecated
from fusedpc.core import _precision
from fusedpc.core._gradients import DeferredUpdate, GradientHook, optimiser_step
from fusedpc.core._measured import Measured, PendingFinite, PendingNorm
from fusedpc.core._metrics import PartMetrics
from fusedpc.core._norms import tree_norms
from fusedpc.core._part import PyTree


@dataclasses.dataclass(frozen=True, eq=False)
class StepContext:
    """What one traced step tells its parts (immutable; `replace` makes a changed copy).

    Attributes:
        compute_dtype: `None` (float32) or `"bfloat16"`: the dtype of activations, caches,
            errors between parts and the operands of matrix products (`ctx.matmul`).
        error_scale: the scalar $s$ by which the executor scaled the output error (with a row
            mask: $R / \\sum_r w_r$, the error handed to the tree being $E_r w_r s$), or None
            when it did not scale it. A part whose step is linear in its error ignores it; a
            part that relaxes on its error (iterative inference) undoes it before its
            non-linear work and applies it to what it hands on and learns from.
        detailed: whether the step computes its parts' report norms (`False`: `run`'s steps
            between reports; `ctx.learning_metrics` then gives NaN norms).
        measured: the step's norm collection, or None (norms measured at once). Belongs to
            the trace it was made in: `for_inner_trace` drops it.
        gradients: the hook on every optimiser step's gradients (`GradientHook`), or None.
        deferred: a list that records optimiser steps instead of applying them
            (`DeferredUpdate`), or None. Belongs to the trace it was made in.
        learning: whether the walk is a learning step (True) or a pullback that does not
            learn (False): the whole-tree relaxation's sweeps ask every part only for the
            error at its input, and discard the new states. `ctx.optimiser_step` then
            returns the parameters and optimiser state unchanged; a part that learns
            without it may skip its update or not (its new state is not read), and a
            `fusedpc.Latent` hands back its latent's energy gradient instead.
    """

    compute_dtype: str | None = None
    error_scale: jax.Array | None = None
    detailed: bool = True
    measured: Measured | None = None
    gradients: GradientHook | None = None
    deferred: list[DeferredUpdate] | None = None
    learning: bool = True

    def replace(self, **changes: Any) -> StepContext:
        """A copy with some fields changed (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    def for_inner_trace(self) -> StepContext:
        """The context for parts traced in a trace of their own (a `lax.scan` body, a
        `lax.cond` branch): the same settings, without the step's norm collection, gradient
        collection and deferred-update sink, whose values must stay in the trace they were
        made in. A part that wants them there opens its own (`measured=Measured()`,
        `GradientHook(squares=[])`) and hands their results out of the inner trace."""
        hook = None if self.gradients is None else self.gradients.without_squares()
        return dataclasses.replace(self, measured=None, gradients=hook, deferred=None)

    @property
    def collecting_gradient_squares(self) -> bool:
        """Whether the step collects every optimiser step's squared gradient norm."""
        return self.gradients is not None and self.gradients.collecting

    # -- precision ---------------------------------------------------------------------

    def to_compute(self, x: Any) -> Any:
        """A floating array in the compute dtype (unchanged in float32, and for integers)."""
        return _precision.to_compute(x, self.compute_dtype)

    def matmul(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """`a @ b`, in the compute dtype (accumulated in float32, rounded to it)."""
        return _precision.matmul(a, b, self.compute_dtype)

    def matmul_accumulate(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """`a @ b` kept in float32 (a weight gradient), operands in the compute dtype."""
        return _precision.matmul_accumulate(a, b, self.compute_dtype)

    def einsum(self, spec: str, a: jax.Array, b: jax.Array, *,
               accumulate: bool = False) -> jax.Array:
        """`jnp.einsum(spec, a, b)` under the rule of `matmul` (`accumulate`: of
        `matmul_accumulate`)."""
        return _precision.einsum(spec, a, b, accumulate=accumulate, dtype=self.compute_dtype)

    def weight_gradient(self, errors: jax.Array, inputs: jax.Array) -> jax.Array:
        """$E^\\top A$ over rows, `(R, out)` and `(R, in)` to `(out, in)`, in float32."""
        return _precision.weight_gradient(errors, inputs, self.compute_dtype)

    # -- learning ----------------------------------------------------------------------

    def optimiser_step(self, optimiser: Any, params: Any, gradients: Any,
                       opt_state: Any) -> tuple[Any, Any]:
        """`(new_params, new_opt_state)`: the optax optimiser's step on the descent
        `gradients`, with what the step asks of them (global clipping) done first; inside
        a deferred-update sink the step is recorded and stand-ins come back, which the
        sink's owner replaces (so put them only in the new state and the report). In a
        pullback that does not learn (`learning=False`) nothing is stepped: `params` and
        `opt_state` come back as they are."""
        if not self.learning:
            return params, opt_state
        return optimiser_step(optimiser, params, gradients, opt_state,
                              self.gradients, self.deferred)

    # -- reporting ---------------------------------------------------------------------

    def learning_metrics(self, old_params: PyTree, new_params: PyTree, error: jax.Array,
                         input_error: Any, layer_sizes: Sequence[int]) -> PartMetrics:
        """The standard report of a learning part: norms of the update, error and weights,
        and `finite` (read off those norms: it names the part in reports; whether the step
        commits is the executor's own check of the whole new state).

        With the step's norm collection (`measured`) the norms are `PendingNorm` /
        `PendingFinite` nodes that the step measures together with every other part's at
        its end: read them only from the step's output. Without it they are measured at
        once; without `detailed` they are NaN and `finite` is true."""
        sizes = tuple(int(s) for s in layer_sizes)
        if not self.detailed:
            unmeasured = jnp.full((), jnp.nan, jnp.float32)
            return PartMetrics(update_norm=unmeasured, error_norm=unmeasured,
                               weight_norm=unmeasured, finite=jnp.array(True),
                               layer_sizes=sizes)
        measured = self.measured
        if measured is not None:
            update = measured.add_difference(new_params, old_params)
            weight = measured.add(new_params)
            checked = [update, weight]
            if input_error is not None:
                checked.append(measured.add(input_error))
            return PartMetrics(
                update_norm=PendingNorm(np.int32(update)),  # type: ignore[arg-type]
                error_norm=PendingNorm(np.int32(measured.add(error))),  # type: ignore[arg-type]
                weight_norm=PendingNorm(np.int32(weight)),  # type: ignore[arg-type]
                finite=PendingFinite(np.asarray(checked, np.int32)),  # type: ignore[arg-type]
                layer_sizes=sizes,
            )
        update = jax.tree_util.tree_map(lambda n, o: n - o, new_params, old_params)
        update_norm, weight_norm, error_norm, input_error_norm = tree_norms(
            update, new_params, error, input_error)
        finite = jnp.isfinite(update_norm) & jnp.isfinite(weight_norm)
        if input_error is not None:
            finite = finite & jnp.isfinite(input_error_norm)
        return PartMetrics(update_norm=update_norm, error_norm=error_norm,
                           weight_norm=weight_norm, finite=finite, layer_sizes=sizes)


def learning_metrics(old_params: PyTree, new_params: PyTree, error: jax.Array,
                     input_error: Any, layer_sizes: Sequence[int], *,
                     ctx: StepContext | None = None,
                     measure_later: bool | None = None) -> PartMetrics:
    """`ctx.learning_metrics(...)` (the plain context when `ctx` is None: measured at once).
    `measure_later` is deprecated and ignored: the context says whether the step measures
    its norms together."""
    if measure_later is not None:
        warn_deprecated("learning_metrics(..., measure_later=...) is deprecated: pass the "
                        "step context (ctx=ctx), which says whether the step measures its "
                        "norms together")
    context = StepContext() if ctx is None else ctx
    return context.learning_metrics(old_params, new_params, error, input_error, layer_sizes)


def row_mask_scale(weights: jax.Array) -> jax.Array:
    """The `error_scale` of a row mask of weights `weights`: $R / \\sum_r w_r$, or 1 where no
    row is real (or the sum is not finite)."""
    scale = jnp.asarray(weights.size / jnp.sum(weights), jnp.float32)
    return jnp.where(jnp.isfinite(scale) & (scale > 0), scale, jnp.ones_like(scale))


__all__ = ["StepContext", "learning_metrics", "row_mask_scale"]
