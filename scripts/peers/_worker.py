"""The request loop that every peer side runs, and what the sides share.

A side is started by `scripts/tree_pc_peers.py` with its own library's python, and answers
one JSON request a line on stdin, `{"cmd": name, "args": {...}}`, with one JSON line on
stdout (`{"error": "..."}` when the handler raised); `{"cmd": "quit"}` ends it. Everything
a library prints goes to stderr, so stdout carries the answers only. Standard library and
numpy only: this file runs in every peer's environment.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

WARM = 3
"""Calls of a step before any timing: the first compiles, and a library whose pytrees
change shape after a step (PCX's optimiser and vode caches) retraces on the second."""


def serve(handlers: dict[str, Callable[..., dict]]) -> None:
    """Answer requests until `quit` or the end of stdin."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the library prints, C level included, goes to stderr
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request["cmd"] == "quit":
            break
        try:
            answer = handlers[request["cmd"]](**request.get("args", {}))
        except Exception as error:  # noqa: BLE001 - handed back to the driver as text
            traceback.print_exc()
            answer = {"error": f"{type(error).__name__}: {error}"}
        answers.write(json.dumps(answer) + "\n")


def load(path: str) -> dict[str, np.ndarray]:
    """The arrays the driver wrote (`np.savez`)."""
    with np.load(path) as arrays:
        return {name: arrays[name] for name in arrays.files}


def first_calls(one_step: Callable[[int], None], sync: Callable[[], None]) -> float:
    """Seconds of the first call of `one_step(0)` (compiling); then `WARM - 1` more."""
    start = time.perf_counter()
    one_step(0)
    sync()
    seconds = time.perf_counter() - start
    for i in range(1, WARM):
        one_step(i)
    sync()
    return round(seconds, 3)


def ms_per_step(n: int, one_step: Callable[[int], None], sync: Callable[[], None]) -> float:
    """Milliseconds per step of `n` calls of `one_step(i)`, dispatched without a host sync
    in between and then waited for (`sync`)."""
    start = time.perf_counter()
    for i in range(n):
        one_step(i)
    sync()
    return (time.perf_counter() - start) / n * 1e3


def timed_steps(step: Callable[[], Any], sync: Callable[[Any], object], warmup: int,
                steps: int) -> tuple[float, float, Any, Any]:
    """`step()` timed as `scripts/pyhgf_speed.py` times each side: its first call (compiling)
    alone, `warmup` more calls untimed, then `steps` calls dispatched without a host sync in
    between and waited for (`sync(result)`). Returns `(seconds of the first call, seconds per
    timed step, the first call's result, the last one's)`."""
    start = time.perf_counter()
    first = step()
    sync(first)
    first_s = time.perf_counter() - start
    last = first
    for _ in range(warmup):
        last = step()
    sync(last)
    start = time.perf_counter()
    for _ in range(steps):
        last = step()
    sync(last)
    return first_s, (time.perf_counter() - start) / steps, first, last


def cross_entropy(logits: Any, ids: Any) -> float:
    """The mean cross-entropy of `logits` `(..., V)` against the integer targets `ids`, on the
    host (numpy, float64): the same number from every side's outputs."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    picked = np.take_along_axis(log_p, np.asarray(ids)[..., None], axis=-1)
    return float(-picked.mean())
