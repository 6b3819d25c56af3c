"""What a `FusedPipeline` tells about its run so far, read from its carry and the last call's
metrics on the host: the state and counters, the skip counts, the last loss, the report and
why a step was refused."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from fusedpc.core._metrics import iter_metrics, report_rows
from fusedpc.core._part import PyTree
from fusedpc.execution import _report
from fusedpc.execution._step_types import SKIP_REASONS, Counters, StepCarry, StepMetrics


class PipelineReadout:
    """The read-only side of `FusedPipeline` (its base): views of `_carry` and of `_last`,
    the last call's metrics, which the pipeline keeps."""

    _carry: StepCarry
    _last_stacked: bool
    nonfinite: str
    max_update_ratio: float | None
    loss_spike: float | None

    @property
    def _last(self) -> StepMetrics | None:  # the pipeline's own: its last call's metrics
        raise NotImplementedError

    @property
    def carry(self) -> StepCarry:
        """The current carry (state and counters) as `program.step` takes it: live buffers,
        donated (hence dead) at the next step."""
        return self._carry

    @property
    def state(self) -> PyTree:
        """The current state pytree (live buffers: donated, hence dead, at the next step)."""
        return self._carry.state

    @property
    def counters(self) -> Counters:
        """The current step counters (live buffers, donated at the next step)."""
        return self._carry.counters

    @property
    def steps(self) -> int:
        """Steps attempted so far (committed or skipped)."""
        return int(self._carry.counters.steps)

    @property
    def skipped_steps(self) -> int:
        """Steps not committed, for any reason (see `skip_counts`)."""
        return int(self._carry.counters.skipped)

    @property
    def skip_counts(self) -> dict[str, int]:
        """Steps not committed so far, by reason: `{"id out of range": n, "non-finite": n,
        "update ratio": n, "loss spike": n}`."""
        counts = np.asarray(self._carry.counters.skips).tolist()
        return dict(zip(SKIP_REASONS, (int(c) for c in counts), strict=True))

    @property
    def loss_mean(self) -> float | None:
        """The running mean of committed losses that `loss_spike` compares with (None
        before any)."""
        if int(self._carry.counters.loss_count) == 0:
            return None
        return float(self._carry.counters.loss_mean)

    @property
    def last_loss(self) -> float | None:
        """The loss of the last step (the last inner step of `run`), or None before any."""
        if self._last is None:
            return None
        return float(np.asarray(self._last.loss).reshape(-1)[-1])

    @property
    def last_metrics(self) -> StepMetrics | None:
        """The last call's metrics (stacked over K for `run`), still on device."""
        return self._last

    # ------------------------------------------------------------------ reports
    def report(self, index: int = -1) -> list[dict[str, Any]]:
        """One row per learning part for the last step (the `index`-th inner step of `run`).

        Each row: `part` (its path in the tree), `layer_sizes`, `update_norm`, `error_norm`,
        `weight_norm`, `update_ratio` (update / weight norm, the number to calibrate a part's
        learning rate by) and `finite`; a `fusedpc.Latent`'s row has its `energy` (and
        `energy_trajectory` when recorded), and a tree with latents ends with a
        `<relaxation>` row (`energy_before`, `energy_after`, `energy_trajectory`,
        `backprop_distance` as recorded). Empty before the first step.

        Raises:
            ValueError: the chosen inner step did not compute its report (`run`'s
                `report_every` / `report_at`).
        """
        if self._last is None:
            return []
        chosen = _report.select_step(jax.device_get(self._last), index)
        if chosen.reported is not None and not bool(np.asarray(chosen.reported)):
            raise ValueError(
                f"report(index={index}): that step of the last run computed no report (run's "
                "report_every / report_at); ask for a step that reported, e.g. the last "
                "(index=-1)."
            )
        rows = report_rows(chosen.parts)
        if getattr(chosen, "relaxation", None) is not None:
            rows.append(chosen.relaxation.row())
        return rows

    def nonfinite_part(self, index: int = -1) -> str | None:
        """The part where the last step's non-finite value first appeared (backward order),
        or None when the step was not refused as non-finite. The rule is the commit's own:
        a NaN, an infinity or a norm that overflows float32 (the report's `finite=False`).
        Under `"ignore"` it names the part although the step was committed."""
        if self._last is None:
            return None
        chosen = _report.select_step(self._last, index)
        if self.nonfinite == "ignore":
            bad = not all(bool(np.asarray(m.finite)) for _, m in iter_metrics(chosen.parts))
            leaves = jax.tree_util.tree_leaves(chosen.state_finite)
            if not bad and all(bool(np.asarray(ok)) for ok in leaves):
                return None
            return _report.first_nonfinite(self._last, index)
        code = int(np.asarray(chosen.skip_reason))
        if code != SKIP_REASONS.index("non-finite") + 1:
            return None
        return _report.first_nonfinite(self._last, index)

    def skip_reason(self, index: int = -1) -> _report.SkipReason | None:
        """Why the last step (the `index`-th inner step of `run`) was not committed: a
        `SkipReason(reason, part, message)`, or None when it was committed."""
        if self._last is None:
            return None
        return _report.skip_reason(
            self._last,
            index,
            max_update_ratio=self.max_update_ratio,
            loss_spike=self.loss_spike,
            stacked=self._last_stacked,
        )
