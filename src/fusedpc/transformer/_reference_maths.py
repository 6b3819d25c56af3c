"""The array maths of the reference GPT (`fusedpc.transformer.reference`): linear maps, norms
and the rotary rotation, on the last axis of a ``(B, T, W)`` array.

They act through batched matrix products (``x @ weight.T + bias``) rather than ``jax.vmap``
over rows, on the parameters of ordinary ``eqx.nn.Linear``, ``eqx.nn.LayerNorm`` and
``eqx.nn.RMSNorm`` modules, matching those modules' per-position semantics.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

Array = jax.Array


def linear(lin: eqx.nn.Linear, x: Array) -> Array:
    """Apply ``lin`` over the last axis of ``x``: ``y = x W^T + b``."""
    y = x @ lin.weight.T
    if lin.bias is not None:
        y = y + lin.bias
    return y


def rms_norm(norm: eqx.nn.RMSNorm, x: Array) -> Array:
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


def layer_norm(ln: eqx.nn.LayerNorm, x: Array) -> Array:
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


def normalise(norm: eqx.nn.LayerNorm | eqx.nn.RMSNorm, x: Array) -> Array:
    """`layer_norm` or `rms_norm`, by the type of ``norm``."""
    if isinstance(norm, eqx.nn.RMSNorm):
        return rms_norm(norm, x)
    return layer_norm(norm, x)


def rotate(x: Array, base: float) -> Array:
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
