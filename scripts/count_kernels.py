"""Fused kernels of a GPT's compiled step: how many, and how many distinct.

XLA:CPU compiles each distinct fused kernel on its own (its MLIR emitters, then LLVM), so a
step's compile time follows the number of *distinct* kernels (docs/benchmarks.md, "Report
values as vectors"). This script compiles the fused step of config S or M (or a tiny GPT with
`--smoke`) and counts the fusion instructions of the optimised HLO and the distinct fused
computations among them: two fusions count as one when their computations are the same once
instruction names and metadata are set aside (the same operations, shapes, constants and
data flow; `fusedpc.bench._kernels`). It prints one JSON line per source tree: each tree's
step is compiled in a process that imports that tree and counted in this one. The count is a
property of the program, not a timing, so one process per tree is enough.

    python scripts/count_kernels.py                                   # S, this tree
    python scripts/count_kernels.py --config M
    python scripts/count_kernels.py --tree before=/tmp/before/src --tree now=src
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _compile(name: str, fields: dict, rows: int, seq: int) -> tuple[dict, str]:
    """Compile the fused step of a GPT of `fields` and return its row (without the counts) and
    the optimised HLO text. fusedpc's public API only: a worker runs under another tree's src
    (`--tree`), which may predate fusedpc.bench's modules, and this process counts."""
    import jax
    import numpy as np
    import optax

    import fusedpc

    gpt = fusedpc.GPTConfig(vocab_size=65, **fields)
    tree, _ = fusedpc.build_gpt(gpt, optax.adam(3e-3), jax.random.key(0))
    pipeline = fusedpc.FusedPipeline(tree, "softmax_cross_entropy")
    ids = np.random.default_rng(0).integers(0, 65, size=(rows, seq), dtype=np.int32)
    lowered = jax.jit(pipeline.program.step).lower(pipeline.carry, ids, ids)
    began = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - began
    row = {"config": name, "compile_s": round(seconds, 2), "fusedpc": fusedpc.__file__,
           "jax": jax.__version__}
    return row, compiled.as_text()


def _counted(row: dict, hlo: str) -> dict:
    from fusedpc.bench._kernels import count_fusions

    return {"config": row["config"], **count_fusions(hlo),
            **{k: v for k, v in row.items() if k != "config"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=("S", "M"), default="S")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT (tests)")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="a source tree to count, in its own process (repeatable)")
    # a worker: the config's sizes as JSON and where to write the compiled program's text
    parser.add_argument("--worker", nargs=2, metavar=("SIZES", "HLO"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = "smoke" if args.smoke else args.config
    if args.worker:
        sizes, hlo_path = args.worker
        fields, (rows, seq) = json.loads(sizes)
        row, hlo = _compile(config, fields, rows, seq)
        Path(hlo_path).write_text(hlo)
        print(json.dumps(row), flush=True)
        return 0
    from fusedpc.bench._configs import CONFIGS  # here, not above: see _compile

    fields, (rows, seq) = CONFIGS[config]
    if not args.tree:
        print(json.dumps(_counted(*_compile(config, fields, rows, seq))), flush=True)
        return 0
    bad = [item for item in args.tree if "=" not in item or not item.split("=", 1)[0]]
    if bad:
        raise SystemExit(f"--tree: expected NAME=DIR, got {bad!r}.")
    sizes = json.dumps([fields, [rows, seq]])
    with tempfile.TemporaryDirectory() as folder:
        for item in args.tree:
            name, src = item.split("=", 1)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [os.path.abspath(src), *filter(None, [os.environ.get("PYTHONPATH")])])}
            hlo_path = os.path.join(folder, "step.hlo")
            command = [sys.executable, __file__, "--worker", sizes, hlo_path,
                       "--config", args.config]
            done = subprocess.run(command + (["--smoke"] if args.smoke else []), env=env,
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"--tree {name}: the worker failed:\n{done.stderr[-2000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            counted = _counted(row, Path(hlo_path).read_text())
            print(json.dumps({"tree": name, **counted}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
