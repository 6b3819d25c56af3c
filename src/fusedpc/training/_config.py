"""The settings of a run: `TrainConfig`, its TOML file (read, written, checked) and the
settings a resumed run may change."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from typing import Any

from fusedpc.parts.learning._local_update import LEARNING_KINDS
from fusedpc.training import data
from fusedpc.training._optimisers import OPTIMISERS
from fusedpc.transformer._build import SLOTS, GPTConfig

CHECKPOINT_NAME = "checkpoint.fpc"
CONFIG_NAME = "config.toml"

TOKENIZERS = ("char", "byte")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run (the CLI's flags and the TOML file's keys).

    **[data]** `text`: a bundled text name (`"hamlet"`) or the path of a UTF-8 file;
    `tokenizer`: `"char"` (vocabulary = the text's characters) or `"byte"` (256 tokens);
    `validation_fraction`: the share of the text, at its end, held out for validation.

    **[model]** `width`, `heads` (must divide `width`), `blocks`, `ff_width`, `seq` (tokens per
    row, also the position table's length); `learn`: the learning slots, a preset (`"all"`,
    `"ff_head"`, `"none"`) or a comma list of `token, position, attention, feed_forward, norm,
    head`; `learning_kind`: `"precision_weighted"`, `"standard"` or `"synaptic_uncertainty"`
    (which needs `window` >= 1); `head_kind`: `"gaussian"` (logits) or `"categorical"`
    (probabilities).

    **[optimiser]** `optimiser`: `"adam"`, `"adamw"` or `"sgd"`; `lr`; `weight_decay` (adamw);
    `slot_lr_scales`: per-slot rate multipliers, e.g. `"head=0.5,attention=2"` (the
    multipliers `fusedpc report` suggests), each slot then gets its own optimiser.

    **[training]** `steps` (the total to reach), `batch` (rows per step, per process),
    `steps_per_call` (K steps per compiled call), `seed`, `eval_every` (steps between
    validations; 0: only at the start and the end), `eval_batches`, `report_every` (steps
    between logged report rows), `save_every` (steps between checkpoints; 0: only at the end),
    `sample_tokens` and `temperature` of the final sample.

    **[runtime]** `devices` (data-parallel devices; on CPU they are emulated), `distributed`
    (join a multi-process run with `jax.distributed.initialize()`).
    """

    # [data]
    text: str = data.DEFAULT_TEXT
    tokenizer: str = "char"
    validation_fraction: float = 0.1
    # [model]
    width: int = 64
    heads: int = 4
    blocks: int = 2
    ff_width: int = 256
    seq: int = 64
    learn: str = "all"
    learning_kind: str = "precision_weighted"
    window: int = 0
    head_kind: str = "gaussian"
    # [optimiser]
    optimiser: str = "adam"
    lr: float = 3e-3
    weight_decay: float = 1e-4
    slot_lr_scales: str = ""
    # [training]
    steps: int = 1000
    batch: int = 16
    steps_per_call: int = 10
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    report_every: int = 10
    save_every: int = 0
    sample_tokens: int = 200
    temperature: float = 0.8
    # [runtime]
    devices: int = 1
    distributed: bool = False

    def validate(self) -> None:
        """Raise a `ValueError` naming the first bad setting and what is allowed."""
        positive = (
            "width", "heads", "blocks", "ff_width", "seq", "steps", "batch", "steps_per_call",
            "eval_batches", "report_every", "devices",
        )
        for name in positive:
            value = getattr(self, name)
            if not value >= 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        for name in ("seed", "eval_every", "save_every", "sample_tokens", "window"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}.")
        if self.width % self.heads:
            raise ValueError(
                f"heads={self.heads} must divide width={self.width} (each head gets "
                f"width/heads features); choose e.g. heads={_divisor_near(self.width, self.heads)}."
            )
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}.")
        if self.optimiser not in OPTIMISERS:
            raise ValueError(f"optimiser must be one of {OPTIMISERS}, got {self.optimiser!r}.")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}.")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}.")
        self.lr_scales()
        if not 0 < self.validation_fraction < 1:
            raise ValueError(
                f"validation_fraction must lie strictly between 0 and 1, got "
                f"{self.validation_fraction!r}."
            )
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}.")
        if self.learning_kind not in LEARNING_KINDS:
            raise ValueError(
                f"learning_kind must be one of {LEARNING_KINDS}, got {self.learning_kind!r}."
            )
        if self.learning_kind == "synaptic_uncertainty" and self.window < 1:
            raise ValueError(
                "learning_kind 'synaptic_uncertainty' needs window >= 1 (the number of steps "
                "its per-weight beliefs average over); pass e.g. --window 100."
            )
        if self.batch % self.devices:
            raise ValueError(
                f"batch={self.batch} must divide over devices={self.devices}; use a multiple "
                f"of {self.devices}."
            )
        self.gpt_config(vocab_size=1).validate()  # learn slots, learning kind, head kind

    def lr_scales(self) -> dict[str, float]:
        """`slot_lr_scales` parsed: `{"head": 0.5, ...}`; bad entries raise a `ValueError`."""
        scales: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in self.slot_lr_scales.split(","))):
            slot, sep, value = item.partition("=")
            slot = slot.strip()
            try:
                scale = float(value) if sep else float("nan")
            except ValueError:
                scale = float("nan")
            if slot not in SLOTS or not (scale > 0 and math.isfinite(scale)):
                raise ValueError(
                    f"slot_lr_scales: expected entries slot=multiplier with a slot from {SLOTS} "
                    f"and a positive multiplier, got {item!r}."
                )
            scales[slot] = scale
        return scales

    def gpt_config(self, vocab_size: int):
        return GPTConfig(
            vocab_size=vocab_size,
            width=self.width,
            n_heads=self.heads,
            n_blocks=self.blocks,
            ff_width=self.ff_width,
            max_len=self.seq,
            learn=self.learn,
            learning_kind=self.learning_kind,
            learning_kwargs={"window": self.window}
            if self.learning_kind == "synaptic_uncertainty"
            else None,
            head_kind=self.head_kind,
        )


