"""Checkpoints: one file per checkpoint (plus shard files for state split across processes),
written atomically, refused when it does not fit.

A checkpoint is a zip container (entries stored uncompressed, fixed timestamps) holding

* `leaves/NNNNN.bin`: the raw C-order, little-endian bytes of the state's `N`-th leaf (in
  `jax.tree_util.tree_leaves` order; PRNG key leaves are stored as their `key_data`);
* `manifest.json`: the format name and version, the library and JAX versions, the step counters,
  the state's tree structure (its treedef as text and every leaf's key path, shape, dtype and
  SHA-256), and the caller's JSON `metadata` (config, data position, ...).

A leaf split across the processes of a multi-process run (a weight over a `"model"` axis that
spans hosts) has no entry there: every process writes the blocks it holds (each distinct block
once, by the process of the lowest device id holding it) to its own zip file in the folder
`<checkpoint>.shards/`, named with this save's id, and the manifest records each block's index,
file, entry and SHA-256.

Writing goes to a temporary file in the destination folder, is flushed and `fsync`ed, then
renamed over the destination with `os.replace`: a reader sees the old checkpoint or the new one,
never a half-written file, whatever interrupts the save. With shard files, the manifest's file
is renamed into place last, once every process has written and `fsync`ed its shards, and only
then are the shard files of earlier saves removed. Loading checks the container, the manifest,
the format version, that the checkpoint's leaves are exactly the pipeline's (key path, shape,
dtype), and every leaf's (or block's) checksum before anything is written into the pipeline, so
a refused load leaves the pipeline as it was. The format is described in `docs/checkpoints.md`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from fusedpc._version import __version__
from fusedpc.execution._program import SKIP_REASONS, Counters

FORMAT_NAME = "fusedpc-checkpoint"
FORMAT_VERSION = 2  # the newest this library reads and writes
SINGLE_FILE_VERSION = 1  # a checkpoint without shard files: every release reads it
MANIFEST_ENTRY = "manifest.json"
SHARDS_SUFFIX = ".shards"
_SHARD_FILE = re.compile(r"[0-9a-f]{16}\.process-[0-9]+-of-[0-9]+\.zip")
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip can record: no wall clock


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded: corrupted, truncated, written by a newer format,
    or holding the state of a different tree. The pipeline is left untouched."""


# --------------------------------------------------------------------------- leaves
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


def _expected_leaves(state: Any) -> list[dict[str, Any]]:
    rows = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        shape, dtype = _describe(leaf)
        rows.append({"path": jax.tree_util.keystr(path), "shape": shape, "dtype": dtype})
    return rows


# --------------------------------------------------------------------------- writing
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
    pipeline: Any,
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


def _guard_record(counters: Counters) -> dict[str, Any]:
    """The counters beyond steps and skipped steps: skips by reason and the running loss."""
    count = int(np.asarray(counters.loss_count))
    mean = float(np.asarray(counters.loss_mean))  # float32 -> float64 is exact
    return {
        "skips": dict(zip(SKIP_REASONS, map(int, np.asarray(counters.skips)), strict=True)),
        "loss_mean": mean if count and np.isfinite(mean) else None,
        "loss_count": count,
    }


def _counters_from(manifest: dict) -> Counters:
    """The `Counters` a (validated) manifest describes; a manifest from before the guard
    (fusedpc 0.2.0 and older) counts every skipped step as non-finite."""
    steps = jnp.asarray(manifest["steps"], jnp.int32)
    skipped = jnp.asarray(manifest["skipped_steps"], jnp.int32)
    guard = manifest.get("guard")
    if guard is None:
        return Counters(steps, skipped)
    mean = guard["loss_mean"]
    return Counters(
        steps,
        skipped,
        jnp.asarray([guard["skips"].get(r, 0) for r in SKIP_REASONS], jnp.int32),
        jnp.asarray(0.0 if mean is None else mean, jnp.float32),
        jnp.asarray(guard["loss_count"], jnp.int32),
    )


