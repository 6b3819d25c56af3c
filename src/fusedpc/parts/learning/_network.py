"""The predictive-coding network: layers, weights, precisions and the prediction sweep.

Layers are indexed input-first: layer 0 is the input $x$ (width `sizes[0]`), layers
$1 \\dots L-1$ are hidden, layer $L$ is the output. Matrix $l$ connects layer $l$ to $l+1$ and
uses the layout of `eqx.nn.Linear`: `weights[l]` has shape `(sizes[l+1], sizes[l])`,
`biases[l]` shape `(sizes[l+1],)`, and the prediction sweep is

$$\\hat z_{l+1} = g_l(\\hat z_l)\\, W_l^\\top + b_l, \\qquad \\hat z_0 = x,$$

with $g_0$ the input activation (identity by default) and $g_l$ ($l \\ge 1$) the hidden
activations. The output is the head applied to $\\hat z_L$: gaussian (identity), categorical
(softmax) or binary (sigmoid). Every non-input layer holds a precision $\\pi_l$ per node
(`precisions[l-1]`), the confidence of its beliefs; $\\pi_L$ is the output precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jaxtyping import Float

from fusedpc.core._part import LinearParams
from fusedpc.parts._activations import ACTIVATIONS, Activation, get_activation

HEADS = ("gaussian", "categorical", "binary")
INITIALISATIONS = ("xavier", "he", "orthogonal")


def _positive_precision(value, width: int, what: str) -> jax.Array:
    arr = jnp.asarray(value, jnp.float32)
    if arr.ndim == 0:
        arr = jnp.full((width,), arr, jnp.float32)
    if arr.shape != (width,):
        raise ValueError(
            f"PCNetwork: {what} must be a scalar or have shape ({width},), got {arr.shape}."
        )
    if not bool(jnp.all(arr > 0)):
        raise ValueError(f"PCNetwork: {what} must be > 0, got {value!r}.")
    return arr


def initialise_matrix(
    key: jax.Array, out_width: int, in_width: int, strategy: str
) -> Float[Array, "out_width in_width"]:  # noqa: F722 - a jaxtyping shape
    """One weight matrix `(out, in)`: xavier $U(-a, a)$, $a = \\sqrt{6/(n_{in} + n_{out})}$;
    he $N(0, 2/n_{in})$; orthogonal (rows or columns orthonormal)."""
    if strategy == "xavier":
        bound = (6.0 / (in_width + out_width)) ** 0.5
        return jax.random.uniform(key, (out_width, in_width), jnp.float32, -bound, bound)
    if strategy == "he":
        return jax.random.normal(key, (out_width, in_width), jnp.float32) * (2.0 / in_width) ** 0.5
    if strategy == "orthogonal":
        return jax.nn.initializers.orthogonal()(key, (out_width, in_width), jnp.float32)
    raise ValueError(f"PCNetwork: unknown init {strategy!r}; choose one of {INITIALISATIONS}.")


class PCNetwork(eqx.Module):
    """Architecture, weights and precisions of a predictive-coding network.

    Args:
        sizes: `[in, hidden_1, ..., out]`, at least two entries.
        activations: the hidden layers' activations, one name for all or one per hidden layer
            (identity, relu, tanh, sigmoid, gelu, elu, silu).
        head: `"gaussian"` (linear output), `"categorical"` (softmax) or `"binary"` (sigmoid);
            the head is always the last layer.
        bias: whether each matrix has a bias (one bool for all, or one per matrix).
        input_activation: $g_0$, applied to the input before the first matrix.
        hidden_precision: $\\pi_l$ of the hidden layers (scalar or per node), > 0.
        output_precision: $\\pi_L$ (gaussian head only: it weights the squared error).
        init: `"xavier"`, `"he"` or `"orthogonal"`; every matrix gets its own draw from `key`.
        key: PRNG key for the initialisation; without `key` or `weights` the weights are drawn
            when the pipeline initialises the state (from the pipeline's key).
        weights, biases: given arrays instead (`(out, in)` and `(out,)` per matrix).
    """

    sizes: tuple[int, ...] = eqx.field(static=True)
    activations: tuple[str, ...] = eqx.field(static=True)
    head: str = eqx.field(static=True)
    input_activation: str = eqx.field(static=True)
    has_bias: tuple[bool, ...] = eqx.field(static=True)
    init: str = eqx.field(static=True)
    weights: tuple[jax.Array, ...] | None
    biases: tuple[jax.Array | None, ...] | None
    precisions: tuple[jax.Array, ...]

    def __init__(
        self,
        sizes: Sequence[int],
        activations: str | Sequence[str] = "tanh",
        head: str = "gaussian",
        *,
        bias: bool | Sequence[bool] = True,
        input_activation: str = "identity",
        hidden_precision=1.0,
        output_precision=1.0,
        init: str = "xavier",
        key: jax.Array | None = None,
        weights: Sequence[jax.Array] | None = None,
        biases: Sequence[jax.Array | None] | None = None,
    ):
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) < 2 or any(s < 1 for s in sizes):
            raise ValueError(
                f"PCNetwork: sizes must be [in, hidden..., out] with at least two positive "
                f"entries, got {list(sizes)}."
            )
        n_hidden = len(sizes) - 2
        if isinstance(activations, str):
            activations = (activations,) * n_hidden
        activations = tuple(activations)
        if len(activations) != n_hidden:
            raise ValueError(
                f"PCNetwork: expected {n_hidden} hidden activations for sizes {list(sizes)}, got "
                f"{len(activations)}: {list(activations)}."
            )
        for i, name in enumerate(activations):
            if name in ("categorical", "softmax", "binary"):
                raise ValueError(
                    f"PCNetwork: hidden layer {i + 1} asks for {name!r}, which is a head kind: "
                    "categorical and binary layers are allowed only as the last layer "
                    "(head='categorical' or head='binary')."
                )
            get_activation(name, f"PCNetwork: hidden layer {i + 1}")
        get_activation(input_activation, "PCNetwork: input_activation")
        if head not in HEADS:
            raise ValueError(f"PCNetwork: unknown head {head!r}; choose one of {HEADS}.")
        if init not in INITIALISATIONS:
            raise ValueError(f"PCNetwork: unknown init {init!r}; choose one of {INITIALISATIONS}.")
        n_mats = len(sizes) - 1
        if isinstance(bias, bool):
            bias = (bias,) * n_mats
        bias = tuple(bool(b) for b in bias)
        if len(bias) != n_mats:
            raise ValueError(f"PCNetwork: expected {n_mats} bias flags, got {len(bias)}.")
        if head != "gaussian" and np.any(np.asarray(output_precision) != 1.0):
            raise ValueError(
                f"PCNetwork: output_precision applies to a gaussian head only (head={head!r} "
                f"has unit precision), got {output_precision!r}."
            )
        self.sizes = sizes
        self.activations = activations
        self.head = head
        self.input_activation = input_activation
        self.has_bias = bias
        self.init = init
        self.precisions = tuple(
            _positive_precision(hidden_precision, w, f"hidden_precision (layer {i + 1})")
            for i, w in enumerate(sizes[1:-1])
        ) + (_positive_precision(output_precision, sizes[-1], "output_precision"),)
        if weights is not None:
            self.weights, self.biases = self._check_arrays(weights, biases)
        elif key is not None:
            self.weights, self.biases = self.initial_arrays(key)
        else:
            if biases is not None:
                raise ValueError("PCNetwork: biases given without weights.")
            self.weights, self.biases = None, None

    def _check_arrays(self, weights, biases):
        weights = tuple(jnp.asarray(w, jnp.float32) for w in weights)
        n_mats = len(self.sizes) - 1
        if len(weights) != n_mats:
            raise ValueError(f"PCNetwork: expected {n_mats} weight matrices, got {len(weights)}.")
        for l, w in enumerate(weights):
            want = (self.sizes[l + 1], self.sizes[l])
            if w.shape != want:
                raise ValueError(
                    f"PCNetwork: weights[{l}] must have shape {want} (out, in), got {w.shape}."
                )
        if biases is None:
            biases = tuple(
                jnp.zeros((self.sizes[l + 1],), jnp.float32) if b else None
                for l, b in enumerate(self.has_bias)
            )
        biases = tuple(None if b is None else jnp.asarray(b, jnp.float32) for b in biases)
        if len(biases) != n_mats:
            raise ValueError(f"PCNetwork: expected {n_mats} biases, got {len(biases)}.")
        for l, (b, flag) in enumerate(zip(biases, self.has_bias)):
            if (b is None) == flag:
                raise ValueError(
                    f"PCNetwork: biases[{l}] is {'missing' if flag else 'given'} but bias="
                    f"{flag} for that matrix."
                )
            if b is not None and b.shape != (self.sizes[l + 1],):
                raise ValueError(
                    f"PCNetwork: biases[{l}] must have shape ({self.sizes[l + 1]},), got "
                    f"{b.shape}."
                )
        return weights, biases

    def initial_arrays(
        self, key: jax.Array
    ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array | None, ...]]:
        """Fresh weights (a distinct draw per matrix) and zero biases."""
        keys = jax.random.split(key, len(self.sizes) - 1)
        weights = tuple(
            initialise_matrix(k, self.sizes[l + 1], self.sizes[l], self.init)
            for l, k in enumerate(keys)
        )
        biases = tuple(
            jnp.zeros((self.sizes[l + 1],), jnp.float32) if b else None
            for l, b in enumerate(self.has_bias)
        )
        return weights, biases

    @property
    def n_matrices(self) -> int:
        return len(self.sizes) - 1

    def layer_activation(self, l: int) -> Activation:
        """$g_l$: the input activation for $l = 0$, else hidden layer $l$'s."""
        return get_activation(self.input_activation if l == 0 else self.activations[l - 1])

    def apply_head(
        self, z: Float[Array, "*rows out"]  # noqa: F722 - a jaxtyping shape
    ) -> Float[Array, "*rows out"]:  # noqa: F722 - a jaxtyping shape
        """The head on the output layer's pre-activations: softmax (categorical), sigmoid
        (binary) or the identity (gaussian)."""
        if self.head == "categorical":
            return jax.nn.softmax(z, axis=-1)
        if self.head == "binary":
            return jax.nn.sigmoid(z)
        return z

    def predict(
        self, x: Float[Array, "*rows in"]  # noqa: F722 - a jaxtyping shape
    ) -> Float[Array, "*rows out"]:  # noqa: F722 - a jaxtyping shape
        """The prediction sweep on `(..., in)` rows (for inspection; needs weights)."""
        if self.weights is None:
            raise ValueError("PCNetwork.predict: the network has no weights yet (pass key=).")
        a = self.layer_activation(0).value(x)
        biases = cast(tuple[jax.Array | None, ...], self.biases)  # set with the weights
        for l in range(self.n_matrices):
            z = a @ self.weights[l].T
            bias = biases[l]
            if bias is not None:
                z = z + bias
            if l < self.n_matrices - 1:
                a = self.layer_activation(l + 1).value(z)
        return self.apply_head(z)


def network_records(owner: str, network: PCNetwork, path: str) -> tuple[LinearParams, ...]:
    """The network's weights and biases as `LinearParams` records, input side first; a
    `TypeError` naming `path` and the `owner` part type for a network whose weights are drawn
    at `init_state`."""
    if network.weights is None:
        raise TypeError(
            f"{path or '<root>'}: {owner} has no weights to export yet (they are "
            "drawn when the state is initialised); export pipeline.merge() instead."
        )
    biases = cast(tuple[jax.Array | None, ...], network.biases)  # set with the weights
    return tuple(LinearParams(w, b) for w, b in zip(network.weights, biases))



__all__ = ["ACTIVATIONS", "HEADS", "PCNetwork", "initialise_matrix"]
