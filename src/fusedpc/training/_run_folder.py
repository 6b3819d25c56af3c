"""Run folders that cannot be mixed up: claimed atomically, locked for the run's life.

A run writes `config.toml`, `log.jsonl` and `checkpoint.fpc` into its folder. Two runs in one
folder would interleave their logs and leave one's config beside the other's checkpoint, so
a folder is **claimed** before anything is written:

* a new run's folder is created, or must hold none of a run's files;
* the default folder `runs/<timestamp>` is created exclusively (`mkdir` fails if it exists)
  and gets a suffix `-2`, `-3`, ... when taken, so two runs started in the same second never
  share one;
* the claimed folder is locked for the run's life: an exclusive `flock` on `.lock` in it
  (released by the operating system if the process dies, so a crash leaves no stale lock);
  a second run into a locked folder is refused with one line naming the holder's pid;
* once locked, the temporary files that a killed run's checkpoint writes left behind
  (`.checkpoint.fpc.<pid>.<hex>.tmp`) are removed: nothing else can be writing them.
"""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path
from typing import IO

try:  # POSIX; elsewhere the lock file is created exclusively instead
    import fcntl
except ImportError:  # pragma: no cover - not on the platforms CI runs
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".lock"
RUN_FILES = ("config.toml", "log.jsonl", "checkpoint.fpc")
# the temporary files of an interrupted checkpoint write (fusedpc.execution's atomic write)
LEFTOVER = re.compile(r"\.(?:checkpoint|best)\.fpc\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp")


class RunFolderError(ValueError):
    """A run folder that cannot be claimed: in use, or holding another run."""


def default_out(root: str | os.PathLike = "runs") -> Path:
    """A fresh `runs/<timestamp>` folder, created exclusively (`-2`, `-3`, ... when taken)."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    Path(root).mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        candidate = Path(root) / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise RunFolderError(f"no free run folder name under {os.fspath(root)!r} for {stamp}")


class RunFolder:
    """The claim on a run folder: hold it for the run's life, then `release()`.

    Args:
        path: the folder.
        resuming: the folder's own run is being continued (its files are expected).

    Raises:
        RunFolderError: the folder is locked by another run, or (a new run) already holds a
            run's files.
    """

    def __init__(
        self, path: str | os.PathLike, *, resuming: bool = False, created: bool = False
    ):
        self.path = Path(path)
        # made for this run (here or by `default_out`): removed again if the run never starts
        self.created = created or not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunFolderError(
                f"cannot create the run folder {os.fspath(path)!r}: {err}"
            ) from None
        self._file: IO[str] | None = None
        self._lock()
        self.removed_leftovers = self._remove_leftovers()
        if not resuming:
            held = [name for name in RUN_FILES if (self.path / name).exists()]
            if held:
                self.release()
                raise RunFolderError(
                    f"{os.fspath(self.path)!r} already holds a run ({', '.join(held)}); continue "
                    f"it with --resume {os.fspath(self.path)}, or choose another --out."
                )

    def _lock(self) -> None:
        lock = self.path / LOCK_NAME
        if fcntl is None:  # pragma: no cover
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                raise RunFolderError(self._in_use(lock)) from None
            self._file = os.fdopen(fd, "w")
        else:
            handle = open(lock, "a+", encoding="utf-8")
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                raise RunFolderError(self._in_use(lock)) from None
            handle.seek(0)
            handle.truncate()
            self._file = handle
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def _remove_leftovers(self) -> list[str]:
        """Remove the temporary files of checkpoint writes that a killed run left here
        (`.checkpoint.fpc.<pid>.<hex>.tmp`, `.best.fpc.<pid>.<hex>.tmp`, as the atomic write
        names them), and return their names. They are provably leftovers: this run holds the
        folder's lock, so no other run is writing here, and this process has written none."""
        removed = []
        for entry in self.path.iterdir():
            match = LEFTOVER.fullmatch(entry.name)
            if match and int(match["pid"]) != os.getpid() and entry.is_file():
                try:
                    entry.unlink()
                except OSError:
                    continue
                removed.append(entry.name)
        return sorted(removed)

    def _in_use(self, lock: Path) -> str:
        try:
            holder = lock.read_text(encoding="utf-8").strip() or "unknown"
        except OSError:
            holder = "unknown"
        return (
            f"{os.fspath(self.path)!r} is in use by another run (pid {holder}); wait for it to "
            "finish or choose another --out."
        )

    def release(self) -> None:
        """Give the folder up (the lock file stays, unlocked)."""
        if self._file is not None:
            if fcntl is None:  # pragma: no cover
                self._file.close()
                os.unlink(self.path / LOCK_NAME)
            else:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
                self._file.close()
            self._file = None

    def abandon(self) -> None:
        """Release the folder and, if this run created it and wrote nothing into it, remove
        it: a run refused at its start leaves no trace."""
        self.release()
        if self.created:
            lock = self.path / LOCK_NAME
            try:
                if [p.name for p in self.path.iterdir()] == [LOCK_NAME]:
                    lock.unlink()
                    self.path.rmdir()
            except OSError:
                pass

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


__all__ = ["LOCK_NAME", "RunFolder", "RunFolderError", "default_out"]
