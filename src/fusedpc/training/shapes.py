"""A small synthetic image set made by the code: white shapes on a dark, noisy background.

No download and no files: `make_shapes(n, size, seed=...)` draws `n` grey-scale images of
`size x size` pixels, one shape each, at a random centre and scale, plus gaussian pixel noise.
The same arguments give the same images on every machine (numpy's PCG64 generator). It is
meant for tests and walkthroughs of convolutional parts (`fusedpc.LearningConv2d`,
`fusedpc.parts.conv`), small enough to train on a CPU in seconds.

Shapes (centre $(c_x, c_y)$, half-size $r$, pixel offsets $u = x - c_x$, $v = y - c_y$):

| name | pixels lit |
| --- | --- |
| `square` | the outline of the square $\\max(|u|, |v|) \\le r$, one pixel wide |
| `circle` | the disc $u^2 + v^2 \\le r^2$ |
| `cross` | the plus sign $\\min(|u|, |v|) \\le r/4$ and $\\max(|u|, |v|) \\le r$ |
| `triangle` | the filled triangle with apex up, $v \\ge -r$, $|u| \\le (v + r)/2$, $v \\le r$ |
| `diamond` | the filled diamond $|u| + |v| \\le r$ |
| `bar` | a horizontal bar $|v| \\le r/4$, $|u| \\le r$ |
"""

from __future__ import annotations

import numpy as np

__all__ = ["SHAPES", "make_shapes"]

SHAPES = ("square", "circle", "cross", "triangle", "diamond", "bar")
"""The shape names `make_shapes` can draw, in the order of their default class ids."""


def _lit(name: str, u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    big, small = np.maximum(np.abs(u), np.abs(v)), np.minimum(np.abs(u), np.abs(v))
    if name == "square":
        return (big <= r) & (big >= r - 1.0)
    if name == "circle":
        return u * u + v * v <= r * r
    if name == "cross":
        return (small <= np.maximum(r / 4, 0.5)) & (big <= r)
    if name == "triangle":
        return (v >= -r) & (v <= r) & (np.abs(u) <= (v + r) / 2)
    if name == "diamond":
        return np.abs(u) + np.abs(v) <= r
    return (np.abs(v) <= np.maximum(r / 4, 0.5)) & (np.abs(u) <= r)  # bar


def make_shapes(
    n: int,
    size: int = 16,
    *,
    seed: int,
    classes: tuple[str, ...] = ("square", "circle", "cross", "triangle"),
    noise: float = 0.1,
) -> tuple[np.ndarray, np.ndarray]:
    """`n` images of one shape each and their class ids.

    Args:
        n: the number of images (>= 1). Classes are balanced: image $i$ before shuffling is
            class $i \\bmod$ `len(classes)`; the order is then shuffled.
        size: height and width in pixels (>= 6).
        seed: the integer seed (required: the set is reproducible by construction).
        classes: names from `SHAPES`, distinct; class id $j$ is `classes[j]`.
        noise: the standard deviation of the gaussian pixel noise (>= 0).

    Each shape has a half-size $r \\sim U(0.2, 0.4) \\cdot$ `size` and a centre drawn so that it
    stays inside the image; lit pixels are 1, the rest 0, then the noise is added.

    Returns:
        `images` `(n, size, size, 1)` float32 (channels last, ready for `fusedpc.parts.conv`)
        and `labels` `(n,)` int32.
    """
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"make_shapes: n must be a positive integer, got {n!r}.")
    if not (isinstance(size, int) and size >= 6):
        raise ValueError(f"make_shapes: size must be an integer >= 6, got {size!r}.")
    classes = tuple(classes)
    unknown = [c for c in classes if c not in SHAPES]
    if not classes or unknown or len(set(classes)) != len(classes):
        raise ValueError(
            f"make_shapes: classes must be distinct names from {SHAPES}, got {classes!r}."
        )
    if not noise >= 0:
        raise ValueError(f"make_shapes: noise must be >= 0, got {noise!r}.")
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % len(classes)).astype(np.int32)
    r = rng.uniform(0.2, 0.4, n) * size
    low, high = r, size - 1 - r
    cx = low + rng.uniform(0.0, 1.0, n) * (high - low)
    cy = low + rng.uniform(0.0, 1.0, n) * (high - low)
    grid = np.arange(size, dtype=np.float64)
    u = grid[None, None, :] - cx[:, None, None]  # (n, 1, size): along the width
    v = grid[None, :, None] - cy[:, None, None]  # (n, size, 1): along the height
    u, v = np.broadcast_arrays(u, v)
    radius = np.broadcast_to(r[:, None, None], u.shape)
    images = np.zeros((n, size, size), np.float64)
    for j, name in enumerate(classes):
        chosen = labels == j
        images[chosen] = _lit(name, u[chosen], v[chosen], radius[chosen])
    images += noise * rng.standard_normal(images.shape)
    return images[..., None].astype(np.float32), labels
