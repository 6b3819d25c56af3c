"""Predictive coding at depth: μPC against the standard parameterisation on the digits, from
a few residual blocks to 128, with the same rates at every depth (`docs/pc-depth.md`).

Every run builds `fusedpc.residual_pc_network(64, width, 10, depth)` (an input layer, `depth`
scanned residual blocks, a readout; a `fusedpc.Latent` after the input layer and after every
block) and trains it with `fusedpc.make_step` (squared error against one-hot targets, every
layer through Adam at `--lr`, the latents relaxed for T = `--inference-steps` sweeps at
`--inference-rate`). The rates were chosen at width 64 and depth 8 and are used unchanged at
every depth. Data: scikit-learn's `load_digits` (pixels / 16, float32), rows permuted by
`np.random.default_rng(0)`, the first 360 held out, the rest for training; the batches of
seed s are drawn by `np.random.default_rng(s)` (the same for every variant and depth).

Seeds, depths and variants are interleaved, so that every variant sees the same machine
conditions. Each run prints one JSON line: held-out `accuracy`, `train_loss` (the mean of the
last 20 steps' losses, non-finite ones left out; null when none is finite), `skipped` (steps
refused as non-finite), `energy_rose_steps` (steps whose relaxation ended at a higher energy
than it started from: the latent rate is too large), `first_call_s` (compile and one step
for a variant's first seed; one step for later seeds, which reuse the compiled step),
`step_ms`, and which layers learnt at all: `blocks_learning` (blocks whose weights moved)
and `input_layer_learning`. Then one summary line per (variant, depth): accuracy mean,
standard deviation and minimum over seeds, skipped steps in total. Then the timing of μPC
at every depth: `compile_s` (the median over `--compile-rounds` of tracing, lowering and
compiling the step, each in a fresh process unless `--compile-in-process`) and `step_ms`
(the median over `--timing-rounds` rounds of 10 steps, depths interleaved round by round),
with their ratios to the shallowest depth. Last, one `target` line per target, met or
missed, with its figures.

`--inference-steps-per-depth 8,32` adds the variant `mupc_T=L+1` at those depths: T = depth
+ 1 sweeps (one per latent), so that the relaxed error can reach every layer.

    python scripts/pc_depth_study.py --out pc_depth.jsonl         # 3 seeds, depths 8, 32, 128
    python scripts/pc_depth_study.py --inference-steps-per-depth 8,32  # and T = L + 1
    python scripts/pc_depth_study.py --seeds 1 --depths 8 --parameterisations mupc \\
        --inference-rate 0.5                                      # the latent rate too large
    python scripts/pc_depth_study.py --quick                       # 1 seed, depths 4, 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import subprocess
import sys
import time
from typing import Any, NamedTuple, TextIO

import jax
import numpy as np
import optax

import fusedpc

HELD_OUT = 360
CLASSES = 10
LOSS_WINDOW = 20
STEPS_PER_ROUND = 10
ACCURACY_TARGET = 0.95
STEP_RATIO_TARGET = 16.0
COMPILE_RATIO_TARGET = 1.5
CHOSEN = {"width": 64, "lr": 0.1, "inference_rate": 0.1, "inference_steps": 8}  # at depth 8


class Data(NamedTuple):
    """The fixed split: training inputs and one-hot targets, held-out inputs and labels."""

    x_train: np.ndarray
    t_train: np.ndarray
    x_test: np.ndarray
    labels_test: np.ndarray


class Variant(NamedTuple):
    """One column of the study: the parameterisation and T (None: `--inference-steps`; -1:
    depth + 1, one sweep per latent)."""

    parameterisation: str
    sweeps: int | None = None

    @property
    def name(self) -> str:
        return self.parameterisation if self.sweeps is None else f"{self.parameterisation}_T=L+1"

    def inference_steps(self, depth: int, default: int) -> int:
        return default if self.sweeps is None else depth + 1


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=_ints, default=[8, 32, 128])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--inference-steps", type=int, default=8)
    parser.add_argument("--inference-rate", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--parameterisations", type=lambda s: s.split(","),
                        default=["mupc", "standard"])
    parser.add_argument("--inference-steps-per-depth", type=_ints, default=[],
                        help="depths at which to add μPC with T = depth + 1")
    parser.add_argument("--timing-rounds", type=int, default=20)
    parser.add_argument("--compile-rounds", type=int, default=2)
    parser.add_argument("--compile-in-process", action="store_true",
                        help="time compiles in this process rather than a fresh one each")
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, depths 4 and 8, 40 steps, 3 timing rounds")
    parser.add_argument("--out", default=None, help="also write every JSON line to this file")
    parser.add_argument("--compile-probe", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.depths, args.steps, args.timing_rounds = 1, [4, 8], 40, 3
        args.compile_in_process = True
    return args


def load_data() -> Data:
    """The digits, pixels / 16 (float32), the fixed split of the module docstring."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    targets = np.eye(CLASSES, dtype=np.float32)[digits.target]
    order = np.random.default_rng(0).permutation(len(x))
    test, train = order[:HELD_OUT], order[HELD_OUT:]
    return Data(x[train], targets[train], x[test], digits.target[test])


