"""What a checkpoint is: the format's names and versions, the error a refused one raises, and
the pipeline it is saved from and loaded into (see `fusedpc.execution._checkpoint`)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fusedpc.core._part import PyTree
    from fusedpc.execution._step_types import Counters

FORMAT_NAME = "fusedpc-checkpoint"
FORMAT_VERSION = 2  # the newest this library reads and writes
SINGLE_FILE_VERSION = 1  # a checkpoint without shard files: every release reads it
MANIFEST_ENTRY = "manifest.json"
SHARDS_SUFFIX = ".shards"
_SHARD_FILE = re.compile(r"[0-9a-f]{16}\.process-[0-9]+-of-[0-9]+\.zip")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded: corrupted, truncated, written by a newer format,
    or holding the state of a different tree. The pipeline is left untouched."""


def _corrupted(path: str, detail: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path!r} is corrupted or truncated ({detail}); it cannot be loaded. "
        "Use an earlier checkpoint, or save a new one."
    )


class Checkpointable(Protocol):
    """What the checkpoint code reads from a pipeline (a `FusedPipeline`) and how it writes one.

    Saving reads `state` (copied to the host, never donated or changed), `steps`,
    `skipped_steps` and `counters`; loading reads `state` (its tree, shapes, dtypes and
    placement) and replaces it, with the counters, through `set_state`."""

    @property
    def state(self) -> PyTree: ...

    @property
    def steps(self) -> int: ...

    @property
    def skipped_steps(self) -> int: ...

    @property
    def counters(self) -> Counters: ...

    def set_state(self, state: PyTree, *, counters: Counters) -> None: ...
