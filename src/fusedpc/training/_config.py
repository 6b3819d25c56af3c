"""The settings of a run: `TrainConfig`, whose model part is a `GPTConfig`, and the flat
settings (the CLI's flags, the TOML file's keys) it is read from and written to.

A setting of the model has the name of the `GPTConfig` field it sets (`n_heads`, `n_blocks`,
`max_len`, ...), plus the learning keywords a run takes: `window`
(`GPTConfig.learning_kwargs["window"]` of `synaptic_uncertainty`), and `inference_steps` and
`inference_rate` (of `"iterative"`). The model's vocabulary
size is not a setting: the tokeniser decides it (`TrainConfig.gpt_config(vocab_size)`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from typing import Any

from fusedpc._deprecation import REMOVED_IN
from fusedpc.training import data
from fusedpc.training._optimisers import DEFAULT_WEIGHT_DECAY, LR_SCHEDULES, OPTIMISERS
from fusedpc.transformer._build import GPT_LEARNING_KINDS, ITERATIVE, SLOTS, GPTConfig

TOKENIZERS = ("char", "byte")
SYNAPTIC = "synaptic_uncertainty"
CALIBRATE_METHODS = ("none", "probe", "auto")
"""`calibrate`'s values: `"auto"` is the method the calibration study supports, `"probe"`."""

MODEL_SETTINGS = (
    "width", "n_heads", "n_blocks", "ff_width", "max_len", "learn", "learning_kind", "window",
    "inference_steps", "inference_rate", "head_kind", "fused_qkv", "hidden_precision", "scan",
    "attention_mixing", "compute_dtype", "norm", "positions", "feed_forward",
)
"""The settings of `TrainConfig.model`: `GPTConfig` fields by their own names, and the learning
keywords (`LEARNING_SETTINGS`)."""
LEARNING_SETTINGS = {SYNAPTIC: ("window",), ITERATIVE: ("inference_steps", "inference_rate")}
"""The flat settings that reach `GPTConfig.learning_kwargs`, per learning kind."""
LEARNING_DEFAULTS = {"window": 0, "inference_steps": 8, "inference_rate": 0.1}

RENAMED = {"heads": "n_heads", "blocks": "n_blocks", "seq": "max_len"}
"""Setting names of fusedpc 0.1 and their `GPTConfig` names. The old names (TOML keys,
`overrides`, `TrainConfig(...)` keywords and attributes, CLI flags) keep working for one
release, with a `DeprecationWarning` (the CLI flags without one)."""



def _deprecated(old: list[str], where: str) -> None:
    renamed = ", ".join(f"{name!r} is now {RENAMED[name]!r}" for name in old)
    warnings.warn(
        f"{where}: settings renamed to GPTConfig's names: {renamed}; the old names will be "
        f"removed in {REMOVED_IN}.",
        DeprecationWarning,
        stacklevel=3,
    )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run (the CLI's flags and the TOML file's keys).

    Each attribute is a key of the TOML table named in brackets. A step's batch is $(B, T)$
    token ids.

    Attributes:
        text: [data] a bundled text name (`"hamlet"`) or the path of a UTF-8 file.
        tokenizer: [data] `"char"` (vocabulary = the text's characters) or `"byte"` (256
            tokens).
        validation_fraction: [data] the share of the text, at its end, held out for
            validation.
        model: [model] a `GPTConfig` (its `vocab_size` is replaced by the tokeniser's). Its
            settings: `width`, `n_heads` (must divide `width`), `n_blocks`, `ff_width`,
            `max_len` (the position table's length, also the tokens per training row $T$);
            `learn`: the learning slots, a preset (`"all"`, `"ff_head"`, `"none"`) or a comma
            list of `token, position, attention, feed_forward, norm, head`; `learning_kind`:
            `"precision_weighted"`, `"standard"`, `"synaptic_uncertainty"` (which needs
            `window` >= 1) or `"iterative"` (the feed-forwards relax for `inference_steps`
            steps at `inference_rate`, `IterativeNetwork`); `head_kind`: `"gaussian"`
            (logits) or `"categorical"` (probabilities); `fused_qkv`, `hidden_precision`,
            `scan`, `attention_mixing` (`"tiles"` or `"dot_product_attention"`) and
            `compute_dtype` (`"float32"` or `"bfloat16"`: activations and matrix products in
            bfloat16, weights, optimiser state, norms and loss in float32), `norm`
            (`"layer"` or `"rms"`), `positions` (`"table"` or `"rotary"`: no position
            table) and `feed_forward` (`"gelu"` or `"swiglu"`) as in `GPTConfig`.
        optimiser: [optimiser] `"adam"`, `"adamw"` or `"sgd"` (`make_optimiser`).
        lr: [optimiser] the learning rate.
        weight_decay: [optimiser] the weight decay (adamw).
        clip: [optimiser] global gradient-norm clipping: every part's gradient scaled by
            `clip / max(global norm, clip)` over all parts together (`FusedPipeline`'s
            `clip_global_norm`, exactly `optax.clip_by_global_norm` of a backprop step);
            0: none.
        lr_schedule: [optimiser] `"constant"` or `"cosine"`: after the warm-up, the rate
            stays at `lr` or decays along a cosine to `lr_final_fraction * lr` at step
            `lr_decay_steps` (`learning_rate_schedule`).
        warmup_steps: [optimiser] steps of linear warm-up from 0 to `lr`; 0: none.
        lr_decay_steps: [optimiser] the step at which the cosine ends (warm-up included);
            0: the run's `steps`, recorded as a number when the run starts, so that a resumed
            run that goes further keeps the schedule it began with.
        lr_final_fraction: [optimiser] the cosine's final rate, as a fraction of `lr`.
        slot_lr_scales: [optimiser] per-slot rate multipliers, e.g. `"head=0.5,attention=2"`
            (such as those a calibration chose, which `fusedpc report` prints); each slot
            then gets its own optimiser.
        calibrate: [optimiser] `"none"`, or `"probe"` (also spelt `"auto"`: the method the
            calibration study supports) to calibrate every slot's rate once during the
            run: at step `calibrate_at`, short trial runs of `probe_steps` steps each try
            every rate at x0.5 and x2 together (climbing on to x4, x8, ... x32 while each
            rung wins), then each slot's, and keep what lowers
            their loss on held-out validation windows beyond its noise
            (`fusedpc.training.probe_rates`). The rates' multipliers live in the optimiser
            state (checkpointed; changing them does not recompile) and are logged.
        calibrate_at: [optimiser] the step of the calibration; 0: 15 % of `steps`, rounded
            to whole calls of `steps_per_call` (recorded as a number when the run starts).
        probe_steps: [optimiser] steps per trial run of the calibration; up to
            `2 |slots| + 8` trials: the baseline, the two global ones, four rungs of the
            global ladder, two per slot and the combined choice.
        steps: [training] the total of steps to reach.
        batch: [training] rows per step per process, $B$.
        steps_per_call: [training] K, the steps per compiled call.
        seed: [training] the seed of the weights and the batches.
        eval_every: [training] steps between validations; 0: only at the start and the end.
        eval_batches: [training] batches per validation.
        report_every: [training] steps between logged report rows.
        save_every: [training] steps between checkpoints; 0: only at the end.
        tensorboard: [training] also write TensorBoard event files into `RUN/tensorboard`
            (needs tensorboardX: `pip install "fusedpc[tensorboard]"`).
        init_from: [training] a run folder whose checkpoint a new run starts from (its
            weights and optimiser state; the step counters start at 0), e.g. to fine-tune at
            a lower `lr`; the model and the optimiser must match. `""`: a fresh model.
        max_update_ratio: [training] the spike guard: a step in which any part's update /
            weight norm ratio exceeds this is not committed (`FusedPipeline`'s
            `max_update_ratio`); 0: no bound.
        loss_spike: [training] a step whose loss exceeds this factor (> 1) times the running
            mean loss is not committed (`FusedPipeline`'s `loss_spike`); 0: no guard.
        sample_tokens: [training] the length of the final sample.
        temperature: [training] the temperature of the final sample.
        devices: [runtime] data-parallel devices (on CPU they are emulated).
        distributed: [runtime] whether to join a multi-process run with
            `jax.distributed.initialize()`.

    The keywords of fusedpc 0.1 (`width=`, `heads=`, `blocks=`, `seq=`, ... at the top level)
    and the attributes of those names still work, with a `DeprecationWarning`; they set and
    read `model`.
    """

    # [data]
    text: str = data.DEFAULT_TEXT
    tokenizer: str = "char"
    validation_fraction: float = 0.1
    # [model]
    model: GPTConfig = dataclasses.field(default_factory=GPTConfig)
    # [optimiser]
    optimiser: str = "adam"
    lr: float = 3e-3
    weight_decay: float = 1e-4
    clip: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    lr_decay_steps: int = 0
    lr_final_fraction: float = 0.1
    slot_lr_scales: str = ""
    calibrate: str = "none"
    calibrate_at: int = 0
    probe_steps: int = 100
    # [training]
    steps: int = 1000
    batch: int = 16
    steps_per_call: int = 10
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    report_every: int = 10
    save_every: int = 0
    init_from: str = ""
    tensorboard: bool = False
    max_update_ratio: float = 0.0
    loss_spike: float = 0.0
    sample_tokens: int = 200
    temperature: float = 0.8
    # [runtime]
    devices: int = 1
    distributed: bool = False

    def calibrated_slots(self) -> tuple[str, ...]:
        """The learning slots a calibration changes the rate of: every learning slot (the
        `synaptic_uncertainty` kind's own steps are scaled by a multiplier too)."""
        return tuple(self.gpt_config(vocab_size=1).learning_slots())

    def calibration_step(self) -> int:
        """The step of the calibration: `calibrate_at`, or 15 % of `steps` rounded to whole
        calls (at least one call) when it is 0."""
        if self.calibrate_at:
            return self.calibrate_at
        per_call = self.steps_per_call
        return max(per_call, int(round(0.15 * self.steps / per_call)) * per_call)

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        """`model` with the tokeniser's `vocab_size`: what `build_gpt` is given."""
        return dataclasses.replace(self.model, vocab_size=vocab_size)

    def validate(self) -> None:
        """Raise a `ValueError` naming the first bad setting and what is allowed."""
        if not isinstance(self.model, GPTConfig):
            raise TypeError(
                f"TrainConfig.model must be a fusedpc.GPTConfig, got {type(self.model).__name__}."
            )
        settings = config_settings(self)
        positive = (
            "width", "n_heads", "n_blocks", "ff_width", "max_len", "steps", "batch",
            "steps_per_call", "eval_batches", "report_every", "devices", "probe_steps",
        )
        for name in positive:
            value = settings[name]
            if not value >= 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        for name in (
            "seed", "eval_every", "save_every", "sample_tokens", "window", "inference_steps",
            "warmup_steps",
            "lr_decay_steps", "calibrate_at",
        ):
            value = settings[name]
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}.")
        model = self.model
        if model.width % model.n_heads:
            raise ValueError(
                f"n_heads={model.n_heads} must divide width={model.width} (each head gets "
                f"width/n_heads features); choose e.g. "
                f"n_heads={_divisor_near(model.width, model.n_heads)}."
            )
        extra = sorted(set(model.learning_kwargs or {}) - set(LEARNING_DEFAULTS))
        if extra:
            raise ValueError(
                f"model.learning_kwargs: a run's settings hold only {sorted(LEARNING_DEFAULTS)}"
                f", got {extra}."
            )
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}.")
        if self.optimiser not in OPTIMISERS:
            raise ValueError(f"optimiser must be one of {OPTIMISERS}, got {self.optimiser!r}.")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}.")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}.")
        if self.optimiser != "adamw" and self.weight_decay != DEFAULT_WEIGHT_DECAY:
            # no silently ignored setting: the decay is adamw's (decoupled from the gradient)
            raise ValueError(
                f"weight_decay={self.weight_decay!r} applies to the adamw optimiser only; "
                f"choose --optimiser adamw, or leave weight_decay at its default with "
                f"{self.optimiser}."
            )
        self.lr_scales()
        if not 0 < self.validation_fraction < 1:
            raise ValueError(
                f"validation_fraction must lie strictly between 0 and 1, got "
                f"{self.validation_fraction!r}."
            )
        if not (self.clip >= 0 and math.isfinite(self.clip)):
            raise ValueError(f"clip must be a finite number >= 0 (0: none), got {self.clip!r}.")
        if self.clip and self.model.learning_kind == SYNAPTIC:
            raise ValueError(
                "clip: global gradient clipping applies to parts that learn through an optax "
                "optimiser; learning_kind 'synaptic_uncertainty' has none. Use clip = 0."
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}."
            )
        if not 0 <= self.lr_final_fraction <= 1:
            raise ValueError(
                f"lr_final_fraction must lie in [0, 1], got {self.lr_final_fraction!r}."
            )
        if self.lr_schedule == "constant" and 0 < self.steps <= self.warmup_steps:
            # as the cosine schedule's check below: a warm-up that outlasts the run
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must be below steps ({self.steps}): the "
                "warm-up would outlast the run, which then never trains at lr."
            )
        decay = self.lr_decay_steps or self.steps
        if self.lr_schedule == "cosine" and decay <= self.warmup_steps:
            raise ValueError(
                f"lr_decay_steps ({decay}) must exceed warmup_steps ({self.warmup_steps}) for "
                "the cosine schedule."
            )
        if self.calibrate not in CALIBRATE_METHODS:
            raise ValueError(
                f"calibrate must be one of {CALIBRATE_METHODS}, got {self.calibrate!r}."
            )
        if self.calibrate != "none" and not self.calibrated_slots():
            raise ValueError(
                f"calibrate={self.calibrate!r}: no slot of this model learns "
                f"(learn={self.model.learn!r}), so there is no rate to calibrate; use "
                "calibrate = \"none\", or name the slots that learn."
            )
        if not (self.max_update_ratio >= 0 and math.isfinite(self.max_update_ratio)):
            raise ValueError(
                f"max_update_ratio must be a finite number >= 0 (0: no bound), got "
                f"{self.max_update_ratio!r}."
            )
        if not (self.loss_spike == 0 or self.loss_spike > 1 and math.isfinite(self.loss_spike)):
            raise ValueError(
                f"loss_spike must be 0 (no guard) or a finite factor > 1, got {self.loss_spike!r}."
            )
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}.")
        if model.learning_kind not in GPT_LEARNING_KINDS:
            raise ValueError(
                f"learning_kind must be one of {GPT_LEARNING_KINDS}, got "
                f"{model.learning_kind!r}."
            )
        if model.learning_kind == ITERATIVE:
            if not (isinstance(settings["inference_rate"], float | int)
                    and settings["inference_rate"] > 0
                    and math.isfinite(settings["inference_rate"])):
                raise ValueError(
                    f"inference_rate must be a positive number, got "
                    f"{settings['inference_rate']!r}."
                )
        if model.learning_kind == SYNAPTIC and settings["window"] < 1:
            raise ValueError(
                "learning_kind 'synaptic_uncertainty' needs window >= 1 (the number of steps "
                "its per-weight beliefs average over); pass e.g. --window 100."
            )
        if self.batch % self.devices:
            raise ValueError(
                f"batch={self.batch} must divide over devices={self.devices}; use a multiple "
                f"of {self.devices}."
            )
        self.gpt_config(vocab_size=1).validate()  # learn slots, head kind, scan

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


def _divisor_near(width: int, heads: int) -> int:
    return min((d for d in range(1, width + 1) if width % d == 0), key=lambda d: abs(d - heads))


# --------------------------------------------------------------------------- flat settings
_RUN_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name != "model")


def _model_settings(model: GPTConfig) -> dict[str, Any]:
    out = {
        name: getattr(model, name) for name in MODEL_SETTINGS if name not in LEARNING_DEFAULTS
    }
    if not isinstance(out["learn"], str):
        out["learn"] = ",".join(out["learn"])
    given = model.learning_kwargs or {}
    for name, default in LEARNING_DEFAULTS.items():
        out[name] = type(default)(given.get(name, default))
    return out


def _model_from(model: GPTConfig, settings: dict[str, Any]) -> GPTConfig:
    """`model` with the model `settings` (`MODEL_SETTINGS` names) applied."""
    merged = {**_model_settings(model), **settings}
    learning = {name: merged.pop(name) for name in LEARNING_DEFAULTS}
    # As in fusedpc 0.1: a learning keyword reaches the model only with the kind that uses it.
    names = LEARNING_SETTINGS.get(merged["learning_kind"], ())
    kwargs = {name: learning[name] for name in names} or None
    return dataclasses.replace(model, learning_kwargs=kwargs, **merged)


