"""The public pure step (`fusedpc.make_step`): usable inside a user's own jit, scan and vmap,
equal to what `FusedPipeline` runs, and traced once per batch signature by the pipeline."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import run_at_default_level

import fusedpc
from fusedpc import frozen


def _tree(seed: int = 0) -> fusedpc.Sequential:
    network = fusedpc.PCNetwork([6, 12, 3], "tanh", key=jax.random.key(seed))
    return fusedpc.Sequential(
        [
            frozen.layer_norm(width=6),
            fusedpc.LearningNetwork(network, optimiser=optax.adam(1e-2)),
        ]
    )


def _batches(steps: int = 5, rows: int = 8):
    x = jax.random.normal(jax.random.key(10), (steps, rows, 6))
    t = jax.random.normal(jax.random.key(11), (steps, rows, 3))
    return x, t


def _assert_trees_equal(a, b, rtol=0.0, atol=0.0):
    for left, right in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        if jnp.issubdtype(jnp.result_type(left), jnp.inexact):
            np.testing.assert_allclose(np.asarray(left), np.asarray(right), rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(np.asarray(left), np.asarray(right))


def test_step_inside_the_users_jit_equals_the_pipeline():
    xs, ts = _batches()
    program = fusedpc.make_step(_tree(), None)
    step = jax.jit(program.step, donate_argnums=0)
    carry = program.init(jax.random.key(0))
    pipeline = fusedpc.FusedPipeline(_tree(), None, key=jax.random.key(0))
    for k in range(xs.shape[0]):
        carry, out = step(carry, xs[k], ts[k])
        y, e = pipeline.step(xs[k], ts[k])
        np.testing.assert_array_equal(np.asarray(out.output), np.asarray(y))
        np.testing.assert_array_equal(np.asarray(out.input_error), np.asarray(e))
    _assert_trees_equal(carry.state, pipeline.state)
    assert int(carry.counters.steps) == pipeline.steps == xs.shape[0]
    assert float(out.metrics.loss) == pipeline.last_loss


def test_run_equals_a_users_scan_of_step():
    xs, ts = _batches()
    program = fusedpc.make_step(_tree(), None)
    ran, outs = jax.jit(program.run)(program.init(jax.random.key(0)), xs, ts)

    def body(carry, batch):
        return program.step(carry, *batch)

    scanned, outs2 = jax.jit(lambda c: jax.lax.scan(body, c, (xs, ts)))(
        program.init(jax.random.key(0))
    )
    _assert_trees_equal(ran, scanned)
    _assert_trees_equal(outs.metrics.loss, outs2.metrics.loss)
    _, dropped = jax.jit(program.run, static_argnames="keep_outputs")(
        program.init(jax.random.key(0)), xs, ts, keep_outputs=False
    )
    assert dropped.output is None and dropped.input_error is None
    _assert_trees_equal(dropped.metrics.loss, outs.metrics.loss)


@pytest.mark.slow
def test_vmap_over_four_seeds_matches_four_pipelines():
    # Four seeds (each tree's weights drawn from its own key) trained at once by one vmapped
    # program, each on its own batches, against four separate pipelines.
    xs, ts = _batches(steps=3)
    keys = jax.random.split(jax.random.key(3), 4)
    shift = jnp.arange(4.0)[:, None, None, None]
    seeds_xs, seeds_ts = xs[None] + shift, ts[None] - shift  # (seeds, steps, rows, features)

    def build(key):
        network = fusedpc.PCNetwork([6, 12, 3], "tanh", key=key)
        return fusedpc.Sequential(
            [
                frozen.layer_norm(width=6),
                fusedpc.LearningNetwork(network, optimiser=optax.adam(1e-2)),
            ]
        )

    carries = jax.vmap(lambda key: fusedpc.make_step(build(key)).init(key))(keys)
    program = fusedpc.make_step(build(keys[0]))  # the functions hold no arrays: any seed's
    step = jax.jit(jax.vmap(program.step))
    for k in range(xs.shape[0]):
        carries, outs = step(carries, seeds_xs[:, k], seeds_ts[:, k])
    finals = []
    for seed in range(4):
        pipeline = fusedpc.FusedPipeline(build(keys[seed]), None, key=keys[seed])
        for k in range(xs.shape[0]):
            pipeline.step(seeds_xs[seed, k], seeds_ts[seed, k])
        mine = jax.tree_util.tree_map(lambda a, s=seed: a[s], carries)
        # vmap batches the matmuls (another summation order): float32 rounding only.
        _assert_trees_equal(mine.state, pipeline.state, rtol=2e-5, atol=2e-6)
        assert int(mine.counters.steps) == pipeline.steps
        np.testing.assert_allclose(float(outs.metrics.loss[seed]), pipeline.last_loss, rtol=2e-5)
        finals.append(np.asarray(jax.tree_util.tree_leaves(pipeline.state.parts[1])[0]))
    assert not np.allclose(finals[0], finals[1])  # the seeds really differ


def test_make_step_refuses_bad_settings_by_name():
    with pytest.raises(ValueError, match="error_normalisation: expected one of"):
        fusedpc.make_step(_tree(), None, "sometimes")
    with pytest.raises(ValueError, match="nonfinite: expected one of"):
        fusedpc.make_step(_tree(), None, nonfinite="maybe")
    with pytest.raises(TypeError, match="make_step"):
        fusedpc.make_step(object(), None)


def test_pipeline_traces_each_new_signature_once():
    xs, ts = _batches()
    pipeline = fusedpc.FusedPipeline(_tree(), None)
    pipeline.step(xs[0], ts[0])
    pipeline.step(xs[1], ts[1])
    assert pipeline.trace_counts["step"] == 1  # the shape check used the jit's own trace
    pipeline.run(xs, ts)
    pipeline.run(xs, ts)
    assert pipeline.trace_counts["run"] == 1
    pipeline.step(xs[0, :4], ts[0, :4])  # a new signature: one more trace
    assert pipeline.trace_counts["step"] == 2
    out = pipeline.check(xs[0, :2], ts[0, :2])
    assert out.shape == (2, 3)
    pipeline.step(xs[0, :2], ts[0, :2])  # checked above: the step reuses that trace
    assert pipeline.trace_counts["step"] == 3


def test_a_class_id_refusal_keeps_its_trace_for_the_next_call():
    tree = fusedpc.Sequential([frozen.linear(jnp.eye(3)), frozen.relu()])
    pipeline = fusedpc.FusedPipeline(tree, "softmax_cross_entropy")
    x = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match=r"target: class ids must lie in \[0, 3\)"):
        pipeline.step(x, np.array([0, 1, 2, 3], np.int32))
    assert pipeline.steps == 0 and pipeline.trace_counts["step"] == 1
    pipeline.step(x, np.array([0, 1, 2, 2], np.int32))
    assert pipeline.steps == 1 and pipeline.trace_counts["step"] == 1


def test_a_shape_error_surfaces_on_the_one_trace_before_anything_is_donated():
    xs, ts = _batches()
    pipeline = fusedpc.FusedPipeline(_tree(), None)
    pipeline.step(xs[0], ts[0])
    before = pipeline.state
    with pytest.raises(ValueError, match=r"expected input of shape \(\.\.\., 6\)"):
        pipeline.step(xs[0, :, :5], ts[0])
    assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(before))
    assert pipeline.steps == 1


def test_compiled_step_before_the_first_step_leaves_the_pipeline_working():
    xs, ts = _batches()
    pipeline = fusedpc.FusedPipeline(_tree(), None)
    pipeline.compiled_step(xs[0], ts[0])
    assert pipeline.check(xs[0], ts[0]).shape == (8, 3)
    pipeline.step(xs[0], ts[0])
    assert pipeline.steps == 1 and pipeline.trace_counts["step"] == 1
    for keep in (False, True):  # run's one trace, whatever happened before
        pipeline.run(xs, ts, keep_outputs=keep)
    assert pipeline.steps == 1 + 2 * xs.shape[0]


def test_compiled_step_is_the_program_the_pipeline_runs():
    xs, ts = _batches()
    pipeline = fusedpc.FusedPipeline(_tree(), None)
    pipeline.step(xs[0], ts[0])
    compiled = pipeline.compiled_step(xs[0], ts[0])
    state_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(pipeline.carry))
    assert compiled.memory_analysis().alias_size_in_bytes == state_bytes  # donated carry
    assert pipeline.trace_counts["step"] == 1


def test_report_and_nonfinite_part_refuse_an_inner_step_outside_the_last_call():
    xs, ts = _batches(steps=3)
    pipeline = fusedpc.FusedPipeline(_tree(), None)
    pipeline.run(xs, ts)
    assert pipeline.report(-3)[0]["part"] == pipeline.report(0)[0]["part"]
    for call in (pipeline.report, pipeline.nonfinite_part):
        for index in (3, -4):
            with pytest.raises(IndexError, match=rf"ran 3 step\(s\).*\[-3, 3\), got {index}"):
                call(index)
        with pytest.raises(TypeError, match="index: expected an integer inner step"):
            call(1.5)
    pipeline.step(xs[0], ts[0])
    assert pipeline.nonfinite_part(0) is None and pipeline.report(-1)
    with pytest.raises(IndexError, match=r"ran 1 step\(s\).*\[-1, 1\), got 1"):
        pipeline.nonfinite_part(1)


def test_object_string_and_float_class_id_batches_are_named_with_their_dtype():
    pipeline = fusedpc.FusedPipeline(_tree(), None)
    x = np.ones((4, 6), np.float32)
    with pytest.raises(TypeError, match=r"^x: expected an array of numbers, got dtype object"):
        pipeline.step(x.astype(object), np.ones((4, 3), np.float32))
    with pytest.raises(TypeError, match=r"^target: expected an array of numbers, got dtype <U"):
        pipeline.step(x, np.full((4, 3), "a"))
    assert pipeline.steps == 0
    head = fusedpc.Sequential([frozen.linear(jnp.eye(6)), frozen.relu()])
    classes = fusedpc.FusedPipeline(head, "softmax_cross_entropy")
    message = r"got shape \(4,\) of dtype float32 \(class ids must be an integer dtype"
    with pytest.raises(ValueError, match=message):
        classes.step(x, np.zeros((4,), np.float32))
    assert classes.steps == 0


# --------------------------------------------------------------------------- report cadence
def _cadence_pipelines(**guards):
    config = fusedpc.GPTConfig(vocab_size=11, width=16, n_heads=4, n_blocks=2, ff_width=32,
                               max_len=8, learn="all")
    part, _ = fusedpc.build_gpt(config, optax.adam(1e-2), jax.random.key(0))
    return [fusedpc.FusedPipeline(part, config.error_fn, **guards) for _ in range(2)]


@pytest.mark.slow
def test_report_cadence_reports_equal_full_metrics_and_losses_every_step():
    xs = np.asarray(jax.random.randint(jax.random.key(1), (7, 2, 8), 0, 11))
    full, cadence = _cadence_pipelines()
    _, _, every = full.run(xs, xs, keep_outputs=False)
    _, _, some = cadence.run(xs, xs, keep_outputs=False, report_every=3)
    np.testing.assert_array_equal(np.asarray(every.loss), np.asarray(some.loss))
    np.testing.assert_array_equal(np.asarray(some.reported),
                                  [False, False, True, False, False, True, True])
    assert np.asarray(every.reported).all()
    for index in (2, 5, 6, -1):  # every third step and the last: the same rows exactly
        assert cadence.report(index=index) == full.report(index=index)
    # the steps between reports: the same update, nothing measured, and said
    for a, b in zip(jax.tree_util.tree_leaves(full.state),
                    jax.tree_util.tree_leaves(cadence.state), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"report\(index=1\): that step of the last run "
                                         "computed no report"):
        cadence.report(index=1)
    # which steps report is data: another choice reuses the compiled program
    traces = cadence.trace_counts["run"]
    flags = np.zeros(7, bool)
    flags[0] = True
    _, _, chosen = cadence.run(xs, xs, keep_outputs=False, report_at=flags)
    assert cadence.trace_counts["run"] == traces
    np.testing.assert_array_equal(np.asarray(chosen.reported), flags | (np.arange(7) == 6))
    with pytest.raises(ValueError, match="report_every: expected an int >= 1, got 0"):
        cadence.run(xs, xs, report_every=0)
    with pytest.raises(ValueError, match=r"report_at: expected 7 booleans"):
        cadence.run(xs, xs, report_at=np.ones(3, bool))


_REPORTS_AT_DEFAULT_LEVEL = """
import json, jax, numpy as np, optax, fusedpc

