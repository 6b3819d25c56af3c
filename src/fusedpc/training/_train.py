"""The training loop behind `fusedpc train`, usable from Python as well.

    from fusedpc.training._train import TrainConfig, train
    result = train(TrainConfig(steps=200), "runs/mine")
    print(result.val_loss, result.sample)

One run trains a hybrid predictive-coding GPT (`fusedpc.build_gpt`) on a text (the bundled
one by default) with `FusedPipeline.run`, `steps_per_call` steps per compiled call, and writes
into its folder:

* `config.toml`: the resolved `TrainConfig` (`config_to_toml`), written first;
* `log.jsonl`: one JSON object a line: `{"kind": "train", "step", "loss", "time",
  "tokens_per_s", "committed"}` for every step, `{"kind": "eval", "step", "val_loss",
  "val_perplexity"}` at every evaluation, `{"kind": "report", "step", **row}` for every row of
  `pipeline.report()` every `report_every` steps, and a `{"kind": "summary", ...}` at the end;
* `checkpoint.fpc`: `pipeline.save(path, metadata)` with the config, the tokeniser, the data
  position, the step and the elapsed time;
* `loss.png`, `update_norm.png`, `update_ratio.png` (see `fusedpc.training._plots`).

Resuming (`resume_from=`) reloads the checkpoint and the data position; batch `k` of the run
depends only on `(seed, k)` (see `fusedpc.training.data.BatchIterator`), so a resumed run draws the
batches an uninterrupted one would, whatever `steps_per_call` is, and its losses are the same
at every later step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import signal
import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from fusedpc.execution._checkpoint import read_checkpoint_manifest
from fusedpc.execution._pipeline import FusedPipeline
from fusedpc.execution._sharding import data_mesh, initialize_distributed, make_global_batch
from fusedpc.parts.learning._local_update import LEARNING_KINDS
from fusedpc.training import _plots, data
from fusedpc.training._optimisers import OPTIMISERS, make_optimiser
from fusedpc.training._progress import Progress, format_duration
from fusedpc.transformer._build import SLOTS, GPTConfig, build_gpt
from fusedpc.transformer._generate import generate

CHECKPOINT_NAME = "checkpoint.fpc"
LOG_NAME = "log.jsonl"
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


# --------------------------------------------------------------------------- pieces
def config_optimiser(config: TrainConfig, scale: float = 1.0):
    """The optax optimiser named by `config.optimiser` at rate `scale * config.lr`."""
    return make_optimiser(config.optimiser, config.lr * scale, config.weight_decay)


def load_tokens(config: TrainConfig, tokenizer: dict | None = None):
    """`(text, tokenizer, train_ids, val_ids)` for `config`; `tokenizer` (a `to_dict`) when
    resuming, so that the vocabulary is the one the model was built with."""
    text = data.load_text(config.text)
    if tokenizer is not None:
        tok = data.tokenizer_from_dict(tokenizer)
    elif config.tokenizer == "char":
        tok = data.CharTokenizer.from_text(text)
    else:
        tok = data.ByteTokenizer()
    ids = tok.encode(text)
    train_ids, val_ids = data.split(ids, config.validation_fraction)
    for name, part in (("training", train_ids), ("validation", val_ids)):
        if len(part) < config.seq + 1:
            raise ValueError(
                f"the text's {name} split has {len(part)} tokens, fewer than seq + 1 = "
                f"{config.seq + 1}; use a longer text, a shorter --seq or another "
                "validation_fraction."
            )
    return text, tok, train_ids, val_ids


def make_mesh(config: TrainConfig):
    """The data-parallel mesh for `config` (None for one device in one process)."""
    if config.distributed:
        return data_mesh()  # every device of every process
    return None if config.devices == 1 else data_mesh(config.devices)


def build_pipeline(config: TrainConfig, vocab_size: int, mesh=None):
    """The `FusedPipeline` of a run: `build_gpt` at `jax.random.key(config.seed)`."""
    gpt = config.gpt_config(vocab_size)
    slot_optimisers = {
        slot: config_optimiser(config, scale) for slot, scale in config.lr_scales().items()
    }
    part, _ = build_gpt(
        gpt, config_optimiser(config), jax.random.key(config.seed), slot_optimisers=slot_optimisers
    )
    return FusedPipeline(part, gpt.error_fn, key=jax.random.key(config.seed), mesh=mesh)


def load_run(run_dir: str | os.PathLike):
    """`(pipeline, tokenizer, config, metadata)` of the run saved in `run_dir`."""
    config = resume_config(run_dir)
    path = os.path.join(os.fspath(run_dir), CHECKPOINT_NAME)
    metadata = read_checkpoint_manifest(path)["metadata"]
    tok = data.tokenizer_from_dict(metadata["tokenizer"])
    pipeline = build_pipeline(config, tok.vocab_size)
    pipeline.load(path)
    return pipeline, tok, config, metadata


def call_size(step: int, total: int, per_call: int) -> int:
    """Steps in the next compiled call from `step`: up to the next multiple of `per_call`
    (and not beyond `total`), so that a run resumed anywhere rejoins the same calls."""
    return min(per_call - step % per_call, total - step)


def cross_entropy(outputs: np.ndarray, targets: np.ndarray, probabilities: bool) -> float:
    """Mean $-\\log p(t)$ over every position; `outputs` `(..., V)` holds logits, or
    probabilities when `probabilities`; `targets` `(...)` integer ids. Computed in float64."""
    out = np.asarray(outputs, np.float64)
    if probabilities:
        logp = np.log(np.clip(out, 1e-30, 1.0))
    else:
        shifted = out - out.max(axis=-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    picked = np.take_along_axis(logp, np.asarray(targets)[..., None].astype(np.int64), axis=-1)
    return float(-picked.mean())


def _host(x) -> np.ndarray:
    """A device array as NumPy, also when it spans processes (replicated or gathered)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def evaluate(pipeline, inputs: np.ndarray, targets: np.ndarray, probabilities: bool) -> float:
    """Mean validation cross-entropy over the batches `inputs`/`targets` `(N, B, T)`."""
    losses = [
        cross_entropy(_host(pipeline.predict(x)), y, probabilities)
        for x, y in zip(inputs, targets, strict=True)
    ]
    return float(np.mean(losses))


