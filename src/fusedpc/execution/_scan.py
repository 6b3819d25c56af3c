"""The scan of K steps in one program and the update-ratio reading of the guard."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from fusedpc.core._metrics import metric_leaves
from fusedpc.core._part import PyTree
from fusedpc.execution._step_types import StepOutput


def max_update_ratio(parts: PyTree) -> jax.Array:
    """The largest update / weight norm ratio over every learning part (the report's
    `update_ratio`); 0 without learning parts. A part with zero weights counts as infinite
    when it moved and as 0 when it did not."""
    ratios = [jnp.max(ratio) for m in metric_leaves(parts)
              if (ratio := m.update_ratios()) is not None]
    if not ratios:
        return jnp.zeros((), jnp.float32)
    return jnp.max(jnp.stack(ratios))


def scan_steps(
    step: Callable,
    carry: Any,
    xs: Any,
    targets: Any,
    keep_outputs: bool = True,
    masks: Any = None,
    report_at: Any = None,
) -> tuple[Any, StepOutput]:
    """K applications of `step(carry, x, target, mask, detailed) -> (carry, StepOutput)` in
    one `lax.scan` over the leading axis of `xs`, `targets` (and `masks`); outputs and
    metrics stacked over K. With `report_at` (K booleans) each step is traced twice, with
    and without its report norms, and `lax.cond` runs the one that step asks for."""

    def trim(out: StepOutput) -> StepOutput:
        return out if keep_outputs else StepOutput(None, None, out.metrics)

    def body(c, batch):
        if report_at is None:
            c, out = step(c, *batch)
            return c, trim(out)
        *batch, flag = batch
        mask = batch[2] if len(batch) == 3 else None

        def detailed(operands):
            c_, b_ = operands
            new, out = step(c_, b_[0], b_[1], mask, detailed=True)
            return new, trim(out)

        def light(operands):
            c_, b_ = operands
            new, out = step(c_, b_[0], b_[1], mask, detailed=False)
            return new, trim(out)

        return jax.lax.cond(flag, detailed, light, (c, tuple(batch[:2])))

    batches: tuple = (xs, targets) if masks is None else (xs, targets, masks)
    if report_at is not None:
        batches = (*batches, jnp.asarray(report_at, bool))
    return jax.lax.scan(body, carry, batches)


__all__ = ["max_update_ratio", "scan_steps"]
