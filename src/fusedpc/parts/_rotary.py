"""Rotary position embeddings of attention rows and their transpose."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fusedpc.core._precision import to_compute, widened


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
    x: jax.Array, n_heads: int, base: float, *, inverse: bool = False, dtype: Any = None
) -> jax.Array:
    """Rotary position embedding of rows `(B, T, H d)`: in each head, the pair of features
    $(i, i + d/2)$ at position $t$ is rotated by $\\theta_{t,i}$ (`rotary_angles`),

    $$x'_i = x_i \\cos\\theta - x_{i+d/2} \\sin\\theta, \\qquad
    x'_{i+d/2} = x_i \\sin\\theta + x_{i+d/2} \\cos\\theta$$

    (the half-split pairing of GPT-NeoX and LLaMA). `inverse=True` rotates by
    $-\\theta$: the transpose, which is the backward of the rotation. `dtype`: the compute
    dtype of the angles' cosines and sines (None: float32)."""
    b, t, width = x.shape
    d = width // n_heads
    half = d // 2
    cos, sin = rotary_angles(t, d, base, tie=x)
    cos, sin = to_compute(cos, dtype)[:, None, :], to_compute(sin, dtype)[:, None, :]
    if inverse:
        sin = -sin
    heads = x.reshape(b, t, n_heads, d)
    first, second = heads[..., :half], heads[..., half:]
    rotated = jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
    return rotated.reshape(b, t, width)
