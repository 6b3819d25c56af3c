"""A live progress line for training loops: step, loss, tokens/s and time to go.

On a terminal the line rewrites itself in place (carriage return), at least once a second
while a compiled call runs, and is drawn again right after a message line (a validation
result); in a log file or a pipe it prints a plain line now and then instead (at most every
`every_steps` steps and every `every_s` seconds), so that captured output stays readable.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    """`75.2` -> `"1:15"`, `3725` -> `"1:02:05"`; `"?"` for an unknown (NaN or inf) time."""
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        return "?"
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


class Progress:
    """Progress of a loop from step `start` to step `total`.

    Args:
        total: the step at which the loop ends.
        start: the step it starts from (a resumed run starts part-way).
        stream: where to write (default `sys.stderr`).
        interactive: rewrite one line in place (`True`) or print plain lines (`False`);
            by default, whether `stream` is a terminal.
        every_s: without a terminal, the least number of seconds between two plain lines
            (the first and the last update always print).
        every_steps: without a terminal, the least number of steps between two plain lines
            (default: a fiftieth of the run, at least 1).
        width: characters of the bar on a terminal.
        tick_s: on a terminal, how often the line is redrawn between updates (its elapsed
            time and eta move on while a long call runs); 0: only at updates.

    The rate (steps/s, tokens/s) and the time to go are measured from the second update
    on, so that the first call's compilation does not skew them.
    """

    def __init__(
        self,
        total: int,
        start: int = 0,
        *,
        stream: TextIO | None = None,
        interactive: bool | None = None,
        every_s: float = 10.0,
        every_steps: int | None = None,
        width: int = 24,
        tick_s: float = 1.0,
    ):
        self.total = int(total)
        self.start = int(start)
        self.stream = sys.stderr if stream is None else stream
        if interactive is None:
            isatty = getattr(self.stream, "isatty", None)
            interactive = bool(isatty and isatty())
        self.interactive = interactive
        self.every_s = float(every_s)
        span = max(self.total - self.start, 1)
        self.every_steps = max(1, span // 50) if every_steps is None else max(1, int(every_steps))
        self.width = int(width)
        self.tick_s = float(tick_s)
        self._last_step = -(10**18)
        self._latest: tuple[int, float] | None = None  # (step, loss) of the last update
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._began = time.perf_counter()
        self._rate_from: tuple[float, int, int] | None = None  # (time, step, tokens)
        self._last_print = -float("inf")
        self._tokens = 0
        self._open_line = False

    def _rates(self, now: float, step: int) -> tuple[float, float]:
        if self._rate_from is None:
            return float("nan"), float("nan")
        t0, s0, tok0 = self._rate_from
        elapsed = now - t0
        if elapsed <= 0 or step <= s0:
            return float("nan"), float("nan")
        return (step - s0) / elapsed, (self._tokens - tok0) / elapsed

    def line(self, step: int, loss: float, now: float | None = None) -> str:
        """The text of the progress line at `step` (without a line ending)."""
        now = time.perf_counter() if now is None else now
        steps_per_s, tokens_per_s = self._rates(now, step)
        eta = (self.total - step) / steps_per_s if steps_per_s > 0 else float("nan")
        span = max(self.total - self.start, 1)
        done = min(max(step - self.start, 0) / span, 1.0)
        filled = int(round(done * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        rate = f"{tokens_per_s:,.0f} tok/s" if tokens_per_s == tokens_per_s else "- tok/s"
        return (
            f"[{bar}] step {step}/{self.total}  loss {loss:.4f}  {rate}  "
            f"elapsed {format_duration(now - self._began)}  eta {format_duration(eta)}"
        )

    def update(self, step: int, loss: float, tokens: int) -> None:
        """Record that the loop reached `step` with `loss`, having consumed `tokens` more."""
        now = time.perf_counter()
        with self._lock:
            self._tokens += int(tokens)
            if self._rate_from is None:
                self._rate_from = (now, step, self._tokens)
            self._latest = (step, loss)
            if self.interactive:
                self._draw(now)
                self._start_ticker()
            elif step >= self.total or (
                now - self._last_print >= self.every_s
                and step - self._last_step >= self.every_steps
            ):
                self.stream.write(self.line(step, loss, now) + "\n")
                self.stream.flush()
                self._last_print, self._last_step = now, step

    def _draw(self, now: float | None = None) -> None:
        """Rewrite the in-place line from the last update (the caller holds the lock)."""
        if self._latest is None:
            return
        self.stream.write("\r" + self.line(*self._latest, now) + "\033[K")
        self._open_line = True
        self.stream.flush()

    def _start_ticker(self) -> None:
        if self.tick_s <= 0 or self._ticker is not None:
            return

        def tick():
            while not self._stop.wait(self.tick_s):
                with self._lock:
                    if self._open_line:
                        self._draw()

        self._ticker = threading.Thread(target=tick, name="fusedpc-progress", daemon=True)
        self._ticker.start()

    def message(self, text: str) -> None:
        """Print a line of its own without garbling the progress line; on a terminal the
        progress line is drawn again below it."""
        with self._lock:
            self._end_line()
            self.stream.write(text + "\n")
            self.stream.flush()
            if self.interactive:
                self._draw()

    def _end_line(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False

    def close(self) -> None:
        """End the in-place line (on a terminal) and stop redrawing it, so later output
        starts on a new line."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        with self._lock:
            self._end_line()
            self._latest = None  # a message after close is not followed by a stale bar
