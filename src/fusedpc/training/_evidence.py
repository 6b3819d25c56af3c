"""What `fusedpc report` suggests about a run's rates, and the evidence it rests on.

The evidence is the calibration study's summary (scripts/calibration_study.py `--evidence`),
bundled with the package as `calibration_evidence.json`: per cell (text, learning kind,
`learn` preset, optimiser) and method, the mean validation loss at the study's budget and
its standard deviation over seeds, with the backprop twin's. `suggest(config, records)`
finds the study cell that matches a run, and says which change is expected to help (the
method that beat no calibration by more than the seed spread there, and by how much), or
plainly that none is.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from importlib import resources
from typing import Any

from fusedpc.training._config import TrainConfig

__all__ = ["CellEvidence", "cell_evidence", "load_evidence", "suggest"]

EVIDENCE_NAME = "calibration_evidence.json"
SUGGESTED_METHOD = "probe"
"""The method `fusedpc report` suggests, and the one `--calibrate auto` runs."""
ARCHITECTURE_DEFAULTS = {"norm": "layer", "positions": "table", "feed_forward": "gelu"}
"""The GPT options the study ran with (`GPTConfig`'s defaults)."""


@dataclasses.dataclass(frozen=True)
class CellEvidence:
    """One study cell: `none` and `method`'s mean and spread (seed standard deviation),
    the twin's mean where the cell has one, and the cell's name."""

    cell: str
    method: str
    none_mean: float
    none_std: float
    mean: float
    std: float
    seeds: int
    twin_mean: float | None

    @property
    def gain(self) -> float:
        """How much lower the method's mean validation loss is than `none`'s."""
        return self.none_mean - self.mean

    @property
    def spread(self) -> float:
        """The larger of the two seed standard deviations."""
        return max(self.none_std, self.std)

    @property
    def helps(self) -> bool:
        """Whether the method beat `none` by more than the seed spread."""
        return self.gain > self.spread

    @property
    def hurts(self) -> bool:
        """Whether the method was worse than `none` by more than the seed spread."""
        return -self.gain > self.spread


@cache
def load_evidence() -> dict[str, Any]:
    """The bundled study summary: `{"study": settings, "cells": [summary lines]}`."""
    text = resources.files("fusedpc.training").joinpath(EVIDENCE_NAME).read_text("utf-8")
    return json.loads(text)


def _preset(config: TrainConfig) -> str | None:
    """The study's `learn` preset a run's learning slots are, or None."""
    model = config.gpt_config(vocab_size=1)
    slots = set(model.learning_slots())
    # a preset's slots as this model has them (rotary positions: no position slot)
    presets = {name: set(dataclasses.replace(model, learn=name).learning_slots())
               for name in ("all", "ff_head")}
    return next((name for name, s in presets.items() if s == slots), None)


def cell_evidence(
    config: TrainConfig,
    method: str = SUGGESTED_METHOD,
    evidence: dict | None = None,
    text: str | None = None,
) -> tuple[CellEvidence | None, str]:
    """The study cell of `text` (the study's first, the bundled one, by default) that
    matches `config` (learning kind, `learn` preset, optimiser; `adamw` reads as `adam`),
    and a note on how well it matches."""
    evidence = load_evidence() if evidence is None else evidence
    cells = evidence["cells"]
    text = evidence["study"]["texts"][0] if text is None else text
    optimiser = "adam" if config.optimiser == "adamw" else config.optimiser
    preset = _preset(config)
    note = ""
    if preset is None:
        preset = "all"
        note = (f"no study cell learns exactly the slots of learn={config.model.learn!r}; "
                "the nearest is learn='all'")
    kind = config.model.learning_kind
    options = {name: getattr(config.model, name) for name in ARCHITECTURE_DEFAULTS}
    if options != ARCHITECTURE_DEFAULTS:
        changed = ", ".join(f"{k}={v!r}" for k, v in options.items()
                            if v != ARCHITECTURE_DEFAULTS[k])
        note = "; ".join(filter(None, (note, (
            f"the study ran the default architecture, not {changed}: its evidence is for "
            "the nearest model"))))

    def find(m: str, k: str = kind, p: str = preset, o: str = optimiser):
        for c in cells:
            if (c["text"], c["learning_kind"], c["learn"], c["method"]) == (text, k, p, m) \
                    and c["optimiser"] in (o, "own_rule"):
                return c
        return None

    none, chosen = find("none"), find(method)
    if none is None or chosen is None:
        return None, f"the study has no cell {kind}/{preset}/{optimiser}"
    twin = find("backprop_twin", "backprop", "all")
    cell = f"{text} / {kind} / learn={preset} / {chosen['optimiser']}"
    return CellEvidence(
        cell=cell, method=method, none_mean=none["val_loss_mean"],
        none_std=none["val_loss_std"], mean=chosen["val_loss_mean"],
        std=chosen["val_loss_std"], seeds=chosen["seeds"],
        twin_mean=None if twin is None else twin["val_loss_mean"],
    ), note


def suggest(
    config: TrainConfig, records: list[dict[str, Any]], evidence: dict | None = None
) -> list[str]:
    """The lines `fusedpc report` prints under "suggestion" for a run with `config` and
    log `records` (`evidence`: the bundled study's by default)."""
    lines: list[str] = []
    calibrations = [r for r in records if r.get("kind") == "calibration"]
    if calibrations:
        last = calibrations[-1]
        changed = last.get("changed") or {}
        lines.append(
            f"this run calibrated its rates by probes at step {last['step']} "
            f"({last['probe_steps']} trial steps): trial loss {last['baseline']:.4f} -> "
            f"{last['score']:.4f}"
        )
        if changed and config.model.learning_kind == "synaptic_uncertainty":
            lines.append("  multipliers chosen: " + ", ".join(
                f"{slot} x{m:g}" for slot, m in last["multipliers"].items()))
            lines.append("(synaptic_uncertainty: --slot-lr-scales sets the LayerNorms' optimiser "
                         "only; the rule's own steps are scaled by --calibrate alone)")
        elif changed:
            lines.append("  multipliers chosen: " + ", ".join(
                f"{slot} x{m:g}" for slot, m in last["multipliers"].items()))
            flag = ",".join(f"{slot}={m:g}" for slot, m in last["multipliers"].items())
            lines.append("to start a new run at these rates from step 0 instead (no probes; "
                         "not the same as changing them at that step):")
            lines.append(f"  --slot-lr-scales {flag}")
            lines.append(f'  or in the config file: [optimiser] slot_lr_scales = "{flag}"')
        else:
            lines.append("  no change lowered the trial loss: the rates stayed as set")
        return lines
    evidence = load_evidence() if evidence is None else evidence
    study = evidence["study"]
    budget = f"{study['steps']} steps, {len(study['seeds'])} seeds"
    found, note = [], ""
    for text in study["texts"]:  # the verdict rests on every text of the study
        cell, note = cell_evidence(config, evidence=evidence, text=text)
        if cell is None:
            lines.append(f"no suggestion: {note}.")
            return lines
        found.append(cell)
    if note:
        lines.append(f"({note})")
    per_text = [
        f"  {c.cell}: {c.none_mean:.3f} without, {c.mean:.3f} with --calibrate auto "
        f"({'lower' if c.gain >= 0 else 'higher'} by {abs(c.gain):.3f}; seed spread "
        f"{c.spread:.3f})"
        for c in found
    ]
    texts = "every text" if len(found) > 1 else "the study's text"
    if all(c.helps for c in found):
        lines.append(
            f"expected to help: --calibrate auto (trial runs of the global rate, then of each "
            f"slot's, at x0.5 and x2) lowered the validation loss by more than the seed spread "
            f"on {texts} of the study ({budget}):"
        )
        lines.extend(per_text)
        lines.append("  train with: --calibrate auto")
        lines.append('  or in the config file: [optimiser] calibrate = "auto"')
    elif any(c.hurts for c in found):
        lines.append(
            "no change is expected to help, and --calibrate auto may hurt: it was worse than "
            f"no calibration by more than the seed spread in the study ({budget}):"
        )
        lines.extend(per_text)
        lines.append("  keep the rates as they are")
    else:
        lines.append(
            "no change is expected to help: --calibrate auto did not beat no calibration by "
            f"more than the seed spread on {texts} of the study ({budget}):"
        )
        lines.extend(per_text)
        lines.append("  keep the rates as they are")
    return lines
