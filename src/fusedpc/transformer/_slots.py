"""The slots of a GPT part and the learning parts `hybrid_from_gpt(learn=...)` puts in them.

A slot is a kind of place in the GPT: `"token"`, `"position"`, `"attention"`,
`"feed_forward"`, `"norm"`, `"head"`. `learning_slots` fills the slots named in `learn` with
learning parts transplanted at a reference GPT's weights, every block's part of a slot holding
the one optimiser given for the slot, so that the blocks stack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import equinox as eqx
import optax

from fusedpc.core._part import AbstractPart
from fusedpc.parts import transplant
from fusedpc.parts.learning._iterative import RELAXATION_SETTINGS
from fusedpc.parts.learning._local_update import LEARNING_KINDS, RateMultiplier
from fusedpc.transformer.reference import GPT, FeedForward, SwiGLU

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


def no_position_table(where: str) -> ValueError:
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


@dataclasses.dataclass(frozen=True)
class SlotParts:
    """The parts `hybrid_from_gpt` is given for its slots, by argument name (see there);
    `None` leaves a slot frozen at the reference weights."""

    ff_parts: Sequence[AbstractPart | None] | Callable[[int], AbstractPart | None] | None
    attention_parts: Sequence[dict | None] | Callable[[int], dict | None] | None
    head_part: AbstractPart | None
    token_part: AbstractPart | None
    position_part: AbstractPart | None
    norm_parts: Callable[[Any], AbstractPart] | None


@dataclasses.dataclass(frozen=True)
class SlotLearning:
    """How the slots named in `hybrid_from_gpt(learn=...)` learn: the `learning_kind` and
    `learning_kwargs` of their parts, the `hidden_precision` of the feed-forwards' hidden
    layer, `fused_qkv` (one QKV network per block) and the `head` kind of the head."""

    learning_kind: str
    learning_kwargs: dict | None
    hidden_precision: float
    fused_qkv: bool
    head: str

    @property
    def iterative(self) -> bool:
        return self.learning_kind == ITERATIVE

    def for_slot(self, optimiser: optax.GradientTransformation | None) -> dict[str, Any]:
        """The transplant keywords of a slot learning with `optimiser` (the feed-forwards of
        the iterative kind excepted: `_iterative_feed_forwards`)."""
        # the synaptic kind is its own rule; a rate multiplier alone scales its steps
        keep = self.learning_kind != "synaptic_uncertainty" or isinstance(
            optimiser, RateMultiplier
        )
        if self.iterative:  # slots without a hidden layer: nothing to relax, the exact step
            return {"optimiser": optimiser, "learning_kind": "precision_weighted"}
        return {
            "optimiser": optimiser if keep else None,
            "learning_kind": self.learning_kind,
            "learning_kwargs": self.learning_kwargs,
        }


def _check_learn(learn: Any, given: SlotParts, learning_kind: str) -> None:
    """`learn` maps known slots, none of them given as a part too, and `learning_kind` is
    known."""
    if not isinstance(learn, Mapping):
        raise TypeError(
            "hybrid_from_gpt: learn must map slot names to optimisers, e.g. "
            f"{{'feed_forward': optax.adam(1e-3)}}; got {type(learn).__name__}."
        )
    unknown = sorted(set(learn) - set(SLOTS))
    if unknown:
        raise ValueError(f"hybrid_from_gpt: learn has unknown slots {unknown}; choose from "
                         f"{SLOTS}.")
    twice = [s for s in learn if getattr(given, _SLOT_ARGUMENTS[s]) is not None]
    if twice:
        raise ValueError(
            f"hybrid_from_gpt: slots {twice} are both in learn and given as parts "
            f"({[_SLOT_ARGUMENTS[s] for s in twice]}); give each slot one way."
        )
    if learning_kind not in GPT_LEARNING_KINDS:
        raise ValueError(
            f"hybrid_from_gpt: unknown learning_kind {learning_kind!r}; choose one of "
            f"{GPT_LEARNING_KINDS}."
        )
    if learning_kind == ITERATIVE and "feed_forward" not in learn:
        raise ValueError(
            "hybrid_from_gpt: learning_kind='iterative' makes the learning feed-forwards relax, "
            f"but learn has no 'feed_forward' (slots {sorted(learn)})."
        )


def _iterative_feed_forwards(
    gpt: GPT, optimiser: optax.GradientTransformation | None, learning: SlotLearning
) -> list[AbstractPart]:
    """Every block's feed-forward as an `IterativeNetwork` relaxing its hidden layer."""
    if isinstance(gpt.blocks[0].ff, SwiGLU):
        raise ValueError(
            "hybrid_from_gpt: learning_kind='iterative' relaxes the hidden layer of a "
            "feed-forward network (linear, GELU, linear), but this GPT's feed-forwards "
            "are SwiGLUs (feed_forward='swiglu'); use feed_forward='gelu'."
        )
    settings = dict(learning.learning_kwargs or {})
    unknown = sorted(set(settings) - set(ITERATIVE_SETTINGS))
    if unknown:
        raise ValueError(
            f"hybrid_from_gpt: learning_kwargs {unknown} do not apply to "
            f"learning_kind='iterative'; allowed: {list(ITERATIVE_SETTINGS)}."
        )
    return [
        transplant.from_feedforward_iterative(
            ff.fc1, ff.fc2, "gelu", hidden_precision=learning.hidden_precision,
            optimiser=optimiser, **settings,
        )
        for ff in (cast(FeedForward, b.ff) for b in gpt.blocks)  # not SwiGLUs: above
    ]