def build(variant: Variant, depth: int, seed: int, args: argparse.Namespace,
          in_width: int = 64) -> fusedpc.StepProgram:
    """The step program of one run: the network of `seed` and its relaxation."""
    tree = fusedpc.residual_pc_network(
        in_width, args.width, CLASSES, depth, optimiser=optax.adam(args.lr),
        key=jax.random.key(seed), parameterisation=variant.parameterisation)
    relaxation = fusedpc.Relaxation(
        steps=variant.inference_steps(depth, args.inference_steps), rate=args.inference_rate)
    return fusedpc.make_step(tree, relaxation=relaxation)


def layer_weights(state: Any) -> list[np.ndarray]:
    """Host copies of every learning layer's weights, in forward order (the blocks' stacked
    weights are the one array of three dimensions)."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return [np.array(leaf) for path, leaf in leaves
            if jax.tree_util.keystr(path).endswith("params.weights[0]")]


def learning_layers(before: list[np.ndarray], after: list[np.ndarray]) -> dict[str, Any]:
    """Which layers moved at all: the blocks whose weights changed and the input layer."""
    (blocks_before,) = [w for w in before if w.ndim == 3]
    (blocks_after,) = [w for w in after if w.ndim == 3]
    moved = np.abs(blocks_after - blocks_before).reshape(len(blocks_before), -1).max(axis=1)
    changed = [i for i, m in enumerate(moved) if m > 0]
    return {"blocks_learning": len(changed),
            "lowest_learning_block": changed[0] if changed else None,
            "input_layer_learning": bool(np.any(before[0] != after[0]))}


def finite_mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else None


def train_run(variant: Variant, depth: int, seed: int, data: Data, args: argparse.Namespace,
              compiled: dict[tuple[str, int], Any]) -> dict[str, Any]:
    """Trains one network for `--steps` steps; later seeds reuse the first seed's compiled
    step and prediction (the seed only changes the state)."""
    program = build(variant, depth, seed, args, data.x_train.shape[1])
    fresh = (variant.name, depth) not in compiled
    if fresh:
        compiled[(variant.name, depth)] = (jax.jit(program.step, donate_argnums=0),
                                           jax.jit(program.predict))
    step, predict = compiled[(variant.name, depth)]
    carry = program.init(jax.random.key(seed))
    before = layer_weights(carry.state)
    rng = np.random.default_rng(seed)
    losses, rises = [], []
    start = time.perf_counter()
    first_call_s = 0.0
    for i in range(args.steps):
        rows = rng.choice(len(data.x_train), args.batch, replace=False)
        carry, out = step(carry, data.x_train[rows], data.t_train[rows])
        losses.append(out.metrics.loss)
        rises.append(out.metrics.relaxation.energy_after > out.metrics.relaxation.energy_before)
        if i == 0:
            jax.block_until_ready(carry)
            first_call_s = time.perf_counter() - start
            start = time.perf_counter()
    jax.block_until_ready(carry)
    rest = time.perf_counter() - start
    scores = np.asarray(predict(carry.state, data.x_test))
    return {
        "variant": variant.name, "parameterisation": variant.parameterisation,
        "depth": depth, "seed": seed,
        "inference_steps": variant.inference_steps(depth, args.inference_steps),
        "accuracy": float(np.mean(np.argmax(scores, -1) == data.labels_test)),
        "train_loss": finite_mean([float(v) for v in losses[-LOSS_WINDOW:]]),
        "skipped": int(carry.counters.skipped), "steps": args.steps,
        "energy_rose_steps": int(sum(bool(r) for r in rises)),
        "first_call_s": round(first_call_s, 3), "compiled": fresh,
        "step_ms": round(1000 * rest / max(1, args.steps - 1), 3),
        **learning_layers(before, layer_weights(carry.state)),
    }


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (variant, depth): accuracy mean, standard deviation (0 for one seed) and
    minimum over the seeds, skipped steps in total."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["variant"], run["depth"]), []).append(run)
    lines = []
    for (name, depth), group in groups.items():
        accuracy = [run["accuracy"] for run in group]
        losses = [run["train_loss"] for run in group if run["train_loss"] is not None]
        lines.append({
            "summary": name, "parameterisation": group[0]["parameterisation"],
            "depth": depth, "inference_steps": group[0]["inference_steps"],
            "seeds": len(group), "accuracy_mean": statistics.fmean(accuracy),
            "accuracy_std": statistics.stdev(accuracy) if len(accuracy) > 1 else 0.0,
            "accuracy_min": min(accuracy),
            "skipped_total": sum(run["skipped"] for run in group),
            "energy_rose_steps_total": sum(run["energy_rose_steps"] for run in group),
            "steps_total": sum(run["steps"] for run in group),
            "train_loss_mean": statistics.fmean(losses) if losses else None,
            "blocks_learning": max(run["blocks_learning"] for run in group),
            "step_ms_mean": statistics.fmean(run["step_ms"] for run in group),
        })
    return lines


def compile_once(depth: int, args: argparse.Namespace, data: Data) -> dict[str, float]:
    """Traces, lowers and compiles μPC's step at `depth` once (a new program, so that nothing
    is cached): `lower_s` (tracing and lowering), `compile_s` (XLA), `total_s`."""
    program = build(Variant("mupc"), depth, 0, args, data.x_train.shape[1])
    carry = program.init(jax.random.key(0))
    x, t = data.x_train[:args.batch], data.t_train[:args.batch]
    start = time.perf_counter()
    lowered = jax.jit(program.step, donate_argnums=0).lower(carry, x, t)
    lowered_at = time.perf_counter()
    lowered.compile()
    end = time.perf_counter()
    return {"lower_s": lowered_at - start, "compile_s": end - lowered_at,
            "total_s": end - start}


def compile_in_fresh_process(depth: int, args: argparse.Namespace) -> dict[str, float]:
    """`compile_once` in a new Python process (this script with `--compile-probe`)."""
    command = [sys.executable, __file__, "--compile-probe", str(depth),
               "--width", str(args.width), "--inference-steps", str(args.inference_steps),
               "--inference-rate", str(args.inference_rate), "--lr", str(args.lr),
               "--batch", str(args.batch)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"compile probe at depth {depth} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def compile_times(args: argparse.Namespace, data: Data) -> dict[int, dict[str, float]]:
    """The median of `--compile-rounds` compiles per depth, depths interleaved per round."""
    samples: dict[int, list[dict[str, float]]] = {d: [] for d in args.depths}
    for _ in range(args.compile_rounds):
        for depth in args.depths:
            samples[depth].append(compile_once(depth, args, data) if args.compile_in_process
                                  else compile_in_fresh_process(depth, args))
    return {depth: {key: statistics.median(s[key] for s in got) for key in got[0]}
            for depth, got in samples.items()}


def step_times(args: argparse.Namespace, data: Data) -> dict[int, float]:
    """μPC's milliseconds per step at every depth: the median over `--timing-rounds` rounds,
    each round `STEPS_PER_ROUND` steps per depth (on one batch already on the device), the
    depths interleaved round by round."""
    x = jax.device_put(data.x_train[:args.batch])
    t = jax.device_put(data.t_train[:args.batch])
    steps, carries = {}, {}
    for depth in args.depths:
        program = build(Variant("mupc"), depth, 0, args, data.x_train.shape[1])
        steps[depth] = jax.jit(program.step, donate_argnums=0)
        carry = program.init(jax.random.key(0))
        for _ in range(2):  # compile, then one warm step
            carry, _ = steps[depth](carry, x, t)
        carries[depth] = jax.block_until_ready(carry)
    samples: dict[int, list[float]] = {d: [] for d in args.depths}
    for _ in range(args.timing_rounds):
        for depth in args.depths:
            carry = carries[depth]
            start = time.perf_counter()
            for _ in range(STEPS_PER_ROUND):
                carry, _ = steps[depth](carry, x, t)
            carries[depth] = jax.block_until_ready(carry)
            samples[depth].append(1000 * (time.perf_counter() - start) / STEPS_PER_ROUND)
    return {depth: statistics.median(s) for depth, s in samples.items()}


def timing_lines(args: argparse.Namespace, data: Data) -> list[dict[str, Any]]:
    """One line per depth: μPC's median step and compile time and their ratios to the
    shallowest depth's."""
    compiles = compile_times(args, data)
    step_ms = step_times(args, data)
    base = min(args.depths)
    return [{
        "timing": "mupc", "depth": depth, "inference_steps": args.inference_steps,
        "step_ms": round(step_ms[depth], 3),
        "step_ratio": round(step_ms[depth] / step_ms[base], 3),
        "compile_s": round(compiles[depth]["total_s"], 3),
        "lower_s": round(compiles[depth]["lower_s"], 3),
        "xla_compile_s": round(compiles[depth]["compile_s"], 3),
        "compile_ratio": round(compiles[depth]["total_s"] / compiles[base]["total_s"], 3),
        "relative_to_depth": base, "timing_rounds": args.timing_rounds,
        "compile_rounds": args.compile_rounds,
        "compile_in": "this process" if args.compile_in_process else "a fresh process each",
    } for depth in args.depths]


