"""Compile time of one training step against K steps in a `lax.scan` (what `run` compiles).

Each variant is compiled in a fresh process (no compilation cache), the variants interleaved
over rounds, and one JSON line is printed per compile, then a summary line per variant with
the median:

* `step`: `StepProgram.step`, jitted;
* `run`: `StepProgram.run` over K steps (`keep_outputs=False`: the stacked metrics only);
* `scan_no_outputs`: a bare `lax.scan` of `step` over K steps that keeps nothing but the
  carry, to separate the loop from what `run` stacks.

    python scripts/compile_scan_cost.py                       # a 1-block GPT, width 16, 3 rounds
    python scripts/compile_scan_cost.py --n-blocks 2 --width 64 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from fusedpc.bench._rounds import interleaved_rows

VARIANTS = ("step", "run", "scan_no_outputs")


def _worker(variant: str, n_blocks: int, width: int, steps: int) -> dict:
    import jax
    import numpy as np
    import optax

    import fusedpc

    config = fusedpc.GPTConfig(vocab_size=32, width=width, n_heads=2, n_blocks=n_blocks,
                               ff_width=2 * width, max_len=16)
    part, _ = fusedpc.build_gpt(config, optax.adam(3e-3), jax.random.key(0))
    program = fusedpc.make_step(part, config.error_fn)
    carry = program.init(jax.random.key(0))
    xs = np.random.default_rng(0).integers(0, 32, (steps, 8, 16)).astype(np.int32)

    def scan_no_outputs(c, x, y):
        def body(c, batch):
            return program.step(c, batch[0], batch[1])[0], None

        return jax.lax.scan(body, c, (x, y))[0]

    functions = {
        "step": (program.step, (carry, xs[0], xs[0])),
        "run": (lambda c, x, y: program.run(c, x, y, keep_outputs=False), (carry, xs, xs)),
        "scan_no_outputs": (scan_no_outputs, (carry, xs, xs)),
    }
    fn, args = functions[variant]
    start = time.perf_counter()
    lowered = jax.jit(fn).trace(*args).lower()
    traced = time.perf_counter()
    lowered.compile()
    compiled = time.perf_counter()
    return {"variant": variant, "n_blocks": n_blocks, "width": width, "steps": steps,
            "trace_lower_s": round(traced - start, 3), "compile_s": round(compiled - traced, 3),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-blocks", type=int, default=1)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6, help="K, the scan's length")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.n_blocks, args.width, args.steps)))
        return
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false", "JAX_PLATFORMS": "cpu"}
    rows = interleaved_rows(
        __file__, VARIANTS, args.rounds,
        lambda variant: ["--worker", variant, "--n-blocks", str(args.n_blocks),
                         "--width", str(args.width), "--steps", str(args.steps)],
        lambda variant: env,
    )
    times = {v: [r["compile_s"] for r in rows if r["variant"] == v] for v in VARIANTS}
    step = statistics.median(times["step"])
    for variant in VARIANTS:
        median = statistics.median(times[variant])
        print(json.dumps({"summary": variant, "compile_s_median": round(median, 3),
                          "ratio_to_step": round(median / step, 2), "rounds": args.rounds}))


if __name__ == "__main__":
    main()
