"""The zip container: a checkpoint's entries written stored (uncompressed), with fixed
timestamps and attributes so that the same state gives the same bytes, and read back with
every entry's size and SHA-256 checked against the manifest."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import jax
import numpy as np

from fusedpc._version import __version__
from fusedpc.execution._checkpoint_format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_ENTRY,
    SINGLE_FILE_VERSION,
    Checkpointable,
    CheckpointError,
    _corrupted,
)
from fusedpc.execution._checkpoint_leaves import (
    _data_shape,
    _decode,
    _describe,
    _normalised_treedef,
    _to_host,
    _wrap,
)
from fusedpc.execution._checkpoint_manifest import _check_manifest, _guard_record

_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip can record: no wall clock


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray | jax.Array) and np.ndim(value) == 0:
        return np.asarray(value).item()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serialisable")


def _dump_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, indent=1, default=_json_default).encode("utf-8")


def _zip_info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_ZIP_EPOCH)
    info.compress_type = zipfile.ZIP_STORED
    info.create_system = 3  # Unix, whatever the platform: identical bytes everywhere
    info.external_attr = 0o100644 << 16
    return info


def _write_container(
    file: BinaryIO,
    pipeline: Checkpointable,
    metadata: Any,
    split: dict[int, dict] | None = None,
    shard_files: dict | None = None,
) -> None:
    """Write every leaf, then the manifest (which carries the leaves' checksums). The leaves
    numbered in `split` are in shard files: their records are given, no entry is written."""
    state = pipeline.state
    leaves = jax.tree_util.tree_leaves_with_path(state)
    split = split or {}
    records = []
    with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for index, (path, leaf) in enumerate(leaves):
            if index in split:
                records.append(split[index])
                continue
            shape, dtype = _describe(leaf)
            host, impl = _to_host(leaf)
            entry = f"leaves/{index:05d}.bin"
            record = {
                "path": jax.tree_util.keystr(path),
                "shape": shape,
                "dtype": dtype,
                "entry": entry,
                "nbytes": int(host.nbytes),
                "sha256": _write_entry(zf, entry, host),
            }
            if impl is not None:
                record.update(
                    key_impl=impl,
                    data_shape=[int(d) for d in host.shape],
                    data_dtype=str(host.dtype),
                )
            records.append(record)
        manifest = {
            "format": FORMAT_NAME,
            "format_version": SINGLE_FILE_VERSION if shard_files is None else FORMAT_VERSION,
            "library_version": __version__,
            "jax_version": jax.__version__,
            "byteorder": "little",
            "steps": int(pipeline.steps),
            "skipped_steps": int(pipeline.skipped_steps),
            "guard": _guard_record(pipeline.counters),
            "treedef": _normalised_treedef(state),
            "leaves": records,
            "metadata": metadata,
        }
        if shard_files is not None:
            manifest["shard_files"] = shard_files
        zf.writestr(_zip_info(MANIFEST_ENTRY), _dump_json(manifest))


def _write_entry(zf: zipfile.ZipFile, entry: str, host: np.ndarray) -> str:
    """Store `host`'s bytes as `entry`; their SHA-256 in hex."""
    # numpy's stubs give ndarray __buffer__ only from Python 3.12 on; we check 3.11
    payload = memoryview(host.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    zf.writestr(_zip_info(entry), payload)
    return hashlib.sha256(payload).hexdigest()


# Everything reading a damaged zip can raise once the file is open: a garbled offset can make a
# seek fail with an OSError, garbled flags ask for features this format never uses
# (NotImplementedError, RuntimeError for "encrypted"), garbled numbers fail to unpack.
_READ_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    EOFError,
    ValueError,
    OSError,
    NotImplementedError,
    RuntimeError,
    struct.error,
    zlib.error,
)


def _read_entry(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """An entry's bytes (zipfile checks its CRC-32); only plain stored entries are accepted."""
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
        raise zipfile.BadZipFile(
            f"entry {info.filename} is compressed or encrypted, which this format never writes"
        )
    return zf.read(info)


def _read_manifest(path: str, zf: zipfile.ZipFile) -> dict:
    try:
        raw = _read_entry(zf, zf.getinfo(MANIFEST_ENTRY))
    except KeyError:
        raise _corrupted(path, f"no {MANIFEST_ENTRY} entry") from None
    except _READ_ERRORS as err:
        raise _corrupted(path, f"{MANIFEST_ENTRY}: {err}") from None
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _corrupted(path, f"{MANIFEST_ENTRY} is not valid JSON: {err}") from None
    return _check_manifest(path, manifest)


@contextlib.contextmanager
def _open_checkpoint(path: str) -> Iterator[tuple[zipfile.ZipFile, dict]]:
    """The open container and its checked manifest."""
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, f"no checkpoint file at {path!r}", path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, f"{path!r} is a folder, not a checkpoint", path)
    with open(path, "rb") as file:  # permission errors propagate as they are
        try:
            zf = zipfile.ZipFile(file, "r")
        except _READ_ERRORS as err:
            raise _corrupted(path, f"not a readable zip container: {err}") from None
        with zf:
            yield zf, _read_manifest(path, zf)


def _read_checked(
    zf: zipfile.ZipFile, entry: dict, where: str, fail: Callable[[str], CheckpointError]
) -> bytes:
    """An entry's bytes, its size and SHA-256 checked against the manifest's `entry` record."""
    try:
        info = zf.getinfo(entry["entry"])
    except KeyError:
        raise fail(f"{where} is missing from the container") from None
    if info.file_size != entry["nbytes"]:
        raise fail(f"{where} holds {info.file_size} bytes, the manifest says {entry['nbytes']}")
    try:
        data = _read_entry(zf, info)
    except _READ_ERRORS as err:
        raise fail(f"{where}: {err}") from None
    if len(data) != entry["nbytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise fail(f"{where} does not match its SHA-256 checksum")
    return data


def _read_values(zf: zipfile.ZipFile, path: str, record: dict) -> np.ndarray:
    """A whole leaf's stored values (a key leaf's key_data), size and SHA-256 checked."""
    where = f"leaf {record['path']} (entry {record['entry']})"
    fail = lambda detail: _corrupted(path, detail)  # noqa: E731
    try:
        shape = _data_shape(record)
    except KeyError as err:
        raise _corrupted(path, f"{where}: cannot rebuild its array ({err})") from None
    return _decode(_read_checked(zf, record, where, fail), record, shape, where, fail)


def _read_leaf(zf: zipfile.ZipFile, path: str, record: dict) -> Any:
    """One whole leaf from its entry, checked; a NumPy array or a key array."""
    return _wrap(_read_values(zf, path, record), record)
