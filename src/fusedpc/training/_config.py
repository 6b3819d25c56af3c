"""The settings of a run: `TrainConfig`, whose model part is a `GPTConfig`, and the checks
that `TrainConfig.validate` makes of them.

Its flat form (the CLI's flags, the TOML file's keys) is that of
`fusedpc.training._settings`; the model's flat settings are those of
`fusedpc.training._model_settings`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fusedpc.execution._step_settings import StepSettings
from fusedpc.training import data
from fusedpc.training._model_settings import LEARNING_DEFAULTS, SYNAPTIC, model_settings
from fusedpc.training._optimisers import DEFAULT_WEIGHT_DECAY, LR_SCHEDULES, OPTIMISERS
from fusedpc.transformer._build import GPTConfig
from fusedpc.transformer._slots import GPT_LEARNING_KINDS, ITERATIVE, SLOTS

TOKENIZERS = ("char", "byte")
CALIBRATE_METHODS = ("none", "probe", "auto")
"""`calibrate`'s values: `"auto"` is the method the calibration study supports, `"probe"`."""


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
        data: [data] a prepared corpus folder (`fusedpc prepare`: memory-mapped `train.bin`
            and `val.bin`, its tokeniser in `meta.json`), which replaces `text`,
            `tokenizer` and `validation_fraction`; `""` (the default): train on `text`.
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
        infill_hide_every: [training] at the end of the run, hide every K-th token of the
            validation windows, infer them as generative latents (`fusedpc infill`) and
            report the fill-in and the causal readout's accuracy in the summary; 0: not.
        devices: [runtime] data-parallel devices (on CPU they are emulated).
        distributed: [runtime] whether to join a multi-process run with
            `jax.distributed.initialize()`.

    The keywords of fusedpc 0.1 at the top level (`width=`, `heads=`, ...), deprecated in 0.2,
    were removed in 0.4.0: the model's settings are those of `model`
    (`TrainConfig(model=GPTConfig(n_heads=8))`, `config.model.n_heads`).
    """

    # [data]
    text: str = data.DEFAULT_TEXT
    tokenizer: str = "char"
    validation_fraction: float = 0.1
    data: str = ""
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
    infill_hide_every: int = 0
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

    @property
    def step_settings(self) -> StepSettings:
        """The run's step guards as the library's `fusedpc.StepSettings` (what the run's
        `FusedPipeline` gets): the file's and the CLI's 0 (off) is the library's None. The
        compute dtype is the model's own (`model.compute_dtype`)."""
        return StepSettings(max_update_ratio=self.max_update_ratio or None,
                            loss_spike=self.loss_spike or None,
                            clip_global_norm=self.clip or None)

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        """`model` with the tokeniser's `vocab_size`: what `build_gpt` is given."""
        return dataclasses.replace(self.model, vocab_size=vocab_size)

    def validate(self) -> None:
        """Raise a `ValueError` naming the first bad setting and what is allowed (a
        `TypeError` when `model` is not a `GPTConfig`)."""
        for check in _CHECKS:
            check(self)
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


RUN_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name != "model")
"""The settings of a run besides its model's, in the order of `TrainConfig`'s fields."""


def setting_values(config: TrainConfig) -> dict[str, Any]:
    """Every flat setting of `config` by name: its run fields and its model's settings
    (`model_settings`)."""
    run = {name: getattr(config, name) for name in RUN_FIELDS}
    return {**run, **model_settings(config.model)}


# --------------------------------------------------------------------------- the checks
# `TrainConfig.validate` runs them in the order of `_CHECKS`: the first bad setting is named.
_POSITIVE = (
    "width", "n_heads", "n_blocks", "ff_width", "max_len", "steps", "batch",
    "steps_per_call", "eval_batches", "report_every", "devices", "probe_steps",
)
_NON_NEGATIVE = (
    "seed", "eval_every", "save_every", "sample_tokens", "window", "inference_steps",
    "warmup_steps", "lr_decay_steps", "calibrate_at",
)


def _check_model_type(config: TrainConfig) -> None:
    if not isinstance(config.model, GPTConfig):
        raise TypeError(
            f"TrainConfig.model must be a fusedpc.GPTConfig, got {type(config.model).__name__}."
        )


def _check_counts(config: TrainConfig) -> None:
    values = setting_values(config)
    for name in _POSITIVE:
        if not values[name] >= 1:
            raise ValueError(f"{name} must be a positive integer, got {values[name]!r}.")
    for name in _NON_NEGATIVE:
        if not values[name] >= 0:
            raise ValueError(f"{name} must be >= 0, got {values[name]!r}.")


def _check_heads_and_learning_kwargs(config: TrainConfig) -> None:
    model = config.model
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


def _divisor_near(width: int, heads: int) -> int:
    return min((d for d in range(1, width + 1) if width % d == 0), key=lambda d: abs(d - heads))


def _check_tokenizer(config: TrainConfig) -> None:
    if config.tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {config.tokenizer!r}.")


