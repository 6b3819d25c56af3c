"""A learning 2-D convolution: the one-matrix learning network on the input's patches.

A convolution is a linear map with shared weights. Extract the patches of the zero-padded
input $\\tilde x$ (channels-last, see `fusedpc.parts.conv`): output position $(a, b)$ of image
$n$ reads the row

$$P_{n,a,b} = \\big(\\tilde x_{n,\\, s_h a + i,\\, s_w b + j,\\, c}\\big)_{(i, j, c)}
\\in \\mathbb{R}^{k_h k_w C_{in}},$$

flattened row-major over $(i, j, c)$, index $(i k_w + j) C_{in} + c$. Then
$y_{n,a,b} = P_{n,a,b} W^\\top + b$ with $W$ `(C_out, kh*kw*C_in)`, exactly a
`LearningNetwork` of sizes `[kh*kw*C_in, C_out]` on the $N H' W'$ patch rows. The kernel in
the HWIO layout is `W.T.reshape(kh, kw, C_in, C_out)`, and `W = kernel.reshape(-1, C_out).T`.

**Weight gradient.** The network's gradient is $k$ times the mean over its rows,
$\\bar G = \\frac{k}{N H' W'} \\sum_{n,a,b} u_{n,a,b} \\otimes P_{n,a,b}$, with $u = \\pi E$ for
`precision_weighted` (the correlation of the error with the input patches) and $E$ for
`standard`. The convolution's weight is used $H' W'$ times per image, so `weight_reuse`
$k = H' W'$ (the default, read off the input at trace time) makes it
$\\frac{1}{N} \\sum_{n,a,b} E_{n,a,b} \\otimes P_{n,a,b}$: the backprop gradient of the loss
averaged over the **images** (what a classifier head after `flatten` gives; the bias alike).
A loss averaged over every output position (a per-pixel loss whose rows are the $N H' W'$
positions) wants `weight_reuse=1.0`. The synaptic importance is scaled by the same $k$.

**Input error.** The network's input error on the patch rows, $E W$ (unit output precision),
is mapped back by the adjoint of the patch extraction (col2im): every patch entry is added to
the pixel it was read from and the padding is cropped off. That adjoint is written by hand
(`fusedpc.parts.conv.windows_adjoint`, a zero-padding per window offset), no autodiff; the
result is the transposed convolution of the error, as for the frozen `conv2d`.

For a single matrix at unit output precision `standard` takes the same step as
`precision_weighted` ($u = E$ either way); `synaptic_uncertainty` differs.
"""

from __future__ import annotations

from typing import ClassVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from fusedpc.core._part import AbstractPart, Core, display_path, replace_fields
from fusedpc.parts.conv import (
    ConvParams,
    ImageShape,
    Padding,
    Pair,
    as_images,
    as_padding,
    as_pair,
    check_kernel,
    conv_geometry,
    crop_images,
    pad_images,
    window_slices,
    windows_adjoint,
)
from fusedpc.parts.learning._learning import LearningNetwork, LearningNetworkState, NetworkCache
from fusedpc.parts.learning._local_update import resolve_learning
from fusedpc.parts.learning._network import PCNetwork
from fusedpc.parts.learning._rules import LearningRule, rule_spelling

__all__ = ["ConvCache", "LearningConv2d"]


class ConvCache(eqx.Module):
    """What a `LearningConv2d`'s backward reads: the patch network's `network` cache (its
    input rows are the patches, `(N H' W', kh*kw*C_in)`) and the input's `shape`."""

    network: NetworkCache
    shape: ImageShape


