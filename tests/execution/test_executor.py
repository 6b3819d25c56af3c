"""The fused executor: memory contract, run == K steps, error normalisation, predict, report,
non-finite steps and every error message it raises."""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    Spy,
    assert_tree_allclose,
    delta_linear,
    linear_params,
    normal,
    shapes_and_dtypes,
)

import fusedpc
from fusedpc import frozen
from fusedpc.core import expect_rank


def _learning_tree() -> fusedpc.Sequential:
    """4 -> 5 (learns, adam) -> tanh -> residual(linear 5 -> 5, frozen) -> 2 (learns, sgd)."""
    return fusedpc.Sequential(
        [
            delta_linear(0, 4, 5, optax.adam(1e-2)),
            frozen.tanh(),
            fusedpc.Residual(frozen.linear(*linear_params(2, 5, 5))),
            delta_linear(3, 5, 2),
        ]
    )


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree)


# --------------------------------------------------------------------------- memory contract
def test_programs_are_traced_with_the_garbage_collector_paused_and_left_as_found():
    import gc

    from fusedpc.parts import Frozen

    enabled: list[bool] = []  # gc.isenabled() each time the part is traced

    def forward(params, x):
        del params
        enabled.append(gc.isenabled())
        return jnp.tanh(x), None

    def backward(params, cache, error):
        del params, cache
        return error

    tree = fusedpc.Sequential([delta_linear(0, 4, 5), Frozen(forward, backward, None)])
    pipeline = fusedpc.FusedPipeline(tree)
    x, target = normal(0, (6, 4)), normal(1, (6, 5))
    assert gc.isenabled()
    pipeline.step(x, target)
    pipeline.run(np.stack([np.asarray(x)] * 2), np.stack([np.asarray(target)] * 2))
    assert enabled and not any(enabled), enabled  # paused while tracing step and run
    assert gc.isenabled()  # and on again after
    try:
        gc.disable()  # a caller's choice is kept
        pipeline.step(normal(2, (3, 4)), normal(3, (3, 5)))
        assert len(enabled) > 2 and not gc.isenabled()
    finally:
        gc.enable()


def test_step_deletes_the_previous_state_only():
    tree = _learning_tree()
    part_arrays = _leaves(tree)
    part_values = [np.array(a) for a in part_arrays]
    pipeline = fusedpc.FusedPipeline(tree)
    x, target = normal(0, (6, 4)), normal(1, (6, 2))

    old = _leaves(pipeline.state)
    assert old and not any(leaf.is_deleted() for leaf in old)
    pipeline.step(x, target)
    assert all(leaf.is_deleted() for leaf in old), "the previous state must be donated"
    assert not x.is_deleted() and not target.is_deleted(), "the caller's batch must survive"
    # The constructor copied the initial state: the part objects' arrays survive step one.
    assert not any(a.is_deleted() for a in part_arrays)
    for kept, a in zip(part_values, part_arrays, strict=True):
        np.testing.assert_array_equal(kept, np.asarray(a))
    assert not any(leaf.is_deleted() for leaf in _leaves(pipeline.state))


def test_merge_result_survives_further_steps():
    pipeline = fusedpc.FusedPipeline(_learning_tree())
    x, target = normal(0, (6, 4)), normal(1, (6, 2))
    pipeline.step(x, target)
    merged = pipeline.merge()
    snapshot = [np.array(a) for a in _leaves(merged)]
    pipeline.step(x, target)
    pipeline.step(x, target)
    assert not any(a.is_deleted() for a in _leaves(merged))
    for kept, now in zip(snapshot, _leaves(merged), strict=True):
        np.testing.assert_array_equal(kept, np.asarray(now))
    # The pipeline moved on; the merged tree did not.
    assert not np.array_equal(
        np.asarray(merged.parts[0].weight), np.asarray(pipeline.merge().parts[0].weight)
    )


