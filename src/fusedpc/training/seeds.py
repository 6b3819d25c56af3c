"""Many seeds of one run in one compiled program: `train_seeds(config, seeds)`.

Every seed is the run `fusedpc train` makes with `seed = s` (its weights from
`jax.random.key(s)`, its batches from `BatchIterator(..., seed=s)`, its validation windows
from `seed=s`), and all of them step together: the carries are stacked on a leading axis of
size N and one `jax.jit(jax.vmap(program.step))` steps them all, one compile and one call per
step. The pure step holds no arrays, so any seed's program serves every seed; the trees are
built under `jax.vmap` from the stacked keys.

Run i equals seed `seeds[i]` trained alone to the float32 floor, not bit for bit: under `vmap`
the matrix products of the N seeds are one batched product, whose summation order XLA may
choose differently from the lone product's (tested: `tests/training/test_seeds.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.execution._program import make_step
from fusedpc.execution._step_types import StepCarry, fresh_counters
from fusedpc.training import data
from fusedpc.training._config import TrainConfig
from fusedpc.training._evaluate import cross_entropy
from fusedpc.training._setup import build_part, load_tokens, model_relaxation


@dataclasses.dataclass(frozen=True)
class SeedRuns:
    """What `train_seeds` hands back.

    Attributes:
        seeds: the seeds, in the order of every leading axis below.
        steps: the evaluation points (steps done), `(E,)`.
        val_loss: the validation cross-entropy of every seed at every point, `(N, E)`.
        train_loss: every step's training loss, `(N, steps)`.
        skipped: the steps each seed's guard refused, `(N,)`.
        carry: the final carries, stacked (`StepCarry` with a leading axis N).
        compile_s: seconds of the first call (tracing, compiling, one step).
        wall_s: seconds of the whole training, compile and evaluations included.
    """

    seeds: tuple[int, ...]
    steps: np.ndarray
    val_loss: np.ndarray
    train_loss: np.ndarray
    skipped: np.ndarray
    carry: Any
    compile_s: float
    wall_s: float


def _builder(config: TrainConfig, vocab_size: int):
    """`(build, gpt, relaxation)`: `build(key) -> part` as `fusedpc train` builds the run's
    model (`build_part`), its `GPTConfig`, its relaxation."""
    if config.calibrate != "none":
        raise ValueError("calibrate: a study of seeds runs without the calibration (its trials "
                         "are host-side decisions per run); set calibrate = 'none'.")
    gpt = config.gpt_config(vocab_size)
    return functools.partial(build_part, config, gpt), gpt, model_relaxation(gpt)


def train_seeds(config: TrainConfig, seeds: Sequence[int], *, tokenizer: Any = None,
                eval_every: int | None = None) -> SeedRuns:
    """Train `config` once per seed in `seeds`, all seeds in one vmapped compiled step.

    Args:
        config: the run (its `seed` is replaced by each of `seeds`; `steps`, `batch`,
            `eval_every` and `eval_batches` as for `fusedpc train`).
        seeds: distinct non-negative integers.
        tokenizer: a tokeniser of your own (as `fusedpc.train`'s).
        eval_every: evaluate every this many steps (default `config.eval_every`); the last
            step is always evaluated.
    """
    seeds = tuple(int(s) for s in seeds)
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"seeds: expected distinct non-negative integers, got {list(seeds)}.")
    every = config.eval_every if eval_every is None else int(eval_every)
    if every < 1:
        raise ValueError(f"eval_every: expected an integer >= 1, got {every}.")
    _, tok, train_ids, val_ids = load_tokens(config, None, tokenizer)
    build, gpt, relaxation = _builder(config, tok.vocab_size)
    keys = jnp.stack([jax.random.key(s) for s in seeds])
    program = make_step(build(keys[0]), gpt.error_fn, settings=config.step_settings,
                        relaxation=relaxation)
    carry = jax.vmap(lambda key: StepCarry(build(key).init_state(key), fresh_counters()))(keys)
    step = jax.jit(jax.vmap(program.step), donate_argnums=0)
    predict = jax.jit(jax.vmap(program.predict))
    rows, length = config.batch, config.model.max_len
    batches = [data.BatchIterator(train_ids, rows, length, seed=s) for s in seeds]
    held = [data.BatchIterator(val_ids, rows, length, seed=s).next_batches(config.eval_batches)
            for s in seeds]
    probabilities = gpt.head_kind == "categorical"
    points, val, losses = [], [], []
    start = time.perf_counter()
    compile_s = 0.0
    for done in range(1, config.steps + 1):
        pairs = [b.next_batch() for b in batches]
        x = jnp.asarray(np.stack([p[0] for p in pairs]))
        y = jnp.asarray(np.stack([p[1] for p in pairs]))
        carry, out = step(carry, x, y)
        losses.append(out.metrics.loss)
        if done == 1:
            jax.block_until_ready(carry)
            compile_s = time.perf_counter() - start
        if done % every == 0 or done == config.steps:
            points.append(done)
            val.append(_validation(predict, carry.state, held, probabilities))
    train_loss = np.asarray(jax.device_get(jnp.stack(losses, axis=1)), np.float64)
    return SeedRuns(seeds, np.asarray(points), np.stack(val, axis=1), train_loss,
                    np.asarray(jax.device_get(carry.counters.skipped)), carry, compile_s,
                    time.perf_counter() - start)


def _validation(predict, states, held: list[tuple[np.ndarray, np.ndarray]],
                probabilities: bool) -> np.ndarray:
    """Every seed's mean cross-entropy on its own validation batches `(N,)`."""
    per_seed: list[list[float]] = [[] for _ in held]
    for k in range(len(held[0][0])):
        x = jnp.asarray(np.stack([h[0][k] for h in held]))
        outputs = np.asarray(predict(states, x))
        for i, h in enumerate(held):
            per_seed[i].append(cross_entropy(outputs[i], h[1][k], probabilities))
    return np.asarray([np.mean(v) for v in per_seed])


__all__ = ["SeedRuns", "train_seeds"]
