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
with the per-position Equinox semantics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
from jaxtyping import Float, Int

from fusedpc.core._precision import resolve_compute_dtype
from fusedpc.core.losses import softmax_cross_entropy

Array = jax.Array
PyTree = Any

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


def _linear(lin: eqx.nn.Linear, x: Array) -> Array:
    """Apply ``lin`` over the last axis of ``x``: ``y = x W^T + b``."""
    y = x @ lin.weight.T
    if lin.bias is not None:
        y = y + lin.bias
    return y


def _check_option(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"GPT: {name} must be one of {allowed}, got {value!r}.")


def _rms_norm(norm: eqx.nn.RMSNorm, x: Array) -> Array:
    """Apply ``norm`` over the last axis of ``x``, matching ``eqx.nn.RMSNorm`` exactly.

    ``y = x / sqrt(mean(x^2) + eps) * gamma + beta`` (``gamma``, ``beta`` when present), the
    mean taken over the last axis, in at least float32.
    """
    if norm.shape != x.shape[-1:]:
        raise ValueError(
            f"RMSNorm of shape {norm.shape} cannot act on an array of shape {x.shape}"
        )
    dtype = x.dtype
    if jnp.finfo(dtype).bits < 32:  # statistics in at least float32
        x = x.astype(jnp.float32)
    out = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + norm.eps)
    if norm.weight is not None:
        out = norm.weight.astype(out.dtype) * out
    if norm.bias is not None:
        out = out + norm.bias.astype(out.dtype)
    return out.astype(dtype)


def _norm(norm: eqx.nn.LayerNorm | eqx.nn.RMSNorm, x: Array) -> Array:
    """`_layer_norm` or `_rms_norm`, by the type of ``norm``."""
    if isinstance(norm, eqx.nn.RMSNorm):
        return _rms_norm(norm, x)
    return _layer_norm(norm, x)


def _make_norm(norm: str, width: int) -> eqx.nn.LayerNorm | eqx.nn.RMSNorm:
    if norm == "rms":
        return eqx.nn.RMSNorm(width, use_bias=False)
    return eqx.nn.LayerNorm(width)


def _rotate(x: Array, base: float) -> Array:
    """Rotary embedding of heads ``(B, H, T, d)``: at position ``t`` the features ``i`` and
    ``i + d/2`` (``i < d/2``) turn by ``theta = t * base**(-2 i / d)``::

        x_i' = x_i cos(theta) - x_{i+d/2} sin(theta)
        x_{i+d/2}' = x_i sin(theta) + x_{i+d/2} cos(theta)
    """
    t, d = x.shape[-2], x.shape[-1]
    half = d // 2
    frequencies = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * frequencies[None, :]  # (T, d/2)
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


def _layer_norm(ln: eqx.nn.LayerNorm, x: Array) -> Array:
    """Apply ``ln`` over the last axis of ``x``, matching ``eqx.nn.LayerNorm`` exactly.

    ``y = (x - mu) / sqrt(sigma^2 + eps) * gamma + beta``, where ``mu`` and the biased
    variance ``sigma^2`` are taken over the last axis.
    """
    if ln.shape != x.shape[-1:]:
        raise ValueError(f"LayerNorm of shape {ln.shape} cannot act on an array of shape {x.shape}")
    dtype = x.dtype
    if jnp.finfo(dtype).bits < 32:  # statistics in at least float32
        x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.maximum(0.0, jnp.var(x, axis=-1, keepdims=True))
    out = (x - mean) * jax.lax.rsqrt(variance + ln.eps)
    if ln.weight is not None:
        out = ln.weight.astype(out.dtype) * out
    if ln.bias is not None:
        out = out + ln.bias.astype(out.dtype)
    return out.astype(dtype)


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
    their positions before the scores (`_rotate`, base ``rotary_base``; ``d`` even); with
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

        q = split_heads(_linear(self.wq, x))
        k = split_heads(_linear(self.wk, x))
        v = split_heads(_linear(self.wv, x))
        if self.positions == "rotary":
            q, k = _rotate(q, self.rotary_base), _rotate(k, self.rotary_base)
        # scores and softmax in float32 whatever the dtype of q and k
        scores = jnp.einsum("bhtd,bhsd->bhts", q, k, preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(d)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, -jnp.inf)
        attn = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        ctx = jnp.einsum("bhts,bhsd->bhtd", attn, v)
        ctx = ctx.transpose(0, 2, 1, 3).reshape(b, t, w)
        return _linear(self.wo, ctx)


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
        return _linear(self.fc2, jax.nn.gelu(_linear(self.fc1, x), approximate=True))


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
        return _linear(self.down, jax.nn.silu(_linear(self.gate, x)) * _linear(self.up, x))


