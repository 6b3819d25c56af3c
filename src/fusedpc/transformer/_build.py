"""Builders of GPT parts: from a reference equinox GPT, and from a config.

`hybrid_from_gpt` keeps every slot frozen at the reference weights unless a part is given for
it, so the all-frozen tree reproduces the reference logits and any slot can be swapped for a
learning part initialised at the same weights. `build_gpt` draws a reference GPT from a key
and asks for learning parts by slot name. Both follow the reference's options: LayerNorm or
RMSNorm, a position table or rotary positions, a GELU or a SwiGLU feed-forward.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import equinox as eqx
import jax
import optax

from fusedpc.core._checks import check_part
from fusedpc.core._part import AbstractPart, LayerNormParams, LinearParams, TableParams
from fusedpc.core._precision import resolve_compute_dtype
from fusedpc.parts import frozen, transplant
from fusedpc.parts._attention import MIXINGS, MultiHeadAttention
from fusedpc.parts._compose import Sequential
from fusedpc.parts._repeat import Repeat
from fusedpc.parts.frozen import RMSNormParams
from fusedpc.parts.learning._iterative import RELAXATION_SETTINGS
from fusedpc.parts.learning._local_update import LEARNING_KINDS, RateMultiplier
from fusedpc.transformer._gpt import Blocks, GPTPart, TransformerBlock
from fusedpc.transformer.reference import (
    FEED_FORWARDS,
    GPT,
    NORMS,
    POSITIONS,
    FeedForward,
    SwiGLU,
)

# `scan="auto"` unrolls this many blocks or fewer (see `hybrid_from_gpt`).
AUTO_UNROLL_BLOCKS = 4
SCAN_CHOICES = (True, False, "auto")


def blocks_form(scan: bool | str, n_blocks: int, where: str = "scan") -> str:
    """How `hybrid_from_gpt(scan=...)` runs `n_blocks` identical blocks: `"scanned"` (a
    `Repeat` in a `lax.scan`), `"unrolled"` (a `Repeat` unrolled) or `"tuple"` (independent
    blocks in a `Blocks` chain; the name is kept from when they were a bare tuple). `where`
    names the setting in the error for a `scan` that is none of `SCAN_CHOICES`."""
    if scan not in SCAN_CHOICES:
        raise ValueError(f"{where} must be True, False or 'auto', got {scan!r}.")
    if scan is False:
        return "tuple"
    if scan == "auto" and n_blocks <= AUTO_UNROLL_BLOCKS:
        return "unrolled"
    return "scanned"

SLOTS = ("token", "position", "attention", "feed_forward", "norm", "head")
ITERATIVE = "iterative"
# every kind of a learning part, and "iterative": the feed-forwards relax (IterativeNetwork)
GPT_LEARNING_KINDS = (*LEARNING_KINDS, ITERATIVE)
ITERATIVE_SETTINGS = RELAXATION_SETTINGS  # what learning_kwargs may set for "iterative"
LEARNING_PRESETS = {
    "all": SLOTS,
    "ff_head": ("feed_forward", "head"),
    "none": (),
}
_ATTENTION_KEYS = ("wq", "wk", "wv", "wo", "wqkv")


def _per_block(value: Any, n_blocks: int, what: str) -> list:
    if value is None:
        return [None] * n_blocks
    if callable(value) and not isinstance(value, AbstractPart):
        return [value(i) for i in range(n_blocks)]
    value = list(value)
    if len(value) != n_blocks:
        raise ValueError(
            f"hybrid_from_gpt: {what} must have one entry per block ({n_blocks}), got "
            f"{len(value)}."
        )
    return value


def _attention_part(
    attn, given: dict | None, where: str, mixing: str = "tiles"
) -> MultiHeadAttention:
    given = dict(given or {})
    options = {"mixing": mixing, "positions": attn.positions, "rotary_base": attn.rotary_base}
    unknown = sorted(set(given) - set(_ATTENTION_KEYS))
    if unknown:
        raise ValueError(
            f"hybrid_from_gpt: {where} has unknown keys {unknown}; allowed: {_ATTENTION_KEYS}."
        )
    wo = given.get("wo") or frozen.linear(attn.wo)
    if "wqkv" in given:
        if {"wq", "wk", "wv"} & set(given):
            raise ValueError(
                f"hybrid_from_gpt: {where} gives 'wqkv' together with separate wq/wk/wv; give "
                "one or the other."
            )
        return MultiHeadAttention(wqkv=given["wqkv"], wo=wo, n_heads=attn.n_heads, **options)
    slots: dict[str, Any] = {
        name: given.get(name) or frozen.linear(getattr(attn, name)) for name in ("wq", "wk", "wv")
    }
    return MultiHeadAttention(**slots, wo=wo, n_heads=attn.n_heads, **options)


def _frozen_norm(norm: eqx.nn.LayerNorm | eqx.nn.RMSNorm) -> AbstractPart:
    """The frozen part of a reference norm: `frozen.rms_norm` or `frozen.layer_norm`."""
    if isinstance(norm, eqx.nn.RMSNorm):
        return frozen.rms_norm(norm)
    return frozen.layer_norm(norm)


def _frozen_feed_forward(ff) -> AbstractPart:
    """The frozen part of a reference feed-forward: a SwiGLU's `frozen.swiglu`, or linear,
    GELU, linear."""
    if isinstance(ff, SwiGLU):
        return frozen.swiglu(ff.gate, ff.up, ff.down)
    return Sequential([frozen.linear(ff.fc1), frozen.gelu(), frozen.linear(ff.fc2)])


def _no_position_table(where: str) -> ValueError:
    return ValueError(
        f"{where} names the slot 'position', but this GPT has rotary positions "
        "(positions='rotary'): there is no position table to learn or replace; drop "
        "'position'."
    )


_SLOT_ARGUMENTS = {
    "token": "token_part",
    "position": "position_part",
    "attention": "attention_parts",
    "feed_forward": "ff_parts",
    "norm": "norm_parts",
    "head": "head_part",
}


def _learning_slots(
    gpt: GPT,
    learn: Mapping[str, optax.GradientTransformation | None],
    given: dict[str, Any],
    *,
    learning_kind: str,
    learning_kwargs: dict | None,
    hidden_precision: float,
    fused_qkv: bool,
    head: str,
) -> dict[str, Any]:
    """The `hybrid_from_gpt` arguments for the slots named in `learn`: learning parts
    transplanted at `gpt`'s weights, every block's part of a slot holding the one optimiser
    given for the slot (so the blocks stack). `given` holds the arguments passed explicitly;
    a slot both in `learn` and given is an error."""
    if not isinstance(learn, Mapping):
        raise TypeError(
            "hybrid_from_gpt: learn must map slot names to optimisers, e.g. "
            f"{{'feed_forward': optax.adam(1e-3)}}; got {type(learn).__name__}."
        )
    unknown = sorted(set(learn) - set(SLOTS))
    if unknown:
        raise ValueError(f"hybrid_from_gpt: learn has unknown slots {unknown}; choose from "
                         f"{SLOTS}.")
    twice = [s for s in learn if given.get(_SLOT_ARGUMENTS[s]) is not None]
    if twice:
        raise ValueError(
            f"hybrid_from_gpt: slots {twice} are both in learn and given as parts "
            f"({[_SLOT_ARGUMENTS[s] for s in twice]}); give each slot one way."
        )
    synaptic = learning_kind == "synaptic_uncertainty"
    iterative = learning_kind == ITERATIVE
    if learning_kind not in GPT_LEARNING_KINDS:
        raise ValueError(
            f"hybrid_from_gpt: unknown learning_kind {learning_kind!r}; choose one of "
            f"{GPT_LEARNING_KINDS}."
        )

    def learning_for(slot: str) -> dict[str, Any]:
        # the synaptic kind is its own rule; a rate multiplier alone scales its steps
        keep = not synaptic or isinstance(learn[slot], RateMultiplier)
        if iterative:  # slots without a hidden layer: nothing to relax, the exact step
            return {"optimiser": learn[slot], "learning_kind": "precision_weighted"}
        return {
            "optimiser": learn[slot] if keep else None,
            "learning_kind": learning_kind,
            "learning_kwargs": learning_kwargs,
        }

    if iterative and "feed_forward" not in learn:
        raise ValueError(
            "hybrid_from_gpt: learning_kind='iterative' makes the learning feed-forwards relax, "
            f"but learn has no 'feed_forward' (slots {sorted(learn)})."
        )
    parts: dict[str, Any] = {}
    if "feed_forward" in learn:
        if iterative and isinstance(gpt.blocks[0].ff, SwiGLU):
            raise ValueError(
                "hybrid_from_gpt: learning_kind='iterative' relaxes the hidden layer of a "
                "feed-forward network (linear, GELU, linear), but this GPT's feed-forwards "
                "are SwiGLUs (feed_forward='swiglu'); use feed_forward='gelu'."
            )
        if iterative:
            settings = dict(learning_kwargs or {})
            unknown = sorted(set(settings) - set(ITERATIVE_SETTINGS))
            if unknown:
                raise ValueError(
                    f"hybrid_from_gpt: learning_kwargs {unknown} do not apply to "
                    f"learning_kind='iterative'; allowed: {list(ITERATIVE_SETTINGS)}."
                )
            parts["ff_parts"] = [
                transplant.from_feedforward_iterative(
                    ff.fc1, ff.fc2, "gelu", hidden_precision=hidden_precision,
                    optimiser=learn["feed_forward"], **settings,
                )
                for ff in (cast(FeedForward, b.ff) for b in gpt.blocks)  # not SwiGLUs: above
            ]
        else:
            parts["ff_parts"] = [
                transplant.from_swiglu(b.ff.gate, b.ff.up, b.ff.down,
                                       **learning_for("feed_forward"))
                if isinstance(b.ff, SwiGLU)
                else transplant.from_feedforward(
                    b.ff.fc1, b.ff.fc2, "gelu", hidden_precision=hidden_precision,
                    **learning_for("feed_forward"),
                )
                for b in gpt.blocks
            ]
    if "attention" in learn:
        learning = learning_for("attention")
        attention = []
        for b in gpt.blocks:
            a = b.attn
            if fused_qkv:
                slot = {"wqkv": transplant.from_linears([a.wq, a.wk, a.wv], **learning)}
            else:
                slot = {n: transplant.from_linear(getattr(a, n), **learning)
                        for n in ("wq", "wk", "wv")}
            slot["wo"] = transplant.from_linear(a.wo, **learning)
            attention.append(slot)
        parts["attention_parts"] = attention
    if "head" in learn:
        parts["head_part"] = transplant.from_linear(
            gpt.head, head=head, **learning_for("head")
        )
    if "token" in learn:
        parts["token_part"] = transplant.from_embedding(gpt.tok_emb, **learning_for("token"))
    if "position" in learn:
        if gpt.pos_emb is None:
            raise _no_position_table("hybrid_from_gpt: learn")
        parts["position_part"] = transplant.from_embedding(
            gpt.pos_emb, **learning_for("position")
        )
    if "norm" in learn:
        norm_optimiser = learn["norm"]

        def norm_parts(ln):
            if isinstance(ln, eqx.nn.RMSNorm):
                return transplant.from_rms_norm(ln, optimiser=norm_optimiser)
            return transplant.from_layer_norm(ln, optimiser=norm_optimiser)

        parts["norm_parts"] = norm_parts
    return parts


def hybrid_from_gpt(
    gpt: GPT,
    ff_parts: Sequence[AbstractPart | None] | Callable[[int], AbstractPart | None] | None = None,
    attention_parts: Sequence[dict | None] | Callable[[int], dict | None] | None = None,
    head_part: AbstractPart | None = None,
    token_part: AbstractPart | None = None,
    position_part: AbstractPart | None = None,
    norm_parts: Callable[[Any], AbstractPart] | None = None,
    *,
    learn: Mapping[str, optax.GradientTransformation | None] | None = None,
    learning_kind: str = "precision_weighted",
    learning_kwargs: dict | None = None,
    hidden_precision: float = 1.0,
    fused_qkv: bool = False,
    attention_mixing: str = "tiles",
    compute_dtype: Any = None,
    scan: bool | str = "auto",
    output: str = "logits",
) -> GPTPart:
    """A `GPTPart` at the weights of a reference `fusedpc.transformer.reference.GPT`.

    Every slot not given stays frozen at the reference weights (feed-forward: linear, GELU,
    linear, or `frozen.swiglu` for a SwiGLU; norms: `frozen.layer_norm` or `frozen.rms_norm`).
    The reference's options carry over: its RMSNorms become RMSNorm parts
    (`transplant.from_rms_norm` where `"norm"` learns), its SwiGLUs `GatedFeedForward`s
    (`transplant.from_swiglu`: gate, up and down learn, `hidden_precision` does not apply), and
    with rotary positions every attention is a `MultiHeadAttention(positions="rotary")` at the
    reference's `rotary_base` and the part has no position slot (`position=None`; naming
    `"position"` in `learn` or passing `position_part` is an error). Learning slots are given
    in one of two ways:

    * `learn={"feed_forward": optax.adam(1e-3), "head": optax.sgd(0.1)}`: one optimiser per
      slot (`"token"`, `"position"`, `"attention"`, `"feed_forward"`, `"norm"`, `"head"`);
      every block's part of that slot is a learning part transplanted at the reference weights
      holding that one optimiser (`learning_kind`, `learning_kwargs`, `hidden_precision` of
      the feed-forwards' hidden layer, `fused_qkv` for one QKV network per block). The
      simplest way to many blocks that scan. `learning_kind="iterative"` makes every
      learning feed-forward an `IterativeNetwork` (`transplant.from_feedforward_iterative`;
      `learning_kwargs` are its `inference_steps`, `inference_rate`, `schedule`,
      `fixed_prediction`, `inference_optimiser`, `record_energy`) and every other learning
      slot `precision_weighted`: they have no hidden layer to relax, and iterative inference
      on a single matrix is that same exact step.
    * parts of your own: `ff_parts[i]` / `attention_parts[i]` (a dict with any of `"wq"`,
      `"wk"`, `"wv"`, `"wo"`, or `"wqkv"` and optionally `"wo"`) replace block i's slots;
      either may also be a callable of the block index. `norm_parts(ln)` is applied to every
      norm module (`n1`, `n2`, `norm_f`: `eqx.nn.LayerNorm`s, or `eqx.nn.RMSNorm`s);
      `head_part`, `token_part`, `position_part`.

    `attention_mixing` is every attention's `MultiHeadAttention(mixing=...)` (`"tiles"`, or
    `"dot_product_attention"` for `jax.nn.dot_product_attention`, no T x T cache);
    `compute_dtype="bfloat16"` runs the GPT in bfloat16 with float32 parameters
    (`GPTPart(compute_dtype=...)`).

    Structurally identical blocks are held by a `Repeat` (their states stacked); optimisers
    made separately by the same call (`optax.adam(1e-3)` in a loop) count as identical, see
    `fusedpc.parts.equivalent`;
    `scan=True` runs them in a `lax.scan` (compile time flat in depth), `scan="auto"` (the
    default) unrolls the `Repeat` up to `AUTO_UNROLL_BLOCKS` blocks and scans beyond, and
    `scan=False`, or blocks that differ, give a `Blocks` chain of independent blocks.
    `output="probabilities"` marks a categorical head.

    Why "auto": for a few blocks the unrolled program steps faster (on CPU the scan
    zero-fills and copies its stacked caches every step), at the price of a longer compile;
    from about 8 blocks on the scan costs nothing noticeable per step and keeps compile time
    flat in depth (measured in docs/performance.md).
    Unrolled or scanned, a `Repeat` has the same state layout, so checkpoints move between
    the two.
    """
    if not isinstance(gpt, GPT):
        raise TypeError(
            f"hybrid_from_gpt: expected a fusedpc.transformer.reference.GPT, got "
            f"{type(gpt).__name__}."
        )
    n_blocks = len(gpt.blocks)
    form = blocks_form(scan, n_blocks, "hybrid_from_gpt: scan")
    if position_part is not None and gpt.pos_emb is None:
        raise _no_position_table("hybrid_from_gpt: position_part")
    if learn is not None:
        given: dict[str, Any] = {
            "ff_parts": ff_parts, "attention_parts": attention_parts, "head_part": head_part,
            "token_part": token_part, "position_part": position_part, "norm_parts": norm_parts,
        }
        head = "categorical" if output == "probabilities" else "gaussian"
        given.update(_learning_slots(
            gpt, learn, given, learning_kind=learning_kind, learning_kwargs=learning_kwargs,
            hidden_precision=hidden_precision, fused_qkv=fused_qkv, head=head,
        ))
        ff_parts, attention_parts = given["ff_parts"], given["attention_parts"]
        head_part, token_part = given["head_part"], given["token_part"]
        position_part, norm_parts = given["position_part"], given["norm_parts"]
    ffs = _per_block(ff_parts, n_blocks, "ff_parts")
    attns = _per_block(attention_parts, n_blocks, "attention_parts")
    if isinstance(norm_parts, AbstractPart):  # callable (its forward), but not a factory
        raise TypeError(
            "hybrid_from_gpt: norm_parts must be a function from a reference norm module (an "
            "eqx.nn.LayerNorm or eqx.nn.RMSNorm) to a part, e.g. lambda ln: "
            f"transplant.from_layer_norm(ln, optimiser=...); got the part "
            f"{type(norm_parts).__name__}."
        )
    norm = norm_parts or _frozen_norm
    blocks = []
    for i, (block, ff, attn) in enumerate(zip(gpt.blocks, ffs, attns)):
        where = f"blocks[{i}]"
        if ff is None:
            ff = _frozen_feed_forward(block.ff)
        blocks.append(
            TransformerBlock(
                n1=check_part(norm(block.n1), f"{where}.n1"),
                attention=_attention_part(block.attn, attn, f"attention_parts[{i}]",
                                          attention_mixing),
                n2=check_part(norm(block.n2), f"{where}.n2"),
                feed_forward=check_part(ff, f"{where}.feed_forward"),
            )
        )
    stacked: AbstractPart = Blocks(blocks)
    if form != "tuple":
        try:
            stacked = Repeat(blocks, unroll=form == "unrolled")
        except (TypeError, ValueError) as err:
            # blocks differ: a `Blocks` chain runs them one after another, and its program
            # (and compile time) grows with depth. Asked to scan: an error; scanning by
            # default: said, with what differs and the fix.
            if scan is True:
                raise ValueError(
                    f"hybrid_from_gpt(scan=True): the blocks cannot be scanned. {err}"
                ) from None
            if form == "scanned":
                warnings.warn(
                    f"hybrid_from_gpt: the {n_blocks} blocks run as an unscanned chain, whose "
                    f"compile time grows with depth, because they differ. {err} Pass one "
                    "optimiser object to every block (hybrid_from_gpt(learn={slot: "
                    "optimiser}) does), or scan=False to ask for the chain.",
                    UserWarning,
                    stacklevel=2,
                )
    if gpt.pos_emb is not None:
        position_part = position_part or frozen.embedding(gpt.pos_emb)
    return GPTPart(
        token=token_part or frozen.embedding(gpt.tok_emb),
        position=position_part,
        blocks=stacked,
        norm_f=check_part(norm(gpt.norm_f), "norm_f"),
        head=head_part or frozen.linear(gpt.head),
        vocab_size=gpt.vocab_size,
        max_len=gpt.max_len,
        output=output,
        compute_dtype=compute_dtype,
    )


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
            raise _no_position_table(f"GPTConfig.learn={self.learn!r}")
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
    return part, reference


def _records(part: AbstractPart, path: str, kind: type, count: int) -> tuple:
    """`part.export_arrays(path)`, checked to be `count` records of type `kind`."""
    records = tuple(part.export_arrays(path))
    if len(records) != count or not all(isinstance(r, kind) for r in records):
        raise TypeError(
            f"to_reference: {path} must export {count} {kind.__name__} record(s) for the "
            f"reference GPT, got {[type(r).__name__ for r in records]}."
        )
    return records


def _set_linear(linear: eqx.nn.Linear, record: LinearParams) -> eqx.nn.Linear:
    linear = eqx.tree_at(lambda m: m.weight, linear, record.weight)
    if linear.bias is not None:
        linear = eqx.tree_at(lambda m: m.bias, linear, record.bias)
    return linear


def _set_norm(norm, record: LayerNormParams | RMSNormParams):
    """`norm` (an `eqx.nn.LayerNorm` or `eqx.nn.RMSNorm`) holding the record's arrays."""
    return eqx.tree_at(
        lambda n: (n.weight, n.bias), norm, (record.weight, record.bias),
        is_leaf=lambda x: x is None,
    )


