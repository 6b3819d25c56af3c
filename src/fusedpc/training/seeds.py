"""Many seeds of one run in one compiled program: `train_seeds(config, seeds)`, and runs
that differ in their seed and their rates in one program: `train_runs(configs)`.

Every seed is the run `fusedpc train` makes with `seed = s` (its weights from
`jax.random.key(s)`, its batches from `BatchIterator(..., seed=s)`, its validation windows
from `seed=s`), and all of them step together: the carries are stacked on a leading axis of
size N and one `jax.jit(jax.vmap(program.step))` steps them all, one compile and one call per
step. The pure step holds no arrays, so any seed's program serves every seed; the trees are
built under `jax.vmap` from the stacked keys.

Run i equals seed `seeds[i]` trained alone to the float32 floor, not bit for bit: under `vmap`
the matrix products of the N seeds are one batched product, whose summation order XLA may
choose differently from the lone product's (tested: `tests/training/test_seeds.py`). Runs
of other rates than the first hold their rates as multipliers in the state (`RATE_SETTINGS`),
and equal the lone runs to the same floor.
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

from fusedpc.execution._pipeline import FusedPipeline
from fusedpc.execution._program import make_step
from fusedpc.execution._step_types import StepCarry, fresh_counters
from fusedpc.training import data
from fusedpc.training._config import TrainConfig
from fusedpc.training._evaluate import batch_losses, cross_entropy
from fusedpc.training._probe import probe_rates
from fusedpc.training._rates import (
    RateMultiplierState,
    gpt_slot,
    rate_multipliers,
    set_rate_multipliers,
)
from fusedpc.training._settings import config_settings
from fusedpc.training._setup import build_part, load_tokens, model_relaxation
from fusedpc.transformer._slots import SLOTS


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
        tokens_per_s: training tokens per second of every run together, over the steps
            after the first (evaluations and calibration trials left out); None for a
            one-step run.
        calibrations: with `calibrate`, each run's calibration (`probe_rates`'s record, its
            step and the multipliers chosen), in run order; else empty.
    """

    seeds: tuple[int, ...]
    steps: np.ndarray
    val_loss: np.ndarray
    train_loss: np.ndarray
    skipped: np.ndarray
    carry: Any
    compile_s: float
    wall_s: float
    tokens_per_s: float | None = None
    calibrations: tuple[dict[str, Any], ...] = ()

    def select(self, runs: Sequence[int]) -> SeedRuns:
        """The runs at the indices `runs` (their curves, losses and carries); the times are
        the whole program's, shared by every run in it."""
        index = np.asarray(runs)
        return dataclasses.replace(
            self, seeds=tuple(self.seeds[i] for i in runs), val_loss=self.val_loss[index],
            train_loss=self.train_loss[index], skipped=self.skipped[index],
            calibrations=tuple(self.calibrations[i] for i in runs) if self.calibrations
            else (),
            carry=jax.tree_util.tree_map(lambda a: a[index], self.carry))


RATE_SETTINGS = ("lr", "slot_lr_scales")
"""The settings whose values can live in the state: runs that differ only in these (and their
seed) share one compiled program (`train_runs`). Each run's optimisers are built at rate 1
with a rate multiplier in their state (`with_rate_multiplier`) set to the run's rate times its
slot's scale: the update $m\\,(1 \\cdot u)$ against the lone run's $\\eta\\,u$, the same
product in float32 for a constant rate (a schedule's $\\eta f(t)$ is rounded once more)."""


def shared_program(config: TrainConfig) -> TrainConfig:
    """`config` with what `train_runs` may vary within one program set aside (the seed, and
    the rates but under the synaptic rule, whose own steps do not take the optimiser's rate,
    and in a calibrated run, whose multipliers are the calibration's): runs whose
    `shared_program` is equal share a compiled step."""
    config = dataclasses.replace(config, seed=0)
    if config.model.learning_kind == "synaptic_uncertainty" or config.calibrate != "none":
        return config
    return dataclasses.replace(config, lr=1.0, slot_lr_scales="")


def _run_multipliers(config: TrainConfig) -> dict[str | None, float]:
    """The rate multiplier of each GPT slot (`gpt_slot`; `None` for the rest) of a run built
    at rate 1: its rate times the slot's scale."""
    scales = config.lr_scales()
    return {None: config.lr, **{slot: config.lr * scales.get(slot, 1.0) for slot in SLOTS}}


