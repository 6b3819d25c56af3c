"""Shard files: the blocks of leaves split across the processes of a multi-process run, each
process writing the blocks it holds to its own zip file in `<checkpoint>.shards/`, and the
collectives by which the processes agree on the save and learn of each other's failures."""

from __future__ import annotations

import contextlib
import os
import secrets
import zipfile
import zlib
from typing import Any, BinaryIO, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from fusedpc.execution._checkpoint_format import _SHARD_FILE
from fusedpc.execution._checkpoint_leaves import (
    Block,
    _describe,
    _key_data,
    _layout,
    _little_endian,
)
from fusedpc.execution._checkpoint_zip import _write_entry


class _Split(NamedTuple):
    """A leaf split across processes, as the manifest records it and as it is saved."""

    number: int  # its position in the state's leaves
    record: dict  # path, shape, dtype (and a key's impl, data shape and dtype)
    data: jax.Array  # the values (a key leaf's key_data)
    layout: list[tuple[Block, Any]]  # every distinct block and the device that saves it


def _plan(split: list[tuple[int, str, Any]]) -> list[_Split]:
    plans = []
    for number, key_path, leaf in split:
        shape, dtype = _describe(leaf)
        data, impl = _key_data(leaf)
        record: dict[str, Any] = {"path": key_path, "shape": shape, "dtype": dtype}
        if impl is not None:
            record.update(
                key_impl=impl, data_shape=[int(d) for d in data.shape], data_dtype=str(data.dtype)
            )
        plans.append(_Split(number, record, data, _layout(data)))
    return plans


def _shard_entry(number: int, block_number: int) -> str:
    return f"leaves/{number:05d}/{block_number:05d}.bin"


def _write_shards(file: BinaryIO, plans: list[_Split], digests: np.ndarray) -> None:
    """This process's blocks into `file`; their SHA-256s into `digests` (one row per block of
    every split leaf, in order)."""
    row = 0
    with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for plan in plans:
            mine = {shard.device: shard for shard in plan.data.addressable_shards}
            for block_number, (_, owner) in enumerate(plan.layout):
                if owner in mine:
                    host = _little_endian(mine[owner].data)
                    digest = _write_entry(zf, _shard_entry(plan.number, block_number), host)
                    digests[row] = np.frombuffer(bytes.fromhex(digest), np.uint8)
                row += 1


def _agree(value: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every process's `value`, stacked along a leading process axis (a collective)."""
    gathered = multihost_utils.process_allgather(value)
    return {name: np.asarray(array) for name, array in gathered.items()}


def _failed_elsewhere(what: str, failed: list[int], path: str) -> OSError:
    return OSError(
        f"save_checkpoint: process(es) {failed} could not {what} for {path!r} (their own error "
        "says why); the previous checkpoint, if any, is left as it was."
    )


def _agree_on_save_id(path: str) -> str:
    """One id for this save (process 0's), and the same checkpoint path in every process (a
    collective)."""
    where = zlib.crc32(os.path.normpath(path).encode("utf-8")).to_bytes(4, "little")
    token = np.frombuffer(secrets.token_bytes(8) + where, np.uint8)
    tokens = _agree({"token": token})["token"]
    if (tokens[:, 8:] != tokens[0, 8:]).any():
        raise ValueError(
            f"save_checkpoint: the processes were given different paths (this one {path!r}); "
            "state split across processes is saved by every process to the same path."
        )
    return tokens[0, :8].tobytes().hex()


def _shard_records(
    plans: list[_Split], names: dict[int, str], digests: np.ndarray
) -> dict[int, dict]:
    """The manifest's record of every split leaf, by its position in the state's leaves: where
    each block is stored and its SHA-256 (`digests`: every process's rows, stacked)."""
    records: dict[int, dict] = {}
    row = 0
    for plan in plans:
        shards = []
        for block_number, (block, owner) in enumerate(plan.layout):
            k = owner.process_index
            itemsize = np.dtype(plan.data.dtype).itemsize
            shards.append({
                "index": [list(bounds) for bounds in block],
                "file": names[k],
                "entry": _shard_entry(plan.number, block_number),
                "nbytes": int(np.prod([b - a for a, b in block])) * itemsize,
                "sha256": digests[k, row].tobytes().hex(),
            })
            row += 1
        records[plan.number] = {**plan.record, "shards": shards}
    return records


def _remove_stale_shards(folder: str, keep: frozenset[str] = frozenset()) -> None:
    """Remove the shard files of earlier saves from `folder` (and the folder once empty)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if _SHARD_FILE.fullmatch(name) and name not in keep:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
    if not keep:
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _discard(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)