def _target(name: str, met: bool, **figures: Any) -> dict[str, Any]:
    return {"target": name, "status": "met" if met else "missed", **figures}


def target_lines(summaries: list[dict[str, Any]], timings: list[dict[str, Any]],
                 args: argparse.Namespace) -> list[dict[str, Any]]:
    """The study's targets, each met or missed, at depth 128 against depth 8 (or the deepest
    against the shallowest depth run)."""
    deep = 128 if 128 in args.depths else max(args.depths)
    shallow = 8 if 8 in args.depths else min(args.depths)
    by = {(s["summary"], s["depth"]): s for s in summaries}
    time_at = {t["depth"]: t for t in timings}
    lines = []
    mupc = by.get(("mupc", deep))
    if mupc is not None:
        lines.append(_target(
            f"mupc accuracy >= {ACCURACY_TARGET} at depth {deep} (mean over seeds)",
            mupc["accuracy_mean"] >= ACCURACY_TARGET, depth=deep, seeds=mupc["seeds"],
            accuracy_mean=mupc["accuracy_mean"], accuracy_min=mupc["accuracy_min"],
            min_also_met=mupc["accuracy_min"] >= ACCURACY_TARGET))
    standard = by.get(("standard", deep))
    if standard is not None:
        lines.append(_target(
            f"standard parameterisation fails at depth {deep} (accuracy mean < 0.5)",
            standard["accuracy_mean"] < 0.5, depth=deep,
            accuracy_mean=standard["accuracy_mean"], skipped_total=standard["skipped_total"],
            steps_total=standard["steps_total"]))
    if deep in time_at and shallow in time_at:
        step_ratio = time_at[deep]["step_ms"] / time_at[shallow]["step_ms"]
        compile_ratio = time_at[deep]["compile_s"] / time_at[shallow]["compile_s"]
        lines.append(_target(
            f"step time at depth {deep} <= {STEP_RATIO_TARGET}x depth {shallow}",
            step_ratio <= STEP_RATIO_TARGET, ratio=round(step_ratio, 3),
            step_ms={shallow: time_at[shallow]["step_ms"], deep: time_at[deep]["step_ms"]}))
        lines.append(_target(
            f"compile time at depth {deep} <= {COMPILE_RATIO_TARGET}x depth {shallow}",
            compile_ratio <= COMPILE_RATIO_TARGET, ratio=round(compile_ratio, 3),
            compile_s={shallow: time_at[shallow]["compile_s"],
                       deep: time_at[deep]["compile_s"]}))
    used = {"width": args.width, "lr": args.lr, "inference_rate": args.inference_rate,
            "inference_steps": args.inference_steps}
    lines.append(_target(
        f"the rates chosen at width 64 / depth 8 used unchanged at depths {args.depths}",
        used == CHOSEN, **used))
    return lines


