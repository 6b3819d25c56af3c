"""Calibrating per-part learning rates from step reports.

Every learning part reports, each step, the norm of its update $\\lVert \\Delta\\theta \\rVert$
and of its weights $\\lVert \\theta \\rVert$. Their ratio

$$\\rho = \\lVert \\Delta\\theta \\rVert / \\lVert \\theta \\rVert$$

is the fraction by which one step moves the part. A common rule of thumb for steady training
is $\\rho \\approx 10^{-3}$: much larger and the part churns (or diverges), much smaller and it
hardly learns. For SGD and for Adam alike the update is, to first order, proportional to the
learning rate $\\eta$ (SGD: $\\Delta\\theta = -\\eta g$; Adam: $-\\eta \\hat m / \\sqrt{\\hat v}$,
whose size does not depend on the gradient's scale), so the rate that brings a part from its
median ratio $\\tilde\\rho$ to the target $\\rho^*$ is

$$\\eta' = \\eta \\cdot \\rho^* / \\tilde\\rho .$$

`calibrate(rows)` computes $\\tilde\\rho$ per part (over every logged step, or the last
`fraction` of them) and that multiplier, with a one-line reason; `format_table` prints it.
The rows are what `pipeline.report()` returns (with a `step`), or the `"report"` records of
the JSONL log that `fusedpc train` writes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from fusedpc.training._table import format_rows

__all__ = [
    "DEFAULT_TARGET",
    "PartCalibration",
    "calibrate",
    "calibrate_slots",
    "format_table",
    "report_rows",
    "slot_lr_scales_flag",
    "slot_of",
]

DEFAULT_TARGET = 1e-3
"""The default target update/weight ratio per step."""

TOLERANCE = 2.0
"""A median ratio within this factor of the target counts as on target."""


@dataclasses.dataclass(frozen=True)
class PartCalibration:
    """One part's calibration: its median update/weight ratio over `steps` logged steps, the
    rate multiplier $\\rho^* / \\tilde\\rho$ (None when it cannot be computed) and why."""

    part: str
    layer_sizes: tuple[int, ...]
    steps: int
    median_ratio: float
    multiplier: float | None
    reason: str


def report_rows(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The report rows among log records (`kind == "report"`); plain report rows pass too."""
    return [r for r in records if r.get("kind", "report") == "report" and "part" in r]


def _reason(median: float, target: float) -> tuple[float | None, str]:
    if not math.isfinite(median):
        return None, "no finite update ratio logged: the part diverged or its weights are zero"
    if median == 0.0:
        return None, "no update at all: the part does not learn (no optimiser, or a zero rate)"
    factor = median / target
    multiplier = target / median
    if factor > TOLERANCE:
        return multiplier, f"updates {factor:.3g}x larger than target: lower this part's rate"
    if factor < 1.0 / TOLERANCE:
        return multiplier, f"updates {1 / factor:.3g}x smaller than target: raise this part's rate"
    return multiplier, f"within {TOLERANCE:g}x of target: keep this part's rate"


def calibrate(
    rows: Iterable[dict[str, Any]],
    target: float = DEFAULT_TARGET,
    fraction: float = 1.0,
) -> list[PartCalibration]:
    """Per part (in the order first seen): median update/weight ratio and rate multiplier.

    Args:
        rows: report rows, each with `part` and `update_ratio` (and `step`, `layer_sizes`
            when known); log records of other kinds are ignored.
        target: the update/weight ratio per step to aim for ($\\rho^*$, default 1e-3).
        fraction: use only the last `fraction` of each part's logged steps (e.g. 0.5 to leave
            out the start of training, when Adam's first steps are unusually large).
    """
    if not (target > 0 and math.isfinite(target)):
        raise ValueError(f"target must be a positive number, got {target!r}.")
    ratios, sizes = _ratios_by_part(rows, fraction)
    if not ratios:
        raise ValueError(
            "no report rows to calibrate from; the log needs lines with kind 'report' "
            "(fusedpc train writes them every --report-every steps)."
        )
    return [_calibration(part, sizes[part], values, target) for part, values in ratios.items()]


