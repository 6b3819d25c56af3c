"""A run's TOML config file (read, written, checked), the order settings are taken in, and
the settings a resumed run may change."""

from __future__ import annotations

import json
import math
import os
import tomllib
from typing import Any

from fusedpc.training._config import TrainConfig
from fusedpc.training._settings import (
    RENAMED,
    SECTIONS,
    coerce_settings,
    config_from_settings,
    config_settings,
)

CHECKPOINT_NAME = "checkpoint.fpc"
CONFIG_NAME = "config.toml"

RESUMABLE = frozenset(
    {
        "steps", "steps_per_call", "eval_every", "eval_batches", "report_every", "save_every",
        "sample_tokens", "temperature", "infill_hide_every", "devices", "tensorboard",
    }
)
"""Settings a resumed run may change: none changes the batches or the maths of the updates.
The continuation is bit-identical when only `steps`, the evaluation, report, save and sample
settings change; another `steps_per_call` or `devices` compiles other programs (a scan of
another length, other cross-device reductions), which may round differently."""


def read_config_file(path: str | os.PathLike, other_sections: tuple[str, ...] = ()
                     ) -> dict[str, Any]:
    """The settings of a TOML config file, flattened (sections as in `SECTIONS`).

    Raises `FileNotFoundError` for a missing file and `ValueError` for a malformed one, an
    unknown section or key, a key in the wrong section or a value of the wrong type.
    `other_sections` are tables a command reads itself (`fusedpc study`'s `[study]`): skipped.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config file at {path!r}")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"config file {path!r} is not valid TOML: {err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(
            f"config file {path!r} is not UTF-8 text (byte {err.object[err.start]:#04x} at "
            f"offset {err.start}); save it as UTF-8."
        ) from None
    section_of = {name: s for s, names in SECTIONS.items() for name in names}
    section_of.update({old: section_of[new] for old, new in RENAMED.items()})  # 0.1 keys
    flat: dict[str, Any] = {}
    for section, table in raw.items():
        if section in other_sections and isinstance(table, dict):
            continue
        if not isinstance(table, dict) and section in section_of:
            raise ValueError(
                f"config file {path!r}: key {section!r} must be inside the "
                f"[{section_of[section]}] section."
            )
        if section not in SECTIONS or not isinstance(table, dict):
            raise ValueError(
                f"config file {path!r}: unknown section {section!r}; sections are "
                f"{', '.join(f'[{s}]' for s in SECTIONS)}."
            )
        for name, value in table.items():
            if section_of.get(name) != section:
                hint = f" (it belongs in [{section_of[name]}])" if name in section_of else ""
                raise ValueError(
                    f"config file {path!r}: unknown key {name!r} in [{section}]{hint}; known "
                    f"keys there: {', '.join(SECTIONS[section])}."
                )
            flat[name] = value
    return coerce_settings(flat, f"config file {path!r}")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    raise TypeError(f"cannot write {value!r} to TOML")


def config_to_toml(config: TrainConfig) -> str:
    """The config as a TOML document, one section per group of `SECTIONS`."""
    settings = config_settings(config)
    lines = ["# fusedpc train: the resolved configuration of this run.", ""]
    for section, names in SECTIONS.items():
        lines.append(f"[{section}]")
        lines.extend(f"{name} = {_toml_value(settings[name])}" for name in names)
        lines.append("")
    return "\n".join(lines)


def resolve_config(
    file: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None,
    other_sections: tuple[str, ...] = (),
) -> TrainConfig:
    """The defaults, then the config `file`, then `overrides`; validated.

    Args:
        file: a TOML config file (`read_config_file`), or None.
        overrides: flat settings named as the file's keys (`{"n_heads": 8, "steps": 500}`);
            the names of fusedpc 0.1 (`heads`, `blocks`, `seq`) are refused, naming the new.

    Returns:
        The `TrainConfig`.

    Raises:
        ValueError: an unknown setting, a value of the wrong type or an invalid config.
    """
    settings: dict[str, Any] = {}
    if file is not None:
        settings.update(read_config_file(file, other_sections))
    settings.update(coerce_settings(dict(overrides or {}), "settings"))
    config = config_from_settings(settings)
    config.validate()
    return config


def resume_config(
    run_dir: str | os.PathLike, overrides: dict[str, Any] | None = None, *,
    argument: str = "--resume",
) -> TrainConfig:
    """The config of the run in `run_dir`, with the `overrides` a resumed run may change.

    Changing anything outside `RESUMABLE` (the model, the data, the optimiser, the seed, the
    batch) would make the continuation differ from an uninterrupted run, and is refused.
    A `config.toml` written by fusedpc 0.1 (keys `heads`, `blocks`, `seq`) is refused, with a
    message that names the new keys.

    Args:
        run_dir: the folder of a run `fusedpc train` wrote.
        overrides: flat settings, as for `resolve_config`.
        argument: what the messages call `run_dir` (the flag or argument it came from).

    Returns:
        The `TrainConfig` to continue with.

    Raises:
        FileNotFoundError: `run_dir` or its `config.toml` or `checkpoint.fpc` is missing.
        ValueError: an override outside `RESUMABLE` that differs from the saved setting.
    """
    run_dir = os.fspath(run_dir)
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"{argument}: no run folder at {run_dir!r}")
    for name in (CONFIG_NAME, CHECKPOINT_NAME):
        if not os.path.isfile(os.path.join(run_dir, name)):
            raise FileNotFoundError(
                f"{argument}: {run_dir!r} has no {name}; give the folder of a run that "
                "fusedpc train wrote."
            )
    saved = resolve_config(os.path.join(run_dir, CONFIG_NAME))
    overrides = coerce_settings(dict(overrides or {}), "settings")
    was = config_settings(saved)
    fixed = sorted(
        name for name, value in overrides.items() if name not in RESUMABLE and value != was[name]
    )
    if fixed:
        raise ValueError(
            f"--resume: cannot change {', '.join(fixed)} of a run being resumed (the "
            f"continuation would no longer match an uninterrupted run); only "
            f"{', '.join(sorted(RESUMABLE))} may change."
        )
    config = config_from_settings(overrides, saved)
    config.validate()
    return config
