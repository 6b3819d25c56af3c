"""Padding parity: a masked step against the masked-mean backprop twin, on every head.

Run in the test process (XLA at the suite's optimisation level 0) and, by
`test_padding.py`, in a fresh process at XLA's default level: there the categorical head's
softmax and subtraction fuse, which is where guessing padding from zero rows broke. Prints
one JSON object: the norm-relative error of each head's weight changes and input error.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fusedpc

ROWS, REAL = 8, 5
HEADS = {
    "gaussian": ("squared", lambda z: z),
    "categorical": ("cross_entropy", jax.nn.softmax),
    "binary": ("sigmoid_cross_entropy", jax.nn.sigmoid),
}


def _logits(params, x):
    (w1, w2), (b1, b2) = params
    return jnp.tanh(x @ w1.T + b1) @ w2.T + b2


def _row_losses(z, target, head):
    if head == "gaussian":
        return 0.5 * jnp.sum((z - target) ** 2, axis=-1)
    if head == "categorical":
        logp = jax.nn.log_softmax(z, axis=-1)
        return -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    return -jnp.sum(target * jax.nn.log_sigmoid(z) + (1 - target) * jax.nn.log_sigmoid(-z), -1)


def _twin(params, x, target, weights, head):
    """jax.grad of the masked mean loss sum_r w_r l_r / sum_r w_r; the input error is the
    executor's convention, R times the gradient of that mean with respect to each row."""

    def masked_mean(p, inputs):
        rows = _row_losses(_logits(p, inputs), target, head)
        return jnp.sum(weights * rows) / jnp.sum(weights)

    grads, dx = jax.grad(masked_mean, argnums=(0, 1))(params, x)
    return grads, dx * x.shape[0]


def _rel(a, b) -> float:
    a, b = np.ravel(np.asarray(a, np.float64)), np.ravel(np.asarray(b, np.float64))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _batch(head, network, rng):
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    x[REAL:] = 0.0  # padding rows: zeros (any finite values would do)
    if head == "categorical":
        target = rng.integers(0, 3, ROWS).astype(np.int32)
    elif head == "binary":
        target = (rng.normal(size=(ROWS, 3)) > 0).astype(np.float32)
    else:
        target = rng.normal(size=(ROWS, 3)).astype(np.float32)
    if head != "categorical":
        # two real rows that the head fits exactly: their error is 0, and they are real
        fitted = fusedpc.FusedPipeline(fusedpc.LearningNetwork(network)).predict(x)
        target[1:3] = np.asarray(fitted)[1:3]
    return x, target


def check(seed: int = 0) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(seed)
    mask = np.arange(ROWS) < REAL
    weights = mask.astype(np.float32)
    out = {}
    for head, (error_fn, _) in HEADS.items():
        network = fusedpc.PCNetwork([4, 6, 3], "tanh", head=head, key=jax.random.key(seed))
        x, target = _batch(head, network, rng)
        rate = 0.1
        pipeline = fusedpc.FusedPipeline(
            fusedpc.LearningNetwork(network, optax.sgd(rate)), error_fn
        )
        old = (tuple(network.weights), tuple(network.biases))
        _, dx = pipeline.step(x, target, mask=mask)
        new = pipeline.state.params
        grads, twin_dx = _twin(old, jnp.asarray(x), jnp.asarray(target), weights, head)
        errors = {}
        for name, i in (("weights", 0), ("biases", 1)):
            for layer in range(2):
                change = np.asarray(getattr(new, name)[layer]) - np.asarray(old[i][layer])
                errors[f"{name}[{layer}]"] = _rel(change, -rate * np.asarray(grads[i][layer]))
        errors["input_error"] = _rel(dx, twin_dx)
        errors["padding_input_error_max"] = float(np.max(np.abs(np.asarray(dx)[REAL:])))
        rows = _row_losses(_logits(old, jnp.asarray(x)), jnp.asarray(target), head)
        twin_loss = float(jnp.sum(weights * rows) / jnp.sum(weights))
        errors["loss"] = abs(pipeline.last_loss - twin_loss) / abs(twin_loss)
        out[head] = errors
    return out


if __name__ == "__main__":
    print(json.dumps(check()))
