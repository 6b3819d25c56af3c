"""Compile time against step time of an unrolled `Repeat` kept stacked or with its blocks apart.

An experiment that was measured and not kept (docs/performance.md, "Blocks apart"): commit
9b317ac let an unrolled `Repeat` step over each block's state apart (`StepProgram.working_step`
over `working_carry`), and was reverted because the step got slower. Run this script against
a checkout of that commit:

    git worktree add /tmp/apart 9b317ac
    python scripts/blocks_apart.py --src /tmp/apart/src                  # config S
    python scripts/blocks_apart.py --src /tmp/apart/src --config M --rounds 2 --steps 15

Each measurement runs in a fresh process (the persistent compilation cache off), the two
variants interleaved; one JSON line per process, then a summary with the medians:

* `stacked`: the step over the stacked state, as `FusedPipeline` runs it today;
* `apart`: the same step over the blocks' states apart (every value bit for bit the same).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

VARIANTS = ("apart", "stacked")
CONFIGS = {
    "S": {"width": 64, "n_heads": 4, "n_blocks": 2, "ff_width": 256, "max_len": 64, "batch": 16},
    "M": {"width": 256, "n_heads": 8, "n_blocks": 4, "ff_width": 1024, "max_len": 128,
          "batch": 32},
}


def _worker(variant: str, config: str, steps: int) -> dict:
    import jax
    import numpy as np
    import optax

    import fusedpc

    settings = dict(CONFIGS[config])
    batch = settings.pop("batch")
    gpt_config = fusedpc.GPTConfig(vocab_size=65, **settings)
    tree, _ = fusedpc.build_gpt(gpt_config, optax.adam(3e-3), jax.random.key(0))
    pipeline = fusedpc.FusedPipeline(tree, "softmax_cross_entropy")
    program = pipeline.program
    if not hasattr(program, "working_carry"):
        raise SystemExit("--src: this tree has no StepProgram.working_carry; check out 9b317ac.")
    ids = np.random.default_rng(0).integers(0, 65, size=(batch, settings["max_len"]),
                                            dtype=np.int32)
    public = program.init(jax.random.key(0))
    # working_step takes either layout: the public carry is the stacked step as it is
    carry = program.working_carry(public) if variant == "apart" else public
    jitted = jax.jit(program.working_step, donate_argnums=0)
    start = time.perf_counter()
    lowered = jitted.trace(carry, ids, ids).lower()
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    for _ in range(3):
        carry, out = compiled(carry, ids, ids)
    jax.block_until_ready(carry)
    timed = time.perf_counter()
    for _ in range(steps):
        carry, out = compiled(carry, ids, ids)
    jax.block_until_ready(carry)
    end = time.perf_counter()
    return {
        "variant": variant,
        "config": config,
        "trace_lower_s": round(traced - start, 3),
        "compile_s": round(done - traced, 3),
        "step_ms": round((end - timed) / steps * 1e3, 3),
        "fusions": compiled.as_text().count(" fusion("),
        "loss": float(out.metrics.loss),
        "fusedpc": fusedpc.__file__,
        "jax": jax.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="the src folder of a 9b317ac checkout")
    parser.add_argument("--config", choices=tuple(CONFIGS), default="S")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per process")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.config, args.steps)))
        return 0
    # here, not above: a worker runs under the --src tree, which predates fusedpc.bench's modules
    from fusedpc.bench._rounds import interleaved_rows

    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false", "PYTHONPATH": args.src}
    rows = interleaved_rows(
        __file__, VARIANTS, args.rounds,
        lambda variant: ["--worker", variant, "--src", args.src, "--config", args.config,
                         "--steps", str(args.steps)],
        lambda variant: env,
    )
    summary: dict = {"summary": True, "config": args.config, "rounds": args.rounds}
    for variant in VARIANTS:
        for field in ("compile_s", "step_ms"):
            summary[f"{variant}_{field}_median"] = statistics.median(
                r[field] for r in rows if r["variant"] == variant
            )
    for field in ("compile_s", "step_ms"):
        summary[f"{field}_ratio_apart_to_stacked"] = round(
            summary[f"apart_{field}_median"] / summary[f"stacked_{field}_median"], 3
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
