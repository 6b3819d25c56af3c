"""The run's JSONL log: one JSON object a line, read back by `read_log`."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from fusedpc.execution._checkpoint import naming_the_file

LOG_NAME = "log.jsonl"


def read_log(path: str | os.PathLike, *, drop_torn_tail: bool = False) -> list[dict[str, Any]]:
    """The records of a JSONL log (`log.jsonl` of a run), in order.

    Args:
        path: the log file.
        drop_torn_tail: drop (with a `RuntimeWarning`) a last line that was cut mid-write (no
            final newline, not valid JSON): what a process killed while writing leaves.
            Any other malformed line is still refused.

    Returns:
        One dict per non-empty line.

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: a line that is not a JSON object; the message names its number.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no log file at {path!r}")
    records = []
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if drop_torn_tail and number == len(lines) and not line.endswith("\n"):
                warnings.warn(
                    f"{path}:{number}: dropped a torn last line (the run was stopped while "
                    "writing it)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                break
            raise ValueError(f"{path}:{number}: not a JSON line ({err.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object per line")
        records.append(record)
    return records


def write_lines(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


class RunLog:
    """The run's records: kept in memory (for the plots and the summary) and, on the leading
    process, appended to `log.jsonl` as they come."""

    def __init__(self, path: Path, history: list[dict], write: bool, sinks: tuple = ()):
        self.records = list(history)
        self.path = path
        self._file = None
        # Other writers of the same records (TensorBoard), called as records are emitted.
        self._sinks = tuple(sinks) if write else ()
        if write:
            with naming_the_file(path):
                write_lines(path, self.records)
                self._file = open(path, "a", encoding="utf-8")

    def emit(self, record: dict) -> None:
        self.records.append(record)
        if self._file is not None:
            with naming_the_file(self.path):  # a full disk says which file
                self._file.write(json.dumps(record) + "\n")
        for sink in self._sinks:
            sink(record)

    def flush(self) -> None:
        if self._file is not None:
            with naming_the_file(self.path):
                self._file.flush()
        for sink in self._sinks:
            sink.flush()

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            with naming_the_file(self.path):
                file.close()
        for sink in self._sinks:
            sink.close()
        self._sinks = ()
