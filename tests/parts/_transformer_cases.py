"""Conformance cases of the modern transformer pieces: RMSNorm (frozen and learning), rotary
attention (each mixing), the gated feed-forward (SwiGLU, frozen and learning) and a GPT with
all three options. `CASES` maps a name to a factory returning `(part, example_input)`, as
`helpers.CONFORMANCE_CASES` does; tiny and float32."""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from helpers import GPT_IDS, linear_params, normal

import fusedpc
from fusedpc.parts import frozen, transplant
from fusedpc.parts.learning import LearningRMSNorm

Case = Callable[[], tuple[fusedpc.AbstractPart, jax.Array]]


def _eqx_rms_norm(width: int = 5) -> eqx.nn.RMSNorm:
    norm = eqx.nn.RMSNorm(width)  # equinox's default: a weight and a bias
    # A non-trivial scale and shift, so that the weight really enters the backward.
    return eqx.tree_at(
        lambda m: (m.weight, m.bias), norm,
        (1.0 + 0.3 * normal(130, (width,)), 0.2 * normal(131, (width,))),
    )


def _rotary_attention(mixing: str, width: int = 8) -> fusedpc.MultiHeadAttention:
    wq, wk, wv, wo = (frozen.linear(*linear_params(140 + i, width, width)) for i in range(4))
    return fusedpc.MultiHeadAttention(
        wq, wk, wv, wo, n_heads=2, mixing=mixing, positions="rotary"
    )


def _learning_rotary_attention(width: int = 8) -> fusedpc.MultiHeadAttention:
    keys = jax.random.split(jax.random.key(150), 2)
    linears = [eqx.nn.Linear(width, width, key=k) for k in jax.random.split(keys[0], 3)]
    optimiser = optax.sgd(0.1)
    return fusedpc.MultiHeadAttention(
        wo=transplant.from_linear(eqx.nn.Linear(width, width, key=keys[1]), optimiser=optimiser),
        n_heads=2,
        wqkv=transplant.from_linears(linears, optimiser=optimiser),
        positions="rotary",
    )


def _swiglu_linears(width: int = 4, hidden: int = 6) -> list[eqx.nn.Linear]:
    keys = jax.random.split(jax.random.key(160), 3)
    sizes = [(width, hidden), (width, hidden), (hidden, width)]
    return [eqx.nn.Linear(i, o, use_bias=False, key=k) for (i, o), k in zip(sizes, keys)]


def _learning_swiglu() -> fusedpc.AbstractPart:
    gate, up, down = _swiglu_linears()
    return transplant.from_swiglu(gate, up, down, optimiser=optax.adam(1e-2))


def _modern_gpt() -> fusedpc.GPTPart:
    config = fusedpc.GPTConfig(
        vocab_size=11, width=8, n_heads=2, n_blocks=2, ff_width=16, max_len=4, learn="all",
        norm="rms", positions="rotary", feed_forward="swiglu",
    )
    return fusedpc.build_gpt(config, optax.sgd(0.1), jax.random.key(0))[0]


CASES: dict[str, Case] = {
    "rms_norm_from_eqx": lambda: (frozen.rms_norm(_eqx_rms_norm()), normal(132, (6, 5))),
    "rms_norm_width": lambda: (frozen.rms_norm(width=5), normal(133, (2, 3, 5))),
    "learning_rms_norm": lambda: (
        LearningRMSNorm(1.0 + 0.3 * normal(134, (5,)), None, optax.sgd(0.1)),
        normal(135, (2, 3, 5)),
    ),
    "learning_rms_norm_with_bias": lambda: (
        transplant.from_rms_norm(_eqx_rms_norm(), optimiser=optax.adam(1e-2)),
        normal(136, (6, 5)),
    ),
    "rotary_attention_tiles": lambda: (_rotary_attention("tiles"), normal(141, (2, 4, 8))),
    "rotary_attention_dot_product": lambda: (
        _rotary_attention("dot_product_attention"), normal(142, (2, 4, 8))
    ),
    "rotary_attention_learning_qkv": lambda: (
        _learning_rotary_attention(), normal(151, (2, 4, 8))
    ),
    "swiglu_frozen": lambda: (frozen.swiglu(*_swiglu_linears()), normal(161, (2, 3, 4))),
    "swiglu_learning": lambda: (_learning_swiglu(), normal(162, (6, 4))),
    "gpt_rms_rotary_swiglu": lambda: (_modern_gpt(), jnp.array(GPT_IDS, jnp.int32)),
}