class Block(eqx.Module):
    """Pre-norm transformer block.

    ``h <- h + attn(N1(h))`` followed by ``h <- h + ff(N2(h))``, on ``(B, T, W)``; the norms
    are LayerNorms (``norm="layer"``) or RMSNorms (``"rms"``), the feed-forward a `FeedForward`
    (``feed_forward="gelu"``) or a `SwiGLU` (``"swiglu"``), and the attention rotates its
    queries and keys with ``positions="rotary"``.
    """

    attn: CausalSelfAttention
    ff: FeedForward | SwiGLU
    n1: eqx.nn.LayerNorm | eqx.nn.RMSNorm
    n2: eqx.nn.LayerNorm | eqx.nn.RMSNorm

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
    ):
        _check_option("norm", norm, NORMS)
        _check_option("feed_forward", feed_forward, FEED_FORWARDS)
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
        h = h + self.attn(_norm(self.n1, h))
        return h + self.ff(_norm(self.n2, h))


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
                  feed_forward=feed_forward, rotary_base=rotary_base)
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
        return _linear(self.head, _norm(self.norm_f, h))


def cross_entropy(
    logits: Float[Array, "*positions vocab"],  # noqa: F722 - a jaxtyping shape
    targets: Int[Array, "*positions"],  # noqa: F722 - a jaxtyping shape
) -> Float[Array, ""]:  # noqa: F722 - a jaxtyping shape
    """Mean softmax cross-entropy over all positions.

    ``loss = mean_n [ logsumexp(z_n) - z_n[y_n] ]`` for logits ``z`` of shape ``(..., V)``
    and integer targets ``y`` of shape ``(...)``, computed in at least float32. The one
    implementation is the fused pipeline's, `fusedpc.core.losses.softmax_cross_entropy.loss`,
    so the backprop twin and the fused step report the same number.
    """
    if jnp.finfo(logits.dtype).bits < 32:
        logits = logits.astype(jnp.float32)
    return softmax_cross_entropy.loss(logits, targets)  # type: ignore[misc]  # it has a loss


_NORM_TYPES = (eqx.nn.LayerNorm, eqx.nn.RMSNorm)


def _layer_norm_spec(model: PyTree) -> PyTree:
    """Bool pytree matching ``model``: True at the affine parameters of every LayerNorm and
    RMSNorm."""

    def label(node):
        frozen = isinstance(node, _NORM_TYPES)
        return jax.tree.map(lambda _: frozen, node)

    return jax.tree.map(label, model, is_leaf=lambda x: isinstance(x, _NORM_TYPES))


def _is_none(x) -> bool:
    return x is None


def make_backprop_step(
    optimiser: optax.GradientTransformation,
    *,
    frozen_layer_norm: bool = False,
    compute_dtype: Any = None,
) -> Callable[[GPT, PyTree, Array, Array], tuple[GPT, PyTree, Array]]:
    """Build a compiled training step ``step(model, opt_state, ids, targets)``.

    One step computes ``loss = cross_entropy(model(ids), targets)`` and its gradient by
    backpropagation, transforms the gradient with `optimiser` and applies it, returning
    ``(model, opt_state, loss)``.

    `opt_state` is ``optimiser.init(eqx.filter(model, eqx.is_array))`` (in both modes).
    The buffers of the `model` and `opt_state` passed in are donated to the step, so they
    must not be used again afterwards; `ids` and `targets` (shape ``(B, T)``) are not
    donated.

    Any `GPT` works, whatever its ``norm``, ``positions`` and ``feed_forward``.

    With ``frozen_layer_norm=True`` every norm's affine parameter (``gamma`` and ``beta``
    of ``n1``, ``n2`` and ``norm_f``, LayerNorms or RMSNorms) is left exactly as it was,
    whatever the optimiser (including Adam with weight decay): its gradient is zeroed before the
    optimiser sees it, so moments and global-norm clipping ignore it, and its update is
    dropped, so the parameter is returned bit-for-bit unchanged.

    With ``compute_dtype="bfloat16"`` the forward runs on a bfloat16 copy of the model
    (LayerNorm statistics, attention scores, softmax and the loss in float32) and the
    gradient flows back through the cast to the float32 model, which the optimiser updates
    in float32: the mixed-precision twin of a fused step with the same ``compute_dtype``.
    """
    dtype = resolve_compute_dtype(compute_dtype, "make_backprop_step: compute_dtype")

    def cast(m):
        if dtype is None:
            return m
        return jax.tree.map(
            lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, m
        )

    @eqx.filter_jit(donate="all-except-first")
    def _step(batch, model, opt_state):
        ids, targets = batch

        def loss_fn(m):
            return cross_entropy(cast(m)(ids), targets)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        if frozen_layer_norm:
            spec = _layer_norm_spec(model)
            grads = jax.tree.map(
                lambda g, f: None if g is None else (jnp.zeros_like(g) if f else g),
                grads,
                spec,
                is_leaf=_is_none,
            )
        # Optax mixes Python floats with int32 step counts (Adam's bias correction), which
        # fails under `jax_numpy_dtype_promotion="strict"`; run it under standard promotion.
        with jax.numpy_dtype_promotion("standard"):
            params = eqx.filter(model, eqx.is_array)
            updates, opt_state = optimiser.update(grads, opt_state, params)
        if frozen_layer_norm:
            updates = jax.tree.map(lambda u, f: None if f else u, updates, spec, is_leaf=_is_none)
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    def step(model, opt_state, ids, targets):
        # Inputs travel in the first (non-donated) argument; model and opt_state are donated.
        return _step((ids, targets), model, opt_state)

    return step


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