def _check_guard(path: str, manifest: dict) -> None:
    guard = manifest.get("guard")
    if guard is None:
        return
    skips = guard.get("skips") if isinstance(guard, dict) else None
    # a manifest of fusedpc 0.3 has no "invalid mask" count (that rule came in 0.4): 0
    known = sorted(SKIP_REASONS)
    if isinstance(skips, dict) and sorted(skips) == [r for r in known if r != "invalid mask"]:
        skips = {**skips, "invalid mask": 0}
    if not isinstance(skips, dict) or sorted(skips) != known:
        raise _corrupted(
            path, f"the manifest's guard.skips is {skips!r}, not a count for each of "
            f"{list(SKIP_REASONS)}"
        )
    for reason, value in skips.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
            raise _corrupted(path, f"the manifest's guard.skips[{reason!r}] is {value!r}")
    if sum(skips.values()) != manifest["skipped_steps"]:
        raise _corrupted(
            path,
            f"the manifest's guard.skips add up to {sum(skips.values())}, not its "
            f"skipped_steps {manifest['skipped_steps']}",
        )
    count, mean = guard.get("loss_count"), guard.get("loss_mean", 0.0)
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count < 2**31:
        raise _corrupted(path, f"the manifest's guard.loss_count is {count!r}")
    if not (mean is None or isinstance(mean, float | int) and not isinstance(mean, bool)):
        raise _corrupted(path, f"the manifest's guard.loss_mean is {mean!r}, not a number")
    if (mean is None) != (count == 0):
        raise _corrupted(
            path, f"the manifest's guard.loss_mean {mean!r} does not fit loss_count {count}"
        )


def _open_for_writing(path: str) -> BinaryIO:
    """Create `path` (which must not exist) for writing; permissions follow the umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    return os.fdopen(os.open(path, flags, 0o666), "wb")


def _fsync_directory(directory: str) -> None:
    """Make the rename itself durable where the platform allows it (POSIX)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def naming_the_file(path: str | os.PathLike, note: str = "") -> Iterator[None]:
    """An `OSError` inside that names no file (a full disk: "No space left on device") is
    raised again naming `path`, with `note` after its reason; others pass unchanged."""
    try:
        yield
    except OSError as err:
        if err.filename is not None or not err.strerror:
            raise
        reason = f"{err.strerror} while writing ({note})" if note else err.strerror
        raise type(err)(err.errno, reason, os.fspath(path)) from err


def _write_atomically(path: str, write: Callable[[BinaryIO], None]) -> None:
    """`write` into a temporary file beside `path`, `fsync` it, rename it over `path`; on any
    failure the temporary file is removed and the error re-raised, `path` untouched."""
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(
        directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    )
    try:
        with naming_the_file(path, "the file there before, if any, is unchanged"):
            with _open_for_writing(temporary) as file:
                write(file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


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


def save_checkpoint(pipeline: Any, path: str | os.PathLike, metadata: Any = None) -> None:
    """Write `pipeline`'s state, step counters and `metadata` to the file `path`, atomically.

    Args:
        pipeline: a `FusedPipeline` (read through `state`, `steps` and `skipped_steps`; the
            state is copied to the host, never donated or changed).
        path: the checkpoint file. Its folder must exist; an existing file is replaced.
        metadata: anything JSON can hold (dicts, lists, strings, numbers, booleans, None;
            NumPy scalars are converted): the config, the data position, ... It is returned
            unchanged (up to JSON: tuples come back as lists) by `load_checkpoint`.

    The file is written to a temporary file next to `path` (`.<name>.<pid>.<random>.tmp`),
    flushed and `fsync`ed, then renamed over `path`. If anything fails or interrupts the save
    (an `OSError` such as a full disk, Ctrl-C), the temporary file is removed, the error is
    re-raised and the previous checkpoint at `path`, if any, is left intact. A process killed
    outright can leave its temporary file behind; it is never mistaken for the checkpoint.

    Saving the same state, counters and metadata twice gives identical bytes.

    State split across processes (leaves sharded over a mesh axis that spans hosts): every
    process must call `save_checkpoint` with the same `path`, on a file system they share.
    Each writes the blocks it holds to its own file in `<path>.shards/`; process 0 then writes
    `path` itself, renamed into place last, and removes the shard files of earlier saves. A
    failure in any process leaves the previous checkpoint intact and is raised in every
    process. Replicated state is saved whole by whichever process calls this.
    """
    path = os.fspath(path)
    try:
        _dump_json(metadata)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"save_checkpoint: metadata must be JSON-serialisable (dicts with string keys, "
            f"lists, strings, numbers, booleans, None); {err}. Nothing was written."
        ) from None
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"save_checkpoint: the folder {directory!r} does not exist; create it first."
        )
    if os.path.isdir(path):
        raise IsADirectoryError(
            f"save_checkpoint: {path!r} is a folder; give the path of a checkpoint file, e.g. "
            f"{os.path.join(path, 'checkpoint.zip')!r}."
        )
    split = [
        (number, jax.tree_util.keystr(key), leaf)
        for number, (key, leaf) in enumerate(jax.tree_util.tree_leaves_with_path(pipeline.state))
        if _split_across_processes(leaf)
    ]
    if split:
        _save_with_shards(pipeline, path, metadata, split)
        return
    _write_atomically(path, lambda file: _write_container(file, pipeline, metadata))
    _remove_stale_shards(path + SHARDS_SUFFIX)


