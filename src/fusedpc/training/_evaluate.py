"""Validation: the cross-entropy of the model's outputs, on one process or many."""

from __future__ import annotations

import jax
import numpy as np


def cross_entropy(outputs: np.ndarray, targets: np.ndarray, probabilities: bool) -> float:
    """Mean $-\\log p(t)$ over every position; `outputs` `(..., V)` holds logits, or
    probabilities when `probabilities`; `targets` `(...)` integer ids. Computed in float64."""
    out = np.asarray(outputs, np.float64)
    if probabilities:
        logp = np.log(np.clip(out, 1e-30, 1.0))
    else:
        shifted = out - out.max(axis=-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    picked = np.take_along_axis(logp, np.asarray(targets)[..., None].astype(np.int64), axis=-1)
    return float(-picked.mean())


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
    losses = [
        cross_entropy(host_array(pipeline.predict(x)), y, probabilities)
        for x, y in zip(inputs, targets, strict=True)
    ]
    return float(np.mean(losses))
