"""`hybrid_from_gpt`: a GPT part at the weights of a reference equinox GPT.

Every slot stays frozen at the reference weights unless a part is given for it, so the
all-frozen tree reproduces the reference logits and any slot can be swapped for a learning
part initialised at the same weights. The reference's options carry over: LayerNorm or
RMSNorm, a position table or rotary positions, a GELU or a SwiGLU feed-forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import optax

from fusedpc.core._checks import check_part
from fusedpc.core._part import AbstractPart
from fusedpc.parts import frozen
from fusedpc.parts._attention import MultiHeadAttention
from fusedpc.parts._compose import Sequential
from fusedpc.parts.learning._rules import LearningRule, rule_spelling
from fusedpc.transformer._gpt import GPTPart, TransformerBlock
from fusedpc.transformer._slots import (
    SlotLearning,
    SlotParts,
    learning_slots,
    no_position_table,
)
from fusedpc.transformer._stacking import blocks_form, stack_blocks
from fusedpc.transformer.reference import GPT, SwiGLU

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


def _checked_form(gpt: Any, scan: bool | str, position_part: AbstractPart | None) -> str:
    """`blocks_form(scan, ...)` for `gpt`, once checked to be a reference GPT with a position
    table where `position_part` is given."""
    if not isinstance(gpt, GPT):
        raise TypeError(
            f"hybrid_from_gpt: expected a fusedpc.transformer.reference.GPT, got "
            f"{type(gpt).__name__}."
        )
    form = blocks_form(scan, len(gpt.blocks), "hybrid_from_gpt: scan")
    if position_part is not None and gpt.pos_emb is None:
        raise no_position_table("hybrid_from_gpt: position_part")
    return form


def _blocks(
    gpt: GPT, parts: SlotParts, attention_mixing: str
) -> tuple[list[TransformerBlock], Callable[[Any], AbstractPart]]:
    """Every block of `gpt` as a `TransformerBlock` of `parts`, frozen where none is given,
    and the function making the part of a norm."""
    n_blocks = len(gpt.blocks)
    ffs = _per_block(parts.ff_parts, n_blocks, "ff_parts")
    attns = _per_block(parts.attention_parts, n_blocks, "attention_parts")
    if isinstance(parts.norm_parts, AbstractPart):  # callable (its forward), but not a factory
        raise TypeError(
            "hybrid_from_gpt: norm_parts must be a function from a reference norm module (an "
            "eqx.nn.LayerNorm or eqx.nn.RMSNorm) to a part, e.g. lambda ln: "
            f"transplant.from_layer_norm(ln, optimiser=...); got the part "
            f"{type(parts.norm_parts).__name__}."
        )
    norm = parts.norm_parts or _frozen_norm
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
                branch_scale=block.branch_scale,
            )
        )
    return blocks, norm


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
    learning_kind: str | LearningRule = "precision_weighted",
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
    linear, or `frozen.swiglu`; norms: `frozen.layer_norm` or `frozen.rms_norm`). The
    reference's options carry over: RMSNorms become RMSNorm parts (`transplant.from_rms_norm`
    where `"norm"` learns), its SwiGLUs `GatedFeedForward`s
    (`transplant.from_swiglu`: gate, up and down learn, `hidden_precision` does not apply), and
    with rotary positions every attention is a `MultiHeadAttention(positions="rotary")` at the
    reference's `rotary_base` and the part has no position slot (`position=None`; naming
    `"position"` in `learn` or passing `position_part` is an error). Learning slots are given
    in one of two ways:

    * `learn={"feed_forward": optax.adam(1e-3), "head": optax.sgd(0.1)}`: one optimiser per
      slot (`"token"`, `"position"`, `"attention"`, `"feed_forward"`, `"norm"`, `"head"`);
      every block's part of that slot is a learning part transplanted at the reference weights
      holding that one optimiser (`learning_kind`: a rule, `SynapticUncertainty(window=8)`,
      or its name with `learning_kwargs`; `hidden_precision` of the feed-forwards' hidden
      layer, `fused_qkv` for one QKV network per block). The
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
    (`GPTPart(compute_dtype=...)`). Structurally identical blocks are held by a `Repeat`
    (their states stacked): `scan=True` runs them in a `lax.scan`, `scan="auto"` (the default)
    unrolls it up to `AUTO_UNROLL_BLOCKS` blocks and scans beyond, and `scan=False`, or blocks
    that differ, give a `Blocks` chain (`blocks_form` says when and why). `output=
    "probabilities"` marks a categorical head.
    """
    form = _checked_form(gpt, scan, position_part)
    parts = SlotParts(ff_parts, attention_parts, head_part, token_part, position_part, norm_parts)
    if learn is not None:
        head = "categorical" if output == "probabilities" else "gaussian"
        learning = SlotLearning(*rule_spelling("hybrid_from_gpt", learning_kind,
                                               learning_kwargs), hidden_precision, fused_qkv, head)
        parts = learning_slots(gpt, learn, parts, learning)
    blocks, norm = _blocks(gpt, parts, attention_mixing)
    stacked = stack_blocks(blocks, form, scan)  # warns on behalf of this function's caller
    position = parts.position_part or (
        None if gpt.pos_emb is None else frozen.embedding(gpt.pos_emb))
    return GPTPart(
        token=parts.token_part or frozen.embedding(gpt.tok_emb),
        position=position,
        blocks=stacked,
        norm_f=check_part(norm(gpt.norm_f), "norm_f"),
        head=parts.head_part or frozen.linear(gpt.head),
        vocab_size=gpt.vocab_size,
        max_len=gpt.max_len,
        output=output,
        compute_dtype=compute_dtype,
    )
