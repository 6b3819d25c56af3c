"""PNG plots of a training log: loss curves, per-part update norms and update/weight ratios,
and the energies of iterative-inference parts.

The plots are drawn with matplotlib's object-oriented API on an Agg canvas (no `pyplot`, no
global backend change), so they work headless and never disturb a notebook's own figures.

Input is the list of log records that `fusedpc train` writes to `log.jsonl` (see
`fusedpc.training`):
`{"kind": "train", "step", "loss"}`, `{"kind": "eval", "step", "val_loss"}`
and `{"kind": "report", "step", "part", "update_norm", "update_ratio", ...}`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["per_part_series", "plot_loss", "plot_per_part", "render_all"]

PLOTS = {
    "update_norm": ("update_norm.png", "update norm  \u2016\u0394\u03b8\u2016"),
    "update_ratio": (
        "update_ratio.png",
        "update / weight  \u2016\u0394\u03b8\u2016 / \u2016\u03b8\u2016",
    ),
}


PLOTS_MISSING = (
    "plots skipped: matplotlib is not installed (install the CLI extra: "
    "pip install 'fusedpc[cli]')"
)
"""What `fusedpc train` and `fusedpc report` print instead of the plots without matplotlib."""


def plots_available() -> bool:
    """Whether matplotlib can be imported (it comes with the `cli` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(width: float = 8.0, height: float = 4.5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(figure)
    return figure


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average over `window` points (fewer at the two ends), so the curve
    does not lag behind the steps it is drawn at."""
    n = len(values)
    if window <= 1 or n == 0:
        return values
    cumulative = np.concatenate([[0.0], np.cumsum(values)])
    index = np.arange(n)
    lo = np.maximum(index - window // 2, 0)
    hi = np.minimum(index + window // 2 + 1, n)
    return (cumulative[hi] - cumulative[lo]) / (hi - lo)


def _finite(xs: Iterable[float]) -> bool:
    return any(math.isfinite(x) for x in xs)


def plot_loss(records: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Training loss per step (faint), its moving average, and the validation loss."""
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    evals = [(r["step"], r["val_loss"]) for r in records if r.get("kind") == "eval"]
    figure = _figure()
    ax = figure.add_subplot()
    if train:
        steps, losses = (np.asarray(v, np.float64) for v in zip(*train, strict=True))
        window = max(1, len(losses) // 50)
        ax.plot(steps, losses, color="tab:blue", alpha=0.3 if window > 1 else 1.0,
                linewidth=0.8, label="train (per step)")
        if window > 1:
            ax.plot(steps, _smooth(losses, window), color="tab:blue", linewidth=1.6,
                    label=f"train ({window}-step mean)")
    if evals:
        steps, losses = (np.asarray(v, np.float64) for v in zip(*evals, strict=True))
        ax.plot(steps, losses, color="tab:orange", marker="o", markersize=4, linewidth=1.6,
                label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title("loss")
    ax.grid(True, alpha=0.3)
    if train or evals:
        ax.legend(loc="upper right")
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path)
    return path


def per_part_series(
    records: list[dict[str, Any]], key: str
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`{part: (steps, values)}` of one report field, parts in the order first logged."""
    series: dict[str, tuple[list, list]] = {}
    for r in records:
        if r.get("kind") != "report" or key not in r:
            continue
        steps, values = series.setdefault(r["part"], ([], []))
        steps.append(r["step"])
        value = r[key]
        values.append(float("nan") if value is None else float(value))
    return {p: (np.asarray(s, np.float64), np.asarray(v, np.float64))
            for p, (s, v) in series.items()}


def plot_per_part(
    records: list[dict[str, Any]],
    key: str,
    path: str | os.PathLike,
    ylabel: str | None = None,
    target: float | None = None,
) -> Path:
    """One line per part of report field `key` over training, log scale, legend outside."""
    series = per_part_series(records, key)
    figure = _figure(10.0, 5.0)
    ax = figure.add_subplot()
    colours = _colours(len(series))
    drawn = False
    for (part, (steps, values)), colour in zip(series.items(), colours, strict=True):
        positive = np.where(values > 0, values, np.nan)
        if _finite(positive):
            ax.plot(steps, positive, color=colour, linewidth=1.2, label=part)
            drawn = True
    if target is not None:
        ax.axhline(target, color="black", linestyle="--", linewidth=1.0,
                   label=f"target {target:g}")
        drawn = True
    if drawn:
        ax.set_yscale("log")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
                  frameon=False, ncols=1 if len(series) <= 24 else 2)
    else:
        ax.text(0.5, 0.5, "no report rows in the log", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel or key)
    ax.set_title(f"{key} per learning part")
    ax.grid(True, which="both", alpha=0.25)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, bbox_inches="tight")
    return path


def rate_series(records: list[dict[str, Any]], last_step: int | None = None
                ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`{slot: (steps, multipliers)}` from the `rates` records, as steps: each value holds
    from its record's step to the next one's (the last to `last_step`, the run's last logged
    step by default)."""
    rates = [r for r in records if r.get("kind") == "rates"]
    if last_step is None:
        last_step = max((int(r.get("step", 0)) for r in records), default=0)
    series: dict[str, tuple[list, list]] = {}
    for i, r in enumerate(rates):
        end = rates[i + 1]["step"] if i + 1 < len(rates) else max(last_step, r["step"])
        for slot, m in r["multipliers"].items():
            steps, values = series.setdefault(slot, ([], []))
            steps.extend([r["step"], end])
            values.extend([float(m), float(m)])
    return {s: (np.asarray(a, np.float64), np.asarray(b, np.float64))
            for s, (a, b) in series.items()}


def plot_rates(records: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Each slot's rate multiplier over training (log scale), from the `rates` records."""
    series = rate_series(records)
    figure = _figure(10.0, 5.0)
    ax = figure.add_subplot()
    for (slot, (steps, values)), colour in zip(series.items(), _colours(len(series)),
                                               strict=True):
        ax.plot(steps, values, color=colour, linewidth=1.4, label=slot)
    ax.set_yscale("log", base=2)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    ax.set_xlabel("step")
    ax.set_ylabel("rate multiplier")
    ax.set_title("rate multiplier per slot (calibration)")
    ax.grid(True, which="both", alpha=0.25)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, bbox_inches="tight")
    return path


def _colours(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab20" if n > 10 else "tab10"]
    return [cmap(i % cmap.N) for i in range(n)]


def render_all(
    records: list[dict[str, Any]], folder: str | os.PathLike, target: float | None = None
) -> list[Path]:
    """`loss.png`, `update_norm.png` and `update_ratio.png` in `folder`,
    `rate_multipliers.png` when the log has `rates` records, and `energy.png` when report rows
    carry energies (iterative-inference parts); returns their paths.

    `target` draws the target update/weight ratio as a dashed line on `update_ratio.png`.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [plot_loss(records, folder / "loss.png")]
    for key, (name, label) in PLOTS.items():
        paths.append(plot_per_part(records, key, folder / name, label,
                                   target if key == "update_ratio" else None))
    if any(r.get("kind") == "rates" for r in records):
        paths.append(plot_rates(records, folder / "rate_multipliers.png"))
    if any(r.get("kind") == "report" and "energy_after" in r for r in records):
        paths.append(plot_per_part(records, "energy_after", folder / "energy.png",
                                   "energy after relaxation F (mean over rows)"))
    if any(r.get("kind") == "report" and "energy" in r for r in records):
        paths.append(plot_per_part(records, "energy", folder / "latent_energy.png",
                                   "each latent's energy after relaxation (mean over rows)"))
    return paths
