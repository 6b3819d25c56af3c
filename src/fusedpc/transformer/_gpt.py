"""The GPT part: token ids in, logits (or probabilities) out, every slot frozen or learning.

$$h_0 = T[\\mathrm{ids}] + P[0{:}T], \\qquad
h' = h + \\mathrm{attention}(\\mathrm{LN}_1(h)), \\qquad
h'' = h' + \\mathrm{ff}(\\mathrm{LN}_2(h')),$$

then a final LayerNorm and the head. Backward walks the same tree in reverse: each residual
junction adds its two messages; the token table learns from the error at the embedding
output row by row, and the position table from its **batch mean** $\\frac1B\\sum_b E_{b,t}$, so
that its own $1/T$ row mean times the $1/B$ reproduces the $1/(BT)$ loss average. The GPT
part's input error is the error at the embedding output, `(batch, seq, width)`.

A GPT built with `token_input="distributions"` reads a distribution over the vocabulary at
every position, `(batch, seq, vocab)`, instead of ids: its token slot is then a map of such
rows (`frozen.linear(table.T)`: $h_0 = q T$), and its input error is that slot's, the error
at the distributions (`fusedpc.transformer.infill` relaxes hidden tokens on it).

A GPT whose attentions rotate their queries and keys (rotary positions) has no position
table: `position=None`, $h_0 = T[\\mathrm{ids}]$, and its state's `position` field is None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from fusedpc.core._checks import check_ids, check_part, id_range_check, positive_number
from fusedpc.core._context import StepContext
from fusedpc.core._metrics import Named, named
from fusedpc.core._part import AbstractPart, Core, PyTree, display_path, join_path, replace_fields
from fusedpc.core._precision import resolve_compute_dtype, widened
from fusedpc.parts._compose import SequentialCache

_BLOCK_SLOTS = ("n1", "attention", "n2", "feed_forward")
_GPT_SLOTS = ("token", "position", "blocks", "norm_f", "head")
TOKEN_INPUTS = ("ids", "distributions")
"""What a `GPTPart` reads: integer ids, or float distributions over the vocabulary."""


class BlockState(eqx.Module):
    """State of a `TransformerBlock`: one field per slot."""

    n1: PyTree
    attention: PyTree
    n2: PyTree
    feed_forward: PyTree


class BlockCache(eqx.Module):
    """What a `TransformerBlock`'s backward reads: each slot's cache."""

    n1: PyTree
    attention: PyTree
    n2: PyTree
    feed_forward: PyTree


class TransformerBlock(AbstractPart):
    """A pre-norm block: $h' = h + \\mathrm{attention}(n_1(h))$, $h'' = h' + \\mathrm{ff}(n_2(h'))$.

    Backward: $e_{h'} = e + n_2^\\top(\\mathrm{ff}^\\top(e))$,
    $e_h = e_{h'} + n_1^\\top(\\mathrm{attention}^\\top(e_{h'}))$.
    Every slot is any part; report rows read `...n1`, `...attention.wq`, `...feed_forward`.

    `branch_scale` $a$ multiplies both branches, $h' = h + a\\,\\mathrm{attention}(n_1(h))$,
    $h'' = h' + a\\,\\mathrm{ff}(n_2(h'))$, and so the errors they receive ($a\\,e$); 1 (the
    default) adds them as they are. `GPTConfig(parameterisation="mupc")` sets it to
    $1/\\sqrt{2L}$ (the reference `Block`'s `branch_scale`).
    """

    defers_updates: ClassVar[bool] = True

    n1: AbstractPart
    attention: AbstractPart
    n2: AbstractPart
    feed_forward: AbstractPart
    branch_scale: float = eqx.field(static=True, default=1.0)

    def __init__(self, n1, attention, n2, feed_forward, branch_scale=1.0):
        self.n1 = check_part(n1, "TransformerBlock.n1")
        self.attention = check_part(attention, "TransformerBlock.attention")
        self.n2 = check_part(n2, "TransformerBlock.n2")
        self.feed_forward = check_part(feed_forward, "TransformerBlock.feed_forward")
        self.branch_scale = positive_number(branch_scale, "TransformerBlock: branch_scale")

    def children(self) -> tuple[tuple[str, AbstractPart], ...]:
        return tuple((name, getattr(self, name)) for name in _BLOCK_SLOTS)

    def replace_children(self, children: Sequence[AbstractPart]) -> TransformerBlock:
        return replace_fields(self, **dict(zip(_BLOCK_SLOTS, children, strict=True)))

    def init_state(self, key: jax.Array) -> BlockState:
        k1, k2, k3, k4 = jax.random.split(key, 4)
        return BlockState(
            self.n1.init_state(k1),
            self.attention.init_state(k2),
            self.n2.init_state(k3),
            self.feed_forward.init_state(k4),
        )

    def compile(self, path: str) -> Core:
        names = _BLOCK_SLOTS
        cores = {n: getattr(self, n).compile(join_path(path, n)) for n in names}
        branch = self.branch_scale

        def scaled(value):  # a branch's output, or the error it receives
            return value if branch == 1.0 else branch * value

        def forward(state: BlockState, x, ctx):
            a, c_n1 = cores["n1"].forward(state.n1, x, ctx)
            a, c_attn = cores["attention"].forward(state.attention, a, ctx)
            h = x + scaled(a)
            f, c_n2 = cores["n2"].forward(state.n2, h, ctx)
            f, c_ff = cores["feed_forward"].forward(state.feed_forward, f, ctx)
            return h + scaled(f), BlockCache(c_n1, c_attn, c_n2, c_ff)

        def backward(state: BlockState, cache: BlockCache, error, ctx):
            c_n1, c_attn, c_n2, c_ff = cache.n1, cache.attention, cache.n2, cache.feed_forward
            e, s_ff, m_ff = cores["feed_forward"].backward(state.feed_forward, c_ff,
                                                           scaled(error), ctx)
            e, s_n2, m_n2 = cores["n2"].backward(state.n2, c_n2, e, ctx)
            e_h = error + e
            e, s_attn, m_attn = cores["attention"].backward(state.attention, c_attn,
                                                            scaled(e_h), ctx)
            e, s_n1, m_n1 = cores["n1"].backward(state.n1, c_n1, e, ctx)
            metrics = named(n1=m_n1, attention=m_attn, n2=m_n2, feed_forward=m_ff)
            return e_h + e, BlockState(s_n1, s_attn, s_n2, s_ff), metrics

        def write_back(state: BlockState) -> TransformerBlock:
            return replace_fields(
                self, **{n: cores[n].write_back(getattr(state, n)) for n in names}
            )

        return Core(forward, backward, write_back)


class Blocks(AbstractPart):
    """Blocks that differ, applied in order: $h_{i+1} = \\mathrm{block}_i(h_i)$.

    The chain that `hybrid_from_gpt` builds for blocks that cannot be stacked in a `Repeat`
    (or for `scan=False`). Backward in reverse, $E_i = \\mathrm{block}_i^\\top(E_{i+1})$.
    Children are named `[i]` (report rows read `blocks[0].feed_forward`, as for a `Repeat`)
    and its state is the tuple of the blocks' states, the layout that GPT checkpoints had when
    a GPT held a bare tuple of blocks, so those checkpoints still load. Its cache is a
    `SequentialCache`.
    """

    defers_updates: ClassVar[bool] = True

    blocks: tuple[AbstractPart, ...]

    def __init__(self, blocks):
        blocks = tuple(blocks)
        if not blocks:
            raise ValueError("Blocks: needs at least one block, got none.")
        self.blocks = tuple(check_part(b, f"Blocks[{i}]") for i, b in enumerate(blocks))

    def children(self) -> tuple[tuple[str, AbstractPart], ...]:
        return tuple((f"[{i}]", block) for i, block in enumerate(self.blocks))

    def replace_children(self, children: Sequence[AbstractPart]) -> Blocks:
        return replace_fields(self, blocks=tuple(children))

    def validate_input(self, x: Any, path: str) -> None:
        self.blocks[0].validate_input(x, join_path(path, "[0]"))

    def input_checks(self, x: Any, path: str) -> tuple[Any, ...]:
        return self.blocks[0].input_checks(x, join_path(path, "[0]"))

    def init_state(self, key: jax.Array) -> tuple[PyTree, ...]:
        keys = jax.random.split(key, len(self.blocks))
        return tuple(b.init_state(k) for b, k in zip(self.blocks, keys))

    def compile(self, path: str) -> Core:
        cores = [b.compile(join_path(path, name)) for name, b in self.children()]

        def forward(state: tuple[PyTree, ...], x, ctx):
            caches = []
            for core, sub in zip(cores, state):
                x, cache = core.forward(sub, x, ctx)
                caches.append(cache)
            return x, SequentialCache(tuple(caches))

        def backward(state: tuple[PyTree, ...], cache: SequentialCache, error, ctx):
            new_states, metrics = [None] * len(cores), [None] * len(cores)
            for i in reversed(range(len(cores))):
                error, new_states[i], metrics[i] = cores[i].backward(
                    state[i], cache.parts[i], error, ctx
                )
            names = tuple(name for name, _ in self.children())
            return error, tuple(new_states), Named(names, tuple(metrics))

        def write_back(state: tuple[PyTree, ...]) -> Blocks:
            return replace_fields(
                self, blocks=tuple(c.write_back(s) for c, s in zip(cores, state))
            )

        return Core(forward, backward, write_back)


class GPTState(eqx.Module):
    """State of a `GPTPart`: one field per slot (`blocks` is the blocks part's state;
    `position` is None for a GPT without a position table)."""

    token: PyTree
    position: PyTree
    blocks: PyTree
    norm_f: PyTree
    head: PyTree


class GPTCache(eqx.Module):
    """What a `GPTPart`'s backward reads: each slot's cache."""

    token: PyTree
    position: PyTree
    blocks: PyTree
    norm_f: PyTree
    head: PyTree


class GPTPart(AbstractPart):
    """A whole GPT as one part tree.

    Args:
        token: a part mapping ids `(B, T)` to `(B, T, D)` (`frozen.embedding(table)` or a
            `LearningEmbedding`).
        position: the same for positions `0..T-1` (`(T,)` ids to `(T, D)`), or None for no
            position table (the attentions carry the positions, e.g.
            `MultiHeadAttention(positions="rotary")`); the GPT's children, state, metrics and
            report then have no `position`.
        blocks: the blocks as one part: a `Repeat` of `TransformerBlock`s (stacked state,
            scanned or unrolled) or a `Blocks` chain (for blocks that differ). A tuple or list
            of blocks is wrapped in a `Blocks`.
        norm_f, head: the final LayerNorm and the head (any parts).
        vocab_size, max_len: checked against the ids before anything is compiled.
        output: `"logits"` or `"probabilities"` (a categorical learning head); `generate` reads it.
        compute_dtype: `"bfloat16"` runs the whole GPT's activations and matrix products in
            bfloat16 (parameters, optimiser states, norms and the loss in float32; the
            output in float32), as `FusedPipeline(compute_dtype=...)` does for any tree;
            None (float32) by default.
        token_input: `"ids"` (integer ids `(B, T)`, the default) or `"distributions"`
            (float rows over the vocabulary `(B, T, V)`, e.g. one-hot or a softmax; `token`
            must map them to `(B, T, D)`, and the GPT's input error is `token`'s).
    """

    defers_updates: ClassVar[bool] = True

    token: AbstractPart
    position: AbstractPart | None
    blocks: AbstractPart
    norm_f: AbstractPart
    head: AbstractPart
    vocab_size: int = eqx.field(static=True)
    max_len: int = eqx.field(static=True)
    output: str = eqx.field(static=True)
    compute_dtype: str | None = eqx.field(static=True, default=None)
    token_input: str = eqx.field(static=True, default="ids")

    def __init__(self, token, position, blocks, norm_f, head, *, vocab_size, max_len,
                 output="logits", compute_dtype=None, token_input="ids"):
        self.token = check_part(token, "GPTPart.token")
        self.position = None if position is None else check_part(position, "GPTPart.position")
        if isinstance(blocks, list | tuple):
            blocks = Blocks(blocks)
        self.blocks = check_part(blocks, "GPTPart.blocks")
        self.norm_f = check_part(norm_f, "GPTPart.norm_f")
        self.head = check_part(head, "GPTPart.head")
        self.vocab_size = int(vocab_size)
        self.max_len = int(max_len)
        if output not in ("logits", "probabilities"):
            raise ValueError(
                f"GPTPart: output must be 'logits' or 'probabilities', got {output!r}."
            )
        self.output = output
        self.compute_dtype = resolve_compute_dtype(compute_dtype, "GPTPart: compute_dtype")
        if token_input not in TOKEN_INPUTS:
            raise ValueError(f"GPTPart: token_input must be one of {TOKEN_INPUTS}, got "
                             f"{token_input!r}.")
        self.token_input = token_input

    def _slot_names(self) -> tuple[str, ...]:
        if self.position is None:
            return tuple(name for name in _GPT_SLOTS if name != "position")
        return _GPT_SLOTS

    def children(self) -> tuple[tuple[str, AbstractPart], ...]:
        """The slots in forward order: `token`, `position` (absent without a position
        table), `blocks`, `norm_f`, `head`."""
        return tuple((name, getattr(self, name)) for name in self._slot_names())

    def replace_children(self, children: Sequence[AbstractPart]) -> GPTPart:
        return replace_fields(self, **dict(zip(self._slot_names(), children, strict=True)))

    def validate_input(self, x: Any, path: str) -> None:
        """The host check of what a trace cannot see: the ids' values lie in the vocabulary.

        Rank, dtype and length are checked once, at trace time (`forward`), so they hold
        wherever the step runs (a pipeline, `make_step` inside a user's jit)."""
        if isinstance(x, jax.ShapeDtypeStruct) or self.token_input == "distributions":
            return  # values not read (a device array without check_device_ids), or not ids
        if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            return  # not ids at all: the trace says what is wrong
        check_ids(x, self.vocab_size, path)

    def input_checks(self, x: Any, path: str) -> tuple[Any, ...]:
        """Inside the step: the ids lie in the vocabulary (named after the token slot)."""
        ids = self.token_input == "ids"
        if not ids or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            return ()  # not ids at all: the forward's trace-time check says what is wrong
        return (id_range_check(x, self.vocab_size, join_path(path, "token")),)

    def _check_input(self, ids, path: str) -> None:
        if self.token_input == "distributions":
            self._check_distributions(ids, path)
            return
        if jnp.ndim(ids) != 2:
            raise ValueError(
                f"{display_path(path)}: expected token ids of shape (batch, seq), got shape "
                f"{tuple(jnp.shape(ids))}: an input of rank 2 (batch, seq) is needed, this "
                f"one has rank {jnp.ndim(ids)}."
            )
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(
                f"{display_path(path)}: expected integer token ids, got dtype {ids.dtype}; "
                "convert with .astype(np.int32)."
            )

    def _check_distributions(self, rows, path: str) -> None:
        shape = tuple(jnp.shape(rows))
        if len(shape) != 3 or shape[-1] != self.vocab_size:
            raise ValueError(
                f"{display_path(path)}: token_input='distributions' expects rows over the "
                f"vocabulary of shape (batch, seq, {self.vocab_size}), got shape {shape}.")
        if not jnp.issubdtype(jnp.result_type(rows), jnp.floating):
            raise TypeError(
                f"{display_path(path)}: token_input='distributions' expects float rows, got "
                f"dtype {jnp.result_type(rows)}; one-hot ids with jax.nn.one_hot(ids, "
                f"{self.vocab_size}).")

    def init_state(self, key: jax.Array) -> GPTState:
        keys = jax.random.split(key, 5)
        return GPTState(
            self.token.init_state(keys[0]),
            None if self.position is None else self.position.init_state(keys[1]),
            self.blocks.init_state(keys[2]),
            self.norm_f.init_state(keys[3]),
            self.head.init_state(keys[4]),
        )

    def compile(self, path: str) -> Core:
        token = self.token.compile(join_path(path, "token"))
        position = None if self.position is None else self.position.compile(
            join_path(path, "position")
        )
        blocks = self.blocks.compile(join_path(path, "blocks"))
        norm_f = self.norm_f.compile(join_path(path, "norm_f"))
        head = self.head.compile(join_path(path, "head"))

        def own_dtype(ctx: StepContext) -> StepContext:
            # the GPT's own compute dtype, or the step's when it names none
            if self.compute_dtype is None:
                return ctx
            return ctx.replace(compute_dtype=self.compute_dtype)

        def forward(state: GPTState, ids, ctx: StepContext):
            out, cache = walk_forward(state, ids, own_dtype(ctx))
            return (out if self.compute_dtype is None else widened(out)), cache

        def backward(state: GPTState, cache: GPTCache, error, ctx: StepContext):
            return walk_backward(state, cache, error, own_dtype(ctx))

        def walk_forward(state: GPTState, ids, ctx: StepContext):
            self._check_input(ids, path)
            seq = ids.shape[1]
            if seq > self.max_len:
                limit = (f"the position table's {self.max_len} positions" if position
                         is not None else f"the GPT's max_len of {self.max_len}")
                raise ValueError(
                    f"{display_path(path)}: sequence length {seq} exceeds {limit}; use "
                    f"sequences of at most {self.max_len}."
                )
            tok, c_tok = token.forward(state.token, ids, ctx)
            h, c_pos = tok, None
            if position is not None:
                pos, c_pos = position.forward(state.position, jnp.arange(seq, dtype=jnp.int32), ctx)
                h = tok + pos[None]
            h, c_blocks = blocks.forward(state.blocks, h, ctx)
            h, c_norm = norm_f.forward(state.norm_f, h, ctx)
            out, c_head = head.forward(state.head, h, ctx)
            return out, GPTCache(c_tok, c_pos, c_blocks, c_norm, c_head)

        def walk_backward(state: GPTState, cache: GPTCache, error, ctx: StepContext):
            e, s_head, m_head = head.backward(state.head, cache.head, error, ctx)
            e, s_norm, m_norm = norm_f.backward(state.norm_f, cache.norm_f, e, ctx)
            e, s_blocks, m_blocks = blocks.backward(state.blocks, cache.blocks, e, ctx)
            e_blocks = e
            e_tok, s_tok, m_tok = token.backward(state.token, cache.token, e, ctx)
            if self.token_input == "distributions":
                e = e_tok  # the error at the distributions
            if position is None:
                metrics = named(token=m_tok, blocks=m_blocks, norm_f=m_norm, head=m_head)
                return e, GPTState(s_tok, None, s_blocks, s_norm, s_head), metrics
            _, s_pos, m_pos = position.backward(
                state.position, cache.position, jnp.mean(widened(e_blocks), axis=0), ctx
            )
            metrics = named(
                token=m_tok, position=m_pos, blocks=m_blocks, norm_f=m_norm, head=m_head
            )
            return e, GPTState(s_tok, s_pos, s_blocks, s_norm, s_head), metrics

        def write_back(state: GPTState) -> GPTPart:
            return replace_fields(
                self,
                token=token.write_back(state.token),
                position=None if position is None else position.write_back(state.position),
                blocks=blocks.write_back(state.blocks),
                norm_f=norm_f.write_back(state.norm_f),
                head=head.write_back(state.head),
            )

        return Core(forward, backward, write_back)
