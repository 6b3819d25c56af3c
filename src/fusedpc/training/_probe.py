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
   most of the gain in the global rate). If a factor $f$ won, the **ladder** climbs on:
   every group at $f^2$, $f^3$, ... in turn, each rung kept only while it beats the one
   before it beyond the noise, up to a total of `global_reach` (x32, or x1/32);
4. **per-group** trials: for each group $g$ and each factor $f$ in `factors` (0.5 and 2),
   the base with $g$'s multiplier times $f$: $2|G|$ trials;
5. keeps for each group the factor with the lowest score (1 included; a change counts
   only when it is lower than the trial it is compared with by more than `significance`
   standard errors of their step-by-step loss differences, and a **slower** trial, one
   that lowers a rate, counts only when its own step losses are lower on average too:
   a lower rate must learn more, not merely move the weights less, since a held-out
   score alone can favour learning less, which ends worse at the budget), then runs the
   **combined** choice once more; if it does not beat the base, the single best trial's
   change is kept instead, and if none beat the base, the base stays;
6. restores the saved state and counters exactly, and returns the choice with every trial's
   score (`ProbeResult`); it does not apply it (`set_rate_multipliers` does).

$1 + |F_{global}| + 4 + 2|G| + 1$ trials at most (four more rungs reach x32 from x2): 20
for a GPT's six slots; one calibration changes a rate by x1/64 to x64 at most. The ladder is
what the study needed for `synaptic_uncertainty`, whose default rate is 16 to 32 times too
low at `window=100` (docs/calibration.md).

A trial's **score** is its held-out loss: `score(pipeline)`, the losses of held-out batches
after the trial (`fusedpc train` passes windows of its validation split other than those it
evaluates on), compared batch for batch between trials. Without `score`, the mean loss over
the last `score_fraction` of the trial's own steps: each step's loss is measured on its
batch before that batch trains the weights, which is held out only while the batches are
new (on a small text they repeat within a few hundred steps, and this score then favours
overfitting). A trial with a non-finite loss or a refused step scores infinity. Every
trial sees the same batches, and the probes consume no data position: the run continues on
the same batches afterwards.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.training._rates import gpt_slot, rate_multipliers, set_rate_multipliers

