"""Optional TensorBoard event files of a run, written beside its JSONL log.

`fusedpc train --tensorboard` mirrors the log into `RUN/tensorboard/` through tensorboardX
(`pip install "fusedpc[tensorboard]"`), so that runs can be watched with `tensorboard
--logdir runs`. The JSONL log stays the source of truth: the event files are written from the
same records, as they are emitted.

Scalars, by record kind:

* `train`: `train/loss`, `train/lr`;
* `eval`: `eval/val_loss`, `eval/val_perplexity`;
* `report`: `report/<part>/update_norm`, `error_norm`, `weight_norm` and `update_ratio`, and
  an iterative-inference part's `energy_before` and `energy_after`, a latent's `energy`
  and a relaxing tree's `<relaxation>` row (`energy_before`, `energy_after`,
  `backprop_distance`);
* `skip`: `train/skipped` (1 at each step not committed).
"""

from __future__ import annotations

import math
import os
from typing import Any

TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_MISSING = (
    "--tensorboard needs tensorboardX; install it with pip install 'fusedpc[tensorboard]'"
)
REPORT_FIELDS = (
    "update_norm", "error_norm", "weight_norm", "update_ratio", "energy_before", "energy_after",
    "energy", "backprop_distance",
)


class TensorBoardSink:
    """Writes the scalars of each log record to event files in `folder`.

    Raises:
        ValueError: tensorboardX is not installed (the message says what to install).
    """

    def __init__(self, folder: str | os.PathLike):
        try:
            from tensorboardX import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
                SummaryWriter,
            )
        except ImportError:
            raise ValueError(TENSORBOARD_MISSING) from None
        self._writer: Any = SummaryWriter(logdir=os.fspath(folder), flush_secs=10)

    def _scalar(self, tag: str, value: Any, step: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return
        if math.isfinite(value):
            self._writer.add_scalar(tag, float(value), int(step))

    def __call__(self, record: dict[str, Any]) -> None:
        kind, step = record.get("kind"), record.get("step", 0)
        if kind == "train":
            self._scalar("train/loss", record.get("loss"), step)
            self._scalar("train/lr", record.get("lr"), step)
        elif kind == "eval":
            self._scalar("eval/val_loss", record.get("val_loss"), step)
            self._scalar("eval/val_perplexity", record.get("val_perplexity"), step)
        elif kind == "report":
            for field in REPORT_FIELDS:
                self._scalar(f"report/{record.get('part')}/{field}", record.get(field), step)
        elif kind == "skip":
            self._scalar("train/skipped", 1, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


__all__ = [
    "TENSORBOARD_DIR",
    "TENSORBOARD_MISSING",
    "TensorBoardSink",
]
