"""A pytree kept as a few arrays, one per dtype, and rebuilt when read.

The step's reports (every part's norms and flags, a flag per state leaf) are a hundred or
more small values. Written out of the compiled step one by one, each is a kernel XLA
compiles (about 6 ms each on a CPU); packed, they leave it as one vector per dtype. The
tree is rebuilt from those vectors, on the host or on the device, when it is read.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core._part import PyTree


def _packable(leaf: Any) -> bool:
    if not isinstance(leaf, jax.Array | np.ndarray | np.generic | bool | int | float):
        return False
    dtype = jnp.result_type(leaf)
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


class Packed(eqx.Module):
    """`tree` stored as one flat vector per dtype (`vectors`), the leaves that are not
    numbers (PRNG keys, say) kept as they are (`others`); `unpack()` gives the tree back.

    The vectors may carry leading axes the tree's leaves did not have (stacked over `run`'s
    K steps, or indexed by `jax.tree_util.tree_map(lambda a: a[i], ...)`): `unpack()` puts
    them in front of every leaf's own shape, as a stacked tree would have them."""

    vectors: tuple[Any, ...]
    others: tuple[Any, ...]
    structure: Any = eqx.field(static=True)
    # per leaf: (vector index, offset, shape), or (-1, position in `others`, ())
    layout: tuple[tuple[int, int, tuple[int, ...]], ...] = eqx.field(static=True)
    dtypes: tuple[str, ...] = eqx.field(static=True)

    @classmethod
    def of(cls, tree: PyTree) -> Packed:
        """Pack `tree`: its number leaves, flattened, concatenated by dtype."""
        leaves, structure = jax.tree_util.tree_flatten(tree)
        groups: dict[str, list[Any]] = {}
        sizes: dict[str, int] = {}
        others: list[Any] = []
        layout: list[tuple[int, int, tuple[int, ...]]] = []
        for leaf in leaves:
            if not _packable(leaf):
                layout.append((-1, len(others), ()))
                others.append(leaf)
                continue
            dtype = str(jnp.result_type(leaf))
            shape = tuple(int(d) for d in np.shape(leaf))
            if dtype not in groups:
                groups[dtype], sizes[dtype] = [], 0
            layout.append((list(groups).index(dtype), sizes[dtype], shape))
            groups[dtype].append(jnp.reshape(jnp.asarray(leaf), (-1,)))
            sizes[dtype] += int(np.prod(shape, dtype=np.int64))
        vectors = tuple(
            parts[0] if len(parts) == 1 else jnp.concatenate(parts) for parts in groups.values()
        )
        return cls(vectors, tuple(others), structure, tuple(layout), tuple(groups))

    def unpack(self) -> PyTree:
        """The tree, every packed leaf a slice of its vector (NumPy in, NumPy out; shapes
        in, from `jax.eval_shape`, shapes out)."""
        leaves = []
        for group, offset, shape in self.layout:
            if group < 0:
                leaves.append(self.others[offset])
                continue
            vector = self.vectors[group]
            lead = tuple(np.shape(vector)[:-1])
            if isinstance(vector, jax.ShapeDtypeStruct):  # from `jax.eval_shape`
                leaves.append(jax.ShapeDtypeStruct(lead + shape, vector.dtype))
                continue
            size = int(np.prod(shape, dtype=np.int64))
            piece = vector[..., offset:offset + size]
            leaves.append(piece.reshape(lead + shape))
        return jax.tree_util.tree_unflatten(self.structure, leaves)
