"""Multi-head causal self-attention: four slots (or a fused QKV slot and an output slot), each
any part, around a weight-free mixing step with a hand-derived backward."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp

from fusedpc.core._checks import check_part, expect_rank
from fusedpc.core._metrics import named
from fusedpc.core._part import (
    AbstractPart,
    Core,
    LinearParams,
    PyTree,
    display_path,
    join_path,
    replace_fields,
)
from fusedpc.core._precision import einsum, to_compute, widened

_SEPARATE = ("wq", "wk", "wv")
_LAYOUT = "(batch, seq, features)"
MIXINGS = ("tiles", "dot_product_attention")
MIXING_IMPLEMENTATIONS = (None, "xla", "cudnn")
POSITIONS = (None, "rotary")
_CUDNN_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
# The first jax whose `jax.nn.dot_product_attention` takes `return_residual` (absent in 0.8.0).
_RESIDUAL_SINCE = "0.8.1"


class AttentionState(eqx.Module):
    """State of a `MultiHeadAttention`: one field per slot (the unused ones are None)."""

    wq: PyTree = None
    wk: PyTree = None
    wv: PyTree = None
    wqkv: PyTree = None
    wo: PyTree = None


class AttentionSlotCaches(eqx.Module):
    """The slots' own caches, one field per slot (the unused ones are None)."""

    wq: PyTree = None
    wk: PyTree = None
    wv: PyTree = None
    wqkv: PyTree = None
    wo: PyTree = None


class AttentionCache(eqx.Module):
    """What the backward reads: the slots' caches, Q as rows `(B, T, D)`, the heads
    `(B, H, T, d)` of K and V and the attention weights of each query tile (a tuple; one
    tile: `A` `(B, H, T, T)`; see `causal_mix_tiles`)."""

    slots: AttentionSlotCaches
    q: jax.Array
    k: jax.Array
    v: jax.Array
    weights: tuple[jax.Array, ...]


class DotProductAttentionCache(eqx.Module):
    """What the backward reads under `mixing="dot_product_attention"`: the slots' caches,
    Q, K, V and the context $C$ per head in `jax.nn.dot_product_attention`'s layout
    `(B, T, H, d)`, and the log-sum-exp of each query's scores `(B, T, H)`. Nothing of size
    `(T, T)`: the backward recomputes the weights from these."""

    slots: AttentionSlotCaches
    q: jax.Array
    k: jax.Array
    v: jax.Array
    context: jax.Array
    lse: jax.Array


