"""fusedpc against pyhgf 0.3.2 at pyhgf's benchmark configuration: the all-learning GPT
(vocabulary 64, width 64, 4 heads, 2 blocks, feed-forward 256, 32 tokens, batch 16, Adam
1e-3, the precision-weighted learning kind, the softmax cross-entropy of the logits averaged
over the rows), tokens per second in `step` mode, each side in a fresh process of its own,
the sides alternating round by round (`scripts/peers/fusedpc_gpt_side.py` and
`scripts/peers/pyhgf_side.py`, timed alike by `scripts/peers/_worker.py`).

pyhgf (GPL-3.0; run, never copied) needs Python >= 3.12 and jax < 0.7, so it lives in its
own virtual environment, e.g. from pyenv's 3.12 interpreter:

    ~/.pyenv/versions/3.12.1/bin/python -m venv /work/pyhgf-venv
    /work/pyhgf-venv/bin/pip install "pyhgf==0.3.2"
    python scripts/pyhgf_speed.py --pyhgf-python /work/pyhgf-venv/bin/python   # 3 rounds

Both sides run with `XLA_FLAGS=--xla_cpu_use_thunk_runtime=true`: on import pyhgf switches
jaxlib 0.4.32-0.6.2 to XLA:CPU's legacy runtime unless the flag is set, and under that
runtime its own backprop parity collapses; the thunk runtime is what a user gets who undoes
the switch (and the only one jax >= 0.7, fusedpc's, has). Prints one JSON row per side and
round, and a summary row with each round's ratio (fusedpc's tokens/s over pyhgf's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PEERS = Path(__file__).resolve().parent / "peers"
CONFIG = {"vocab": 64, "width": 64, "n_heads": 4, "n_blocks": 2, "ff_width": 256, "seq": 32,
          "batch": 16, "lr": 1e-3, "steps": 200, "warmup": 10, "seed": 0}
THUNK = "--xla_cpu_use_thunk_runtime=true"


def _run(command: list[str], request: dict) -> dict:
    env = {**os.environ, "XLA_FLAGS": THUNK, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(command, input=json.dumps(request), capture_output=True, text=True,
                          env=env, check=False)
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(rows[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pyhgf-python", default="/work/pyhgf-venv/bin/python",
                        help="the interpreter of pyhgf's virtual environment")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=CONFIG["steps"])
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds and --steps: expected integers >= 1, got {args.rounds} and "
                     f"{args.steps}")
    if not Path(args.pyhgf_python).exists():
        parser.error(f"--pyhgf-python: {args.pyhgf_python!r} does not exist; make pyhgf's "
                     "environment first (this script's docstring says how)")
    request = {**CONFIG, "steps": args.steps}
    sides = {"fusedpc": [sys.executable, str(PEERS / "fusedpc_gpt_side.py")],
             "pyhgf": [args.pyhgf_python, str(PEERS / "pyhgf_side.py")]}
    ratios = []
    for round_ in range(args.rounds):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        rows = {}
        for side in order:
            rows[side] = _run(sides[side], request)
            print(json.dumps({"round": round_, **rows[side]}), flush=True)
        ratios.append(rows["fusedpc"]["tokens_per_s"] / rows["pyhgf"]["tokens_per_s"])
    print(json.dumps({"summary": "pyhgf_speed", "config": request,
                      "ratios": [round(r, 3) for r in ratios],
                      "median_ratio": round(statistics.median(ratios), 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
