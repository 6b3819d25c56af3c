"""The model's flat settings: a `GPTConfig` read as the settings of a run (the CLI's flags,
the `[model]` keys of a TOML file) and built back from them.

A setting of the model has the name of the `GPTConfig` field it sets (`n_heads`, `n_blocks`,
`max_len`, ...), plus the learning keywords a run takes: `window`
(`GPTConfig.learning_kwargs["window"]` of `synaptic_uncertainty`), and `inference_steps` and
`inference_rate` (of `"iterative"`, and of a model with latents: its
`relaxation_steps` and `relaxation_rate`), and `inference_tolerance` (a model with latents'
`relaxation_tolerance`; 0 in the file: none) and `incremental_inference`
(`relaxation_incremental`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fusedpc.transformer._build import GPTConfig
from fusedpc.transformer._slots import ITERATIVE

SYNAPTIC = "synaptic_uncertainty"

MODEL_SETTINGS = (
    "width", "n_heads", "n_blocks", "ff_width", "max_len", "learn", "learning_kind", "window",
    "inference_steps", "inference_rate", "head_kind", "fused_qkv", "hidden_precision", "scan",
    "attention_mixing", "compute_dtype", "norm", "positions", "feed_forward", "latents",
    "latent_precision", "inference_tolerance", "incremental_inference", "parameterisation",
)
"""The settings of `TrainConfig.model`: `GPTConfig` fields by their own names, and the learning
keywords (`LEARNING_SETTINGS`)."""
LEARNING_SETTINGS = {SYNAPTIC: ("window",), ITERATIVE: ("inference_steps", "inference_rate")}
"""The flat settings that reach `GPTConfig.learning_kwargs`, per learning kind."""
LEARNING_DEFAULTS = {"window": 0, "inference_steps": 8, "inference_rate": 0.1}
RELAXATION_FIELDS = {"inference_tolerance": "relaxation_tolerance",
                     "incremental_inference": "relaxation_incremental"}
"""Flat settings of a model with latents and the `GPTConfig` fields they set."""


def model_settings(model: GPTConfig) -> dict[str, Any]:
    """The flat settings of `model` (`MODEL_SETTINGS`; a learning keyword that
    `learning_kwargs` lacks at its default)."""
    out = {
        name: getattr(model, name) for name in MODEL_SETTINGS
        if name not in LEARNING_DEFAULTS and name not in RELAXATION_FIELDS
    }
    out["inference_tolerance"] = float(model.relaxation_tolerance or 0.0)
    out["incremental_inference"] = bool(model.relaxation_incremental)
    if not isinstance(out["learn"], str):
        out["learn"] = ",".join(out["learn"])
    given = dict(model.learning_kwargs or {})
    if model.latents != "none":  # the relaxation of the latents
        given = {"inference_steps": model.relaxation_steps,
                 "inference_rate": model.relaxation_rate, **given}
    for name, default in LEARNING_DEFAULTS.items():
        out[name] = type(default)(given.get(name, default))
    return out


def model_from(model: GPTConfig, settings: dict[str, Any]) -> GPTConfig:
    """`model` with the model `settings` (`MODEL_SETTINGS` names) applied."""
    merged = {**model_settings(model), **settings}
    learning = {name: merged.pop(name) for name in LEARNING_DEFAULTS}
    merged["relaxation_incremental"] = bool(merged.pop("incremental_inference"))
    tolerance = float(merged.pop("inference_tolerance"))
    merged["relaxation_tolerance"] = None if tolerance == 0 else tolerance  # < 0: refused
    # As in fusedpc 0.1: a learning keyword reaches the model only with the kind that uses it.
    names = LEARNING_SETTINGS.get(merged["learning_kind"], ())
    kwargs = {name: learning[name] for name in names} or None
    if merged["latents"] != "none":  # the same keywords set the latents' relaxation
        merged["relaxation_steps"] = int(learning["inference_steps"])
        merged["relaxation_rate"] = float(learning["inference_rate"])
    return dataclasses.replace(model, learning_kwargs=kwargs, **merged)
