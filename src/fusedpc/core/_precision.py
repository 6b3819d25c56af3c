"""The compute precision of a step: the dtype that activations and matrix products use while
parameters, optimiser states, norms and the loss stay float32.

A step compiled with `compute_dtype="bfloat16"` hands its parts a step context
(`fusedpc.core.StepContext`) whose `compute_dtype` says so; a part computes through the
context's methods (`ctx.matmul`, `ctx.to_compute`, ...), which call the helpers below with
that dtype (`dtype=None`: float32, exactly the plain operation). Matrix products
take their operands in the compute dtype and accumulate in float32; products that make a
weight gradient keep the float32 result (`matmul_accumulate`), the others round it to the
compute dtype (`matmul`), so caches and errors between parts are held in the compute dtype.
Statistics (LayerNorm's mean and variance, softmax) are taken in float32 (`widened`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

COMPUTE_DTYPES = ("float32", "bfloat16")
"""The compute dtypes a step accepts (`None` means float32)."""

def resolve_compute_dtype(dtype: Any, where: str = "compute_dtype") -> str | None:
    """`None` for float32 (the parameters' own dtype), `"bfloat16"` for bfloat16; any other
    value is an error naming `where`."""
    if dtype is None:
        return None
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name in ("bf16",):
        name = "bfloat16"
    if name not in COMPUTE_DTYPES:
        raise ValueError(
            f"{where}: expected one of {COMPUTE_DTYPES} (or None), got {dtype!r}."
        )
    return None if name == "float32" else name


def _floating(x: Any) -> bool:
    return x is not None and jnp.issubdtype(jnp.result_type(x), jnp.floating)


def to_compute(x: Any, dtype: Any = None) -> Any:
    """A floating array in the compute dtype `dtype` (unchanged for None, and for
    integers)."""
    if dtype is None or not _floating(x):
        return x
    return jnp.asarray(x).astype(dtype)


def widened(x: Any) -> Any:
    """A floating array in at least float32 (for statistics, sums and the loss)."""
    if not _floating(x):
        return x
    x = jnp.asarray(x)
    return x if jnp.finfo(x.dtype).bits >= 32 else x.astype(jnp.float32)


def matmul(a: jax.Array, b: jax.Array, dtype: Any = None) -> jax.Array:
    """`a @ b`: without a compute dtype exactly that; with one, the operands in it,
    accumulated in float32 and rounded to it."""
    if dtype is None:
        return a @ b
    product = jnp.matmul(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)
    return product.astype(dtype)


def matmul_accumulate(a: jax.Array, b: jax.Array, dtype: Any = None) -> jax.Array:
    """`a @ b` kept in float32 (a weight gradient): with a compute dtype, the operands in it
    and the result accumulated in float32."""
    if dtype is None:
        return a @ b
    return jnp.matmul(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def einsum(spec: str, a: jax.Array, b: jax.Array, *, accumulate: bool = False,
           dtype: Any = None) -> jax.Array:
    """`jnp.einsum(spec, a, b)` under the same rule as `matmul` (`accumulate=True`: as
    `matmul_accumulate`)."""
    if dtype is None:
        return jnp.einsum(spec, a, b)
    product = jnp.einsum(
        spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32
    )
    return product if accumulate else product.astype(dtype)


def weight_gradient(errors: jax.Array, inputs: jax.Array, dtype: Any = None) -> jax.Array:
    """$E^\\top A$ over rows, `(R, out)` and `(R, in)` to `(out, in)`, in float32 (as
    `matmul_accumulate`).

    The transposed errors are laid out in memory first (an `optimization_barrier` keeps XLA
    from folding the transpose back into the product): XLA:CPU then runs the product in its
    fast matrix library instead of its generic dot, about 1.5 % of a config-S step
    (docs/benchmarks.md). The numbers are those of `errors.T @ inputs`.
    """
    return matmul_accumulate(jax.lax.optimization_barrier(errors.T), inputs, dtype)
