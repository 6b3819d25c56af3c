"""The flat settings of a run (the CLI's flags, the TOML file's keys): their names, sections,
defaults and types, and a `TrainConfig` read from and written to them.

The model's settings are those of `fusedpc.training._model_settings`; the model's vocabulary
size is not a setting: the tokeniser decides it (`TrainConfig.gpt_config(vocab_size)`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fusedpc.training._config import RUN_FIELDS, TrainConfig, setting_values
from fusedpc.training._model_settings import MODEL_SETTINGS, model_from, model_settings

RENAMED = {"heads": "n_heads", "blocks": "n_blocks", "seq": "max_len"}
"""Setting names of fusedpc 0.1 and their `GPTConfig` names. Deprecated in 0.2 and removed in
0.4.0: an old name (a TOML key, an `overrides` key) is refused with a message naming the new
one."""


def config_settings(config: TrainConfig) -> dict[str, Any]:
    """The flat settings of `config`, named as in `SECTIONS` (what its TOML file holds)."""
    values = setting_values(config)
    return {name: values[name] for name in SETTINGS}


def config_from_settings(
    settings: dict[str, Any], base: TrainConfig | None = None
) -> TrainConfig:
    """`base` (default `TrainConfig()`) with the flat `settings` applied (checked names)."""
    base = TrainConfig() if base is None else base
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"settings: unknown {unknown}; known: {', '.join(SETTINGS)}.")
    model = {k: v for k, v in settings.items() if k in MODEL_SETTINGS}
    run = {k: v for k, v in settings.items() if k not in MODEL_SETTINGS}
    return dataclasses.replace(base, model=model_from(base.model, model), **run)


def _settings_defaults() -> dict[str, Any]:
    default = TrainConfig()
    run = {name: getattr(default, name) for name in RUN_FIELDS}
    model = model_settings(default.model)
    order = [*RUN_FIELDS[:4], *MODEL_SETTINGS, *RUN_FIELDS[4:]]
    return {name: model[name] if name in model else run[name] for name in order}


SETTINGS: dict[str, Any] = _settings_defaults()
"""Every flat setting and its default, in the order of `SECTIONS`."""

SECTIONS: dict[str, tuple[str, ...]] = {
    "data": ("text", "tokenizer", "validation_fraction", "data"),
    "model": MODEL_SETTINGS,
    "optimiser": (
        "optimiser", "lr", "weight_decay", "clip", "lr_schedule", "warmup_steps",
        "lr_decay_steps",
        "lr_final_fraction", "slot_lr_scales", "calibrate", "calibrate_at", "probe_steps",
    ),
    "training": (
        "steps", "batch", "steps_per_call", "seed", "eval_every", "eval_batches",
        "report_every", "save_every", "tensorboard", "init_from", "max_update_ratio",
        "loss_spike",
        "sample_tokens", "temperature", "infill_hide_every",
    ),
    "runtime": ("devices", "distributed"),
}

_TYPES = {name: type(value) for name, value in SETTINGS.items()}


def _refuse_renamed(settings: dict[str, Any], where: str) -> None:
    old = [name for name in settings if name in RENAMED]
    if old:
        renamed = ", ".join(f"{name!r} is now {RENAMED[name]!r}" for name in old)
        raise ValueError(
            f"{where}: settings renamed to GPTConfig's names in fusedpc 0.2: {renamed}; the "
            "old names were removed in 0.4.0."
        )


def coerce_settings(settings: dict[str, Any], where: str) -> dict[str, Any]:
    """Check the names and types of `settings` (as read from TOML or given in Python).

    Integers are accepted for float settings; a list of slot names for `learn`; `true`,
    `false` or `"auto"` for `scan`. The names of fusedpc 0.1 (`RENAMED`: `heads`, `blocks`,
    `seq`) are refused with a `ValueError` that names their new names.
    """
    _refuse_renamed(settings, where)
    out = {}
    for name, value in settings.items():
        if name not in _TYPES:
            raise ValueError(f"{where}: unknown setting {name!r}; known: {', '.join(_TYPES)}.")
        kind = _TYPES[name]
        if name == "scan":
            if not (isinstance(value, bool) or value == "auto"):
                raise ValueError(f"{where}: scan must be true, false or 'auto', got {value!r}.")
            out[name] = value
            continue
        if name == "learn" and isinstance(value, list | tuple):
            value = ",".join(str(v) for v in value)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ValueError(
                f"{where}: {name} must be {kind.__name__}, got {value!r} "
                f"({type(value).__name__})."
            )
        out[name] = value
    return out