class StopRequest:
    """Turns the first Ctrl-C (SIGINT) into a request to stop after the current call; a
    second Ctrl-C interrupts at once. Installed only in the main thread."""

    def __init__(self, on_request: Callable[[], None] | None = None):
        self.requested = False
        self.aborted = False
        self._on_request = on_request
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            self.aborted = True
            raise KeyboardInterrupt
        self.requested = True
        if self._on_request is not None:
            self._on_request()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def default_cache_dir() -> str:
    """`$FUSEDPC_CACHE`, else `$XDG_CACHE_HOME/fusedpc/jax`, else `~/.cache/fusedpc/jax`."""
    if os.environ.get("FUSEDPC_CACHE"):
        return os.environ["FUSEDPC_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fusedpc", "jax")


def enable_compile_cache(path: str | os.PathLike | None = None) -> str | None:
    """Keep compiled programs on disk (JAX's persistent compilation cache) so that a later run
    of the same model skips compiling (tens of seconds on a CPU). Returns the folder used.

    `path=None` uses `default_cache_dir()`, unless JAX already has a cache folder configured
    (e.g. `JAX_COMPILATION_CACHE_DIR`), which is then kept; `"none"` changes nothing. A folder
    that cannot be created is skipped silently: the cache only saves time. Compiled programs
    are the same with or without it, so results do not change.
    """
    if path is not None and os.fspath(path) == "none":
        return None
    if path is None and jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    folder = os.fspath(path) if path is not None else default_cache_dir()
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()  # take the folder into use even if JAX compiled before
    return folder


PROCESS_VARIABLES = ("FUSEDPC_COORDINATOR", "FUSEDPC_NUM_PROCESSES", "FUSEDPC_PROCESS_ID")


def join_processes() -> None:
    """Join a multi-process run (`fusedpc.initialize_distributed`).

    On a cluster (Slurm, Open MPI, TPU pods) JAX reads the processes from the environment.
    Elsewhere, e.g. several processes on one machine, set all three of `FUSEDPC_COORDINATOR`
    (`host:port` of process 0), `FUSEDPC_NUM_PROCESSES` and `FUSEDPC_PROCESS_ID`.
    """
    given = {name: os.environ.get(name) for name in PROCESS_VARIABLES}
    if not any(given.values()):
        initialize_distributed()
        return
    missing = [name for name, value in given.items() if not value]
    if missing:
        raise ValueError(
            f"--distributed: set all of {', '.join(PROCESS_VARIABLES)} or none; "
            f"{', '.join(missing)} missing."
        )
    try:
        count, index = int(given["FUSEDPC_NUM_PROCESSES"]), int(given["FUSEDPC_PROCESS_ID"])
    except ValueError:
        raise ValueError(
            "--distributed: FUSEDPC_NUM_PROCESSES and FUSEDPC_PROCESS_ID must be integers, got "
            f"{given['FUSEDPC_NUM_PROCESSES']!r} and {given['FUSEDPC_PROCESS_ID']!r}."
        ) from None
    initialize_distributed(given["FUSEDPC_COORDINATOR"], count, index)