def _divisor_near(width: int, heads: int) -> int:
    return min((d for d in range(1, width + 1) if width % d == 0), key=lambda d: abs(d - heads))


SECTIONS: dict[str, tuple[str, ...]] = {
    "data": ("text", "tokenizer", "validation_fraction"),
    "model": (
        "width", "heads", "blocks", "ff_width", "seq", "learn", "learning_kind", "window",
        "head_kind",
    ),
    "optimiser": ("optimiser", "lr", "weight_decay", "slot_lr_scales"),
    "training": (
        "steps", "batch", "steps_per_call", "seed", "eval_every", "eval_batches",
        "report_every", "save_every", "sample_tokens", "temperature",
    ),
    "runtime": ("devices", "distributed"),
}

RESUMABLE = frozenset(
    {
        "steps", "steps_per_call", "eval_every", "eval_batches", "report_every", "save_every",
        "sample_tokens", "temperature", "devices",
    }
)
"""Settings a resumed run may change: none changes the batches or the maths of the updates.
The continuation is bit-identical when only `steps`, the evaluation, report, save and sample
settings change; another `steps_per_call` or `devices` compiles other programs (a scan of
another length, other cross-device reductions), which may round differently."""

_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_TYPES = {name: type(f.default) for name, f in _FIELDS.items()}


def coerce_settings(settings: dict[str, Any], where: str) -> dict[str, Any]:
    """Check the names and types of `settings` (as read from TOML or given in Python).

    Integers are accepted for float settings; a list of slot names for `learn`.
    """
    out = {}
    for name, value in settings.items():
        if name not in _TYPES:
            raise ValueError(f"{where}: unknown setting {name!r}; known: {', '.join(_TYPES)}.")
        kind = _TYPES[name]
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


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The settings of a TOML config file, flattened (sections as in `SECTIONS`).

    Raises `FileNotFoundError` for a missing file and `ValueError` for a malformed one, an
    unknown section or key, a key in the wrong section or a value of the wrong type.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config file at {path!r}")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"config file {path!r} is not valid TOML: {err}") from None
    section_of = {name: s for s, names in SECTIONS.items() for name in names}
    flat: dict[str, Any] = {}
    for section, table in raw.items():
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
    lines = ["# fusedpc train: the resolved configuration of this run.", ""]
    for section, names in SECTIONS.items():
        lines.append(f"[{section}]")
        lines.extend(f"{name} = {_toml_value(getattr(config, name))}" for name in names)
        lines.append("")
    return "\n".join(lines)


def resolve_config(
    file: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None
) -> TrainConfig:
    """Defaults, then the config `file`, then `overrides`; validated."""
    settings: dict[str, Any] = {}
    if file is not None:
        settings.update(read_config_file(file))
    settings.update(coerce_settings(dict(overrides or {}), "settings"))
    config = dataclasses.replace(TrainConfig(), **settings)
    config.validate()
    return config


def resume_config(run_dir: str | os.PathLike, overrides: dict[str, Any] | None = None):
    """The config of the run in `run_dir`, with the `overrides` a resumed run may change.

    Changing anything outside `RESUMABLE` (the model, the data, the optimiser, the seed, the
    batch) would make the continuation differ from an uninterrupted run, and is refused.
    """
    run_dir = os.fspath(run_dir)
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"--resume: no run folder at {run_dir!r}")
    for name in (CONFIG_NAME, CHECKPOINT_NAME):
        if not os.path.isfile(os.path.join(run_dir, name)):
            raise FileNotFoundError(
                f"--resume: {run_dir!r} has no {name}; give the folder of a run that "
                "fusedpc train wrote."
            )
    saved = resolve_config(os.path.join(run_dir, CONFIG_NAME))
    overrides = coerce_settings(dict(overrides or {}), "settings")
    fixed = sorted(
        name for name, value in overrides.items()
        if name not in RESUMABLE and value != getattr(saved, name)
    )
    if fixed:
        raise ValueError(
            f"--resume: cannot change {', '.join(fixed)} of a run being resumed (the "
            f"continuation would no longer match an uninterrupted run); only "
            f"{', '.join(sorted(RESUMABLE))} may change."
        )
    config = dataclasses.replace(saved, **overrides)
    config.validate()
    return config
