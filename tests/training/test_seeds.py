"""Many seeds in one compiled program (`fusedpc.training.seeds.train_seeds`): each vmapped run
is the run `fusedpc train` makes with that seed, to the float32 floor."""

from __future__ import annotations

import dataclasses
import io

import jax
import numpy as np
import pytest

import fusedpc
from fusedpc.training import _setup, data
from fusedpc.training.seeds import shared_program, train_runs, train_seeds

TINY = fusedpc.GPTConfig(width=16, n_heads=2, n_blocks=1, ff_width=32, max_len=16)


def _alone(config: fusedpc.TrainConfig):
    """The seed's run as `fusedpc train` builds it (its pipeline, its batches), stepped."""
    _, tok, train_ids, val_ids = _setup.load_tokens(config)
    pipeline = _setup.build_pipeline(config, tok.vocab_size)
    batches = data.BatchIterator(train_ids, config.batch, config.model.max_len,
                                 seed=config.seed)
    losses = []
    for _ in range(config.steps):
        x, y = batches.next_batch()
        pipeline.step(x, y)
        losses.append(pipeline.last_loss)
    return pipeline, np.asarray(losses)


@pytest.mark.slow
def test_each_vmapped_seed_is_that_seed_trained_alone():
    # SGD: under Adam a weight whose exact gradient is zero (the attention keys' bias: softmax
    # ignores a shift shared by every key) is stepped by its rounding noise, normalised to a
    # full-size step, so the two programs' last-bit differences there become lr-sized
    config = fusedpc.TrainConfig(steps=6, batch=4, eval_every=3, eval_batches=2, model=TINY,
                                 optimiser="sgd", lr=0.05)
    runs = train_seeds(config, [0, 3])
    assert runs.val_loss.shape == (2, 2) and list(runs.steps) == [3, 6]
    assert runs.train_loss.shape == (2, 6) and list(runs.skipped) == [0, 0]
    assert abs(runs.val_loss[0, -1] - runs.val_loss[1, -1]) > 1e-4  # independent seeds
    for i, seed in enumerate(runs.seeds):
        pipeline, losses = _alone(dataclasses.replace(config, seed=seed))
        np.testing.assert_allclose(runs.train_loss[i], losses, rtol=2e-6)
        alone = jax.tree_util.tree_leaves(pipeline.carry.state)
        stacked = jax.tree_util.tree_leaves(runs.carry.state)
        for a, s in zip(alone, stacked, strict=True):
            a, s = np.asarray(a, np.float64), np.asarray(s[i], np.float64)
            assert np.linalg.norm(a - s) <= 1e-6 * max(np.linalg.norm(a), 1e-30) + 1e-9


def test_bad_seed_lists_are_refused():
    config = fusedpc.TrainConfig(steps=1, model=TINY)
    for seeds in ([], [1, 1], [-2]):
        with pytest.raises(ValueError, match="seeds: expected distinct non-negative integers"):
            train_seeds(config, seeds)


def _weights(state):
    """The state's leaves without its rate multipliers (a run built alone has none)."""
    from fusedpc.training import RateMultiplierState

    bare = jax.tree_util.tree_map(
        lambda n: None if isinstance(n, RateMultiplierState) else n, state,
        is_leaf=lambda n: isinstance(n, RateMultiplierState))
    return jax.tree_util.tree_leaves(bare)


@pytest.mark.slow
def test_runs_of_other_rates_share_one_program_and_each_equals_its_run_alone():
    # SGD for the reason given in the test above
    config = fusedpc.TrainConfig(steps=6, batch=4, eval_every=3, eval_batches=2, model=TINY,
                                 optimiser="sgd", lr=0.05)
    configs = [config, dataclasses.replace(config, lr=0.2),
               dataclasses.replace(config, seed=2, slot_lr_scales="head=4,attention=0.5")]
    runs = train_runs(configs)
    assert runs.seeds == (0, 0, 2) and runs.val_loss.shape == (3, 2)
    assert runs.tokens_per_s is not None and runs.tokens_per_s > 0
    assert abs(runs.val_loss[0, -1] - runs.val_loss[1, -1]) > 1e-4  # the rate tells
    from fusedpc.training import rate_multipliers

    third = jax.tree_util.tree_map(lambda a: a[2], runs.carry.state)
    assert rate_multipliers(third) == pytest.approx(
        {"token": 0.05, "position": 0.05, "attention": 0.025, "feed_forward": 0.05,
         "norm": 0.05, "head": 0.2})
    for i, c in enumerate(configs):
        pipeline, losses = _alone(c)
        np.testing.assert_allclose(runs.train_loss[i], losses, rtol=2e-6)
        alone = _weights(pipeline.carry.state)
        stacked = _weights(runs.select([i]).carry.state)
        for a, s in zip(alone, stacked, strict=True):
            a, s = np.asarray(a, np.float64), np.asarray(s[0], np.float64)
            assert np.linalg.norm(a - s) <= 1e-6 * max(np.linalg.norm(a), 1e-30) + 1e-9


def test_runs_of_one_program_may_differ_only_in_seed_and_rates():
    config = fusedpc.TrainConfig(steps=1, model=TINY)
    other = dataclasses.replace(config, model=dataclasses.replace(TINY, n_blocks=2))
    with pytest.raises(ValueError, match=r"differ only in the seed and the rates .*'n_blocks' "
                                         r"is 1 in the first and 2 in another"):
        train_runs([config, other])
    with pytest.raises(ValueError, match="at least one run"):
        train_runs([])
    synaptic = dataclasses.replace(config, model=dataclasses.replace(
        TINY, learning_kind="synaptic_uncertainty"))
    assert shared_program(synaptic).lr == config.lr  # its rule takes no optimiser rate
    assert shared_program(config) == shared_program(dataclasses.replace(config, lr=0.5,
                                                                        seed=4))
    with pytest.raises(ValueError, match=r"differ only in the seed; 'lr'"):
        train_runs([synaptic, dataclasses.replace(synaptic, lr=0.5)])


@pytest.mark.slow
def test_a_calibrated_run_of_a_study_is_the_calibrated_run_trained_alone(tmp_path):
    from fusedpc.training import rate_multipliers

    config = fusedpc.TrainConfig(steps=8, batch=4, eval_every=4, eval_batches=1, model=TINY,
                                 optimiser="sgd", lr=0.05, steps_per_call=2,
                                 calibrate="auto", calibrate_at=4, probe_steps=2,
                                 sample_tokens=0)
    runs = train_seeds(config, [0, 1])
    assert [c["step"] for c in runs.calibrations] == [4, 4]
    for i, seed in enumerate(runs.seeds):
        alone = fusedpc.train(dataclasses.replace(config, seed=seed), tmp_path / str(seed),
                              stream=io.StringIO())
        assert runs.val_loss[i, -1] == pytest.approx(alone.val_loss, rel=1e-5)
        chosen = rate_multipliers(alone.pipeline.state)
        assert any(m != 1 for m in chosen.values())  # the trials changed the rates
        assert runs.calibrations[i]["multipliers"] == pytest.approx(chosen)
        mine = jax.tree_util.tree_map(lambda a, i=i: a[i], runs.carry.state)
        assert rate_multipliers(mine) == pytest.approx(chosen)