def config_settings(config: TrainConfig) -> dict[str, Any]:
    """The flat settings of `config`, named as in `SECTIONS` (what its TOML file holds)."""
    run = {name: getattr(config, name) for name in _RUN_FIELDS}
    model = _model_settings(config.model)
    return {name: model[name] if name in model else run[name] for name in SETTINGS}


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
    return dataclasses.replace(base, model=_model_from(base.model, model), **run)


def _settings_defaults() -> dict[str, Any]:
    default = TrainConfig()
    run = {name: getattr(default, name) for name in _RUN_FIELDS}
    model = _model_settings(default.model)
    order = [*_RUN_FIELDS[:3], *MODEL_SETTINGS, *_RUN_FIELDS[3:]]
    return {name: model[name] if name in model else run[name] for name in order}


SETTINGS: dict[str, Any] = _settings_defaults()
"""Every flat setting and its default, in the order of `SECTIONS`."""

SECTIONS: dict[str, tuple[str, ...]] = {
    "data": ("text", "tokenizer", "validation_fraction"),
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
        "sample_tokens", "temperature",
    ),
    "runtime": ("devices", "distributed"),
}

_TYPES = {name: type(value) for name, value in SETTINGS.items()}


def coerce_settings(settings: dict[str, Any], where: str) -> dict[str, Any]:
    """Check the names and types of `settings` (as read from TOML or given in Python).

    Integers are accepted for float settings; a list of slot names for `learn`; `true`,
    `false` or `"auto"` for `scan`. The names of fusedpc 0.1 (`RENAMED`: `heads`, `blocks`,
    `seq`) are accepted with a `DeprecationWarning` and returned under their new names.
    """
    out = {}
    old = [name for name in settings if name in RENAMED]
    for name in old:
        if RENAMED[name] in settings:
            raise ValueError(
                f"{where}: {name!r} and {RENAMED[name]!r} name the same setting; give only "
                f"{RENAMED[name]!r}."
            )
    if old:
        _deprecated(old, where)
    for name, value in settings.items():
        name = RENAMED.get(name, name)
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


