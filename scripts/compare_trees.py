"""Step time and compile time of two source trees' fused GPT step, paired in one process.

Timing two versions of the library in two processes, one after the other, compares two
moments of a shared machine as much as two programs. This script exports each tree's step
program (`jax.export`, in a process that imports that tree), then loads both programs into one
process and times them in turn, round after round: their compiles (each with the in-memory
cache bypassed) and their steps (the same batch, each program carrying its own state), so
that a load that comes and goes hits both alike. It prints one JSON line per round and a
summary with the medians and the median of the per-round ratios (second tree over first).

Needs `flatbuffers` (jax's export serialisation: `pip install -e ".[dev]"`).

    git worktree add /tmp/before <commit>
    python scripts/compare_trees.py --tree before=/tmp/before/src --tree now=src       # S
    python scripts/compare_trees.py --config M --steps 4 --tree before=... --tree now=src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _pipeline(sizes: str):
    """A pipeline and a batch of ids of the config `sizes` (its `[GPTConfig fields, [rows,
    seq]]` as JSON), with fusedpc's public API only: an exporting process imports another
    tree, which may predate fusedpc.bench's modules."""
    import jax
    import numpy as np
    import optax

    import fusedpc

    fields, (rows, seq) = json.loads(sizes)
    gpt = fusedpc.GPTConfig(vocab_size=65, **fields)
    tree, _ = fusedpc.build_gpt(gpt, optax.adam(3e-3), jax.random.key(0))
    pipeline = fusedpc.FusedPipeline(tree, "softmax_cross_entropy")
    ids = np.random.default_rng(0).integers(0, 65, size=(rows, seq), dtype=np.int32)
    return pipeline, ids


def _export(sizes: str, path: str) -> None:
    """In a process importing one tree: write its step, over flat carry leaves, to `path`."""
    import jax
    import numpy as np

    import fusedpc

    pipeline, ids = _pipeline(sizes)
    leaves, structure = jax.tree_util.tree_flatten(pipeline.carry)

    def step(leaves, x, target):
        carry = jax.tree_util.tree_unflatten(structure, leaves)
        carry, out = pipeline.program.step(carry, x, target)
        return jax.tree_util.tree_leaves(carry), jax.tree_util.tree_leaves(out)

    exported = jax.export.export(jax.jit(step))(leaves, ids, ids)
    Path(path).write_bytes(exported.serialize())
    # its own starting carry: two trees' carries may differ (a counter added, say)
    np.savez(path + ".npz", *[np.asarray(leaf) for leaf in leaves])
    print(json.dumps({"exported": path, "fusedpc": fusedpc.__file__}))


def _compare(config: str, sizes: str, paths: dict[str, str], rounds: int, steps: int) -> dict:
    import jax
    import numpy as np

    _, ids = _pipeline(sizes)
    programs = {name: jax.export.deserialize(Path(p).read_bytes()) for name, p in paths.items()}
    starts = {}  # each tree's own starting carry, as its export wrote it
    for name, path in paths.items():
        with np.load(path + ".npz") as saved:
            starts[name] = [jax.numpy.asarray(saved[f"arr_{i}"]) for i in range(len(saved.files))]
    calls = {name: jax.jit(program.call) for name, program in programs.items()}
    carries = {name: list(start) for name, start in starts.items()}
    rows = []
    for r in range(rounds):
        row: dict = {"round": r}
        for name, program in programs.items():
            lowered = jax.jit(program.call).lower(starts[name], ids, ids)
            began, cpu = time.perf_counter(), time.process_time()
            # an option no step depends on, new each round: the in-memory cache is bypassed
            lowered.compile(compiler_options={"xla_cpu_collective_timeout_seconds": 1000 + r})
            row[f"{name}_compile_s"] = time.perf_counter() - began
            row[f"{name}_compile_cpu_s"] = time.process_time() - cpu
            times = []
            for _ in range(steps + 1):  # the first call of the round compiles or warms
                began = time.perf_counter()
                leaves, _ = calls[name](carries[name], ids, ids)
                jax.block_until_ready(leaves)
                times.append(time.perf_counter() - began)
                carries[name] = leaves
            row[f"{name}_step_ms"] = statistics.median(times[1:]) * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
    names = list(programs)
    summary: dict = {"summary": True, "config": config, "rounds": rounds, "steps": steps}
    for field in ("compile_s", "compile_cpu_s", "step_ms"):
        for name in names:
            summary[f"{name}_{field}_median"] = statistics.median(
                r[f"{name}_{field}"] for r in rows)
        first, second = names
        summary[f"{second}_over_{first}_{field}"] = statistics.median(
            r[f"{second}_{field}"] / r[f"{first}_{field}"] for r in rows)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="a source tree to time (exactly two; the ratios are second/first)")
    parser.add_argument("--config", choices=("M", "S"), default="S",
                        help="a GPT size of fusedpc.bench._configs (default S)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--export", nargs=2, metavar=("SIZES", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.export:
        _export(*args.export)
        return 0
    trees = dict(item.split("=", 1) for item in args.tree if "=" in item)
    if len(trees) != 2 or len(args.tree) != 2:
        raise SystemExit(f"--tree: expected two NAME=DIR with different names, got {args.tree!r}.")
    from fusedpc.bench._configs import CONFIGS  # here, not above: see _pipeline

    sizes = json.dumps(CONFIGS[args.config])
    with tempfile.TemporaryDirectory() as folder:
        paths = {}
        for name, src in trees.items():
            paths[name] = os.path.join(folder, f"{name}.bin")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                p for p in (str(Path(src).resolve()), os.environ.get("PYTHONPATH")) if p)}
            subprocess.run([sys.executable, __file__, "--export", sizes, paths[name]],
                           env=env, check=True)
        print(json.dumps(_compare(args.config, sizes, paths, args.rounds, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
