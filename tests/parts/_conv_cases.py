"""Conformance cases of the image parts (`fusedpc.parts.conv`, `LearningConv2d`): tiny images
(2 x 6 x 6 or 2 x 8 x 8), 1-4 channels, float32.

`CASES` maps a name to a factory returning `(part, example_input)`, like
`helpers.CONFORMANCE_CASES`. `RESHAPING` names the cases whose output has other leading axes
than the input (pools, strided or VALID convolutions, flatten): an image's rows are its
leading axes before `(height, width, channels)`, so for them only the batch axis carries
through (`y.shape[0] == x.shape[0]`), not `x.shape[:-1]`.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import optax
from helpers import normal

import fusedpc
from fusedpc import LearningConv2d
from fusedpc.parts import conv
from fusedpc.transplant import from_conv2d

Case = Callable[[], tuple[fusedpc.AbstractPart, jax.Array]]


def _kernel(seed: int, kh: int, kw: int, c_in: int, c_out: int) -> jax.Array:
    return normal(seed, (kh, kw, c_in, c_out)) / float((kh * kw * c_in) ** 0.5)


def _eqx_conv() -> eqx.nn.Conv2d:
    return eqx.nn.Conv2d(3, 4, 3, stride=2, padding=1, key=jax.random.key(60))


CASES: dict[str, Case] = {
    "conv2d_same": lambda: (
        conv.conv2d(_kernel(65, 3, 3, 3, 4), 0.1 * normal(66, (4,))),
        normal(130, (2, 6, 6, 3)),
    ),
    "conv2d_valid_stride2": lambda: (
        conv.conv2d(_kernel(67, 3, 2, 3, 4), stride=2, padding="VALID"),
        normal(131, (2, 7, 6, 3)),
    ),
    "max_pool_overlapping": lambda: (conv.max_pool(3, 2), normal(134, (2, 7, 7, 3))),
    "avg_pool": lambda: (conv.avg_pool(2), normal(135, (2, 6, 6, 3))),
    "flatten": lambda: (conv.flatten(), normal(136, (2, 4, 4, 3))),
    "learning_conv2d": lambda: (
        LearningConv2d(3, 4, 3, optax.adam(1e-2), key=jax.random.key(68)),
        normal(137, (2, 6, 6, 3)),
    ),
    "learning_conv2d_strided_from_eqx": lambda: (
        from_conv2d(_eqx_conv(), optimiser=optax.sgd(0.1)),
        normal(138, (2, 6, 6, 3)),
    ),
}
# The synaptic kind of the learning convolution and a whole convnet run in tests/parts/
# test_conv.py; they are left out here to keep the suite's time (about 30 s together).

RESHAPING = frozenset(
    {
        "conv2d_valid_stride2",
        "max_pool_overlapping",
        "avg_pool",
        "flatten",
        "learning_conv2d_strided_from_eqx",
    }
)