def to_reference(part: GPTPart, reference: GPT) -> GPT:
    """The reference equinox GPT holding a GPT part's current weights (e.g. after
    `pipeline.merge()`), for use outside fusedpc or comparison with a backprop twin.

    `reference` gives the architecture (any GPT of the same sizes and options). Every slot is
    read through `AbstractPart.export_arrays`: the embeddings as one `TableParams` each (no
    position table under rotary positions), each LayerNorm as one `LayerNormParams` (an
    RMSNorm: one `RMSNormParams`), the attention as four `LinearParams` (Q, K, V, output), the
    feed-forward as two (`fc1`, `fc2`; a SwiGLU: three, `gate`, `up`, `down`) and the head as
    one; so a part type of your own in any slot exports by implementing that method. A slot
    that cannot raises a `TypeError` naming its path; a part whose options differ from the
    reference's (a position table or not, a `MultiHeadAttention`'s `positions`) a
    `ValueError`.
    """
    # every child of a GPT part's blocks is a transformer block
    blocks = [cast(TransformerBlock, block) for _, block in part.blocks.children()]
    if len(blocks) != len(reference.blocks):
        raise ValueError(
            f"to_reference: the part has {len(blocks)} blocks, the reference GPT "
            f"{len(reference.blocks)}; pass a reference of the same sizes."
        )
    if (part.position is None) != (reference.pos_emb is None):
        has = "has no" if part.position is None else "has a"
        raise ValueError(
            f"to_reference: the part {has} position table but the reference GPT has "
            f"positions={reference.positions!r}; pass a reference built with the part's options."
        )
    model = reference
    (token,) = _records(part.token, "token", TableParams, 1)
    model = eqx.tree_at(lambda m: m.tok_emb.weight, model, token.table)
    if part.position is not None:
        (position,) = _records(part.position, "position", TableParams, 1)
        model = eqx.tree_at(lambda m: m.pos_emb.weight, model, position.table)
    norm_record = RMSNormParams if isinstance(model.norm_f, eqx.nn.RMSNorm) else LayerNormParams
    new_blocks = []
    for i, (block, ref) in enumerate(zip(blocks, model.blocks)):
        where = f"blocks[{i}]"
        attention = block.attention
        if isinstance(attention, MultiHeadAttention) and (
            attention.positions != ref.attn.positions
        ):
            raise ValueError(
                f"to_reference: {where}.attention has positions={attention.positions!r} but the "
                f"reference's attention positions={ref.attn.positions!r}; pass a reference "
                "built with the part's options."
            )
        projections = _records(attention, f"{where}.attention", LinearParams, 4)
        new_attn = ref.attn
        for name, record in zip(("wq", "wk", "wv", "wo"), projections):
            new_attn = eqx.tree_at(lambda a, n=name: getattr(a, n), new_attn,  # type: ignore[misc]
                                   _set_linear(getattr(new_attn, name), record))
        ff: Any
        if isinstance(ref.ff, SwiGLU):
            gate, up, down = _records(block.feed_forward, f"{where}.feed_forward",
                                      LinearParams, 3)
            ff = eqx.tree_at(lambda f: (f.gate, f.up, f.down), ref.ff,
                             (_set_linear(ref.ff.gate, gate), _set_linear(ref.ff.up, up),
                              _set_linear(ref.ff.down, down)))
        else:
            fc1, fc2 = _records(block.feed_forward, f"{where}.feed_forward", LinearParams, 2)
            ff = eqx.tree_at(lambda f: (f.fc1, f.fc2), ref.ff,
                             (_set_linear(ref.ff.fc1, fc1), _set_linear(ref.ff.fc2, fc2)))
        (n1,) = _records(block.n1, f"{where}.n1", norm_record, 1)
        (n2,) = _records(block.n2, f"{where}.n2", norm_record, 1)
        new_blocks.append(eqx.tree_at(lambda b: (b.attn, b.ff, b.n1, b.n2), ref,
                                      (new_attn, ff, _set_norm(ref.n1, n1),
                                       _set_norm(ref.n2, n2))))
    model = eqx.tree_at(lambda m: m.blocks, model, tuple(new_blocks))
    (norm_f,) = _records(part.norm_f, "norm_f", norm_record, 1)
    model = eqx.tree_at(lambda m: m.norm_f, model, _set_norm(model.norm_f, norm_f))
    (head,) = _records(part.head, "head", LinearParams, 1)
    return eqx.tree_at(lambda m: m.head, model, _set_linear(model.head, head))
