"""Transactional steps: a step that produces a NaN or an infinity is not committed.

The guard lives inside the compiled program (`jnp.where(committed, new, old)` over the state),
so the old state comes back bit for bit although its buffers were donated; the step is counted
as skipped and `nonfinite_part()` / `report()` name the part. Policies `"skip"` (default),
`"raise"` (raise at the next call) and `"ignore"` (commit anyway); with `run` the same holds
per inner step. The guard's memory cost is measured from the compiled program.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_bitwise_equal, host_leaves, linear_params, normal

import fusedpc
from fusedpc import frozen

OVERFLOW_RATE = 1e38  # times a gradient entry above 3.4 in size: beyond float32's 3.4e38
SAFE_RATE = 0.01


def _tree(optimiser: optax.GradientTransformation) -> fusedpc.Sequential:
    """linear 4 -> 4 (frozen), tanh, learning network 4 -> 5 -> 3, layer norm (frozen)."""
    network = fusedpc.PCNetwork([4, 5, 3], "tanh", key=jax.random.key(1))
    return fusedpc.Sequential(
        [
            frozen.linear(*linear_params(0, 4, 4)),
            frozen.tanh(),
            fusedpc.LearningNetwork(network, optimiser=optimiser),
            frozen.layer_norm(width=3),
        ]
    )


def _switchable_tree() -> fusedpc.Sequential:
    # The rate is a state leaf (`opt_state.hyperparams`), so it can be switched between steps.
    return _tree(optax.inject_hyperparams(optax.sgd)(learning_rate=SAFE_RATE))


def _set_rate(pipeline: fusedpc.FusedPipeline, rate: float) -> None:
    """Switch the learning network's rate, keeping the step counters."""
    state = eqx.tree_at(
        lambda s: s.parts[2].opt_state.hyperparams["learning_rate"],
        pipeline.state,
        jnp.asarray(rate, jnp.float32),
    )
    pipeline.set_state(state, pipeline.steps, pipeline.skipped_steps)


def _batch(seed: int = 0) -> tuple[jax.Array, jax.Array]:
    # Targets of size ~10 give gradient entries well above 3.4: a rate of 1e38 overflows.
    return normal(seed, (6, 4)), 10.0 * normal(seed + 1, (6, 3))


def _learning_leaves(pipeline: fusedpc.FusedPipeline) -> list[np.ndarray]:
    return host_leaves(pipeline.state.parts[2].params)


# --------------------------------------------------------------------------- "skip"
def test_overflowing_rate_is_not_committed_and_training_continues():
    pipeline = fusedpc.FusedPipeline(_switchable_tree())
    x, target = _batch()
    pipeline.step(x, target)
    assert bool(pipeline.last_metrics.committed) and pipeline.skipped_steps == 0

    _set_rate(pipeline, OVERFLOW_RATE)
    kept = host_leaves(pipeline.state)
    old_buffers = jax.tree_util.tree_leaves(pipeline.state)
    structure = jax.tree_util.tree_structure(pipeline.state)
    pipeline.step(x, target)

    assert not bool(pipeline.last_metrics.committed)
    assert (pipeline.steps, pipeline.skipped_steps) == (2, 1)
    # The old state was donated (its buffers are dead) and still came back bit for bit: the
    # choice between new and old happened inside the program, not on the host.
    assert all(leaf.is_deleted() for leaf in old_buffers)
    assert jax.tree_util.tree_structure(pipeline.state) == structure
    assert_bitwise_equal(kept, pipeline.state)
    # The learning network's update overflowed; the layer norm behind it stayed finite.
    assert pipeline.nonfinite_part() == "parts[2]"
    (row,) = pipeline.report()
    assert row["part"] == "parts[2]" and row["finite"] is False
    assert not np.isfinite(row["update_norm"])
    # Skipped steps accumulate, and the state still does not move.
    pipeline.step(x, target)
    assert (pipeline.steps, pipeline.skipped_steps) == (3, 2)
    assert_bitwise_equal(kept, pipeline.state)

    # Back to a sane rate: the next step commits and really learns.
    _set_rate(pipeline, SAFE_RATE)
    before = _learning_leaves(pipeline)
    pipeline.step(x, target)
    assert bool(pipeline.last_metrics.committed)
    assert (pipeline.steps, pipeline.skipped_steps) == (4, 2)
    assert pipeline.nonfinite_part() is None and pipeline.report()[0]["finite"] is True
    after = _learning_leaves(pipeline)
    assert all(np.isfinite(a).all() for a in after)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))


# --------------------------------------------------------------------------- "raise"
def test_raise_policy_raises_at_the_next_call_naming_the_part():
    pipeline = fusedpc.FusedPipeline(_switchable_tree(), nonfinite="raise")
    x, target = _batch()
    _set_rate(pipeline, OVERFLOW_RATE)
    kept = host_leaves(pipeline.state)
    pipeline.step(x, target)  # the bad step itself returns: its values are still on device
    assert (pipeline.steps, pipeline.skipped_steps) == (1, 1)
    assert_bitwise_equal(kept, pipeline.state)

    buffers = jax.tree_util.tree_leaves(pipeline.state)
    with pytest.raises(
        fusedpc.NonFiniteStepError,
        match=r"step 0 of the last call produced a non-finite value first in part 'parts\[2\]'",
    ):
        pipeline.step(x, target)
    # The call that raised ran nothing: nothing donated, nothing counted.
    assert not any(leaf.is_deleted() for leaf in buffers)
    assert (pipeline.steps, pipeline.skipped_steps) == (1, 1)
    assert_bitwise_equal(kept, pipeline.state)

    # Reported once; with a sane rate training goes on.
    _set_rate(pipeline, SAFE_RATE)
    pipeline.step(x, target)
    pipeline.step(x, target)
    assert (pipeline.steps, pipeline.skipped_steps) == (3, 1)