def _in_step(pipeline, step: int) -> bool:
    """Whether the pipeline's state is alive and at `step` (what the log has recorded)."""
    try:
        return pipeline.steps == step
    except RuntimeError:  # the state was donated to a call that never returned
        return False


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSONL log, in order; a `ValueError` names a malformed line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no log file at {path!r}")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON line ({err.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object per line")
            records.append(record)
    return records


def _write_lines(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def _default_out() -> Path:
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    out = Path("runs") / stamp
    n = 1
    while out.exists():
        n += 1
        out = Path("runs") / f"{stamp}_{n}"
    return out


@dataclasses.dataclass
class TrainResult:
    """What `train` returns: the run's folder, final figures and the live pipeline."""

    out: Path
    config: TrainConfig
    step: int
    train_loss: float
    val_loss: float
    val_perplexity: float
    tokens_per_s: float
    elapsed_s: float
    compile_s: float
    skipped_steps: int
    interrupted: bool
    sample: str
    pipeline: Any
    tokenizer: Any
    files: list[Path]

    def summary_rows(self) -> list[tuple[str, str]]:
        """`(label, value)` rows of the end-of-run table."""
        return [
            ("steps", f"{self.step}" + (" (interrupted)" if self.interrupted else "")),
            ("train loss (last 10 steps)", f"{self.train_loss:.4f}"),
            ("validation loss", f"{self.val_loss:.4f}"),
            ("validation perplexity", f"{self.val_perplexity:.2f}"),
            ("tokens/s (after compiling)",
             f"{self.tokens_per_s:,.0f}" if math.isfinite(self.tokens_per_s) else "-"),
            ("time (all sessions)", format_duration(self.elapsed_s)),
            ("first call (compiling)", f"{self.compile_s:.1f} s"),
            ("skipped steps (non-finite)", f"{self.skipped_steps}"),
            ("output folder", str(self.out)),
        ]


def format_summary(result: TrainResult) -> str:
    rows = result.summary_rows()
    width = max(len(label) for label, _ in rows)
    rule = "-" * (width + 2 + max(len(v) for _, v in rows))
    body = [f"{label:<{width}}  {value}" for label, value in rows]
    return "\n".join([rule, *body, rule])


class _Log:
    """The run's records: kept in memory (for the plots and the summary) and, on the leading
    process, appended to `log.jsonl` as they come."""

    def __init__(self, path: Path, history: list[dict], write: bool):
        self.records = list(history)
        self._file = None
        if write:
            _write_lines(path, self.records)
            self._file = open(path, "a", encoding="utf-8")

    def emit(self, record: dict) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class _Session:
    """One `train` call: the pipeline, the data streams, the log and the clock."""

    def __init__(self, config, out, resume_from, stream, interactive):
        self.config = config
        self.leader = jax.process_index() == 0
        self.processes = jax.process_count()
        self.out = Path(out if out is not None else resume_from or _default_out())
        if resume_from is None and (self.out / CHECKPOINT_NAME).exists():
            raise ValueError(
                f"{str(self.out)!r} already holds a run ({CHECKPOINT_NAME}); continue it with "
                f"--resume {self.out}, or choose another --out."
            )
        checkpoint = None if resume_from is None else Path(resume_from) / CHECKPOINT_NAME
        metadata: dict[str, Any] = {}
        if checkpoint is not None:
            metadata = read_checkpoint_manifest(checkpoint)["metadata"]
            if not isinstance(metadata, dict) or "tokenizer" not in metadata:
                raise ValueError(f"{str(checkpoint)!r} was not written by fusedpc train.")
        text, self.tokenizer, train_ids, self.val_ids = load_tokens(
            config, metadata.get("tokenizer")
        )
        self.text_hash = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if metadata and metadata.get("text_sha256") != self.text_hash:
            raise ValueError(
                f"the text {config.text!r} differs from the one the run was trained on (its "
                "SHA-256 changed); resume with the same text."
            )
        self.mesh = make_mesh(config)
        self.pipeline = build_pipeline(config, self.tokenizer.vocab_size, self.mesh)
        # Each process draws its own rows; batch k depends only on (seed, k).
        self.batches = data.BatchIterator(
            train_ids, config.batch, config.seq, seed=config.seed + jax.process_index()
        )
        self.step, self.elapsed_before = 0, 0.0
        if checkpoint is not None:
            self.pipeline.load(checkpoint)
            self.step = int(metadata["step"])
            self.elapsed_before = float(metadata.get("elapsed_s", 0.0))
            self.batches.load_state_dict({**metadata["data"], "seed": self.batches.seed})
            if self.batches.step != self.step:
                raise ValueError(
                    f"{str(checkpoint)!r}: its data position ({self.batches.step}) and step "
                    f"({self.step}) disagree; the checkpoint was not written by fusedpc train."
                )
            if config.steps <= self.step:
                raise ValueError(
                    f"--steps {config.steps} is not beyond the checkpoint's step {self.step}; "
                    "pass a larger --steps (the total to reach) to continue."
                )
        self.start_step = self.step
        # Validation: the same batches at every evaluation, identical on every process.
        val_iter = data.BatchIterator(
            self.val_ids, config.batch * self.processes, config.seq, seed=config.seed
        )
        self.val_x, self.val_y = val_iter.next_batches(config.eval_batches)
        self.tokens_per_step = config.batch * config.seq * self.processes

        history = []
        if self.leader:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / CONFIG_NAME).write_text(config_to_toml(config), encoding="utf-8")
            previous = None if resume_from is None else Path(resume_from) / LOG_NAME
            if previous is not None and previous.exists():
                history = [r for r in read_log(previous) if int(r.get("step", 0)) <= self.step]
        self.log = _Log(self.out / LOG_NAME, history, write=self.leader)
        self.progress = Progress(
            config.steps, self.step, stream=stream if self.leader else io.StringIO(),
            interactive=interactive,
        )
        self.began = time.perf_counter()
        self.compile_s, self.steady_s, self.steady_tokens = 0.0, 0.0, 0
        self.val_loss, self.val_step = float("nan"), -1
        self.say(
            f"fusedpc train: {config.blocks} blocks, width {config.width}, {config.heads} "
            f"heads, vocabulary {self.tokenizer.vocab_size}, learning {config.learn!r}, "
            f"{config.optimiser} lr {config.lr:g}; {len(train_ids):,} training tokens -> "
            f"{self.out}"
        )
        if resume_from is not None:
            self.say(f"resuming from step {self.step} of {resume_from}")

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.began

    def say(self, text: str) -> None:
        if self.leader:
            self.progress.message(text)

    def evaluate(self) -> None:
        probabilities = self.config.head_kind == "categorical"
        loss = evaluate(self.pipeline, self.val_x, self.val_y, probabilities)
        self.val_loss, self.val_step = loss, self.step
        perplexity = float(np.exp(loss))
        self.log.emit({"kind": "eval", "step": self.step, "val_loss": loss,
                       "val_perplexity": perplexity})
        self.say(f"step {self.step}: validation loss {loss:.4f}, perplexity {perplexity:.2f}")

    def save(self) -> None:
        metadata = {
            "config": dataclasses.asdict(self.config),
            "tokenizer": self.tokenizer.to_dict(),
            "data": self.batches.state_dict(),
            "step": self.step,
            "elapsed_s": self.elapsed(),
            "text_sha256": self.text_hash,
        }
        if self.leader:
            self.pipeline.save(self.out / CHECKPOINT_NAME, metadata)
        self.log.flush()

    def call(self) -> float:
        """One compiled call of `run` (up to the next multiple of `steps_per_call`) and its
        records; returns the last step's loss."""
        config = self.config
        k = call_size(self.step, config.steps, config.steps_per_call)
        xs, ys = self.batches.next_batches(k)
        if self.processes > 1:
            xs, ys = make_global_batch(xs, self.mesh, 1), make_global_batch(ys, self.mesh, 1)
        t0 = time.perf_counter()
        _, _, metrics = self.pipeline.run(xs, ys, keep_outputs=False)
        losses, committed = _host(metrics.loss), _host(metrics.committed)
        dt = time.perf_counter() - t0
        if self.step == self.start_step:
            self.compile_s = dt
        else:
            self.steady_s += dt
            self.steady_tokens += k * self.tokens_per_step
        now = self.elapsed()
        for i in range(k):
            step = self.step + i + 1
            self.log.emit({"kind": "train", "step": step, "loss": float(losses[i]),
                           "time": now - dt * (k - 1 - i) / k,
                           "tokens_per_s": k * self.tokens_per_step / dt,
                           "committed": bool(committed[i])})
            if step % config.report_every == 0:
                for row in self.pipeline.report(index=i):
                    self.log.emit({"kind": "report", "step": step, **row})
        self.step += k
        self.progress.update(self.step, float(losses[-1]), k * self.tokens_per_step)
        if _crossed(config.eval_every, self.step - k, self.step):
            self.evaluate()
        if _crossed(config.save_every, self.step - k, self.step):
            self.save()
        return float(losses[-1])

    def sample(self) -> str:
        prompt = self.val_ids[: max(1, min(16, self.config.seq // 2))]
        key = jax.random.fold_in(jax.random.key(self.config.seed), self.step)
        ids = generate(self.pipeline, prompt[None], self.config.sample_tokens,
                       self.config.temperature, key)
        return self.tokenizer.decode(np.asarray(ids)[0])

    def finish(self, interrupted: bool) -> TrainResult:
        """The last evaluation, the checkpoint, the sample, the summary and the plots."""
        if interrupted:
            self.say(f"interrupted at step {self.step}: saving the checkpoint and the files")
        if self.val_step != self.step:
            self.evaluate()
        self.save()
        self.progress.close()
        sample = ""
        if not interrupted and self.config.sample_tokens > 0 and self.processes == 1:
            sample = self.sample()
        losses = [r["loss"] for r in self.log.records if r.get("kind") == "train"]
        tail = [x for x in losses[-10:] if math.isfinite(x)]
        result = TrainResult(
            out=self.out,
            config=self.config,
            step=self.step,
            train_loss=float(np.mean(tail)) if tail else float("nan"),
            val_loss=self.val_loss,
            val_perplexity=float(np.exp(self.val_loss)),
            tokens_per_s=self.steady_tokens / self.steady_s if self.steady_s else float("nan"),
            elapsed_s=self.elapsed(),
            compile_s=self.compile_s,
            skipped_steps=self.pipeline.skipped_steps,
            interrupted=interrupted,
            sample=sample,
            pipeline=self.pipeline,
            tokenizer=self.tokenizer,
            files=[],
        )
        self.log.emit({"kind": "summary", "step": self.step, "train_loss": result.train_loss,
                       "val_loss": result.val_loss, "val_perplexity": result.val_perplexity,
                       "tokens_per_s": result.tokens_per_s, "elapsed_s": result.elapsed_s,
                       "compile_s": result.compile_s, "skipped_steps": result.skipped_steps,
                       "interrupted": interrupted})
        self.log.close()
        if self.leader:
            result.files = [self.out / CONFIG_NAME, self.out / LOG_NAME,
                            self.out / CHECKPOINT_NAME,
                            *_plots.render_all(self.log.records, self.out)]
        return result


def _crossed(every: int, before: int, after: int) -> bool:
    """Whether a multiple of `every` (> 0) lies in `(before, after]`."""
    return every > 0 and after // every > before // every


def train(
    config: TrainConfig,
    out: str | os.PathLike | None = None,
    *,
    resume_from: str | os.PathLike | None = None,
    stream: TextIO | None = None,
    interactive: bool | None = None,
    callback: Callable[[int, float], bool | None] | None = None,
) -> TrainResult:
    """Train (or continue) a run; see the module docstring for the files it writes.

    Args:
        config: the run's settings (`resolve_config` / `resume_config` make one).
        out: the output folder (default `runs/<timestamp>`; with `resume_from`, that folder).
        resume_from: a run folder to continue from (its `checkpoint.fpc` and log).
        stream: where the progress line and messages go (default `sys.stderr`).
        interactive: force the in-place progress line on or off (default: `stream.isatty()`).
        callback: called after every compiled call with `(step, last loss)`; returning True
            stops the run as Ctrl-C would (checkpoint and files written).

    The first Ctrl-C (or a `KeyboardInterrupt` raised by `callback`) stops after the current
    call, then saves the checkpoint and writes every file; `TrainResult.interrupted` is then
    True. A second Ctrl-C aborts at once without saving (the last checkpoint stays intact).
    """
    config.validate()
    if config.distributed:
        join_processes()
    session = _Session(config, out, resume_from, stream, interactive)
    if session.step == 0:
        session.evaluate()  # the untrained model: the first point of the validation curve
    stop = StopRequest(
        lambda: session.say("stopping after this call (Ctrl-C again to abort at once)")
    )
    try:
        with stop:
            while session.step < config.steps and not stop.requested:
                loss = session.call()
                if callback is not None and callback(session.step, loss):
                    stop.requested = True
    except KeyboardInterrupt:
        # Saving needs the pipeline and the log at the same step: an interrupt inside a
        # call (a second Ctrl-C) aborts without saving.
        if stop.aborted or not _in_step(session.pipeline, session.step):
            session.progress.close()
            session.log.close()
            raise
        stop.requested = True
    return session.finish(interrupted=stop.requested)
