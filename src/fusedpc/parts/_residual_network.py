"""Deep residual predictive-coding networks and μPC, their depth-stable parameterisation
(`docs/pc-depth.md`).

The network has an input layer, `depth` residual blocks of one layer each and a readout,
with latents (`fusedpc.Latent`) after the input layer and after every block:

$$h_0 = a_{in} W_{in} x, \\qquad h_l = h_{l-1} + a_{hid} W_l\\, g(h_{l-1}) \\;(l = 1 \\dots L),
\\qquad y = a_{out} W_{out}\\, g(h_L),$$

each $W$ a learning layer without bias (`LearningNetwork`, stepping through its optimiser)
and each $a$ a fixed multiplier (`fusedpc.frozen.scale`). Two parameterisations:

* `"mupc"` (μPC: Innocenti, Achour & Buckley, NeurIPS 2025, a Depth-μP parameterisation
  for predictive coding): every weight drawn from $N(0, 1)$ and the width and depth moved
  into the multipliers, $a_{in} = 1/\\sqrt{D}$ (D the input width),
  $a_{hid} = 1/\\sqrt{N L}$ (N the width, L the number of blocks) and $a_{out} = 1/N$. Every
  block's branch then adds $O(1/\\sqrt{L})$ to a stream of size $O(1)$, so activities,
  prediction errors and the energy stay of the same size at any depth, and the rates that
  work at one width and depth work unchanged at others.
* `"standard"`: the same tree with the weights drawn as usual for the activation
  (He: $N(0, 2/n_{in})$) and every multiplier 1; its residual stream grows with depth (the
  control that μPC is measured against).

Blocks are one `Repeat` (scanned): the program, its compile time and its memory per block do
not grow with depth.
"""

from __future__ import annotations

import math

import jax
import optax

from fusedpc.core._part import AbstractPart
from fusedpc.parts._activations import ACTIVATIONS
from fusedpc.parts._compose import Residual, Sequential
from fusedpc.parts._latent import Latent
from fusedpc.parts._repeat import Repeat
from fusedpc.parts.frozen import scale
from fusedpc.parts.learning import LearningNetwork, PCNetwork

PARAMETERISATIONS = ("mupc", "standard")
LATENT_PLACES = ("blocks", "none")


def mupc_multipliers(in_width: int, width: int, depth: int) -> tuple[float, float, float]:
    """μPC's multipliers $(a_{in}, a_{hid}, a_{out}) = (1/\\sqrt{D}, 1/\\sqrt{N L}, 1/N)$."""
    return 1.0 / math.sqrt(in_width), 1.0 / math.sqrt(width * depth), 1.0 / width


def _layer(key: jax.Array, n_in: int, n_out: int, activation: str,
           optimiser: optax.GradientTransformation | None,
           parameterisation: str) -> LearningNetwork:
    """One learning matrix without bias, $W g(x)$ with $g$ = `activation` on its input."""
    if parameterisation == "mupc":
        weight = jax.random.normal(key, (n_out, n_in))
        network = PCNetwork([n_in, n_out], bias=False, input_activation=activation,
                            weights=[weight])
    else:
        network = PCNetwork([n_in, n_out], bias=False, input_activation=activation,
                            init="he", key=key)
    return LearningNetwork(network, optimiser)


def _scaled(layer: LearningNetwork, multiplier: float) -> list[AbstractPart]:
    return [layer] if multiplier == 1.0 else [layer, scale(multiplier)]


def _check(in_width: int, width: int, out_width: int, depth: int, parameterisation: str,
           activation: str, latents: str) -> None:
    for name, value in (("in_width", in_width), ("width", width), ("out_width", out_width),
                        ("depth", depth)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"residual_pc_network: {name} must be an integer >= 1, got "
                             f"{value!r}.")
    if parameterisation not in PARAMETERISATIONS:
        raise ValueError(f"residual_pc_network: parameterisation must be one of "
                         f"{PARAMETERISATIONS}, got {parameterisation!r}.")
    if activation not in ACTIVATIONS:
        raise ValueError(f"residual_pc_network: activation must be one of {tuple(ACTIVATIONS)}, "
                         f"got {activation!r}.")
    if latents not in LATENT_PLACES:
        raise ValueError(f"residual_pc_network: latents must be one of {LATENT_PLACES}, got "
                         f"{latents!r}.")


def residual_pc_network(
    in_width: int,
    width: int,
    out_width: int,
    depth: int,
    *,
    optimiser: optax.GradientTransformation | None,
    key: jax.Array,
    parameterisation: str = "mupc",
    activation: str = "relu",
    latents: str = "blocks",
    latent_precision: float = 1.0,
) -> Sequential:
    """A residual predictive-coding network of `depth` blocks (module docstring).

    Args:
        in_width, width, out_width: $D$, $N$ and the output width.
        depth: $L \\ge 1$, the residual blocks (one scanned `Repeat`).
        optimiser: every layer's optax optimiser (μPC uses one rate for all: the multipliers
            carry the width and the depth); None freezes the weights.
        key: draws every weight (each layer its own key).
        parameterisation: `"mupc"` (the default) or `"standard"`.
        activation: $g$, applied to a block's input inside its branch and before the readout.
        latents: `"blocks"` (a `Latent` after the input layer and after every block: the
            whole network relaxes on one energy) or `"none"` (no latents: the single sweep,
            the exact step).
        latent_precision: every latent's precision $\\Pi$.

    Returns:
        `Sequential([input layer, (latent), Repeat(blocks), readout])`, each block
        `Sequential([Residual(branch), (latent)])`.
    """
    _check(in_width, width, out_width, depth, parameterisation, activation, latents)
    a_in, a_hid, a_out = (mupc_multipliers(in_width, width, depth)
                          if parameterisation == "mupc" else (1.0, 1.0, 1.0))
    k_in, k_blocks, k_out = jax.random.split(key, 3)

    def latent() -> list[AbstractPart]:
        return [Latent(latent_precision)] if latents == "blocks" else []

    def block(block_key: jax.Array) -> Sequential:
        branch = _scaled(_layer(block_key, width, width, activation, optimiser,
                                parameterisation), a_hid)
        return Sequential([Residual(Sequential(branch)), *latent()])

    return Sequential([
        *_scaled(_layer(k_in, in_width, width, "identity", optimiser, parameterisation), a_in),
        *latent(),
        Repeat.from_factory(block, depth, k_blocks),
        *_scaled(_layer(k_out, width, out_width, activation, optimiser, parameterisation),
                 a_out),
    ])


__all__ = ["PARAMETERISATIONS", "mupc_multipliers", "residual_pc_network"]
