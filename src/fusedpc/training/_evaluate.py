"""Validation: the cross-entropy of the model's outputs, on one process or many."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core import losses as _losses


def cross_entropy(outputs: np.ndarray, targets: np.ndarray, probabilities: bool) -> float:
    """Mean $-\\log p(t)$ over every position: the library's one cross-entropy
    (`fusedpc.losses.softmax_cross_entropy` for logits, `cross_entropy` for probabilities),
    the loss the training step reports, in float32.

    Args:
        outputs: `(..., V)` logits, or probabilities when `probabilities`.
        targets: `(...)` integer class ids.
        probabilities: whether `outputs` holds probabilities.
    """
    error_fn = _losses.cross_entropy if probabilities else _losses.softmax_cross_entropy
    loss = cast(Callable[[jax.Array, jax.Array], jax.Array], error_fn.loss)  # both have one
    return float(loss(jnp.asarray(outputs, jnp.float32), jnp.asarray(targets)))


def host_array(x) -> np.ndarray:
    """A device array as NumPy, also when it spans processes (replicated or gathered)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def evaluate(pipeline, inputs: np.ndarray, targets: np.ndarray, probabilities: bool) -> float:
    """Mean validation cross-entropy over the batches `inputs`/`targets` `(N, B, T)`."""
    return float(np.mean(batch_losses(pipeline, inputs, targets, probabilities)))


def batch_losses(
    pipeline, inputs: np.ndarray, targets: np.ndarray, probabilities: bool
) -> np.ndarray:
    """The cross-entropy of each batch of `inputs`/`targets` `(N, B, T)`: `(N,)`."""
    return np.asarray([
        cross_entropy(host_array(pipeline.predict(x)), y, probabilities)
        for x, y in zip(inputs, targets, strict=True)
    ])