def _with_multipliers(state: Any, runs: Sequence[dict[str | None, float]]) -> Any:
    """A stacked state (leading axis: the runs) with every rate multiplier set to its run's
    value for its slot."""

    def replace(path, node):
        if not isinstance(node, RateMultiplierState):
            return node
        slot = gpt_slot(jax.tree_util.keystr(path))
        values = jnp.asarray([run.get(slot, run[None]) for run in runs], node.multiplier.dtype)
        shape = node.multiplier.shape
        return RateMultiplierState(
            jnp.broadcast_to(values.reshape((-1,) + (1,) * (len(shape) - 1)), shape))

    return jax.tree_util.tree_map_with_path(
        replace, state, is_leaf=lambda n: isinstance(n, RateMultiplierState))


def _builder(config: TrainConfig, vocab_size: int, multipliers: bool):
    """`(build, gpt, relaxation)`: `build(key) -> part` as `fusedpc train` builds the run's
    model (`build_part`), its `GPTConfig`, its relaxation."""
    gpt = config.gpt_config(vocab_size)
    build = functools.partial(build_part, config, gpt, multipliers=multipliers)
    return build, gpt, model_relaxation(gpt)


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
    return train_runs([dataclasses.replace(config, seed=s) for s in seeds],
                      tokenizer=tokenizer, eval_every=eval_every)


def train_runs(configs: Sequence[TrainConfig], *, tokenizer: Any = None,
               eval_every: int | None = None) -> SeedRuns:
    """Train every run of `configs` in one vmapped compiled step: runs that differ only in
    their seed and their rates (`RATE_SETTINGS`; `shared_program` says what must agree).

    Args:
        configs: the runs, each as `fusedpc train` would make it.
        tokenizer, eval_every: as for `train_seeds` (`eval_every` defaults to the first
            run's).

    Raises:
        ValueError: for no runs, or runs that differ in anything else (the message names the
            first such setting), or a negative seed.
    """
    configs = list(configs)
    if not configs:
        raise ValueError("configs: expected at least one run, got none.")
    _check_shared(configs)
    first = configs[0]
    every = first.eval_every if eval_every is None else int(eval_every)
    if every < 1:
        raise ValueError(f"eval_every: expected an integer >= 1, got {every}.")
    rates = {(c.lr, tuple(sorted(c.lr_scales().items()))) for c in configs}
    multipliers = len(rates) > 1
    base = shared_program(first) if multipliers else first
    _, tok, train_ids, val_ids = load_tokens(base, None, tokenizer)
    build, gpt, relaxation = _builder(base, tok.vocab_size, multipliers)
    keys = jnp.stack([jax.random.key(c.seed) for c in configs])
    program = make_step(build(keys[0]), gpt.error_fn, settings=base.step_settings,
                        relaxation=relaxation)
    carry = jax.vmap(lambda key: StepCarry(build(key).init_state(key), fresh_counters()))(keys)
    if multipliers:
        carry = StepCarry(_with_multipliers(carry.state, [_run_multipliers(c) for c in configs]),
                          carry.counters)
    seeds = [c.seed for c in configs]
    calibration = None if base.calibrate == "none" else _Calibration(
        base, build(keys[0]), gpt, relaxation, val_ids, seeds)
    return _train(program, carry, base, seeds, train_ids, val_ids, every,
                  gpt.head_kind == "categorical", calibration)


def _check_shared(configs: list[TrainConfig]) -> None:
    for config in configs:
        if config.seed < 0:
            raise ValueError(f"seed: expected a non-negative integer, got {config.seed}.")
    settings = [config_settings(shared_program(c)) for c in configs]
    for name, value in settings[0].items():
        other = next((s[name] for s in settings[1:] if s[name] != value), value)
        if other != value:
            synaptic = configs[0].model.learning_kind == "synaptic_uncertainty"
            varied = "the seed" + ("" if synaptic else " and the rates (lr, slot_lr_scales)")
            raise ValueError(f"configs: runs of one program may differ only in {varied}; "
                             f"{name!r} is {value!r} in the first and {other!r} in another.")


