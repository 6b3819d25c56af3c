"""The loop the timing scripts in `scripts/` share: every variant in a fresh Python process,
the variants interleaved round after round (the machine is shared and noisy), one JSON line
each."""

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
    """Run `python script *arguments(variant)` under `environment(variant)` for every variant,
    `rounds` times over.

    Args:
        script: the script's path (a script passes its own `__file__`).
        variants: the variants, run in this order in every round.
        rounds: how many times each variant runs.
        arguments: a variant's command-line arguments.
        environment: a variant's environment (another tree's `PYTHONPATH`, say).

    Returns:
        The last line of each run's stdout, read as JSON, in the order they ran; each is also
        printed as it comes.

    Raises:
        subprocess.CalledProcessError: for a run that fails.
    """
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
