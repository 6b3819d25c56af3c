"""Converters from equinox modules to learning parts initialised at the same weights.

Each converter's part computes exactly the module's forward. `**learning` are the learning
part's keywords: `optimiser`, `learning_kind`, `learning_kwargs`, `update_precisions`,
`time_step`, `weight_reuse` (and `tonic_volatility`), plus `head` (`"gaussian"` default,
`"categorical"`, `"binary"`) and, where there are hidden layers, `hidden_precision`.

| converter | network sizes | weights |
| --- | --- | --- |
| `from_linear(lin)` | `[in, out]` | `W_0 = lin.weight`, `b_0 = lin.bias` |
| `from_linears([l1, l2, ...])` | `[in, sum(out)]` | rows stacked in order |
| `from_feedforward(fc1, fc2, act)` | `[in, hidden, out]` | `fc1` then `fc2`, `act` between |
| `from_feedforward_iterative(fc1, fc2)` | `[in, hidden, out]` | as above (`IterativeNetwork`) |
| `from_embedding(emb)` | table `(V, D)` | gather / scatter-add (`LearningEmbedding`) |
| `from_layer_norm(ln)` | `(D,)` affine | `LearningLayerNorm` |
| `from_rms_norm(norm)` | `(D,)` scale | `LearningRMSNorm` |
| `from_swiglu(gate, up, down)` | three `[in, out]` | a `GatedFeedForward` of three `from_linear` |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp

from fusedpc.parts._gated import GatedFeedForward
from fusedpc.parts.conv import eqx_conv_arrays
from fusedpc.parts.learning._conv import LearningConv2d
from fusedpc.parts.learning._embedding import LearningEmbedding
from fusedpc.parts.learning._iterative import RELAXATION_SETTINGS, IterativeNetwork
from fusedpc.parts.learning._layer_norm import LearningLayerNorm
from fusedpc.parts.learning._learning import LearningNetwork
from fusedpc.parts.learning._network import PCNetwork
from fusedpc.parts.learning._rms_norm import LearningRMSNorm

_NETWORK_KEYS = ("head", "hidden_precision", "output_precision", "input_activation")
_PART_KEYS = (
    "optimiser",
    "learning_kind",
    "learning_kwargs",
    "update_precisions",
    "time_step",
    "tonic_volatility",
    "weight_reuse",
)


def _split_learning(where: str, learning: dict, network_keys=_NETWORK_KEYS,
                    part_keys=_PART_KEYS):
    unknown = sorted(set(learning) - set(network_keys) - set(part_keys))
    if unknown:
        raise TypeError(
            f"{where}: unknown keywords {unknown}; allowed: {sorted(network_keys + part_keys)}."
        )
    network = {k: v for k, v in learning.items() if k in network_keys}
    part = {k: v for k, v in learning.items() if k in part_keys}
    return network, part


def _check_linear(where: str, linear) -> None:
    if not isinstance(linear, eqx.nn.Linear):
        raise TypeError(f"{where}: expected an eqx.nn.Linear, got {type(linear).__name__}.")
    if linear.weight.ndim != 2:
        raise ValueError(f"{where}: expected a 2-D weight, got shape {linear.weight.shape}.")


def from_linear(linear: eqx.nn.Linear, **learning: Any) -> LearningNetwork:
    """A learning part computing `linear(x)` on `(..., in)` rows: sizes `[in, out]`."""
    _check_linear("from_linear", linear)
    net_kw, part_kw = _split_learning("from_linear", learning, ("head", "output_precision",
                                                                "input_activation"))
    out_width, in_width = linear.weight.shape
    has_bias = linear.bias is not None
    network = PCNetwork(
        [in_width, out_width], (), bias=has_bias,
        weights=[linear.weight], biases=[linear.bias if has_bias else None], **net_kw,
    )
    return LearningNetwork(network, **part_kw)


def from_linears(linears: Sequence[eqx.nn.Linear], **learning: Any) -> LearningNetwork:
    """Several linears sharing one input, outputs stacked in order (e.g. a fused Q/K/V)."""
    linears = list(linears)
    if not linears:
        raise ValueError("from_linears: needs at least one eqx.nn.Linear.")
    for i, lin in enumerate(linears):
        _check_linear(f"from_linears: linears[{i}]", lin)
    in_widths = [lin.weight.shape[1] for lin in linears]
    if len(set(in_widths)) != 1:
        raise ValueError(
            f"from_linears: every linear must share its in_features; got {in_widths}."
        )
    has_bias = [lin.bias is not None for lin in linears]
    if len(set(has_bias)) != 1:
        raise ValueError(
            f"from_linears: either all linears have a bias or none does; got use_bias "
            f"{has_bias}."
        )
    net_kw, part_kw = _split_learning("from_linears", learning, ("head", "output_precision",
                                                                  "input_activation"))
    weight = jnp.concatenate([lin.weight for lin in linears], axis=0)
    bias = (
        jnp.concatenate([lin.bias for lin in linears])  # type: ignore[misc]  # all have a bias
        if has_bias[0]
        else None
    )
    network = PCNetwork(
        [in_widths[0], weight.shape[0]], (), bias=has_bias[0], weights=[weight], biases=[bias],
        **net_kw,
    )
    return LearningNetwork(network, **part_kw)


def _feedforward_network(
    where: str, fc1: eqx.nn.Linear, fc2: eqx.nn.Linear, activation: str, network_kw: dict
) -> PCNetwork:
    _check_linear(f"{where}: fc1", fc1)
    _check_linear(f"{where}: fc2", fc2)
    hidden, in_width = fc1.weight.shape
    out_width, hidden2 = fc2.weight.shape
    if hidden != hidden2:
        raise ValueError(
            f"{where}: fc1 has {hidden} out_features but fc2 has {hidden2} "
            "in_features; they must match."
        )
    bias = (fc1.bias is not None, fc2.bias is not None)
    return PCNetwork(
        [in_width, hidden, out_width], (activation,), bias=bias,
        weights=[fc1.weight, fc2.weight], biases=[fc1.bias, fc2.bias], **network_kw,
    )


def from_feedforward(
    fc1: eqx.nn.Linear, fc2: eqx.nn.Linear, activation: str = "gelu", **learning: Any
) -> LearningNetwork:
    """`fc2(activation(fc1(x)))` as one learning network: sizes `[in, hidden, out]`.

    fc1's bias sits inside the activation (the hidden layer holds pre-activations).
    """
    net_kw, part_kw = _split_learning("from_feedforward", learning)
    network = _feedforward_network("from_feedforward", fc1, fc2, activation, net_kw)
    return LearningNetwork(network, **part_kw)


ITERATIVE_KEYS = ("optimiser", *RELAXATION_SETTINGS)


def from_feedforward_iterative(
    fc1: eqx.nn.Linear, fc2: eqx.nn.Linear, activation: str = "gelu", **iterative: Any
) -> IterativeNetwork:
    """`fc2(activation(fc1(x)))` as one `IterativeNetwork` (sizes `[in, hidden, out]`): the
    same forward as `from_feedforward`, learning by iterative inference. `**iterative`: the
    part's `optimiser`, `inference_steps`, `inference_rate`, `schedule`, `fixed_prediction`,
    `inference_optimiser`, `record_energy`, and the network's `head`, `hidden_precision`,
    `output_precision`, `input_activation`."""
    where = "from_feedforward_iterative"
    net_kw, part_kw = _split_learning(where, iterative, part_keys=ITERATIVE_KEYS)
    network = _feedforward_network(where, fc1, fc2, activation, net_kw)
    return IterativeNetwork(network, **part_kw)


def from_embedding(embedding: eqx.nn.Embedding, **learning: Any) -> LearningEmbedding:
    """A learning embedding at the table of `embedding` (gather forward, scatter-add backward).

    Accepts `optimiser`, `learning_kind`, `learning_kwargs` and `weight_reuse`.
    """
    if not isinstance(embedding, eqx.nn.Embedding):
        raise TypeError(
            f"from_embedding: expected an eqx.nn.Embedding, got {type(embedding).__name__}."
        )
    allowed = ("optimiser", "learning_kind", "learning_kwargs", "weight_reuse")
    unknown = sorted(set(learning) - set(allowed))
    if unknown:
        raise TypeError(f"from_embedding: unknown keywords {unknown}; allowed: {list(allowed)}.")
    return LearningEmbedding(embedding.weight, **learning)


def from_layer_norm(layer_norm: eqx.nn.LayerNorm, **learning: Any) -> LearningLayerNorm:
    """A LayerNorm whose affine learns (`optimiser`), at the module's weight, bias and eps.

    A LayerNorm built without an affine starts from $\\gamma = 1$, $\\beta = 0$.
    """
    if not isinstance(layer_norm, eqx.nn.LayerNorm):
        raise TypeError(
            f"from_layer_norm: expected an eqx.nn.LayerNorm, got {type(layer_norm).__name__}."
        )
    unknown = sorted(set(learning) - {"optimiser"})
    if unknown:
        raise TypeError(f"from_layer_norm: unknown keywords {unknown}; allowed: ['optimiser'].")
    shape = layer_norm.shape
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if len(shape) != 1:
        raise ValueError(f"from_layer_norm: only a LayerNorm over the last axis, got {shape}.")
    weight = layer_norm.weight if layer_norm.weight is not None else jnp.ones(shape, jnp.float32)
    bias = layer_norm.bias if layer_norm.bias is not None else jnp.zeros(shape, jnp.float32)
    return LearningLayerNorm(weight, bias, eps=layer_norm.eps, **learning)


def from_rms_norm(rms_norm: eqx.nn.RMSNorm, **learning: Any) -> LearningRMSNorm:
    """An RMSNorm whose scale learns (`optimiser`), at the module's weight, bias and eps.

    An `eqx.nn.RMSNorm(use_weight=False)` starts from $\\gamma = 1$; one with
    `use_bias=False` has no shift, and the part learns none.
    """
    if not isinstance(rms_norm, eqx.nn.RMSNorm):
        raise TypeError(
            f"from_rms_norm: expected an eqx.nn.RMSNorm, got {type(rms_norm).__name__}."
        )
    unknown = sorted(set(learning) - {"optimiser"})
    if unknown:
        raise TypeError(f"from_rms_norm: unknown keywords {unknown}; allowed: ['optimiser'].")
    shape = rms_norm.shape
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if len(shape) != 1:
        raise ValueError(f"from_rms_norm: only an RMSNorm over the last axis, got {shape}.")
    weight = rms_norm.weight if rms_norm.weight is not None else jnp.ones(shape, jnp.float32)
    return LearningRMSNorm(weight, rms_norm.bias, eps=rms_norm.eps, **learning)


def from_swiglu(
    gate: eqx.nn.Linear, up: eqx.nn.Linear, down: eqx.nn.Linear, **learning: Any
) -> GatedFeedForward:
    """A SwiGLU feed-forward $\\mathrm{down}(\\mathrm{silu}(\\mathrm{gate}(x)) \\odot
    \\mathrm{up}(x))$ whose three linears learn, each a `from_linear(..., **learning)` (one
    optimiser object for the three: they stack in a `Repeat` across blocks).

    `gate` and `up` must map the same `in_features` to the same `out_features`, which `down`
    takes in.
    """
    for name, lin in (("gate", gate), ("up", up), ("down", down)):
        _check_linear(f"from_swiglu: {name}", lin)
    if gate.weight.shape != up.weight.shape:
        raise ValueError(
            f"from_swiglu: gate and up must have the same weight shape (hidden, in), got "
            f"{tuple(gate.weight.shape)} and {tuple(up.weight.shape)}."
        )
    if down.weight.shape[1] != gate.weight.shape[0]:
        raise ValueError(
            f"from_swiglu: down must take the gate's {gate.weight.shape[0]} out_features as its "
            f"in_features, got {down.weight.shape[1]}."
        )
    return GatedFeedForward(
        from_linear(gate, **learning), from_linear(up, **learning), from_linear(down, **learning)
    )


__all__ = [
    "from_conv2d",
    "from_embedding",
    "from_feedforward",
    "from_feedforward_iterative",
    "from_layer_norm",
    "from_linear",
    "from_linears",
    "from_rms_norm",
    "from_swiglu",
]


def from_conv2d(conv: eqx.nn.Conv2d, **learning: Any) -> LearningConv2d:
    """A `LearningConv2d` at the weights, stride and padding of an `eqx.nn.Conv2d`.

    Equinox's convolution is channels-first on unbatched `(C, H, W)` inputs, weight
    `(C_out, C_in, kh, kw)`, bias `(C_out, 1, 1)`; the part is channels-last with the kernel
    `weight.transpose(2, 3, 1, 0)` and the bias flattened, so that on `(B, H, W, C_in)` it
    computes `jax.vmap(conv)` of the channels-first images, transposed back. Only dilation 1,
    one group and zero padding. `**learning`: `optimiser`, `learning_kind`, `learning_kwargs`,
    `update_precisions`, `time_step`, `tonic_volatility`, `weight_reuse`.
    """
    where = "from_conv2d"
    if not isinstance(conv, eqx.nn.Conv2d):
        raise TypeError(f"{where}: expected an eqx.nn.Conv2d, got {type(conv).__name__}.")
    _, learning = _split_learning(where, learning, network_keys=())
    kernel, bias, stride, padding = eqx_conv_arrays(conv, where)
    kh, kw, in_channels, out_channels = kernel.shape
    return LearningConv2d(
        in_channels, out_channels, (kh, kw), stride=stride, padding=padding,
        use_bias=bias is not None, kernel=kernel, bias=bias, **learning,
    )