# --------------------------------------------------------------------------- shard files
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


def _save_with_shards(
    pipeline: Any, path: str, metadata: Any, split: list[tuple[int, str, Any]]
) -> None:
    """The collective save: shard files by every process, then the manifest by process 0."""
    n, me = jax.process_count(), jax.process_index()
    # One id for this save (process 0's), and the same checkpoint path in every process.
    where = zlib.crc32(os.path.normpath(path).encode("utf-8")).to_bytes(4, "little")
    token = np.frombuffer(secrets.token_bytes(8) + where, np.uint8)
    tokens = _agree({"token": token})["token"]
    if (tokens[:, 8:] != tokens[0, 8:]).any():
        raise ValueError(
            f"save_checkpoint: the processes were given different paths (this one {path!r}); "
            "state split across processes is saved by every process to the same path."
        )
    save_id = tokens[0, :8].tobytes().hex()
    plans = _plan(split)
    writers = sorted({owner.process_index for p in plans for _, owner in p.layout})
    names = {k: f"{save_id}.process-{k}-of-{n}.zip" for k in writers}
    folder_name = os.path.basename(path) + SHARDS_SUFFIX
    folder = os.path.join(os.path.dirname(os.path.abspath(path)), folder_name)
    mine = os.path.join(folder, names[me]) if me in names else None

    digests = np.zeros((sum(len(p.layout) for p in plans), 32), np.uint8)
    failure: BaseException | None = None
    try:
        os.makedirs(folder, exist_ok=True)
        _fsync_directory(os.path.dirname(folder))  # the folder's own entry, made durable
        if mine is not None:
            _write_atomically(mine, lambda file: _write_shards(file, plans, digests))
    except Exception as err:  # noqa: BLE001 - every process must learn of it, then it is raised
        failure = err
    gathered = _agree({"ok": np.asarray([failure is None], np.uint8), "digests": digests})
    failed = [k for k in range(n) if not gathered["ok"][k, 0]]
    if failed:
        _discard(mine)
        if failure is not None:
            raise failure
        raise _failed_elsewhere("write their shard files", failed, path)

    if me == 0:
        try:
            records, row = {}, 0
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
                        "sha256": gathered["digests"][k, row].tobytes().hex(),
                    })
                    row += 1
                records[plan.number] = {**plan.record, "shards": shards}
            shard_files = {
                "folder": folder_name,
                "save_id": save_id,
                "process_count": n,
                "files": sorted(names.values()),
            }
            _write_atomically(
                path,
                lambda file: _write_container(file, pipeline, metadata, records, shard_files),
            )
        except Exception as err:  # noqa: BLE001 - as above
            failure = err
        else:
            _remove_stale_shards(folder, frozenset(names.values()))
    gathered = _agree({"ok": np.asarray([failure is None], np.uint8)})
    if not gathered["ok"][0, 0]:
        _discard(mine)
        if failure is not None:
            raise failure
        raise _failed_elsewhere("write the checkpoint's manifest", [0], path)


def _discard(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


# --------------------------------------------------------------------------- reading
def _corrupted(path: str, detail: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path!r} is corrupted or truncated ({detail}); it cannot be loaded. "
        "Use an earlier checkpoint, or save a new one."
    )


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