class _Calibration:
    """`fusedpc train --calibrate`'s trials, run by run: at the calibration step each run's
    state goes into one pipeline (compiled once for all), `probe_rates` tries its rates on
    the run's next `probe_steps` batches (its data position restored) scored on its own probe
    windows (the validation split at seed + 1), and the chosen multipliers go back into the
    run's state, as `fusedpc train` does it."""

    def __init__(self, config: TrainConfig, part, gpt, relaxation, val_ids, seeds: list[int]):
        self.config, self.step = config, config.calibration_step()
        self.pipeline = FusedPipeline(part, gpt.error_fn, settings=config.step_settings,
                                      relaxation=relaxation)
        self.probabilities = gpt.head_kind == "categorical"
        self.probes = [data.BatchIterator(val_ids, config.batch, config.model.max_len,
                                          seed=s + 1).next_batches(config.eval_batches)
                       for s in seeds]
        self.records: list[dict[str, Any]] = []

    def __call__(self, carry: StepCarry, batches: list[data.BatchIterator]) -> StepCarry:
        config, pipeline = self.config, self.pipeline
        states = []
        for i, iterator in enumerate(batches):
            position = iterator.step
            xs, ys = iterator.next_batches(config.probe_steps)
            iterator.step = position
            one = jax.tree_util.tree_map(lambda a, i=i: a[i], carry)
            pipeline.set_state(one.state, counters=one.counters)
            held_x, held_y = self.probes[i]

            def score(p: FusedPipeline, held_x=held_x, held_y=held_y) -> np.ndarray:
                return batch_losses(p, held_x, held_y, self.probabilities)

            result = probe_rates(pipeline, xs, ys, groups=config.calibrated_slots(),
                                 per_call=config.steps_per_call, score=score)
            chosen = set_rate_multipliers(pipeline.state, result.multipliers)
            states.append(jax.tree_util.tree_map(jnp.copy, chosen))
            self.records.append({"step": self.step, **result.record(),
                                 "multipliers": rate_multipliers(chosen)})
        stacked = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *states)
        return StepCarry(stacked, carry.counters)


def _train(program, carry, config: TrainConfig, seeds: list[int], train_ids, val_ids,
           every: int, probabilities: bool, calibration: _Calibration | None) -> SeedRuns:
    """Step the stacked `carry` `config.steps` times, evaluating every `every` steps (and
    calibrating each run at its step, with `calibration`)."""
    step = jax.jit(jax.vmap(program.step), donate_argnums=0)
    predict = jax.jit(jax.vmap(program.predict))
    rows, length = config.batch, config.model.max_len
    batches = [data.BatchIterator(train_ids, rows, length, seed=s) for s in seeds]
    held = [data.BatchIterator(val_ids, rows, length, seed=s).next_batches(config.eval_batches)
            for s in seeds]
    points, val, losses = [], [], []
    start = time.perf_counter()
    compile_s = stepping = 0.0
    for done in range(1, config.steps + 1):
        if calibration is not None and done - 1 == calibration.step:
            carry = calibration(carry, batches)
        began = time.perf_counter()
        pairs = [b.next_batch() for b in batches]
        x = jnp.asarray(np.stack([p[0] for p in pairs]))
        y = jnp.asarray(np.stack([p[1] for p in pairs]))
        carry, out = step(carry, x, y)
        losses.append(out.metrics.loss)
        if done == 1:
            jax.block_until_ready(carry)
            compile_s = time.perf_counter() - start
        elif done % every == 0 or done == config.steps:
            jax.block_until_ready(carry)
        if done > 1:
            stepping += time.perf_counter() - began
        if done % every == 0 or done == config.steps:
            points.append(done)
            val.append(_validation(predict, carry.state, held, probabilities))
    train_loss = np.asarray(jax.device_get(jnp.stack(losses, axis=1)), np.float64)
    tokens = (config.steps - 1) * rows * length * len(seeds)
    return SeedRuns(tuple(seeds), np.asarray(points), np.stack(val, axis=1), train_loss,
                    np.asarray(jax.device_get(carry.counters.skipped)), carry, compile_s,
                    time.perf_counter() - start, tokens / stepping if stepping else None,
                    tuple(calibration.records) if calibration is not None else ())


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


__all__ = ["RATE_SETTINGS", "SeedRuns", "shared_program", "train_runs", "train_seeds"]
