"""Whether a checkpoint holds the state of this pipeline's tree: its leaves bound to the
pipeline's (by key path, shape and dtype; a release-0.1 layout migrated first), or the first
difference in words."""

from __future__ import annotations

from typing import Any

import jax

from fusedpc.execution._checkpoint_format import CheckpointError
from fusedpc.execution._checkpoint_leaves import _describe, _normalised_treedef, _spell
from fusedpc.execution._checkpoint_migrate import _migrated_leaves


def _matched_records(path: str, current: Any, manifest: dict) -> list[dict]:
    """The checkpoint's leaf records in the order of `current`'s leaves (this pipeline's
    state); `CheckpointError`, naming the first difference, when the trees differ."""
    expected = _expected_leaves(current)
    records = manifest["leaves"]
    migrated = _migrated_leaves(expected, records)
    if migrated is not None:  # a 0.1 layout: its leaves bound by path, not by position
        records = migrated
    difference = _first_difference(expected, records)
    if difference is None and migrated is None and manifest.get("jax_version") == jax.__version__:
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
    return records


def _expected_leaves(state: Any) -> list[dict[str, Any]]:
    rows = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        shape, dtype = _describe(leaf)
        rows.append({"path": jax.tree_util.keystr(path), "shape": shape, "dtype": dtype})
    return rows


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