def _check_manifest(path: str, manifest: Any) -> dict:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(
            f"{path!r} is not a fusedpc checkpoint (its manifest does not name the format "
            f"{FORMAT_NAME!r})."
        )
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise _corrupted(path, f"format_version is {version!r}, not an integer")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path!r} has format version {version}, written by fusedpc "
            f"{manifest.get('library_version')!r}; this fusedpc reads format versions up to "
            f"{FORMAT_VERSION}. Upgrade fusedpc to load it."
        )
    leaves = manifest.get("leaves")
    if not isinstance(leaves, list) or not all(isinstance(r, dict) for r in leaves):
        raise _corrupted(path, "the manifest's leaf table is malformed")
    files = _check_shard_files(path, manifest)
    for record in leaves:
        _check_record(path, record, files)
    for key in ("steps", "skipped_steps"):  # int32 counters on the device
        value = manifest.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
            raise _corrupted(
                path, f"the manifest's {key!r} is {value!r}, not an integer in [0, 2**31)"
            )
    if manifest["skipped_steps"] > manifest["steps"]:
        raise _corrupted(
            path,
            f"the manifest's skipped_steps {manifest['skipped_steps']} exceeds its steps "
            f"{manifest['steps']}",
        )
    _check_guard(path, manifest)
    if "metadata" not in manifest or not isinstance(manifest["metadata"], dict | None):
        raise _corrupted(path, "the manifest has no 'metadata' (a JSON object or null)")
    return manifest


_ENTRY_FIELDS = {"entry": str, "nbytes": int, "sha256": str}


def _has_fields(record: Any, fields: dict[str, type]) -> bool:
    return isinstance(record, dict) and all(
        isinstance(record.get(k), t) and not isinstance(record.get(k), bool)
        for k, t in fields.items()
    )


def _check_shard_files(path: str, manifest: dict) -> frozenset[str]:
    """The shard files a (format 2) manifest names; none for a single-file checkpoint."""
    info = manifest.get("shard_files")
    if info is None:
        return frozenset()
    fields = {"folder": str, "save_id": str, "process_count": int, "files": list}
    if not _has_fields(info, fields):
        raise _corrupted(path, "the manifest's shard_files record is malformed")
    folder, files = info["folder"], info["files"]
    if folder in ("", ".", "..") or os.path.basename(folder) != folder or not all(
        isinstance(name, str) and _SHARD_FILE.fullmatch(name) for name in files
    ):
        raise _corrupted(
            path, f"the manifest's shard_files names {folder!r} / {files!r}, not shard files"
        )
    return frozenset(files)


def _check_record(path: str, record: dict, files: frozenset[str]) -> None:
    """One leaf record: stored whole (an entry) or in blocks tiling the leaf (shard files)."""
    if not _has_fields(record, {"path": str, "shape": list, "dtype": str}):
        raise _corrupted(path, "the manifest's leaf table is malformed")
    if "shards" not in record:
        if not _has_fields(record, _ENTRY_FIELDS):
            raise _corrupted(path, "the manifest's leaf table is malformed")
        return
    where = f"leaf {record['path']}"
    shards = record["shards"]
    shape = record.get("data_shape") if "key_impl" in record else record["shape"]
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _corrupted(path, f"{where}: its shape {shape!r} is malformed")
    if not isinstance(shards, list) or not shards or not all(
        _has_fields(shard, {**_ENTRY_FIELDS, "file": str, "index": list}) for shard in shards
    ):
        raise _corrupted(path, f"{where}: its shard table is malformed")
    blocks = []
    for shard in shards:
        index = shard["index"]
        if shard["file"] not in files:
            raise _corrupted(path, f"{where}: a block names the unlisted file {shard['file']!r}")
        if len(index) != len(shape) or not all(
            isinstance(b, list) and len(b) == 2 and all(isinstance(i, int) for i in b)
            and 0 <= b[0] < b[1] <= d
            for b, d in zip(index, shape, strict=True)
        ):
            raise _corrupted(path, f"{where}: the block index {index!r} does not fit {shape}")
        blocks.append(tuple(tuple(b) for b in index))
    volume = sum(int(np.prod([b - a for a, b in block])) for block in blocks)
    overlap = any(
        all(a < d and c < b for (a, b), (c, d) in zip(x, y, strict=True))
        for i, x in enumerate(blocks)
        for y in blocks[i + 1 :]
    )
    if overlap or volume != int(np.prod(shape)):
        raise _corrupted(path, f"{where}: its blocks do not tile its shape {shape}")


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