class LearningConv2d(AbstractPart):
    """A 2-D convolution whose kernel learns locally, with exact backprop parity.

    Channels-last: input `(*rows, H, W, C_in)`, output `(*rows, H', W', C_out)`, kernel
    `(kh, kw, C_in, C_out)`. Forward, backward and the weight rule: see the module docstring
    (the one-matrix `LearningNetwork` on the patches, `weight_reuse` $H' W'$).

    Args:
        in_channels, out_channels: $C_{in}$, $C_{out}$.
        kernel_size: $k$ or $(k_h, k_w)$.
        optimiser: any optax transformation fed the gradient; `None` freezes the kernel.
        learning_kind: a learning rule (`fusedpc.parts.learning.PrecisionWeighted()`, the
            default, `Standard()`, `SynapticUncertainty(window=N, ...)`) or its name,
            `"precision_weighted"`, `"standard"` or `"synaptic_uncertainty"` (with
            `learning_kwargs={"window": N, ...}`), as for a
            `LearningNetwork`.
        learning_kwargs: the synaptic settings (see `LearningNetwork`).
        stride: a positive integer or `(along height, along width)`.
        padding: `"SAME"` (default), `"SAME_LOWER"`, `"VALID"`, an integer or
            `((lo_h, hi_h), (lo_w, hi_w))` (see `fusedpc.parts.conv`).
        use_bias: whether there is a bias `(C_out,)`.
        init: `"he"` (default, $N(0, 2/(k_h k_w C_{in}))$, for ReLU networks), `"xavier"` or
            `"orthogonal"` (see `PCNetwork`), drawn from `key`, or from the pipeline's key at
            `init_state` without one.
        key: PRNG key for the kernel; zero bias.
        kernel, bias: given arrays instead, `(kh, kw, C_in, C_out)` and `(C_out,)` (a given
            kernel without a bias starts from a zero bias when `use_bias`).
        update_precisions, time_step, tonic_volatility: as for `LearningNetwork` (a single
            matrix has no hidden precision to update).
        weight_reuse: $k$; `None` (default) for $H' W'$ of the input seen, the parity setting
            for a loss averaged over images; a number fixes it (see the module docstring).

    The state is the patch network's `LearningNetworkState` (its weight `(C_out, kh*kw*C_in)`
    in the patch order above); it reports `PartMetrics` with `layer_sizes`
    `[kh*kw*C_in, C_out]` and exports one `ConvParams(kernel, bias)`.
    """

    defers_updates: ClassVar[bool] = True

    network: LearningNetwork
    window: Pair = eqx.field(static=True)
    in_channels: int = eqx.field(static=True)
    stride: Pair = eqx.field(static=True)
    padding: Padding = eqx.field(static=True)
    weight_reuse: float | None = eqx.field(static=True)

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Pair,
        optimiser: optax.GradientTransformation | None = None,
        learning_kind: str | LearningRule = "precision_weighted",
        learning_kwargs: dict | None = None,
        *,
        stride: int | Pair = 1,
        padding: str | int | tuple[Pair, Pair] = "SAME",
        use_bias: bool = True,
        init: str = "he",
        key: jax.Array | None = None,
        kernel: jax.Array | None = None,
        bias: jax.Array | None = None,
        update_precisions: bool = False,
        time_step: float = 1.0,
        tonic_volatility: float = -4.0,
        weight_reuse: float | None = None,
    ):
        where = "LearningConv2d"
        learning_kind, learning_kwargs = rule_spelling(where, learning_kind, learning_kwargs)
        resolve_learning(where, optimiser, learning_kind, learning_kwargs, 1.0)
        window = as_pair(kernel_size, "kernel_size", where)
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}.")
        width = window[0] * window[1] * in_channels
        weights = biases = None
        if kernel is not None:
            kernel, bias = check_kernel(where, kernel, bias)
            want = (*window, in_channels, out_channels)
            if tuple(kernel.shape) != want:
                raise ValueError(
                    f"{where}: kernel must have shape {want} (kh, kw, in_channels, "
                    f"out_channels), got {tuple(kernel.shape)}."
                )
            if bias is not None and not use_bias:
                raise ValueError(f"{where}: a bias was given with use_bias=False.")
            weights = [jnp.reshape(kernel, (width, out_channels)).T]
            biases = [bias] if bias is not None else None
        elif bias is not None:
            raise ValueError(f"{where}: a bias was given without a kernel.")
        if weight_reuse is not None and not weight_reuse > 0:
            raise ValueError(f"{where}: weight_reuse must be > 0 or None, got {weight_reuse!r}.")
        patch_map = PCNetwork(
            [width, out_channels], (), bias=use_bias, init=init,
            key=key if weights is None else None, weights=weights, biases=biases,
        )
        # weight_reuse is set per input size at trace time (the network's own stays 1).
        self.network = LearningNetwork(
            patch_map, optimiser, learning_kind, learning_kwargs,
            update_precisions=update_precisions, time_step=time_step,
            tonic_volatility=tonic_volatility,
        )
        self.window = window
        self.in_channels = int(in_channels)
        self.stride = as_pair(stride, "stride", where)
        self.padding = as_padding(padding, where)
        self.weight_reuse = None if weight_reuse is None else float(weight_reuse)

    @property
    def out_channels(self) -> int:
        """$C_{out}$, the number of output channels."""
        return self.network.network.sizes[-1]

    @property
    def kernel(self) -> jax.Array | None:
        """The kernel `(kh, kw, C_in, C_out)` (None until drawn at `init_state`)."""
        weights = self.network.network.weights
        if weights is None:
            return None
        return jnp.reshape(weights[0].T, (*self.window, self.in_channels, self.out_channels))

    @property
    def bias(self) -> jax.Array | None:
        """The bias `(C_out,)`, or None (no bias, or not drawn yet)."""
        biases = self.network.network.biases
        return None if biases is None else biases[0]

    def export_arrays(self, path: str = "") -> tuple[ConvParams, ...]:
        """`(ConvParams(kernel, bias),)`: the kernel in the HWIO layout `(kh, kw, C_in,
        C_out)` (a kernel drawn at `init_state` is exported from `pipeline.merge()`)."""
        kernel = self.kernel
        if kernel is None:
            raise TypeError(
                f"{display_path(path)}: LearningConv2d has no kernel to export yet (it is "
                "drawn when the state is initialised); export pipeline.merge() instead."
            )
        return (ConvParams(kernel, self.bias),)

    def init_state(self, key: jax.Array) -> LearningNetworkState:
        return self.network.init_state(key)

    def compile(self, path: str) -> Core:
        where = display_path(path)
        window, stride, padding = self.window, self.stride, self.padding
        out_channels = self.out_channels
        base = self.network.compile(path)
        by_reuse: dict[float, Core] = {1.0: base}

        def patch_core(reuse: float) -> Core:
            # the network's Core with k baked in, compiled once per input size (trace time)
            if reuse not in by_reuse:
                network = replace_fields(self.network, weight_reuse=reuse)
                by_reuse[reuse] = network.compile(path)
            return by_reuse[reuse]

        def forward(state: LearningNetworkState, x, ctx):
            images = as_images(where, x, self.in_channels)
            shape = ImageShape(*images.shape[1:])
            geometry = conv_geometry(where, images.shape[1:3], window, stride, padding)
            padded = pad_images(images, geometry.pads)
            pieces = window_slices(padded, window, stride, geometry.out)
            patches = jnp.stack(pieces, axis=3)  # (N, H', W', kh*kw, C_in)
            patches = jnp.reshape(patches, (*patches.shape[:3], -1))
            y, cache = base.forward(state, patches, ctx)
            y = jnp.reshape(y, (*jnp.shape(x)[:-3], *geometry.out, out_channels))
            return y, ConvCache(cast(NetworkCache, cache), shape)

        def backward(state: LearningNetworkState, cache: ConvCache, error, ctx):
            shape = cache.shape
            size = (shape.height, shape.width)
            geometry = conv_geometry(where, size, window, stride, padding)
            rows = jnp.reshape(error, (-1, *geometry.out, out_channels))
            reuse = self.weight_reuse
            if reuse is None:
                reuse = float(geometry.out[0] * geometry.out[1])
            patch_error, new_state, metrics = patch_core(reuse).backward(
                state, cache.network, rows, ctx
            )
            offsets = window[0] * window[1]
            patch_error = jnp.reshape(
                patch_error, (*patch_error.shape[:3], offsets, shape.channels)
            )
            pieces = [patch_error[:, :, :, i, :] for i in range(offsets)]
            padded = windows_adjoint(pieces, geometry.padded, window, stride)
            input_error = crop_images(padded, geometry.pads, size)
            input_error = jnp.reshape(input_error, (*error.shape[:-3], *input_error.shape[1:]))
            return input_error, new_state, metrics

        def write_back(state: LearningNetworkState) -> LearningConv2d:
            return replace_fields(self, network=base.write_back(state))

        return Core(forward, backward, write_back)
