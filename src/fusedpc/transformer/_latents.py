"""Latents in a GPT: the whole transformer as one predictive-coding network
(`docs/tree-pc.md`).

`with_latents(gpt, "blocks")` puts a `fusedpc.Latent` after the token embedding and after
every block (block-PC: each block predicts the next block's latent); `"all"` puts one after
every slot (the token embedding, each block's two norms, its attention and its feed-forward,
and the final norm): every part boundary relaxes, as in FabricPC's fully-PC transformer,
except inside a slot's own part (a learning feed-forward's hidden layer keeps its exact
single-sweep step). A slot with a latent becomes `Sequential([slot, Latent()])`, so its
report rows read `blocks[0].attention.parts[0].wq`; a block with one after it,
`blocks[0].parts[0]...`. The weights do not move: the part's feed-forward readout is the
reference GPT's.
"""

from __future__ import annotations

from fusedpc.core._part import AbstractPart
from fusedpc.parts._compose import Sequential
from fusedpc.parts._latent import Latent
from fusedpc.parts._repeat import Repeat
from fusedpc.transformer._gpt import Blocks, GPTPart, TransformerBlock

LATENT_PLACES = ("none", "blocks", "all")
"""Where `with_latents` (and `GPTConfig.latents`, `fusedpc train --latents`) puts latents."""


def _then_latent(part: AbstractPart, precision: float) -> Sequential:
    return Sequential([part, Latent(precision)])


def _block(block: AbstractPart, at: str, precision: float) -> AbstractPart:
    if at == "blocks":
        return _then_latent(block, precision)
    if not isinstance(block, TransformerBlock):
        raise TypeError(
            f"with_latents: at='all' puts a latent after every slot of a TransformerBlock, got "
            f"a block of type {type(block).__name__}; use at='blocks'.")
    return block.replace_children([_then_latent(slot, precision)
                                   for _, slot in block.children()])


def with_latents(gpt: GPTPart, at: str = "blocks", precision: float = 1.0) -> GPTPart:
    """`gpt` with `fusedpc.Latent(precision)` parts at the places `at` names (module
    docstring): `"blocks"` (after the embedding and every block), `"all"` (after every slot
    but the head) or `"none"` (`gpt` itself)."""
    if at not in LATENT_PLACES:
        raise ValueError(f"with_latents: at must be one of {LATENT_PLACES}, got {at!r}.")
    if not isinstance(gpt, GPTPart):
        raise TypeError(f"with_latents: expected a GPTPart, got {type(gpt).__name__}.")
    if at == "none":
        return gpt
    blocks = gpt.blocks
    if not isinstance(blocks, Repeat | Blocks):
        raise TypeError(f"with_latents: expected the GPT's blocks as a Repeat or a Blocks "
                        f"chain, got {type(blocks).__name__}.")
    blocks = blocks.replace_children([_block(b, at, precision) for _, b in blocks.children()])
    slots = dict(gpt.children())
    slots["token"] = _then_latent(gpt.token, precision)
    slots["blocks"] = blocks
    if at == "all":
        slots["norm_f"] = _then_latent(gpt.norm_f, precision)
    return gpt.replace_children([slots[name] for name, _ in gpt.children()])


__all__ = ["LATENT_PLACES", "with_latents"]
