"""How a step guards and computes, said once: `StepSettings`, which `make_step`,
`StepProgram`, `FusedPipeline` and the training app's `TrainConfig` all take."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fusedpc.core._precision import resolve_compute_dtype

NONFINITE_POLICIES = ("skip", "raise", "ignore")


def check_bound(name: str, value: Any, low: float) -> float | None:
    """`value` as a float above `low`, or None (off); anything else is an error naming
    `name`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise TypeError(f"{name}: expected None or a number, got {type(value).__name__}.")
    value = float(value)
    if not (np.isfinite(value) and value > low):
        raise ValueError(f"{name}: expected None or a finite number > {low:g}, got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The step's guards and compute dtype (off is None).

    Attributes:
        nonfinite: `"skip"` (or `"raise"`) keeps the old state when anything of the step is
            not representable (NaN, infinity, a norm overflowing float32) and counts the step
            as skipped; `"raise"` also raises at the next call of a `FusedPipeline`;
            `"ignore"` commits it anyway.
        max_update_ratio: refuse a step in which any learning part's update / weight norm
            ratio exceeds this bound (None: no bound).
        loss_spike: refuse a step whose loss exceeds this factor (> 1) times the running mean
            of committed losses, from the 10th committed step on (None: no guard).
        clip_global_norm: clip every optax-driven part's gradient by the global norm over
            all of them, as `optax.clip_by_global_norm(c)` chained before the optimiser of a
            backprop step (None: no clipping).
        compute_dtype: None (float32) or `"bfloat16"`: activations, caches, errors between
            parts and the operands of matrix products in bfloat16; parameters, optimiser
            states, weight gradients, statistics, norms and the loss in float32.

    Every value is checked when the settings are made, each error naming its field.
    """

    nonfinite: str = "skip"
    max_update_ratio: float | None = None
    loss_spike: float | None = None
    clip_global_norm: float | None = None
    compute_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"nonfinite: expected one of {NONFINITE_POLICIES}, got {self.nonfinite!r}.")
        checked = {
            "max_update_ratio": check_bound("max_update_ratio", self.max_update_ratio, 0.0),
            "loss_spike": check_bound("loss_spike", self.loss_spike, 1.0),
            "clip_global_norm": check_bound("clip_global_norm", self.clip_global_norm, 0.0),
            "compute_dtype": resolve_compute_dtype(self.compute_dtype),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> StepSettings:
        """A copy with some settings changed (checked again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, settings: StepSettings | None, **keywords: Any) -> StepSettings:
        """`settings`, or the settings the keywords name (those that are None take the
        default): what the functions that accept both forms call. Both at once is an error
        (one place says each setting)."""
        given = {name: value for name, value in keywords.items() if value is not None}
        if settings is None:
            return cls(**given)
        if not isinstance(settings, StepSettings):
            raise TypeError(
                f"settings: expected a fusedpc.StepSettings, got {type(settings).__name__}.")
        if given:
            raise ValueError(
                f"settings: given together with {sorted(given)}; pass the settings object "
                "alone (settings.replace(...) changes some) or the keywords alone.")
        return settings


def settings_property(name: str) -> Any:
    """A read-only property of a `StepProgram`: `program.settings.<name>`."""

    def read(program: Any) -> Any:
        return getattr(program.settings, name)

    read.__name__ = name
    return property(read, doc=f"`settings.{name}`")


__all__ = ["NONFINITE_POLICIES", "StepSettings", "check_bound", "settings_property"]