def pipeline():
    config = fusedpc.GPTConfig(vocab_size=11, width=16, n_heads=4, n_blocks=2, ff_width=32,
                               max_len=8, learn="all")
    part, _ = fusedpc.build_gpt(config, optax.adam(1e-2), jax.random.key(0))
    return fusedpc.FusedPipeline(part, config.error_fn)

xs = np.asarray(jax.random.randint(jax.random.key(1), (7, 2, 8), 0, 11))
full, cadence, stepped = pipeline(), pipeline(), pipeline()
full.run(xs, xs, keep_outputs=False)
cadence.run(xs, xs, keep_outputs=False, report_every=3)
reports = []
for x in xs:
    stepped.step(x, x)
    reports.append(stepped.report())
print(json.dumps({
    "cadence": all(cadence.report(index=i) == full.report(index=i) for i in (2, 5, 6)),
    "step": all(reports[i] == full.report(index=i) for i in range(7)),
    "rows": len(reports[0]),
}))
"""


@pytest.mark.slow
def test_reports_are_equal_in_step_run_and_cadence_at_the_default_level():
    # The report norms are measured together at the end of each step, as dot products of
    # the arrays as written (a reduction would fuse their producers and round by its
    # kernel): the same bits in `step`, in `run` and in `run` with a cadence, at XLA's
    # default optimisation level (what users get) as at the suite's level 0 (above).
    outcome = run_at_default_level("-c", _REPORTS_AT_DEFAULT_LEVEL, timeout=600)
    assert outcome == {"cadence": True, "step": True, "rows": 18}


@pytest.mark.slow
def test_steps_between_reports_keep_the_commit_rule():
    xs = np.asarray(jax.random.randint(jax.random.key(1), (4, 2, 8), 0, 11))
    bad = xs.copy()
    bad[1, 0, 0] = 99  # an id out of range at step 1, a step without report
    _, cadence = _cadence_pipelines()
    before = [np.array(a) for a in jax.tree_util.tree_leaves(cadence.state)]
    # a device array: its ids are checked inside the step, not before it
    _, _, metrics = cadence.run(jnp.asarray(bad), xs, keep_outputs=False, report_every=4)
    np.testing.assert_array_equal(np.asarray(metrics.committed), [True, False, True, True])
    assert cadence.skip_reason(index=1).reason == "token id out of range"
    assert any(not np.array_equal(a, b)
               for a, b in zip(before, jax.tree_util.tree_leaves(cadence.state)))
    # a state that cannot be represented is refused on a step without report too: SGD at a
    # rate that overflows the weights' norm (finite entries, an infinite norm: Adam moves
    # each weight by ~1e38; SGD at 1e36, as before Reliability III, overflowed only float32's
    # sum of squares, of a norm of ~1e36)
    config = fusedpc.GPTConfig(vocab_size=11, width=16, n_heads=4, n_blocks=1, ff_width=32,
                               max_len=8, learn="head")
    part, _ = fusedpc.build_gpt(config, optax.adam(1e38), jax.random.key(0))
    pipeline = fusedpc.FusedPipeline(part, config.error_fn)
    start = [np.array(a) for a in jax.tree_util.tree_leaves(pipeline.state)]
    _, _, metrics = pipeline.run(xs, xs, keep_outputs=False, report_every=4)
    assert not np.asarray(metrics.committed)[:3].any() and not np.asarray(metrics.reported)[0]
    assert pipeline.skip_reason(index=0).reason == "non-finite"
    for a, b in zip(start, jax.tree_util.tree_leaves(pipeline.state), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_update_ratio_guard_reports_every_step():
    xs = np.asarray(jax.random.randint(jax.random.key(1), (3, 2, 8), 0, 11))
    _, guarded = _cadence_pipelines(max_update_ratio=10.0)
    _, _, metrics = guarded.run(xs, xs, keep_outputs=False, report_every=3)
    assert np.asarray(metrics.reported).all() and np.asarray(metrics.committed).all()


def test_a_step_without_its_report_makes_the_same_update_and_says_so():
    xs, ts = _batches(steps=3)
    full, quiet = fusedpc.FusedPipeline(_tree()), fusedpc.FusedPipeline(_tree())
    for i, (x, t) in enumerate(zip(xs, ts)):
        full.step(x, t)
        quiet.step(x, t, report=i == 2)  # the report of the last step only
        assert bool(quiet.last_metrics.reported) == (i == 2)
        np.testing.assert_array_equal(np.asarray(quiet.last_metrics.loss),
                                      np.asarray(full.last_metrics.loss))
        if i < 2:
            with pytest.raises(ValueError, match="computed no report"):
                quiet.report()
    _assert_trees_equal(full.state, quiet.state)  # bit for bit
    assert quiet.report() == full.report()
    assert quiet.trace_counts["step"] == 2  # one program with the report, one without
    # the commit rule is the same without the report: a non-finite batch is refused
    before = jax.tree_util.tree_map(np.asarray, quiet.state)
    quiet.step(xs[0] * jnp.nan, ts[0], report=False)
    assert not bool(quiet.last_metrics.committed)
    _assert_trees_equal(before, quiet.state)
