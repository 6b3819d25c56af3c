"""A checkpoint's leaves as arrays: what the manifest records of a leaf (shape, dtype, a PRNG
key's impl), its values as little-endian host bytes and back, and the blocks of a leaf split
across processes."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.execution._checkpoint_format import CheckpointError


def _is_key(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _as_array(leaf: Any) -> Any:
    """Arrays stay as they are; a Python scalar becomes the array the executor would see."""
    if isinstance(leaf, jax.Array | np.ndarray | np.generic):
        return leaf
    return jnp.asarray(leaf)


def _describe(leaf: Any) -> tuple[list[int], str]:
    """`(shape, dtype name)` of a leaf as the manifest records it (keys: `key<impl>`)."""
    leaf = _as_array(leaf)
    return [int(d) for d in np.shape(leaf)], str(leaf.dtype)


def _spell(shape: list[int], dtype: str) -> str:
    return f"{dtype}[{', '.join(str(d) for d in shape)}]"


def _little_endian(values: Any) -> np.ndarray:
    host = np.ascontiguousarray(np.asarray(jax.device_get(values)))
    if host.dtype.byteorder == ">":
        host = host.astype(host.dtype.newbyteorder("<"))
    return host


def _key_data(leaf: Any) -> tuple[Any, str | None]:
    """A key leaf as its `key_data` and its impl name; any other leaf as it is and None."""
    leaf = _as_array(leaf)
    if _is_key(leaf):
        return jax.random.key_data(leaf), str(jax.random.key_impl(leaf))
    return leaf, None


def _to_host(leaf: Any) -> tuple[np.ndarray, str | None]:
    """The leaf's values as a little-endian, C-contiguous NumPy array, and its key impl name
    (the leaf is held whole by this process, or replicated over every process)."""
    leaf, impl = _key_data(leaf)
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        leaf = leaf.addressable_data(0)
    return _little_endian(leaf), impl


def _split_across_processes(leaf: Any) -> bool:
    """Whether no single process can read the whole leaf (it needs shard files)."""
    return (
        isinstance(leaf, jax.Array)
        and not leaf.is_fully_addressable
        and not leaf.is_fully_replicated
    )


Block = tuple[tuple[int, int], ...]  # [start, stop) along every axis


def _block(index: tuple, shape: tuple[int, ...]) -> Block:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))


def _layout(data: jax.Array) -> list[tuple[Block, Any]]:
    """Every distinct block of a global array, in order, with the device that saves it: the
    lowest device id holding the block."""
    owners: dict[Block, Any] = {}  # block -> jax.Device
    placed: Mapping[Any, Any] = data.sharding.devices_indices_map(tuple(data.shape))
    for device, index in placed.items():
        block = _block(index, tuple(data.shape))
        if block not in owners or device.id < owners[block].id:
            owners[block] = device
    return sorted(owners.items(), key=lambda item: item[0])


def _normalised_treedef(tree: Any) -> str:
    """The treedef as text, without memory addresses (so that it is stable across processes)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(jax.tree_util.tree_structure(tree)))


def _decode(
    data: bytes, record: dict, shape: list[int], where: str, fail: Callable[[str], CheckpointError]
) -> np.ndarray:
    """Stored bytes as a NumPy array of `shape` in the record's (data) dtype, native order."""
    try:
        name = record["data_dtype"] if record.get("key_impl") is not None else record["dtype"]
        dtype = np.dtype(jnp.dtype(name))
        values = np.frombuffer(data, dtype=dtype.newbyteorder("<")).reshape(shape)
    except (KeyError, TypeError, ValueError) as err:
        raise fail(f"{where}: cannot rebuild its array ({err})") from None
    return values.astype(dtype, copy=True)  # native byte order, writable, own memory


def _data_shape(record: dict) -> list[int]:
    return record["data_shape"] if record.get("key_impl") is not None else record["shape"]


def _wrap(values: Any, record: dict) -> Any:
    impl = record.get("key_impl")
    if impl is not None:
        return jax.random.wrap_key_data(jnp.asarray(values), impl=impl)
    return values
