"""Relaxation schedules side by side on the digits: the standard relaxation (T sweeps, then
the learning walk), incremental PC (the weights step at every sweep) and adaptive inference
(sweeps until the energy settles, at most T), on a μPC residual network whose every block
boundary is a latent.

Each run trains `--steps` steps (batch 64, Adam, the same batches per seed) on scikit-learn's
bundled digits (pixels / 16; the rows of `np.random.default_rng(0).permutation` after the
first 360 train, those 360 are held out) and prints one JSON line: held-out accuracy, the
mean of the last 20 training losses, the sweeps the relaxation ran (mean over steps), the step
time (median over timed calls of 10 steps, the schedules interleaved call by call) and the
refused steps. Then one summary line per schedule (mean and standard deviation over seeds).

    python scripts/pc_schedules_digits.py                    # depth 8, width 64, T = 8, 3 seeds
    python scripts/pc_schedules_digits.py --quick            # 1 seed, 30 steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jax
import numpy as np
import optax

import fusedpc


def digits() -> tuple[np.ndarray, ...]:
    """`(x_train, y_train, x_test, y_test)`: the bundled digits, pixels / 16."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(x))
    test, train = order[:360], order[360:]
    return x[train], data.target[train], x[test], data.target[test]


def schedules(steps: int, rate: float, tolerance: float) -> dict[str, fusedpc.Relaxation]:
    """Schedule name -> its relaxation."""
    return {
        "standard": fusedpc.Relaxation(steps=steps, rate=rate),
        "incremental": fusedpc.Relaxation(steps=steps, rate=rate, incremental=True),
        "adaptive": fusedpc.Relaxation(steps=steps, rate=rate, tolerance=tolerance),
    }


class Run:
    """One schedule's compiled step on one seed's network, trained call by call."""

    def __init__(self, args: argparse.Namespace, relaxation: fusedpc.Relaxation, seed: int):
        tree = fusedpc.residual_pc_network(64, args.width, 10, args.depth,
                                           optimiser=optax.adam(args.lr),
                                           key=jax.random.key(seed))
        self.program = fusedpc.make_step(tree, relaxation=relaxation)
        self.carry = self.program.init(jax.random.key(seed))
        self.step = jax.jit(self.program.step, donate_argnums=0)
        self.losses: list[float] = []
        self.sweeps: list[int] = []
        self.times: list[float] = []

    def call(self, batches: list[tuple[np.ndarray, np.ndarray]], timed: bool) -> None:
        start = time.perf_counter()
        outs = []
        for x, y in batches:
            self.carry, out = self.step(self.carry, x, y)
            outs.append(out.metrics)
        jax.block_until_ready(self.carry)
        if timed:
            self.times.append((time.perf_counter() - start) / len(batches))
        for metrics in jax.device_get(outs):
            self.losses.append(float(metrics.loss))
            self.sweeps.append(int(metrics.relaxation.steps))

    def row(self, x_test: np.ndarray, y_test: np.ndarray) -> dict[str, Any]:
        predicted = np.argmax(np.asarray(self.program.predict(self.carry.state, x_test)), -1)
        finite = [v for v in self.losses[-20:] if np.isfinite(v)]
        return {"accuracy": round(float(np.mean(predicted == y_test)), 4),
                "train_loss": round(statistics.mean(finite), 5) if finite else None,
                "sweeps_mean": round(statistics.mean(self.sweeps), 2),
                "step_ms": round(1e3 * statistics.median(self.times), 3) if self.times else None,
                "skipped_steps": int(self.carry.counters.skipped)}


def train_seed(args: argparse.Namespace, seed: int, data: tuple[np.ndarray, ...]) -> list[dict]:
    """Every schedule on one seed, interleaved call by call (10 steps a call)."""
    x_train, y_train, x_test, y_test = data
    onehot = np.eye(10, dtype=np.float32)
    runs = {name: Run(args, relaxation, seed)
            for name, relaxation in schedules(args.inference_steps, args.inference_rate,
                                              args.tolerance).items()}
    rows = np.random.default_rng(seed)
    for call in range(args.steps // 10):
        picks = [rows.choice(len(x_train), 64, replace=False) for _ in range(10)]
        batches = [(x_train[p], onehot[y_train[p]]) for p in picks]
        for run in runs.values():
            run.call(batches, timed=call > 0)
    return [{"schedule": name, "seed": seed, "steps": args.steps, "depth": args.depth,
             "width": args.width, "inference_steps": args.inference_steps,
             **run.row(x_test, y_test)} for name, run in runs.items()]


def _spread(rows: list[dict], field: str) -> tuple[float, float]:
    """Mean and standard deviation of `field` over `rows` (NaN when none has it)."""
    values = [r[field] for r in rows if r[field] is not None]
    if not values:
        return float("nan"), float("nan")
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return round(statistics.mean(values), 4), round(std, 4)


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for name in dict.fromkeys(r["schedule"] for r in rows):
        mine = [r for r in rows if r["schedule"] == name]
        accuracy, step_ms, sweeps = (_spread(mine, f) for f in ("accuracy", "step_ms",
                                                                "sweeps_mean"))
        out.append({"summary": name, "seeds": len(mine), "accuracy_mean": accuracy[0],
                    "accuracy_std": accuracy[1], "step_ms_mean": step_ms[0],
                    "sweeps_mean": sweeps[0],
                    "skipped_steps": sum(r["skipped_steps"] for r in mine)})
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="a multiple of 10")
    parser.add_argument("--inference-steps", type=int, default=8)
    parser.add_argument("--inference-rate", type=float, default=0.1)
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="the adaptive schedule's relative energy change")
    parser.add_argument("--lr", type=float, default=0.1, help="Adam's rate (μPC's)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 30 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps = 1, 30
    if args.steps < 20 or args.steps % 10:
        parser.error(f"--steps must be a multiple of 10, at least 20, got {args.steps}")
    data = digits()
    rows = []
    for seed in range(args.seeds):
        for row in train_seed(args, seed, data):
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = summarise(rows)
    for row in summary:
        print(json.dumps(row), flush=True)
    return rows + summary


if __name__ == "__main__":
    main()
