"""Frozen image parts: a 2-D convolution, max and average pooling, and flatten.

**Layout.** Images are channels-last, `(*rows, height, width, channels)` (NHWC: the library's
"features last"); every axis before the height is a row axis (usually one, the batch). A
kernel is `(kh, kw, C_in, C_out)` (HWIO), its bias `(C_out,)`. `eqx.nn.Conv2d` is
channels-first on unbatched `(C, H, W)` inputs with a weight `(C_out, C_in, kh, kw)` and a bias
`(C_out, 1, 1)`; `conv2d(conv)` converts them (`weight.transpose(2, 3, 1, 0)`,
`bias.reshape(-1)`), so that `conv2d(conv)(x)` is `jax.vmap(conv)(x.transpose(0, 3, 1, 2))`
transposed back to channels-last.

**Geometry.** With stride $s$ and padding $(p^-, p^+)$ along an axis of size $H$ and a window
$k$, the padded size is $H_p = H + p^- + p^+$ and the output size $H' = \\lfloor (H_p - k)/s
\\rfloor + 1$. `"VALID"` pads nothing; `"SAME"` pads $P = \\max((\\lceil H/s \\rceil - 1)s + k - H,
0)$ in all, $p^- = \\lfloor P/2 \\rfloor$ (the convention of `jax.lax.conv_general_dilated`),
`"SAME_LOWER"` puts the odd unit before; an integer $p$ pads $p$ on every side; explicit
`((p^-_h, p^+_h), (p^-_w, p^+_w))` pairs are taken as they are.

**Windows.** Output position $(a, b)$ reads the window $\\tilde x_{sa + i,\\, sb + j}$,
$0 \\le i < k_h$, $0 \\le j < k_w$, of the zero-padded input $\\tilde x$. Each offset $(i, j)$ is
one strided slice of $\\tilde x$ (`window_slices`), and the adjoint of a strided slice is a
zero-padding with the stride's gaps between the entries (`windows_adjoint`): that pair is the
patch extraction and its hand-written transpose (col2im) that the pools and
`fusedpc.LearningConv2d` use.

Every backward here is hand-derived (no autodiff) and checked against `jax.vjp` of its forward
by the tests; check your own with `fusedpc.check_backward`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core._context import StepContext
from fusedpc.core._part import ExportRecord
from fusedpc.core._precision import to_compute
from fusedpc.parts._conv_geometry import PADDINGS as PADDINGS
from fusedpc.parts._conv_geometry import Geometry as Geometry
from fusedpc.parts._conv_geometry import Padding as Padding
from fusedpc.parts._conv_geometry import Pair as Pair
from fusedpc.parts._conv_geometry import as_images as as_images
from fusedpc.parts._conv_geometry import as_padding as as_padding
from fusedpc.parts._conv_geometry import as_pair as as_pair
from fusedpc.parts._conv_geometry import conv_geometry as conv_geometry
from fusedpc.parts._conv_geometry import crop_images as crop_images
from fusedpc.parts._conv_geometry import pad_images as pad_images
from fusedpc.parts._conv_geometry import window_slices as window_slices
from fusedpc.parts._conv_geometry import windows_adjoint as windows_adjoint
from fusedpc.parts._frozen import Frozen

__all__ = [
    "ConvParams",
    "ImageShape",
    "MaxPoolCache",
    "avg_pool",
    "conv2d",
    "flatten",
    "max_pool",
]

_DIMENSIONS = ("NHWC", "HWIO", "NHWC")


class ConvParams(ExportRecord):
    """A 2-D convolution's parameters, channels-last: `kernel` `(kh, kw, C_in, C_out)` (HWIO)
    and `bias` `(C_out,)` or None. A frozen `conv2d`'s parameters and the export record of
    every convolution (`LearningConv2d` exports one too). From an `eqx.nn.Conv2d`:
    `kernel = conv.weight.transpose(2, 3, 1, 0)`, `bias = conv.bias.reshape(-1)`."""

    kernel: jax.Array
    bias: jax.Array | None


class ImageShape(eqx.Module):
    """The spatial shape of an image input, `height`, `width`, `channels` (static): what the
    backward of a convolution, an average pool or a flatten reads from its cache."""

    height: int = eqx.field(static=True)
    width: int = eqx.field(static=True)
    channels: int = eqx.field(static=True)


class MaxPoolCache(eqx.Module):
    """What a max pool's backward reads: `winner` `(N, H', W', C)` int32, the offset
    $i k_w + j$ of each window's arg-max (the first in row-major window order on ties), and the
    input's `shape`."""

    winner: jax.Array
    shape: ImageShape