def variants(args: argparse.Namespace, depth: int) -> list[Variant]:
    found = [Variant(p) for p in args.parameterisations]
    if depth in args.inference_steps_per_depth:
        found.append(Variant("mupc", sweeps=-1))
    return found


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    data = load_data()
    if args.compile_probe is not None:
        jax.jit(lambda v: v + 1)(1.0)  # the backend starts before the clock
        print(json.dumps(compile_once(args.compile_probe, args, data)))
        return
    with open(args.out, "w") if args.out else contextlib.nullcontext() as sink:
        study(args, data, sink)


def study(args: argparse.Namespace, data: Data, sink: TextIO | None) -> None:
    """The runs, their summaries, the timing and the targets, each line printed (and
    written to `sink`) as soon as it is known."""

    def emit(line: dict[str, Any]) -> None:
        text = json.dumps(line)
        print(text, flush=True)
        if sink is not None:
            sink.write(text + "\n")
            sink.flush()

    emit({"config": {k: v for k, v in vars(args).items() if k not in ("out", "compile_probe")},
          "device": str(jax.devices()[0]), "jax": jax.__version__})
    compiled: dict[tuple[str, int], Any] = {}
    runs = []
    for seed in range(args.seeds):
        for depth in args.depths:
            for variant in variants(args, depth):
                runs.append(train_run(variant, depth, seed, data, args, compiled))
                emit(runs[-1])
    compiled.clear()
    summaries = summarise(runs)
    for line in summaries:
        emit(line)
    timings = timing_lines(args, data) if "mupc" in args.parameterisations else []
    for line in timings:
        emit(line)
    for line in target_lines(summaries, timings, args):
        emit(line)


if __name__ == "__main__":
    main()
