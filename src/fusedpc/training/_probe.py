"""Calibration by probes: short trial runs from the current state, each with one group's
rate scaled, keeping what lowers the held-out loss.

This is the calibration method the study in docs/calibration.md supports (the rule of
thumb that brings every part's update/weight ratio to $10^{-3}$ makes training worse with
Adam; rebalancing the parts alone never helped). `probe_rates(pipeline, xs, ys)`:

1. saves the pipeline's state and counters;
2. runs the **baseline** trial: the next $P$ batches `xs`, `ys` from the saved state at the
   current multipliers;
3. **global** trials: every group's multiplier times each of `global_factors` (0.5 and 2)
   at once; the best of them and the baseline becomes the new base (the study found
   most of the gain in the global rate);
4. **per-group** trials: for each group $g$ and each factor $f$ in `factors` (0.5 and 2),
   the base with $g$'s multiplier times $f$: $2|G|$ trials;
5. keeps for each group the factor with the lowest score (1 included), then runs the
   **combined** choice once more; if it does not beat the base, the single best trial's
   change is kept instead, and if none beat the base, the base stays;
6. restores the saved state and counters exactly, and returns the choice with every trial's
   score (`ProbeResult`); it does not apply it (`set_rate_multipliers` does).

$1 + |F_{global}| + 2|G| + 1$ trials at most: 16 for a GPT's six slots; one calibration
changes a rate by x0.25 to x4 at most.

A trial's **score** is the mean loss over the last `score_fraction` of its steps. Each
step's loss is measured on its batch before that batch updates the weights, so the score is
a held-out loss of the model as the trial trains it (no validation data is used), and every
trial sees the same batches. A trial with a non-finite loss or a refused step scores
infinity. The probes consume no data position: the run continues on the same batches
afterwards.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.training._rates import gpt_slot, rate_multipliers, set_rate_multipliers

__all__ = [
    "GLOBAL_FACTORS",
    "PROBE_FACTORS",
    "ProbeResult",
    "ProbeTrial",
    "choose_factors",
    "probe_rates",
]

PROBE_FACTORS = (0.5, 2.0)
"""The factors each group's rate is tried at, besides 1."""

GLOBAL_FACTORS = (0.5, 2.0)
"""The factors every group's rate is tried at together first, besides 1."""


@dataclasses.dataclass(frozen=True)
class ProbeTrial:
    """One trial: the multipliers it ran at (every group's, absolute) and its score."""

    multipliers: dict[str, float]
    score: float
    label: str


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What `probe_rates` found.

    `before` and `multipliers` are every group's multiplier before and as chosen;
    `baseline` is the score at `before`, `score` the chosen multipliers' score (equal to
    `baseline` when nothing changed); `trials` every trial in the order run; `steps` the
    training steps the trials ran in all."""

    before: dict[str, float]
    multipliers: dict[str, float]
    baseline: float
    score: float
    trials: tuple[ProbeTrial, ...]
    steps: int

    @property
    def changed(self) -> dict[str, float]:
        """The groups whose multiplier changed, with its factor against `before`."""
        return {
            g: m / self.before[g] for g, m in self.multipliers.items() if m != self.before[g]
        }

    @property
    def gain(self) -> float:
        """`baseline - score`: how much lower the chosen multipliers' score is (>= 0)."""
        return self.baseline - self.score

    def record(self) -> dict[str, Any]:
        """A JSON-ready dict of the result (the `calibration` record of a run's log)."""
        return {
            "method": "probe",
            "before": self.before,
            "multipliers": self.multipliers,
            "changed": self.changed,
            "baseline": self.baseline,
            "score": self.score,
            "gain": self.gain,
            "probe_steps": self.steps,
            "trials": [
                {"label": t.label, "multipliers": t.multipliers, "score": t.score}
                for t in self.trials
            ],
        }


def choose_factors(
    baseline: float,
    scores: dict[str, dict[float, float]],
) -> dict[str, float]:
    """Per group, the factor whose score is lowest, 1 (the baseline) included; non-finite
    scores never win. `scores` is `{group: {factor: score}}`; groups that keep 1 are left
    out of the result. Ties keep 1, then the smaller factor."""
    chosen = {}
    for g, by_factor in scores.items():
        best, best_score = 1.0, baseline if math.isfinite(baseline) else math.inf
        for f in sorted(by_factor):
            s = by_factor[f]
            if math.isfinite(s) and s < best_score:
                best, best_score = f, s
        if best != 1.0:
            chosen[g] = best
    return chosen


def _score(losses: np.ndarray, committed: np.ndarray, fraction: float) -> float:
    if not (np.all(committed) and np.all(np.isfinite(losses))):
        return math.inf
    tail = max(1, int(round(len(losses) * fraction)))
    return float(np.mean(losses[-tail:]))