def _ratios_by_part(
    rows: Iterable[dict[str, Any]], fraction: float
) -> tuple[dict[str, list[float]], dict[str, tuple[int, ...]]]:
    """Each part's logged update ratios (its last `fraction` of them; NaN where none was
    logged), in the order first seen, and its layer sizes."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must lie in (0, 1], got {fraction!r}.")
    ratios: dict[str, list[float]] = {}
    sizes: dict[str, tuple[int, ...]] = {}
    for row in report_rows(rows):
        value = row.get("update_ratio")
        ratios.setdefault(row["part"], []).append(float("nan") if value is None else float(value))
        sizes.setdefault(row["part"], tuple(row.get("layer_sizes") or ()))
    kept = {
        part: values[len(values) - max(1, math.ceil(len(values) * fraction)):]
        for part, values in ratios.items()
    }
    return kept, sizes


def _calibration(
    name: str, sizes: tuple[int, ...], values: list[float], target: float
) -> PartCalibration:
    """The median of the finite `values`, its multiplier and reason."""
    finite = np.asarray([v for v in values if math.isfinite(v)], np.float64)
    median = float(np.median(finite)) if finite.size else float("nan")
    multiplier, reason = _reason(median, target)
    return PartCalibration(name, sizes, len(values), median, multiplier, reason)


def slot_of(part: str) -> str | None:
    """The GPT slot (`fusedpc.transformer.SLOTS`) a part path belongs to, or None:
    `"blocks[1].attention.wq"` -> `"attention"`, `"blocks[0].n2"` and `"norm_f"` -> `"norm"`."""
    if part in ("token", "position", "head"):
        return part
    if part == "norm_f":
        return "norm"
    if part.startswith("blocks[") and "]." in part:
        first = part.split("].", 1)[1].split(".", 1)[0]
        if first in ("attention", "feed_forward"):
            return first
        if first in ("n1", "n2"):
            return "norm"
    return None


def calibrate_slots(
    rows: Iterable[dict[str, Any]],
    target: float = DEFAULT_TARGET,
    fraction: float = 1.0,
    current: dict[str, float] | None = None,
) -> list[PartCalibration]:
    """The calibration per GPT slot, in the unit `--slot-lr-scales` takes.

    Every part of a slot shares the slot's optimiser (scanned blocks share one stacked
    state, so a rate per block is not a setting a run has), so a slot's multiplier is read
    off the median of all its parts' ratios together (each part's last `fraction` of steps).
    `current` (a run's own `slot_lr_scales`) is compounded in: the result is the scale to
    set, relative to `lr`, not a change of the scale the run used. Parts outside every slot
    are left out."""
    pooled: dict[str, list[float]] = {}
    for part, values in _ratios_by_part(rows, fraction)[0].items():
        slot = slot_of(part)
        if slot is not None:
            pooled.setdefault(slot, []).extend(values)
    table = []
    for slot, values in pooled.items():
        c = _calibration(slot, (), values, target)
        multiplier = None if c.multiplier is None else c.multiplier * (current or {}).get(slot, 1.0)
        reason = c.reason.replace("this part's", "this slot's")
        table.append(dataclasses.replace(c, multiplier=multiplier, reason=reason))
    return table


def slot_lr_scales_flag(table: list[PartCalibration]) -> str:
    """The `--slot-lr-scales` value of a slot calibration (3 significant digits), slots
    without a multiplier left out: `"token=0.794,attention=0.0884,head=0.0164"`."""
    return ",".join(f"{c.part}={c.multiplier:.3g}" for c in table if c.multiplier is not None)


def format_table(table: list[PartCalibration], target: float = DEFAULT_TARGET) -> str:
    """The calibration as a fixed-width text table, one part a line (`format_rows`)."""
    rows = [
        {
            "part": c.part,
            "sizes": "x".join(str(s) for s in c.layer_sizes) or "-",
            "median ratio": f"{c.median_ratio:.3g}",
            "rate x": None if c.multiplier is None else f"{c.multiplier:.3g}",
            "reason": c.reason,
        }
        for c in table
    ]
    title = (
        f"calibration: median update/weight ratio per step, and the rate multiplier that "
        f"brings it to the target {target:g}"
    )
    columns = [(name, name) for name in ("part", "sizes", "median ratio", "rate x", "reason")]
    return format_rows(rows, columns, title=title)