def _wrap(values: Any, record: dict) -> Any:
    impl = record.get("key_impl")
    if impl is not None:
        return jax.random.wrap_key_data(jnp.asarray(values), impl=impl)
    return values


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


def _first_difference(expected: list[dict], stored: list[dict]) -> str | None:
    """The first difference between this pipeline's leaves and the checkpoint's, in words."""
    expected_paths = {r["path"] for r in expected}
    stored_paths = {r["path"] for r in stored}
    for index in range(max(len(expected), len(stored))):
        mine = expected[index] if index < len(expected) else None
        theirs = stored[index] if index < len(stored) else None
        if mine is not None and theirs is not None and mine["path"] == theirs["path"]:
            if mine["shape"] != theirs["shape"] or mine["dtype"] != theirs["dtype"]:
                return (
                    f"leaf {mine['path']}: this pipeline expects "
                    f"{_spell(mine['shape'], mine['dtype'])}, the checkpoint has "
                    f"{_spell(theirs['shape'], theirs['dtype'])}"
                )
            continue
        if mine is not None and mine["path"] not in stored_paths:
            return (
                f"this pipeline has leaf {mine['path']} "
                f"({_spell(mine['shape'], mine['dtype'])}), the checkpoint has no such leaf"
            )
        if theirs is not None and theirs["path"] not in expected_paths:
            return (
                f"the checkpoint has leaf {theirs['path']} "
                f"({_spell(theirs['shape'], theirs['dtype'])}), this pipeline has no such leaf"
            )
        return (
            f"leaf #{index} is {mine['path'] if mine else None} in this pipeline but "
            f"{theirs['path'] if theirs else None} in the checkpoint (the leaves are in a "
            "different order)"
        )
    return None


_DICT_KEY = re.compile(r"\['([A-Za-z_]\w*)'\]")


def _migrated_leaves(expected: list[dict], stored: list[dict]) -> list[dict] | None:
    """The stored leaf records of a release-0.1 checkpoint in this pipeline's terms, or None.

    Release 0.1 held frozen parameters as dicts (key paths `['weight']`, flattened in sorted
    key order, so `['bias']` first) and a frozen LayerNorm's `eps` as a leaf; later releases
    hold named records (`.weight`) and keep `eps` static (it comes from the part). A stored
    path that this pipeline lacks is renamed `['name']` -> `.name` when that names one of this
    pipeline's leaves, a stored `eps` leaf this pipeline lacks is dropped, and the records are
    put in this pipeline's order. None when nothing needed migrating or the leaves still do
    not correspond one to one (the ordinary difference report then speaks)."""
    expected_paths = {r["path"] for r in expected}
    migrated, changed = [], False
    for record in stored:
        path = record["path"]
        if path not in expected_paths:
            renamed = _DICT_KEY.sub(r".\1", path)
            if renamed in expected_paths:
                record, changed = {**record, "path": renamed}, True
            elif renamed.endswith(".eps"):
                changed = True
                continue
        migrated.append(record)
    by_path = {r["path"]: r for r in migrated}
    if not changed or len(by_path) != len(migrated) or set(by_path) != expected_paths:
        return None
    return [by_path[r["path"]] for r in expected]


def _treedef_difference(expected: str, stored: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(expected, stored)) if a != b), None)
    at = min(len(expected), len(stored)) if at is None else at
    lo = max(at - 60, 0)

    def excerpt(text: str) -> str:
        hi = min(at + 60, len(text))
        return f"{'...' if lo else ''}{text[lo:hi]}{'...' if hi < len(text) else ''}"

    return (
        f"the leaves match but the tree structures differ from character {at}: this pipeline "
        f"has {excerpt(expected)}, the checkpoint has {excerpt(stored)}"
    )