def probe_rates(
    pipeline: Any,
    xs: Any,
    ys: Any,
    *,
    groups: Sequence[str] | None = None,
    factors: Sequence[float] = PROBE_FACTORS,
    global_factors: Sequence[float] = GLOBAL_FACTORS,
    per_call: int | None = None,
    score_fraction: float = 0.5,
    group: Callable[[str], str | None] = gpt_slot,
) -> ProbeResult:
    """Probe each group's rate at `factors` from the pipeline's current state (see the
    module's description) and return the choice; the pipeline is left as it was.

    Args:
        pipeline: a `FusedPipeline` whose optimisers carry rate multipliers
            (`with_rate_multiplier`).
        xs, ys: the trials' batches, `(P, batch...)` each: the P training batches that come
            next (every trial runs all P).
        groups: the groups to probe, in order; every group with a multiplier by default.
        factors: the factors tried per group, besides 1.
        global_factors: the factors tried for every group at once first, besides 1; `()`
            skips this stage (with a single group it is skipped: the per-group trials are
            the same).
        per_call: steps per compiled `run` call (use the run's own `steps_per_call` so that
            the trials reuse its program); all P in one call by default.
        score_fraction: the share of each trial's last steps whose mean loss is its score.
        group: a state path -> its group (a GPT's slots by default).

    Raises:
        ValueError: when the state has no rate multiplier, a named group has none, or the
            arguments are out of range (each named in the message).
    """
    before = rate_multipliers(pipeline.state, group)
    if not before:
        raise ValueError(
            "probe_rates: the pipeline's optimisers carry no rate multiplier; build them with "
            "fusedpc.training.with_rate_multiplier (fusedpc train does with --calibrate)."
        )
    groups = tuple(before) if groups is None else tuple(groups)
    unknown = sorted(set(groups) - set(before))
    if unknown:
        raise ValueError(
            f"groups: {unknown} carry no rate multiplier; the state has {list(before)}."
        )
    for name, values in (("factors", factors), ("global_factors", global_factors)):
        if any(not (f > 0 and math.isfinite(f)) or f == 1.0 for f in values) or (
            name == "factors" and not values
        ):
            raise ValueError(
                f"{name}: expected positive numbers other than 1, got {list(values)!r}."
            )
    if not 0.0 < score_fraction <= 1.0:
        raise ValueError(f"score_fraction: expected a number in (0, 1], got {score_fraction!r}.")
    steps = int(np.shape(xs)[0])
    if steps < 1 or int(np.shape(ys)[0]) != steps:
        raise ValueError(
            f"xs, ys: expected the same number P >= 1 of batches on their first axis, got "
            f"{np.shape(xs)[0]} and {np.shape(ys)[0]}."
        )
    per_call = steps if per_call is None else int(per_call)
    if per_call < 1:
        raise ValueError(f"per_call: expected a positive number of steps, got {per_call!r}.")

    saved = jax.tree_util.tree_map(jnp.copy, pipeline.state)
    counters = jax.tree_util.tree_map(jnp.copy, pipeline.counters)
    trials: list[ProbeTrial] = []
    ran = [0]

    def trial(multipliers: dict[str, float], label: str) -> float:
        pipeline.set_state(set_rate_multipliers(saved, multipliers, group), counters=counters)
        losses, committed = [], []
        for start in range(0, steps, per_call):
            k = min(per_call, steps - start)
            _, _, metrics = pipeline.run(
                xs[start:start + k], ys[start:start + k], keep_outputs=False,
                report_at=np.zeros(k, bool),
            )
            losses.append(np.asarray(metrics.loss))
            committed.append(np.asarray(metrics.committed))
        ran[0] += steps
        score = _score(np.concatenate(losses), np.concatenate(committed), score_fraction)
        trials.append(ProbeTrial(dict(multipliers), score, label))
        return score

    try:
        baseline = trial(before, "baseline")
        base, base_score = dict(before), baseline
        if len(groups) > 1 and global_factors:
            overall = {
                f: trial({**before, **{g: before[g] * f for g in groups}}, f"all x{f:g}")
                for f in global_factors
            }
            f_all = choose_factors(baseline, {"all": overall}).get("all", 1.0)
            if f_all != 1.0:
                base = {**before, **{g: before[g] * f_all for g in groups}}
                base_score = overall[f_all]
        scores: dict[str, dict[float, float]] = {}
        for g in groups:
            scores[g] = {f: trial({**base, g: base[g] * f}, f"{g} x{f:g}") for f in factors}
        chosen = choose_factors(base_score, scores)
        multipliers, score = base, base_score
        if len(chosen) == 1:
            (g, f), = chosen.items()
            multipliers, score = {**base, g: base[g] * f}, scores[g][f]
        elif chosen:
            combined = {**base, **{g: base[g] * f for g, f in chosen.items()}}
            combined_score = trial(combined, "combined")
            if combined_score < base_score:
                multipliers, score = combined, combined_score
            else:  # the choices do not add up: keep the best single change
                g, f = min(chosen.items(), key=lambda item: scores[item[0]][item[1]])
                multipliers, score = {**base, g: base[g] * f}, scores[g][f]
    finally:
        pipeline.set_state(saved, counters=counters)
    return ProbeResult(before, multipliers, baseline, score, tuple(trials), ran[0])
