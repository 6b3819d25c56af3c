"""What a run starts from, read and checked before anything is built: the checkpoint that it
resumes (`train(resume_from=...)`) or the run that it initialises from (`init_from`)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from fusedpc.execution._checkpoint import read_checkpoint_manifest
from fusedpc.training._config import TrainConfig
from fusedpc.training._config_file import CHECKPOINT_NAME, CONFIG_NAME, RESUMABLE
from fusedpc.training._settings import RENAMED, SETTINGS, coerce_settings, config_settings


@dataclasses.dataclass(frozen=True)
class StartPoint:
    """A run's start: for a resumed run, its `checkpoint`, that checkpoint's `metadata` and
    the settings `changed` since it was trained (`{name: [trained, now]}`); for a run that
    starts from another's weights (`init_from`), that run's checkpoint `init` and its
    manifest. A fresh run has none of them."""

    checkpoint: Path | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    changed: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    init: Path | None = None
    init_manifest: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def saved_tokenizer(self) -> dict[str, Any] | None:
        """The tokeniser the weights know: the resumed run's, or that of the run the new one
        starts from; None for a fresh run."""
        if self.init is not None:
            return self.init_manifest["metadata"]["tokenizer"]
        return self.metadata.get("tokenizer")


def read_start_point(
    config: TrainConfig,
    resume_from: str | os.PathLike | None,
    allow_config_change: bool,
) -> StartPoint:
    """The start of a run of `config`: the checkpoint in `resume_from`, or the one that
    `config.init_from` names, read and checked (a `ValueError` or `FileNotFoundError` names
    what is wrong and what to do)."""
    if resume_from is not None:
        checkpoint = Path(resume_from) / CHECKPOINT_NAME
        metadata = read_checkpoint_manifest(checkpoint)["metadata"]
        if not isinstance(metadata, dict) or "tokenizer" not in metadata:
            raise ValueError(f"{str(checkpoint)!r} was not written by fusedpc train.")
        changed = _checked_changes(metadata, config, allow_config_change)
        return StartPoint(checkpoint=checkpoint, metadata=metadata, changed=changed)
    if config.init_from:
        init = Path(config.init_from) / CHECKPOINT_NAME
        return StartPoint(init=init, init_manifest=_init_manifest(init))
    return StartPoint()


def _checked_changes(
    metadata: dict[str, Any], config: TrainConfig, allow_config_change: bool
) -> dict[str, list[Any]]:
    changed: dict[str, list[Any]] = {}
    if isinstance(metadata.get("config"), dict):
        changed = _changed_settings(metadata["config"], config)
    if changed and not allow_config_change:
        listed = ", ".join(f"{k} ({v[0]!r} -> {v[1]!r})" for k, v in changed.items())
        raise ValueError(
            f"--resume: the run's config differs from the one its checkpoint was "
            f"trained with: {listed}; restore {CONFIG_NAME}, or pass "
            "--allow-config-change to continue with the change (it is logged)."
        )
    return changed


def _changed_settings(saved: dict[str, Any], config: TrainConfig) -> dict[str, list[Any]]:
    """Settings outside `RESUMABLE` whose value differs from the one a checkpoint was trained
    with: `{name: [trained, now]}`. Settings the checkpoint predates count as their default;
    a checkpoint of fusedpc 0.1 (its old names, `RENAMED`) is refused."""
    known = coerce_settings(
        {k: v for k, v in saved.items() if k in SETTINGS or k in RENAMED},
        "the checkpoint's config",
    )
    trained = {**SETTINGS, **known}
    now = config_settings(config)
    return {
        name: [trained[name], now[name]]
        for name in now
        if name not in RESUMABLE and trained[name] != now[name]
    }


def _init_manifest(init: Path) -> dict[str, Any]:
    if not init.is_file():
        raise FileNotFoundError(
            f"--init-from: no checkpoint at {str(init)!r}; give the folder of a run "
            "that fusedpc train wrote."
        )
    manifest = read_checkpoint_manifest(init)
    metadata = manifest["metadata"]
    if not isinstance(metadata, dict) or "tokenizer" not in metadata:
        raise ValueError(f"--init-from: {str(init)!r} was not written by fusedpc train.")
    return manifest
