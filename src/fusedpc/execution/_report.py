"""Reading a step's metrics on the host: which inner step, which part went non-finite."""

from __future__ import annotations

import jax
import numpy as np

from fusedpc.core._metrics import iter_metrics
from fusedpc.core._part import display_path
from fusedpc.execution._program import StepMetrics


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
