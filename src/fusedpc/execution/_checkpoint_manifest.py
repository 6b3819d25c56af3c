"""A checkpoint's manifest: the checks a manifest read from a file must pass before anything is
loaded (format, version, leaf table, shard files, step counters), and the step counters it
records (`Counters` to JSON and back, manifests of older releases included)."""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from fusedpc.execution._checkpoint_format import (
    _SHARD_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
    _corrupted,
)
from fusedpc.execution._step_types import (
    SKIP_REASONS,
    Counters,
)


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
