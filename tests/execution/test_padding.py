"""Padding is said, not guessed: row masks on `step` and `run`.

A masked step follows the masked mean loss exactly (parity with its backprop twin on every
head, including rows that the head fits exactly), at the suite's XLA level and at XLA's
default level; `run` with masks equals K masked steps; a GPT with a masked sequence learns
as if that sequence were not there. `"active"` normalisation stays opt-in, and this file pins
the failure that made it so.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _padding_parity import check as padding_parity
from helpers import assert_tree_allclose, normal, run_at_default_level

import fusedpc

PARITY_TOLERANCE = 1e-5  # norm-relative, float32: the acceptance gate of the parity claims


def _assert_parity(result: dict) -> None:
    for head, errors in result.items():
        assert errors["padding_input_error_max"] == 0.0, head  # padding emits nothing
        for name, value in errors.items():
            assert value <= PARITY_TOLERANCE, f"{head} {name}: {value:.2e}"


@pytest.mark.gpu_parity
def test_masked_step_equals_the_masked_mean_twin_on_every_head():
    _assert_parity(padding_parity())


@pytest.mark.slow
def test_masked_step_parity_at_xla_default_optimisation_level():
    # A fresh process without the suite's level-0 flag: fusions there (softmax and the
    # subtraction into one rounding) are what broke padding by zero rows.
    _assert_parity(run_at_default_level(str(Path(__file__).with_name("_padding_parity.py"))))


def _tree():
    network = fusedpc.PCNetwork([4, 6, 3], "tanh", head="binary", key=jax.random.key(2))
    return fusedpc.LearningNetwork(network, optax.adam(1e-2))


def test_active_normalisation_mistakes_exact_fits_for_padding():
    # The documented failure of the opt-in mode: two real rows fitted exactly are taken for
    # padding, so the other rows' error is scaled by 8/6; "rows" (the default) is exact.
    network = fusedpc.PCNetwork([4, 6, 3], "tanh", head="binary", key=jax.random.key(2))
    x = normal(0, (8, 4))
    target = np.asarray((normal(1, (8, 3)) > 0), np.float32)
    fitted = fusedpc.FusedPipeline(fusedpc.LearningNetwork(network)).predict(x)
    target[1:3] = np.asarray(fitted)[1:3]
    input_errors = {}
    for mode in ("rows", "active"):
        pipeline = fusedpc.FusedPipeline(
            fusedpc.LearningNetwork(network, optax.sgd(0.1)), "sigmoid_cross_entropy", mode
        )
        input_errors[mode] = np.asarray(pipeline.step(x, target)[1])
    real = [0, 3, 4, 5, 6, 7]
    np.testing.assert_allclose(
        input_errors["active"][real], input_errors["rows"][real] * 8 / 6, rtol=1e-5, atol=1e-7
    )
    assert fusedpc.FusedPipeline(_tree()).error_normalisation == "rows"


def test_run_with_masks_equals_k_masked_steps():
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(4, 8, 4)).astype(np.float32)
    targets = (rng.normal(size=(4, 8, 3)) > 0).astype(np.float32)
    masks = rng.random((4, 8)) > 0.3
    stepped = fusedpc.FusedPipeline(_tree(), "sigmoid_cross_entropy")
    losses = []
    for x, t, m in zip(xs, targets, masks, strict=True):
        stepped.step(x, t, mask=m)
        losses.append(stepped.last_loss)
    scanned = fusedpc.FusedPipeline(_tree(), "sigmoid_cross_entropy")
    _, _, metrics = scanned.run(xs, targets, masks=masks)
    assert_tree_allclose(scanned.state, stepped.state, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(metrics.loss), losses, rtol=1e-6)


def test_a_masked_sequence_is_as_if_it_were_not_there():
    config = fusedpc.GPTConfig(
        vocab_size=11, width=8, n_heads=2, n_blocks=1, ff_width=16, max_len=8, learn="all"
    )
    part = fusedpc.build_gpt(config, optax.sgd(0.1), jax.random.key(0))[0]
    ids = np.random.default_rng(1).integers(0, 11, (3, 9)).astype(np.int32)
    x, t = ids[:, :-1], ids[:, 1:]
    mask = np.ones((3, 8), bool)
    mask[2] = False  # the third sequence is padding
    masked = fusedpc.FusedPipeline(part, "softmax_cross_entropy")
    masked.step(x, t, mask=mask)
    short = fusedpc.FusedPipeline(part, "softmax_cross_entropy")
    short.step(x[:2], t[:2])
    assert_tree_allclose(masked.state, short.state, rtol=1e-5, atol=1e-7)
    assert masked.last_loss == pytest.approx(short.last_loss, rel=1e-6)


def test_pad_rows_pads_a_last_partial_batch_and_says_which_rows_are_real():
    x, t = np.ones((5, 4), np.float32), np.ones((5, 3), np.float32)
    px, pt, mask = fusedpc.pad_rows(8, x, t)
    assert px.shape == (8, 4) and pt.shape == (8, 3)
    assert mask.tolist() == [True] * 5 + [False] * 3
    assert not px[5:].any() and not pt[5:].any()
    with pytest.raises(ValueError, match=r"rows: expected an integer >= the batch's 5 rows"):
        fusedpc.pad_rows(4, x, t)
    with pytest.raises(ValueError, match=r"arrays\[1\]: expected 5 rows on axis 0"):
        fusedpc.pad_rows(8, x, t[:4])


def test_bad_masks_are_refused_before_anything_is_donated():
    pipeline = fusedpc.FusedPipeline(_tree(), "sigmoid_cross_entropy")
    x, t = normal(0, (8, 4)), np.zeros((8, 3), np.float32)
    before = pipeline.state
    cases = [
        (np.ones((8, 1), bool), ValueError, r"mask: expected shape \(8,\) \(the output's shape"),
        (np.full(8, -1.0, np.float32), ValueError, r"mask: row weights must be finite and >= 0"),
        ([1, 0, 1], TypeError, r"mask: expected an array"),
        (np.array(["a"] * 8), TypeError, r"mask: expected an array of numbers, got dtype <U1"),
    ]
    for mask, error, message in cases:
        with pytest.raises(error, match=message):
            pipeline.step(x, t, mask=mask)
    assert pipeline.steps == 0
    assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(before))
    with pytest.raises(ValueError, match=r"run: xs and masks must have the same number of steps"):
        pipeline.run(x[None], t[None], masks=np.ones((2, 8), bool))
    pipeline.step(x, t, mask=jnp.ones(8, bool))
    assert pipeline.steps == 1


def test_host_masks_without_weight_or_of_complex_numbers_are_refused():
    # Reliability III: an all-zero mask ran and was refused as non-finite, blaming '<root>';
    # a complex mask ran with only a ComplexWarning.
    pipeline = fusedpc.FusedPipeline(_tree(), "sigmoid_cross_entropy")
    x, t = normal(0, (8, 4)), np.zeros((8, 3), np.float32)
    with pytest.raises(ValueError, match=r"mask: the mask has no weight \(every row is 0\)"):
        pipeline.step(x, t, mask=np.zeros(8, np.float32))
    with pytest.raises(TypeError, match=r"mask: expected booleans or real numbers .* complex64"):
        pipeline.step(x, t, mask=np.ones(8, np.complex64))
    with pytest.raises(TypeError, match=r"mask: expected booleans or real numbers"):
        pipeline.step(x, t, mask=jnp.ones(8, jnp.complex64))  # on the device too: a dtype
    masks = np.ones((3, 8), np.float32)
    masks[1] = 0.0
    with pytest.raises(ValueError, match=r"masks\[1\]: the mask has no weight"):
        pipeline.run(np.stack([x] * 3), np.stack([t] * 3), masks=masks)
    with pytest.raises(ValueError, match=r"mask: row weights must be finite and >= 0 .* NaN"):
        pipeline.step(x, t, mask=np.full(8, np.nan, np.float32))
    assert pipeline.steps == 0


@pytest.mark.parametrize("weight", [-1.0, np.nan, np.inf, "none"])
def test_device_masks_are_checked_inside_the_step(weight):
    # Reliability III: a device mask's values are not read back before the step; a negative
    # weight was committed (gradient ascent on that row). Now the step refuses it inside the
    # program, as it refuses device token ids, and the next sane step trains.
    pipeline = fusedpc.FusedPipeline(_tree(), "sigmoid_cross_entropy")
    x, t = normal(0, (8, 4)), (normal(1, (8, 3)) > 0).astype(np.float32)
    pipeline.step(x, t)
    bad = jnp.zeros(8) if weight == "none" else jnp.ones(8).at[3].set(weight)
    kept = [np.array(a) for a in jax.tree_util.tree_leaves(pipeline.state)]
    pipeline.step(x, t, mask=bad)
    assert not bool(pipeline.last_metrics.committed)
    for a, b in zip(kept, jax.tree_util.tree_leaves(pipeline.state), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    skip = pipeline.skip_reason()
    assert skip.reason == "invalid mask" and skip.part is None
    expected = {-1.0: r"got -1\.0", "none": "the mask has no weight"}.get(
        weight, "got a NaN or an infinity")
    assert re.search(rf"^mask: .*{expected}", skip.message), skip.message
    assert pipeline.skip_counts["invalid mask"] == 1 and pipeline.skipped_steps == 1
    assert pipeline.nonfinite_part() is None
    pipeline.step(x, t, mask=jnp.ones(8).at[3].set(0.0))
    assert bool(pipeline.last_metrics.committed)


def test_device_masks_in_run_and_under_raise():
    pipeline = fusedpc.FusedPipeline(_tree(), "sigmoid_cross_entropy", nonfinite="raise")
    x, t = normal(0, (8, 4)), (normal(1, (8, 3)) > 0).astype(np.float32)
    masks = jnp.ones((3, 8)).at[1, 2].set(-2.0)
    _, _, metrics = pipeline.run(jnp.stack([x] * 3), jnp.stack([t] * 3), masks=masks)
    np.testing.assert_array_equal(np.asarray(metrics.committed), [True, False, True])
    assert pipeline.skip_reason(index=1).message.startswith("masks: row weights must be")
    with pytest.raises(fusedpc.execution.InputRangeError,
                       match=r"step 1 of the last call was not committed: masks: row weights"):
        pipeline.step(x, t)
    assert pipeline.skip_counts["invalid mask"] == 1