def _feed_forwards(
    gpt: GPT, optimiser: optax.GradientTransformation | None, learning: SlotLearning
) -> list[AbstractPart]:
    """Every block's feed-forward as a learning part: a `GatedFeedForward` for a SwiGLU, else
    a network of two layers (linear, GELU, linear)."""
    if learning.iterative:
        return _iterative_feed_forwards(gpt, optimiser, learning)
    return [
        transplant.from_swiglu(b.ff.gate, b.ff.up, b.ff.down, **learning.for_slot(optimiser))
        if isinstance(b.ff, SwiGLU)
        else transplant.from_feedforward(
            b.ff.fc1, b.ff.fc2, "gelu", hidden_precision=learning.hidden_precision,
            **learning.for_slot(optimiser),
        )
        for b in gpt.blocks
    ]


def _attentions(
    gpt: GPT, optimiser: optax.GradientTransformation | None, learning: SlotLearning
) -> list[dict[str, AbstractPart]]:
    """Every block's attention projections as learning parts: `"wqkv"` (one network) or
    `"wq"`, `"wk"`, `"wv"`, and `"wo"`."""
    keywords = learning.for_slot(optimiser)
    attention = []
    for b in gpt.blocks:
        a = b.attn
        slot: dict[str, AbstractPart]
        if learning.fused_qkv:
            slot = {"wqkv": transplant.from_linears([a.wq, a.wk, a.wv], **keywords)}
        else:
            slot = {n: transplant.from_linear(getattr(a, n), **keywords)
                    for n in ("wq", "wk", "wv")}
        slot["wo"] = transplant.from_linear(a.wo, **keywords)
        attention.append(slot)
    return attention


def _learning_norms(
    optimiser: optax.GradientTransformation | None,
) -> Callable[[Any], AbstractPart]:
    """`norm_parts` making every norm a learning part with `optimiser`."""

    def norm_parts(ln):
        if isinstance(ln, eqx.nn.RMSNorm):
            return transplant.from_rms_norm(ln, optimiser=optimiser)
        return transplant.from_layer_norm(ln, optimiser=optimiser)

    return norm_parts


def learning_slots(
    gpt: GPT,
    learn: Mapping[str, optax.GradientTransformation | None],
    given: SlotParts,
    learning: SlotLearning,
) -> SlotParts:
    """`given` with the slots named in `learn` filled by learning parts transplanted at
    `gpt`'s weights, every block's part of a slot holding the one optimiser given for the slot
    (so the blocks stack). A slot both in `learn` and given is an error."""
    _check_learn(learn, given, learning.learning_kind)
    parts: dict[str, Any] = {}
    if "feed_forward" in learn:
        parts["ff_parts"] = _feed_forwards(gpt, learn["feed_forward"], learning)
    if "attention" in learn:
        parts["attention_parts"] = _attentions(gpt, learn["attention"], learning)
    if "head" in learn:
        parts["head_part"] = transplant.from_linear(
            gpt.head, head=learning.head, **learning.for_slot(learn["head"])
        )
    if "token" in learn:
        parts["token_part"] = transplant.from_embedding(
            gpt.tok_emb, **learning.for_slot(learn["token"])
        )
    if "position" in learn:
        if gpt.pos_emb is None:
            raise no_position_table("hybrid_from_gpt: learn")
        parts["position_part"] = transplant.from_embedding(
            gpt.pos_emb, **learning.for_slot(learn["position"])
        )
    if "norm" in learn:
        parts["norm_parts"] = _learning_norms(learn["norm"])
    return dataclasses.replace(given, **parts)