def read_checkpoint_manifest(path: str | os.PathLike, *, verify: bool = False) -> dict:
    """The manifest of the checkpoint at `path` (a dict; its `"metadata"` is what was saved).

    Use it to rebuild the pipeline a checkpoint belongs to (from the config in its metadata)
    before calling `load_checkpoint`. With `verify=True` every leaf is also read and checked
    against its checksum, including every block in the shard files of a checkpoint of state
    split across processes. Raises `FileNotFoundError` if there is no file and
    `CheckpointError` if it is not a readable fusedpc checkpoint of a supported format version
    (or, with `verify=True`, a shard file is missing or damaged: the message names it and the
    leaf).
    """
    path = os.fspath(path)
    with contextlib.ExitStack() as stack:
        zf, manifest = stack.enter_context(_open_checkpoint(path))
        if verify:
            reader = _Reader(path, zf, manifest, stack)
            for record in manifest["leaves"]:
                reader.verify(record)
    return manifest


def load_checkpoint(pipeline: Any, path: str | os.PathLike) -> Any:
    """Load the checkpoint at `path` into `pipeline` and return its `metadata`.

    The state and the step counters are replaced (via `pipeline.set_state`, which also places
    the state on the pipeline's devices: a checkpoint saved from a sharded pipeline loads into a
    single-device one and the reverse). Continuing to train then gives bit for bit the same
    results as if training had never stopped.

    Refused with `CheckpointError`, the pipeline untouched, when the file is corrupted or
    truncated (bad container, bad JSON, a checksum or size mismatch, a missing entry), was
    written in a newer format version, or holds the state of a different tree: the message then
    names the first difference (a leaf present on one side only, or a leaf whose shape or dtype
    differs, e.g. `leaf .parts[0].params.weights[0]: this pipeline expects float32[16, 4], the
    checkpoint has float32[8, 4]`). A missing file raises `FileNotFoundError`.

    A checkpoint of state split across processes loads into a pipeline of any placement whose
    processes can read its shard files: each process reads only the blocks its own devices
    hold. In a multi-process run every process calls `load_checkpoint`; if any process refuses
    the checkpoint (a missing or damaged shard file, named with the leaf in that process's
    error), every process raises and none changes its pipeline.
    """
    path = os.fspath(path)
    with contextlib.ExitStack() as stack:
        zf, manifest = stack.enter_context(_open_checkpoint(path))
        current = pipeline.state
        expected = _expected_leaves(current)
        records = manifest["leaves"]
        migrated = _migrated_leaves(expected, records)
        if migrated is not None:  # a 0.1 layout: its leaves bound by path, not by position
            records = migrated
        difference = _first_difference(expected, records)
        if (
            difference is None
            and migrated is None
            and manifest.get("jax_version") == jax.__version__
        ):
            # The treedef's text form is only compared under the same JAX version (its spelling
            # may change between versions); the key paths above bind the leaves either way.
            mine, theirs = _normalised_treedef(current), manifest.get("treedef")
            if isinstance(theirs, str) and mine != theirs:
                difference = _treedef_difference(mine, theirs)
        if difference is not None:
            raise CheckpointError(
                f"checkpoint {path!r} holds the state of a different tree "
                f"({len(manifest['leaves'])} leaves; this pipeline has {len(expected)}). First "
                f"difference: {difference}. Build the pipeline from the configuration the "
                "checkpoint was saved with (see fusedpc.read_checkpoint_manifest(path)"
                "['metadata'])."
            )
        current_leaves = jax.tree_util.tree_leaves(current)
        reader = _Reader(path, zf, manifest, stack)
        failure: Exception | None = None
        try:
            leaves = [
                reader.leaf(record, leaf)
                for record, leaf in zip(records, current_leaves, strict=True)
            ]
        except Exception as err:  # noqa: BLE001 - raised below, once every process knows
            failure = err
    if jax.process_count() > 1 and any(
        isinstance(leaf, jax.Array) and not leaf.is_fully_addressable for leaf in current_leaves
    ):
        # The state spans processes: load everywhere or nowhere.
        ok = _agree({"ok": np.asarray([failure is None], np.uint8)})["ok"][:, 0]
        failed = [k for k, good in enumerate(ok) if not good]
        if failed and failure is None:
            raise CheckpointError(
                f"checkpoint {path!r} was refused by process(es) {failed} (their own error says "
                "why); no process loaded it."
            )
    if failure is not None:
        raise failure
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(current), leaves)
    pipeline.set_state(state, counters=_counters_from(manifest))
    return manifest["metadata"]


__all__ = [
    "CheckpointError",
    "FORMAT_VERSION",
    "load_checkpoint",
    "read_checkpoint_manifest",
    "save_checkpoint",
]
