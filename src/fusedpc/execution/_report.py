"""Reading a step's metrics on the host: which inner step, which part went non-finite."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from fusedpc.core._metrics import iter_metrics, report_rows
from fusedpc.core._part import display_path
from fusedpc.execution._step_types import (
    SKIP_REASONS,
    StepMetrics,
)


def select_step(metrics: StepMetrics, index: int) -> StepMetrics:
    """The `index`-th inner step of `run`'s stacked metrics (a `step`'s metrics as they are).

    Raises:
        IndexError: `index` is not an inner step of the last call, `[-K, K)` for `run`'s K
            steps and `[-1, 1)` for a `step` (JAX would clamp it to another step).
    """
    steps = 1 if np.ndim(metrics.committed) == 0 else int(np.shape(metrics.committed)[0])
    if isinstance(index, bool) or not isinstance(index, int | np.integer):
        raise TypeError(f"index: expected an integer inner step, got {index!r}.")
    if not -steps <= index < steps:
        raise IndexError(
            f"index: the last call ran {steps} step(s), so the inner step must lie in "
            f"[{-steps}, {steps}), got {index}."
        )
    if np.ndim(metrics.committed) == 0:
        return metrics
    return jax.tree_util.tree_map(lambda a: a[index], metrics)


def first_nonfinite(metrics: StepMetrics, index: int = -1) -> str | None:
    """The first part, in backward order, whose update or emitted error was non-finite.

    When no part flagged its update or error (an optimiser's moment estimate overflowed,
    say), the last non-finite state leaf in tree order, by its key path
    (`"parts[0].opt_state[0].nu.weights[1]"`, which starts with the part's path); when no
    leaf either, and the step was not committed, `"<root>"` (the tree's output or input
    error)."""
    chosen = select_step(metrics, index)
    bad = [path for path, m in iter_metrics(chosen.parts) if not bool(np.asarray(m.finite))]
    if bad:
        return display_path(bad[-1])
    leaves = [
        path
        for path, ok in jax.tree_util.tree_leaves_with_path(chosen.state_finite)
        if not bool(np.asarray(ok))
    ]
    if leaves:
        return jax.tree_util.keystr(leaves[-1]).lstrip(".")
    if not bool(np.asarray(chosen.committed)):
        return display_path("")
    return None


class SkipReason(NamedTuple):
    """Why a step was not committed.

    Attributes:
        reason: `"token id out of range"` / `"class id out of range"`, `"invalid mask"`,
            `"non-finite"`, `"update ratio"` or `"loss spike"`.
        part: the part it names (`"<root>"` for the tree's output or loss, None for a mask
            or a loss spike, which belong to no part).
        message: one line for logs and errors: what was seen against what was allowed.
    """

    reason: str
    part: str | None
    message: str


def skip_reason(
    metrics: StepMetrics,
    index: int = -1,
    *,
    max_update_ratio: float | None = None,
    loss_spike: float | None = None,
    stacked: bool = False,
) -> SkipReason | None:
    """Why the `index`-th inner step was not committed, or None when it was.

    `max_update_ratio` and `loss_spike` are the guards' settings (for the message);
    `stacked` says that the arguments were `run`'s `xs`/`targets`."""
    chosen = jax.device_get(select_step(metrics, index))
    code = int(np.asarray(chosen.skip_reason)) if chosen.skip_reason is not None else 0
    if code == 0:
        if bool(np.asarray(chosen.committed)):
            return None
        code = SKIP_REASONS.index("non-finite") + 1  # metrics without a reason code
    reason = SKIP_REASONS[code - 1]
    if reason == "id out of range":
        for check in chosen.input_checks:
            if not bool(np.asarray(check.ok)):
                argument = check.argument + ("s" if stacked else "")
                kind = check.what.removesuffix("s").replace(" ids", " id")
                return SkipReason(
                    f"{kind} out of range", display_path(check.path), check.message(argument)
                )
        return SkipReason("id out of range", None, "an input id was out of range.")
    if reason == "invalid mask":
        argument = "masks" if stacked else "mask"
        message = (chosen.mask_check.message(argument) if chosen.mask_check is not None
                   else f"{argument}: the mask was refused.")
        return SkipReason(reason, None, message)
    if reason == "non-finite":
        part = first_nonfinite(metrics, index)
        return SkipReason(
            reason, part, f"a value that float32 cannot represent appeared first in {part!r}."
        )
    if reason == "update ratio":
        rows = [r for r in report_rows(chosen.parts) if "update_ratio" in r]
        worst = max(rows, key=lambda r: _ratio_key(r["update_ratio"]), default=None)
        part = None if worst is None else worst["part"]
        ratio = float("nan") if worst is None else worst["update_ratio"]
        return SkipReason(
            reason,
            part,
            f"part {part!r} had update / weight norm {ratio:.3g}, above max_update_ratio "
            f"{max_update_ratio}.",
        )
    loss, mean = float(np.asarray(chosen.loss)), float(np.asarray(chosen.loss_mean))
    return SkipReason(
        reason,
        None,
        f"loss {loss:.4g} exceeded loss_spike {loss_spike} times the running mean {mean:.4g}.",
    )


def nonfinite_advice(metrics: StepMetrics, index: int = -1) -> str:
    """What a user can do about a non-finite step, by what `first_nonfinite` names: a part
    that learns (its report row has an update) or a state leaf (only learning parts change
    theirs) has a learning rate to lower; a frozen part has none; `<root>` is the output,
    input error or loss."""
    chosen = jax.device_get(select_step(metrics, index))
    flagged = [m for _, m in iter_metrics(chosen.parts) if not bool(np.asarray(m.finite))]
    if flagged:
        learns = any("update_norm" in row for row in flagged[-1].rows(""))
    else:
        learns = not all(bool(np.asarray(ok))
                         for ok in jax.tree_util.tree_leaves(chosen.state_finite))
    if learns:
        return "Lower that part's learning rate or check its inputs."
    if not flagged:
        return ("The tree's output, its input error or the loss was not finite: check the "
                "batch (inputs and targets) and the error function.")
    return ("That part is frozen (it has no learning rate): its formula met values beyond "
            "float32. Check the batch, or bound the steps of the learning parts around it "
            "(lower their learning rates, or set clip_global_norm or max_update_ratio).")


def _ratio_key(ratio: float) -> float:
    return float("inf") if np.isnan(ratio) else ratio