def _convolve(
    x: jax.Array,
    kernel: jax.Array,
    stride: Pair,
    padding: Sequence[Pair],
    lhs_dilation: Pair = (1, 1),
    dtype: Any = None,
) -> jax.Array:
    """`lax.conv_general_dilated` channels-last, in the compute dtype `dtype` (operands in
    it, accumulated in float32 and rounded to it; plain float32 for None)."""
    if dtype is None:
        return jax.lax.conv_general_dilated(
            x, kernel, stride, tuple(padding), lhs_dilation, dimension_numbers=_DIMENSIONS
        )
    out = jax.lax.conv_general_dilated(
        x.astype(dtype), kernel.astype(dtype), stride, tuple(padding), lhs_dilation,
        dimension_numbers=_DIMENSIONS, preferred_element_type=jnp.float32,
    )
    return out.astype(dtype)


def conv2d_input_error(
    kernel: jax.Array, error: jax.Array, shape: ImageShape, stride: Pair, geometry: Geometry,
    dtype: Any = None,
) -> jax.Array:
    """$\\partial L/\\partial x$ of $y = x \\star K$: the transposed convolution of `error`.

    With $y_{a,b,o} = \\sum_{i,j,c} \\tilde x_{s_h a + i,\\, s_w b + j,\\, c} K_{i,j,c,o}$ and
    $\\tilde E$ the error `(N, H', W', C_out)` dilated by the stride ($\\tilde E_{s_h a, s_w b} =
    E_{a,b}$, zeros between),

    $$\\frac{\\partial L}{\\partial \\tilde x_{u,v,c}} = \\sum_{i,j,o}
    \\tilde E_{u - i,\\, v - j,\\, o} K_{i,j,c,o},$$

    a full correlation of $\\tilde E$ with the kernel flipped in space and transposed in its
    channels, $K'_{i,j,o,c} = K_{k_h-1-i,\\, k_w-1-j,\\, c,\\, o}$: one
    `conv_general_dilated` with `lhs_dilation` = stride and $k - 1$ zeros of padding on each
    side (plus the rows of $\\tilde x$ that no window reached). Cropping the input's padding
    off gives $\\partial L/\\partial x$ `(N, H, W, C_in)`.
    """
    kh, kw = kernel.shape[:2]
    flipped = jnp.swapaxes(jnp.flip(kernel, (0, 1)), 2, 3)
    out = error.shape[1:3]
    extra = tuple(
        geometry.padded[a] - ((out[a] - 1) * stride[a] + (kh, kw)[a]) for a in range(2)
    )
    full = _convolve(
        to_compute(error, dtype), flipped, (1, 1),
        ((kh - 1, kh - 1 + extra[0]), (kw - 1, kw - 1 + extra[1])), lhs_dilation=stride,
        dtype=dtype,
    )
    return crop_images(full, geometry.pads, (shape.height, shape.width))


@functools.cache
def _conv2d_formulas(stride: Pair, padding: Padding):
    # One function pair per (stride, padding), so that equal convolutions have equal (static)
    # structure and stack in a `Repeat`; the kernel's own shape is read at trace time.
    def forward(params: ConvParams, x, ctx: StepContext):
        kernel = params.kernel
        images = as_images("conv2d", x, kernel.shape[2])
        shape = ImageShape(*images.shape[1:])
        geometry = conv_geometry("conv2d", images.shape[1:3], kernel.shape[:2], stride, padding)
        y = _convolve(ctx.to_compute(images), kernel, stride, geometry.pads,
                      dtype=ctx.compute_dtype)
        if params.bias is not None:
            y = y + ctx.to_compute(params.bias)
        return jnp.reshape(y, (*jnp.shape(x)[:-3], *y.shape[1:])), shape

    def backward(params: ConvParams, shape: ImageShape, error, ctx: StepContext):
        kernel = params.kernel
        rows = jnp.reshape(error, (-1, *error.shape[-3:]))
        geometry = conv_geometry(
            "conv2d", (shape.height, shape.width), kernel.shape[:2], stride, padding
        )
        input_error = conv2d_input_error(kernel, rows, shape, stride, geometry,
                                         ctx.compute_dtype)
        return jnp.reshape(input_error, (*error.shape[:-3], *input_error.shape[1:]))

    forward.__name__ = "conv2d"
    return forward, backward


def eqx_conv_arrays(
    conv: eqx.nn.Conv2d, where: str
) -> tuple[jax.Array, jax.Array | None, Pair, Padding]:
    """Kernel (HWIO), bias `(C_out,)`, stride and padding of an `eqx.nn.Conv2d`; dilation,
    groups and padding modes other than zeros are refused."""
    if conv.num_spatial_dims != 2:
        raise ValueError(f"{where}: expected a 2-D convolution, got {conv.num_spatial_dims}-D.")
    if tuple(conv.dilation) != (1, 1):
        raise ValueError(f"{where}: dilation must be 1, got {tuple(conv.dilation)}.")
    if conv.groups != 1:
        raise ValueError(f"{where}: groups must be 1, got {conv.groups}.")
    if conv.padding_mode != "ZEROS":
        raise ValueError(
            f"{where}: only zero padding (padding_mode='ZEROS'), got {conv.padding_mode!r}."
        )
    kernel = jnp.transpose(conv.weight, (2, 3, 1, 0))
    bias = None if conv.bias is None else jnp.reshape(conv.bias, (-1,))
    stride = as_pair(tuple(conv.stride), "stride", where)
    return kernel, bias, stride, as_padding(conv.padding, where)


def check_kernel(where: str, kernel: Any, bias: Any) -> tuple[jax.Array, jax.Array | None]:
    """A kernel `(kh, kw, C_in, C_out)` and a bias `(C_out,)` or None, as arrays."""
    kernel = jnp.asarray(kernel)
    if kernel.ndim != 4:
        raise ValueError(
            f"{where}: kernel must have shape (kh, kw, in_channels, out_channels) (channels "
            f"last, HWIO), got shape {tuple(kernel.shape)}."
        )
    if bias is not None:
        bias = jnp.asarray(bias)
        if tuple(bias.shape) != (kernel.shape[3],):
            raise ValueError(
                f"{where}: bias must have shape ({kernel.shape[3]},), got {tuple(bias.shape)}."
            )
    return kernel, bias


def conv2d(
    kernel_or_conv: eqx.nn.Conv2d | jax.Array,
    bias: jax.Array | None = None,
    *,
    stride: int | Pair | None = None,
    padding: str | int | tuple[Pair, Pair] | None = None,
) -> Frozen:
    """A frozen 2-D convolution $y = x \\star K + b$ on channels-last images.

    $$y_{n,a,b,o} = \\sum_{i,j,c} \\tilde x_{n,\\, s_h a + i,\\, s_w b + j,\\, c}\\,
    K_{i,j,c,o} + b_o$$

    ($\\tilde x$ the zero-padded input). Backward: $\\partial L/\\partial x$ is the transposed
    convolution of the error (`conv2d_input_error`); the kernel and bias pass nothing back.

    Args:
        kernel_or_conv: a kernel `(kh, kw, C_in, C_out)` (HWIO), or an `eqx.nn.Conv2d`, whose
            channels-first weight `(C_out, C_in, kh, kw)` is transposed to that layout and
            whose bias `(C_out, 1, 1)` is flattened; its stride and padding are used (only
            dilation 1, one group and zero padding).
        bias: `(C_out,)` or None (arrays only; a module brings its own).
        stride: a positive integer or `(along height, along width)`; default 1.
        padding: `"SAME"` (default), `"SAME_LOWER"`, `"VALID"`, an integer or
            `((lo_h, hi_h), (lo_w, hi_w))` (see the module docstring).

    Input `(*rows, H, W, C_in)`, output `(*rows, H', W', C_out)`. Its parameters are a
    `ConvParams(kernel, bias)`, which is also what it exports.
    """
    where = "conv2d"
    if isinstance(kernel_or_conv, eqx.nn.Conv2d):
        if bias is not None or stride is not None or padding is not None:
            raise TypeError(
                f"{where}: given an eqx.nn.Conv2d, the bias, stride and padding are the "
                "module's; pass none of them (or pass its arrays instead)."
            )
        kernel, bias, stride_pair, padding_norm = eqx_conv_arrays(kernel_or_conv, where)
    else:
        kernel, bias = check_kernel(where, kernel_or_conv, bias)
        stride_pair = as_pair(1 if stride is None else stride, "stride", where)
        padding_norm = as_padding("SAME" if padding is None else padding, where)
    forward, backward = _conv2d_formulas(stride_pair, padding_norm)
    return Frozen(
        forward, backward, ConvParams(kernel, bias), in_width=int(kernel.shape[2]),
        name="conv2d",
    )


