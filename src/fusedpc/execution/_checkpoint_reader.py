"""Reading a checkpoint's leaves: each leaf whole from the container, or each process's part
of a leaf split across processes from the shard files (opened when first needed), every entry
checked against the manifest."""

from __future__ import annotations

import contextlib
import os
import zipfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.execution._checkpoint_format import CheckpointError
from fusedpc.execution._checkpoint_leaves import Block, _block, _data_shape, _decode, _wrap
from fusedpc.execution._checkpoint_zip import (
    _READ_ERRORS,
    _read_checked,
    _read_leaf,
    _read_values,
)


class _Reader:
    """A checkpoint's leaves, or any block of them, read from its container and its shard
    files (opened when first needed), every entry checked against the manifest."""

    def __init__(self, path: str, zf: zipfile.ZipFile, manifest: dict, stack: contextlib.ExitStack):
        self.path, self.zf, self.stack = path, zf, stack
        info = manifest.get("shard_files") or {}
        directory = os.path.dirname(os.path.abspath(path))
        self.folder = os.path.join(directory, info.get("folder", ""))
        self.files: dict[str, zipfile.ZipFile] = {}
        self.cache: dict[tuple[str, int], np.ndarray] = {}  # the current leaf's blocks

    def _file(self, name: str, where: str) -> tuple[zipfile.ZipFile, str]:
        location = os.path.join(self.folder, name)
        if name not in self.files:
            try:
                file = self.stack.enter_context(open(location, "rb"))
            except FileNotFoundError:
                raise CheckpointError(
                    f"checkpoint {self.path!r}: its shard file {location!r}, which holds "
                    f"{where}, does not exist; it cannot be loaded. Keep the folder "
                    f"{os.path.basename(self.folder)!r} beside the checkpoint (copy or move "
                    "them together), or use an earlier checkpoint."
                ) from None
            try:
                self.files[name] = self.stack.enter_context(zipfile.ZipFile(file, "r"))
            except _READ_ERRORS as err:
                detail = f"{where}: not a readable zip container: {err}"
                raise self._corrupted(location, detail) from None
        return self.files[name], location

    def _corrupted(self, location: str, detail: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {self.path!r}: its shard file {location!r} is corrupted or truncated "
            f"({detail}); it cannot be loaded. Use an earlier checkpoint, or save a new one."
        )

    def block(self, record: dict, number: int) -> np.ndarray:
        """The `number`-th stored block of a split leaf."""
        cached = self.cache.get((record["path"], number))
        if cached is not None:
            return cached
        shard = record["shards"][number]
        block = ", ".join(f"{a}:{b}" for a, b in shard["index"])
        where = f"leaf {record['path']} block [{block}] (entry {shard['entry']})"
        zf, location = self._file(shard["file"], where)
        fail = lambda detail: self._corrupted(location, detail)  # noqa: E731
        data = _read_checked(zf, shard, where, fail)
        values = _decode(data, record, [b - a for a, b in shard["index"]], where, fail)
        self.cache[(record["path"], number)] = values
        return values

    def region(self, record: dict, wanted: Block) -> np.ndarray:
        """The values of a leaf (a key leaf's key_data) inside `wanted`."""
        if "shards" not in record:
            whole = self.cache.get((record["path"], -1))
            if whole is None:
                whole = self.cache[(record["path"], -1)] = _read_values(self.zf, self.path, record)
            return np.asarray(whole[tuple(slice(a, b) for a, b in wanted)])  # 0-d: an array
        out: np.ndarray | None = None
        for number, shard in enumerate(record["shards"]):
            block = tuple(tuple(bounds) for bounds in shard["index"])
            lo = [max(a, c) for (a, _), (c, _) in zip(wanted, block, strict=True)]
            hi = [min(b, d) for (_, b), (_, d) in zip(wanted, block, strict=True)]
            if any(x >= y for x, y in zip(lo, hi, strict=True)):
                continue
            values = self.block(record, number)
            if block == wanted:
                return values
            if out is None:
                out = np.empty([b - a for a, b in wanted], values.dtype)
            into = tuple(slice(x - a, y - a) for x, y, (a, _) in zip(lo, hi, wanted, strict=True))
            take = tuple(slice(x - c, y - c) for x, y, (c, _) in zip(lo, hi, block, strict=True))
            out[into] = values[take]
        if out is None:  # an empty region
            name = record["data_dtype"] if record.get("key_impl") is not None else record["dtype"]
            out = np.empty([b - a for a, b in wanted], np.dtype(jnp.dtype(name)))
        return out

    def leaf(self, record: dict, current: Any) -> Any:
        """The leaf of `record`, placed like `current` when no process holds all of `current`
        (each process then reads only the blocks its devices hold), else a host array."""
        self.cache.clear()
        shape = tuple(_data_shape(record))
        if not (isinstance(current, jax.Array) and not current.is_fully_addressable):
            if "shards" not in record:
                return _read_leaf(self.zf, self.path, record)
            return _wrap(self.region(record, tuple((0, d) for d in shape)), record)
        sharding = current.sharding
        if record.get("key_impl") is not None:
            sharding = _key_data_sharding(current)
        values = jax.make_array_from_callback(
            shape, sharding, lambda index: self.region(record, _block(index or (), shape))
        )
        return _wrap(values, record)

    def verify(self, record: dict) -> None:
        if "shards" not in record:
            _read_leaf(self.zf, self.path, record)
        for number in range(len(record.get("shards", ()))):
            self.block(record, number)
        self.cache.clear()


def _key_data_sharding(current: jax.Array) -> jax.sharding.Sharding:
    """The sharding of a key array's `key_data` (the trailing key axis whole)."""
    sharding = current.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise CheckpointError(
            f"load_checkpoint: a PRNG key leaf placed with {type(sharding).__name__} across "
            "processes cannot be rebuilt; place key leaves with a NamedSharding."
        )
    spec = tuple(sharding.spec) + (None,) * (current.ndim - len(sharding.spec))
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec, None))
