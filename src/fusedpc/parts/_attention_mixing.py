"""The weight-free mixing of causal self-attention and its hand-derived backward: by query
tiles (`causal_mix_tiles`, the weights cached) or through `jax.nn.dot_product_attention`
(`causal_mix_dot_product`, the weights recomputed in the backward). Every function takes the
compute dtype (`dtype`, None: float32) as `fusedpc.core.matmul` does."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp

from fusedpc.core._precision import einsum, to_compute, widened


def split_heads(y: jax.Array, n_heads: int, transposed: bool = False) -> jax.Array:
    """`(B, T, D)` -> `(B, H, T, D/H)`, or each head transposed, `(B, H, D/H, T)`; head `h`
    holds features `[h d, (h + 1) d)`."""
    b, t, width = y.shape
    heads = y.reshape(b, t, n_heads, width // n_heads)
    return heads.transpose(0, 2, 3, 1) if transposed else heads.transpose(0, 2, 1, 3)


def merge_heads(y: jax.Array, transposed: bool = False) -> jax.Array:
    """Undoes `split_heads`: `(B, H, T, d)` (transposed: `(B, H, d, T)`) -> `(B, T, H d)`."""
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


def _masked_scores(q: jax.Array, k: jax.Array, start: int, stop: int, d: int,
                   dtype: Any = None) -> jax.Array:
    """The scores $S = Q K^\\top / \\sqrt d$ of query rows `[start, stop)` against keys
    `[0, stop)` (heads `(B, H, T, d)`), the entries with $s > t$ set to the most negative
    finite number."""
    # float32 scores whatever the compute dtype (the softmax reads them)
    scores = einsum("bhtd,bhsd->bhts", q[..., start:stop, :], k[..., :stop, :], accumulate=True,
                    dtype=dtype)
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
    q: jax.Array, k: jax.Array, v: jax.Array, tiles: int = 1, dtype: Any = None
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """`causal_mix` computed by query tiles: returns `C` and the tiles' attention weights.

    The T queries are split into `tiles` tiles (equal when `tiles` divides T, sizes one apart
    otherwise; at most T tiles); tile $i$ (rows $[a_i, b_i)$) attends to the key prefix
    $[0, b_i)$ only, since every later key is masked for it. Its weights
    $A_i$ have shape `(B, H, b_i - a_i, b_i)`; the masked upper-right blocks of $A$, a fraction
    $(n - 1) / 2n$ of it, are never computed. Per row, the same numbers as `causal_mix` up to
    float32 rounding (the softmax of a row sums over its prefix instead of the whole row, the
    masked entries contributing exactly 0 either way). `dtype`: the compute dtype (None:
    float32), as for `fusedpc.core.matmul`; the scores and the softmax in float32.
    """
    seq_len, d = q.shape[-2], q.shape[-1]
    contexts, weights = [], []
    for start, stop in _tile_bounds(seq_len, tiles):
        scores = _masked_scores(q, k, start, stop, d, dtype)
        tile_weights = to_compute(jax.nn.softmax(scores, axis=-1), dtype)
        contexts.append(einsum("bhts,bhsd->bhtd", tile_weights, v[..., :stop, :], dtype=dtype))
        weights.append(tile_weights)
    context = contexts[0] if len(contexts) == 1 else jnp.concatenate(contexts, axis=-2)
    return context, tuple(weights)


def causal_mix(q: jax.Array, k: jax.Array, v: jax.Array,
               dtype: Any = None) -> tuple[jax.Array, jax.Array]:
    """The weight-free mixing on heads `(B, H, T, d)`: returns `(C, A)`.

    $S = Q K^\\top / \\sqrt d$, entries with $s > t$ set to the most negative finite number
    (their weight is exactly 0 and no NaN can appear: the diagonal is never masked),
    $A = \\mathrm{softmax}_s(S)$, $C = A V$. (`causal_mix_tiles` with one tile.)
    """
    context, (weights,) = causal_mix_tiles(q, k, v, 1, dtype)
    return context, weights


def causal_mix_backward(
    q: jax.Array, k: jax.Array, v: jax.Array, weights: jax.Array, error: jax.Array,
    dtype: Any = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The hand-derived backward of `causal_mix`: `(dQ, dK, dV)` from `dC` (all per head).

    $dA = dC\\, V^\\top$, $dV = A^\\top dC$,
    $dS = A \\odot (dA - \\textstyle\\sum_s dA \\odot A) / \\sqrt d$, $dQ = dS\\, K$,
    $dK = dS^\\top Q$. Masked entries have $A = 0$, hence $dS = 0$: nothing flows to the future.
    (Per-head front end of `causal_mix_backward_rows`, which the attention part calls.)
    """
    n_heads = q.shape[1]
    d_q, d_k, d_v = causal_mix_backward_rows(
        merge_heads(q), k, v, (weights,), merge_heads(error), n_heads, dtype
    )
    return split_heads(d_q, n_heads), split_heads(d_k, n_heads), split_heads(d_v, n_heads)


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
    dtype: Any = None,
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
        q_rows, k, v, error_rows, n_heads, bounds, lambda i, start, stop: weights[i],
        dtype=dtype,
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
    dtype: Any = None,
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
    scaled = split_heads(error_rows * (1.0 / math.sqrt(d)), n_heads)
    error_t = split_heads(error_rows, n_heads, transposed=True)
    q_t = split_heads(q_rows, n_heads, transposed=True)
    row_sums = None if context is None else jnp.sum(
        widened(scaled) * widened(context), axis=-1, keepdims=True
    )
    d_q_tiles, d_k_t, d_v_t = [], None, None
    for i, (start, stop) in enumerate(bounds):
        tile_weights = widened(tile_weights_of(i, start, stop))
        d_weights = einsum(  # dA / sqrt(d), in float32 whatever the compute dtype
            "bhtd,bhsd->bhts", scaled[..., start:stop, :], v[..., :stop, :], accumulate=True,
            dtype=dtype,
        )
        if row_sums is None:
            tile_sums = jnp.sum(d_weights * tile_weights, axis=-1, keepdims=True)
        else:
            tile_sums = row_sums[..., start:stop, :]
        d_scores = tile_weights * (d_weights - tile_sums)
        d_q_tiles.append(einsum("bhts,bhsd->bhtd", d_scores, k[..., :stop, :], dtype=dtype))
        k_part = einsum("bhdt,bhts->bhds", q_t[..., start:stop], d_scores, dtype=dtype)
        v_part = einsum("bhdt,bhts->bhds", error_t[..., start:stop], tile_weights, dtype=dtype)
        d_k_t = _add_to_prefix(d_k_t, k_part, seq_len)
        d_v_t = _add_to_prefix(d_v_t, v_part, seq_len)
    d_q = d_q_tiles[0] if len(d_q_tiles) == 1 else jnp.concatenate(d_q_tiles, axis=-2)
    # every sequence has at least one tile, so the loop has set both sums
    d_k, d_v = (merge_heads(cast(jax.Array, a), transposed=True) for a in (d_k_t, d_v_t))
    return merge_heads(d_q), d_k, d_v


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
    dtype: Any = None,
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
        scores = _masked_scores(q_heads, k_heads, start, stop, d, dtype)
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
        dtype,
    )
