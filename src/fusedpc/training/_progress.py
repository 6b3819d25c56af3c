"""A live progress line for training loops: step, loss, tokens/s and time to go.

On a terminal the line rewrites itself in place (carriage return); in a log file or a pipe
it prints a plain line now and then instead, so that captured output stays readable.
"""

from __future__ import annotations

import sys
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
        width: characters of the bar on a terminal.

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
        width: int = 24,
    ):
        self.total = int(total)
        self.start = int(start)
        self.stream = sys.stderr if stream is None else stream
        if interactive is None:
            isatty = getattr(self.stream, "isatty", None)
            interactive = bool(isatty and isatty())
        self.interactive = interactive
        self.every_s = float(every_s)
        self.width = int(width)
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
        self._tokens += int(tokens)
        if self._rate_from is None:
            self._rate_from = (now, step, self._tokens)
        text = self.line(step, loss, now)
        if self.interactive:
            self.stream.write("\r" + text + "\033[K")
            self._open_line = True
            self.stream.flush()
        elif now - self._last_print >= self.every_s or step >= self.total:
            self.stream.write(text + "\n")
            self.stream.flush()
            self._last_print = now

    def message(self, text: str) -> None:
        """Print a line of its own without garbling the progress line."""
        self.close()
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the in-place line (on a terminal), so later output starts on a new line."""
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False