def test_merge_writes_the_current_state_back():
    pipeline = fusedpc.FusedPipeline(_learning_tree())
    pipeline.step(normal(0, (6, 4)), normal(1, (6, 2)))
    merged = pipeline.merge()
    assert isinstance(merged, fusedpc.Sequential)
    state = pipeline.state
    np.testing.assert_array_equal(
        np.asarray(merged.parts[0].weight), np.asarray(state.parts[0].params["weight"])
    )
    np.testing.assert_array_equal(
        np.asarray(merged.parts[3].bias), np.asarray(state.parts[3].params["bias"])
    )


# --------------------------------------------------------------------------- run == K steps
def test_run_equals_k_steps():
    k, rows = 3, 6
    xs, targets = normal(10, (k, rows, 4)), normal(11, (k, rows, 2))
    stepped = fusedpc.FusedPipeline(_learning_tree())
    outputs, input_errors, losses = [], [], []
    for i in range(k):
        y, e = stepped.step(xs[i], targets[i])
        outputs.append(y)
        input_errors.append(e)
        losses.append(stepped.last_loss)
    step_report = stepped.report()

    scanned = fusedpc.FusedPipeline(_learning_tree())
    ys, es, metrics = scanned.run(xs, targets)
    assert scanned.trace_counts == {"step": 0, "run": 1, "predict": 0}
    assert ys.shape == (k, rows, 2) and es.shape == (k, rows, 4)

    assert_tree_allclose(ys, jnp.stack(outputs), rtol=1e-6, atol=1e-7)
    assert_tree_allclose(es, jnp.stack(input_errors), rtol=1e-6, atol=1e-7)
    assert_tree_allclose(scanned.state, stepped.state, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(metrics.loss), losses, rtol=1e-6)
    assert scanned.steps == stepped.steps == k
    # The loss fell: the tree really learns, so the comparison is not of a fixed point.
    assert losses[-1] < losses[0]
    run_report = scanned.report()
    assert [r["part"] for r in run_report] == [r["part"] for r in step_report]
    for a, b in zip(run_report, step_report, strict=True):
        assert a["update_norm"] == pytest.approx(b["update_norm"], rel=1e-5)


def test_run_without_outputs():
    pipeline = fusedpc.FusedPipeline(frozen.linear(*linear_params(0, 4, 2)))
    ys, es, metrics = pipeline.run(normal(10, (2, 6, 4)), normal(11, (2, 6, 2)), keep_outputs=False)
    assert ys is None and es is None
    assert metrics.loss.shape == (2,)


# --------------------------------------------------------------------------- normalisation
ROW_MASK = jnp.array([1, 1, 0, 1, 0, 1], jnp.float32)[:, None]  # rows 2 and 4: zero error


def _masked_error(output, target):
    return (output - target) * ROW_MASK


def _spied_tree():
    return fusedpc.Sequential([Spy((6, 4)), frozen.linear(*linear_params(5, 4, 3)), Spy((6, 3))])


def _seen_errors(normalisation: str):
    pipeline = fusedpc.FusedPipeline(_spied_tree(), _masked_error, normalisation)
    x, target = normal(0, (6, 4)), normal(1, (6, 3))
    y, input_error = pipeline.step(x, target)
    seen_in = pipeline.state.parts[0].seen
    seen_out = pipeline.state.parts[2].seen
    return y - target, seen_out, seen_in, input_error


def test_active_normalisation_scales_every_part_by_rows_over_active_rows():
    raw, rows_out, rows_in, rows_input_error = _seen_errors("rows")
    _, active_out, active_in, active_input_error = _seen_errors("active")

    # "rows" leaves the error as error_fn formed it.
    np.testing.assert_array_equal(np.asarray(rows_out), np.asarray(raw * ROW_MASK))
    # "active": 6 rows, 4 with a non-zero error, so every part sees exactly 1.5 times as much.
    np.testing.assert_array_equal(np.asarray(active_out), np.asarray(1.5 * rows_out))
    assert_tree_allclose(active_in, 1.5 * rows_in, rtol=1e-6, atol=1e-7)
    assert_tree_allclose(active_input_error, 1.5 * rows_input_error, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(active_input_error), np.asarray(active_in))
    assert not np.any(np.asarray(active_in)[[2, 4]])
    # A sanity check that the spies saw something.
    assert float(jnp.linalg.norm(rows_in)) > 0.1


