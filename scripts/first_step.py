"""Time of the first training step (trace + compile + run) of a GPT, one trace vs two.

Each measurement runs in a fresh Python process (nothing cached, the persistent compilation
cache off), the variants interleaved, and prints one JSON line per process, then a summary:

* `one_trace`: `FusedPipeline.step` as it is, whose shape check is the jit's own trace;
* `two_traces`: the same with an extra `jax.eval_shape` of the step before it (what the
  executor did before it checked shapes on the jit's trace), to show what that trace costs;
* `previous` (with `--previous-src DIR`): `FusedPipeline.step` of another source tree, e.g.
  a checkout of release 0.1 (`git worktree add /tmp/v01 <commit>`, then `/tmp/v01/src`).

    python scripts/first_step.py                      # 4 blocks, width 64, 5 rounds
    python scripts/first_step.py --n-blocks 8 --rounds 3
    python scripts/first_step.py --previous-src /tmp/v01/src
    python scripts/first_step.py --n-blocks 2 --variants one_trace \
        --tree r01=/tmp/v01/src --tree before=/tmp/before/src   # several trees, interleaved
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

VARIANTS = ("one_trace", "two_traces")


def _worker(variant: str, n_blocks: int, width: int) -> dict:
    start = time.perf_counter()
    import jax
    import numpy as np
    import optax

    import fusedpc

    imported = time.perf_counter()
    config = fusedpc.GPTConfig(
        vocab_size=65, width=width, n_heads=4, n_blocks=n_blocks, ff_width=4 * width, max_len=64
    )
    tree, _ = fusedpc.build_gpt(config, optax.adam(3e-3), jax.random.key(0))
    pipeline = fusedpc.FusedPipeline(tree, "softmax_cross_entropy")
    ids = np.random.default_rng(0).integers(0, 65, size=(16, 64), dtype=np.int32)
    built = time.perf_counter()
    # The shape check before compiling: the traces a first step makes (previous: its own
    # check, an eval_shape, and then its step traces the jit once more, not timed here).
    if variant == "two_traces":
        jax.eval_shape(pipeline.program.step, pipeline.carry, ids, ids)
    pipeline.check(ids, ids)
    checked = time.perf_counter()
    pipeline.step(ids, ids)
    jax.block_until_ready(pipeline.state)
    first = time.perf_counter()
    pipeline.step(ids, ids)
    jax.block_until_ready(pipeline.state)
    second = time.perf_counter()
    return {
        "variant": variant,
        "n_blocks": n_blocks,
        "width": width,
        "first_step_s": round(first - built, 4),
        "check_s": round(checked - built, 4),
        "second_step_s": round(second - first, 4),
        "import_s": round(imported - start, 3),
        "traces": dict(pipeline.trace_counts),
        "fusedpc": fusedpc.__file__,
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-blocks", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--previous-src", help="another source tree to time as `previous`")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="more source trees to time beside the others, each as NAME "
                             "(repeatable: e.g. --tree r01=/tmp/v01/src --tree r03=/tmp/v03/src)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="which of this tree's variants to time (default: both)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        row = _worker("one_trace" if args.worker not in VARIANTS else args.worker,
                      args.n_blocks, args.width)
        print(json.dumps({**row, "variant": args.worker}))
        return 0
    # here, not above: a worker runs under another tree's src (--tree, --previous-src), which
    # may predate fusedpc.bench's modules
    from fusedpc.bench._rounds import interleaved_rows

    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    bad = [item for item in args.tree
           if "=" not in item or item.split("=", 1)[0] in (*VARIANTS, "previous", "")]
    if bad:
        raise SystemExit(f"--tree: expected NAME=DIR with a NAME other than "
                         f"{(*VARIANTS, 'previous')}, got {bad!r}.")
    trees = dict(item.split("=", 1) for item in args.tree)
    if args.previous_src:
        trees["previous"] = args.previous_src
    own = tuple(v for v in args.variants.split(",") if v)
    if any(v not in VARIANTS for v in own):
        raise SystemExit(f"--variants: expected names from {VARIANTS}, got {args.variants!r}.")
    variants = (*own, *trees)
    rows = interleaved_rows(
        __file__, variants, args.rounds,
        lambda variant: ["--worker", variant, "--n-blocks", str(args.n_blocks),
                         "--width", str(args.width)],
        # another tree's variant runs that tree's code, its own step as it is
        lambda variant: {**env, "PYTHONPATH": trees[variant]} if variant in trees else env,
    )
    summary: dict = {"summary": True, "n_blocks": args.n_blocks, "width": args.width}
    for variant in variants:
        for field in ("first_step_s", "check_s"):
            times = [r[field] for r in rows if r["variant"] == variant]
            summary[f"{variant}_{field}_median"] = round(statistics.median(times), 4)
            summary[f"{variant}_{field}_all"] = times
    if set(VARIANTS) <= set(own):
        for field in ("first_step_s", "check_s"):
            summary[f"{field}_ratio_one_to_two"] = round(
                summary[f"one_trace_{field}_median"] / summary[f"two_traces_{field}_median"], 3
            )
    if own:  # this tree's first step against each other tree's
        mine = summary[f"{own[0]}_first_step_s_median"]
        for name in trees:
            summary[f"first_step_ratio_to_{name}"] = round(
                mine / summary[f"{name}_first_step_s_median"], 3)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
