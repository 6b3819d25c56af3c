"""`to_reference`: a GPT part's current weights written back into a reference equinox GPT,
read slot by slot through `AbstractPart.export_arrays`."""

from __future__ import annotations

from typing import Any, cast

import equinox as eqx

from fusedpc.core._part import AbstractPart, LayerNormParams, LinearParams, TableParams
from fusedpc.parts._attention import MultiHeadAttention
from fusedpc.parts.frozen import RMSNormParams
from fusedpc.transformer._gpt import GPTPart, TransformerBlock
from fusedpc.transformer.reference import GPT, Block, SwiGLU


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


def _block_to_reference(
    block: TransformerBlock, ref: Block, where: str, norm_record: type
) -> Block:
    """`ref` (a reference block) holding the weights of `block`, found at `where`."""
    attention = block.attention
    if block.branch_scale != ref.branch_scale:
        raise ValueError(
            f"to_reference: {where} has branch_scale={block.branch_scale!r} but the "
            f"reference's blocks branch_scale={ref.branch_scale!r}; pass a reference built "
            "with the part's options (GPT(branch_scale=...), as GPTConfig.parameterisation "
            "sets it).")
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
        gate, up, down = _records(block.feed_forward, f"{where}.feed_forward", LinearParams, 3)
        ff = eqx.tree_at(lambda f: (f.gate, f.up, f.down), ref.ff,
                         (_set_linear(ref.ff.gate, gate), _set_linear(ref.ff.up, up),
                          _set_linear(ref.ff.down, down)))
    else:
        fc1, fc2 = _records(block.feed_forward, f"{where}.feed_forward", LinearParams, 2)
        ff = eqx.tree_at(lambda f: (f.fc1, f.fc2), ref.ff,
                         (_set_linear(ref.ff.fc1, fc1), _set_linear(ref.ff.fc2, fc2)))
    (n1,) = _records(block.n1, f"{where}.n1", norm_record, 1)
    (n2,) = _records(block.n2, f"{where}.n2", norm_record, 1)
    return eqx.tree_at(lambda b: (b.attn, b.ff, b.n1, b.n2), ref,
                       (new_attn, ff, _set_norm(ref.n1, n1), _set_norm(ref.n2, n2)))


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
    new_blocks = [
        _block_to_reference(block, ref, f"blocks[{i}]", norm_record)
        for i, (block, ref) in enumerate(zip(blocks, model.blocks))
    ]
    model = eqx.tree_at(lambda m: m.blocks, model, tuple(new_blocks))
    (norm_f,) = _records(part.norm_f, "norm_f", norm_record, 1)
    model = eqx.tree_at(lambda m: m.norm_f, model, _set_norm(model.norm_f, norm_f))
    (head,) = _records(part.head, "head", LinearParams, 1)
    return eqx.tree_at(lambda m: m.head, model, _set_linear(model.head, head))
