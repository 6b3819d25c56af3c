"""Multi-head causal self-attention: four slots (or a fused QKV slot and an output slot), each
any part, around a weight-free mixing step with a hand-derived backward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from fusedpc.core._checks import check_part, expect_rank
from fusedpc.core._context import StepContext
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
from fusedpc.parts._attention_mixing import (
    causal_mix_backward_rows,
    causal_mix_dot_product,
    causal_mix_dot_product_backward_rows,
    causal_mix_tiles,
    causal_tiles_for,
    dot_product_attention_available,
    merge_heads,
    split_heads,
)
from fusedpc.parts._rotary import rotate_rows

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

    defers_updates: ClassVar[bool] = True

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
        names = self._slot_names()
        cores = {name: getattr(self, name).compile(join_path(path, name)) for name in names}

        def forward(state: AttentionState, x, ctx: StepContext):
            expect_rank(path, x, 3, _LAYOUT)
            (q, k, v), caches = self._project(cores, path, state, x, ctx)
            self._check_heads(path, q.shape[-1])
            if self.positions == "rotary":
                q, k = (rotate_rows(a, self.n_heads, self.rotary_base,
                                    dtype=ctx.compute_dtype) for a in (q, k))
            return self._mix(cores, path, state, caches, (q, k, v), ctx)

        def backward(state: AttentionState, cache: AttentionCache | DotProductAttentionCache,
                     error, ctx: StepContext):
            new_states, metrics = {}, {}
            d_context, new_states["wo"], metrics["wo"] = cores["wo"].backward(
                state.wo, cache.slots.wo, error, ctx
            )
            d_q, d_k, d_v = self._mix_backward(cache, d_context, ctx)
            if self.positions == "rotary":  # errors at the rotated Q and K, rotated back
                d_q, d_k = (rotate_rows(a, self.n_heads, self.rotary_base, inverse=True,
                                        dtype=ctx.compute_dtype) for a in (d_q, d_k))
            if self.fused:
                input_error, new_states["wqkv"], metrics["wqkv"] = cores["wqkv"].backward(
                    state.wqkv, cache.slots.wqkv, jnp.concatenate([d_q, d_k, d_v], axis=-1), ctx
                )
            else:
                input_error = None
                for name, d in zip(_SEPARATE, (d_q, d_k, d_v)):
                    e, new_states[name], metrics[name] = cores[name].backward(
                        getattr(state, name), getattr(cache.slots, name), d, ctx
                    )
                    input_error = e if input_error is None else input_error + e
            ordered = named(**{name: metrics[name] for name in names})
            return input_error, AttentionState(**new_states), ordered

        def write_back(state: AttentionState) -> MultiHeadAttention:
            return replace_fields(
                self, **{name: cores[name].write_back(getattr(state, name)) for name in names}
            )

        return Core(forward, backward, write_back)

    @staticmethod
    def _check_slot(path: str, name: str, y, x) -> None:
        expect_rank(join_path(path, name), y, 3, _LAYOUT, what="output")
        if y.shape[:2] != x.shape[:2]:
            raise ValueError(
                f"{display_path(join_path(path, name))}: expected an output of shape "
                f"{tuple(x.shape[:2])} + (width,) (the input's batch and sequence), got "
                f"{tuple(y.shape)}."
            )

    def _project(self, cores: dict[str, Core], path: str, state: AttentionState, x,
                 ctx: StepContext):
        """Q, K, V `(B, T, D)` from the slots, and the slots' caches."""
        caches = {}
        if self.fused:
            qkv, caches["wqkv"] = cores["wqkv"].forward(state.wqkv, x, ctx)
            self._check_slot(path, "wqkv", qkv, x)
            if qkv.shape[-1] % 3:
                raise ValueError(
                    f"{display_path(path)}: the fused slot wqkv must output [q | k | v], three "
                    f"equal widths, but its output width {qkv.shape[-1]} is not divisible by 3."
                )
            q, k, v = jnp.split(qkv, 3, axis=-1)
            return (q, k, v), caches
        outputs = []
        for name in _SEPARATE:
            y, caches[name] = cores[name].forward(getattr(state, name), x, ctx)
            self._check_slot(path, name, y, x)
            outputs.append(y)
        widths = {name: y.shape[-1] for name, y in zip(_SEPARATE, outputs)}
        if len(set(widths.values())) != 1:
            raise ValueError(
                f"{display_path(path)}: the slots wq, wk, wv must output the same width, got "
                f"{widths}."
            )
        return tuple(outputs), caches

    def _check_heads(self, path: str, width: int) -> None:
        """Refuses a width that the heads do not divide (or, with rotary positions, an odd
        head width), naming the part."""
        n_heads, where = self.n_heads, display_path(path)
        if width % n_heads:
            raise ValueError(
                f"{where}: n_heads={n_heads} does not divide the width {width} of Q, K and "
                f"V; choose n_heads dividing {width} or change the slots' output width."
            )
        if self.positions == "rotary" and (width // n_heads) % 2:
            raise ValueError(
                f"{where}: positions='rotary' rotates pairs of features in each head, "
                f"so the head width must be even, got {width // n_heads} (width "
                f"{width} over n_heads={n_heads})."
            )

    def _mix(self, cores: dict[str, Core], path: str, state: AttentionState,
             caches: dict[str, Any], qkv: tuple[jax.Array, jax.Array, jax.Array],
             ctx: StepContext):
        """The mixing and the output slot: `(y, cache)`."""
        q, k, v = qkv
        n_heads, width = self.n_heads, q.shape[-1]
        if self.mixing == "dot_product_attention":
            b, t = q.shape[:2]
            q, k, v = (a.reshape(b, t, n_heads, width // n_heads) for a in (q, k, v))
            if self.mixing_implementation == "cudnn" and q.dtype not in _CUDNN_DTYPES:
                raise ValueError(
                    f"{display_path(path)}: mixing_implementation='cudnn' needs float16 or "
                    f"bfloat16 Q, K, V (cuDNN's fused attention), got {q.dtype}; leave "
                    "mixing_implementation=None (or 'xla') for this dtype."
                )
            context, lse = causal_mix_dot_product(q, k, v, self.mixing_implementation)
            y, caches["wo"] = cores["wo"].forward(state.wo, context.reshape(b, t, width), ctx)
            return y, DotProductAttentionCache(
                slots=AttentionSlotCaches(**caches), q=q, k=k, v=v, context=context, lse=lse
            )
        tiles = self.causal_tiles or causal_tiles_for(q.shape[1])
        q_rows = q
        q, k, v = (split_heads(a, n_heads) for a in (q, k, v))
        context, weights = causal_mix_tiles(q, k, v, tiles, ctx.compute_dtype)
        y, caches["wo"] = cores["wo"].forward(state.wo, merge_heads(context), ctx)
        return y, AttentionCache(
            slots=AttentionSlotCaches(**caches), q=q_rows, k=k, v=v, weights=weights
        )

    def _mix_backward(self, cache: AttentionCache | DotProductAttentionCache, d_context,
                      ctx: StepContext):
        """`(dQ, dK, dV)` as rows from the error at the mixing's output."""
        if isinstance(cache, DotProductAttentionCache):
            tiles = self.causal_tiles or causal_tiles_for(cache.q.shape[1])
            return causal_mix_dot_product_backward_rows(
                cache.q, cache.k, cache.v, cache.context, cache.lse, d_context, tiles,
                ctx.compute_dtype,
            )
        return causal_mix_backward_rows(
            cache.q, cache.k, cache.v, cache.weights, d_context, self.n_heads, ctx.compute_dtype
        )