def test_overflow_outside_every_part_metric_is_still_named():
    # Adam's second moment g^2 overflows while its update m / sqrt(v) stays finite (it is 0):
    # the parts' own flags are all finite, so the state leaf is named instead.
    network = fusedpc.PCNetwork([4, 5, 3], "relu", key=jax.random.key(1))
    tree = fusedpc.Sequential(
        [fusedpc.LearningNetwork(network, optimiser=optax.adam(1e-3)), frozen.relu()]
    )
    pipeline = fusedpc.FusedPipeline(tree, nonfinite="raise")
    x, target = _batch()
    kept = host_leaves(pipeline.state)
    pipeline.step(1e10 * x, target)
    assert pipeline.skipped_steps == 1
    assert pipeline.report()[0]["finite"] is True
    name = pipeline.nonfinite_part()
    assert name is not None and name.startswith("parts[0].opt_state")
    assert_bitwise_equal(kept, pipeline.state)
    with pytest.raises(fusedpc.NonFiniteStepError, match=r"first in part 'parts\[0\]\.opt_state"):
        pipeline.step(x, target)


# --------------------------------------------------------------------------- "ignore"
def test_ignore_policy_commits_non_finite_values():
    pipeline = fusedpc.FusedPipeline(_switchable_tree(), nonfinite="ignore")
    _set_rate(pipeline, OVERFLOW_RATE)
    frozen_before = host_leaves(pipeline.state.parts[0])
    x, target = _batch()
    pipeline.step(x, target)
    assert bool(pipeline.last_metrics.committed)
    assert (pipeline.steps, pipeline.skipped_steps) == (1, 0)
    learned = _learning_leaves(pipeline)
    assert not all(np.isfinite(a).all() for a in learned), "the overflow was committed"
    assert_bitwise_equal(frozen_before, pipeline.state.parts[0])
    # The report still says where it happened.
    assert pipeline.nonfinite_part() == "parts[2]"
    assert pipeline.report()[0]["finite"] is False


# --------------------------------------------------------------------------- run: per inner step
def test_run_guards_every_inner_step():
    xs = jnp.stack([normal(10 + 2 * i, (6, 4)) for i in range(3)])
    targets = jnp.stack([normal(11 + 2 * i, (6, 3)) for i in range(3)])
    # A NaN in the second batch reaches the output: the first part to see a non-finite value in
    # backward order is the last one, parts[3].
    poisoned = xs.at[1, 0, 0].set(jnp.nan)

    scanned = fusedpc.FusedPipeline(_tree(optax.sgd(0.05)))
    ys, _, metrics = scanned.run(poisoned, targets)
    np.testing.assert_array_equal(np.asarray(metrics.committed), [True, False, True])
    assert (scanned.steps, scanned.skipped_steps) == (3, 1)
    assert [scanned.nonfinite_part(i) for i in range(3)] == [None, "parts[3]", None]
    assert [row["finite"] for row in scanned.report(1)] == [False]
    assert [row["finite"] for row in scanned.report(2)] == [True]

    # Steps 1 and 3 committed, step 2 did not: the same as two separate clean steps, bit for
    # bit (run is a scan of the very same step).
    stepped = fusedpc.FusedPipeline(_tree(optax.sgd(0.05)))
    y0, _ = stepped.step(xs[0], targets[0])
    y2, _ = stepped.step(xs[2], targets[2])
    assert_bitwise_equal(host_leaves(stepped.state), scanned.state)
    assert np.array_equal(np.asarray(ys[0]), np.asarray(y0))
    assert np.array_equal(np.asarray(ys[2]), np.asarray(y2))


# --------------------------------------------------------------------------- memory
def _compiled_memory(pipeline: fusedpc.FusedPipeline, x, target):
    program = jax.jit(pipeline.program.step, donate_argnums=(0,))
    return program.lower(pipeline.carry, x, target).compile().memory_analysis()


def _nbytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


def test_guard_keeps_no_second_copy_of_the_state():
    # A big frozen matrix and a small learning part: the guard's extra scratch memory is at
    # most about one copy of what the step updates (the learning part's parameters and
    # optimiser state), never of the whole state, and the whole state stays donated.
    def pipeline(policy):
        network = fusedpc.PCNetwork([64, 16, 8], "tanh", key=jax.random.key(1))
        tree = fusedpc.Sequential(
            [
                frozen.linear(normal(0, (64, 64))),
                frozen.tanh(),
                fusedpc.LearningNetwork(network, optimiser=optax.adam(1e-3)),
                frozen.layer_norm(width=8),
            ]
        )
        return fusedpc.FusedPipeline(tree, nonfinite=policy)

    x, target = normal(1, (8, 64)), normal(2, (8, 8))
    guarded, unguarded = pipeline("skip"), pipeline("ignore")
    state_bytes = _nbytes(guarded.state)
    learning_bytes = _nbytes(guarded.state.parts[2])
    skip = _compiled_memory(guarded, x, target)
    ignore = _compiled_memory(unguarded, x, target)
    counters = _nbytes(guarded.carry.counters)
    for stats in (skip, ignore):
        assert stats.alias_size_in_bytes == state_bytes + counters, "the state must be donated"
    extra = skip.temp_size_in_bytes - ignore.temp_size_in_bytes
    # 1.25: XLA pads every scratch buffer (alignment), a few dozen bytes per leaf.
    assert extra <= 1.25 * learning_bytes, (extra, learning_bytes, state_bytes)
    assert extra < 0.5 * state_bytes
