"""Reference GPT in plain Equinox, trained by backpropagation.

This is the "backprop twin" against which the predictive-coding models are compared in
tests and benchmarks: a small pre-norm decoder-only transformer with learned absolute
positional embeddings, or, by option, the modern pieces: RMSNorm (``norm="rms"``), rotary
position embeddings inside attention (``positions="rotary"``, no position table) and a SwiGLU
feed-forward (``feed_forward="swiglu"``).

Notation used throughout: ``B`` batch size, ``T`` sequence length, ``W`` model width,
``H`` number of heads, ``d = W / H`` head width, ``F`` feed-forward width, ``V`` vocabulary
size, ``L`` number of blocks.

All linear maps and layer normalisations act on the last axis of a ``(B, T, W)`` array
through batched matrix products (``x @ weight.T + bias``) rather than through ``jax.vmap``
over rows; the parameters are nevertheless stored in ordinary ``eqx.nn.Linear`` and
``eqx.nn.LayerNorm`` modules so that the model can be inspected, mapped over and compared
with the per-position Equinox semantics. That maths lives in
`fusedpc.transformer._reference_maths`, and the training step (`cross_entropy`,
`make_backprop_step`) in `fusedpc.transformer._backprop`; every name of `__all__` is
importable from here.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Float, Int

from fusedpc.core._checks import positive_number
from fusedpc.transformer._backprop import cross_entropy, make_backprop_step
from fusedpc.transformer._reference_maths import linear, normalise, rotate

Array = jax.Array

__all__ = [
    "FEED_FORWARDS",
    "GPT",
    "NORMS",
    "POSITIONS",
    "Block",
    "CausalSelfAttention",
    "FeedForward",
    "SwiGLU",
    "count_flops",
    "cross_entropy",
    "make_backprop_step",
]

# Scale applied to the default Equinox initialisation of the output head, so that the
# initial logits are small and the initial loss is close to log(V).
_HEAD_INIT_SCALE = 0.1

NORMS = ("layer", "rms")
"""`GPT(norm=...)`: ``"layer"`` (`eqx.nn.LayerNorm`) or ``"rms"`` (`eqx.nn.RMSNorm`, no bias)."""
POSITIONS = ("table", "rotary")
"""`GPT(positions=...)`: ``"table"`` (a learned position table) or ``"rotary"`` (rotary
embeddings of the queries and keys inside every attention, no table)."""
FEED_FORWARDS = ("gelu", "swiglu")
"""`GPT(feed_forward=...)`: ``"gelu"`` (`FeedForward`) or ``"swiglu"`` (`SwiGLU`)."""


def _check_option(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"GPT: {name} must be one of {allowed}, got {value!r}.")


def _make_norm(norm: str, width: int) -> eqx.nn.LayerNorm | eqx.nn.RMSNorm:
    if norm == "rms":
        return eqx.nn.RMSNorm(width, use_bias=False)
    return eqx.nn.LayerNorm(width)


class CausalSelfAttention(eqx.Module):
    """Multi-head causal self-attention.

    For an input ``x`` of shape ``(B, T, W)``::

        q = x Wq^T + bq,   k = x Wk^T + bk,   v = x Wv^T + bv          (B, T, W)

    Head ``i`` uses features ``[i d, (i + 1) d)`` of ``q``, ``k`` and ``v``. Per head::

        S = q k^T / sqrt(d)                                            (B, H, T, T)
        S[t, s] = -inf for s > t                                       (causal mask)
        A = softmax(S) over the last axis
        c = A v                                                        (B, H, T, d)

    The heads are concatenated back in the same order to ``(B, T, W)`` and the output is
    ``c Wo^T + bo``. With ``positions="rotary"`` each head's ``q`` and ``k`` are rotated by
    their positions before the scores (`rotate`, base ``rotary_base``; ``d`` even); with
    ``positions=None`` (the default) the attention adds no positions.
    """

    wq: eqx.nn.Linear
    wk: eqx.nn.Linear
    wv: eqx.nn.Linear
    wo: eqx.nn.Linear
    n_heads: int = eqx.field(static=True)
    positions: str | None = eqx.field(static=True, default=None)
    rotary_base: float = eqx.field(static=True, default=10000.0)

    def __init__(
        self,
        width: int,
        n_heads: int,
        *,
        key: Array,
        positions: str | None = None,
        rotary_base: float = 10000.0,
    ):
        if n_heads < 1 or width % n_heads != 0:
            raise ValueError(f"width ({width}) must be divisible by n_heads ({n_heads})")
        if positions not in (None, "rotary"):
            raise ValueError(
                f"CausalSelfAttention: positions must be None or 'rotary', got {positions!r}."
            )
        if positions == "rotary" and (width // n_heads) % 2:
            raise ValueError(
                f"CausalSelfAttention: rotary positions need an even head width, got "
                f"{width // n_heads} (width {width} over n_heads={n_heads})."
            )
        self.positions = positions
        self.rotary_base = float(rotary_base)
        kq, kk, kv, ko = jr.split(key, 4)
        self.wq = eqx.nn.Linear(width, width, use_bias=True, key=kq)
        self.wk = eqx.nn.Linear(width, width, use_bias=True, key=kk)
        self.wv = eqx.nn.Linear(width, width, use_bias=True, key=kv)
        self.wo = eqx.nn.Linear(width, width, use_bias=True, key=ko)
        self.n_heads = n_heads

    def __call__(
        self, x: Float[Array, "batch seq width"]  # noqa: F722 - a jaxtyping shape
    ) -> Float[Array, "batch seq width"]:  # noqa: F722 - a jaxtyping shape
        b, t, w = x.shape
        h = self.n_heads
        d = w // h

        def split_heads(y: Array) -> Array:  # (B, T, W) -> (B, H, T, d)
            return y.reshape(b, t, h, d).transpose(0, 2, 1, 3)

        q = split_heads(linear(self.wq, x))
        k = split_heads(linear(self.wk, x))
        v = split_heads(linear(self.wv, x))
        if self.positions == "rotary":
            q, k = rotate(q, self.rotary_base), rotate(k, self.rotary_base)
        # scores and softmax in float32 whatever the dtype of q and k
        scores = jnp.einsum("bhtd,bhsd->bhts", q, k, preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(d)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, -jnp.inf)
        attn = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        ctx = jnp.einsum("bhts,bhsd->bhtd", attn, v)
        ctx = ctx.transpose(0, 2, 1, 3).reshape(b, t, w)
        return linear(self.wo, ctx)


class FeedForward(eqx.Module):
    """Position-wise MLP: ``y = GELU_tanh(x W1^T + b1) W2^T + b2``.

    ``x`` has shape ``(B, T, W)``, the hidden layer ``(B, T, F)``. GELU is the tanh form,
    ``jax.nn.gelu(approximate=True)``.
    """

    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, width: int, ff_width: int, *, key: Array):
        k1, k2 = jr.split(key)
        self.fc1 = eqx.nn.Linear(width, ff_width, use_bias=True, key=k1)
        self.fc2 = eqx.nn.Linear(ff_width, width, use_bias=True, key=k2)

    def __call__(
        self, x: Float[Array, "*rows width"]  # noqa: F722 - a jaxtyping shape
    ) -> Float[Array, "*rows width"]:  # noqa: F722 - a jaxtyping shape
        return linear(self.fc2, jax.nn.gelu(linear(self.fc1, x), approximate=True))


class SwiGLU(eqx.Module):
    """Gated position-wise MLP: ``y = (silu(x Wg^T) * (x Wu^T)) Wd^T``, no biases.

    ``x`` has shape ``(B, T, W)``; the gate ``x Wg^T`` and the up projection ``x Wu^T`` are
    ``(B, T, F)``; ``silu(g) = g sigmoid(g)``. Three matrices where `FeedForward` has two.
    """

    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, ff_width: int, *, key: Array):
        kg, ku, kd = jr.split(key, 3)
        self.gate = eqx.nn.Linear(width, ff_width, use_bias=False, key=kg)
        self.up = eqx.nn.Linear(width, ff_width, use_bias=False, key=ku)
        self.down = eqx.nn.Linear(ff_width, width, use_bias=False, key=kd)

    def __call__(
        self, x: Float[Array, "*rows width"]  # noqa: F722 - a jaxtyping shape
    ) -> Float[Array, "*rows width"]:  # noqa: F722 - a jaxtyping shape
        return linear(self.down, jax.nn.silu(linear(self.gate, x)) * linear(self.up, x))


class Block(eqx.Module):
    """Pre-norm transformer block.

    ``h <- h + attn(N1(h))`` followed by ``h <- h + ff(N2(h))``, on ``(B, T, W)``; the norms
    are LayerNorms (``norm="layer"``) or RMSNorms (``"rms"``), the feed-forward a `FeedForward`
    (``feed_forward="gelu"``) or a `SwiGLU` (``"swiglu"``), and the attention rotates its
    queries and keys with ``positions="rotary"``. ``branch_scale`` ``a`` multiplies both
    branches, ``h <- h + a attn(N1(h))``, ``h <- h + a ff(N2(h))`` (1: none; the depth
    multiplier of ``GPT(branch_scale=...)``).
    """

    attn: CausalSelfAttention
    ff: FeedForward | SwiGLU
    n1: eqx.nn.LayerNorm | eqx.nn.RMSNorm
    n2: eqx.nn.LayerNorm | eqx.nn.RMSNorm
    branch_scale: float = eqx.field(static=True)

    def __init__(
        self,
        width: int,
        n_heads: int,
        ff_width: int,
        *,
        key: Array,
        norm: str = "layer",
        positions: str | None = None,
        feed_forward: str = "gelu",
        rotary_base: float = 10000.0,
        branch_scale: float = 1.0,
    ):
        _check_option("norm", norm, NORMS)
        _check_option("feed_forward", feed_forward, FEED_FORWARDS)
        self.branch_scale = positive_number(branch_scale, "Block: branch_scale")
        ka, kf = jr.split(key)
        self.attn = CausalSelfAttention(
            width, n_heads, key=ka, positions=positions, rotary_base=rotary_base
        )
        if feed_forward == "swiglu":
            self.ff = SwiGLU(width, ff_width, key=kf)
        else:
            self.ff = FeedForward(width, ff_width, key=kf)
        self.n1 = _make_norm(norm, width)
        self.n2 = _make_norm(norm, width)

    def __call__(
        self, h: Float[Array, "batch seq width"]  # noqa: F722 - a jaxtyping shape
    ) -> Float[Array, "batch seq width"]:  # noqa: F722 - a jaxtyping shape
        if self.branch_scale == 1.0:
            h = h + self.attn(normalise(self.n1, h))
            return h + self.ff(normalise(self.n2, h))
        h = h + self.branch_scale * self.attn(normalise(self.n1, h))
        return h + self.branch_scale * self.ff(normalise(self.n2, h))


class GPT(eqx.Module):
    """Decoder-only pre-norm transformer language model.

    For integer ids of shape ``(B, T)`` with ``T <= max_len``::

        h_0 = E_tok[ids] + E_pos[0..T-1]                               (B, T, W)
        h_l = Block_l(h_{l-1}),  l = 1..L
        logits = LN_f(h_L) Wh^T + bh                                   (B, T, V)

    With ``positions="rotary"`` there is no position table (``pos_emb`` is None and
    ``h_0 = E_tok[ids]``): every attention rotates its queries and keys instead.

    Initialisation is Equinox's default for every layer (embeddings ``N(0, 1)``, linear
    weights and biases ``U(-1/sqrt(n_in), 1/sqrt(n_in))``, LayerNorm ``gamma = 1``,
    ``beta = 0``), except that the output head's weight and bias are scaled by 0.1 so the
    initial predictions are close to uniform.

    Args:
        vocab_size: ``V``.
        width: ``W``; must be divisible by `n_heads`.
        n_heads: ``H``.
        n_blocks: ``L``.
        ff_width: ``F``, the hidden width of each feed-forward layer.
        max_len: the largest sequence length accepted (rows of the positional embedding).
        key: PRNG key for initialisation.
        norm: ``"layer"`` (LayerNorms, the default) or ``"rms"`` (`eqx.nn.RMSNorm` without
            bias, ``gamma = 1``) for ``n1``, ``n2`` and ``norm_f``.
        positions: ``"table"`` (a learned ``(max_len, W)`` table, the default) or
            ``"rotary"`` (rotary embeddings inside every attention, base `rotary_base`; the
            head width ``W / H`` must be even).
        feed_forward: ``"gelu"`` (`FeedForward`, the default) or ``"swiglu"`` (`SwiGLU`).
        rotary_base: ``b`` of the rotary angles ``t * b**(-2 i / d)``.
        branch_scale: ``a > 0``, every block's multiplier of its two residual branches
            (`Block`); 1 (the default) adds them as they are. ``1 / sqrt(2 L)`` is the
            depth-muP multiplier of ``GPTConfig(parameterisation="mupc")``: the stream stays
            of the same size at any depth.

    The defaults draw exactly the model (and the random numbers) of a GPT without options.
    """

    tok_emb: eqx.nn.Embedding
    pos_emb: eqx.nn.Embedding | None
    blocks: tuple[Block, ...]
    norm_f: eqx.nn.LayerNorm | eqx.nn.RMSNorm
    head: eqx.nn.Linear
    max_len: int = eqx.field(static=True)
    positions: str = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: int,
        width: int,
        n_heads: int,
        n_blocks: int,
        ff_width: int,
        max_len: int,
        *,
        key: Array,
        norm: str = "layer",
        positions: str = "table",
        feed_forward: str = "gelu",
        rotary_base: float = 10000.0,
        branch_scale: float = 1.0,
    ):
        if n_heads < 1 or width % n_heads != 0:
            raise ValueError(f"width ({width}) must be divisible by n_heads ({n_heads})")
        _check_option("norm", norm, NORMS)
        _check_option("positions", positions, POSITIONS)
        _check_option("feed_forward", feed_forward, FEED_FORWARDS)
        if positions == "rotary" and (width // n_heads) % 2:
            raise ValueError(
                f"GPT: positions='rotary' needs an even head width, got {width // n_heads} "
                f"(width {width} over n_heads={n_heads})."
            )
        for name, value in [
            ("vocab_size", vocab_size),
            ("width", width),
            ("n_blocks", n_blocks),
            ("ff_width", ff_width),
            ("max_len", max_len),
        ]:
            if value < (0 if name == "n_blocks" else 1):
                raise ValueError(f"{name} must be positive, got {value}")
        k_tok, k_pos, k_blocks, k_head = jr.split(key, 4)
        self.tok_emb = eqx.nn.Embedding(vocab_size, width, key=k_tok)
        self.pos_emb = (
            eqx.nn.Embedding(max_len, width, key=k_pos) if positions == "table" else None
        )
        self.max_len = int(max_len)
        self.positions = positions
        attention_positions = "rotary" if positions == "rotary" else None
        self.blocks = tuple(
            Block(width, n_heads, ff_width, key=k, norm=norm, positions=attention_positions,
                  feed_forward=feed_forward, rotary_base=rotary_base,
                  branch_scale=branch_scale)
            for k in jr.split(k_blocks, n_blocks)
        )
        self.norm_f = _make_norm(norm, width)
        head = eqx.nn.Linear(width, vocab_size, use_bias=True, key=k_head)
        self.head = eqx.tree_at(
            lambda lin: (lin.weight, lin.bias),
            head,
            # use_bias=True: the head has a bias
            (head.weight * _HEAD_INIT_SCALE, head.bias * _HEAD_INIT_SCALE),  # type: ignore[operator]
        )

    @property
    def vocab_size(self) -> int:
        """Size ``V`` of the vocabulary."""
        return self.tok_emb.num_embeddings

    def __call__(
        self, ids: Int[Array, "batch seq"]  # noqa: F722 - a jaxtyping shape
    ) -> Float[Array, "batch seq vocab"]:  # noqa: F722 - a jaxtyping shape
        """Return next-token logits of shape ``(B, T, V)`` for ids of shape ``(B, T)``."""
        if ids.ndim != 2:
            raise ValueError(f"ids must have shape (batch, seq), got shape {ids.shape}")
        seq = ids.shape[1]
        if seq > self.max_len:
            raise ValueError(f"sequence length {seq} exceeds max_len {self.max_len}")
        h = self.tok_emb.weight[ids]
        if self.pos_emb is not None:
            h = h + self.pos_emb.weight[:seq]
        for block in self.blocks:
            h = block(h)
        return linear(self.head, normalise(self.norm_f, h))


def count_flops(
    vocab: int,
    width: int,
    n_heads: int,
    n_blocks: int,
    ff_width: int,
    seq: int,
    batch: int,
    *,
    feed_forward: str = "gelu",
) -> int:
    """Analytic FLOP count of one backprop training step of `GPT`.

    Only matrix products are counted, at 2 FLOPs per multiply-add; embeddings lookups,
    layer normalisations, softmax, GELU and the optimiser are ignored. With ``N = B T``
    tokens, the forward pass costs::

        per block:  projections  4 * 2 N W^2    (q, k, v, o)
                    feed-forward 2 * 2 N W F    (fc1, fc2; feed_forward="swiglu":
                                 3 * 2 N W F     gate, up, down)
                    attention    2 * 2 B T^2 W  (q k^T scores and A v mix, all heads)
        head:                    2 N W V

        forward = L (8 N W^2 + 4 N W F + 4 B T^2 W) + 2 N W V

    (``4 N W F`` becomes ``6 N W F`` for a SwiGLU). The rotary rotation and the norms
    (LayerNorm or RMSNorm) are elementwise and not counted.
    The causal mask is not exploited (dense implementations compute the full ``T x T``
    score matrix), and ``n_heads`` does not change the count (the heads partition ``W``).
    The backward pass costs about twice the forward (one product for the gradient with
    respect to the input and one for the gradient with respect to the weights), so::

        step = 3 * forward
    """
    del n_heads
    _check_option("feed_forward", feed_forward, FEED_FORWARDS)
    ff_matrices = 3 if feed_forward == "swiglu" else 2
    n = batch * seq
    per_block = (
        8 * n * width**2 + 2 * ff_matrices * n * width * ff_width + 4 * batch * seq**2 * width
    )
    forward = n_blocks * per_block + 2 * n * width * vocab
    return 3 * forward
