"""Generative latents in the main job: fill-in of hidden characters by relaxation against the
causal readout, over seeds and relaxation settings.

For each seed, trains the default GPT of `fusedpc train` on the bundled text (`--steps`
steps, everything else at its default) into a fresh temporary folder, then hides every
`--hide-every`-th token of the run's validation windows (its `eval_batches` batches) and
scores every (sweeps, rate) setting of `--settings` with `fusedpc.training`'s `infill_score`:
one JSON line per seed and setting (the causal readout's accuracy, the fill-in's, the energy
before and after, the seconds), then one summary line per setting (means and standard
deviations over seeds).

    python scripts/infill_study.py                                # 3 seeds, 1,500 steps
    python scripts/infill_study.py --seeds 1 --steps 100 --settings 8:1.0     # quick
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from fusedpc.training import resolve_config, train
from fusedpc.training._infill import infill_score
from fusedpc.training._setup import load_tokens


def _settings(text: str) -> list[tuple[int, float]]:
    """`"0:1,64:1.0"` -> `[(0, 1.0), (64, 1.0)]`."""
    pairs = []
    for item in text.split(","):
        steps, rate = item.split(":")
        pairs.append((int(steps), float(rate)))
    return pairs


def run_seed(seed: int, steps: int, hide_every: int,
             settings: list[tuple[int, float]]) -> list[dict[str, Any]]:
    config = resolve_config(overrides={"steps": steps, "seed": seed, "sample_tokens": 0,
                                       "eval_every": 0})
    with tempfile.TemporaryDirectory() as folder:
        result = train(config, Path(folder) / "run", stream=io.StringIO(), interactive=False)
        val_ids = load_tokens(config, tokenizer=result.tokenizer)[3]
        rows = []
        for sweeps, rate in settings:
            score = infill_score(result.pipeline, config, result.tokenizer, val_ids,
                                 hide_every=hide_every, steps=sweeps, rate=rate)
            rows.append({"seed": seed, "val_loss": result.val_loss,
                         **{k: v for k, v in score.items() if k != "example"},
                         "example": score["example"]["filled"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--hide-every", type=int, default=8)
    parser.add_argument("--settings", default="0:1.0,16:1.0,64:0.3,64:1.0,64:3.0,256:1.0",
                        help="sweeps:rate pairs, comma-separated (0 sweeps: the causal fill)")
    args = parser.parse_args(argv)
    settings = _settings(args.settings)
    rows = []
    for seed in range(args.seeds):
        for row in run_seed(seed, args.steps, args.hide_every, settings):
            print(json.dumps(row), flush=True)
            rows.append(row)
    for sweeps, rate in settings:
        mine = [r for r in rows if r["steps"] == sweeps and r["rate"] == rate]

        def stat(key: str, mine: list = mine) -> tuple[float, float]:
            values = [r[key] for r in mine]
            return (statistics.fmean(values),
                    statistics.stdev(values) if len(values) > 1 else 0.0)

        print(json.dumps({"summary": True, "steps": sweeps, "rate": rate, "seeds": len(mine),
                          "causal_accuracy": stat("causal_accuracy"),
                          "infill_accuracy": stat("infill_accuracy"),
                          "seconds": stat("seconds")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
