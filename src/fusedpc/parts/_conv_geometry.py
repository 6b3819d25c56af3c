"""Where the windows of a 2-D convolution or pool lie, and the patch extraction and its
adjoint: the geometry and the window helpers of `fusedpc.parts.conv` (whose docstring states
the conventions: channels-last images, the paddings, the output sizes, the windows as strided
slices and their adjoint as zero-paddings). Every name is importable from there too.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Pair = tuple[int, int]
Padding = str | tuple[Pair, Pair]
PADDINGS = ("SAME", "SAME_LOWER", "VALID")


class Geometry(NamedTuple):
    """Where the windows of a convolution or pool lie: `pads` `((p^-_h, p^+_h), (p^-_w,
    p^+_w))`, the `padded` size $(H_p, W_p)$ and the output size `out` $(H', W')$."""

    pads: tuple[Pair, Pair]
    padded: Pair
    out: Pair


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_pair(value: Any, what: str, where: str) -> Pair:
    """A positive integer or a pair of them as `(along height, along width)`."""
    try:
        pair = (value, value) if _is_count(value) else tuple(value)
    except TypeError:
        pair = ()
    if len(pair) != 2 or not all(_is_count(v) and v >= 1 for v in pair):
        raise ValueError(
            f"{where}: {what} must be a positive integer or a pair of them, got {value!r}."
        )
    return (int(pair[0]), int(pair[1]))


def as_padding(padding: Any, where: str) -> Padding:
    """`"SAME"`, `"SAME_LOWER"`, `"VALID"`, an integer $p \\ge 0$ (every side) or
    `((lo_h, hi_h), (lo_w, hi_w))` of integers $\\ge 0$, in a hashable normal form."""
    if isinstance(padding, str):
        if padding.upper() not in PADDINGS:
            raise ValueError(
                f"{where}: padding must be one of {PADDINGS}, an integer or "
                f"((lo_h, hi_h), (lo_w, hi_w)), got {padding!r}."
            )
        return padding.upper()
    if _is_count(padding):
        padding = ((padding, padding), (padding, padding))
    try:
        pairs = tuple(tuple(pair) for pair in padding)
    except TypeError:
        pairs = ()
    if not (len(pairs) == 2 and all(
        len(pair) == 2 and all(_is_count(p) and p >= 0 for p in pair) for pair in pairs
    )):
        raise ValueError(
            f"{where}: padding must be one of {PADDINGS}, an integer >= 0 or "
            f"((lo_h, hi_h), (lo_w, hi_w)) of integers >= 0, got {padding!r}."
        )
    return tuple((int(lo), int(hi)) for lo, hi in pairs)  # type: ignore[return-value]


def _axis_pads(padding: Padding, axis: int, size: int, window: int, stride: int) -> Pair:
    if padding == "VALID":
        return (0, 0)
    if isinstance(padding, str):  # SAME and SAME_LOWER
        total = max((-(-size // stride) - 1) * stride + window - size, 0)
        small = total // 2
        return (small, total - small) if padding == "SAME" else (total - small, small)
    return padding[axis]


def conv_geometry(
    where: str, size: Sequence[int], window: Sequence[int], stride: Pair, padding: Padding
) -> Geometry:
    """The padding and output size of a window `(kh, kw)` moved by `stride` over an image of
    `size` `(H, W)` (see the module docstring); a window larger than the padded image is an
    error naming `where` and the sizes."""
    pads = tuple(_axis_pads(padding, a, size[a], window[a], stride[a]) for a in range(2))
    padded = tuple(size[a] + pads[a][0] + pads[a][1] for a in range(2))
    if padded[0] < window[0] or padded[1] < window[1]:
        raise ValueError(
            f"{where}: a {window[0]}x{window[1]} window does not fit an image of height x "
            f"width {size[0]}x{size[1]} padded to {padded[0]}x{padded[1]} (padding "
            f"{padding!r}); use smaller windows, more padding or larger images."
        )
    out = tuple((padded[a] - window[a]) // stride[a] + 1 for a in range(2))
    return Geometry(pads, padded, out)  # type: ignore[arg-type]  # two entries each


def as_images(where: str, x: Any, channels: int | None = None) -> jax.Array:
    """`x` `(*rows, H, W, C)` as `(N, H, W, C)` with the row axes flattened; a rank below 4 or
    (with `channels`) another channel count is an error naming `where` and the shape."""
    shape = tuple(jnp.shape(x))
    if len(shape) < 4:
        raise ValueError(
            f"{where}: expected images of shape (batch, height, width, channels) (channels "
            f"last; more leading row axes are allowed), got shape {shape} (rank {len(shape)})."
        )
    if channels is not None and shape[-1] != channels:
        raise ValueError(
            f"{where}: expected images with {channels} channels, shape (..., height, width, "
            f"{channels}), got shape {shape}."
        )
    return jnp.reshape(x, (-1, *shape[-3:]))


def pad_images(images: jax.Array, pads: tuple[Pair, Pair]) -> jax.Array:
    """Zero-pad `(N, H, W, C)` images by `pads` along height and width."""
    (lo_h, hi_h), (lo_w, hi_w) = pads
    zero = jnp.zeros((), images.dtype)
    return jax.lax.pad(images, zero, ((0, 0, 0), (lo_h, hi_h, 0), (lo_w, hi_w, 0), (0, 0, 0)))


def crop_images(padded: jax.Array, pads: tuple[Pair, Pair], size: Pair) -> jax.Array:
    """The adjoint of `pad_images`: the `(H, W)` interior of `(N, H_p, W_p, C)`."""
    (lo_h, _), (lo_w, _) = pads
    return padded[:, lo_h:lo_h + size[0], lo_w:lo_w + size[1], :]


def window_slices(
    padded: jax.Array, window: Pair, stride: Pair, out: Pair
) -> list[jax.Array]:
    """The $k_h k_w$ strided slices $\\tilde x_{s a + i,\\, s b + j}$ of `(N, H_p, W_p, C)`, each
    `(N, H', W', C)`, in row-major window order (offset $i k_w + j$)."""
    n, _, _, c = padded.shape
    reach = ((out[0] - 1) * stride[0] + 1, (out[1] - 1) * stride[1] + 1)
    return [
        jax.lax.slice(padded, (0, i, j, 0), (n, i + reach[0], j + reach[1], c),
                      (1, stride[0], stride[1], 1))
        for i in range(window[0])
        for j in range(window[1])
    ]


def windows_adjoint(
    pieces: Sequence[jax.Array], padded: Pair, window: Pair, stride: Pair
) -> jax.Array:
    """The adjoint (col2im) of `window_slices`: $\\sum_{i,j}$ of each piece `(N, H', W', C)`
    put back where its slice came from, zeros elsewhere, `(N, H_p, W_p, C)`.

    A strided slice's adjoint is a zero-padding: $i$ zeros before, the stride's $s - 1$ zeros
    between entries, and the rest after. Entries that several windows read get the sum.
    """
    out = pieces[0].shape[1:3]
    reach = ((out[0] - 1) * stride[0] + 1, (out[1] - 1) * stride[1] + 1)
    zero = jnp.zeros((), pieces[0].dtype)
    total = None
    offsets = [(i, j) for i in range(window[0]) for j in range(window[1])]
    for (i, j), piece in zip(offsets, pieces, strict=True):
        placed = jax.lax.pad(piece, zero, (
            (0, 0, 0),
            (i, padded[0] - i - reach[0], stride[0] - 1),
            (j, padded[1] - j - reach[1], stride[1] - 1),
            (0, 0, 0),
        ))
        total = placed if total is None else total + placed
    assert total is not None  # a window has at least one offset
    return total


__all__ = [
    "PADDINGS",
    "Geometry",
    "Padding",
    "Pair",
    "as_images",
    "as_padding",
    "as_pair",
    "conv_geometry",
    "crop_images",
    "pad_images",
    "window_slices",
    "windows_adjoint",
]
