"""Fused kernels of a GPT's compiled step: how many, and how many distinct.

XLA:CPU compiles each distinct fused kernel on its own (its MLIR emitters, then LLVM), so a
step's compile time follows the number of *distinct* kernels (docs/benchmarks.md, "Report
values as vectors"). This script compiles the fused step of config S or M (or a tiny GPT with
`--smoke`) and counts the fusion instructions of the optimised HLO and the distinct fused
computations among them: two fusions count as one when their computations are the same once
instruction names and metadata are set aside (the same operations, shapes, constants and
data flow). It prints one JSON line per source tree; the count is a property of the program,
not a timing, so one process per tree is enough.

    python scripts/count_kernels.py                                   # S, this tree
    python scripts/count_kernels.py --config M
    python scripts/count_kernels.py --tree before=/tmp/before/src --tree now=src
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when loaded from elsewhere (tests)
from compare_trees import CONFIGS as PAIRED_CONFIGS  # noqa: E402  (S and M, as compared there)

CONFIGS = {  # GPTConfig fields and the batch (rows, seq)
    "smoke": ({"width": 16, "n_heads": 2, "n_blocks": 2, "ff_width": 32, "max_len": 8}, (4, 8)),
    **PAIRED_CONFIGS,
}

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_FUSION = re.compile(r"= .*? fusion\(.*calls=%([\w.\-]+)")
_NAME = re.compile(r"%[\w.\-]+")
_DROPPED = (re.compile(r",?\s*metadata=\{[^}]*\}"), re.compile(r",?\s*backend_config=.*$"))


def computations(hlo: str) -> dict[str, list[str]]:
    """The HLO text's computations: name -> its instruction lines (without the braces)."""
    found: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            found[current] = []
        elif current is not None and line.strip() not in ("", "}"):
            found[current].append(line.strip())
    return found


def normalised(lines: list[str]) -> str:
    """A computation's text with metadata dropped and its names replaced, in order of first
    appearance, by numbers: equal for computations that differ only in names."""
    numbers: dict[str, str] = {}

    def number(match: re.Match) -> str:
        return numbers.setdefault(match.group(0), f"%{len(numbers)}")

    out = []
    for line in lines:
        for pattern in _DROPPED:
            line = pattern.sub("", line)
        out.append(_NAME.sub(number, line))
    return "\n".join(out)


def count(hlo: str) -> dict[str, int]:
    """Fusion instructions in `hlo` and distinct fused computations among them."""
    comps = computations(hlo)
    called = [m.group(1) for lines in comps.values() for line in lines
              if (m := _FUSION.search(line))]
    distinct = Counter(normalised(comps.get(name, [])) for name in called)
    return {"fusions": len(called), "distinct_fusions": len(distinct)}


def _measure(config: str) -> dict:
    import jax
    import numpy as np
    import optax

    import fusedpc

    fields, (rows, seq) = CONFIGS[config]
    gpt = fusedpc.GPTConfig(vocab_size=65, **fields)
    tree, _ = fusedpc.build_gpt(gpt, optax.adam(3e-3), jax.random.key(0))
    pipeline = fusedpc.FusedPipeline(tree, "softmax_cross_entropy")
    ids = np.random.default_rng(0).integers(0, 65, size=(rows, seq), dtype=np.int32)
    lowered = jax.jit(pipeline.program.step).lower(pipeline.carry, ids, ids)
    began = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - began
    return {"config": config, **count(compiled.as_text()), "compile_s": round(seconds, 2),
            "fusedpc": fusedpc.__file__, "jax": jax.__version__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=("S", "M"), default="S")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT (tests)")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="a source tree to count, in its own process (repeatable)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = "smoke" if args.smoke else args.config
    if args.worker or not args.tree:
        print(json.dumps(_measure(config)), flush=True)
        return 0
    bad = [item for item in args.tree if "=" not in item or not item.split("=", 1)[0]]
    if bad:
        raise SystemExit(f"--tree: expected NAME=DIR, got {bad!r}.")
    for item in args.tree:
        name, src = item.split("=", 1)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [os.path.abspath(src), *filter(None, [os.environ.get("PYTHONPATH")])])}
        command = [sys.executable, __file__, "--worker", "--config", args.config]
        done = subprocess.run(command + (["--smoke"] if args.smoke else []), env=env,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"--tree {name}: the worker failed:\n{done.stderr[-2000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps({"tree": name, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