def _check_optimiser(config: TrainConfig) -> None:
    if config.optimiser not in OPTIMISERS:
        raise ValueError(f"optimiser must be one of {OPTIMISERS}, got {config.optimiser!r}.")
    if not (config.lr > 0 and math.isfinite(config.lr)):
        raise ValueError(f"lr must be a positive number, got {config.lr!r}.")
    if not config.weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {config.weight_decay!r}.")
    if config.optimiser != "adamw" and config.weight_decay != DEFAULT_WEIGHT_DECAY:
        # no silently ignored setting: the decay is adamw's (decoupled from the gradient)
        raise ValueError(
            f"weight_decay={config.weight_decay!r} applies to the adamw optimiser only; "
            f"choose --optimiser adamw, or leave weight_decay at its default with "
            f"{config.optimiser}."
        )
    config.lr_scales()


def _check_validation_fraction(config: TrainConfig) -> None:
    if not 0 < config.validation_fraction < 1:
        raise ValueError(
            f"validation_fraction must lie strictly between 0 and 1, got "
            f"{config.validation_fraction!r}."
        )


def _check_clip(config: TrainConfig) -> None:
    if not (config.clip >= 0 and math.isfinite(config.clip)):
        raise ValueError(f"clip must be a finite number >= 0 (0: none), got {config.clip!r}.")
    if config.clip and config.model.learning_kind == SYNAPTIC:
        raise ValueError(
            "clip: global gradient clipping applies to parts that learn through an optax "
            "optimiser; learning_kind 'synaptic_uncertainty' has none. Use clip = 0."
        )


def _check_schedule(config: TrainConfig) -> None:
    if config.lr_schedule not in LR_SCHEDULES:
        raise ValueError(
            f"lr_schedule must be one of {LR_SCHEDULES}, got {config.lr_schedule!r}."
        )
    if not 0 <= config.lr_final_fraction <= 1:
        raise ValueError(
            f"lr_final_fraction must lie in [0, 1], got {config.lr_final_fraction!r}."
        )
    if config.lr_schedule == "constant" and 0 < config.steps <= config.warmup_steps:
        # as the cosine schedule's check below: a warm-up that outlasts the run
        raise ValueError(
            f"warmup_steps ({config.warmup_steps}) must be below steps ({config.steps}): the "
            "warm-up would outlast the run, which then never trains at lr."
        )
    decay = config.lr_decay_steps or config.steps
    if config.lr_schedule == "cosine" and decay <= config.warmup_steps:
        raise ValueError(
            f"lr_decay_steps ({decay}) must exceed warmup_steps ({config.warmup_steps}) for "
            "the cosine schedule."
        )


def _check_calibration(config: TrainConfig) -> None:
    if config.calibrate not in CALIBRATE_METHODS:
        raise ValueError(
            f"calibrate must be one of {CALIBRATE_METHODS}, got {config.calibrate!r}."
        )
    if config.calibrate != "none" and not config.calibrated_slots():
        raise ValueError(
            f"calibrate={config.calibrate!r}: no slot of this model learns "
            f"(learn={config.model.learn!r}), so there is no rate to calibrate; use "
            "calibrate = \"none\", or name the slots that learn."
        )


def _check_guards(config: TrainConfig) -> None:
    if not (config.max_update_ratio >= 0 and math.isfinite(config.max_update_ratio)):
        raise ValueError(
            f"max_update_ratio must be a finite number >= 0 (0: no bound), got "
            f"{config.max_update_ratio!r}."
        )
    spike = config.loss_spike
    if not (spike == 0 or spike > 1 and math.isfinite(spike)):
        raise ValueError(
            f"loss_spike must be 0 (no guard) or a finite factor > 1, got {spike!r}."
        )


def _check_temperature(config: TrainConfig) -> None:
    if not config.temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {config.temperature!r}.")
    if config.infill_hide_every == 1 or config.infill_hide_every < 0:
        raise ValueError(f"infill_hide_every must be 0 (no fill-in) or >= 2 (1 would hide "
                         f"every token), got {config.infill_hide_every!r}.")


def _check_learning_kind(config: TrainConfig) -> None:
    kind = config.model.learning_kind
    if kind not in GPT_LEARNING_KINDS:
        raise ValueError(f"learning_kind must be one of {GPT_LEARNING_KINDS}, got {kind!r}.")
    values = model_settings(config.model)
    rate = values["inference_rate"]
    if kind == ITERATIVE and not (
        isinstance(rate, float | int) and rate > 0 and math.isfinite(rate)
    ):
        raise ValueError(f"inference_rate must be a positive number, got {rate!r}.")
    if kind == SYNAPTIC and values["window"] < 1:
        raise ValueError(
            "learning_kind 'synaptic_uncertainty' needs window >= 1 (the number of steps "
            "its per-weight beliefs average over); pass e.g. --window 100."
        )


def _check_batch(config: TrainConfig) -> None:
    if config.batch % config.devices:
        raise ValueError(
            f"batch={config.batch} must divide over devices={config.devices}; use a multiple "
            f"of {config.devices}."
        )


_CHECKS = (
    _check_model_type, _check_counts, _check_heads_and_learning_kwargs, _check_tokenizer,
    _check_optimiser, _check_validation_fraction, _check_clip, _check_schedule,
    _check_calibration, _check_guards, _check_temperature, _check_learning_kind, _check_batch,
)