def test_active_normalisation_without_padding_changes_nothing():
    x, target = normal(0, (6, 4)), normal(1, (6, 3))
    errors = []
    for normalisation in ("active", "rows"):
        pipeline = fusedpc.FusedPipeline(_spied_tree(), None, normalisation)
        pipeline.step(x, target)
        errors.append(pipeline.state.parts[2].seen)
    np.testing.assert_array_equal(np.asarray(errors[0]), np.asarray(errors[1]))


def test_active_normalisation_makes_padding_rows_invisible_to_weight_updates():
    # Zero-error rows are padding: the row mean of a learning part then averages the real rows.
    x, target = normal(0, (6, 4)), normal(1, (6, 3))
    padded = fusedpc.FusedPipeline(delta_linear(4, 4, 3), _masked_error, "active")
    padded.step(x, target)
    real = np.flatnonzero(np.asarray(ROW_MASK[:, 0]))
    unpadded = fusedpc.FusedPipeline(delta_linear(4, 4, 3), None, "rows")
    unpadded.step(x[real], target[real])
    assert_tree_allclose(padded.state, unpadded.state, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- predict, report
def test_predict_does_not_donate_and_leaves_the_state_untouched():
    tree = _learning_tree()
    pipeline = fusedpc.FusedPipeline(tree)
    x, target = normal(0, (6, 4)), normal(1, (6, 2))
    before = _leaves(pipeline.state)
    snapshot = [np.array(a) for a in before]
    y = pipeline.predict(x)
    y_again = pipeline.predict(x + 0.0)
    assert not any(a.is_deleted() for a in before) and not x.is_deleted()
    for kept, leaf in zip(snapshot, _leaves(pipeline.state), strict=True):
        np.testing.assert_array_equal(kept, np.asarray(leaf))
    assert pipeline.trace_counts == {"step": 0, "run": 0, "predict": 1}
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_again))
    assert pipeline.report() == [] and pipeline.steps == 0
    # The step's output is computed from the same state before the update.
    y_step, _ = pipeline.step(x, target)
    assert_tree_allclose(y_step, y, rtol=1e-6, atol=1e-7)


def test_report_rows():
    tree = _learning_tree()
    pipeline = fusedpc.FusedPipeline(tree, error_normalisation="rows")
    assert pipeline.report() == []
    x, target = normal(0, (6, 4)), normal(1, (6, 2))
    before = pipeline.merge()
    y, _ = pipeline.step(x, target)
    after = pipeline.merge()

    report = pipeline.report()
    assert [r["part"] for r in report] == ["parts[0]", "parts[3]"]
    assert [r["layer_sizes"] for r in report] == [[4, 5], [5, 2]]
    head = report[1]
    assert set(head) == {
        "part",
        "layer_sizes",
        "update_norm",
        "error_norm",
        "weight_norm",
        "update_ratio",
        "finite",
    }
    dw = after.parts[3].weight - before.parts[3].weight
    db = after.parts[3].bias - before.parts[3].bias
    update = float(jnp.sqrt(jnp.sum(dw * dw) + jnp.sum(db * db)))
    weight = float(
        jnp.sqrt(jnp.sum(after.parts[3].weight ** 2) + jnp.sum(after.parts[3].bias ** 2))
    )
    assert head["update_norm"] == pytest.approx(update, rel=1e-5)
    assert head["weight_norm"] == pytest.approx(weight, rel=1e-6)
    assert head["error_norm"] == pytest.approx(float(jnp.linalg.norm(y - target)), rel=1e-6)
    assert head["update_ratio"] == pytest.approx(update / weight, rel=1e-5)
    assert head["finite"] is True
    assert pipeline.last_loss == pytest.approx(
        float(0.5 * jnp.mean(jnp.sum((y - target) ** 2, axis=-1))), rel=1e-6
    )