@functools.cache
def _max_pool_formulas(window: Pair, stride: Pair):
    def forward(params, x):
        del params
        images = as_images("max_pool", x)
        shape = ImageShape(*images.shape[1:])
        geometry = conv_geometry("max_pool", images.shape[1:3], window, stride, "VALID")
        stacked = jnp.stack(window_slices(images, window, stride, geometry.out), axis=3)
        winner = jnp.argmax(stacked, axis=3).astype(jnp.int32)  # the first maximum on ties
        y = jnp.take_along_axis(stacked, winner[:, :, :, None, :], axis=3)[:, :, :, 0, :]
        return jnp.reshape(y, (*jnp.shape(x)[:-3], *y.shape[1:])), MaxPoolCache(winner, shape)

    def backward(params, cache: MaxPoolCache, error):
        del params
        rows = jnp.reshape(error, (-1, *error.shape[-3:]))
        size = (cache.shape.height, cache.shape.width)
        offsets = window[0] * window[1]
        routed = jax.nn.one_hot(cache.winner, offsets, axis=3, dtype=rows.dtype)
        routed = routed * rows[:, :, :, None, :]
        pieces = [routed[:, :, :, i, :] for i in range(offsets)]
        input_error = windows_adjoint(pieces, size, window, stride)
        return jnp.reshape(input_error, (*error.shape[:-3], *input_error.shape[1:]))

    forward.__name__ = "max_pool"
    return forward, backward


def max_pool(window: int | Pair = 2, stride: int | Pair | None = None) -> Frozen:
    """Max pooling over `window` (VALID: windows that fit inside the image), moved by
    `stride` (default: the window, no overlap).

    $y_{n,a,b,c} = \\max_{i,j} x_{n,\\, s_h a + i,\\, s_w b + j,\\, c}$. Backward: each window's
    error goes to its arg-max, $\\partial L/\\partial x_{n,u,v,c} = \\sum_{(a,b):\\, w_{abc} =
    (u,v)} E_{n,a,b,c}$ (overlapping windows add). **Ties** go to the first maximum in
    row-major window order (smallest $i$, then smallest $j$): the forward selects that very
    entry, so `jax.vjp` of the forward agrees even on ties (a plain `jnp.max` splits a tie
    evenly instead). Input `(*rows, H, W, C)`, output `(*rows, H', W', C)`.
    """
    window_pair = as_pair(window, "window", "max_pool")
    stride_pair = window_pair if stride is None else as_pair(stride, "stride", "max_pool")
    forward, backward = _max_pool_formulas(window_pair, stride_pair)
    return Frozen(forward, backward, None, name="max_pool")


@functools.cache
def _avg_pool_formulas(window: Pair, stride: Pair):
    count = window[0] * window[1]

    def forward(params, x):
        del params
        images = as_images("avg_pool", x)
        shape = ImageShape(*images.shape[1:])
        conv_geometry("avg_pool", images.shape[1:3], window, stride, "VALID")
        zero = np.zeros((), images.dtype)  # concrete: lax takes it as the sum monoid
        summed = jax.lax.reduce_window(
            images, zero, jax.lax.add, (1, *window, 1), (1, *stride, 1), "VALID"
        )
        y = summed / count
        return jnp.reshape(y, (*jnp.shape(x)[:-3], *y.shape[1:])), shape

    def backward(params, shape: ImageShape, error):
        del params
        rows = jnp.reshape(error, (-1, *error.shape[-3:])) / count
        size = (shape.height, shape.width)
        input_error = windows_adjoint([rows] * count, size, window, stride)
        return jnp.reshape(input_error, (*error.shape[:-3], *input_error.shape[1:]))

    forward.__name__ = "avg_pool"
    return forward, backward


def avg_pool(window: int | Pair = 2, stride: int | Pair | None = None) -> Frozen:
    """Average pooling over `window` (VALID), moved by `stride` (default: the window).

    $y_{n,a,b,c} = \\tfrac{1}{k_h k_w} \\sum_{i,j} x_{n,\\, s_h a + i,\\, s_w b + j,\\, c}$.
    Backward: every entry of a window receives $E_{n,a,b,c} / (k_h k_w)$ (overlapping windows
    add). Input `(*rows, H, W, C)`, output `(*rows, H', W', C)`.
    """
    window_pair = as_pair(window, "window", "avg_pool")
    stride_pair = window_pair if stride is None else as_pair(stride, "stride", "avg_pool")
    forward, backward = _avg_pool_formulas(window_pair, stride_pair)
    return Frozen(forward, backward, None, name="avg_pool")


def _flatten_forward(params, x):
    del params
    images = as_images("flatten", x)
    shape = ImageShape(*images.shape[1:])
    lead = jnp.shape(x)[:-3]
    return jnp.reshape(x, (*lead, math.prod(jnp.shape(x)[-3:]))), shape


def _flatten_backward(params, shape: ImageShape, error):
    del params
    return jnp.reshape(error, (*error.shape[:-1], shape.height, shape.width, shape.channels))


def flatten() -> Frozen:
    """`(*rows, H, W, C)` to `(*rows, H W C)`, row-major (index $(u W + v) C + c$, as
    `x.reshape(B, -1)`). Backward: the error reshaped back to `(*rows, H, W, C)`."""
    return Frozen(_flatten_forward, _flatten_backward, None, name="flatten")
