"""The step guard: one commit rule, the spike guards and in-program id checks.

One rule decides whether a step is committed, and the report, `nonfinite_part()`,
`skip_reason()` and the skip counters read the same flags: a step whose update, weights,
emitted error or loss cannot be represented in float32 (a NaN, an infinity, or a norm that
overflows) is not committed. Beyond it, `max_update_ratio` and `loss_spike` refuse finite
steps that are absurd, and ids outside their range refuse the step inside the program.
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

SANE_RATE = 0.05
# An infinite rate: every slot's update overflows. (A finite rate times small gradients can
# stay representable, and a representable step is committed: Reliability III.)
HUGE_RATE = float("inf")


def _set_rates(pipeline: fusedpc.FusedPipeline, rate_of) -> None:
    """Set every injected learning rate to `rate_of(path)` (None keeps it), keeping the
    counters: the rate is a state leaf, so nothing recompiles."""

    def swap(path, leaf):
        key = jax.tree_util.keystr(path)
        rate = rate_of(key) if "learning_rate" in key else None
        return leaf if rate is None else jnp.full_like(leaf, rate)

    state = jax.tree_util.tree_map_with_path(swap, pipeline.state)
    pipeline.set_state(state, counters=pipeline.counters)


def _agree(pipeline: fusedpc.FusedPipeline, expected_reason: str) -> str:
    """The report, `nonfinite_part`, `skip_reason` and the counters tell one story."""
    skip = pipeline.skip_reason()
    assert skip is not None and skip.reason == expected_reason
    assert not bool(pipeline.last_metrics.committed)
    part = pipeline.nonfinite_part()
    if expected_reason == "non-finite":
        assert part == skip.part and part is not None
        bad_rows = [r["part"] for r in pipeline.report() if not r["finite"]]
        # the named part is a row the report flags, or a state leaf of a part (an optimiser
        # moment) inside one of the report's parts, or the root's output/loss
        assert part in bad_rows or part == "<root>" or any(
            part.startswith(r["part"].replace("<root>", "")) for r in pipeline.report()
        )
    else:
        assert part is None
    return skip.part or ""


# --------------------------------------------------------------------------- one rule, GPT
GPT_SLOTS = {
    "token": ".token.",
    "position": ".position.",
    "attention": ".attention.",
    "feed_forward": ".feed_forward.",
    "norm": (".n1.", ".n2.", ".norm_f."),
    "head": ".head.",
}


def _gpt_pipeline(**guards) -> fusedpc.FusedPipeline:
    config = fusedpc.GPTConfig(
        vocab_size=11, width=8, n_heads=2, n_blocks=2, ff_width=16, max_len=8, learn="all"
    )
    optimiser = optax.inject_hyperparams(optax.sgd)(learning_rate=SANE_RATE)
    part = fusedpc.build_gpt(config, optimiser, jax.random.key(0))[0]
    return fusedpc.FusedPipeline(part, "softmax_cross_entropy", **guards)


def _gpt_batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, 11, (4, 9)).astype(np.int32)
    return ids[:, :-1], ids[:, 1:]


def test_an_overflowing_rate_on_any_gpt_slot_is_refused_and_the_run_recovers():
    pipeline = _gpt_pipeline()
    x, t = _gpt_batch(0)
    pipeline.step(x, t)
    first_loss = pipeline.last_loss
    for n, (slot, marks) in enumerate(GPT_SLOTS.items(), start=1):
        marks = (marks,) if isinstance(marks, str) else marks
        _set_rates(pipeline, lambda key, m=marks: HUGE_RATE if any(s in key for s in m) else None)
        kept = host_leaves(pipeline.state)
        pipeline.step(x, t)
        assert_bitwise_equal(kept, pipeline.state)  # the weights never held the overflow
        part = _agree(pipeline, "non-finite")
        assert pipeline.skip_counts["non-finite"] == n, slot
        names = {"norm": ("n1", "n2", "norm_f")}.get(slot, (slot,))
        assert any(name in part for name in names), (slot, part)
        _set_rates(pipeline, lambda key: SANE_RATE)
    assert pipeline.skipped_steps == len(GPT_SLOTS)
    for _ in range(20):  # a sane rate trains again from the state kept
        pipeline.step(x, t)
        assert bool(pipeline.last_metrics.committed)
    assert np.isfinite(pipeline.last_loss) and pipeline.last_loss < first_loss


# --------------------------------------------------------------------------- one rule, floats
def _network_tree(optimiser, activation: str = "tanh") -> fusedpc.Sequential:
    network = fusedpc.PCNetwork([4, 5, 3], activation, key=jax.random.key(1))
    return fusedpc.Sequential(
        [frozen.linear(*linear_params(0, 4, 4)), fusedpc.LearningNetwork(network, optimiser)]
    )


def _no_loss_error(output, target):  # a bare error function: no loss to check
    return output - target


@pytest.mark.parametrize(
    "case",
    # inputs of 1e20, not 1e15: 1e15 only overflowed float32's sum of squares of a representable
    # step (weights of ~5e28), which is now committed; 1e20 overflows the gradients and loss
    ["inputs_1e20", "targets_1e20", "adam_moments"],
)
def test_unrepresentable_steps_are_refused_and_the_next_sane_step_trains(case):
    x, t = normal(0, (6, 4)), normal(1, (6, 3))
    if case == "adam_moments":
        # Gradients ~1e22: Adam's second moment (g^2) overflows while its update stays
        # bounded (no loss to overflow: a bare error function).
        pipeline = fusedpc.FusedPipeline(_network_tree(optax.adam(1e-2)), _no_loss_error)
        bad_x, bad_t = x, t * 1e22
    else:
        # Identity units: huge inputs reach the gradients (tanh units would saturate and
        # make the step a sane one, which is then committed).
        pipeline = fusedpc.FusedPipeline(_network_tree(optax.sgd(SANE_RATE), "identity"))
        bad_x, bad_t = (x * 1e20, t) if case == "inputs_1e20" else (x, t * 1e20)
    pipeline.step(x, t)
    first_loss = float(np.sum((np.asarray(pipeline.predict(x)) - np.asarray(t)) ** 2))
    kept = host_leaves(pipeline.state)
    pipeline.step(bad_x, bad_t)
    assert_bitwise_equal(kept, pipeline.state)
    part = _agree(pipeline, "non-finite")
    assert part.startswith("parts[1]") or part == "<root>", part
    assert pipeline.skip_counts == {
        "id out of range": 0, "invalid mask": 0, "non-finite": 1, "update ratio": 0,
        "loss spike": 0,
    }
    for _ in range(20):
        pipeline.step(x, t)
        assert bool(pipeline.last_metrics.committed)
    loss = float(np.sum((np.asarray(pipeline.predict(x)) - np.asarray(t)) ** 2))
    assert np.isfinite(loss) and loss < first_loss


def test_a_norm_that_overflows_counts_although_every_entry_is_finite():
    # Adam at a rate of 1e38 on a GPT head: its first step moves every weight by ~1e38 (a
    # normalised update), finite, and the norm of 176 of them (~1.3e39) is beyond float32.
    # (Entries of 1e19, as this test used, have a finite norm of 4e19 that only float32's sum
    # of squares overflowed: now committed, see below.)
    config = fusedpc.GPTConfig(vocab_size=11, width=16, n_heads=4, n_blocks=1, ff_width=32,
                               max_len=8, learn="head")
    x, t = _gpt_batch(0)
    ignoring = fusedpc.FusedPipeline(
        fusedpc.build_gpt(config, optax.adam(1e38), jax.random.key(0))[0],
        "softmax_cross_entropy", nonfinite="ignore")
    ignoring.step(x, t)
    assert all(np.isfinite(a).all() for a in host_leaves(ignoring.state))
    assert np.isinf(ignoring.report()[-1]["weight_norm"]) and not ignoring.report()[-1]["finite"]
    pipeline = fusedpc.FusedPipeline(
        fusedpc.build_gpt(config, optax.adam(1e38), jax.random.key(0))[0],
        "softmax_cross_entropy")
    kept = host_leaves(pipeline.state)
    pipeline.step(x, t)
    assert_bitwise_equal(kept, pipeline.state)
    assert _agree(pipeline, "non-finite") == "head"


def test_a_sum_of_squares_that_overflows_float32_does_not_refuse_a_representable_step():
    # Reliability III: targets of 3e19 give weights of ~1e19, whose float32 sum of squares
    # overflows while their norm (~1e20) is representable. The step is committed and the
    # report's norms are the float64 norms.
    pipeline = fusedpc.FusedPipeline(_network_tree(optax.sgd(1.0)), _no_loss_error)
    x, t = normal(0, (6, 4)), normal(1, (6, 3))
    pipeline.step(x, t)
    before = host_leaves(pipeline.state.parts[1].params)
    pipeline.step(x, t * 3e19)
    assert bool(pipeline.last_metrics.committed) and pipeline.skipped_steps == 0
    after = host_leaves(pipeline.state.parts[1].params)
    assert max(float(np.abs(a).max()) for a in after) > 1e19  # past float32's squares
    row = pipeline.report()[0]
    assert row["finite"] and np.isfinite(row["weight_norm"])
    weight = np.sqrt(sum(np.sum(np.square(a.astype(np.float64))) for a in after))
    update = np.sqrt(sum(np.sum(np.square(a.astype(np.float64) - b))
                         for a, b in zip(after, before, strict=True)))
    np.testing.assert_allclose(row["weight_norm"], weight, rtol=1e-5)
    np.testing.assert_allclose(row["update_norm"], update, rtol=1e-5)


@pytest.mark.parametrize("precision", [1e20, 1e30])
def test_large_fixed_precisions_train_as_at_unit_precision(precision):
    # Reliability III: fixed hidden precisions of 1e20 and 1e30 (valid float32 values) had
    # every step refused ("non-finite", part 'precisions[...]'): the float32 sum of squares
    # of the state leaf overflowed. In the parity setting the step does not depend on the
    # hidden precisions, so the run equals the one at unit precision.
    def pipeline(p: float) -> fusedpc.FusedPipeline:
        network = fusedpc.PCNetwork([4, 8, 8, 3], "tanh", hidden_precision=p,
                                    key=jax.random.key(1))
        return fusedpc.FusedPipeline(fusedpc.LearningNetwork(network, optax.adam(1e-2)))

    x, t = normal(0, (6, 4)), normal(1, (6, 3))
    large, unit = pipeline(precision), pipeline(1.0)
    losses = []
    for _ in range(5):
        large.step(x, t)
        unit.step(x, t)
        assert bool(large.last_metrics.committed), large.skip_reason()
        losses.append(large.last_loss)
    assert large.skipped_steps == 0 and large.report()[0]["finite"]
    assert losses[-1] < losses[0]
    for a, b in zip(host_leaves(large.state.params), host_leaves(unit.state.params),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _raised_after(pipeline, x, t) -> str:
    pipeline.step(x, t)  # not committed; the next call raises
    with pytest.raises(fusedpc.execution.NonFiniteStepError) as info:
        pipeline.step(x, t)
    return str(info.value)


def test_nonfinite_step_error_advises_by_kind_of_part():
    # Reliability III: a frozen part's formula going non-finite was advised "Lower that
    # part's learning rate", and a frozen part has none.
    x, t = normal(0, (6, 4)), normal(1, (6, 3))
    blows_up = fusedpc.Frozen(lambda params, x: (x, x), lambda params, x, e: e / (x * 0.0))
    frozen_first = fusedpc.FusedPipeline(
        fusedpc.Sequential([blows_up, fusedpc.LearningNetwork(
            fusedpc.PCNetwork([4, 5, 3], "tanh", key=jax.random.key(1)), optax.sgd(0.1))]),
        nonfinite="raise")
    message = _raised_after(frozen_first, x, t)
    assert "'parts[0]'" in message and "frozen (it has no learning rate)" in message, message
    assert "Lower that part's learning rate" not in message
    learning = fusedpc.FusedPipeline(_network_tree(optax.sgd(HUGE_RATE)), nonfinite="raise")
    message = _raised_after(learning, x, 10.0 * t)
    assert "'parts[1]'" in message and "Lower that part's learning rate" in message, message


def test_ignore_commits_an_overflowing_step_but_still_names_its_part():
    pipeline = fusedpc.FusedPipeline(
        _network_tree(optax.sgd(HUGE_RATE)), nonfinite="ignore"
    )
    pipeline.step(normal(0, (6, 4)), 10.0 * normal(1, (6, 3)))
    assert bool(pipeline.last_metrics.committed) and pipeline.skipped_steps == 0
    assert pipeline.nonfinite_part() == "parts[1]"
    assert pipeline.skip_reason() is None


# --------------------------------------------------------------------------- spike guards
def test_update_ratio_guard_refuses_a_spike_and_names_the_part():
    pipeline = fusedpc.FusedPipeline(
        _network_tree(optax.inject_hyperparams(optax.sgd)(learning_rate=SANE_RATE)),
        max_update_ratio=0.5,
    )
    x, t = normal(0, (6, 4)), normal(1, (6, 3))
    pipeline.step(x, t)
    assert pipeline.skip_reason() is None
    assert pipeline.report()[0]["update_ratio"] < 0.5
    _set_rates(pipeline, lambda key: 1e6)  # finite weights of ~1e6: a spike, not an overflow
    kept = host_leaves(pipeline.state)
    pipeline.step(x, t)
    assert_bitwise_equal(kept, pipeline.state)
    assert _agree(pipeline, "update ratio") == "parts[1]"
    assert pipeline.report()[0]["update_ratio"] > 0.5 and pipeline.report()[0]["finite"]
    assert "above max_update_ratio 0.5" in pipeline.skip_reason().message
    assert pipeline.skip_counts["update ratio"] == 1


def test_loss_spike_guard_refuses_a_spike_after_its_warm_up():
    pipeline = fusedpc.FusedPipeline(_network_tree(optax.sgd(SANE_RATE)), loss_spike=3.0)
    x, t = normal(0, (6, 4)), normal(1, (6, 3))
    spike = t + 100.0
    pipeline.step(x, spike)  # before the warm-up the guard lets anything finite through
    assert bool(pipeline.last_metrics.committed)
    for _ in range(fusedpc.execution._step_types.LOSS_SPIKE_WARMUP):
        pipeline.step(x, t)
    mean = pipeline.loss_mean
    assert mean is not None and np.isfinite(mean)
    kept = host_leaves(pipeline.state)
    pipeline.step(x, spike)
    assert_bitwise_equal(kept, pipeline.state)
    assert _agree(pipeline, "loss spike") == ""
    assert pipeline.skip_reason().part is None
    assert "exceeded loss_spike 3.0 times the running mean" in pipeline.skip_reason().message
    assert pipeline.loss_mean == mean  # a refused loss does not move the mean
    pipeline.step(x, t)
    assert bool(pipeline.last_metrics.committed)


def test_guards_skip_nothing_in_a_normal_run():
    tree = _network_tree(optax.adam(1e-2))
    pipeline = fusedpc.FusedPipeline(tree, max_update_ratio=0.1, loss_spike=2.0)
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(200, 8, 4)).astype(np.float32)
    targets = np.tanh(xs[..., :3] * 0.7).astype(np.float32)
    _, _, metrics = pipeline.run(xs, targets, keep_outputs=False)
    assert pipeline.skipped_steps == 0 and bool(np.all(np.asarray(metrics.committed)))
    losses = np.asarray(metrics.loss)
    assert losses[-20:].mean() < 0.5 * losses[:20].mean()  # and it trained


def test_guard_settings_are_checked():
    tree = _network_tree(optax.sgd(0.1))
    for name, value, message in [
        ("max_update_ratio", 0.0, "max_update_ratio: expected None or a finite number > 0"),
        ("max_update_ratio", float("nan"), "max_update_ratio: expected None or a finite"),
        ("loss_spike", 1.0, "loss_spike: expected None or a finite number > 1"),
        ("loss_spike", "2", "loss_spike: expected None or a number, got str"),
    ]:
        with pytest.raises((ValueError, TypeError), match=message):
            fusedpc.FusedPipeline(tree, **{name: value})
    with pytest.raises(ValueError, match="loss_spike: needs a loss"):
        fusedpc.FusedPipeline(tree, _no_loss_error, loss_spike=2.0)


def test_guard_counters_survive_a_checkpoint(tmp_path):
    tree = _network_tree(optax.inject_hyperparams(optax.sgd)(learning_rate=SANE_RATE))
    pipeline = fusedpc.FusedPipeline(tree, max_update_ratio=0.5, loss_spike=3.0)
    x, t = normal(0, (6, 4)), normal(1, (6, 3))
    for _ in range(3):
        pipeline.step(x, t)
    _set_rates(pipeline, lambda key: 1e6)
    pipeline.step(x, t)
    _set_rates(pipeline, lambda key: SANE_RATE)
    pipeline.save(tmp_path / "guard.fpc")
    other = fusedpc.FusedPipeline(tree, max_update_ratio=0.5, loss_spike=3.0)
    other.load(tmp_path / "guard.fpc")
    assert other.skip_counts == pipeline.skip_counts and other.skip_counts["update ratio"] == 1
    assert other.loss_mean == pipeline.loss_mean and other.steps == 4
    manifest = fusedpc.read_checkpoint_manifest(tmp_path / "guard.fpc")
    assert manifest["guard"]["loss_count"] == 3


def test_a_checkpoint_of_fusedpc_0_3_without_the_mask_count_loads(tmp_path):
    # fusedpc 0.3 counted four skip reasons; "invalid mask" (0.4) loads as 0 from its files.
    import json
    import zipfile

    tree = _network_tree(optax.inject_hyperparams(optax.sgd)(learning_rate=SANE_RATE))
    pipeline = fusedpc.FusedPipeline(tree, max_update_ratio=0.5)
    x, t = normal(0, (6, 4)), normal(1, (6, 3))
    pipeline.step(x, t)
    _set_rates(pipeline, lambda key: 1e6)
    pipeline.step(x, t)
    pipeline.save(tmp_path / "now.fpc")
    old = tmp_path / "v0.3.fpc"
    with zipfile.ZipFile(tmp_path / "now.fpc") as src, zipfile.ZipFile(old, "w") as dst:
        for name in src.namelist():
            data = src.read(name)
            if name == "manifest.json":
                manifest = json.loads(data)
                del manifest["guard"]["skips"]["invalid mask"]
                data = json.dumps(manifest).encode()
            dst.writestr(name, data)
    other = fusedpc.FusedPipeline(tree, max_update_ratio=0.5)
    other.load(old)
    assert other.skip_counts == pipeline.skip_counts
    assert other.skip_counts["invalid mask"] == 0 and other.skip_counts["update ratio"] == 1


# --------------------------------------------------------------------------- ids on device
VOCAB = 11


def test_device_ids_out_of_range_never_reach_the_state():
    pipeline = _gpt_pipeline(nonfinite="raise")
    x, t = _gpt_batch(1)
    pipeline.step(x, t)
    for bad, shown in ((VOCAB, VOCAB), (-1, -1)):
        ids = jnp.asarray(x).at[1, 2].set(bad)  # on the device: no host check
        kept = host_leaves(pipeline.state)
        pipeline.step(ids, t)
        assert_bitwise_equal(kept, pipeline.state)
        skip = pipeline.skip_reason()
        assert (skip.reason, skip.part) == ("token id out of range", "token")
        assert pipeline.nonfinite_part() is None
        with pytest.raises(fusedpc.InputRangeError) as raised:
            pipeline.step(x, t)  # the next call raises, and runs nothing
        message = str(raised.value)
        assert f"x: token ids must lie in [0, {VOCAB}) (part 'token'), got {shown}" in message
        assert "the state was kept" in message.lower()
    assert pipeline.skip_counts["id out of range"] == 2
    ids = jnp.asarray(np.stack([x] * 2)).at[1, 0, 0].set(VOCAB + 3)
    pipeline.run(ids, np.stack([t] * 2))
    assert pipeline.skip_reason(0) is None
    assert pipeline.skip_reason(1).message.startswith("xs: token ids must lie in [0, 11)")


def test_device_class_ids_out_of_range_refuse_the_step():
    tree = fusedpc.Sequential([frozen.linear(jnp.eye(3)), frozen.relu()])
    pipeline = fusedpc.FusedPipeline(tree, "softmax_cross_entropy", nonfinite="raise")
    x = np.ones((4, 3), np.float32)
    pipeline.step(x, jnp.asarray([0, 1, 2, 3], jnp.int32))
    assert pipeline.skip_reason().reason == "class id out of range"
    with pytest.raises(fusedpc.InputRangeError, match=r"target: class ids must lie in \[0, 3\)"):
        pipeline.step(x, np.array([0, 1, 2, 2], np.int32))


def test_predict_marks_out_of_range_ids_without_a_sync_and_checks_on_request():
    pipeline = _gpt_pipeline()
    x, _ = _gpt_batch(2)
    bad = jnp.asarray(x).at[0, 3].set(VOCAB + 1)
    y = np.asarray(pipeline.predict(bad))
    assert np.isnan(y[0, 3]).all()  # the bad position (and the sequence it is in: its key
    assert np.isfinite(y[1:]).all()  # is NaN in every query's scores); no other sequence
    checked = fusedpc.FusedPipeline(pipeline.tree, "softmax_cross_entropy", check_device_ids=True)
    with pytest.raises(ValueError, match=r"<root>: token ids must lie in \[0, 11\), got 12"):
        checked.predict(bad)  # read back before the call: the documented transfer
    y_checked, checks = jax.jit(pipeline.program.checked_predict)(pipeline.state, bad)
    assert [bool(c.ok) for c in checks] == [False] and int(checks[0].high) == VOCAB + 1
    np.testing.assert_array_equal(np.asarray(y_checked), y)


def test_a_program_inside_a_users_jit_refuses_bad_ids_too():
    pipeline = _gpt_pipeline()
    program = pipeline.program
    carry = program.init(jax.random.key(0))
    x, t = _gpt_batch(3)
    step = jax.jit(program.step)
    carry, out = step(carry, jnp.asarray(x).at[0, 0].set(-5), t)
    assert int(out.metrics.skip_reason) == 1 and int(carry.counters.skips[0]) == 1
    low = int(out.metrics.input_checks[0].low)
    assert low == -5


def test_counters_built_the_old_way_still_work():
    counters = fusedpc.execution.Counters(jnp.int32(5), jnp.int32(2))
    # the second count is "invalid mask" (fusedpc 0.4): a skipped count counts as non-finite
    assert np.asarray(counters.skips).tolist() == [0, 0, 2, 0, 0]
    assert int(counters.loss_count) == 0
    assert isinstance(eqx.filter(counters, eqx.is_array), fusedpc.execution.Counters)