def test_report_of_a_frozen_tree_is_empty_but_step_counts():
    pipeline = fusedpc.FusedPipeline(frozen.linear(*linear_params(0, 4, 3)))
    pipeline.step(normal(0, (6, 4)), normal(1, (6, 3)))
    assert pipeline.report() == []
    assert pipeline.steps == 1 and pipeline.skipped_steps == 0


# --------------------------------------------------------------------------- non-finite steps
def test_nonfinite_step_is_skipped_and_named():
    pipeline = fusedpc.FusedPipeline(_learning_tree())
    x, target = normal(0, (6, 4)), normal(1, (6, 2))
    pipeline.step(x, target)
    kept = [np.array(a) for a in _leaves(pipeline.state)]
    pipeline.step(x.at[0, 0].set(jnp.nan), target)
    assert pipeline.skipped_steps == 1 and pipeline.steps == 2
    assert not bool(pipeline.last_metrics.committed)
    for old, new in zip(kept, _leaves(pipeline.state), strict=True):
        np.testing.assert_array_equal(old, np.asarray(new))
    # The error first goes non-finite at the output, in the last part (backward order).
    assert pipeline.nonfinite_part() == "parts[3]"


def test_nonfinite_raise_policy_raises_at_the_next_call():
    pipeline = fusedpc.FusedPipeline(_learning_tree(), nonfinite="raise")
    x, target = normal(0, (6, 4)), normal(1, (6, 2))
    # tanh(inf) = 1: the output and later parts stay finite; only the first part's update,
    # E^T x with an infinite x, does not.
    pipeline.step(x.at[0, 0].set(jnp.inf), target)
    with pytest.raises(fusedpc.NonFiniteStepError, match=r"first in part 'parts\[0\]'"):
        pipeline.step(x, target)
    pipeline.step(x, target)  # the failure is reported once
    assert pipeline.skipped_steps == 1


# --------------------------------------------------------------------------- error messages
class NeedsSequence(fusedpc.AbstractPart):
    """A pass-through part that only accepts `(batch, seq, features)` inputs."""

    def init_state(self, key):
        del key
        return None

    def compile(self, path):
        def forward(state, x, ctx):
            expect_rank(path, x, 3, "(batch, seq, features)")
            return x, None

        def backward(state, cache, error, ctx):
            return error, state, fusedpc.core.FiniteFlag(jnp.all(jnp.isfinite(error)))

        return fusedpc.Core(forward, backward, lambda state: self)


def test_bad_options_are_refused_at_construction():
    part = frozen.relu()
    with pytest.raises(
        ValueError, match=r"error_normalisation: expected one of \('active', 'rows'\), got 'mean'"
    ):
        fusedpc.FusedPipeline(part, error_normalisation="mean")
    with pytest.raises(
        ValueError, match=r"nonfinite: expected one of \('skip', 'raise', 'ignore'\), got 'warn'"
    ):
        fusedpc.FusedPipeline(part, nonfinite="warn")
    with pytest.raises(
        ValueError, match=r"error_fn: unknown name 'mse'; choose one of \[.*'squared'"
    ):
        fusedpc.FusedPipeline(part, "mse")
    with pytest.raises(TypeError, match=r"error_fn: expected None, a name, .* got int"):
        fusedpc.FusedPipeline(part, 3)
    with pytest.raises(TypeError, match=r"FusedPipeline\(tree\): expected a part .* got function"):
        fusedpc.FusedPipeline(lambda x: x)


def test_width_mismatch_names_the_part_before_compiling():
    tree = fusedpc.Sequential(
        [frozen.linear(*linear_params(0, 4, 3)), frozen.linear(*linear_params(1, 5, 2))]
    )
    pipeline = fusedpc.FusedPipeline(tree)
    state = _leaves(pipeline.state)
    x, target = normal(0, (6, 4)), normal(1, (6, 2))
    with pytest.raises(
        ValueError, match=re.escape("parts[1]: expected input of shape (..., 5), got shape (6, 3)")
    ):
        pipeline.step(x, target)
    with pytest.raises(ValueError, match=re.escape("parts[1]: expected input of shape (..., 5)")):
        pipeline.run(x[None], target[None])
    assert pipeline.trace_counts == {"step": 0, "run": 0, "predict": 0}
    assert not any(leaf.is_deleted() for leaf in state)


