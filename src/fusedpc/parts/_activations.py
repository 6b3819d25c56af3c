"""Activations with closed-form first and second derivatives (no autodiff in the library).

Each entry maps a name to `(g, g', g'')`, elementwise functions of the pre-activation $z$.
GELU is the tanh form that `jax.nn.gelu` computes by default:
$g(z) = \\tfrac12 z (1 + t)$, $t = \\tanh u$, $u = c(z + a z^3)$, $c = \\sqrt{2/\\pi}$,
$a = 0.044715$; $g' = \\tfrac12(1+t) + \\tfrac12 z (1-t^2) u'$ with $u' = c(1 + 3 a z^2)$;
$g'' = (1-t^2) u' + \\tfrac12 z (1-t^2)(u'' - 2 t u'^2)$ with $u'' = 6 a c z$.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

_C = math.sqrt(2.0 / math.pi)
_A = 0.044715


class Activation(NamedTuple):
    value: Callable[[jax.Array], jax.Array]
    first: Callable[[jax.Array], jax.Array]
    second: Callable[[jax.Array], jax.Array]


def _gelu(z):
    return 0.5 * z * (1.0 + jnp.tanh(_C * (z + _A * z**3)))


def _gelu_first(z):
    t = jnp.tanh(_C * (z + _A * z**3))
    du = _C * (1.0 + 3.0 * _A * z**2)
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t**2) * du


def _gelu_second(z):
    t = jnp.tanh(_C * (z + _A * z**3))
    du = _C * (1.0 + 3.0 * _A * z**2)
    ddu = 6.0 * _A * _C * z
    sech2 = 1.0 - t**2
    return sech2 * du + 0.5 * z * sech2 * (ddu - 2.0 * t * du**2)


def _sigmoid_first(z):
    s = jax.nn.sigmoid(z)
    return s * (1.0 - s)


def _sigmoid_second(z):
    s = jax.nn.sigmoid(z)
    return s * (1.0 - s) * (1.0 - 2.0 * s)


def _silu_first(z):
    s = jax.nn.sigmoid(z)
    return s + z * s * (1.0 - s)


def _silu_second(z):
    s = jax.nn.sigmoid(z)
    return s * (1.0 - s) * (2.0 + z * (1.0 - 2.0 * s))


ACTIVATIONS: dict[str, Activation] = {
    "identity": Activation(lambda z: z, jnp.ones_like, jnp.zeros_like),
    "relu": Activation(
        lambda z: jnp.maximum(z, 0.0),
        lambda z: (z > 0).astype(z.dtype),
        jnp.zeros_like,
    ),
    "tanh": Activation(
        jnp.tanh,
        lambda z: 1.0 - jnp.tanh(z) ** 2,
        lambda z: -2.0 * jnp.tanh(z) * (1.0 - jnp.tanh(z) ** 2),
    ),
    "sigmoid": Activation(jax.nn.sigmoid, _sigmoid_first, _sigmoid_second),
    "gelu": Activation(_gelu, _gelu_first, _gelu_second),
    "elu": Activation(
        lambda z: jnp.where(z > 0, z, jnp.expm1(jnp.minimum(z, 0.0))),
        lambda z: jnp.where(z > 0, jnp.ones_like(z), jnp.exp(jnp.minimum(z, 0.0))),
        lambda z: jnp.where(z > 0, jnp.zeros_like(z), jnp.exp(jnp.minimum(z, 0.0))),
    ),
    "silu": Activation(lambda z: z * jax.nn.sigmoid(z), _silu_first, _silu_second),
}


def get_activation(name: str, where: str = "activation") -> Activation:
    """Look up an activation by name; unknown names raise a `ValueError` listing the options."""
    try:
        return ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"{where}: unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}."
        ) from None
