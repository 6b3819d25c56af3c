"""fusedpc against pyhgf 0.3.2 at pyhgf's benchmark configuration: the all-learning GPT
(vocabulary 64, width 64, 4 heads, 2 blocks, feed-forward 256, 32 tokens, batch 16, Adam
1e-3, the precision-weighted learning kind, the softmax cross-entropy of the logits averaged
over the rows), tokens per second in `step` mode, each side in a fresh process of its own,
the sides alternating round by round.

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

HERE = Path(__file__).resolve().parent
CONFIG = {"vocab": 64, "width": 64, "n_heads": 4, "n_blocks": 2, "ff_width": 256, "seq": 32,
          "batch": 16, "lr": 1e-3, "steps": 200, "warmup": 10, "seed": 0}
THUNK = "--xla_cpu_use_thunk_runtime=true"


def fusedpc_side(r: dict) -> dict:
    """fusedpc's all-learning GPT at the same sizes, `FusedPipeline.step` timed likewise."""
    import jax
    import optax

    import fusedpc

    sys.path.insert(0, str(HERE / "peers"))
    from _worker import timed_steps  # the timing pyhgf's side uses too

    config = fusedpc.GPTConfig(vocab_size=r["vocab"], width=r["width"], n_heads=r["n_heads"],
                               n_blocks=r["n_blocks"], ff_width=r["ff_width"],
                               max_len=r["seq"], learn="all")
    part, _ = fusedpc.build_gpt(config, optax.adam(r["lr"]), jax.random.key(r["seed"]))
    pipeline = fusedpc.FusedPipeline(part, config.error_fn)
    ids = jax.random.randint(jax.random.key(r["seed"] + 1), (r["batch"], r["seq"] + 1), 0,
                             r["vocab"])
    x, y = ids[:, :-1], ids[:, 1:]
    first, step_s, output_first, output = timed_steps(
        lambda: pipeline.step(x, y)[0], jax.block_until_ready, r["warmup"], r["steps"])
    loss_first = _cross_entropy(output_first, y)
    return {"side": "fusedpc", "step_ms": step_s * 1e3,
            "tokens_per_s": r["batch"] * r["seq"] / step_s, "first_call_s": first,
            "loss_first": loss_first, "loss_last": _cross_entropy(output, y),
            "finite": bool(pipeline.last_metrics.committed), "jax": jax.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def _cross_entropy(output, ids) -> float:
    """The mean cross-entropy of the logits against the targets (the same number on both
    sides: the training batch's, after the step that produced `output`)."""
    import jax
    import jax.numpy as jnp

    picked = jnp.take_along_axis(jax.nn.log_softmax(output), ids[..., None], axis=-1)
    return float(-jnp.mean(picked))


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
    parser.add_argument("--side", choices=("fusedpc",), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side == "fusedpc":  # a worker: the request on stdin, one row out
        print(json.dumps(fusedpc_side(json.loads(sys.stdin.read()))))
        return 0
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds and --steps: expected integers >= 1, got {args.rounds} and "
                     f"{args.steps}")
    if not Path(args.pyhgf_python).exists():
        parser.error(f"--pyhgf-python: {args.pyhgf_python!r} does not exist; make pyhgf's "
                     "environment first (this script's docstring says how)")
    request = {**CONFIG, "steps": args.steps}
    sides = {"fusedpc": [sys.executable, str(Path(__file__).resolve()), "--side", "fusedpc"],
             "pyhgf": [args.pyhgf_python, str(HERE / "peers" / "pyhgf_side.py")]}
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
