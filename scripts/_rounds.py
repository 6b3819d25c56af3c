"""The loop the timing scripts share: every variant in a fresh Python process, the variants
interleaved round after round (the machine is shared and noisy), one JSON line each."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence


def interleaved_rows(
    script: str,
    variants: Sequence[str],
    rounds: int,
    arguments: Callable[[str], list[str]],
    environment: Callable[[str], dict[str, str]],
) -> list[dict]:
    """Runs `python script *arguments(variant)` under `environment(variant)` for every
    variant, `rounds` times over, and returns (and prints, as they come) the last stdout line
    of each run, read as JSON."""
    rows: list[dict] = []
    for _ in range(rounds):
        for variant in variants:
            done = subprocess.run(
                [sys.executable, script, *arguments(variant)],
                capture_output=True, text=True, env=environment(variant), check=True,
            )
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows
