"""scripts/flat_state_probe.py: every variant is the same training step (the same first
loss, the same state after a few steps), and it prints one JSON row per variant."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def probe():
    return load_script("flat_state_probe")


def test_the_flat_and_per_leaf_steps_train_alike(probe):
    x, y, params = probe._problem()
    trained = {}
    for name, (step, init) in {"per_leaf": probe.per_leaf(None),
                               "per_leaf_guarded": probe.per_leaf("both"),
                               "flat_guarded_whole": probe.flat("whole", params),
                               "flat_inside_guarded": probe.flat_inside(params)}.items():
        carry = init(jax.tree_util.tree_map(jax.numpy.copy, params))
        for _ in range(3):
            carry, loss = jax.jit(step)(carry, x, y)
        trained[name] = (np.asarray(jax.flatten_util.ravel_pytree(carry[0])[0]), float(loss))
    theta, loss = trained["per_leaf"]
    for name, (other, other_loss) in trained.items():
        np.testing.assert_allclose(other, theta, rtol=1e-5, atol=1e-6, err_msg=name)
        assert other_loss == pytest.approx(loss, rel=1e-6), name
    # a non-finite batch: the guarded steps keep their state
    for name, (step, init) in {"per_leaf_guarded": probe.per_leaf("both"),
                               "flat_guarded_whole": probe.flat("whole", params),
                               "flat_inside_guarded": probe.flat_inside(params)}.items():
        carry = init(jax.tree_util.tree_map(jax.numpy.copy, params))
        kept, _ = jax.jit(step)(carry, x * np.nan, y)
        for a, b in zip(jax.tree_util.tree_leaves(kept), jax.tree_util.tree_leaves(carry)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_it_prints_a_row_per_variant(probe, capsys):
    assert probe.main(["--rounds", "1", "--calls", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["variant"] for r in rows] == [
        "per_leaf", "per_leaf_guarded", "per_leaf_sums_only", "per_leaf_selects_only", "flat",
        "flat_guarded", "flat_guarded_whole", "flat_inside_guarded"]
    assert len({r["first_loss"] for r in rows}) == 1
    assert all(r["step_ms"] > 0 and r["fusions"] > 0 for r in rows)
