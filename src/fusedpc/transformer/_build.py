"""`GPTConfig` and `build_gpt`: a GPT part from a config, at the weights of a reference GPT
drawn from a key, with learning parts asked for by slot name (`hybrid_from_gpt(learn=...)`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import optax

from fusedpc.core._precision import resolve_compute_dtype
from fusedpc.parts._attention import MIXINGS
from fusedpc.transformer._gpt import GPTPart
from fusedpc.transformer._hybrid import hybrid_from_gpt
from fusedpc.transformer._latents import LATENT_PLACES, with_latents
from fusedpc.transformer._slots import (
    GPT_LEARNING_KINDS,
    ITERATIVE,
    LEARNING_PRESETS,
    SLOTS,
    no_position_table,
)
from fusedpc.transformer._stacking import blocks_form
from fusedpc.transformer.reference import FEED_FORWARDS, GPT, NORMS, POSITIONS

PARAMETERISATIONS = ("standard", "mupc")
"""`GPTConfig.parameterisation` (and `fusedpc train --parameterisation`)."""


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Size and learning choices of a GPT part.

    `learn` names the slots that learn (`"token"`, `"position"`, `"attention"`,
    `"feed_forward"`, `"norm"`, `"head"`), or a preset `"all"`, `"ff_head"`, `"none"`.
    `head_kind` `"gaussian"` outputs logits (error `softmax_cross_entropy`); `"categorical"`
    outputs probabilities (error `cross_entropy`); both give the cross-entropy gradient.
    `scan` is `hybrid_from_gpt`'s: `"auto"` (unrolled up to `AUTO_UNROLL_BLOCKS` blocks,
    scanned beyond), `True` (always scanned) or `False` (a `Blocks` chain).
    `attention_mixing` (`"tiles"` or `"dot_product_attention"`) and `compute_dtype`
    (`"float32"`, or `"bfloat16"`, also spelt `"bf16"`) are `hybrid_from_gpt`'s too.
    `learning_kind` is `hybrid_from_gpt`'s (a learning part's kind, or `"iterative"`:
    the feed-forwards learn by iterative inference, `learning_kwargs` their settings).
    `norm` (`"layer"` or `"rms"`), `positions` (`"table"` or `"rotary"`: no position table,
    the head width `width / n_heads` even) and `feed_forward` (`"gelu"` or `"swiglu"`) are the
    reference GPT's options (`fusedpc.transformer.reference.GPT`); with rotary positions the
    presets leave out `"position"` and naming it in `learn` is an error.
    `latents` (`"none"`, `"blocks"`, `"all"`) puts `fusedpc.Latent`s of precision
    `latent_precision` in the GPT (`fusedpc.transformer.with_latents`): its step then
    relaxes them on the one energy of the whole transformer, `relaxation_steps` sweeps at
    `relaxation_rate`, or fewer once the energy's relative change is below
    `relaxation_tolerance` (None: always all), the weights stepping at every sweep with
    `relaxation_incremental` (what `fusedpc train` makes its `fusedpc.Relaxation` of).
    `parameterisation` `"mupc"` scales both residual branches of every block by
    $1/\\sqrt{2L}$ (L = `n_blocks`; `branch_scale` of the reference `Block` and of the
    `TransformerBlock`), the depth multiplier of μPC (`fusedpc.residual_pc_network`), so the
    residual stream, the errors and the effect of a weight step on the stream stay of the same
    size at any depth; `"standard"` (the default) adds the branches as they are.
    """

    vocab_size: int = 65
    width: int = 64
    n_heads: int = 4
    n_blocks: int = 2
    ff_width: int = 256
    max_len: int = 64
    learn: tuple[str, ...] | str = "all"
    learning_kind: str = "precision_weighted"
    learning_kwargs: dict | None = None
    fused_qkv: bool = False
    head_kind: str = "gaussian"
    hidden_precision: float = 1.0
    scan: bool | str = "auto"
    attention_mixing: str = "tiles"
    compute_dtype: str = "float32"
    norm: str = "layer"
    positions: str = "table"
    feed_forward: str = "gelu"
    latents: str = "none"
    latent_precision: float = 1.0
    relaxation_steps: int = 8
    relaxation_rate: float = 0.1
    relaxation_tolerance: float | None = None
    relaxation_incremental: bool = False
    parameterisation: str = "standard"

    @property
    def branch_scale(self) -> float:
        """Every block's residual-branch multiplier: $1/\\sqrt{2L}$ under `"mupc"`, else 1."""
        return 1.0 / math.sqrt(2 * self.n_blocks) if self.parameterisation == "mupc" else 1.0

    def learning_slots(self) -> tuple[str, ...]:
        """The slots that learn, in `SLOTS` order for a preset (without `"position"` under
        rotary positions, which have no table)."""
        learn = self.learn
        if isinstance(learn, str):
            if learn in LEARNING_PRESETS:
                preset = LEARNING_PRESETS[learn]
                if self.positions == "rotary":
                    return tuple(slot for slot in preset if slot != "position")
                return preset
            learn = tuple(s.strip() for s in learn.split(",") if s.strip())
        unknown = sorted(set(learn) - set(SLOTS))
        if unknown:
            raise ValueError(
                f"GPTConfig.learn: unknown slots {unknown}; choose from {SLOTS} or a preset "
                f"{sorted(LEARNING_PRESETS)}."
            )
        if self.positions == "rotary" and "position" in learn:
            raise no_position_table(f"GPTConfig.learn={self.learn!r}")
        return tuple(learn)

    def validate(self) -> None:
        for name in ("vocab_size", "width", "n_heads", "n_blocks", "ff_width", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}.")
        if self.width % self.n_heads:
            raise ValueError(
                f"GPTConfig: n_heads={self.n_heads} must divide width={self.width}."
            )
        if self.head_kind not in ("gaussian", "categorical"):
            raise ValueError(
                f"GPTConfig.head_kind must be 'gaussian' or 'categorical', got {self.head_kind!r}."
            )
        blocks_form(self.scan, self.n_blocks, "GPTConfig.scan")
        if self.attention_mixing not in MIXINGS:
            raise ValueError(
                f"GPTConfig.attention_mixing must be one of {MIXINGS}, got "
                f"{self.attention_mixing!r}."
            )
        resolve_compute_dtype(self.compute_dtype, "GPTConfig.compute_dtype")
        for name, allowed in (("norm", NORMS), ("positions", POSITIONS),
                              ("feed_forward", FEED_FORWARDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"GPTConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}."
                )
        if self.learning_kind not in GPT_LEARNING_KINDS:
            raise ValueError(
                f"GPTConfig.learning_kind must be one of {GPT_LEARNING_KINDS}, got "
                f"{self.learning_kind!r}."
            )
        if self.learning_kind == ITERATIVE:
            if self.feed_forward != "gelu":
                raise ValueError(
                    "GPTConfig: learning_kind='iterative' relaxes the hidden layer of each "
                    "feed-forward (linear, GELU, linear), which needs feed_forward='gelu', got "
                    f"{self.feed_forward!r}."
                )
            if "feed_forward" not in self.learning_slots():
                raise ValueError(
                    "GPTConfig: learning_kind='iterative' makes the learning feed-forwards "
                    f"relax, but learn={self.learn!r} has no 'feed_forward'; add it (or the "
                    "preset 'all' or 'ff_head')."
                )
        if self.positions == "rotary" and (self.width // self.n_heads) % 2:
            raise ValueError(
                f"GPTConfig: positions='rotary' rotates pairs of features in each head, so the "
                f"head width width / n_heads must be even, got {self.width} / {self.n_heads} = "
                f"{self.width // self.n_heads}."
            )
        if self.parameterisation not in PARAMETERISATIONS:
            raise ValueError(f"GPTConfig.parameterisation must be one of {PARAMETERISATIONS}, "
                             f"got {self.parameterisation!r}.")
        if self.latents not in LATENT_PLACES:
            raise ValueError(
                f"GPTConfig.latents must be one of {LATENT_PLACES}, got {self.latents!r}.")
        for name in ("latent_precision", "relaxation_rate"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"GPTConfig.{name} must be a finite number > 0, got {value!r}.")
        tolerance = self.relaxation_tolerance
        if tolerance is not None and not (isinstance(tolerance, int | float)
                                          and math.isfinite(tolerance) and tolerance > 0):
            raise ValueError(f"GPTConfig.relaxation_tolerance must be None or a finite number "
                             f"> 0, got {tolerance!r}.")
        if isinstance(self.relaxation_steps, bool) or not isinstance(
                self.relaxation_steps, int) or self.relaxation_steps < 1:
            raise ValueError(f"GPTConfig.relaxation_steps must be an integer >= 1, got "
                             f"{self.relaxation_steps!r}.")
        self.learning_slots()

    @property
    def error_fn(self) -> str:
        return "cross_entropy" if self.head_kind == "categorical" else "softmax_cross_entropy"


def build_gpt(
    config: GPTConfig,
    optimiser: optax.GradientTransformation | None,
    key: jax.Array,
    *,
    slot_optimisers: dict[str, optax.GradientTransformation | None] | None = None,
) -> tuple[GPTPart, GPT]:
    """A reference GPT drawn from `key` and the GPT part built from it per `config`.

    `slot_optimisers` gives some slots (`"token"`, `"position"`, `"attention"`,
    `"feed_forward"`, `"norm"`, `"head"`) an optimiser of their own — e.g. the per-part rates
    that `fusedpc report` suggests — instead of `optimiser`. Returns `(part, reference)`: the
    reference is the backprop twin at the same weights.
    """
    config.validate()
    slot_optimisers = dict(slot_optimisers or {})
    unknown = sorted(set(slot_optimisers) - set(SLOTS))
    if unknown:
        raise ValueError(f"build_gpt: slot_optimisers has unknown slots {unknown}; choose from "
                         f"{SLOTS}.")
    reference = GPT(
        config.vocab_size,
        config.width,
        config.n_heads,
        config.n_blocks,
        config.ff_width,
        config.max_len,
        key=key,
        norm=config.norm,
        positions=config.positions,
        feed_forward=config.feed_forward,
        branch_scale=config.branch_scale,
    )
    learn = {slot: slot_optimisers.get(slot, optimiser) for slot in config.learning_slots()}
    part = hybrid_from_gpt(
        reference,
        learn=learn,
        learning_kind=config.learning_kind,
        learning_kwargs=config.learning_kwargs,
        hidden_precision=config.hidden_precision,
        fused_qkv=config.fused_qkv,
        attention_mixing=config.attention_mixing,
        compute_dtype=config.compute_dtype,
        scan=config.scan,
        output="probabilities" if config.head_kind == "categorical" else "logits",
    )
    return with_latents(part, config.latents, config.latent_precision), reference
