"""fusedpc's side of scripts/pyhgf_speed.py: the all-learning GPT at pyhgf's benchmark
configuration, `FusedPipeline.step` timed as pyhgf's side is timed (`_worker.timed_steps`).
Reads the same JSON request on stdin as `pyhgf_side.py` and prints one JSON row."""

from __future__ import annotations

import json
import os
import sys

import jax
import optax
from _worker import cross_entropy, timed_steps  # this folder, beside this file

import fusedpc


def main() -> int:
    r = json.loads(sys.stdin.read())
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
    print(json.dumps({
        "side": "fusedpc", "step_ms": step_s * 1e3,
        "tokens_per_s": r["batch"] * r["seq"] / step_s, "first_call_s": first,
        "loss_first": cross_entropy(output_first, y), "loss_last": cross_entropy(output, y),
        "finite": bool(pipeline.last_metrics.committed), "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
