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

This module holds the entry points and the order in which a save is made durable (temporary
file, `fsync`, rename; shard files before the manifest); the pieces are private modules of one
concept each: `_checkpoint_format` (names, versions, `CheckpointError`, the pipeline's
protocol), `_checkpoint_leaves` (a leaf's record and bytes), `_checkpoint_zip` (the container),
`_checkpoint_manifest` (its checks and the step counters), `_checkpoint_shards` (shard files
and the collectives of a multi-process save), `_checkpoint_reader` (reading leaves back),
`_checkpoint_match` (binding the checkpoint's leaves to the pipeline's) and
`_checkpoint_migrate` (release-0.1 checkpoints).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import jax
import numpy as np

from fusedpc.execution._checkpoint_format import (
    FORMAT_VERSION,
    SHARDS_SUFFIX,
    Checkpointable,
    CheckpointError,
)
from fusedpc.execution._checkpoint_format import (  # the tests read it here
    SINGLE_FILE_VERSION as SINGLE_FILE_VERSION,
)
from fusedpc.execution._checkpoint_leaves import _split_across_processes
from fusedpc.execution._checkpoint_manifest import _counters_from
from fusedpc.execution._checkpoint_match import _matched_records
from fusedpc.execution._checkpoint_reader import _Reader
from fusedpc.execution._checkpoint_shards import (
    _agree,
    _agree_on_save_id,
    _discard,
    _failed_elsewhere,
    _plan,
    _remove_stale_shards,
    _shard_records,
    _write_shards,
)
from fusedpc.execution._checkpoint_zip import _dump_json, _open_checkpoint, _write_container


# --------------------------------------------------------------------------- writing atomically
# (here, beside the saves: the tests fill the disk by patching `_checkpoint._open_for_writing`)
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


# --------------------------------------------------------------------------- saving
def save_checkpoint(
    pipeline: Checkpointable, path: str | os.PathLike, metadata: Any = None
) -> None:
    """Write `pipeline`'s state, step counters and `metadata` to the file `path`, atomically.

    Args:
        pipeline: a `FusedPipeline` (read through `state`, `steps`, `skipped_steps` and
            `counters`; the state is copied to the host, never donated or changed).
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


def _save_with_shards(
    pipeline: Checkpointable, path: str, metadata: Any, split: list[tuple[int, str, Any]]
) -> None:
    """The collective save: shard files by every process, then the manifest by process 0."""
    n, me = jax.process_count(), jax.process_index()
    save_id = _agree_on_save_id(path)
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
            records = _shard_records(plans, names, gathered["digests"])
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


# --------------------------------------------------------------------------- loading
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


def load_checkpoint(pipeline: Checkpointable, path: str | os.PathLike) -> Any:
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
        records = _matched_records(path, current, manifest)
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