# --------------------------------------------------------------------------- 0.1 names
_OLD_MODEL_KEYWORDS = frozenset(
    {"width", "ff_width", "learn", "learning_kind", "window", "head_kind", *RENAMED}
)
_dataclass_init = TrainConfig.__init__


def _init(self, *args, **kwargs):
    old = {name: kwargs.pop(name) for name in list(kwargs) if name in _OLD_MODEL_KEYWORDS}
    if old:
        warnings.warn(
            f"TrainConfig({', '.join(f'{k}=' for k in old)}): the model's settings are now "
            f"TrainConfig.model, a GPTConfig (e.g. TrainConfig(model=GPTConfig(n_heads=8))); "
            f"the top-level keywords will be removed in {REMOVED_IN}.",
            DeprecationWarning,
            stacklevel=2,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            settings = coerce_settings(old, "TrainConfig")
        kwargs["model"] = _model_from(kwargs.get("model", GPTConfig()), settings)
    _dataclass_init(self, *args, **kwargs)


_init.__doc__ = _dataclass_init.__doc__
_init.__signature__ = inspect.signature(_dataclass_init)  # type: ignore[attr-defined]  # read by inspect
TrainConfig.__init__ = _init  # type: ignore[method-assign]  # the dataclass's, taking the old keywords too


def _old_attribute(name: str) -> property:
    new = RENAMED.get(name, name)

    def get(self: TrainConfig) -> Any:
        warnings.warn(
            f"TrainConfig.{name} is now TrainConfig.model.{new}"
            + (" (GPTConfig's name)" if name in RENAMED else "")
            + f"; the old attribute will be removed in {REMOVED_IN}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return _model_settings(self.model)[new]

    get.__name__ = name
    return property(get, doc=f"Deprecated: `model.{new}`.")


for _name in sorted(_OLD_MODEL_KEYWORDS):
    setattr(TrainConfig, _name, _old_attribute(_name))