def test_wrong_input_width_and_rank():
    pipeline = fusedpc.FusedPipeline(frozen.linear(*linear_params(0, 4, 3)))
    with pytest.raises(
        ValueError, match=re.escape("<root>: expected input of shape (..., 4), got shape (6, 2)")
    ):
        pipeline.step(normal(0, (6, 2)), normal(1, (6, 3)))
    with pytest.raises(ValueError, match=re.escape("x: expected a non-empty batch, got shape ()")):
        pipeline.step(jnp.float32(1.0), normal(1, (6, 3)))
    with pytest.raises(
        ValueError, match=re.escape("x: expected a non-empty batch, got shape (0, 4)")
    ):
        pipeline.predict(jnp.zeros((0, 4), jnp.float32))

    nested = fusedpc.Sequential([frozen.relu(), fusedpc.Residual(NeedsSequence())])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "parts[1].branch: expected input of rank 3 (batch, seq, features), got shape (6, 4) "
            "(rank 2)"
        ),
    ):
        fusedpc.FusedPipeline(nested).step(normal(0, (6, 4)), normal(1, (6, 4)))
    fusedpc.FusedPipeline(nested).step(normal(0, (2, 3, 4)), normal(1, (2, 3, 4)))


def test_non_part_in_a_sequential_is_named():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "Sequential.parts[1]: expected a part (a subclass of fusedpc.AbstractPart), "
            "got function"
        ),
    ):
        fusedpc.Sequential([frozen.relu(), lambda x: x])
    with pytest.raises(TypeError, match=re.escape("Residual.branch: expected a part")) as err:
        fusedpc.Residual(eqx.nn.Linear(3, 3, key=jax.random.key(0)))
    assert "fusedpc.frozen.from_module(module)" in str(err.value)  # the way to wrap it
    with pytest.raises(ValueError, match="Sequential: needs at least one part, got none"):
        fusedpc.Sequential([])


def test_residual_branch_changing_shape_is_named():
    tree = fusedpc.Sequential(
        [frozen.relu(), fusedpc.Residual(frozen.linear(*linear_params(0, 4, 3)))]
    )
    with pytest.raises(
        ValueError,
        match=re.escape(
            "parts[1].branch: a residual branch must keep its input's shape; expected output "
            "shape (6, 4), got (6, 3)"
        ),
    ):
        fusedpc.FusedPipeline(tree).step(normal(0, (6, 4)), normal(1, (6, 4)))


def test_target_of_the_wrong_shape():
    pipeline = fusedpc.FusedPipeline(frozen.linear(*linear_params(0, 4, 3)))
    x = normal(0, (6, 4))
    with pytest.raises(
        ValueError,
        match=re.escape("target: expected shape (6, 3) (the output's shape), got (6, 2)"),
    ):
        pipeline.step(x, normal(1, (6, 2)))
    ce = fusedpc.FusedPipeline(frozen.linear(*linear_params(0, 4, 3)), "softmax_cross_entropy")
    with pytest.raises(
        ValueError, match=re.escape("target: expected integer class ids of shape (6,)")
    ):
        ce.step(x, jnp.zeros((6, 2), jnp.int32))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "run: xs and targets must have the same number of steps on axis 0, got 2 and 3"
        ),
    ):
        pipeline.run(jnp.stack([x, x]), jnp.zeros((3, 6, 3), jnp.float32))


def test_set_state_refuses_a_different_state():
    pipeline = fusedpc.FusedPipeline(_learning_tree())
    other = fusedpc.FusedPipeline(frozen.linear(*linear_params(0, 4, 3)))
    with pytest.raises(ValueError, match="set_state: the state's tree structure differs"):
        pipeline.set_state(other.state)
    wrong = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), pipeline.state)
    with pytest.raises(
        ValueError, match=r"set_state: leaf .* expected float32\[5\], got bfloat16\[5\]"
    ):
        pipeline.set_state(wrong)
    assert shapes_and_dtypes(pipeline.state) != shapes_and_dtypes(wrong)
