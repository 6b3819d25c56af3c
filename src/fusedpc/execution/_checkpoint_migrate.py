"""The migration of release-0.1 checkpoints: their leaf records renamed to the key paths of
later releases, so that they load into a pipeline of today."""

from __future__ import annotations

import re

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