def _split_heads(y: jax.Array, n_heads: int, transposed: bool = False) -> jax.Array:
    """`(B, T, D)` -> `(B, H, T, D/H)`, or each head transposed, `(B, H, D/H, T)`; head `h`
    holds features `[h d, (h + 1) d)`."""
    b, t, width = y.shape
    heads = y.reshape(b, t, n_heads, width // n_heads)
    return heads.transpose(0, 2, 3, 1) if transposed else heads.transpose(0, 2, 1, 3)


def _merge_heads(y: jax.Array, transposed: bool = False) -> jax.Array:
    """Undoes `_split_heads`: `(B, H, T, d)` (transposed: `(B, H, d, T)`) -> `(B, T, H d)`."""
    if transposed:
        y = y.swapaxes(-1, -2)
    b, h, t, d = y.shape
    return y.transpose(0, 2, 1, 3).reshape(b, t, h * d)


def causal_tiles_for(seq_len: int) -> int:
    """How many query tiles `MultiHeadAttention` splits a sequence into by default: from 128
    positions 4 (divisible by 4) or 2 (even), else 1. Tiling skips the score blocks above the
    causal diagonal, which pays from 128 positions on; more tiles than 4 add more per-tile
    overhead than they skip, and at 64 positions two tiles made the whole GPT step slower and
    its compile longer than one (measured in docs/performance.md, on CPU)."""
    if seq_len >= 128 and seq_len % 4 == 0:
        return 4
    if seq_len >= 128 and seq_len % 2 == 0:
        return 2
    return 1


def _tile_bounds(seq_len: int, tiles: int) -> list[tuple[int, int]]:
    """`[start, stop)` of each query tile: `min(tiles, seq_len)` tiles whose sizes differ by
    at most one (equal when `tiles` divides `seq_len`)."""
    n = min(tiles, seq_len)
    return [(i * seq_len // n, (i + 1) * seq_len // n) for i in range(n)]


def _masked_scores(q: jax.Array, k: jax.Array, start: int, stop: int, d: int) -> jax.Array:
    """The scores $S = Q K^\\top / \\sqrt d$ of query rows `[start, stop)` against keys
    `[0, stop)` (heads `(B, H, T, d)`), the entries with $s > t$ set to the most negative
    finite number."""
    # float32 scores whatever the compute dtype (the softmax reads them)
    scores = einsum("bhtd,bhsd->bhts", q[..., start:stop, :], k[..., :stop, :], accumulate=True)
    scores = scores * (1.0 / math.sqrt(d))
    row = jnp.arange(start, stop)[:, None]
    col = jnp.arange(stop)[None, :]
    # The mask depends on the scores (`| isnan`: a NaN score stays NaN, as it would
    # anyway) so that XLA cannot hoist it out of `run`'s scan as a loop invariant:
    # hoisted, it changes how the softmax kernel is compiled, and K `step`s and one K-step
    # `run` would differ in the last bits.
    causal = (col <= row) | jnp.isnan(scores)
    return jnp.where(causal, scores, jnp.finfo(scores.dtype).min)


def causal_mix_tiles(
    q: jax.Array, k: jax.Array, v: jax.Array, tiles: int = 1
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """`causal_mix` computed by query tiles: returns `C` and the tiles' attention weights.

    The T queries are split into `tiles` tiles (equal when `tiles` divides T, sizes one apart
    otherwise; at most T tiles); tile $i$ (rows $[a_i, b_i)$) attends to the key prefix
    $[0, b_i)$ only, since every later key is masked for it. Its weights
    $A_i$ have shape `(B, H, b_i - a_i, b_i)`; the masked upper-right blocks of $A$, a fraction
    $(n - 1) / 2n$ of it, are never computed. Per row, the same numbers as `causal_mix` up to
    float32 rounding (the softmax of a row sums over its prefix instead of the whole row, the
    masked entries contributing exactly 0 either way).
    """
    seq_len, d = q.shape[-2], q.shape[-1]
    contexts, weights = [], []
    for start, stop in _tile_bounds(seq_len, tiles):
        scores = _masked_scores(q, k, start, stop, d)
        tile_weights = to_compute(jax.nn.softmax(scores, axis=-1))
        contexts.append(einsum("bhts,bhsd->bhtd", tile_weights, v[..., :stop, :]))
        weights.append(tile_weights)
    context = contexts[0] if len(contexts) == 1 else jnp.concatenate(contexts, axis=-2)
    return context, tuple(weights)


def causal_mix(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The weight-free mixing on heads `(B, H, T, d)`: returns `(C, A)`.

    $S = Q K^\\top / \\sqrt d$, entries with $s > t$ set to the most negative finite number
    (their weight is exactly 0 and no NaN can appear: the diagonal is never masked),
    $A = \\mathrm{softmax}_s(S)$, $C = A V$. (`causal_mix_tiles` with one tile.)
    """
    context, (weights,) = causal_mix_tiles(q, k, v, 1)
    return context, weights


def causal_mix_backward(
    q: jax.Array, k: jax.Array, v: jax.Array, weights: jax.Array, error: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The hand-derived backward of `causal_mix`: `(dQ, dK, dV)` from `dC` (all per head).

    $dA = dC\\, V^\\top$, $dV = A^\\top dC$,
    $dS = A \\odot (dA - \\textstyle\\sum_s dA \\odot A) / \\sqrt d$, $dQ = dS\\, K$,
    $dK = dS^\\top Q$. Masked entries have $A = 0$, hence $dS = 0$: nothing flows to the future.
    (Per-head front end of `causal_mix_backward_rows`, which the attention part calls.)
    """
    n_heads = q.shape[1]
    d_q, d_k, d_v = causal_mix_backward_rows(
        _merge_heads(q), k, v, (weights,), _merge_heads(error), n_heads
    )
    return _split_heads(d_q, n_heads), _split_heads(d_k, n_heads), _split_heads(d_v, n_heads)


def _add_to_prefix(total: jax.Array | None, part: jax.Array, seq_len: int) -> jax.Array:
    """`total` (None: zeros) plus `part` over the first `part.shape[-1]` of `seq_len` positions
    of the last axis. An in-place add into the prefix, which avoids padding each part to full
    length before adding (faster, measured in docs/performance.md)."""
    if total is None:
        if part.shape[-1] == seq_len:
            return part
        total = jnp.zeros((*part.shape[:-1], seq_len), part.dtype)
    return total.at[..., : part.shape[-1]].add(part)


def causal_mix_backward_rows(
    q_rows: jax.Array,
    k: jax.Array,
    v: jax.Array,
    weights: tuple[jax.Array, ...],
    error_rows: jax.Array,
    n_heads: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The backward of `causal_mix_tiles` with Q, dC and the results as rows `(B, T, D)` (K, V
    per head, `weights` the tiles' weights as `causal_mix_tiles` returns them).

    Per query tile $i$ (rows $[a_i, b_i)$, key prefix $[0, b_i)$):
    $dA_i = dC_i V_{<b_i}^\\top$, $dS_i = A_i \\odot (dA_i - \\mathrm{rowsum}(dA_i \\odot A_i))
    / \\sqrt d$, $dQ_i = dS_i K_{<b_i}$, and the prefix's $dK_{<b_i} \\mathrel{+}= dS_i^\\top
    Q_i$, $dV_{<b_i} \\mathrel{+}= A_i^\\top dC_i$ (one tile: `causal_mix_backward`).

    Every product is written so that the operand it contracts over its rows ($A^\\top dC$ and
    $dS^\\top Q$) arrives transposed from the head split itself: $dV^\\top = dC^\\top A$ and
    $dK^\\top = Q^\\top dS$ with $dC^\\top$, $Q^\\top$ split straight to `(B, H, d, T)` and the
    results merged straight back. The head split and merge are transposes anyway, so this
    costs nothing extra, and each product has the row-major form XLA:CPU hands to its fast
    matmul library; written as $A^\\top dC$ they fall back to a slower generic batched dot
    (measured in docs/performance.md).
    """
    bounds = _tile_bounds(error_rows.shape[1], len(weights))
    return _backward_by_tiles(
        q_rows, k, v, error_rows, n_heads, bounds, lambda i, start, stop: weights[i]
    )


def _backward_by_tiles(
    q_rows: jax.Array,
    k: jax.Array,
    v: jax.Array,
    error_rows: jax.Array,
    n_heads: int,
    bounds: list[tuple[int, int]],
    tile_weights_of: Callable[[int, int, int], jax.Array],
    context: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The tile loop of `causal_mix_backward_rows`; `tile_weights_of(i, start, stop)` gives
    tile $i$'s weights (cached or recomputed). With `context` (per head, `(B, H, T, d)`) the
    softmax row sums are taken as $\\mathrm{rowsum}(dC \\odot C)$ (equal to
    $\\mathrm{rowsum}(dA \\odot A)$ since $C = A V$; $T d$ products per head instead of
    $T^2$), otherwise from the tile's $dA \\odot A$."""
    seq_len = error_rows.shape[1]
    d = k.shape[-1]
    # dS carries the 1/sqrt(d) of the scores; it is applied to dC (T d entries per head)
    # rather than to dA or dS (T T each), where XLA:CPU would materialise it as a full array.
    scaled = _split_heads(error_rows * (1.0 / math.sqrt(d)), n_heads)
    error_t = _split_heads(error_rows, n_heads, transposed=True)
    q_t = _split_heads(q_rows, n_heads, transposed=True)
    row_sums = None if context is None else jnp.sum(
        widened(scaled) * widened(context), axis=-1, keepdims=True
    )
    d_q_tiles, d_k_t, d_v_t = [], None, None
    for i, (start, stop) in enumerate(bounds):
        tile_weights = widened(tile_weights_of(i, start, stop))
        d_weights = einsum(  # dA / sqrt(d), in float32 whatever the compute dtype
            "bhtd,bhsd->bhts", scaled[..., start:stop, :], v[..., :stop, :], accumulate=True
        )
        if row_sums is None:
            tile_sums = jnp.sum(d_weights * tile_weights, axis=-1, keepdims=True)
        else:
            tile_sums = row_sums[..., start:stop, :]
        d_scores = tile_weights * (d_weights - tile_sums)
        d_q_tiles.append(einsum("bhts,bhsd->bhtd", d_scores, k[..., :stop, :]))
        k_part = einsum("bhdt,bhts->bhds", q_t[..., start:stop], d_scores)
        v_part = einsum("bhdt,bhts->bhds", error_t[..., start:stop], tile_weights)
        d_k_t = _add_to_prefix(d_k_t, k_part, seq_len)
        d_v_t = _add_to_prefix(d_v_t, v_part, seq_len)
    d_q = d_q_tiles[0] if len(d_q_tiles) == 1 else jnp.concatenate(d_q_tiles, axis=-2)
    # every sequence has at least one tile, so the loop has set both sums
    d_k, d_v = (_merge_heads(cast(jax.Array, a), transposed=True) for a in (d_k_t, d_v_t))
    return _merge_heads(d_q), d_k, d_v


def dot_product_attention_available() -> bool:
    """Whether the installed `jax.nn.dot_product_attention` can return its log-sum-exp
    (`return_residual`, from jax 0.8.1), which `mixing="dot_product_attention"` needs."""
    try:
        parameters = inspect.signature(jax.nn.dot_product_attention).parameters
    except (TypeError, ValueError):  # a signature Python cannot read: assume the keyword
        return True
    return "return_residual" in parameters


def causal_mix_dot_product(
    q: jax.Array, k: jax.Array, v: jax.Array, implementation: str | None = None
) -> tuple[jax.Array, jax.Array]:
    """The causal mixing through `jax.nn.dot_product_attention`, on `(B, T, H, d)` arrays:
    returns the context $C$ `(B, T, H, d)` and the log-sum-exp of each query's scores
    $\\ell_t = \\log \\sum_{s \\le t} e^{S_{ts}}$ `(B, T, H)`, with
    $S = Q K^\\top / \\sqrt d$ per head (the same numbers as `causal_mix` to float32
    rounding). `implementation` goes to jax as is (`None`: jax chooses; `"xla"`, `"cudnn"`).
    """
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        scale=1.0 / math.sqrt(q.shape[-1]),
        implementation=cast(Any, implementation),
        return_residual=True,
    )


def causal_mix_dot_product_backward_rows(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    context: jax.Array,
    lse: jax.Array,
    error_rows: jax.Array,
    tiles: int = 1,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The backward of `causal_mix_dot_product` from Q, K, V, the context $C$ (each
    `(B, T, H, d)`), the log-sum-exp $\\ell$ `(B, T, H)` and $dC$ as rows `(B, T, H d)`:
    returns $dQ, dK, dV$ as rows `(B, T, H d)`.

    The weights are recomputed per query tile (as in `causal_mix_tiles`; tile $i$ against
    its key prefix $[0, b_i)$): $A_i = \\exp(S_i - \\ell_i)$, masked entries exactly 0.
    Then the softmax-attention backward, with $D_t = \\mathrm{rowsum}(dC \\odot C)_t$:
    $dV = A^\\top dC$, $dA = dC\\, V^\\top$, $dS = A \\odot (dA - D) / \\sqrt d$,
    $dQ = dS\\, K$, $dK = dS^\\top Q$.
    """
    b, seq_len, n_heads, d = q.shape
    q_heads, k_heads, v_heads, context_heads = (a.transpose(0, 2, 1, 3) for a in (q, k, v, context))
    lse_heads = widened(lse).transpose(0, 2, 1)[..., None]  # (B, H, T, 1)

    def tile_weights(i: int, start: int, stop: int) -> jax.Array:
        scores = _masked_scores(q_heads, k_heads, start, stop, d)
        return jnp.exp(scores - lse_heads[..., start:stop, :])

    return _backward_by_tiles(
        q.reshape(b, seq_len, n_heads * d),
        k_heads,
        v_heads,
        error_rows,
        n_heads,
        _tile_bounds(seq_len, tiles),
        tile_weights,
        context_heads,
    )


def rotary_angles(
    seq_len: int, head_width: int, base: float, tie: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """$\\cos\\theta$ and $\\sin\\theta$ of the rotary angles
    $\\theta_{t,i} = t\\, b^{-2i/d}$ for positions $t < T$ = `seq_len` and pairs
    $i < d/2$ ($d$ = `head_width`, even; $b$ = `base`), each `(T, d/2)` in float32.

    `tie`, an array of the step's data (the rows being rotated), makes the angles depend on
    it (NaN where its first entry is NaN, which the rotated rows would be anyway), so that XLA
    neither folds them into constants nor hoists them out of `run`'s scan: folded or hoisted,
    they are computed by another implementation of cos and sin than inside the step's
    kernels, and K `step`s and one K-step `run` would differ in the last bits."""
    exponents = jnp.arange(0, head_width, 2, dtype=jnp.float32) / head_width
    frequencies = 1.0 / (base**exponents)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * frequencies[None, :]
    if tie is not None:
        probe = widened(jnp.ravel(tie)[0])
        angles = jnp.where(jnp.isnan(probe), jnp.float32(jnp.nan), angles)
    return jnp.cos(angles), jnp.sin(angles)


def rotate_rows(
    x: jax.Array, n_heads: int, base: float, *, inverse: bool = False
) -> jax.Array:
    """Rotary position embedding of rows `(B, T, H d)`: in each head, the pair of features
    $(i, i + d/2)$ at position $t$ is rotated by $\\theta_{t,i}$ (`rotary_angles`),

    $$x'_i = x_i \\cos\\theta - x_{i+d/2} \\sin\\theta, \\qquad
    x'_{i+d/2} = x_i \\sin\\theta + x_{i+d/2} \\cos\\theta$$

    (the half-split pairing of GPT-NeoX and LLaMA). `inverse=True` rotates by
    $-\\theta$: the transpose, which is the backward of the rotation."""
    b, t, width = x.shape
    d = width // n_heads
    half = d // 2
    cos, sin = rotary_angles(t, d, base, tie=x)
    cos, sin = to_compute(cos)[:, None, :], to_compute(sin)[:, None, :]  # (T, 1, d/2)
    if inverse:
        sin = -sin
    heads = x.reshape(b, t, n_heads, d)
    first, second = heads[..., :half], heads[..., half:]
    rotated = jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
    return rotated.reshape(b, t, width)


def _check_positions(positions: object, base: object) -> None:
    """Refuses an unknown `positions` and a rotary base that is not a number above 1."""
    if positions not in POSITIONS:
        raise ValueError(
            f"MultiHeadAttention: positions must be one of {POSITIONS} (None: the attention "
            f"adds no positions; 'rotary': rotary position embeddings), got {positions!r}."
        )
    if isinstance(base, bool) or not isinstance(base, int | float) or not base > 1.0:
        raise ValueError(
            f"MultiHeadAttention: rotary_base must be a number > 1 (10000.0 by default), got "
            f"{base!r}."
        )


def _check_mixing(mixing: object, implementation: object) -> None:
    """Refuses an unknown `mixing` or `mixing_implementation`, an implementation without the
    `"dot_product_attention"` mixing, and that mixing on a jax without `return_residual`."""
    if not isinstance(mixing, str) or mixing not in MIXINGS:
        raise ValueError(f"MultiHeadAttention: mixing must be one of {MIXINGS}, got {mixing!r}.")
    if implementation not in MIXING_IMPLEMENTATIONS:
        raise ValueError(
            "MultiHeadAttention: mixing_implementation must be one of "
            f"{MIXING_IMPLEMENTATIONS} (passed to jax.nn.dot_product_attention as "
            f"implementation), got {implementation!r}."
        )
    if implementation is not None and mixing != "dot_product_attention":
        raise ValueError(
            f"MultiHeadAttention: mixing_implementation={implementation!r} applies to "
            f"mixing='dot_product_attention' only, got mixing={mixing!r}; pass "
            "mixing='dot_product_attention' or leave mixing_implementation=None."
        )
    if mixing == "dot_product_attention" and not dot_product_attention_available():
        raise ValueError(
            "MultiHeadAttention: mixing='dot_product_attention' needs "
            "jax.nn.dot_product_attention(return_residual=True), which this jax "
            f"({jax.__version__}) lacks; it needs jax >= {_RESIDUAL_SINCE}. Upgrade jax or use "
            "mixing='tiles' (the default)."
        )


class MultiHeadAttention(AbstractPart):
    """Multi-head causal self-attention over `(batch, seq, features)`.

    Slots: `wq`, `wk`, `wv` (or one fused `wqkv` whose output stacks $[q \\mid k \\mid v]$ on the
    last axis) and `wo`; each is any part, frozen or learning, called on the whole
    `(B, T, D_in)` array (parts treat leading axes as rows).

    **Forward.** $Q, K, V \\in \\mathbb{R}^{B \\times T \\times D}$ from the slots (fused: the
    three equal thirds of `wqkv`'s output). With $H$ = `n_heads`, $d = D/H$ and head $h$ the
    features $[h d, (h+1) d)$:

    $$S_h = \\frac{Q_h K_h^\\top}{\\sqrt d}, \\quad S_{h,ts} = -\\infty \\ (s > t), \\quad
    A_h = \\mathrm{softmax}_s(S_h), \\quad C_h = A_h V_h,$$

    $C = [C_1 \\mid \\dots \\mid C_H]$ and $y = \\mathrm{wo}(C)$. Position $t$ attends to
    positions $s \\le t$ only. The mask uses the most negative finite number, so masked weights
    are exactly 0 and no NaN appears.

    **Backward** (descent errors; $E = \\partial L/\\partial y$). $dC = \\mathrm{wo}^\\top(E)$ is
    split into heads $dC_h$; then, per head,

    $$dA_h = dC_h V_h^\\top, \\quad dV_h = A_h^\\top dC_h, \\quad
    dS_h = \\frac{A_h \\odot \\big(dA_h - \\mathrm{rowsum}(dA_h \\odot A_h)\\big)}{\\sqrt d},$$

    $$dQ_h = dS_h K_h, \\qquad dK_h = dS_h^\\top Q_h$$

    (the softmax rows sum to one). The heads merge back into $dQ, dK, dV$; each goes to its
    slot's backward and the three input errors add: $\\partial L/\\partial x =
    \\mathrm{wq}^\\top(dQ) + \\mathrm{wk}^\\top(dK) + \\mathrm{wv}^\\top(dV)$. Fused:
    $\\partial L/\\partial x = \\mathrm{wqkv}^\\top([dQ \\mid dK \\mid dV])$. Each slot learns
    from its own error.

    **Causal tiles.** The queries are processed in `causal_tiles` equal tiles, each against
    its key prefix only (`causal_mix_tiles`), so the masked upper-right blocks of $A$ are never
    computed; the results equal the one-tile computation to float32 rounding. `None` (the
    default) picks `causal_tiles_for(T)` at trace time (4 tiles from T = 128, one below 128);
    an explicit count is used for every sequence length (tiles one apart in size when it does
    not divide T, at most T tiles), so windows of any length still work, e.g. in `generate`.

    **Mixing.** `mixing="tiles"` (the default) computes the mixing as above and caches the
    weights $A$ of each tile for the backward, $O(T^2)$ per head. `mixing=
    "dot_product_attention"` computes it with `jax.nn.dot_product_attention(is_causal=True,
    return_residual=True)` and caches Q, K, V, $C$ and each query's log-sum-exp
    $\\ell_t = \\log\\sum_{s \\le t} e^{S_{ts}}$ instead, $O(T d)$ per head: the backward
    recomputes $A = \\exp(S - \\ell)$ tile by tile (`causal_tiles`) and applies the same
    formulas, with $\\mathrm{rowsum}(dA \\odot A) = \\mathrm{rowsum}(dC \\odot C)$
    (`causal_mix_dot_product_backward_rows`). The two mixings agree to float32 rounding.
    `mixing_implementation` (`None`: jax chooses, XLA's in jax 0.10; `"xla"`; `"cudnn"`,
    cuDNN's fused kernel, which takes float16 or bfloat16 Q, K, V only, checked at trace
    time) is passed to jax as `implementation` and needs `mixing="dot_product_attention"`;
    the option needs jax >= 0.8.1 (the first with `return_residual`), checked at
    construction.

    **Rotary positions.** `positions="rotary"` rotates each head's queries and keys by
    position-dependent angles after the projections and before the scores (`rotate_rows`:
    the features $(i, i + d/2)$ of a head at position $t$ turn by
    $\\theta_{t,i} = t\\, b^{-2i/d}$, $b$ = `rotary_base`, $d$ even), so that
    $S_{ts}$ depends on the positions through $t - s$ only; no position table is needed.
    Backward: the mixing's $dQ$ and $dK$ (errors at the rotated $Q$, $K$) are rotated back by
    $-\\theta$ (the transpose of a rotation) before they reach the slots. Both mixings take
    it; `positions=None` (the default) adds no positions.

    The state is an `AttentionState` with a field per slot; the metrics are the slots' metrics
    under their names in forward order (`named(wq=..., wk=..., wv=..., wo=...)`, fused
    `named(wqkv=..., wo=...)`), so report rows read `...attention.wq`. Shapes and heads are
    checked at trace time (before anything runs) with errors naming the part's path.
    """

    wq: AbstractPart | None
    wk: AbstractPart | None
    wv: AbstractPart | None
    wo: AbstractPart
    wqkv: AbstractPart | None
    n_heads: int = eqx.field(static=True)
    causal_tiles: int | None = eqx.field(static=True)
    mixing: str = eqx.field(static=True)
    mixing_implementation: str | None = eqx.field(static=True)
    positions: str | None = eqx.field(static=True)
    rotary_base: float = eqx.field(static=True)

    def __init__(
        self,
        wq: AbstractPart | None = None,
        wk: AbstractPart | None = None,
        wv: AbstractPart | None = None,
        wo: AbstractPart | None = None,
        n_heads: int = 1,
        wqkv: AbstractPart | None = None,
        causal_tiles: int | None = None,
        mixing: str = "tiles",
        mixing_implementation: str | None = None,
        positions: str | None = None,
        rotary_base: float = 10000.0,
    ):
        given = {"wq": wq, "wk": wk, "wv": wv}
        if wo is None:
            raise ValueError(
                "MultiHeadAttention: the output slot `wo` is missing; pass wo=<part> (for no "
                "output projection, a frozen identity such as fusedpc.frozen.activation("
                "'identity'))."
            )
        if wqkv is not None:
            clash = [name for name, part in given.items() if part is not None]
            if clash:
                raise ValueError(
                    f"MultiHeadAttention: got a fused `wqkv` and separate slots {clash}; pass "
                    "either wqkv=<part> or all of wq, wk, wv, not both."
                )
        else:
            missing = [name for name, part in given.items() if part is None]
            if missing:
                raise ValueError(
                    f"MultiHeadAttention: slots {missing} are missing; pass all of wq, wk, wv, "
                    "or one fused wqkv=<part> whose output stacks [q | k | v]."
                )
        if isinstance(n_heads, bool) or not isinstance(n_heads, int):
            raise TypeError(
                f"MultiHeadAttention: n_heads must be an int, got {type(n_heads).__name__} "
                f"{n_heads!r}."
            )
        if n_heads < 1:
            raise ValueError(f"MultiHeadAttention: n_heads must be >= 1, got {n_heads}.")
        if causal_tiles is not None and (
            isinstance(causal_tiles, bool) or not isinstance(causal_tiles, int) or causal_tiles < 1
        ):
            raise ValueError(
                "MultiHeadAttention: causal_tiles must be None (chosen from the sequence "
                f"length) or an int >= 1, got {causal_tiles!r}."
            )
        _check_mixing(mixing, mixing_implementation)
        _check_positions(positions, rotary_base)
        for name, part in {**given, "wo": wo, "wqkv": wqkv}.items():
            if part is not None:
                check_part(part, f"MultiHeadAttention.{name}")
        self.wq, self.wk, self.wv, self.wo, self.wqkv = wq, wk, wv, wo, wqkv
        self.n_heads = n_heads
        self.causal_tiles = causal_tiles
        self.mixing = mixing
        self.mixing_implementation = mixing_implementation
        self.positions = positions
        self.rotary_base = float(rotary_base)

    @property
    def fused(self) -> bool:
        return self.wqkv is not None

    def _slot_names(self) -> tuple[str, ...]:
        return ("wqkv", "wo") if self.fused else ("wq", "wk", "wv", "wo")

    def children(self) -> tuple[tuple[str, AbstractPart], ...]:
        """The slots in forward order: `wq`, `wk`, `wv`, `wo` (fused: `wqkv`, `wo`)."""
        return tuple((name, getattr(self, name)) for name in self._slot_names())

    def replace_children(self, children: Sequence[AbstractPart]) -> MultiHeadAttention:
        return replace_fields(self, **dict(zip(self._slot_names(), children, strict=True)))

    def export_arrays(self, path: str = "") -> tuple[LinearParams, ...]:
        """Four `LinearParams`, for $Q$, $K$, $V$ and the output, each slot's single affine
        map (a fused `wqkv` `(3D, D)` is split into its three `(D, D)` thirds)."""

        def one_linear(name: str) -> LinearParams:
            where = join_path(path, name)
            records = getattr(self, name).export_arrays(where)
            if len(records) != 1 or not isinstance(records[0], LinearParams):
                raise TypeError(
                    f"{display_path(where)}: an attention slot must export exactly one "
                    f"LinearParams, got {[type(r).__name__ for r in records]}."
                )
            return records[0]

        if self.fused:
            qkv = one_linear("wqkv")
            width = qkv.weight.shape[0] // 3
            thirds = [slice(j * width, (j + 1) * width) for j in range(3)]
            projections = tuple(
                LinearParams(qkv.weight[t], None if qkv.bias is None else qkv.bias[t])
                for t in thirds
            )
        else:
            projections = tuple(one_linear(name) for name in _SEPARATE)
        return (*projections, one_linear("wo"))

    def init_state(self, key: jax.Array) -> AttentionState:
        names = self._slot_names()
        keys = jax.random.split(key, len(names))
        return AttentionState(
            **{name: getattr(self, name).init_state(k) for name, k in zip(names, keys)}
        )

    def compile(self, path: str) -> Core:
        where = display_path(path)
        n_heads = self.n_heads
        names = self._slot_names()
        cores = {name: getattr(self, name).compile(join_path(path, name)) for name in names}
        rotary, base = self.positions == "rotary", self.rotary_base

        def check_slot(name: str, y, x) -> None:
            expect_rank(join_path(path, name), y, 3, _LAYOUT, what="output")
            if y.shape[:2] != x.shape[:2]:
                raise ValueError(
                    f"{display_path(join_path(path, name))}: expected an output of shape "
                    f"{tuple(x.shape[:2])} + (width,) (the input's batch and sequence), got "
                    f"{tuple(y.shape)}."
                )

        def project(state: AttentionState, x):
            """Q, K, V `(B, T, D)` and the slots' caches."""
            caches = {}
            if self.fused:
                qkv, caches["wqkv"] = cores["wqkv"].forward(state.wqkv, x)
                check_slot("wqkv", qkv, x)
                if qkv.shape[-1] % 3:
                    raise ValueError(
                        f"{where}: the fused slot wqkv must output [q | k | v], three equal "
                        f"widths, but its output width {qkv.shape[-1]} is not divisible by 3."
                    )
                q, k, v = jnp.split(qkv, 3, axis=-1)
                return (q, k, v), caches
            outputs = []
            for name in _SEPARATE:
                y, caches[name] = cores[name].forward(getattr(state, name), x)
                check_slot(name, y, x)
                outputs.append(y)
            widths = {name: y.shape[-1] for name, y in zip(_SEPARATE, outputs)}
            if len(set(widths.values())) != 1:
                raise ValueError(
                    f"{where}: the slots wq, wk, wv must output the same width, got {widths}."
                )
            return tuple(outputs), caches

        def forward(state: AttentionState, x):
            expect_rank(path, x, 3, _LAYOUT)
            (q, k, v), caches = project(state, x)
            width = q.shape[-1]
            if width % n_heads:
                raise ValueError(
                    f"{where}: n_heads={n_heads} does not divide the width {width} of Q, K and "
                    f"V; choose n_heads dividing {width} or change the slots' output width."
                )
            if rotary:
                if (width // n_heads) % 2:
                    raise ValueError(
                        f"{where}: positions='rotary' rotates pairs of features in each head, "
                        f"so the head width must be even, got {width // n_heads} (width "
                        f"{width} over n_heads={n_heads})."
                    )
                q, k = (rotate_rows(a, n_heads, base) for a in (q, k))
            tiles = self.causal_tiles or causal_tiles_for(q.shape[1])
            if self.mixing == "dot_product_attention":
                b, t = q.shape[:2]
                q, k, v = (a.reshape(b, t, n_heads, width // n_heads) for a in (q, k, v))
                if self.mixing_implementation == "cudnn" and q.dtype not in _CUDNN_DTYPES:
                    raise ValueError(
                        f"{where}: mixing_implementation='cudnn' needs float16 or bfloat16 "
                        f"Q, K, V (cuDNN's fused attention), got {q.dtype}; leave "
                        "mixing_implementation=None (or 'xla') for this dtype."
                    )
                context, lse = causal_mix_dot_product(q, k, v, self.mixing_implementation)
                y, caches["wo"] = cores["wo"].forward(state.wo, context.reshape(b, t, width))
                return y, DotProductAttentionCache(
                    slots=AttentionSlotCaches(**caches), q=q, k=k, v=v, context=context, lse=lse
                )
            q_rows = q
            q, k, v = (_split_heads(a, n_heads) for a in (q, k, v))
            context, weights = causal_mix_tiles(q, k, v, tiles)
            y, caches["wo"] = cores["wo"].forward(state.wo, _merge_heads(context))
            return y, AttentionCache(
                slots=AttentionSlotCaches(**caches), q=q_rows, k=k, v=v, weights=weights
            )

        def backward(
            state: AttentionState, cache: AttentionCache | DotProductAttentionCache, error
        ):
            new_states, metrics = {}, {}
            d_context, new_states["wo"], metrics["wo"] = cores["wo"].backward(
                state.wo, cache.slots.wo, error
            )
            if isinstance(cache, DotProductAttentionCache):
                tiles = self.causal_tiles or causal_tiles_for(cache.q.shape[1])
                d_q, d_k, d_v = causal_mix_dot_product_backward_rows(
                    cache.q, cache.k, cache.v, cache.context, cache.lse, d_context, tiles
                )
            else:
                d_q, d_k, d_v = causal_mix_backward_rows(
                    cache.q, cache.k, cache.v, cache.weights, d_context, n_heads
                )
            if rotary:  # errors at the rotated Q and K, rotated back (the transpose)
                d_q, d_k = (rotate_rows(a, n_heads, base, inverse=True) for a in (d_q, d_k))
            if self.fused:
                input_error, new_states["wqkv"], metrics["wqkv"] = cores["wqkv"].backward(
                    state.wqkv, cache.slots.wqkv, jnp.concatenate([d_q, d_k, d_v], axis=-1)
                )
            else:
                input_error = None
                for name, d in zip(_SEPARATE, (d_q, d_k, d_v)):
                    e, new_states[name], metrics[name] = cores[name].backward(
                        getattr(state, name), getattr(cache.slots, name), d
                    )
                    input_error = e if input_error is None else input_error + e
            ordered = named(**{name: metrics[name] for name in names})
            return input_error, AttentionState(**new_states), ordered

        def write_back(state: AttentionState) -> MultiHeadAttention:
            return replace_fields(
                self, **{name: cores[name].write_back(getattr(state, name)) for name in names}
            )

        return Core(forward, backward, write_back)
