"""Checkpoints: one file per checkpoint, written atomically, refused when it does not fit.

A checkpoint is a zip container (entries stored uncompressed, fixed timestamps) holding

* `leaves/NNNNN.bin`: the raw C-order, little-endian bytes of the state's `N`-th leaf (in
  `jax.tree_util.tree_leaves` order; PRNG key leaves are stored as their `key_data`);
* `manifest.json`: the format name and version, the library and JAX versions, the step counters,
  the state's tree structure (its treedef as text and every leaf's key path, shape, dtype and
  SHA-256), and the caller's JSON `metadata` (config, data position, ...).

Writing goes to a temporary file in the destination folder, is flushed and `fsync`ed, then
renamed over the destination with `os.replace`: a reader sees the old checkpoint or the new one,
never a half-written file, whatever interrupts the save. Loading checks the container, the
manifest, the format version, that the checkpoint's leaves are exactly the pipeline's (key path,
shape, dtype), and every leaf's checksum before anything is written into the pipeline, so a
refused load leaves the pipeline as it was. The format is described in `docs/checkpoints.md`.
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
from collections.abc import Iterator
from typing import Any, BinaryIO

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc._version import __version__
from fusedpc.execution._program import SKIP_REASONS, Counters

FORMAT_NAME = "fusedpc-checkpoint"
FORMAT_VERSION = 1
MANIFEST_ENTRY = "manifest.json"
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


def _to_host(leaf: Any) -> tuple[np.ndarray, str | None]:
    """The leaf's values as a little-endian, C-contiguous NumPy array, and its key impl name."""
    leaf = _as_array(leaf)
    impl = None
    if _is_key(leaf):
        impl = str(jax.random.key_impl(leaf))
        leaf = jax.random.key_data(leaf)
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        if not leaf.is_fully_replicated:
            raise ValueError(
                "save_checkpoint: a state leaf is sharded across hosts; the state is expected "
                "replicated (every host holds a full copy)."
            )
        leaf = leaf.addressable_data(0)
    host = np.ascontiguousarray(np.asarray(jax.device_get(leaf)))
    if host.dtype.byteorder == ">":
        host = host.astype(host.dtype.newbyteorder("<"))
    return host, impl


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


def _write_container(file: BinaryIO, pipeline: Any, metadata: Any) -> None:
    """Write every leaf, then the manifest (which carries the leaves' checksums)."""
    state = pipeline.state
    leaves = jax.tree_util.tree_leaves_with_path(state)
    records = []
    with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for index, (path, leaf) in enumerate(leaves):
            shape, dtype = _describe(leaf)
            host, impl = _to_host(leaf)
            # numpy's stubs give ndarray __buffer__ only from Python 3.12 on; we check 3.11
            payload = memoryview(host.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
            entry = f"leaves/{index:05d}.bin"
            record = {
                "path": jax.tree_util.keystr(path),
                "shape": shape,
                "dtype": dtype,
                "entry": entry,
                "nbytes": int(host.nbytes),
                "sha256": hashlib.sha256(payload).hexdigest(),
            }
            if impl is not None:
                record.update(
                    key_impl=impl,
                    data_shape=[int(d) for d in host.shape],
                    data_dtype=str(host.dtype),
                )
            records.append(record)
            zf.writestr(_zip_info(entry), payload)
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
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
        zf.writestr(_zip_info(MANIFEST_ENTRY), _dump_json(manifest))


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
        jnp.asarray([guard["skips"][r] for r in SKIP_REASONS], jnp.int32),
        jnp.asarray(0.0 if mean is None else mean, jnp.float32),
        jnp.asarray(guard["loss_count"], jnp.int32),
    )


def _check_guard(path: str, manifest: dict) -> None:
    guard = manifest.get("guard")
    if guard is None:
        return
    skips = guard.get("skips") if isinstance(guard, dict) else None
    if not isinstance(skips, dict) or sorted(skips) != sorted(SKIP_REASONS):
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
    temporary = os.path.join(
        directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    )
    try:
        with _open_for_writing(temporary) as file:
            _write_container(file, pipeline, metadata)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


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
    fields = {"path": str, "shape": list, "dtype": str, "entry": str, "nbytes": int, "sha256": str}
    if not isinstance(leaves, list) or not all(
        isinstance(r, dict) and all(isinstance(r.get(k), t) for k, t in fields.items())
        for r in leaves
    ):
        raise _corrupted(path, "the manifest's leaf table is malformed")
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


def _read_leaf(zf: zipfile.ZipFile, path: str, record: dict) -> Any:
    """One leaf from its entry, its size and SHA-256 checked; a NumPy array or a key array."""
    where = f"leaf {record['path']} (entry {record['entry']})"
    try:
        info = zf.getinfo(record["entry"])
    except KeyError:
        raise _corrupted(path, f"{where} is missing from the container") from None
    if info.file_size != record["nbytes"]:
        raise _corrupted(
            path, f"{where} holds {info.file_size} bytes, the manifest says {record['nbytes']}"
        )
    try:
        data = _read_entry(zf, info)
    except _READ_ERRORS as err:
        raise _corrupted(path, f"{where}: {err}") from None
    if len(data) != record["nbytes"] or hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise _corrupted(path, f"{where} does not match its SHA-256 checksum")
    impl = record.get("key_impl")
    try:
        shape = record["data_shape"] if impl is not None else record["shape"]
        dtype = np.dtype(jnp.dtype(record["data_dtype"] if impl is not None else record["dtype"]))
        values = np.frombuffer(data, dtype=dtype.newbyteorder("<")).reshape(shape)
    except (KeyError, TypeError, ValueError) as err:
        raise _corrupted(path, f"{where}: cannot rebuild its array ({err})") from None
    values = values.astype(dtype, copy=True)  # native byte order, writable, own memory
    if impl is not None:
        return jax.random.wrap_key_data(jnp.asarray(values), impl=impl)
    return values


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
    against its checksum. Raises `FileNotFoundError` if there is no file and `CheckpointError`
    if it is not a readable fusedpc checkpoint of a supported format version.
    """
    path = os.fspath(path)
    with _open_checkpoint(path) as (zf, manifest):
        if verify:
            for record in manifest["leaves"]:
                _read_leaf(zf, path, record)
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
    """
    path = os.fspath(path)
    with _open_checkpoint(path) as (zf, manifest):
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
        leaves = [_read_leaf(zf, path, record) for record in records]
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