__all__ = [
    "GLOBAL_FACTORS",
    "GLOBAL_REACH",
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

GLOBAL_REACH = 32.0
"""How far the global stage climbs at most (a total factor of x32 or x1/32): the winning
global factor is applied again while each rung beats the one before it."""


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


def _tail(losses: np.ndarray, committed: np.ndarray, fraction: float) -> np.ndarray | None:
    """The scored steps' losses, or None for a trial that failed (a refused step or a
    non-finite loss)."""
    if not (np.all(committed) and np.all(np.isfinite(losses))):
        return None
    return losses[-max(1, int(round(len(losses) * fraction))):].astype(np.float64)


def lower_by_more_than_noise(
    candidate: np.ndarray | None, reference: np.ndarray | None, significance: float
) -> bool:
    """Whether `candidate`'s per-step losses are lower than `reference`'s (the same batches,
    step for step) by more than `significance` standard errors of their differences,
    $\\bar d < -z\\, s_d / \\sqrt{n}$ with $d_i = c_i - r_i$; a failed trial (None) never is,
    and anything is lower than a failed reference."""
    if candidate is None:
        return False
    if reference is None:
        return True
    d = candidate - reference
    if d.size < 2 or significance == 0:
        return bool(d.mean() < 0)
    return bool(d.mean() < -significance * d.std(ddof=1) / math.sqrt(d.size))


def probe_rates(
    pipeline: Any,
    xs: Any,
    ys: Any,
    *,
    groups: Sequence[str] | None = None,
    factors: Sequence[float] = PROBE_FACTORS,
    global_factors: Sequence[float] = GLOBAL_FACTORS,
    global_reach: float = GLOBAL_REACH,
    per_call: int | None = None,
    score: Callable[[Any], Any] | None = None,
    score_fraction: float = 0.5,
    significance: float = 2.0,
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
        global_reach: how far the global stage may climb: when a global factor $f$ wins,
            every group is tried at $f^2, f^3, \\ldots$ in turn, each kept only while it
            beats the rung before it beyond the noise, up to a total factor of
            `global_reach` (or `1 / global_reach` downwards); 1 stops at the first
            rung.
        per_call: steps per compiled `run` call (use the run's own `steps_per_call` so that
            the trials reuse its program); all P in one call by default.
        score: `score(pipeline) -> losses` (a 1-d array: one loss per held-out batch, the
            same batches for every trial) read after each trial; its mean is the trial's
            score. None: the trial's own step losses (see above).
        score_fraction: without `score`, the share of each trial's last steps whose mean
            loss is its score.
        significance: a change counts as lower only when its scored losses are below
            those of the trial it is compared with (the same batches) by more than this
            many standard errors of their batch-by-batch differences
            (`lower_by_more_than_noise`); 0: any lower score counts. A trial with a
            rate lowered must also have lower step losses on average than the trial it is
            compared with (it learnt more, not less).
        group: a state path -> its group (a GPT's slots by default).

    Raises:
        ValueError: when the state has no rate multiplier, a named group has none, or the
            arguments are out of range (each named in the message).
    """
    before = rate_multipliers(pipeline.state, group)
    groups = _checked_groups(before, groups)
    _check_arguments(factors, global_factors, global_reach, significance, score_fraction)
    per_call = _checked_per_call(xs, ys, per_call)
    trials = _Trials(pipeline, xs, ys, per_call, score, score_fraction, significance, group)
    try:
        baseline = trials.run(before, "baseline")
        base = _Base(dict(before), baseline, "baseline")
        if len(groups) > 1 and global_factors:
            base = _global_stage(trials, base, groups, global_factors, global_reach)
        multipliers, final = _per_group_stage(trials, base, groups, factors)
    finally:
        trials.restore()
    return ProbeResult(before, multipliers, baseline, final, tuple(trials.trials), trials.ran)


def _checked_groups(before: dict[str, float], groups: Sequence[str] | None) -> tuple[str, ...]:
    """The groups to probe (every group with a multiplier by default), checked."""
    if not before:
        raise ValueError(
            "probe_rates: the pipeline's optimisers carry no rate multiplier; build them with "
            "fusedpc.training.with_rate_multiplier (fusedpc train does with --calibrate)."
        )
    groups = tuple(before) if groups is None else tuple(groups)
    reserved = sorted(set(groups) & {"all", "baseline", "combined"})
    if reserved:
        raise ValueError(
            f"groups: {reserved} name trials of their own (all, baseline, combined); "
            "give the groups other names."
        )
    unknown = sorted(set(groups) - set(before))
    if unknown:
        raise ValueError(
            f"groups: {unknown} carry no rate multiplier; the state has {list(before)}."
        )
    return groups


def _check_arguments(
    factors: Sequence[float],
    global_factors: Sequence[float],
    global_reach: float,
    significance: float,
    score_fraction: float,
) -> None:
    for name, values in (("factors", factors), ("global_factors", global_factors)):
        if any(not (f > 0 and math.isfinite(f)) or f == 1.0 for f in values) or (
            name == "factors" and not values
        ):
            raise ValueError(
                f"{name}: expected positive numbers other than 1, got {list(values)!r}."
            )
    if not (global_reach >= 1 and math.isfinite(global_reach)):
        raise ValueError(f"global_reach: expected a number >= 1, got {global_reach!r}.")
    if not (significance >= 0 and math.isfinite(significance)):
        raise ValueError(f"significance: expected a number >= 0, got {significance!r}.")
    if not 0.0 < score_fraction <= 1.0:
        raise ValueError(f"score_fraction: expected a number in (0, 1], got {score_fraction!r}.")


def _checked_per_call(xs: Any, ys: Any, per_call: int | None) -> int:
    """The steps per call of the trials (all P by default), with `xs` and `ys` checked."""
    steps = int(np.shape(xs)[0])
    if steps < 1 or int(np.shape(ys)[0]) != steps:
        raise ValueError(
            f"xs, ys: expected the same number P >= 1 of batches on their first axis, got "
            f"{np.shape(xs)[0]} and {np.shape(ys)[0]}."
        )
    per_call = steps if per_call is None else int(per_call)
    if per_call < 1:
        raise ValueError(f"per_call: expected a positive number of steps, got {per_call!r}.")
    return per_call


class _Trials:
    """The trials of one `probe_rates` call: each runs the P batches from the state saved at
    the start, at its multipliers, and is scored; `restore` puts the saved state back."""

    def __init__(
        self,
        pipeline: Any,
        xs: Any,
        ys: Any,
        per_call: int,
        score: Callable[[Any], Any] | None,
        score_fraction: float,
        significance: float,
        group: Callable[[str], str | None],
    ) -> None:
        self.pipeline, self.xs, self.ys = pipeline, xs, ys
        self.steps, self.per_call = int(np.shape(xs)[0]), per_call
        self.score, self.score_fraction = score, score_fraction
        self.significance, self.group = significance, group
        self.saved = jax.tree_util.tree_map(jnp.copy, pipeline.state)
        self.counters = jax.tree_util.tree_map(jnp.copy, pipeline.counters)
        self.trials: list[ProbeTrial] = []
        self.tails: dict[str, np.ndarray | None] = {}  # each trial's scored losses
        self.own: dict[str, np.ndarray | None] = {}  # each trial's own step losses (its tail)
        self.ran = 0  # training steps run in all

    def run(self, multipliers: dict[str, float], label: str) -> float:
        """Run the trial `label` at `multipliers` and return its score (infinity for a
        failed trial)."""
        pipeline = self.pipeline
        pipeline.set_state(
            set_rate_multipliers(self.saved, multipliers, self.group), counters=self.counters
        )
        losses, committed = [], []
        for start in range(0, self.steps, self.per_call):
            k = min(self.per_call, self.steps - start)
            _, _, metrics = pipeline.run(
                self.xs[start:start + k], self.ys[start:start + k], keep_outputs=False,
                report_at=np.zeros(k, bool),
            )
            losses.append(np.asarray(metrics.loss))
            committed.append(np.asarray(metrics.committed))
        self.ran += self.steps
        scored = _tail(np.concatenate(losses), np.concatenate(committed), self.score_fraction)
        self.own[label] = scored
        if self.score is not None and scored is not None:
            held = np.ravel(np.asarray(self.score(pipeline), np.float64))
            scored = held if np.all(np.isfinite(held)) else None
        self.tails[label] = scored
        value = math.inf if scored is None else float(np.mean(scored))
        self.trials.append(ProbeTrial(dict(multipliers), value, label))
        return value

    def counted(self, value: float, label: str, reference: str, slower: bool = False) -> float:
        """`value`, or infinity when it is not lower than `reference`'s beyond the noise;
        a `slower` trial (a rate lowered) must also have learnt more: its own step losses
        lower on average than the reference's."""
        lower = lower_by_more_than_noise(
            self.tails[label], self.tails[reference], self.significance
        )
        if lower and slower:
            lower = lower_by_more_than_noise(self.own[label], self.own[reference], 0.0)
        return value if lower else math.inf

    def run_counted(
        self, multipliers: dict[str, float], label: str, reference: str, slower: bool
    ) -> float:
        """`run`, then `counted` against the trial `reference`."""
        return self.counted(self.run(multipliers, label), label, reference, slower)

    def restore(self) -> None:
        self.pipeline.set_state(self.saved, counters=self.counters)


class _Base(NamedTuple):
    """The trial the next stage compares with: its multipliers, score and label."""

    multipliers: dict[str, float]
    score: float
    label: str


def _global_stage(
    trials: _Trials,
    baseline: _Base,
    groups: tuple[str, ...],
    global_factors: Sequence[float],
    global_reach: float,
) -> _Base:
    """Every group at each global factor together; if one wins, the ladder climbs on in its
    direction while each rung beats the one before it, up to `global_reach`."""
    before = baseline.multipliers

    def everywhere(factor: float) -> dict[str, float]:
        return {**before, **{g: before[g] * factor for g in groups}}

    overall = {
        f: trials.run_counted(everywhere(f), f"all x{f:g}", baseline.label, slower=f < 1)
        for f in global_factors
    }
    f_all = choose_factors(baseline.score, {"all": overall}).get("all", 1.0)
    if f_all == 1.0:
        return baseline
    base = _Base(everywhere(f_all), overall[f_all], f"all x{f_all:g}")
    # the ladder: on in the same direction while each rung beats the last
    step, total = f_all, f_all
    while max(total * step, 1 / (total * step)) <= global_reach * (1 + 1e-9):
        total *= step
        label = f"all x{total:g}"
        rates = everywhere(total)
        rung = trials.run_counted(rates, label, base.label, slower=step < 1)
        if not math.isfinite(rung):
            break
        base = _Base(rates, rung, label)
    return base


def _per_group_stage(
    trials: _Trials, base: _Base, groups: tuple[str, ...], factors: Sequence[float]
) -> tuple[dict[str, float], float]:
    """Each group at each factor from `base`, then the choice: the multipliers and their
    score (the combined choice if it beats `base`, else the best single change)."""
    rates = base.multipliers
    scores = {
        g: {
            f: trials.run_counted({**rates, g: rates[g] * f}, f"{g} x{f:g}", base.label,
                                  slower=f < 1)
            for f in factors
        }
        for g in groups
    }
    chosen = choose_factors(base.score, scores)
    if not chosen:
        return rates, base.score
    if len(chosen) > 1:
        combined = {**rates, **{g: rates[g] * f for g, f in chosen.items()}}
        combined_score = trials.run(combined, "combined")
        if trials.counted(combined_score, "combined", base.label) < base.score:
            return combined, combined_score
        # the choices do not add up: keep the best single change
    g, f = min(chosen.items(), key=lambda item: scores[item[0]][item[1]])
    return {**rates, g: rates[g] * f}, scores[g][f]
